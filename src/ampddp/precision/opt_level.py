"""The builtin apex opt-level engine (O0-O5, and O6: O4 with fp8 matmuls) on native torch.

It composes the pieces: model conversion (casting.py), the O1/O4 op-cast context (cast_context.py),
fp32 masters (master.py) and loss scalers (scaler.py). It only uses per-object hooks — module
forward/state-dict hooks and optimizer step hooks — which ``teardown`` removes; torch itself is
never patched.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from ampddp.errors import AmpUsageError, ConfigError, NonFiniteGradientsError
from ampddp.precision.buffer_guard import BufferGuard
from ampddp.precision.casting.cast_context import OpCastContext
from ampddp.precision.casting.model_hooks import ForwardHooks, install_fp32_state_hooks
from ampddp.precision.casting.op_table import build_op_table
from ampddp.precision.casting.registry import OpRegistry
from ampddp.precision.casting.tensors import convert_model, device_types
from ampddp.precision.compile_support import run_eagerly_as_own_frame
from ampddp.precision.diagnostics import overflow_origin
from ampddp.precision.engine import PrecisionEngine, check_loss, check_models_and_optimizers, policy_compute_dtype
from ampddp.precision.fp8_conversion import model_conversion
from ampddp.precision.master import GradPhase, OptimizerGrads
from ampddp.precision.master_sync import DdpForwards, reconcile_masters
from ampddp.precision.policy import PrecisionPolicy
from ampddp.precision.scaler import LossScaler
from ampddp.precision.state import PrecisionState
from ampddp.precision.verdict import agreed_flag

logger = logging.getLogger("ampddp.precision")


def _device_of(records: Sequence[OptimizerGrads]) -> torch.device:
    """Where the records' params live: a rank without gradients joins the verdict's collective from there."""
    return next((param.device for record in records for param in record.master_params()), torch.device("cpu"))


@dataclass
class _PendingStep:
    """The loss whose scaled grads await the next step, and whether that step happened."""

    loss_id: int
    stepped: bool = False


class OptLevelEngine(PrecisionEngine):
    """apex opt-level semantics for the models/optimizers given to ``setup``."""

    def __init__(self, policy: PrecisionPolicy, registry: OpRegistry | None = None, allow_low_precision_models: bool = False) -> None:
        self.policy = policy
        self._allow_low_precision_models = allow_low_precision_models
        self.mode = policy.opt_level
        self._registrations = registry.entries() if registry is not None else ()
        self.scalers = [LossScaler.from_policy(policy) for _ in range(policy.num_losses)]
        self._records: dict[int, OptimizerGrads] = {}
        self._handles: list[RemovableHandle] = []
        self._buffer_guard: BufferGuard | None = None
        self._ddp_forwards = DdpForwards()
        self._cast_context: OpCastContext | None = None
        self._forward_hooks: ForwardHooks | None = None
        self._param_names: dict[int, str] = {}
        self._pending: _PendingStep | None = None
        self._conversion = model_conversion(policy)
        """O6's fp8 layers (every other level: no conversion)."""

    @classmethod
    def for_mode(
        cls, spec: Any, settings: Mapping[str, Any], registry: OpRegistry | None = None, allow_low_precision_models: bool = False
    ) -> OptLevelEngine:
        """The engine of the mode table's row ``spec`` (an opt level) with its checked ``settings`` applied to the level's policy."""
        return cls(spec.policy_with(settings), registry, allow_low_precision_models)

    # ---- set-up -------------------------------------------------------------------------------
    def convert_storage(self, model: nn.Module, device: torch.device | None = None) -> None:
        if self.policy.enabled and self.policy.cast_model_type not in (None, torch.float32):
            convert_model(model, self.policy.cast_model_type, bool(self.policy.keep_batchnorm_fp32))
            self._allow_low_precision_models = True
        self._conversion.convert(model, device=device)

    def setup(self, models: list[nn.Module], optimizers: list[Optimizer]) -> tuple[list[nn.Module], list[Optimizer]]:
        check_models_and_optimizers(models, optimizers, self._allow_low_precision_models, fp8=self.policy.fp8_recipe is not None)
        self.teardown()
        fp32_data = self._convert_models(models, optimizers)
        self._param_names = {id(p): f"models[{i}].{name}" for i, model in enumerate(models) for name, p in model.named_parameters()}
        self._records = {}
        for optimizer in optimizers:
            self.add_optimizer(optimizer, fp32_data)
        if not self.policy.enabled:
            return models, optimizers
        self._install_hooks(models)
        if self.policy.verbosity > 0:
            logger.info("precision %s", self.policy.summary())
            logger.debug("precision %s settings: %s", self.policy.opt_level, self.policy.describe())
        return models, optimizers

    @property
    def _casts_model(self) -> bool:
        return self.policy.enabled and self.policy.cast_model_type not in (None, torch.float32)

    def _convert_models(self, models: list[nn.Module], optimizers: list[Optimizer]) -> dict[int, torch.Tensor]:
        """The models' params cast to the mode's stored dtype and O6's linear layers converted to fp8;
        returns the exact fp32 values (by param id) the masters are taken from."""
        policy = self.policy
        fp32_data: dict[int, torch.Tensor] = {}
        if self._casts_model and policy.uses_master_weights:
            fp32_data = {id(p): p.data for opt in optimizers for group in opt.param_groups for p in group["params"]}
        for index, model in enumerate(models):
            if self._casts_model:
                convert_model(model, policy.cast_model_type, bool(policy.keep_batchnorm_fp32))
            self._conversion.convert(model, f"models[{index}]." if len(models) > 1 else "")
        return fp32_data

    def _install_hooks(self, models: list[nn.Module]) -> None:
        """The forward's hooks (op casting, input and output casts, O6's), fp32 state for cast models, the
        first forward's DDP check and, with a dynamic loss scale, the buffer guard."""
        policy = self.policy
        if policy.patch_torch_functions:
            table = build_op_table(self._registrations)
            self._cast_context = OpCastContext(table, policy.op_cast_dtype, device_types(models))
        input_dtype = policy.cast_model_type
        low_params = input_dtype is not None or policy.sharded_param_dtype is not None  # apex casts such outputs to fp32
        output_dtype = policy.cast_model_outputs or (torch.float32 if low_params else None)
        self._forward_hooks = ForwardHooks(self._cast_context, input_dtype, output_dtype)
        for model in models:
            self._handles += self._forward_hooks.install(model)
            if self._casts_model:
                self._handles += install_fp32_state_hooks(model, self._master_of)
        self._handles += self._conversion.hooks(models)
        run_eagerly_as_own_frame(DdpForwards.__call__)
        self._handles += [model.register_forward_pre_hook(self._ddp_forwards) for model in models]
        if any(scaler.dynamic for scaler in self.scalers):
            self._buffer_guard = BufferGuard(models)
            self._handles += self._buffer_guard.install(models)

    def add_optimizer(self, optimizer: Optimizer, fp32_data: dict[int, torch.Tensor] | None = None) -> None:
        """Track an optimizer (masters, skip hooks); ``setup`` calls it, the legacy ``amp.init`` handle
        calls it for optimizers it meets later. ``fp32_data``: exact fp32 values of params already cast."""
        if id(optimizer) in self._records:
            return
        makes_masters = self.policy.enabled and self.policy.uses_master_weights
        record = OptimizerGrads(optimizer, makes_masters, fp32_data)
        self._records[id(optimizer)] = record
        self._handles.append(optimizer.register_step_pre_hook(self._make_pre_step(record)))
        self._handles.append(optimizer.register_step_post_hook(self._make_post_step(record)))

    def _master_of(self, param: nn.Parameter) -> nn.Parameter | None:
        for record in self._records.values():
            master = record.master_of(param)
            if master is not None:
                return master
        return None

    def _make_pre_step(self, record: OptimizerGrads) -> Any:
        first_step = [True]

        def pre_step(optimizer: Optimizer, args: Any, kwargs: Any) -> None:
            record.sync_param_groups()
            if first_step[0]:
                first_step[0] = False
                reconcile_masters(record, self._ddp_forwards.group)
            if record.skip_pending:
                self._restore_buffers()
                record.drop_grads()
                return
            record.check_ready_to_step()

        return pre_step

    @property
    def forward_under_no_sync(self) -> bool:
        """The last forward ran under a DDP wrapper's ``no_sync``: its backward all-reduces nothing (apex
        blocks unscaled such gradients at once, so they were accumulated locally and never reduced)."""
        return self._ddp_forwards.under_no_sync

    def _restore_buffers(self) -> None:
        """A skipped step leaves no trace: buffers its forwards changed (BatchNorm statistics) go back."""
        if self._buffer_guard is not None:
            self._buffer_guard.restore()

    def _make_post_step(self, record: OptimizerGrads) -> Any:
        def post_step(optimizer: Optimizer, args: Any, kwargs: Any) -> None:
            if not record.skip_pending:
                record.copy_masters_to_model()
                if self._buffer_guard is not None:
                    self._buffer_guard.commit()
            record.reset_step_state()
            self._norm_overflow = None  # a step the facade took without engine.step: its verdict came at its blocks' ends

        return post_step

    def teardown(self) -> None:
        if self._forward_hooks is not None:
            # Deep copies of the models (an EMA copy) share these hooks: they stop casting ops too.
            self._forward_hooks.drop_context()
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def unwind_interrupted_forwards(self) -> None:
        """Exit op-cast contexts that forwards interrupted by KeyboardInterrupt left entered on this thread."""
        if self._forward_hooks is not None:
            self._forward_hooks.unwind_interrupted()

    def stop_op_casting(self) -> None:
        """End O1/O4 op casting for this set-up (apex's ``handle._deactivate``); loss scaling goes on.
        Lists applied outside the forward (the facade's window) are their owner's to close."""
        self._cast_context = None
        if self._forward_hooks is not None:
            self._forward_hooks.drop_context()

    # ---- per step -----------------------------------------------------------------------------
    def forward_context(self) -> AbstractContextManager[Any]:
        return self._cast_context if self._cast_context is not None else contextlib.nullcontext()

    def fp8_plan(self) -> list[dict[str, Any]]:
        return [verdict.to_dict() for verdict in self._conversion.verdicts]

    def _record(self, optimizer: Optimizer) -> OptimizerGrads:
        record = self._records.get(id(optimizer))
        if record is None:
            raise AmpUsageError("this optimizer was not passed to initialize/setup of this amp engine")
        return record

    def records_for(self, optimizers: Sequence[Optimizer]) -> list[OptimizerGrads]:
        """The gradient bookkeeping of each optimizer (AmpUsageError for one this engine does not hold)."""
        return [self._record(optimizer) for optimizer in optimizers]

    def scaler_for(self, loss_id: int) -> LossScaler:
        if not isinstance(loss_id, int) or not 0 <= loss_id < len(self.scalers):
            raise ConfigError(f"loss_id={loss_id!r} is not valid; num_losses={len(self.scalers)} gives ids 0..{len(self.scalers) - 1}")
        return self.scalers[loss_id]

    def share_loss_scalers(self, newer: PrecisionEngine) -> bool:
        if not isinstance(newer, OptLevelEngine) or newer is self:
            return False
        if [scaler.settings for scaler in newer.scalers] != [scaler.settings for scaler in self.scalers]:
            return False
        self.scalers = newer.scalers
        return True

    def passes_through(self, scaler: LossScaler) -> bool:
        """Disabled, or static scale 1 without masters: nothing to unscale, check or copy (apex O0/O3)."""
        if not self.policy.enabled:
            return True
        return not scaler.dynamic and scaler.loss_scale == 1.0 and not self.policy.uses_master_weights

    def scale_for_backward(self, loss: torch.Tensor, loss_id: int = 0) -> torch.Tensor:
        check_loss(loss, "engine.backward")
        scaler = self.scaler_for(loss_id)
        if any(record.phase is GradPhase.UNSCALED for record in self._records.values()):
            raise AmpUsageError(
                "backward after unscale_/clip_grad_norm_ in the same step: unscaled and scaled gradients would mix. "
                "Accumulate all micro-batches first, then unscale/clip once before step."
            )
        pending = self._pending
        if pending is not None and not pending.stepped and pending.loss_id != loss_id:
            raise AmpUsageError(
                f"backward with loss_id={loss_id} while the grads of loss_id={pending.loss_id} are not yet stepped; "
                "call engine.step between losses, or use amp.scale_loss, which unscales per loss"
            )
        return loss if self.passes_through(scaler) else scaler.scale_loss(loss)

    def backward_done(self, loss_id: int = 0) -> None:
        scaler = self.scaler_for(loss_id)
        pending = self._pending
        if pending is None or pending.stepped:
            self._pending = _PendingStep(loss_id)
        if not self.passes_through(scaler):
            self.mark_scaled(self._records.values())

    def mark_scaled(self, records: Iterable[OptimizerGrads]) -> None:
        """A backward left scaled gradients in ``records`` that no unscale has seen yet (``engine.backward``, or a
        ``scale_loss`` block that delays its unscale): a step must unscale them first."""
        for record in records:
            record.phase = GradPhase.SCALED

    def unscale_block(self, loss_id: int, records: Sequence[OptimizerGrads], defer_verdict: bool = False) -> None:
        """An apex ``scale_loss`` block closed: unscale the gradients its backward added to ``records`` and decide now
        whether their next step skips (held by the records until that step), or, with ``defer_verdict`` (apex's
        ``delay_overflow_check``), leave the non-finite flags on the scaler for the caller's ``update_scale``."""
        scaler = self.scaler_for(loss_id)
        for record in records:
            record.unscale_(scaler)
        skip = False
        if defer_verdict:
            scaler.defer([record.found_inf for record in records if record.found_inf is not None])
        else:
            scaler.deferred_found_inf = None  # this check covers those grads too (they accumulated into these)
            skip = self.decide_skip(loss_id, records)
        for record in records:
            record.close_block(skip)

    def unscale_(self, optimizer: Optimizer) -> None:
        record = self._record(optimizer)
        if record.phase is GradPhase.UNSCALED or self._pending is None or self._pending.stepped:
            return
        scaler = self.scaler_for(self._pending.loss_id)
        if self.passes_through(scaler):
            record.phase = GradPhase.UNSCALED
            return
        record.unscale_(scaler)

    def step(self, *optimizers: Optimizer) -> bool:
        if not optimizers:
            raise AmpUsageError("engine.step needs the optimizers to step, e.g. engine.step(optimizer)")
        records = self.records_for(optimizers)
        if self._pending is not None and self._pending.stepped:
            raise AmpUsageError(
                "engine.step was already called since the last backward: step every optimizer in one call, "
                "engine.step(opt_a, opt_b), so that the loss scale is updated once per backward"
            )
        for optimizer in optimizers:
            self.unscale_(optimizer)
        loss_id = self._pending.loss_id if self._pending else 0
        skip = self.decide_skip(loss_id, records)
        self._pending = _PendingStep(loss_id, stepped=True)
        if skip:
            self._restore_buffers()
        for record in records:
            if skip:
                record.drop_grads()
                record.reset_step_state()
            else:
                record.optimizer.step()
        return not skip

    def zero_grad(self, *optimizers: Optimizer) -> None:
        """Clear every gradient these optimizers depend on, including pending low-precision model grads.

        Use it to discard a backward without stepping; after a step, ``optimizer.zero_grad()`` suffices.
        """
        for optimizer in optimizers:
            record = self._record(optimizer)
            optimizer.zero_grad(set_to_none=True)
            record.discard_grads()
        self._pending = None
        self._norm_overflow = None

    def decide_skip(self, loss_id: int, records: Sequence[OptimizerGrads]) -> bool:
        """Update scaler ``loss_id`` from the records' non-finite flags (one host read); True: skip the step."""
        scaler = self.scalers[loss_id]
        try:
            skip = scaler.update(self._overflowed(records, scaler))
        except NonFiniteGradientsError as error:
            raise NonFiniteGradientsError(f"{error} Non-finite gradients start at: {self._overflow_origin(records)}.") from None
        if skip:
            self.last_overflow = self._overflow_origin(records)
            if self.policy.verbosity > 0:
                logger.warning(
                    "gradient overflow: step skipped, loss scaler %d reduced the loss scale to %g; non-finite gradients start at %s",
                    loss_id,
                    scaler.loss_scale,
                    self.last_overflow,
                )
        return skip

    def _overflowed(self, records: Sequence[OptimizerGrads], scaler: LossScaler) -> bool:
        """Whether the records' gradients (or this step's gradient norm) were non-finite on any rank of the verdict
        group: one host read, after the group's one MAX all-reduce. A static scale never skips, so never asks."""
        flags = [record.found_inf for record in records if record.found_inf is not None] + self._take_norm_overflow()
        if not scaler.dynamic or self.passes_through(scaler) or not (flags or self._verdict_group is not None):
            return False
        return bool(agreed_flag(flags, self._verdict_group, _device_of(records)).item())

    def _overflow_origin(self, records: Sequence[OptimizerGrads]) -> str:
        stepped = {id(model_param): param for record in records for model_param, param in record.param_pairs()}
        named = [(name, stepped[key]) for key, name in self._param_names.items() if key in stepped]
        return overflow_origin(named) or "no parameter of this rank (the gradients are finite here: another rank's, or the norm, were not)"

    def master_params(self, optimizer: Optimizer) -> Iterator[nn.Parameter]:
        return self._record(optimizer).master_params()

    def optimizer_grads(self, optimizer: Optimizer) -> OptimizerGrads | None:
        """The masters and gradient bookkeeping of one optimizer of this set-up (read by apex's ``_amp_stash``)."""
        return self._record(optimizer) if self.policy.enabled else None

    @property
    def steps_fp32_masters(self) -> bool:
        return self.policy.enabled and self.policy.uses_master_weights

    @property
    def casts_model_params(self) -> bool:
        return self.policy.enabled and self.policy.cast_model_type not in (None, torch.float32)

    # ---- state --------------------------------------------------------------------------------
    def loss_scale(self, loss_id: int = 0) -> float:
        return self.scaler_for(loss_id).loss_scale

    @property
    def skipped_steps(self) -> int:
        return sum(scaler.skipped_steps for scaler in self.scalers)

    @property
    def compute_dtype(self) -> torch.dtype | None:
        return policy_compute_dtype(self.policy)

    @property
    def sharded_param_dtype(self) -> torch.dtype | None:
        return self.policy.sharded_param_dtype if self.policy.enabled else None

    def grad_scaler_state_dict(self, loss_id: int = 0) -> dict[str, Any]:
        return self.scaler_for(loss_id).grad_scaler_state_dict()

    def precision_state(self) -> PrecisionState:
        scalers = tuple(scaler.state() for scaler in self.scalers)
        return PrecisionState(
            mode=self.mode,
            impl="builtin",
            policy=self.policy.describe(),
            scalers=scalers,
            skipped_steps=self.skipped_steps,
            fp8_layers=tuple(verdict.name for verdict in self._conversion.verdicts if verdict.fp8),
        )

    def load_precision_state(self, state: PrecisionState) -> None:
        if len(state.scalers) != len(self.scalers):
            raise ConfigError(
                f"precision state has {len(state.scalers)} loss scalers, this engine has {len(self.scalers)} "
                "(num_losses); expected {'scalers': [state, ...]} as returned by state_dict()"
            )
        self.check_precision_state(state)
        for scaler, saved in zip(self.scalers, state.scalers):
            scaler.load_state(saved)

    def loss_scale_ceilings(self) -> tuple[float, ...]:
        return tuple(scaler.ceiling for scaler in self.scalers)
