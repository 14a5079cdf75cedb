"""apex's ``apex.normalization`` (FusedLayerNorm, FusedRMSNorm and their Mixed* forms) on native torch norms.

apex's versions needed its ``fused_layer_norm_cuda`` extension and CUDA tensors; these are
``nn.LayerNorm`` / ``nn.RMSNorm`` subclasses on ``torch.nn.functional.layer_norm`` / ``rms_norm``
that run on any device with apex's signatures, defaults and output dtypes. See
:mod:`ampddp.apex.normalization.fused_layer_norm` for the functional forms and the dtype rules.
"""

from __future__ import annotations

from typing import Any

from ampddp.apex._names import unknown_name
from ampddp.apex.normalization.fused_layer_norm import REPLACEMENTS as _NORM_REPLACEMENTS
from ampddp.apex.normalization.fused_layer_norm import FusedLayerNorm, FusedRMSNorm, MixedFusedLayerNorm, MixedFusedRMSNorm

__all__ = ["FusedLayerNorm", "FusedRMSNorm", "MixedFusedLayerNorm", "MixedFusedRMSNorm", "fused_layer_norm"]

REPLACEMENTS = {
    **_NORM_REPLACEMENTS,
    "fused_layer_norm_affine": "from apex.normalization.fused_layer_norm import fused_layer_norm_affine",
    "fused_rms_norm_affine": "from apex.normalization.fused_layer_norm import fused_rms_norm_affine",
    "fused_rms_norm": "from apex.normalization.fused_layer_norm import fused_rms_norm",
}


def __getattr__(name: str) -> Any:
    raise unknown_name(__name__, name, REPLACEMENTS, __all__)
