"""The private torch APIs ampddp relies on, each behind a probe that names what is missing.

Private names move between torch releases; a module here fails at the call that needs it, with one
line naming the torch version and what to do instead, rather than deep inside a training step.
"""

from __future__ import annotations

import re
import sys
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from ampddp.errors import UnsupportedTorchError

MIN_TORCH = (2, 10)
"""The oldest torch release ampddp supports (setup.py says the same); CI runs it and the newest."""


def torch_release(version: str) -> tuple[int, int]:
    """(major, minor) of a torch version string; pre-releases and local builds count as their release
    (NGC's ``2.10.0a0+b4e4ee8`` is 2.10)."""
    found = re.match(r"(\d+)\.(\d+)", version)
    if found is None:
        raise UnsupportedTorchError(f"cannot read the torch version {version!r}; ampddp needs torch >= {MIN_TORCH[0]}.{MIN_TORCH[1]}")
    return int(found.group(1)), int(found.group(2))


def require_supported_torch(version: str | None = None) -> None:
    """Refuse, in one line naming the version needed, a torch older than :data:`MIN_TORCH`.

    Run when this module is imported, which every part of ampddp that uses torch does, so an old
    cluster image fails at start rather than inside a training step."""
    version = str(torch.__version__) if version is None else version
    if torch_release(version) < MIN_TORCH:
        needed = f"{MIN_TORCH[0]}.{MIN_TORCH[1]}"
        raise UnsupportedTorchError(f"ampddp needs torch >= {needed}, this environment has torch {version}: pip install 'torch>={needed}'")


require_supported_torch()

DDP_REBUILD_METHODS = ("_build_params_for_reducer", "_build_debug_param_to_name_mapping", "_ddp_init_helper")
"""What torch's own ``DistributedDataParallel.__setstate__`` calls to build a reducer for an existing wrapper."""


def ddp_rebuild_problem(wrapper: DistributedDataParallel) -> str | None:
    """Why ``rebuild_ddp_reducer`` cannot rebuild ``wrapper`` faithfully on this torch, or None when it can."""
    missing = [name for name in DDP_REBUILD_METHODS if not callable(getattr(wrapper, name, None))]
    if missing:
        return f"torch {torch.__version__} lacks DistributedDataParallel.{', '.join(missing)}"
    if getattr(wrapper, "mixed_precision", None) is not None:
        return "it was built with DDP's own mixed_precision"
    if getattr(wrapper, "_delay_all_reduce_params", None):
        return "it was built with delay_all_reduce_named_params"
    if any(hasattr(param, "_in_backward_optimizers") for param in wrapper.module.parameters()):
        return "an optimizer runs in its backward"
    hook_name = logged_comm_hook(wrapper)
    if hook_name and not getattr(wrapper, "_comm_hooks", None):
        return f"its built-in communication hook {hook_name} cannot be read back to register again"
    return None


def logged_comm_hook(wrapper: DistributedDataParallel) -> str:
    """The communication hook DDP's logger recorded (built-in hooks leave no other trace), or ''."""
    try:
        return str(wrapper._get_ddp_logging_data().get("comm_hook", "") or "")
    except (AttributeError, RuntimeError):
        return ""


