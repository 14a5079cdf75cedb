"""apex's DistributedDataParallel and Reducer (``strategy: apex-ddp``), built on torch's DDP.

apex deleted ``apex.parallel`` in May 2025, and torch's DDP cannot stand in for it: apex-era scripts
call ``DDP(model, delay_allreduce=True)`` and torch answers ``unexpected keyword argument``. Here
every apex argument is honoured through torch DDP (bucket size, a single end-of-backward bucket, a
communication hook doing apex's pre/post division and fp32 reduction, gradients kept as views of
the reduction buffers) or refused with a :class:`~ampddp.errors.ConfigError` that says why and what
to pass instead. Works on CPU/gloo and CUDA/NCCL alike. ``ampddp.apex.parallel`` gives these classes
their apex import paths.
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.profiler import record_function

from ampddp.distributed.hook_callbacks import HookCallbacks
from ampddp.errors import ConfigError

__all__ = ["DistributedDataParallel", "Reducer", "flat_dist_call"]

_LOW_PRECISION = (torch.float16, torch.bfloat16)
_PROFILE_PREFIX = "apex.parallel.DistributedDataParallel"


def _require_initialized(what: str) -> None:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"{what} needs torch.distributed to be initialized: call torch.distributed.init_process_group(backend=...) "
            "(or ampddp.distributed.setup_distributed / launch with torchrun) before constructing it"
        )


def _grouped(tensors: Iterable[torch.Tensor]) -> Iterator[list[torch.Tensor]]:
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for tensor in tensors:
        groups.setdefault((tensor.dtype, tensor.device), []).append(tensor)
    return iter(groups.values())


def flat_dist_call(tensors: Iterable[torch.Tensor], call: Callable[..., Any], extra_args: tuple | None = None) -> None:
    """Run ``call(flat, *extra_args)`` once per dtype/device on the flattened tensors, copying results back.

    As apex: when ``call`` is ``torch.distributed.all_reduce`` the result is divided by the world size.
    """
    for bucket in _grouped(tensors):
        flat = torch.cat([t.detach().reshape(-1) for t in bucket])
        call(flat, *(extra_args or ()))
        if call is dist.all_reduce:
            flat /= dist.get_world_size()
        offset = 0
        with torch.no_grad():
            for tensor in bucket:
                tensor.copy_(flat[offset : offset + tensor.numel()].view_as(tensor))
                offset += tensor.numel()


def _collect_tensors(item: Any, found: list[torch.Tensor]) -> None:
    if torch.is_tensor(item):
        found.append(item)
    elif isinstance(item, Iterable) and not isinstance(item, (str, bytes)):
        for child in item:
            _collect_tensors(child, found)


class Reducer:
    """apex's manual all-reduce helper: nothing happens in backward; ``reduce()`` averages over processes.

    ``module_or_grads_list``: a module (its parameters are broadcast from rank 0 now, and ``reduce()``
    averages the gradients its parameters hold) or an iterable (possibly nested) of tensors that
    ``reduce()`` averages in place.
    """

    def __init__(self, module_or_grads_list: nn.Module | Iterable[Any]) -> None:
        _require_initialized("apex.parallel.Reducer")
        self.module: nn.Module | None = None
        self.grads: list[torch.Tensor] = []
        if isinstance(module_or_grads_list, nn.Module):
            self.module = module_or_grads_list
            flat_dist_call([p.data for p in self.module.parameters()], dist.broadcast, (0,))
        else:
            _collect_tensors(module_or_grads_list, self.grads)

    def reduce(self) -> None:
        """All-reduce and average the module's gradients (those that exist) or the given tensors."""
        if self.module is not None:
            flat_dist_call([p.grad.data for p in self.module.parameters() if p.grad is not None], dist.all_reduce)
        else:
            flat_dist_call(self.grads, dist.all_reduce)


class _HookState:
    """What the communication hook needs; one per wrapper."""

    def __init__(self, group: Any, predivide: float, average: bool, always_fp32: bool, retain: bool, prof: bool) -> None:
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.predivide = predivide
        self.average = average
        self.always_fp32 = always_fp32
        self.retain = retain
        self.prof = prof
        self.buffers: dict[int, torch.Tensor] = {}
        self.callbacks = HookCallbacks()


# No annotations on purpose: torch checks `bucket`'s annotation by identity, and this module's
# `from __future__ import annotations` would turn it into a string that fails that check.
def _apex_allreduce_hook(state, bucket):
    """apex's bucket math: optional fp32 copy, x 1/f, all-reduce (sum), x f/world when averaging."""
    profiled = record_function(f"{_PROFILE_PREFIX}.allreduce_bucket") if state.prof else contextlib.nullcontext()
    with profiled:
        buffer = bucket.buffer()
        tensor = buffer.float() if state.always_fp32 and buffer.dtype in _LOW_PRECISION else buffer
        if state.predivide != 1.0:
            tensor.mul_(1.0 / state.predivide)
        future = dist.all_reduce(tensor, group=state.group, async_op=True).get_future()
        if state.retain:
            if bucket.index() == 0:  # buckets are reduced in index order; 0 starts a new backward
                state.buffers.clear()
            state.buffers[bucket.index()] = buffer

    def finish(done):
        reduced = done.value()[0]
        if state.average:
            reduced.mul_(state.predivide / state.world_size)
        if reduced is not buffer:
            buffer.copy_(reduced)
        return buffer

    return state.callbacks.then(future, finish)


