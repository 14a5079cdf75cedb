"""apex's public module paths on native torch, for code written against NVIDIA apex.

``from ampddp.apex import amp`` / ``from ampddp.apex.parallel import DistributedDataParallel`` /
``from ampddp.apex.optimizers import FusedAdam`` ... give apex's names and signatures built on
ampddp's parts and torch, on any device. ``python -m ampddp.apex script.py`` runs an unchanged
script with ``import apex`` resolving here. Submodules load on first use, as attributes too
(``import apex; apex.amp.initialize(...)``).
"""

from __future__ import annotations

import importlib
from typing import Any

from ampddp.apex._names import unknown_name

__version__ = "0.1"
"""The version every apex build reports (its setup.py never changed it): what apex-era version checks read."""
SUBMODULES = ("amp", "parallel", "fp16_utils", "optimizers", "normalization", "multi_tensor_apply")
REPLACEMENTS = {
    "contrib": "the torch equivalents (apex.contrib's extensions are not provided): torch.nn.functional.cross_entropy "
    "for xentropy, torch.nn.functional.group_norm for group_norm, torch.optim for its optimizers",
    "transformer": "torch.distributed (tensor/pipeline parallel) or Megatron-Core; apex.transformer is not provided",
    "RNN": "torch.nn.LSTM / nn.GRU (apex.RNN was removed with amp)",
    "reparameterization": "torch.nn.utils.parametrizations.weight_norm",
    "mlp": "a torch.nn.Sequential of nn.Linear layers",
    "fused_dense": "torch.nn.Linear (cuBLAS fuses the bias on CUDA)",
}


def __getattr__(name: str) -> Any:
    if name in SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise unknown_name(__name__, name, REPLACEMENTS, list(SUBMODULES))


def __dir__() -> list[str]:
    return sorted([*globals(), *SUBMODULES])
