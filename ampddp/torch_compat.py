"""The private torch APIs ampddp relies on, each behind a probe that names what is missing.

Private names move between torch releases; a module here fails at the call that needs it, with one
line naming the torch version and what to do instead, rather than deep inside a training step.
"""

from __future__ import annotations

import torch
from torch.nn.parallel import DistributedDataParallel

DDP_REBUILD_METHODS = ("_build_params_for_reducer", "_build_debug_param_to_name_mapping", "_ddp_init_helper")
"""What torch's own ``DistributedDataParallel.__setstate__`` calls to build a reducer for an existing wrapper."""


class UnsupportedTorchError(RuntimeError):
    """This torch release lacks an internal API the requested feature needs; the message says what to do instead."""


def rebuild_ddp_reducer(wrapper: DistributedDataParallel) -> None:
    """Build ``wrapper``'s gradient buckets and hooks anew for its module's current parameters.

    DDP hooks each parameter's gradient accumulator when it is built; changing a parameter's dtype in
    place (an opt level's model cast) replaces that accumulator, so the old hooks never fire and no
    gradient is all-reduced. This repeats what torch does when it unpickles a wrapper, then re-registers
    the wrapper's communication hooks (apex's pre/post division, fp32 reduction).
    """
    missing = [name for name in DDP_REBUILD_METHODS if not callable(getattr(wrapper, name, None))]
    if missing or getattr(wrapper, "mixed_precision", None) is not None:
        reason = f"lacks {', '.join(missing)}" if missing else "cannot rebuild a wrapper built with DDP's own mixed_precision"
        raise UnsupportedTorchError(
            f"torch {torch.__version__} {reason}, needed to re-hook a DistributedDataParallel built before the model's "
            "parameters changed dtype; call amp.initialize / the precision set-up before wrapping the model in DDP"
        )
    comm_hooks = list(getattr(wrapper, "_comm_hooks", ()))
    parameters, expect_sparse = wrapper._build_params_for_reducer()
    names = wrapper._build_debug_param_to_name_mapping(parameters)
    wrapper._ddp_init_helper(parameters, expect_sparse, names, wrapper.static_graph)
    if wrapper.static_graph:
        wrapper.reducer._set_static_graph()
        wrapper.logger._set_static_graph()
    wrapper._comm_hooks = []
    for hook, state in comm_hooks:
        wrapper.register_comm_hook(state, hook)