def _refuse(name: str, value: Any, why: str, instead: str) -> ConfigError:
    return ConfigError(f"apex.parallel.DistributedDataParallel({name}={value!r}) cannot be honoured on torch DDP: {why}; {instead}")


def _check_unsupported(shared_param: Any, allreduce_trigger_params: Any, num_allreduce_streams: Any, allreduce_communicators: Any) -> None:
    if shared_param is not None:
        raise _refuse(
            "shared_param", shared_param,
            "apex itself removed it (its DDP raised ValueError for any value but None; overlapping works with shared parameters)",
            "pass shared_param=None, or delay_allreduce=True to reduce only once backward has finished",
        )  # fmt: skip
    if allreduce_trigger_params is not None:
        raise _refuse(
            "allreduce_trigger_params", "<list of parameters>",
            "torch DDP forms its buckets by size in gradient-ready order and cannot start an all-reduce at chosen parameters",
            "pass allreduce_trigger_params=None and choose the bucket size with message_size=<elements> "
            "(gradients are the same either way; only the overlap differs)",
        )  # fmt: skip
    if not isinstance(num_allreduce_streams, int) or num_allreduce_streams < 1:
        raise ConfigError(f"num_allreduce_streams={num_allreduce_streams!r} is not valid; it must be an integer >= 1 (1 is accepted)")
    if num_allreduce_streams > 1:
        raise _refuse(
            "num_allreduce_streams", num_allreduce_streams,
            "torch DDP issues every bucket's all-reduce on its one process group's communication stream, "
            "not round-robin over several communicators and streams",
            "pass num_allreduce_streams=1 (the default; torch DDP already overlaps communication with backward)",
        )  # fmt: skip
    if allreduce_communicators is not None:
        raise _refuse(
            "allreduce_communicators", "<(groups, streams)>",
            "torch DDP reduces on a single process group with its own stream; per-bucket communicators and streams do not exist there",
            "pass allreduce_communicators=None; to reduce on one specific group pass process_group=<group>, "
            "which is forwarded to torch DDP",
        )  # fmt: skip


def _device_ids(module: nn.Module) -> list[int] | None:
    devices = {p.device for p in module.parameters()}
    if len(devices) == 1:
        device = next(iter(devices))
        if device.type == "cuda":
            return [device.index if device.index is not None else torch.cuda.current_device()]
    return None


def _bucket_cap_mb(module: nn.Module, message_size: int, delay_allreduce: bool) -> float:
    trainable = [p for p in module.parameters() if p.requires_grad]
    if delay_allreduce:
        # One bucket (per dtype) holding every gradient: it becomes ready when backward has finished.
        return sum(p.numel() * p.element_size() for p in trainable) / 2**20 + 1.0
    element_size = max((p.element_size() for p in trainable), default=4)
    return message_size * element_size / 2**20


