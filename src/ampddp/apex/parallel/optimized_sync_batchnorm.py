"""apex.parallel.optimized_sync_batchnorm: apex's path for its CUDA-extension SyncBatchNorm.

apex chose between ``sync_batchnorm`` (Python fallback) and ``optimized_sync_batchnorm`` (CUDA
extension, with channel_last and fuse_relu) at import time. ampddp has one implementation, which
does both on any backend; this path re-exports it so imports written against either module work.
"""

from __future__ import annotations

from typing import Any

from ampddp.apex._names import unknown_name
from ampddp.apex.parallel.sync_batchnorm import REPLACEMENTS, SyncBatchNorm

__all__ = ["SyncBatchNorm"]


def __getattr__(name: str) -> Any:
    raise unknown_name(__name__, name, REPLACEMENTS, __all__)