def rebuild_ddp_reducer(wrapper: DistributedDataParallel) -> None:
    """Build ``wrapper``'s gradient buckets and hooks anew for its module's current parameters.

    DDP hooks each parameter's gradient accumulator when it is built; changing a parameter's dtype in
    place (an opt level's model cast) replaces that accumulator, so the old hooks never fire and no
    gradient is all-reduced. This repeats what torch does when it unpickles a wrapper, then re-registers
    the wrapper's communication hooks (apex's pre/post division, fp32 reduction).
    """
    problem = ddp_rebuild_problem(wrapper)
    if problem is not None:
        raise UnsupportedTorchError(
            f"cannot re-hook this DistributedDataParallel built before the model's parameters changed dtype ({problem}); "
            "call amp.initialize / the precision set-up before wrapping the model in DDP"
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


# ---- device autocast in a form dynamo records (device_autocast.py) -------------------------------


AUTOCAST_CACHE_SAFE = torch_release(str(torch.__version__)) >= (2, 11)
"""torch 2.10's autocast cache hands a weight cast made under ``no_grad`` to a later use with grad
enabled in the same region, so that use gets no ``grad_fn`` and the weight silently loses that part of
its gradient. There ampddp's autocast regions do not cache (each op casts the weights it uses)."""


def enter_autocast(device_type: str, dtype: torch.dtype | None, enabled: bool) -> Any:
    """Enter device autocast as ``torch.autocast`` does, through the function dynamo records as a
    graph node even when the matching exit runs in another function."""
    return torch.amp._enter_autocast(device_type, dtype, enabled, None if AUTOCAST_CACHE_SAFE else False)


def exit_autocast(mode: Any) -> None:
    """Leave what :func:`enter_autocast` entered."""
    torch.amp._exit_autocast(mode)


SPLIT_AUTOCAST_IN_GRAPHS = torch_release(str(torch.__version__)) >= (2, 14)
"""Whether dynamo records an autocast entered in one function and left in another (a model's forward
hooks) as graph nodes. Before 2.14 it either changes the real autocast state while tracing or hands
AOTAutograd a graph that leaves autocast entered; there dynamo runs both calls as plain Python
(``torch.compiler.disable``), and traces what runs between them under the autocast they set (measured:
still one graph for a compiled training step on 2.12 and 2.13)."""

if not SPLIT_AUTOCAST_IN_GRAPHS:
    enter_autocast = torch.compiler.disable(enter_autocast)
    exit_autocast = torch.compiler.disable(exit_autocast)


# ---- the torch-function mode stack (cast_context.py) ---------------------------------------------


def pop_function_mode() -> Any:
    """Take the top mode off this thread's torch-function mode stack (``torch.overrides`` keeps no public pop)."""
    return torch._C._pop_torch_function_stack()


def push_function_mode(mode: Any) -> None:
    """Put ``mode`` on top of this thread's torch-function mode stack without entering it as a context."""
    torch._C._push_on_torch_function_stack(mode)


def function_mode_depth() -> int:
    """How many torch-function modes are on this thread's stack."""
    return torch._C._len_torch_function_stack()


# ---- the dispatcher (aten_casts.py) ---------------------------------------------------------------


def dispatcher_op_names() -> frozenset[str]:
    """Every op the dispatcher knows (``torch.ops.aten`` also lists TorchScript-only overloads)."""
    return frozenset(torch._C._dispatch_get_all_op_names())


def has_kernel_for_key(op_name: str, key: str) -> bool:
    """Whether ``op_name`` has a kernel registered on dispatch key ``key`` (e.g. ``AutocastCPU``)."""
    return torch._C._dispatch_has_kernel_for_dispatch_key(op_name, key)


def excluding_key(key: str) -> Any:
    """A context that skips dispatch key ``key`` for the ops run inside it, as torch's own autocast kernels do."""
    below = torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, key))
    return torch._C._ExcludeDispatchKeyGuard(below)


# ---- activation checkpointing (casting/recompute.py) ----------------------------------------------


CHECKPOINT_RECOMPUTE_CLASSES = ("CheckpointFunction", "_CheckpointFrame")
"""The classes of ``torch.utils.checkpoint`` that keep what a checkpoint recomputes: the reentrant
variant's autograd Function (``ctx.run_function``) and the non-reentrant variant's frame (its first
argument, ``recompute_fn``); each is looked up in the module whenever a checkpoint is taken."""


def checkpoint_recompute_classes() -> dict[str, type]:
    """Those of :data:`CHECKPOINT_RECOMPUTE_CLASSES` this torch has, by name."""
    import torch.utils.checkpoint as checkpoint

    found = {name: getattr(checkpoint, name, None) for name in CHECKPOINT_RECOMPUTE_CLASSES}
    return {name: cls for name, cls in found.items() if isinstance(cls, type)}


# ---- dynamo (compile_support.py, compile_model.py) -------------------------------------------------


def run_as_plain_python_under_compile(*functions: Any) -> None:
    """Make dynamo run ``functions`` as plain Python when it meets them as frames of their own (it still
    inlines them into a caller's graph): a per-code-object setting every supported torch has."""
    from torch._dynamo.eval_frame import FrameAction, FrameExecStrategy, set_code_exec_strategy

    eager = FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP)
    for function in functions:
        set_code_exec_strategy(function.__code__, eager)


def compile_backends() -> tuple[list[str], list[str]]:
    """(every registered torch.compile backend, the ones listed by default)."""
    import torch._dynamo

    return sorted(torch._dynamo.list_backends(exclude_tags=())), sorted(torch._dynamo.list_backends())


# ---- DataLoader workers (training/loading.py) -----------------------------------------------------


def loader_worker_shutdown(iterator: Any) -> Any:
    """The iterator's method that stops its worker processes, or None (a plain iterable, or a torch without it)."""
    return getattr(iterator, "_shutdown_workers", None)