class DistributedDataParallel(nn.parallel.DistributedDataParallel):
    """apex's DistributedDataParallel signature on torch's DistributedDataParallel (a subclass).

    ``.module`` is the wrapped model and ``state_dict`` keys are ``module.``-prefixed, as with apex.
    Parameters are broadcast from rank 0 at construction; buffers are not re-broadcast each forward
    (apex never did). Argument mapping:

    - ``message_size`` (elements per bucket) -> ``bucket_cap_mb`` for the parameters' element size.
    - ``delay_allreduce=True``: one bucket (per dtype) holding every gradient, reduced once backward ends.
      apex then skipped parameters without a gradient; torch DDP needs ``find_unused_parameters=True``
      (forwarded, see below) for models that leave some parameters unused.
    - ``gradient_average`` / ``gradient_predivide_factor``: a communication hook multiplies by 1/f
      before the all-reduce and, when averaging, by f/world after it (apex's math exactly;
      ``gradient_average=False`` keeps the pre-division and skips the post-multiplication, as apex).
    - ``allreduce_always_fp32``: fp16/bf16 buckets are reduced in an fp32 copy and copied back.
    - ``retain_allreduce_buffers``: gradients are views of the reduction buffers
      (``gradient_as_bucket_view=True``); the reduced flat buffers are in ``allreduce_buffers``.
    - ``gradient_average_split_factor``: the old name of ``gradient_predivide_factor``, honoured as it.
    - ``prof=True``: ``torch.autograd.profiler.record_function`` ranges around forward and each
      bucket's all-reduce (visible in torch.profiler, and as NVTX ranges under ``emit_nvtx``).
    - ``shared_param``, ``allreduce_trigger_params``, ``num_allreduce_streams > 1``,
      ``allreduce_communicators``: refused (:class:`ConfigError` says why and what to pass).

    Extra keyword arguments (e.g. ``find_unused_parameters``, ``static_graph``, ``process_group``)
    go to torch's DistributedDataParallel unchanged.
    """

    def __init__(
        self,
        module: nn.Module,
        message_size: int = 10000000,
        delay_allreduce: bool = False,
        shared_param: Any = None,
        allreduce_trigger_params: Any = None,
        retain_allreduce_buffers: bool = False,
        allreduce_always_fp32: bool = False,
        num_allreduce_streams: int = 1,
        allreduce_communicators: Any = None,
        gradient_average: bool = True,
        gradient_predivide_factor: float = 1.0,
        gradient_average_split_factor: float | None = None,
        prof: bool = False,
        **ddp_options: Any,
    ) -> None:
        _check_unsupported(shared_param, allreduce_trigger_params, num_allreduce_streams, allreduce_communicators)
        if not isinstance(message_size, (int, float)) or isinstance(message_size, bool) or not message_size >= 1:
            raise ConfigError(f"message_size={message_size!r} is not valid; it must be a positive number of elements (default 10000000)")
        message_size = int(message_size)  # apex's docs wrote the default as 1e7, so floats are accepted
        if gradient_average_split_factor is not None:
            if gradient_predivide_factor not in (1.0, gradient_average_split_factor):
                raise ConfigError(
                    f"gradient_average_split_factor={gradient_average_split_factor!r} and gradient_predivide_factor="
                    f"{gradient_predivide_factor!r} disagree; the first is the old name of the second, pass only gradient_predivide_factor"
                )
            warnings.warn(
                "gradient_average_split_factor is the old name of gradient_predivide_factor; it is honoured as that, "
                "pass gradient_predivide_factor instead",
                DeprecationWarning,
                stacklevel=2,
            )
            gradient_predivide_factor = gradient_average_split_factor
        if not gradient_predivide_factor > 0:
            raise ConfigError(f"gradient_predivide_factor={gradient_predivide_factor!r} is not valid; it must be a number > 0")
        if "bucket_cap_mb" in ddp_options:
            raise ConfigError("bucket_cap_mb is set from apex's message_size (elements per bucket); pass message_size instead")
        _require_initialized("apex.parallel.DistributedDataParallel")
        options: dict[str, Any] = {"device_ids": _device_ids(module), "gradient_as_bucket_view": bool(retain_allreduce_buffers)}
        if not {"broadcast_buffers", "forward_sync_buffers"} & set(ddp_options):  # apex never re-broadcast buffers in forward
            torch_parameters = inspect.signature(nn.parallel.DistributedDataParallel.__init__).parameters
            options["forward_sync_buffers" if "forward_sync_buffers" in torch_parameters else "broadcast_buffers"] = False
        options.update(ddp_options)
        options["bucket_cap_mb"] = _bucket_cap_mb(module, message_size, delay_allreduce)
        super().__init__(module, **options)
        self.message_size = message_size
        self.delay_allreduce = bool(delay_allreduce)
        self.retain_allreduce_buffers = bool(retain_allreduce_buffers)
        self.allreduce_always_fp32 = bool(allreduce_always_fp32)
        self.gradient_average = bool(gradient_average)
        self.gradient_predivide_factor = float(gradient_predivide_factor)
        self.num_allreduce_streams = 1
        self.prof = bool(prof)
        self._hook_state = _HookState(
            self.process_group, self.gradient_predivide_factor, self.gradient_average, self.allreduce_always_fp32,
            self.retain_allreduce_buffers, self.prof,
        )  # fmt: skip
        self.register_comm_hook(self._hook_state, _apex_allreduce_hook)
        # Python calls this at exit too: a script ending right after backward must not abort there.
        weakref.finalize(self, self._hook_state.callbacks.settle)

    @property
    def world_size(self) -> float:
        """Processes in the reduction group (a float, as apex kept it)."""
        return float(self._hook_state.world_size)

    @property
    def allreduce_buffers(self) -> list[torch.Tensor]:
        """With ``retain_allreduce_buffers=True``: the flat reduced gradient buffers, by bucket; else []."""
        return [self._hook_state.buffers[index] for index in sorted(self._hook_state.buffers)]

    def disable_allreduce(self) -> None:
        """Stop reducing gradients in backward (they accumulate locally) until :meth:`enable_allreduce`."""
        self.require_backward_grad_sync = False

    def enable_allreduce(self) -> None:
        """Reduce gradients in backward again (the default)."""
        self.require_backward_grad_sync = True

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """The wrapped module's forward, with gradient reduction prepared for the next backward."""
        if not self.prof:
            return super().forward(*inputs, **kwargs)
        with record_function(f"{_PROFILE_PREFIX}.forward"):
            return super().forward(*inputs, **kwargs)
