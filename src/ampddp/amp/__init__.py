"""apex-compatible API: change ``from apex import amp`` to ``from ampddp import amp`` and run.

Everything apex kept in process-wide globals lives in an ``Amp`` object here. The module-level
functions (``amp.initialize``, ``amp.scale_loss``, ...) belong to one default instance; create more
with ``amp.Amp()`` to train independent set-ups in one process.

Each ``initialize`` makes a set-up (engine, scalers, hooks) of its own; earlier set-ups keep
training, as in apex's own tests, except one that holds a model or optimizer passed again, which is
removed first; repeating the very same call on the same objects is a no-op (mmengine calls it until
``optimizer._amp_stash`` appears). ``scale_loss`` and ``master_params`` go to the set-up holding the
optimizer; ``state_dict``/``load_state_dict`` and ``_amp_state`` describe the newest set-up, as apex's
globals did. A DDP wrapper built around the models before an opt level casts them is re-hooked.

When O1/O4 casting applies: inside the forward of a model given to ``initialize``, and after it
returns on the same thread — the loss computed outside the model — until ``scale_loss`` is entered,
an optimizer of the set-up steps, a model's next forward begins, or ``end_casts()``. After the
forward only apex's op lists apply (no device autocast), as with apex's patched functions. Inside
``process_wide_casts()`` (``python -m ampddp.apex`` runs programs there) apex's own scope applies:
every op on the initializing thread from ``initialize`` on, except in ``scale_loss`` and the step,
and apex's one global list of loss scalers: each ``initialize`` gives its fresh scalers to the earlier
set-ups whose scalers work the same way (apex's ``_amp_state.loss_scalers[loss_id]``, read by every
``scale_loss``), so a reference and a restored model restart their scales together, as under apex.
The engine API (``build_engine``) keeps casting inside the forward.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from ampddp.amp.loss_blocks import loss_blocks
from ampddp.amp.rewrap import Wrappers, wrappers_around
from ampddp.amp.set_up import CastScope, SetUp
from ampddp.amp.state_io import load_amp_state
from ampddp.distributed.env import launched_rank_without_a_group
from ampddp.errors import AmpUsageError
from ampddp.precision import (
    MODES,
    PrecisionEngine,
    build_engine,
    check_loss,
    check_models_and_optimizers,
    check_opt_level,
    group_for_sharded,
    settle_host_heap,
    warn_if_slower_than_fp32,
)
from ampddp.precision.casting import (
    BFLOAT16,
    FP32,
    LOW,
    PROMOTE,
    OpRegistry,
    bfloat16_function,
    end_thread_casts,
    float_function,
    half_function,
    promote_function,
    suspend_thread_casts,
)


def _as_list(value: Any, kind: type, name: str) -> tuple[list[Any], bool]:
    if isinstance(value, kind):
        return [value], False
    if isinstance(value, (list, tuple)):
        return list(value), True
    raise AmpUsageError(f"{name} must be a {kind.__name__} or a list of them, got {type(value).__name__}")


def _shaped(models: list[nn.Module], models_were_list: bool, optimizers: list[Optimizer] | None, optimizers_were_list: bool) -> Any:
    """``initialize``'s return value in the shapes it was given (apex: a model or a list; with optimizers, a pair)."""
    out_models = models if models_were_list else models[0]
    if optimizers is None:
        return out_models
    return out_models, (optimizers if optimizers_were_list else optimizers[0])


