"""apex.parallel.distributed: DistributedDataParallel, Reducer and flat_dist_call under apex's path.

The implementation is ampddp's own apex-style DDP (``ampddp.distributed.apex_ddp``, also behind
``strategy: apex-ddp``); this module gives it apex's import path and apex's errors for the names it
does not provide.
"""

from __future__ import annotations

from typing import Any

from ampddp.apex._names import unknown_name
from ampddp.distributed.apex_ddp import DistributedDataParallel, Reducer, flat_dist_call

__all__ = ["DistributedDataParallel", "Reducer", "flat_dist_call"]

REPLACEMENTS = {
    "apply_flat_dist_call": "flat_dist_call(tensors, call, extra_args) (it groups tensors by dtype itself)",
    "split_by_type": "flat_dist_call (it groups tensors by dtype and device itself)",
    "split_half_float_double": "flat_dist_call (it groups tensors by dtype and device itself)",
    "flatten": "torch.cat([t.reshape(-1) for t in tensors]) (apex's C++ flatten is not needed)",
    "unflatten": "torch.split(flat, [t.numel() for t in tensors]) viewed back with .view_as(t)",
    "extract_tensors": "Reducer(list_of_tensors), which collects tensors from nested iterables itself",
}


def __getattr__(name: str) -> Any:
    raise unknown_name(__name__, name, REPLACEMENTS, __all__)
