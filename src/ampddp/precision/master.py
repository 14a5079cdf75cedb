"""Per-optimizer gradient bookkeeping: fp32 master weights, unscaling, skipping.

With master weights (O2/O5) the optimizer's param groups hold fp32 masters in place of the model's
low-precision params; unscaled grads land in the masters' ``.grad`` (fp32) and, after a step, the
masters are copied back into the model with one foreach call. Params that are already fp32 (e.g.
BatchNorm kept fp32) are their own masters. Without master weights every param is its own master.

The masters' fp32 gradients live in buffers made once, at a master's first unscale, and overwritten
in place every step after: allocated afresh each step, the allocator returned them to the OS and the
next step faulted them back (thousands of page faults a step on a CPU, +20% step time on an MLP).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Iterator

import torch
from torch import nn
from torch.optim import Optimizer

from ampddp.errors import AmpUsageError
from ampddp.precision.scaler import LossScaler
from ampddp.precision.shards import holds_dtensors, like_layout, locals_of


class GradPhase(enum.Enum):
    """Where one optimizer's gradients are within a step (as torch's GradScaler ``OptState``)."""

    READY = "ready"
    """No scaled gradients pending: none yet, or a closed ``scale_loss`` block unscaled them."""
    SCALED = "scaled"
    """A backward left scaled gradients that no unscale has seen (``delay_unscale``, ``engine.backward``)."""
    UNSCALED = "unscaled"
    """``unscale_`` (clipping) ran this step: another backward would mix scaled and unscaled gradients."""


class OptimizerGrads:
    """Masters, stashed grads and the step state of one optimizer.

    The step state is ``phase`` (a ``GradPhase``) plus ``skip_pending``, the verdict of a
    ``scale_loss`` block that found non-finite gradients: apex decided the skip when a block closed
    and kept it while later blocks of the same step went through their phases, so it is not a phase.
    ``found_inf`` holds the unscaled gradients' non-finite flag until the verdict reads it.
    """

    def __init__(self, optimizer: Optimizer, make_masters: bool, fp32_data: dict[int, torch.Tensor] | None = None) -> None:
        self.optimizer = optimizer
        self.make_masters = make_masters
        self.model_params: list[nn.Parameter] = []
        self.masters: list[nn.Parameter] = []
        self.in_place: list[nn.Parameter] = []
        self._master_of: dict[int, nn.Parameter] = {}
        self._grad_buffers: dict[int, torch.Tensor] = {}
        """Each master's fp32 gradient buffer (by the master's id), reused step after step."""
        self._groups_seen = 0
        self._sharded = False
        """Whether any param is a DTensor: only then is each tensor's local shard looked up (a per-param cost every step)."""
        self._stash: list[torch.Tensor | None] = []
        self.phase = GradPhase.READY
        self.skip_pending = False
        self.found_inf: torch.Tensor | None = None
        self.sync_param_groups(fp32_data or {})

    def sync_param_groups(self, fp32_data: dict[int, torch.Tensor] | None = None) -> None:
        """Give params of groups added since the last call (``add_param_group``) their masters."""
        groups = self.optimizer.param_groups
        for group in groups[self._groups_seen :]:
            for index, param in enumerate(group["params"]):
                if self.make_masters and param.is_floating_point() and param.dtype != torch.float32:
                    group["params"][index] = self._new_master(param, (fp32_data or {}).get(id(param)))
                else:
                    self.in_place.append(param)
            self._sharded = self._sharded or holds_dtensors(group["params"])
        self._groups_seen = len(groups)

    def _locals(self, tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
        """Each tensor's local shard, as the foreach kernels take them (the tensors themselves when none is a DTensor)."""
        return locals_of(tensors) if self._sharded else list(tensors)

    def _new_master(self, param: nn.Parameter, fp32: torch.Tensor | None) -> nn.Parameter:
        master = nn.Parameter(fp32 if fp32 is not None else param.detach().float(), requires_grad=param.requires_grad)
        state = self.optimizer.state.pop(param, None)
        if state is not None:
            self.optimizer.state[master] = {
                k: v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() and k != "step" else v for k, v in state.items()
            }
        self.model_params.append(param)
        self.masters.append(master)
        self._master_of[id(param)] = master
        return master

    def master_of(self, param: nn.Parameter) -> nn.Parameter | None:
        return self._master_of.get(id(param))

    def master_params(self) -> Iterator[nn.Parameter]:
        """The params the optimizer actually steps, in param-group order."""
        for group in self.optimizer.param_groups:
            yield from group["params"]

    def stash_grads(self) -> None:
        """Set aside already-unscaled grads so the next backward's grads can be unscaled alone."""
        self.sync_param_groups()
        if self.phase is GradPhase.SCALED:
            return
        # Clone: DDP's gradient_as_bucket_view makes p.grad a view the next backward overwrites.
        self._stash = [None if p.grad is None else p.grad.clone() for p in self.in_place]
        for param in self.in_place:
            param.grad = None

    def unscale_(self, scaler: LossScaler) -> None:
        """Unscale the grads produced since the last unscale; add them to any stashed/master grads."""
        self.sync_param_groups()
        new_in_place = [p.grad for p in self.in_place if p.grad is not None]
        pairs = self._new_low_precision_grads()
        if any(g.is_sparse for g in new_in_place) or any(grad.is_sparse for _, grad in pairs):
            raise AmpUsageError(
                "sparse gradients (e.g. nn.Embedding(sparse=True)) are not supported by the opt-level engines; "
                "use sparse=False, or the native-fp16 / native-bf16 modes"
            )
        fp32_copies = [self._fp32_grad_room(master) for master, _ in pairs]
        if fp32_copies:
            torch._foreach_copy_(self._locals(fp32_copies), self._locals(g for _, g in pairs))
        found = scaler.unscale_(new_in_place + fp32_copies)
        self._accumulate_masters(pairs, fp32_copies)
        self.restore_stash()
        if found is not None:
            self.found_inf = found if self.found_inf is None else self.found_inf + found
        self.phase = GradPhase.UNSCALED

    def _new_low_precision_grads(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """(master, its model param's new gradient laid out as the master is) for every model param with one."""
        pairs = [(master, param.grad) for master, param in zip(self.masters, self.model_params) if param.grad is not None]
        return [(master, like_layout(grad, master)) for master, grad in pairs] if self._sharded else pairs

    def _fp32_grad_room(self, master: nn.Parameter) -> torch.Tensor:
        """Where ``master``'s newly unscaled gradient is written: its own buffer, unless that already holds
        this step's earlier gradient (a second unscale in one step: a fresh tensor, added to it)."""
        buffer = self._grad_buffers.get(id(master))
        if buffer is None or buffer.shape != master.shape or buffer.device != master.device:
            buffer = self._grad_buffers[id(master)] = torch.empty_like(master)
        return torch.empty_like(master) if master.grad is buffer else buffer

    def _accumulate_masters(self, pairs: list[tuple[nn.Parameter, torch.Tensor]], fp32_grads: list[torch.Tensor]) -> None:
        fresh, existing, added = [], [], []
        for (master, _), grad in zip(pairs, fp32_grads):
            if master.grad is None:
                fresh.append((master, grad))
            else:
                existing.append(master.grad)
                added.append(grad)
        for master, grad in fresh:
            master.grad = grad
        if existing:
            torch._foreach_add_(self._locals(existing), self._locals(added))
        for param in self.model_params:
            param.grad = None

    def restore_stash(self) -> None:
        for param, old in zip(self.in_place, self._stash):
            if old is None:
                continue
            if param.grad is None:
                param.grad = old
            else:
                param.grad.add_(old)
        self._stash = []

    def param_pairs(self) -> Iterator[tuple[nn.Parameter, nn.Parameter]]:
        """(model param, param the optimizer steps) for every param of this optimizer."""
        yield from zip(self.model_params, self.masters)
        for param in self.in_place:
            yield param, param

    def discard_new_grads(self) -> None:
        """Undo a backward that raised: drop its grads and bring back the stashed ones."""
        for param in self.in_place:
            param.grad = None
        for param in self.model_params:
            param.grad = None
        if self.phase is GradPhase.SCALED:
            self.phase = GradPhase.READY
        self.restore_stash()

    def discard_grads(self) -> None:
        """Forget every pending gradient and per-step flag (the optimizer zeroes its own grads)."""
        for param in self.model_params:
            param.grad = None
        self._stash = []
        self.reset_step_state()

    def drop_grads(self) -> None:
        """Make the next ``step`` a no-op: torch optimizers skip params whose grad is None."""
        for param in self.master_params():
            param.grad = None
        for param in self.model_params:
            param.grad = None

    def check_ready_to_step(self) -> None:
        if self.phase is GradPhase.SCALED:
            raise AmpUsageError(
                "optimizer.step() called while gradients are still scaled (after scale_loss(..., delay_unscale=True), "
                "a backward under DDP's no_sync, which all-reduces nothing, or engine.backward). Finish with a "
                "scale_loss(..., delay_unscale=False) call, or step through "
                "engine.step(optimizer), which unscales first."
            )
        if any(p.grad is not None for p in self.model_params):
            raise AmpUsageError(
                "optimizer.step() found low-precision model gradients that were never unscaled into the fp32 "
                "master weights: call backward inside `with amp.scale_loss(loss, optimizer) as scaled: "
                "scaled.backward()` (or engine.backward(loss)) instead of loss.backward()."
            )

    @torch.no_grad()
    def adopt_model_writes(self) -> bool:
        """Masters of params whose model value was overwritten after set-up take the model's value.

        A model param that differs from its master in the model dtype was written by someone else
        since the masters were made (DDP's broadcast of rank 0's weights, an in-place edit); apex
        made masters lazily at the first step and so followed such writes. One host read.
        """
        if not self.model_params:
            return False
        params, masters = locals_of(self.model_params), locals_of(self.masters)
        device = masters[0].device
        differs = torch.stack([(p != m.to(p.dtype)).any().to(device) for p, m in zip(params, masters)])
        changed = differs.tolist()
        for param, master, stale in zip(params, masters, changed):
            if stale:
                master.copy_(param)
        return any(changed)

    @torch.no_grad()
    def copy_master_values_to_model(self) -> None:
        """Model params take their masters' values (grads untouched)."""
        if self.model_params:
            torch._foreach_copy_(self._locals(self.model_params), self._locals(self.masters))

    @torch.no_grad()
    def copy_masters_to_model(self) -> None:
        """After a step: model params take the masters' values; the masters' grads are consumed."""
        self.copy_master_values_to_model()
        for master in self.masters:
            master.grad = None

    def close_block(self, skip: bool) -> None:
        """A ``scale_loss`` block's gradients are unscaled and judged: nothing scaled pends, and a skip found now holds
        until the step (apex decided a step's fate as each block closed, and kept it through the step's later blocks)."""
        self.found_inf, self.phase = None, GradPhase.READY
        self.skip_pending = self.skip_pending or skip

    def reset_step_state(self) -> None:
        """A step ended (taken or skipped): the next one starts from nothing pending."""
        self.phase = GradPhase.READY
        self.skip_pending = False
        self.found_inf = None