def detach_persistent_workers(loader: Any) -> Any:
    """Detach and return the iterator a ``persistent_workers`` DataLoader keeps (and its workers), or None."""
    iterator = getattr(loader, "_iterator", None)
    if iterator is not None:
        loader._iterator = None
    return iterator


# ---- GradScaler's verdict (precision/native.py) ---------------------------------------------------------


def grad_scaler_found_infs(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> dict[torch.device, torch.Tensor]:
    """The per-device non-finite flags ``scaler.unscale_(optimizer)`` left for its ``step`` (skip or not) and ``update``
    (back off or not) to read: written into, they change both decisions. GradScaler keeps them private."""
    states = getattr(scaler, "_per_optimizer_states", None)
    found = states.get(id(optimizer), {}).get("found_inf_per_device") if isinstance(states, dict) else None
    if not isinstance(found, dict):
        raise UnsupportedTorchError(
            f"torch {torch.__version__}'s GradScaler keeps no per-device found_inf flags after unscale_ (ampddp reads "
            "_per_optimizer_states[id(optimizer)]['found_inf_per_device']), so native-fp16 cannot agree its loss-scale verdict "
            "across ranks here: use opt level O1 (float16 ops, the same dynamic loss scale) or a torch ampddp supports"
        )
    return found


# ---- DTensor, asked about without importing it -----------------------------------------------------------


def is_dtensor(value: object) -> bool:
    """Whether ``value`` is a DTensor, without importing ``torch.distributed.tensor`` (0.7 s, sympy
    included, for a one-process run that holds none): no DTensor exists before that module is imported."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(value, module.DTensor)


def casts_before_gathers(module: Any) -> bool:
    """Whether ``module`` is torchao's fp8 linear layer (told without importing torchao) with one scale per tensor for
    its inputs, weights and output gradients (tensorwise): what torchao's tensor-parallel styles need to cast activations
    to fp8 before they are exchanged."""
    if type(module).__name__ != "Float8Linear" or not type(module).__module__.startswith("torchao"):
        return False
    casts = (module.config.cast_config_input, module.config.cast_config_weight, module.config.cast_config_grad_output)
    return all(cast.scaling_type.value == "dynamic" and cast.scaling_granularity.value == "tensorwise" for cast in casts)


# ---- compiled graphs under a split backward ---------------------------------------------------------------


def graphs_kept_between_backwards() -> Any:
    """A context in which blocks compiled meanwhile keep their graph's buffers: torch's zero-bubble pipeline schedules
    run each backward in two parts (the inputs' gradients, later the weights'), keeping the graph between them
    (``retain_graph``), which a backward aot_autograd compiled with donated buffers refuses. Private config (torch
    2.6+); scoped: graphs compiled outside it keep torch's default."""
    from torch._functorch import config

    return config.patch(donated_buffer=False)


ZBV_TORCH = (2, 14)
"""The oldest torch ZBVZeroBubble, and compiled blocks under a zero-bubble schedule, were measured to run on (2.10 sends
between the two stages one rank holds, which gloo refuses: "Pair is not connected"; and its weight-gradient pass reads
``_input_metadata`` of a compiled block's backward, which it refuses); releases between were not measured."""


def _before_zero_bubble_torch(version: str | None) -> str | None:
    """``version`` (default: this torch's) where it is older than :data:`ZBV_TORCH`, else None."""
    version = str(torch.__version__) if version is None else version
    return version if torch_release(version) < ZBV_TORCH else None


def zbv_schedule_problem(version: str | None = None) -> str | None:
    """Why torch's ZBVZeroBubble schedule cannot run here, or None when it can."""
    older = _before_zero_bubble_torch(version)
    return older and (
        f"pp_schedule=ZBVZeroBubble needs torch >= {ZBV_TORCH[0]}.{ZBV_TORCH[1]} (on torch {older} a rank sends to itself "
        "between its two stages and gloo refuses); use InterleavedZeroBubble or Interleaved1F1B, or a newer torch"
    )


def compiled_split_backward_problem(version: str | None = None) -> str | None:
    """Why blocks compiled by torch.compile cannot run under a zero-bubble schedule here, or None when they can."""
    older = _before_zero_bubble_torch(version)
    return older and (
        f"trainer.compile under a zero-bubble pipeline schedule needs torch >= {ZBV_TORCH[0]}.{ZBV_TORCH[1]} (torch {older}'s "
        "weight-gradient pass cannot read a compiled block's backward); leave compile off, use Interleaved1F1B or 1F1B, or a "
        "newer torch"
    )
