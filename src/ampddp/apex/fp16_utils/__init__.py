"""apex.fp16_utils: pre-amp "manual mixed precision" (FP16_Optimizer, network_to_half, ...) on native torch.

apex removed this package together with amp; scripts written against it
(``from apex.fp16_utils import *``, ``FP16_Optimizer(opt, dynamic_loss_scale=True)``) run here
unchanged. ``FP16_Optimizer`` is built on ampddp's O2 master-weight machinery, so it matches
``build_engine("O2")`` step for step; the helpers keep apex's semantics (see each submodule).
``import *`` gives exactly the names apex's ``__init__`` exported.
"""

from __future__ import annotations

from typing import Any

from ampddp.apex._names import unknown_name
from ampddp.apex.fp16_utils.fp16_optimizer import FP16_Optimizer
from ampddp.apex.fp16_utils.fp16util import (
    BN_convert_float,
    FP16Model,
    clip_grad_norm,
    convert_module,
    convert_network,
    master_params_to_model_params,
    model_grads_to_master_grads,
    network_to_half,
    prep_param_lists,
    to_python_float,
    tofp16,
)
from ampddp.apex.fp16_utils.loss_scaler import DynamicLossScaler, LossScaler

__all__ = [
    "BN_convert_float",
    "network_to_half",
    "prep_param_lists",
    "model_grads_to_master_grads",
    "master_params_to_model_params",
    "tofp16",
    "to_python_float",
    "clip_grad_norm",
    "convert_module",
    "convert_network",
    "FP16Model",
    "FP16_Optimizer",
    "LossScaler",
    "DynamicLossScaler",
]
REPLACEMENTS = {
    "FP16_Module": "apex.fp16_utils.FP16Model (or network_to_half); FP16_Module left apex in 2018",
    "fp32_to_fp16": "tensor.half(), or ampddp.precision.casting.cast_floating(obj, torch.float16) for nested inputs",
    "fp16_to_fp32": "tensor.float(), or ampddp.precision.casting.cast_floating(obj, torch.float32) for nested outputs",
    "Fused_Weight_Norm": "torch.nn.utils.parametrizations.weight_norm",
    "fused_weight_norm": "torch.nn.utils.parametrizations.weight_norm",
}


def __getattr__(name: str) -> Any:
    raise unknown_name(__name__, name, REPLACEMENTS, __all__)
