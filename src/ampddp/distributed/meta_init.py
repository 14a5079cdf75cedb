"""A model built on the meta device, then given each rank's shards of the weights an eager build makes.

Under FSDP2 every rank used to build the whole fp32 model before sharding it: the host's memory, not
the devices', bounded the model. Here the model's constructor runs with every ``torch.empty`` (what
every ``torch.nn`` layer allocates its weights with) on the meta device, while the in-place
initialisation ops applied to those tensors (``reset_parameters``, ``nn.init.*``, ``fill_``...) are
recorded, each with the random-number state it started from. The random stream is advanced as the
eager build advances it (each recorded op also runs once on a scratch tensor of the same shape, freed
at once), so what the constructor draws for real tensors (a ``torch.randn`` parameter, a buffer)
and the state after the build are the eager build's. Once the model is sharded, each tensor's ops are
replayed on one full-size scratch tensor at a time from their recorded states and only the rank's
slice is kept: the weights equal an eager build's of the same seed, bit for bit, and no rank holds
more than its shards plus the largest single tensor.

What cannot be replayed one tensor at a time (a weight computed from another tensor of the model, an
op on a view of a weight, a generator of the model's own) is refused in one line naming the tensor,
with the eager build as the alternative (``FSDPOptions(build_on_meta=False)``).
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

from ampddp.distributed.data import broadcast_from_main, gather_objects
from ampddp.distributed.env import DistEnv
from ampddp.distributed.model_agreement import check_models_agree
from ampddp.errors import CheckpointError, ConfigError

EAGER_ALTERNATIVE = (
    "build it whole on each rank instead: distributed.fsdp_build_on_meta: false (Parallel(fsdp=FSDPOptions(build_on_meta=False)))"
)

_IS_META = torch._C.TensorBase.is_meta.__get__
_IN_PLACE_DUNDERS = frozenset({"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__set__"})


class _Target:
    """Where the recorded tensor goes in a replayed call."""


_TARGET = _Target()


def _storage_key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage()._cdata


@dataclass
class _Step:
    """One recorded in-place op: ``func(*args, **kwargs)`` with the tensor at ``_TARGET``, and the CPU
    random state it started from when it draws random numbers."""

    func: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    random_state: torch.Tensor | None

    def run(self, tensor: torch.Tensor) -> None:
        def put(value: Any) -> Any:
            return tensor if value is _TARGET else value

        if self.random_state is not None:
            torch.set_rng_state(self.random_state)
        self.func(*tree_map(put, self.args), **tree_map(put, self.kwargs))


@dataclass
class TensorProgram:
    """How one meta tensor of the build gets its values: its shape, strides and dtype at birth and the
    in-place ops applied to it, in order; ``refusal``: why it cannot be replayed (None: it can)."""

    tensor: torch.Tensor
    """The meta tensor itself, kept alive so that its storage's address names it alone for the build."""
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    steps: list[_Step] = field(default_factory=list)
    refusal: str | None = None

    def covers(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is this whole tensor (not a view of a part or another shape of it)."""
        return tuple(tensor.shape) == self.shape and tuple(tensor.stride()) == self.stride and tensor.storage_offset() == 0

    def value(self) -> torch.Tensor:
        """The full tensor as the eager build leaves it, on the CPU (the random state is left changed)."""
        full = torch.empty_strided(self.shape, self.stride, dtype=self.dtype)
        with torch.no_grad():
            full.zero_()
            for step in self.steps:
                step.run(full)
        return full

    def random_states(self) -> list[torch.Tensor]:
        return [step.random_state for step in self.steps if step.random_state is not None]

    def take_random_states(self, states: list[torch.Tensor]) -> None:
        drawing = [step for step in self.steps if step.random_state is not None]
        for step, state in zip(drawing, states, strict=True):
            step.random_state = state


def _target_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[torch.Tensor | None, tuple[Any, ...], dict[str, Any]]:
    """The tensor an in-place call writes (its first argument, or ``tensor=`` as ``torch.nn.init``'s
    functions pass it) and the call's arguments with it replaced by ``_TARGET``."""
    if args and isinstance(args[0], torch.Tensor):
        return args[0], (_TARGET, *args[1:]), dict(kwargs)
    if isinstance(kwargs.get("tensor"), torch.Tensor):
        return kwargs["tensor"], tuple(args), {**kwargs, "tensor": _TARGET}
    return None, args, kwargs


def _writes_in_place(func: Callable[..., Any]) -> bool:
    name = getattr(func, "__name__", "")
    return name in _IN_PLACE_DUNDERS or (name.endswith("_") and not name.startswith("__"))


class _InitRecorder(TorchFunctionMode):
    """During a model's construction: ``torch.empty`` on the meta device, in-place ops on those tensors
    recorded (and run once on scratch to advance the random stream as eagerly); everything else as is."""

    def __init__(self) -> None:
        super().__init__()
        self.programs: dict[int, TensorProgram] = {}
        self._depth = 0

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if self._depth:  # inside a recorded op, or this recorder's own work: as it is
            return func(*args, **kwargs)
        self._depth += 1
        try:
            return self._handle(func, args, kwargs)
        finally:
            self._depth -= 1

    def _handle(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if func is torch.empty:
            tensor = func(*args, **{**{k: v for k, v in kwargs.items() if k != "pin_memory"}, "device": "meta"})
            self.programs[_storage_key(tensor)] = TensorProgram(tensor, tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype)
            return tensor
        if func == _IS_META and args[0].is_meta:
            return self._skipping_init_function(args[0])
        target, call_args, call_kwargs = _target_of(args, kwargs)
        if target is None or not target.is_meta or not _writes_in_place(func):
            return func(*args, **kwargs)
        if self._record(target, func, call_args, call_kwargs):
            return target
        return func(*args, **kwargs)

    def _skipping_init_function(self, target: torch.Tensor) -> bool:
        """``target.is_meta`` asked by a ``torch.nn.init`` function that skips meta tensors (newer
        torch's trunc_normal_, orthogonal_, sparse_, dirac_: value-dependent, so no op of theirs would be
        seen): the whole call is recorded with its arguments, and it is told True so it skips."""
        frame = sys._getframe(1)
        while frame is not None and frame.f_globals.get("__name__") in (__name__, "torch.overrides"):
            frame = frame.f_back
        if frame is None or frame.f_globals.get("__name__") != "torch.nn.init":
            return True
        function = torch.nn.init.__dict__.get(frame.f_code.co_name)
        names = list(inspect.signature(function).parameters) if function is not None else []
        if names and frame.f_locals.get(names[0]) is target:
            self._record(target, function, (_TARGET, *(frame.f_locals[name] for name in names[1:])), {})
        return True

    def _record(self, target: torch.Tensor, func: Callable[..., Any], call_args: tuple[Any, ...], call_kwargs: dict[str, Any]) -> bool:
        """Record ``func`` writing ``target`` (a meta tensor of the build): whether it was (False: not one
        of the build's tensors, or a call that cannot be replayed: the tensor is then refused if it becomes
        a weight)."""
        program = self.programs.get(_storage_key(target))
        if program is None:
            return False  # a tensor computed from a meta one: refused if it becomes a weight
        name = getattr(func, "__name__", repr(func)).removeprefix("_no_grad")
        leaves = tree_flatten((call_args, call_kwargs))[0]
        if not program.covers(target):
            program.refusal = f"{name} writes a view of it (shape {list(target.shape)} of {list(program.shape)})"
        elif any(isinstance(leaf, torch.Tensor) and leaf.is_meta for leaf in leaves):
            program.refusal = f"{name} computes it from another tensor of the model being built"
        elif any(isinstance(leaf, torch.Generator) for leaf in leaves):
            program.refusal = f"{name} draws from a generator of its own"
        if program.refusal is not None:
            return False
        state = torch.get_rng_state()
        scratch = torch.empty_strided(program.shape, program.stride, dtype=program.dtype)
        with torch.no_grad():
            _Step(func, call_args, call_kwargs, None).run(scratch)
        del scratch
        drew = not torch.equal(state, torch.get_rng_state())
        program.steps.append(_Step(func, call_args, call_kwargs, state if drew else None))
        return True


def _named_tensors(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    yield from module.named_parameters(remove_duplicate=False)
    yield from module.named_buffers(remove_duplicate=False)


def _owner(module: nn.Module, name: str) -> str:
    path = name.rpartition(".")[0]
    return type(module.get_submodule(path)).__name__ if path else type(module).__name__


class WeightsSource(Protocol):
    """Weights by tensor name, each read whole or in part (``ampddp.checkpoint.safetensors_weights``)."""

    def names(self) -> set[str]:
        """The names of the model's tensors these weights hold."""

    def reading(self) -> AbstractContextManager[Any]:
        """The source held open; what it gives has ``read(name, index)``: tensor ``name``, or the part
        ``index`` of it (a slice per dimension)."""

    def verify(self, rank: int, world_size: int) -> list[str]:
        """This rank's share of the tensors checked against the digests the source carries: what differs."""


@dataclass
class InitProgram:
    """The recorded initialisation of a meta-built model's meta tensors, by their names in it."""

    programs: dict[str, TensorProgram]
    weights: WeightsSource | None = None
    """Weights the tensors they name are read from instead (``checkpoint.init_from``'s safetensors)."""

    def place_and_agree(self, module: nn.Module, env: DistEnv) -> None:
        """Move the build's real tensors to ``env.device`` (the meta ones get storage once sharded); then,
        collective, check the weights to load (each rank its share) and that the ranks built the same
        model, and take rank 0's random states and real tensors, so every rank materialises rank 0's
        weights (as the eager set-up broadcasts them)."""
        module._apply(lambda t: t if t.is_meta else t.to(env.device))
        if self.weights is not None:
            self._verify_weights(env)
        if not env.distributed:
            return
        check_models_agree(module, env)
        self._take_main_random_states(env)
        with torch.no_grad():
            for _, tensor in _named_tensors(module):
                if not tensor.is_meta:
                    torch.distributed.broadcast(tensor.data, src=0)

    def _verify_weights(self, env: DistEnv) -> None:
        """Each rank checks its share of the weights' digests; every rank stops on a mismatch."""
        found = [problem for problems in gather_objects(self.weights.verify(env.rank, env.world_size), env) for problem in problems]
        if found:
            raise CheckpointError(found[0] + (f" ({len(found) - 1} more such tensor(s))" if len(found) > 1 else ""))

    def _take_main_random_states(self, env: DistEnv) -> None:
        names = sorted(self.programs)
        mine = [[s.numpy().tobytes() for s in self.programs[n].random_states()] for n in names] if env.is_main else None
        for name, states in zip(names, broadcast_from_main(mine, env), strict=True):
            try:
                self.programs[name].take_random_states([torch.frombuffer(bytearray(s), dtype=torch.uint8) for s in states])
            except ValueError:
                raise ConfigError(
                    f"the ranks initialise {name!r} with different random draws: every rank must build the same model"
                ) from None

    def materialise(self, module: nn.Module, device: torch.device) -> None:
        """Give ``module``'s meta tensors (sharded or not) storage on ``device`` and each rank's part of
        the values: read from ``weights`` where they name the tensor (only this rank's part is read),
        else the eager build's, replayed one full tensor at a time on the CPU."""
        random_state = torch.get_rng_state()
        module._apply(lambda t: torch.empty_like(t, device=device) if t.is_meta else t)
        loaded = self.weights.names() if self.weights is not None else set()
        seen: set[int] = set()
        with torch.no_grad(), self.weights.reading() if self.weights is not None else contextlib.nullcontext() as reader:
            for name, tensor in _named_tensors(module):
                if id(tensor) in seen or (name not in loaded and name not in self.programs):
                    continue
                seen.add(id(tensor))
                index = _local_index(tensor, name)
                if name in loaded:
                    part = reader.read(name, index)
                else:
                    full = self.programs[name].value()
                    part = full[index] if index is not None else full
                local = tensor.to_local() if index is not None else tensor
                if tuple(local.shape) != tuple(part.shape):
                    raise RuntimeError(f"meta build: the local part of {name!r} is {list(local.shape)}, the part read {list(part.shape)}")
                local.copy_(part)
        torch.set_rng_state(random_state)


def _local_index(tensor: torch.Tensor, name: str) -> tuple[slice, ...] | None:
    """This rank's part of a sharded (DTensor) tensor as a slice per dimension (None: it holds all of it), as
    DTensor lays it out (and DCP writes it): FSDP2 cuts as ``torch.chunk`` does, the last ranks' parts possibly
    empty; under FSDP2 x tensor parallelism a dimension is cut by both, the data-parallel cut within the tensor-
    parallel one."""
    from torch.distributed.tensor import DTensor

    if not isinstance(tensor, DTensor):
        return None
    chunks = tensor.__create_chunk_list__()
    if len(chunks) != 1:
        raise ConfigError(f"{name!r} is placed as {tensor.placements} on the mesh, {len(chunks)} pieces on this rank; a meta build "
                          "fills one block per rank")  # fmt: skip
    return tuple(slice(offset, offset + size) for offset, size in zip(chunks[0].offsets, chunks[0].sizes))


@dataclass
class ModelBuild:
    """A model and, when it was built on the meta device, how its meta tensors get their values."""

    module: nn.Module
    init: InitProgram | None = None


ModelSource = nn.Module | ModelBuild | Callable[[], nn.Module]
"""What a set-up takes as its model: a module, a function that builds one, or a build already made."""


def whole_model(model: ModelSource) -> nn.Module:
    """``model`` as one whole module on the CPU: a module as it is, a function's model built eagerly, a
    meta build materialised whole (to load weights into it)."""
    if isinstance(model, ModelBuild):
        if model.init is not None:
            model.init.materialise(model.module, torch.device("cpu"))
        return model.module
    return model if isinstance(model, nn.Module) else model_from(model)


def model_from(factory: Callable[[], nn.Module]) -> nn.Module:
    """``factory()``, which must be a module."""
    model = factory()
    if not isinstance(model, nn.Module):
        raise ConfigError(f"the model factory returned a {type(model).__name__}, not a torch.nn.Module")
    return model


def build_on_meta(factory: Callable[[], nn.Module]) -> ModelBuild:
    """``factory()`` with its weights on the meta device and their initialisation recorded; a tensor
    whose initialisation cannot be replayed per shard is refused in one line naming it."""
    recorder = _InitRecorder()
    try:
        with recorder:
            module = model_from(factory)
    except ConfigError:
        raise
    except (RuntimeError, NotImplementedError, TypeError, ValueError) as error:
        reason = str(error).strip().splitlines()[0][:300] if str(error).strip() else type(error).__name__
        raise ConfigError(
            f"building the model on the meta device failed ({type(error).__name__}: {reason}); {EAGER_ALTERNATIVE}"
        ) from error
    programs: dict[str, TensorProgram] = {}
    for name, tensor in _named_tensors(module):
        if not tensor.is_meta:
            continue
        program = recorder.programs.get(_storage_key(tensor))
        reason = (
            "it is computed from other tensors while the model is built"
            if program is None or not program.covers(tensor)
            else program.refusal
        )
        if reason is not None:
            raise ConfigError(
                f"model tensor {name!r} ({_owner(module, name)}) cannot be initialised shard by shard: {reason}; {EAGER_ALTERNATIVE}"
            )
        programs[name] = program
    return ModelBuild(module, InitProgram(programs))
