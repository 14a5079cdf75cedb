"""``sync_bn``: one converter for torch's SyncBatchNorm, apex's and ampddp's portable one.

Each implementation is a converter in one table; ``auto`` picks torch's on CUDA (its kernels) and the
portable one elsewhere (torch's refuses to run off CUDA). ``apex`` is NVIDIA apex's converter where an
apex build that still has ``apex.parallel`` (25.04 or older) is installed, ampddp's apex-style one
everywhere else.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import torch
from torch import nn

from ampddp.choices import SYNC_BN_IMPLS
from ampddp.distributed.apex_sync_bn import convert_syncbn_model
from ampddp.distributed.installed_apex import installed_apex_parallel
from ampddp.distributed.portable_sync_bn import convert_portable_syncbn
from ampddp.errors import choice_error

Converter = Callable[[nn.Module, Any], nn.Module]
"""``convert(module, process_group)`` -> the module with its BatchNorms synchronised."""


def _convert_apex(module: nn.Module, process_group: Any) -> nn.Module:
    convert = installed_apex_parallel("convert_syncbn_model") or convert_syncbn_model
    return convert(module, process_group=process_group)


CONVERTERS: Mapping[str, Converter] = MappingProxyType(
    {"torch": nn.SyncBatchNorm.convert_sync_batchnorm, "apex": _convert_apex, "portable": convert_portable_syncbn}
)
"""Every implementation but ``auto`` (which resolves to one of them)."""


def resolve_sync_bn(impl: str, device: torch.device) -> str:
    """The implementation ``impl`` means for a model that trains on ``device``: ``auto`` is torch's
    SyncBatchNorm on CUDA and the portable one elsewhere; the others are themselves."""
    if impl not in SYNC_BN_IMPLS:
        raise choice_error("sync_bn impl", impl, SYNC_BN_IMPLS)
    if impl != "auto":
        return impl
    return "torch" if device.type == "cuda" else "portable"


def _module_device(module: nn.Module) -> torch.device:
    """Where ``module`` lives: CUDA when any parameter does (or, without parameters, when CUDA is available)."""
    params = list(module.parameters())
    on_cuda = any(p.is_cuda for p in params) or (not params and torch.cuda.is_available())
    return torch.device("cuda" if on_cuda else "cpu")


def convert_sync_batchnorm(
    module: nn.Module, impl: str = "auto", process_group: Any = None, device: torch.device | None = None
) -> nn.Module:
    """Replace every BatchNorm (not InstanceNorm) with a synchronised one; params and stats are kept.

    ``impl``: ``torch`` (nn.SyncBatchNorm, CUDA only), ``apex`` (apex's converter: NVIDIA's from an old
    apex build, else ampddp's apex-style one),
    ``portable`` (any backend) or ``auto`` (torch's on CUDA, portable elsewhere; ``device``: where
    the model will train, by default where its parameters are now).
    """
    chosen = resolve_sync_bn(impl, device if device is not None else _module_device(module))
    return CONVERTERS[chosen](module, process_group)
