"""The interface every precision mode implements.

The trainer and the ``amp`` facade talk only to this interface; a new mode is a new small class,
never a new branch in the training loop.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from ampddp.choices import FLOAT32_MAX
from ampddp.errors import AmpUsageError, ConfigError
from ampddp.precision.casting.tensors import first_non_fp32_param
from ampddp.precision.fp8 import fp8_layer_in
from ampddp.precision.grad_norm import clip_total_norm_, total_norm
from ampddp.precision.master import OptimizerGrads
from ampddp.precision.policy import PrecisionPolicy
from ampddp.precision.state import PrecisionState
from ampddp.precision.verdict import check_group, non_finite_flag


def check_models_and_optimizers(
    models: Sequence[nn.Module], optimizers: Sequence[Optimizer], allow_low_precision_models: bool = False, fp8: bool = False
) -> None:
    """Refuse the inputs apex refused (and the ones it silently mishandled), for every engine's ``setup``.

    ``allow_low_precision_models`` accepts models with fp16/bf16 params on entry (apex's
    ``_amp_state.allow_incoming_model_not_fp32``); their masters then start from those values.
    ``fp8``: the set-up is O6's; any other refuses a model an O6 set-up converted (it would go on
    running those layers in fp8 unseen).
    """
    for index, model in enumerate(models):
        _check_model(index, model, allow_low_precision_models, fp8)
    seen: set[int] = set()
    model_params = {id(param) for model in models for param in model.parameters()}
    for index, optimizer in enumerate(optimizers):
        if not isinstance(optimizer, Optimizer):
            raise AmpUsageError(f"optimizers[{index}] is a {type(optimizer).__name__}, not a torch.optim.Optimizer")
        if id(optimizer) in seen:
            raise AmpUsageError(f"optimizers[{index}] was passed twice; pass each optimizer once")
        seen.add(id(optimizer))
        stepped = [param for group in optimizer.param_groups for param in group["params"]]
        if models and not any(id(param) in model_params for param in stepped):
            raise AmpUsageError(
                f"optimizers[{index}] steps none of the models' parameters ({len(stepped)} parameter(s) of something else): "
                "the models would never train. Build it from model.parameters() of a model passed here, "
                "or pass the module it trains as one of the models too"
            )


def _check_model(index: int, model: Any, allow_low_precision_models: bool, fp8: bool) -> None:
    """``models[index]``: a bare module, no fp8 layers but under O6, fp32 params unless low ones are allowed."""
    if not isinstance(model, nn.Module):
        raise AmpUsageError(f"models[{index}] is a {type(model).__name__}, not a torch.nn.Module")
    if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
        raise AmpUsageError(
            f"models[{index}] is already wrapped in {type(model).__name__}: pass the bare model to "
            "initialize/setup and wrap it in DistributedDataParallel afterwards"
        )
    converted = None if fp8 else fp8_layer_in(model)
    if converted is not None:
        raise AmpUsageError(
            f"models[{index}] layer {converted!r} runs in fp8 (torchao's Float8Linear, from an O6 set-up): only O6 runs such "
            "a model; build the model anew for another mode (an O6 checkpoint loads into it)"
        )
    bad = None if allow_low_precision_models else first_non_fp32_param(model)
    if bad is not None:
        raise AmpUsageError(
            f"models[{index}] parameter {bad[0]!r} is {bad[1]}; models must be fp32 when passed in "
            "(was this model already initialized with O2/O3/O5, or .half()-ed by hand?)"
        )


def check_loss(loss: Any, api: str) -> None:
    """Refuse anything but a loss tensor before it reaches ``.float()`` / ``.backward()``."""
    if not isinstance(loss, torch.Tensor):
        raise AmpUsageError(
            f"{api} needs the loss as a torch.Tensor from the forward pass, got {type(loss).__name__} {loss!r}; "
            "pass the loss itself, not loss.item() or a number"
        )


def policy_compute_dtype(policy: PrecisionPolicy) -> torch.dtype | None:
    """The low-precision dtype an opt level computes in: its model cast, else its op casts (None: fp32)."""
    if not policy.enabled:
        return None
    if policy.sharded_param_dtype is not None:
        return policy.sharded_param_dtype
    if policy.cast_model_type not in (None, torch.float32):
        return policy.cast_model_type
    return policy.op_cast_dtype


class PrecisionEngine(ABC):
    """Model conversion, forward context, scaled backward, optimizer step and scaler state."""

    mode: str
    last_overflow: str | None = None
    """Parameter where the gradients of the last skipped step first became non-finite."""
    _verdict_group: Any = None
    _norm_group: Any = None
    _norm_overflow: torch.Tensor | None = None
    """This step's gradient norm was inf or NaN (a device flag, read with the verdict): an overflow."""

    @abstractmethod
    def setup(self, models: list[nn.Module], optimizers: list[Optimizer]) -> tuple[list[nn.Module], list[Optimizer]]:
        """Convert models and optimizers in place for this mode; returns the objects to use."""

    def convert_storage(self, model: nn.Module, device: torch.device | None = None) -> None:  # noqa: B027 - most modes store fp32
        """Cast ``model`` to the dtypes this mode stores it in, ahead of ``setup`` (FSDP2 shards what
        is stored, and a sharded model cannot be cast afterwards); ``setup`` then finds it cast.
        ``device``: where it will train, for a model still on the meta device (O6 asks it for fp8 matmuls)."""

    @abstractmethod
    def forward_context(self) -> AbstractContextManager[Any]:
        """Context for the forward pass and loss computation."""

    def backward(self, loss: torch.Tensor, loss_id: int = 0) -> None:
        """Backward of the (scaled) loss; call it once per micro-batch when accumulating. The two halves,
        for a schedule that runs the backward itself: :meth:`scale_for_backward`, then :meth:`backward_done`."""
        self.scale_for_backward(loss, loss_id).backward()
        self.backward_done(loss_id)

    def scale_for_backward(self, loss: torch.Tensor, loss_id: int = 0) -> torch.Tensor:
        """The tensor to run the backward of ``loss`` on (scaled where this mode scales it); refuses a backward
        that would mix with gradients this step cannot take (after ``unscale_``, another loss's pending ones).
        Every engine of ampddp's has it; an engine of a user's own that overrides only ``backward`` (as the
        interface asked before the halves existed) still trains, but not under a schedule that needs the halves."""
        raise NotImplementedError(f"{type(self).__name__} overrides backward() only: a schedule that runs the backward itself "
                                  "needs scale_for_backward() and backward_done()")  # fmt: skip

    def backward_done(self, loss_id: int = 0) -> None:
        """Say that a backward of loss ``loss_id``'s scale ran (its gradients are now scaled and pending). A
        pipeline stage without a loss of its own (its backward starts from the next stage's gradients) calls
        only this."""
        raise NotImplementedError(f"{type(self).__name__} overrides backward() only: a schedule that runs the backward itself "
                                  "needs scale_for_backward() and backward_done()")  # fmt: skip

    def agree_over(self, group: Any) -> None:
        """Agree the loss-scale verdict (skip or step) over ``group`` from now on: one small MAX all-reduce of the
        non-finite flags after unscaling, before stepping (``ampddp.precision.verdict``). Whoever sets the engine up
        names the ranks whose gradients can differ (FSDP2, tensor parallelism: every rank of the mesh); None, the
        default, agrees nothing (one process, or DDP, whose all-reduce already made every rank's gradients equal).
        Every rank of ``group`` must then step together."""
        check_group(group)
        self._verdict_group = group

    def norm_across(self, group: Any) -> None:
        """Take the gradient norm (clipping, logging) across ``group`` from now on: ranks holding disjoint parts of the
        model as plain tensors (a pipeline's stages), whose parts' norms combine into the model's. None, the default:
        this rank's gradients are the model's (replicated, or DTensors whose norms are whole already)."""
        check_group(group)
        self._norm_group = group

    @property
    def verdict_group(self) -> Any:
        """The process group the loss-scale verdict is agreed over (None: each rank decides alone)."""
        return self._verdict_group

    @abstractmethod
    def unscale_(self, optimizer: Optimizer) -> None:
        """Unscale the optimizer's grads now (before clipping); idempotent within a step."""

    @abstractmethod
    def step(self, *optimizers: Optimizer) -> bool:
        """Unscale if needed, step unless grads overflowed, update the scale; True if stepped."""

    @abstractmethod
    def master_params(self, optimizer: Optimizer) -> Iterator[nn.Parameter]:
        """Params the optimizer steps (fp32 masters under O2/O5) — clip and inspect these."""

    @abstractmethod
    def loss_scale(self, loss_id: int = 0) -> float:
        """Current loss scale (1.0 when not scaling)."""

    @property
    @abstractmethod
    def skipped_steps(self) -> int:
        """Steps skipped because of non-finite gradients, over the engine's life."""

    @property
    @abstractmethod
    def compute_dtype(self) -> torch.dtype | None:
        """torch.float16 or torch.bfloat16 when some compute runs in it, None when all runs in fp32 (O0,
        disabled) — so callers can ask about precision without branching on mode names."""

    @property
    def scales_loss(self) -> bool:
        """Whether the loss is scaled (a dynamic scaler, or a static scale other than 1): only then do
        the loss scale and skipped steps say anything worth showing."""
        return any(scaler.dynamic is not False or scaler.loss_scale != 1.0 for scaler in self.precision_state().scalers)

    @property
    def casts_model_params(self) -> bool:
        """Whether ``setup`` changes the models' parameter dtypes in place (O2/O3/O5)."""
        return False

    @property
    def sharded_param_dtype(self) -> torch.dtype | None:
        """The dtype FSDP2 hands the sharded params to the forward in (None: as they are stored)."""
        return None

    @property
    def steps_fp32_masters(self) -> bool:
        """Whether the optimizers step fp32 copies of low-precision model params (O2/O5), not the params."""
        return False

    def fp8_plan(self) -> list[dict[str, Any]]:
        """Each linear layer of the set-up models with whether it runs in fp8 and why not (O6; empty
        for the modes without fp8), for the run's records."""
        return []

    def optimizer_grads(self, optimizer: Optimizer) -> OptimizerGrads | None:
        """This engine's masters and gradient bookkeeping for ``optimizer``, where it keeps them (opt levels)."""
        return None

    @abstractmethod
    def precision_state(self) -> PrecisionState:
        """The typed state (mode, scalers, skipped steps) that checkpoints, ``inspect`` and ``amp`` read."""

    @abstractmethod
    def load_precision_state(self, state: PrecisionState) -> None:
        """Restore a state with this engine's number of scalers (its mode is not checked: converting
        between modes is ``state.convert``'s job), each scale within ``check_precision_state``'s bounds;
        raise ConfigError and change nothing otherwise."""

    def loss_scale_ceilings(self) -> tuple[float, ...]:
        """The largest loss scale each of this engine's scalers holds: float32's largest (the scale is an
        fp32 tensor or multiplies an fp32 loss); an opt level's, its ``max_loss_scale``."""
        return tuple(FLOAT32_MAX for _ in self.precision_state().scalers)

    def check_precision_state(self, state: PrecisionState, where: str = "precision state") -> None:
        """Each loss scale of ``state`` in (0, the ceiling of the scaler it goes to]: a larger one overflows
        every step, and every step is skipped (O2 skipped all 60 of a run given 1e300). ConfigError
        naming the scaler, its scale and the range."""
        for index, (saved, ceiling) in enumerate(zip(state.scalers, self.loss_scale_ceilings())):
            if not 0 < saved.loss_scale <= ceiling:
                raise ConfigError(
                    f"{where}: loss_scaler{index}: loss scale {saved.loss_scale:.10g} is out of range; it must be a finite number in "
                    f"(0, {ceiling:.10g}], the most this {self.mode} scaler holds; nothing was loaded"
                )

    def state_dict(self) -> dict[str, Any]:
        """``precision_state()`` as plain data, for checkpoints."""
        return self.precision_state().to_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what ``state_dict`` returned, or apex's ``amp.state_dict()`` or a GradScaler state."""
        self.load_precision_state(PrecisionState.from_dict(state))

    def grad_scaler_state_dict(self, loss_id: int = 0) -> dict[str, Any]:
        """Scaler ``loss_id`` in ``torch.amp.GradScaler.state_dict()`` form, for engines that know its settings."""
        raise AmpUsageError(
            f"grad_scaler_state_dict needs the builtin opt-level engine (impl='builtin'); this {self.mode} engine has no such scaler"
        )

    def share_loss_scalers(self, newer: PrecisionEngine) -> bool:
        """Use ``newer``'s loss scalers from now on when they work like this engine's (apex kept one global
        list, replaced by each ``initialize``); True when taken. Engines without apex scalers keep theirs."""
        return False

    def unwind_interrupted_forwards(self) -> None:  # noqa: B027 - optional for engines without forward contexts
        """Exit forward contexts that a KeyboardInterrupt left entered on this thread."""

    def zero_grad(self, *optimizers: Optimizer) -> None:
        """Clear the optimizers' gradients (and any pending gradient state the engine keeps)."""
        for optimizer in optimizers:
            optimizer.zero_grad(set_to_none=True)
        self._norm_overflow = None

    def teardown(self) -> None:  # noqa: B027 - optional for engines that install nothing
        """Remove hooks this engine installed; the models keep their converted dtypes."""

    def clip_grad_norm_(self, optimizers: Iterable[Optimizer], max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Unscale, then clip the global norm over the params the optimizers step; a non-finite norm counts as
        an overflow in this step's verdict (a dynamic loss scale skips the step, on every rank)."""
        return self._counted(clip_total_norm_(self._unscaled_params(optimizers), max_norm, norm_type, self._norm_group))

    def grad_norm(self, optimizers: Iterable[Optimizer], norm_type: float = 2.0) -> torch.Tensor:
        """Unscale, then measure the global gradient norm without touching the gradients (for logging:
        clipping at an infinite limit would still rewrite every gradient); a non-finite norm counts as an
        overflow, as in :meth:`clip_grad_norm_`."""
        return self._counted(total_norm(self._unscaled_params(optimizers), norm_type, self._norm_group))

    def _counted(self, norm: torch.Tensor) -> torch.Tensor:
        """Keep whether ``norm`` is finite for this step's verdict (no host read now)."""
        flag = non_finite_flag(norm)
        self._norm_overflow = flag if self._norm_overflow is None else self._norm_overflow + flag
        return norm

    def _take_norm_overflow(self) -> list[torch.Tensor]:
        """This step's gradient-norm flag, for the verdict, forgotten as it is taken."""
        flag, self._norm_overflow = self._norm_overflow, None
        return [] if flag is None else [flag]

    def _unscaled_params(self, optimizers: Iterable[Optimizer]) -> list[nn.Parameter]:
        params = []
        for optimizer in optimizers:
            self.unscale_(optimizer)
            params.extend(p for p in self.master_params(optimizer) if p.grad is not None)
        return params
