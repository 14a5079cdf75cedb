"""apex's ``with amp.scale_loss(loss, optimizers) as scaled:`` blocks over the opt-level engine.

apex unscaled a backward's gradients and decided the next step's fate when each block closed, one
block per loss. The training loop never works that way (it calls the engine's ``backward`` and
``step``), so the protocol lives here, over the engine's gradient bookkeeping, for the ``amp``
facade and ``ampddp.apex`` only. ``loss_blocks`` picks the implementation for an engine: this one
for the builtin opt levels, NVIDIA apex's own for ``impl='apex'``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from torch.optim import Optimizer

from ampddp.errors import AmpUsageError
from ampddp.precision import ApexEngine, OptLevelEngine, PrecisionEngine, check_loss


def loss_blocks(engine: PrecisionEngine) -> OptLevelLossBlocks | ApexEngine:
    """The ``scale_loss`` blocks of ``engine``; AmpUsageError for the native modes, which have none."""
    if isinstance(engine, OptLevelEngine):
        return OptLevelLossBlocks(engine)
    if isinstance(engine, ApexEngine):
        return engine
    raise AmpUsageError(f"scale_loss is apex's API for opt levels O0-O5; {engine.mode} uses engine.backward(loss) and engine.step")


class OptLevelLossBlocks:
    """apex semantics over an ``OptLevelEngine``: unscale and update the scale when a block exits."""

    def __init__(self, engine: OptLevelEngine) -> None:
        self.engine = engine

    @contextlib.contextmanager
    def scale_loss(
        self,
        loss: torch.Tensor,
        optimizers: Sequence[Optimizer],
        loss_id: int = 0,
        delay_unscale: bool = False,
        delay_overflow_check: bool = False,
    ) -> Iterator[torch.Tensor]:
        """Scale ``loss``; on exit unscale the block's new gradients and decide whether the next step skips.

        ``delay_unscale=True`` leaves them scaled for a later block to unscale with its own; so does a
        backward of a forward run under DDP's ``no_sync`` (gradient accumulation as Hugging Face's Trainer
        does it): DDP all-reduces the accumulated gradients at the next synchronising backward, which
        apex's unscale-at-once had already moved away, so ranks trained apart.
        ``delay_overflow_check=True`` (apex's, for callers that reduce gradients themselves first, as
        NVIDIA's BERT does): unscale, but leave the scale update and the skip decision to the caller's
        ``update_scale()`` on apex's scaler view; the non-finite flags wait in ``scaler.deferred_found_inf``.
        """
        engine = self.engine
        check_loss(loss, "scale_loss")
        scaler = engine.scaler_for(loss_id)
        if not engine.policy.enabled:
            yield loss
            return
        if not optimizers:
            raise AmpUsageError("scale_loss needs the optimizer(s) whose gradients this backward produces")
        records = engine.records_for(optimizers)
        delay_unscale = delay_unscale or engine.forward_under_no_sync
        if engine.passes_through(scaler):
            yield loss.float()
            return
        if not delay_unscale:
            for record in records:
                record.stash_grads()
        try:
            yield scaler.scale_loss(loss)
        except BaseException:
            for record in records:
                record.discard_new_grads()
            raise
        if delay_unscale:
            engine.mark_scaled(records)
            return
        engine.unscale_block(loss_id, records, defer_verdict=delay_overflow_check)
