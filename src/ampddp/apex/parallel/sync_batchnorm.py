"""apex.parallel.sync_batchnorm: SyncBatchNorm under apex's path.

The implementation is ampddp's own apex-style SyncBatchNorm (``ampddp.distributed.apex_sync_bn``, also
behind ``sync_bn: apex``); this module gives it apex's import path and apex's errors for the names it
does not provide.
"""

from __future__ import annotations

from typing import Any

from ampddp.apex._names import unknown_name
from ampddp.distributed.apex_sync_bn import SyncBatchNorm

__all__ = ["SyncBatchNorm"]

REPLACEMENTS = {
    "SyncBatchnormFunction": "the module SyncBatchNorm (its autograd function is internal)",
    "ReduceOp": "torch.distributed.ReduceOp",
}


def __getattr__(name: str) -> Any:
    raise unknown_name(__name__, name, REPLACEMENTS, __all__)