class Amp:
    """The amp API over this instance's op registry and set-ups (engines, scalers, masters, hooks)."""

    def __init__(self) -> None:
        self._registry = OpRegistry()
        self._setups: list[weakref.ref[SetUp]] = []
        self._newest: SetUp | None = None
        self._initialized_optimizers: weakref.WeakSet[Optimizer] = weakref.WeakSet()
        self.allow_incoming_model_not_fp32 = False
        """Accept models with fp16/bf16 params in ``initialize`` (apex's ``_amp_state`` flag of that name)."""
        self._scope = CastScope()
        self._warned_ranks_apart = False

    @contextlib.contextmanager
    def process_wide_casts(self) -> Iterator[None]:
        """apex's O1/O4 scope inside the block: from ``initialize`` on, ops anywhere on the initializing
        thread follow the op lists — modules and functions never given to ``initialize`` too — except while
        ``scale_loss`` (backward) and the optimizer step run. ``python -m ampddp.apex`` runs the program
        inside it; the library API keeps casting to the models' forwards and the loss after them."""
        self.set_process_wide_casts(True)
        try:
            yield
        finally:
            self.set_process_wide_casts(False)

    def set_process_wide_casts(self, enabled: bool) -> None:
        """Turn apex's scope (see ``process_wide_casts``) on or off for this instance's set-ups, from now on.

        A process started under ``python -m ampddp.apex`` (a ``spawn`` worker) turns it on when it imports
        ``apex``; it lasts as long as that process."""
        self._scope.process_wide = enabled
        if enabled:
            self._reopen_process_casts(self._newest)
        else:
            end_thread_casts()

    def _reopen_process_casts(self, setup: SetUp | None) -> None:
        if self._scope.process_wide and setup is not None and setup.live:
            setup.open_window_here()

    @property
    def registry(self) -> OpRegistry:
        """This instance's op registrations (``register_*_function``)."""
        return self._registry

    # ---- registration (before initialize) ------------------------------------------------------
    def register_half_function(self, module: Any, name: str) -> None:
        """Run ``module.name`` in the low-precision dtype under O1/O4 (takes effect at initialize)."""
        self._registry.register(module, name, LOW)

    def register_float_function(self, module: Any, name: str) -> None:
        """Run ``module.name`` in fp32 under O1/O4 (takes effect at initialize)."""
        self._registry.register(module, name, FP32)

    def register_promote_function(self, module: Any, name: str) -> None:
        """Cast ``module.name``'s inputs to their widest float type under O1/O4."""
        self._registry.register(module, name, PROMOTE)

    def register_bfloat16_function(self, module: Any, name: str) -> None:
        """Run ``module.name`` in bfloat16 under O1/O4."""
        self._registry.register(module, name, BFLOAT16)

    # ---- set-up ---------------------------------------------------------------------------------
    def initialize(
        self,
        models: nn.Module | list[nn.Module],
        optimizers: Optimizer | list[Optimizer] | None = None,
        enabled: bool = True,
        opt_level: str = "O1",
        impl: str = "builtin",
        **overrides: Any,
    ) -> Any:
        """Prepare models (and optimizers) for ``opt_level``; returns them in the shapes given.

        ``overrides`` are apex's keywords (cast_model_type, patch_torch_functions,
        keep_batchnorm_fp32, master_weights, loss_scale, cast_model_outputs, num_losses,
        verbosity, min_loss_scale, max_loss_scale) plus ampddp's scaler settings
        (init_loss_scale, growth_factor, backoff_factor, growth_interval, hysteresis).
        """
        model_list, models_were_list = _as_list(models, nn.Module, "models")
        optimizer_list, optimizers_were_list = ([], False) if optimizers is None else _as_list(optimizers, Optimizer, "optimizers")
        request = (opt_level, impl, enabled, sorted(overrides.items()))
        if self._repeats_a_setup(model_list, optimizer_list, request):
            return _shaped(model_list, models_were_list, optimizer_list if optimizers is not None else None, optimizers_were_list)
        allow_low = self.allow_incoming_model_not_fp32
        options = {"allow_low_precision_models": True} if allow_low and impl == "builtin" else {}
        engine = build_engine(check_opt_level(opt_level), impl=impl, registry=self._registry, enabled=enabled, **options, **overrides)
        self._refuse_initialized_optimizers(optimizer_list)
        check_models_and_optimizers(model_list, optimizer_list, allow_low, fp8=MODES[opt_level].runs_fp8)
        self._set_up_engine(engine, model_list, optimizer_list)
        setup = SetUp(engine, model_list, optimizer_list, request, scope=self._scope, restores_carried_amp_state=self._owns_its_scalers)
        setup.install_hooks()
        setup.mark_optimizers()
        self._add(setup)
        self._warn_if_ranks_train_apart()
        return _shaped(model_list, models_were_list, optimizer_list if optimizers is not None else None, optimizers_were_list)

    def _refuse_initialized_optimizers(self, optimizers: list[Optimizer]) -> None:
        for index, optimizer in enumerate(optimizers):
            if optimizer in self._initialized_optimizers:
                raise AmpUsageError(
                    f"optimizers[{index}] was already passed to amp.initialize (its param groups may hold that set-up's fp32 "
                    "masters); pass each optimizer through initialize once, as apex required: build a new optimizer over "
                    "the model's parameters for a new set-up"
                )

    def _set_up_engine(self, engine: PrecisionEngine, models: list[nn.Module], optimizers: list[Optimizer]) -> None:
        """``engine`` over ``models`` and ``optimizers``: DDP wrappers around them checked (and re-hooked after
        a cast), earlier set-ups holding any of them removed first, the slower-than-fp32 line said."""
        wrappers = wrappers_around(models) if engine.casts_model_params or engine.steps_fp32_masters else Wrappers()
        wrappers.check(engine.casts_model_params, engine.steps_fp32_masters)
        self.end_casts()
        for earlier in [s for s in self.setups if any(s.holds(obj) for obj in (*models, *optimizers))]:
            earlier.teardown()
        engine.agree_over(group_for_sharded(param for model in models for param in model.parameters()))
        engine.setup(models, optimizers)
        device = next((param.device for model in models for param in model.parameters()), torch.device("cpu"))
        warn_if_slower_than_fp32(engine.mode, engine.compute_dtype, device, models)
        settle_host_heap(device)
        if engine.casts_model_params:
            wrappers.rehook_after_cast()

    def _add(self, setup: SetUp) -> None:
        """``setup`` becomes the newest: its casts open under apex's scope, where it also gives its loss
        scalers to the earlier set-ups (apex's one global list, replaced by each initialize)."""
        self._reopen_process_casts(setup)
        if self._scope.process_wide:
            for earlier in self.setups:
                earlier.engine.share_loss_scalers(setup.engine)
        self._setups = [ref for ref in self._setups if (live := ref()) is not None and live.live]
        self._setups.append(weakref.ref(setup))
        self._newest = setup
        self._initialized_optimizers.update(setup.optimizers)

    def _owns_its_scalers(self) -> bool:
        """Under apex's scope the set-ups share one list of loss scalers (apex's global): an optimizer's
        carried amp state is restored only while its set-up is the only live one. Beside others (apex's
        test_restoring loads a checkpoint into a second model next to the one that wrote it) the list
        stays as apex left it."""
        return not self._scope.process_wide or len(self.setups) <= 1

    def _warn_if_ranks_train_apart(self) -> None:
        """Under apex's scope (the runner): a script started on several processes that never joined them
        trains one independent copy per rank, each writing the same files; say so once."""
        if not self._scope.process_wide or self._warned_ranks_apart:
            return
        env = launched_rank_without_a_group()
        if env is None:
            return
        self._warned_ranks_apart = True
        warnings.warn(
            f"rank {env.rank} of {env.world_size}: amp.initialize ran with no process group started, so the "
            f"{env.world_size} processes train independent copies on all the data (and write the same files); "
            "call torch.distributed.init_process_group(...) and wrap the model in DistributedDataParallel, or run one process",
            stacklevel=3,
        )

    def _repeats_a_setup(self, models: list[nn.Module], optimizers: list[Optimizer], request: tuple[Any, ...]) -> bool:
        """True when exactly these objects were initialized with exactly this request: mmengine calls
        ``initialize`` again until it sees ``_amp_stash``. Anything else goes through ``initialize``'s checks."""
        return any(setup.holds_exactly(models, optimizers) and setup.request == request for setup in self.setups)

    @property
    def setups(self) -> tuple[SetUp, ...]:
        """Live set-ups, oldest first (those whose models and optimizers still exist)."""
        found = [ref() for ref in self._setups]
        return tuple(setup for setup in found if setup is not None and setup.live)

    @property
    def engine(self) -> PrecisionEngine:
        """The engine of the newest set-up (raises before ``initialize``)."""
        return self._require_newest().engine

    def _require_newest(self) -> SetUp:
        if self._newest is None or not self._newest.live:
            raise AmpUsageError("amp.initialize(model, optimizer, opt_level=...) must be called first")
        return self._newest

    def _setup_for(self, optimizers: list[Optimizer]) -> SetUp | None:
        """The set-up holding these optimizers (one set-up must hold them all); None when none holds them."""
        self._require_newest()
        owners = {id(s): s for optimizer in optimizers for s in self.setups if s.holds(optimizer)}
        if len(owners) > 1:
            raise AmpUsageError(
                "these optimizers were passed to different amp.initialize calls; call scale_loss once per set-up, "
                "with the optimizers that set-up holds"
            )
        return next(iter(owners.values())) if owners else None

    def _engine_for(self, optimizers: list[Optimizer]) -> PrecisionEngine:
        setup = self._setup_for(optimizers)
        return setup.engine if setup is not None else self.engine

    def end_casts(self) -> None:
        """End O1/O4 casting left on this thread: the window after a forward, and contexts that forwards
        interrupted by KeyboardInterrupt left entered (the next forward starts casting again)."""
        end_thread_casts()
        for setup in self.setups:
            setup.unwind()
        self._reopen_process_casts(self._newest)

    @contextlib.contextmanager
    def disable_casts(self) -> Iterator[None]:
        """No O1/O4 casts on this thread inside the block, forwards included (apex's ``amp.disable_casts``)."""
        contexts = [context for setup in self.setups if (context := setup.cast_context) is not None]
        device_types = tuple(dict.fromkeys(d for context in contexts for d in context.device_types))
        with suspend_thread_casts([mode for setup in self.setups for mode in setup.modes_here()], device_types):
            yield

    # ---- per iteration --------------------------------------------------------------------------
    @contextlib.contextmanager
    def scale_loss(
        self,
        loss: torch.Tensor,
        optimizers: Optimizer | list[Optimizer],
        loss_id: int = 0,
        model: nn.Module | None = None,
        delay_unscale: bool = False,
        delay_overflow_check: bool = False,
    ) -> Iterator[torch.Tensor]:
        """``with amp.scale_loss(loss, optimizer) as scaled: scaled.backward()``.

        On exit the new grads are unscaled (into fp32 masters under O2/O5) and checked; an overflow
        halves the scale and makes the next ``optimizer.step()`` a no-op. ``model`` is accepted for
        apex compatibility and unused, as in apex. ``delay_overflow_check=True``: unscale only; the
        caller updates the scale (and skips) with ``_amp_state.loss_scalers[loss_id].update_scale()``.
        """
        check_loss(loss, "amp.scale_loss")
        optimizer_list, _ = _as_list(optimizers, Optimizer, "optimizers")
        setup = self._setup_for(optimizer_list)
        engine = setup.engine if setup is not None else self.engine
        end_thread_casts()
        options = {"delay_unscale": delay_unscale, "delay_overflow_check": delay_overflow_check}
        try:
            with loss_blocks(engine).scale_loss(loss, optimizer_list, loss_id=loss_id, **options) as scaled:
                yield scaled
        finally:
            self._reopen_process_casts(setup or self._newest)

    def forward_context(self) -> AbstractContextManager[Any]:
        """The newest set-up's O1/O4 op-cast context, with device autocast: models from ``initialize``
        enter it on their own; enter it for other code that should cast as a forward does."""
        context = self.engine.forward_context()
        end_thread_casts()
        return context

    def master_params(self, optimizer: Optimizer) -> Iterator[nn.Parameter]:
        """The params ``optimizer`` steps: fp32 masters under O2/O5. Clip these."""
        return self._engine_for([optimizer]).master_params(optimizer)

    # ---- state ----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, dict[str, Any]]:
        """apex's format: ``{"loss_scaler0": {"loss_scale": float, "unskipped": int}, ...}``."""
        return self.engine.precision_state().to_apex_dict()

    def grad_scaler_state_dict(self, loss_id: int = 0) -> dict[str, Any]:
        """Scaler ``loss_id`` in ``torch.amp.GradScaler.state_dict()`` form."""
        return self.engine.grad_scaler_state_dict(loss_id)

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore scalers from apex's format, or (one scaler) from a GradScaler state dict.

        Call after ``initialize``, as apex documents. Nothing changes unless the whole dict is valid.
        """
        load_amp_state(self.engine, state_dict)


default = Amp()
"""The instance behind the module-level functions."""

initialize = default.initialize
scale_loss = default.scale_loss
master_params = default.master_params
state_dict = default.state_dict
load_state_dict = default.load_state_dict
grad_scaler_state_dict = default.grad_scaler_state_dict
forward_context = default.forward_context
end_casts = default.end_casts
disable_casts = default.disable_casts
register_half_function = default.register_half_function
register_float_function = default.register_float_function
register_promote_function = default.register_promote_function
register_bfloat16_function = default.register_bfloat16_function

__all__ = [
    "Amp",
    "SetUp",
    "bfloat16_function",
    "default",
    "disable_casts",
    "end_casts",
    "float_function",
    "forward_context",
    "grad_scaler_state_dict",
    "half_function",
    "initialize",
    "load_state_dict",
    "master_params",
    "promote_function",
    "register_bfloat16_function",
    "register_float_function",
    "register_half_function",
    "register_promote_function",
    "scale_loss",
    "state_dict",
]
