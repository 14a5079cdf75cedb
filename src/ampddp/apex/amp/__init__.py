"""``apex.amp`` on ampddp: the same functions as ``ampddp.amp`` (one default set-up shared by both
import paths), plus what only apex-era code uses: the legacy ``amp.init()`` handle API and the
``_amp_state`` view that apex's tests and many scripts read (``_amp_state.loss_scalers[0].loss_scale()``).

Code that feature-detects apex by its namespace (timm: ``'state_dict' in amp.__dict__``) finds
apex's names here as module attributes.
"""

from __future__ import annotations

from typing import Any

from ampddp.amp import (
    Amp,
    bfloat16_function,
    disable_casts,
    end_casts,
    float_function,
    forward_context,
    grad_scaler_state_dict,
    half_function,
    initialize,
    load_state_dict,
    master_params,
    promote_function,
    register_bfloat16_function,
    register_float_function,
    register_half_function,
    register_promote_function,
    scale_loss,
    state_dict,
)
from ampddp.apex._names import unknown_name
from ampddp.apex.amp._amp_state import _amp_state
from ampddp.apex.amp.handle import AmpHandle, NoOpHandle, init

__all__ = [
    "Amp",
    "AmpHandle",
    "NoOpHandle",
    "_amp_state",
    "bfloat16_function",
    "disable_casts",
    "end_casts",
    "float_function",
    "forward_context",
    "grad_scaler_state_dict",
    "half_function",
    "init",
    "initialize",
    "load_state_dict",
    "master_params",
    "promote_function",
    "register_bfloat16_function",
    "register_float_function",
    "register_half_function",
    "register_promote_function",
    "scale_loss",
    "state_dict",
]

REPLACEMENTS = {
    "LossScaler": "ampddp.LossScaler (apex.amp's scaler class was internal; amp.state_dict() holds its state)",
    "opt": "amp.initialize(...) with amp.scale_loss (apex's amp.opt OptimWrapper is the legacy handle.wrap_optimizer)",
    "rnn_compat": "nothing: torch's RNNs are cast by the O1 lists directly",
}


def __getattr__(name: str) -> Any:
    raise unknown_name(__name__, name, REPLACEMENTS, __all__)
