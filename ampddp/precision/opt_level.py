"""The builtin apex opt-level engine (O0-O5) on native torch.

It composes the pieces: model conversion (casting.py), the O1/O4 op-cast context (cast_context.py),
fp32 masters (master.py) and loss scalers (scaler.py). It only uses per-object hooks — module
forward/state-dict hooks and optimizer step hooks — which ``teardown`` removes; torch itself is
never patched.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from ampddp.errors import AmpUsageError, ConfigError
from ampddp.precision.cast_context import OpCastContext, build_op_table
from ampddp.precision.casting import cast_floating, convert_model, device_types, first_non_fp32_param
from ampddp.precision.engine import PrecisionEngine
from ampddp.precision.master import OptimizerGrads
from ampddp.precision.policy import PrecisionPolicy
from ampddp.precision.registry import OpRegistry
from ampddp.precision.scaler import LossScaler

logger = logging.getLogger("ampddp.precision")


def check_models_and_optimizers(models: Sequence[nn.Module], optimizers: Sequence[Optimizer]) -> None:
    """Refuse the inputs apex refused (and the ones it silently mishandled)."""
    wrappers = (nn.parallel.DistributedDataParallel, nn.DataParallel)
    for index, model in enumerate(models):
        if not isinstance(model, nn.Module):
            raise AmpUsageError(f"models[{index}] is a {type(model).__name__}, not a torch.nn.Module")
        if isinstance(model, wrappers):
            raise AmpUsageError(
                f"models[{index}] is already wrapped in {type(model).__name__}: pass the bare model to "
                "initialize/setup and wrap it in DistributedDataParallel afterwards"
            )
        bad = first_non_fp32_param(model)
        if bad is not None:
            raise AmpUsageError(
                f"models[{index}] parameter {bad[0]!r} is {bad[1]}; models must be fp32 when passed in "
                "(was this model already initialized with O2/O3/O5, or .half()-ed by hand?)"
            )
    seen: set[int] = set()
    for index, optimizer in enumerate(optimizers):
        if not isinstance(optimizer, Optimizer):
            raise AmpUsageError(f"optimizers[{index}] is a {type(optimizer).__name__}, not a torch.optim.Optimizer")
        if id(optimizer) in seen:
            raise AmpUsageError(f"optimizers[{index}] was passed twice; pass each optimizer once")
        seen.add(id(optimizer))


def _overflowed(records: Sequence[OptimizerGrads], scaler: LossScaler) -> bool:
    """Read the found-inf flags of all records with one host synchronisation."""
    found = [record.found_inf for record in records if record.found_inf is not None]
    return scaler.dynamic and bool(found) and bool(sum(found[1:], found[0]).item())


class OptLevelEngine(PrecisionEngine):
    """apex opt-level semantics for the models/optimizers given to ``setup``."""

    def __init__(self, policy: PrecisionPolicy, registry: OpRegistry | None = None) -> None:
        self.policy = policy
        self.mode = policy.opt_level
        self._registrations = registry.entries() if registry is not None else ()
        self.scalers = [LossScaler.from_policy(policy) for _ in range(policy.num_losses)]
        self._records: dict[int, OptimizerGrads] = {}
        self._handles: list[RemovableHandle] = []
        self._cast_context: OpCastContext | None = None
        self._pending_loss_id: int | None = None

    # ---- set-up -------------------------------------------------------------------------------
    def setup(self, models: list[nn.Module], optimizers: list[Optimizer]) -> tuple[list[nn.Module], list[Optimizer]]:
        check_models_and_optimizers(models, optimizers)
        self.teardown()
        policy = self.policy
        casts_model = policy.enabled and policy.cast_model_type not in (None, torch.float32)
        fp32_data: dict[int, torch.Tensor] = {}
        if casts_model and policy.uses_master_weights:
            fp32_data = {id(p): p.data for opt in optimizers for group in opt.param_groups for p in group["params"]}
        if casts_model:
            for model in models:
                convert_model(model, policy.cast_model_type, bool(policy.keep_batchnorm_fp32))
        self._records = {}
        for optimizer in optimizers:
            record = OptimizerGrads(optimizer, casts_model and policy.uses_master_weights, fp32_data)
            self._records[id(optimizer)] = record
            self._handles.append(optimizer.register_step_pre_hook(self._make_pre_step(record)))
            self._handles.append(optimizer.register_step_post_hook(self._make_post_step(record)))
        if not policy.enabled:
            return models, optimizers
        if policy.patch_torch_functions:
            table = build_op_table(self._registrations)
            self._cast_context = OpCastContext(table, policy.op_cast_dtype, device_types(models))
        for model in models:
            self._hook_model(model, casts_model)
        if policy.verbosity > 0:
            logger.info("ampddp %s: %s", policy.opt_level, policy.describe())
        return models, optimizers

    def _hook_model(self, model: nn.Module, casts_model: bool) -> None:
        input_dtype = self.policy.cast_model_type
        output_dtype = self.policy.cast_model_outputs or (torch.float32 if input_dtype is not None else None)
        context = self._cast_context

        def before_forward(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            if context is not None:
                context.__enter__()
            if input_dtype is not None:
                return cast_floating(args, input_dtype), cast_floating(kwargs, input_dtype)
            return None

        def after_forward(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
            if context is not None:
                context.__exit__(None, None, None)
            if output_dtype is not None and output is not None:
                return cast_floating(output, output_dtype)
            return None

        if context is not None or input_dtype is not None or output_dtype is not None:
            self._handles.append(model.register_forward_pre_hook(before_forward, with_kwargs=True))
            self._handles.append(model.register_forward_hook(after_forward, always_call=True))
        if casts_model:
            # torch tags public hooks with an attribute, which bound methods cannot carry: wrap them.
            self._handles.append(model.register_state_dict_post_hook(lambda *a: self._fp32_state_dict(*a)))
            self._handles.append(model.register_load_state_dict_pre_hook(lambda *a: self._load_into_masters(*a)))

    def _master_of(self, param: nn.Parameter) -> nn.Parameter | None:
        for record in self._records.values():
            master = record.master_of(param)
            if master is not None:
                return master
        return None

    def _fp32_state_dict(self, module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
        """Checkpoints hold fp32 master values, not upcast half weights (apex issues 180/388)."""
        for name, param in module.named_parameters(remove_duplicate=False):
            key = prefix + name
            if key in state_dict:
                master = self._master_of(param)
                state_dict[key] = master.detach() if master is not None else param.detach().float()
        for name, buffer in module.named_buffers(remove_duplicate=False):
            key = prefix + name
            if key in state_dict and buffer.is_floating_point() and buffer.dtype != torch.float32:
                state_dict[key] = buffer.detach().float()

    def _load_into_masters(self, module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        with torch.no_grad():
            for name, param in module.named_parameters(remove_duplicate=False):
                value = state_dict.get(prefix + name)
                master = self._master_of(param)
                if master is not None and isinstance(value, torch.Tensor) and value.shape == master.shape:
                    master.copy_(value)

    def _make_pre_step(self, record: OptimizerGrads) -> Any:
        def pre_step(optimizer: Optimizer, args: Any, kwargs: Any) -> None:
            record.sync_param_groups()
            if record.skip_pending:
                record.drop_grads()
                return
            record.check_ready_to_step()

        return pre_step

    def _make_post_step(self, record: OptimizerGrads) -> Any:
        def post_step(optimizer: Optimizer, args: Any, kwargs: Any) -> None:
            if not record.skip_pending:
                record.copy_masters_to_model()
            record.reset_step_state()

        return post_step

    def teardown(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    # ---- per step -----------------------------------------------------------------------------
    def forward_context(self) -> AbstractContextManager[Any]:
        return self._cast_context if self._cast_context is not None else contextlib.nullcontext()

    def _record(self, optimizer: Optimizer) -> OptimizerGrads:
        record = self._records.get(id(optimizer))
        if record is None:
            raise AmpUsageError("this optimizer was not passed to initialize/setup of this amp engine")
        return record

    def scaler_for(self, loss_id: int) -> LossScaler:
        if not isinstance(loss_id, int) or not 0 <= loss_id < len(self.scalers):
            raise ConfigError(f"loss_id={loss_id!r} is not valid; num_losses={len(self.scalers)} gives ids 0..{len(self.scalers) - 1}")
        return self.scalers[loss_id]

    def _is_identity(self, scaler: LossScaler) -> bool:
        """Disabled, or static scale 1 without masters: nothing to unscale, check or copy (apex O0/O3)."""
        if not self.policy.enabled:
            return True
        return not scaler.dynamic and scaler.loss_scale == 1.0 and not self.policy.uses_master_weights

    def backward(self, loss: torch.Tensor, loss_id: int = 0) -> None:
        scaler = self.scaler_for(loss_id)
        if self._pending_loss_id not in (None, loss_id):
            raise AmpUsageError(
                f"backward with loss_id={loss_id} before the grads of loss_id={self._pending_loss_id} were "
                "unscaled; step (or unscale_) between losses, or use amp.scale_loss for per-loss unscaling"
            )
        self._pending_loss_id = loss_id
        if self._is_identity(scaler):
            loss.backward()
            return
        for record in self._records.values():
            record.has_scaled_grads = True
        scaler.scale_loss(loss).backward()

    def unscale_(self, optimizer: Optimizer) -> None:
        record = self._record(optimizer)
        scaler = self.scaler_for(self._pending_loss_id or 0)
        if record.unscaled:
            return
        if self._is_identity(scaler):
            record.unscaled = True
            return
        record.unscale_(scaler)

    def step(self, *optimizers: Optimizer) -> bool:
        records = [self._record(optimizer) for optimizer in optimizers]
        scaler = self.scaler_for(self._pending_loss_id or 0)
        for optimizer in optimizers:
            self.unscale_(optimizer)
        overflow = _overflowed(records, scaler)
        skip = scaler.update(overflow)
        self._pending_loss_id = None
        for record in records:
            if skip:
                record.drop_grads()
                record.reset_step_state()
            else:
                record.optimizer.step()
        if skip and self.policy.verbosity > 0:
            logger.info("gradient overflow: step skipped, loss scale reduced to %g", scaler.loss_scale)
        return not skip

    @contextlib.contextmanager
    def scale_loss(
        self, loss: torch.Tensor, optimizers: Sequence[Optimizer], loss_id: int = 0, delay_unscale: bool = False
    ) -> Iterator[torch.Tensor]:
        """apex semantics: unscale and update the scale when the block exits (once per backward)."""
        scaler = self.scaler_for(loss_id)
        if not self.policy.enabled:
            yield loss
            return
        records = [self._record(optimizer) for optimizer in optimizers]
        if self._is_identity(scaler):
            yield loss.float()
            return
        if not delay_unscale:
            for record in records:
                record.stash_grads()
        try:
            yield scaler.scale_loss(loss)
        except BaseException:
            for record in records:
                record.restore_stash()
            raise
        if delay_unscale:
            for record in records:
                record.has_scaled_grads = True
            return
        self._unscale_after_backward(records, scaler, loss_id)

    def _unscale_after_backward(self, records: list[OptimizerGrads], scaler: LossScaler, loss_id: int) -> None:
        for record in records:
            record.unscale_(scaler)
        overflow = _overflowed(records, scaler)
        for record in records:
            record.found_inf, record.unscaled = None, False
        if scaler.update(overflow):
            for record in records:
                record.skip_pending = True
            if self.policy.verbosity > 0:
                logger.info("gradient overflow: skipping step, loss scaler %d reducing loss scale to %g", loss_id, scaler.loss_scale)

    def master_params(self, optimizer: Optimizer) -> Iterator[nn.Parameter]:
        return self._record(optimizer).master_params()

    # ---- state --------------------------------------------------------------------------------
    def loss_scale(self, loss_id: int = 0) -> float:
        return self.scaler_for(loss_id).loss_scale

    @property
    def skipped_steps(self) -> int:
        return sum(scaler.skipped_steps for scaler in self.scalers)

    def state_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "impl": "builtin",
            "policy": self.policy.describe(),
            "scalers": [scaler.state_dict() for scaler in self.scalers],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        scalers = state.get("scalers") if isinstance(state, dict) else None
        if not isinstance(scalers, list) or len(scalers) != len(self.scalers):
            count = len(scalers) if isinstance(scalers, list) else "no"
            raise ConfigError(
                f"precision state has {count} loss scalers, this engine has {len(self.scalers)} "
                "(num_losses); expected {'scalers': [state, ...]} as returned by state_dict()"
            )
        parsed = [scaler.parse_state(sd, where=f"scalers[{i}]") for i, (scaler, sd) in enumerate(zip(self.scalers, scalers))]
        for scaler, values in zip(self.scalers, parsed):
            scaler.apply_state(values)
