"""FSDP2 (``fully_shard``): a model's params, gradients and optimizer state sharded over the ranks.

The model is sharded per block (transformer blocks, residual stages: one all-gather per block in
the forward, freed again after it), then the root. The precision engine decides the dtype FSDP2
hands the params to the forward in (O2/O5: fp16/bf16 over fp32 shards); gradients are reduced in
fp32 unless asked otherwise. Everything here runs where ``prepare`` wraps a model, after the
precision set-up, so O3's fp16 params are what is sharded and the optimizer steps the shards.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ampddp.distributed.env import DistEnv
from ampddp.distributed.mesh import ParallelDims
from ampddp.errors import ConfigError, closest

logger = logging.getLogger("ampddp.distributed")


@dataclass(frozen=True)
class FSDPOptions:
    """FSDP2's settings that people tune; checked when made.

    ``blocks``: class names of the modules sharded as one unit each (``Block``, or qualified as
    ``package.module.Block``); empty: found in the model (the class of two or more same-class
    children of a ModuleList/Sequential that hold parameters). ``reshard_after_forward``: free a
    block's gathered params after its forward (less memory; gathered again for the backward) or keep
    them until then (one all-gather less per block). ``reduce_in_fp32``: reduce gradients in fp32
    (False: in the compute dtype, half the traffic, as DDP's compress hooks). ``activation_checkpointing``:
    recompute each block's activations in the backward instead of keeping them. ``cpu_offload``: keep
    the sharded params, their gradients and the optimizer state in (pinned) CPU memory, copied to the
    device per block for the forward and backward; the optimizer steps on the CPU (a model whose
    training state does not fit the devices, at the cost of the copies and a CPU optimizer step).
    ``shard_size`` (HSDP only): the ranks each replica shards over (None: a node's, LOCAL_WORLD_SIZE);
    the world size must be a multiple of it. ``build_on_meta``: a model given as a function that builds
    it is built on the meta device and each rank materialises only its shards, with the weights an
    eager build of the same seed makes (``ampddp.distributed.meta_init``); False: built whole on
    each rank, then sharded.
    """

    blocks: tuple[str, ...] = ()
    reshard_after_forward: bool = True
    reduce_in_fp32: bool = True
    activation_checkpointing: bool = False
    cpu_offload: bool = False
    shard_size: int | None = None
    build_on_meta: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.blocks, str) or not all(isinstance(name, str) and name for name in self.blocks):
            raise ConfigError(f"fsdp blocks={self.blocks!r} is not valid; give a list of module class names, e.g. [Block]")
        object.__setattr__(self, "blocks", tuple(self.blocks))
        for name in ("reshard_after_forward", "reduce_in_fp32", "activation_checkpointing", "cpu_offload", "build_on_meta"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"fsdp {name}={getattr(self, name)!r} is not valid; it must be true or false")
        if self.shard_size is not None and (
            isinstance(self.shard_size, bool) or not isinstance(self.shard_size, int) or self.shard_size < 1
        ):
            raise ConfigError(f"fsdp shard_size={self.shard_size!r} is not valid; it must be an integer >= 1 or null (a node's ranks)")

    def changed(self, where: str = "") -> list[str]:
        """The settings given other values than their defaults, as ``{where}name=value``."""
        return [f"{where}{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self) if getattr(self, f.name) != f.default]

    def replicas(self, env: DistEnv) -> int:
        """HSDP's replica count on ``env``: the world size over ``shard_size`` (a node's ranks when None)."""
        size = self.shard_size or env.local_world_size
        if env.world_size % size:
            source = "shard_size" if self.shard_size else "a node's ranks: LOCAL_WORLD_SIZE"
            raise ConfigError(
                f"strategy hsdp shards over groups of {size} rank(s) ({source}) and the world has {env.world_size}: "
                "choose a shard_size that divides the world size"
            )
        return env.world_size // size


def _class_names(kind: type[nn.Module]) -> tuple[str, str]:
    return kind.__name__, f"{kind.__module__}.{kind.__qualname__}"


def repeated_blocks(model: nn.Module) -> list[type[nn.Module]]:
    """The classes of the model's repeated layers: two or more same-class children of a ModuleList
    or Sequential, each holding parameters (a GPT's blocks, a ResNet's residual blocks)."""
    found: dict[type[nn.Module], None] = {}
    for container in model.modules():
        if not isinstance(container, (nn.ModuleList, nn.Sequential)):
            continue
        children = list(container.children())
        kinds = {type(child) for child in children}
        if len(children) >= 2 and len(kinds) == 1 and all(any(True for _ in child.parameters()) for child in children):
            found[kinds.pop()] = None
    return list(found)


def block_classes(model: nn.Module, names: tuple[str, ...]) -> list[type[nn.Module]]:
    """The block classes ``names`` asks for (every name must be a class in the model), or the model's
    repeated layers when ``names`` is empty."""
    if not names:
        return repeated_blocks(model)
    by_name: dict[str, dict[type[nn.Module], None]] = {}
    for module in model.modules():
        for name in _class_names(type(module)):
            by_name.setdefault(name, {})[type(module)] = None
    unknown = [name for name in names if name not in by_name]
    if unknown:
        holding = sorted({type(m).__name__ for m in model.modules() if any(True for _ in m.parameters(recurse=False))})
        raise ConfigError(
            f"fsdp block class {unknown[0]!r} is not in the model{closest(unknown[0], list(by_name))}; "
            f"its classes holding parameters: {', '.join(holding)}"
        )
    for name in names:
        if len(by_name[name]) > 1:
            qualified = ", ".join(sorted(_class_names(kind)[1] for kind in by_name[name]))
            raise ConfigError(
                f"fsdp block class {name!r} names {len(by_name[name])} classes of the model ({qualified}); give the qualified name"
            )
    return list(dict.fromkeys(next(iter(by_name[name])) for name in names))


def shard_model(model: nn.Module, env: DistEnv, options: FSDPOptions, param_dtype: torch.dtype | None,
                mesh: Callable[[], Any] | None = None) -> nn.Module:  # fmt: skip
    """``model`` sharded in place over the device mesh ``mesh()`` gives (default: every rank of
    ``env``, one dimension; HSDP's is 2-D, (replicas, shard): sharded within each group, replicated
    across the groups): its BatchNorm layers, each block, then the root. The mesh is asked for once
    the process group is known to exist.

    ``param_dtype``: the dtype FSDP2 gives the params to the forward in (None: as stored). A unit's
    params share one dtype, so BatchNorm layers (kept fp32 beside fp16/bf16 weights, as apex's
    ``keep_batchnorm_fp32``) are units of their own, computing in their stored dtype.
    A checkpointed block recomputes in the dtypes its forward computed in: autocast torch's checkpoint
    replays, ampddp's O1/O4 casting ``ampddp.precision.casting.recompute``. The model keeps its class
    (FSDP2 adds its own as a base) and its parameter names; rank 0's buffers are given
    to every rank before each training forward, as DDP does.
    """
    from torch.distributed._composable import checkpoint
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    _refuse_unshardable(model, env)
    classes = block_classes(model, options.blocks)
    mesh = (mesh or (lambda: ParallelDims.data_parallel(env, replicas=1).submesh("dp_shard")))()
    reduce_dtype = torch.float32 if options.reduce_in_fp32 else None
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    as_stored = MixedPrecisionPolicy(param_dtype=None, reduce_dtype=reduce_dtype)
    offload = _offload_policy(options, env)
    shard = functools.partial(fully_shard, mesh=mesh, offload_policy=offload)
    norms = _own_dtype_norms(model, param_dtype)
    for norm in norms:
        shard(norm, mp_policy=as_stored, reshard_after_forward=options.reshard_after_forward)
    own_units = {id(norm) for norm in norms}
    blocks = [m for m in reversed(list(model.modules())) if type(m) in classes and m is not model and id(m) not in own_units]
    for block in blocks:  # innermost first: a block inside another is its own unit
        if options.activation_checkpointing:
            checkpoint(block)
        shard(block, mp_policy=policy, reshard_after_forward=options.reshard_after_forward)
    # The root's params (embeddings, the head) are needed again at once by the backward: kept gathered.
    shard(model, mp_policy=policy, reshard_after_forward=False)
    if any(True for _ in model.buffers()):
        MainBuffers().install(model)
    _log_units(env, mesh.shape[0] if mesh.ndim == 2 else 1, blocks, norms)
    return model


def _log_units(env: DistEnv, replicas: int, blocks: list[nn.Module], norms: list[nn.Module]) -> None:
    """One line saying how the model was cut into units and over which ranks."""
    names = ", ".join(sorted({type(block).__name__ for block in blocks})) or "none found: the model is one unit"
    kept = f", {len(norms)} BatchNorm layer(s) in their stored dtype" if norms else ""
    over = f"{env.world_size} rank(s)" if replicas == 1 else f"{replicas} replicas of {env.world_size // replicas} rank(s) (HSDP)"
    logger.info("FSDP2 over %s: %d block(s) (%s)%s, then the root", over, len(blocks), names, kept)


def _refuse_unshardable(model: nn.Module, env: DistEnv) -> None:
    if isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
        raise ConfigError(
            f"strategy fsdp2/hsdp got a model already wrapped in {type(model).__name__}: pass the bare model; FSDP2 replaces "
            "DDP and cannot shard inside nn.DataParallel"
        )
    if not (dist.is_available() and dist.is_initialized()):
        raise ConfigError(
            "distributed strategy fsdp2 builds its device mesh over a process group, and this process has none: on one "
            "process, make a group of it first (torch.distributed.init_process_group('gloo', store=torch.distributed.HashStore(), "
            "rank=0, world_size=1); ampddp train does this itself), launch 2 or more processes, or use strategy ddp or none"
        )


def _offload_policy(options: FSDPOptions, env: DistEnv) -> Any:
    """Where the shards live between uses: host memory with ``cpu_offload`` (which needs a host backend
    beside NCCL for the collectives on them), else the device."""
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    if not options.cpu_offload:
        return OffloadPolicy()
    if env.device.type == "cuda" and "cpu:" not in str(dist.get_backend_config()):
        raise ConfigError(
            f"fsdp cpu_offload keeps the shards in host memory, and the collectives on them (the loss scale's agreement, "
            f"gradient norms) need a host backend beside NCCL; this process group has {dist.get_backend_config()}: "
            "use distributed.backend auto or 'cpu:gloo,cuda:nccl' (setup_distributed(backend='cpu:gloo,cuda:nccl'))"
        )
    if env.device.type == "cpu":
        logger.info("FSDP2 CPU offload on a CPU run: the state is in CPU memory already, nothing moves")
    return CPUOffloadPolicy(pin_memory=env.device.type == "cuda")


def _own_dtype_norms(model: nn.Module, param_dtype: torch.dtype | None) -> list[nn.Module]:
    """The BatchNorm layers with params that must be units of their own: where the others compute in
    ``param_dtype``, or are stored in another dtype than theirs (O3 with BatchNorm kept fp32)."""
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and any(True for _ in m.parameters())]
    stored = {param.dtype for param in model.parameters()}
    return norms if norms and (param_dtype is not None or len(stored) > 1) else []


@torch.no_grad()
def broadcast_buffers(module: nn.Module) -> None:
    """Every rank takes rank 0's buffers (one broadcast per dtype)."""

    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for buffer in module.buffers():
        by_dtype.setdefault(buffer.dtype, []).append(buffer)
    for buffers in by_dtype.values():
        flat = torch.cat([buffer.reshape(-1) for buffer in buffers])
        dist.broadcast(flat, src=0)
        for buffer, value in zip(buffers, flat.split([buffer.numel() for buffer in buffers])):
            buffer.copy_(value.view_as(buffer))


class MainBuffers:
    """Rank 0's buffers (BatchNorm's running statistics) given to every rank as DDP does: before the
    first forward after a forward with gradients (a training step), whatever that next forward is.
    FSDP2 shards params only; buffers each rank updates from its own batches would drift apart, and
    evaluation would then depend on the rank. (Every FSDP2 forward is collective already: the
    broadcast cannot leave a rank waiting alone.)"""

    def __init__(self) -> None:
        self.due = True  # as DDP: the first forward synchronises

    def before(self, module: nn.Module, args: Any) -> None:
        if self.due:
            broadcast_buffers(module)

    def after(self, module: nn.Module, args: Any, output: Any) -> None:
        self.due = torch.is_grad_enabled()

    def install(self, model: nn.Module) -> None:
        model.register_forward_pre_hook(self.before)
        model.register_forward_hook(self.after, always_call=True)


def sharded_blocks(model: nn.Module) -> list[nn.Module]:
    """The units FSDP2 shards below ``model`` (its blocks; BatchNorm layers that are units of their
    own aside): what ``trainer.compile`` compiles one by one. Empty when ``model`` is not sharded."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(model, FSDPModule):
        return []
    units = [module for module in model.modules() if isinstance(module, FSDPModule) and module is not model]
    return [unit for unit in units if not isinstance(unit, nn.modules.batchnorm._BatchNorm)]


@contextlib.contextmanager
def gradient_sync_off(model: nn.Module) -> Iterator[None]:
    """FSDP2's ``no_sync``: gradients accumulate unsharded, reduced by the next synchronising backward."""
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)
