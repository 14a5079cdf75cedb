"""The training loop: the one place that knows the order of a step; everything else is a part.

Each optimizer step: forward in the engine's context, scaled backward per micro-batch (gradient sync
only on the last), two flags agreed over the ranks (a non-finite loss, a stop request; riding the
gradients' all-reduce under torch DDP over gloo), unscale -> clip -> step -> scale update, and the LR
scheduler advances only when the step was applied; the loss is summed over the ranks when a record is
written. The loop never branches on the precision mode: it calls the engine's interface.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer
from torch.utils.data import Dataset

from ampddp.checkpoint.store import CheckpointRef
from ampddp.distributed.data import PendingSum, ResumableSampler, gather_objects
from ampddp.distributed.gradient_rider import GradientRider
from ampddp.errors import BadSamplesError, ConfigError
from ampddp.precision.engine import PrecisionEngine
from ampddp.preemption import StopSignals
from ampddp.prepare import Prepared
from ampddp.training.batches import BatchAdapter, LossFn
from ampddp.training.callbacks import Callbacks
from ampddp.training.checkpointer import Checkpointer, ResumePlan
from ampddp.training.device import DeviceSettings
from ampddp.training.evaluator import EvaluationStopped, Evaluator
from ampddp.training.last_batch import check_single_sample_batch, epochs_to_finish
from ampddp.training.loading import DataLoading, InputTimer, LoaderSettings, name_batch_rows
from ampddp.training.log_window import LogWindow
from ampddp.training.nonfinite import NonFiniteGuard, blame_inputs, non_finite_rows
from ampddp.training.phase import AGREEING, BACKWARD, CHECKPOINT, EVALUATION, FORWARD, OPTIMIZER, StepPhase, out_of_memory
from ampddp.training.progress import Progress, finished
from ampddp.training.settings import LoopSettings
from ampddp.training.step_agreement import StepAgreement
from ampddp.training.stopping import StopAgreement

logger = logging.getLogger("ampddp.trainer")


class TrainingLoop:
    """Trains ``run`` on ``train_set`` following ``settings``, with the given parts.

    ``stop_signals``: a ``StopSignals`` already catching (the caller's), or signal names to catch
    during ``fit``. Override ``compute_loss`` for a loss that needs more than ``loss_fn``.
    """

    def __init__(self, run: Prepared, train_set: Dataset, settings: LoopSettings, *, checkpointer: Checkpointer,
                 loss_fn: LossFn, batches: BatchAdapter, loading: DataLoading | None = None, evaluator: Evaluator | None = None,
                 callbacks: Callbacks | None = None, stop_signals: tuple[str, ...] | StopSignals = (),
                 device: DeviceSettings | None = None) -> None:  # fmt: skip
        self.run, self.train_set, self.settings = run, train_set, settings
        self.checkpointer, self.loss_fn, self.batches, self.evaluator = checkpointer, loss_fn, batches, evaluator
        self.loading = loading or DataLoading(LoaderSettings(), run.env.device, settings.seed, run.env.rank_seed(settings.seed))
        self.input_timer = InputTimer()
        self.log_window = LogWindow()
        self._first_step_logged = False
        self.device = device or DeviceSettings()
        self.callbacks = callbacks or Callbacks()
        self.stopping = StopAgreement(stop_signals)
        """The run's stop signals: caught while training runs, voted on in the step's all-reduce."""
        self.guard = NonFiniteGuard(settings.max_nonfinite_losses)
        self.last_eval: dict[str, float] = {}
        self._evaluated_step: int | None = None
        self.phase = StepPhase()
        """Where this rank is in its step (read by the peer watch, named by an out-of-memory error)."""

    @property
    def engine(self) -> PrecisionEngine:
        return self.run.engine

    @property
    def optimizer(self) -> Optimizer:
        return self.run.optimizer

    @property
    def scheduler(self) -> Any:
        return self.checkpointer.state.scheduler

    @property
    def sampler(self) -> ResumableSampler:
        return self.checkpointer.state.sampler

    @property
    def progress(self) -> Progress:
        return self.checkpointer.state.progress

    def fit(self) -> dict[str, Any]:
        """Train until the horizon or a stop signal; returns progress, last evaluation and summary
        (``preempted`` names the signal when the run stopped early, after writing a checkpoint; one
        agreed on the last step stops nothing: the run ends as an uninterrupted one, evaluated)."""
        try:
            return self._fit()
        except BaseException as error:
            self.callbacks.on_exception(self.progress, error)  # the progress bar, open loggers: released, marked failed
            ran_out = out_of_memory(error, self.phase, self.settings.batch_size, self.run.env.device)
            if ran_out is not None:
                raise ran_out from error
            raise
        finally:
            self.loading.close()  # the training loader's workers: stopped with the run, never left to exit

    def _fit(self) -> dict[str, Any]:
        self.checkpointer.resume_if_asked(self._is_finished)
        if self.checkpointer.saved_step is not None and self._finished():
            return self._already_complete()
        self._check_last_batch()
        self.callbacks.on_start(self.progress)
        with self.device.backend_flags(self.run.env.device):  # the final evaluation too
            with self.stopping.training():
                preempted = self._train_until_done()
            if not preempted and self.evaluator is not None and self._evaluated_step != self.progress.global_step:
                self._evaluate_and_report()  # a run that ended without a step (max_steps=0); the last step evaluates itself
        if self.checkpointer.saved_step != self.progress.global_step:
            self.save_checkpoint()
        summary = self.callbacks.on_end(self.progress)
        if preempted:
            logger.warning("stopped by %s at step %d after writing a checkpoint; run again to resume", preempted, self.progress.global_step)
        return {"progress": self.progress.state_dict(), "eval": self.last_eval, "summary": {**summary, "preempted": preempted}}

    def _check_last_batch(self) -> None:
        """An epoch ending in a batch the training step cannot take fails now, not an epoch in."""
        epochs = epochs_to_finish(self.progress, self.sampler, self.settings)
        with torch.no_grad():
            check_single_sample_batch(self.train_set, epochs, self.settings.batch_size, self._forward_loss, self.run.module, self.run.env)

    def _forward_loss(self, batch: Any) -> tuple[torch.Tensor, int]:
        """``compute_loss`` of ``batch`` as the step's schedule runs a whole-model forward."""
        return self.run.schedule.forward(lambda: self.compute_loss(batch))

    def _already_complete(self) -> dict[str, Any]:
        """A re-run of a finished run: say so, change nothing (no evaluation, no summary rewrite)."""
        logger.info("already complete at step %d (epoch %d): nothing to train", self.progress.global_step, self.progress.epoch)
        summary = self.callbacks.on_already_complete(self.progress)
        return {"progress": self.progress.state_dict(), "eval": {}, "summary": {**summary, "already_complete": True, "preempted": None}}

    def _train_until_done(self) -> str | None:
        settings = self.settings
        loader = self.loading.train_loader(self.train_set, self.sampler, settings.batch_size)  # once: workers persist
        while not self._finished():
            self.sampler.set_epoch(self.progress.epoch, start=self.progress.epoch_position)
            last = len(loader) - 1
            if last < 0:
                self._end_epoch()
                continue
            window: list[Any] = []
            with contextlib.closing(self.input_timer.batches(loader)) as batches:  # workers of a non-persistent loader stop with the epoch
                for index, batch in enumerate(self.phase.loading(batches, self._step_number)):
                    window.append(batch)
                    if len(window) == settings.grad_accum_steps or index == last:
                        stop_agreed = self._optimizer_step(window, index + 1 - len(window), ends_epoch=index == last)
                        if self._finished():
                            break  # a stop on the last step: the run ended (evaluated) as it would have anyway
                        if stop_agreed or self.stopping.evaluation_stopped:
                            return self.stopping.reason()
                        window = []
        return None

    def _step_number(self) -> int:
        """The optimizer step under way (the one after the last applied)."""
        return self.progress.global_step + 1

    def _is_finished(self, progress: Progress) -> bool:
        return finished(progress, self.settings.max_steps, self.settings.max_epochs)

    def _finished(self) -> bool:
        return self._is_finished(self.progress)

    def compute_loss(self, batch: Any) -> tuple[torch.Tensor, int]:
        """Forward one micro-batch; return the mean loss and the number of samples in it."""
        batch = self.batches.to_device(batch, self.run.env.device)
        with self.engine.forward_context():
            loss = self.loss_fn(self.batches.forward(self.run.model, batch), batch)
        return loss, self.batches.count(batch)

    def _end_epoch(self) -> None:
        self.progress.epoch += 1
        self.progress.epoch_position = 0
        if self.evaluator is not None:
            self._evaluate_and_report()

    def _evaluate_and_report(self) -> None:
        if self.evaluator is None:
            raise ConfigError("evaluate() needs an eval_set")
        self.phase.enter(EVALUATION, self.progress.global_step)
        try:
            self.last_eval = self.evaluator.evaluate(
                self.run.model, self.engine.forward_context, self.stopping.evaluation_asks(self._finished())
            )
        except EvaluationStopped:
            self.stopping.stop_evaluating(self.progress.global_step, self._finished(), self.checkpointer.saved_step)
            return
        self._evaluated_step = self.progress.global_step
        logger.debug("step %d epoch %d: %s", self.progress.global_step, self.progress.epoch, self.last_eval)
        self.callbacks.on_evaluation(self.progress, self.last_eval)

    def evaluate(self) -> dict[str, float]:
        """Loss and metrics over the whole eval set, every sample counted exactly once."""
        if self.evaluator is None:
            raise ConfigError("evaluate() needs an eval_set")
        return self.evaluator.evaluate(self.run.model, self.engine.forward_context)

    # ---- one optimizer step -----------------------------------------------------------------------
    def _optimizer_step(self, window: list[Any], first: int, ends_epoch: bool) -> bool:
        """One optimizer step over ``window`` (batches ``first``... of this pass); returns True when
        every rank should stop (a signal)."""
        step = self._step_number()
        counts = self._global_counts(window)  # in flight while the first forward runs (when it needs a reduce)
        agreement = StepAgreement(self.run.env, self.stopping, self._gradient_rider)
        loss_sum = self._forward_backward(window, first, counts, agreement)
        total = counts.result()[0]
        self.phase.enter(AGREEING, step)
        agreement.start(loss_sum)  # where the schedule did not start it before its last backward (a pipeline's)
        verdict = agreement.verdict()
        self.log_window.add(verdict.loss_sum, self.run.schedule.loss_copies(self._readers), total, verdict.finite, self._tokens(window))
        self.guard.check(verdict.finite, self.progress.global_step + 1, lambda: self._diagnose(window, first))
        logging_step = (self.progress.global_step + 1) % self.settings.log_every == 0 or not self._first_step_logged
        self._first_step_logged = True  # the first step this process trains is recorded: progress shows at once
        self.phase.enter(OPTIMIZER, step)
        grad_norm, stepped = self._apply(logging_step)
        if not stepped and verdict.finite:
            logger.warning("step %d skipped: %s", self.progress.global_step + 1, self._diagnose(window, first))
        self._advance(int(total), stepped)
        record = self._record(stepped, grad_norm) if logging_step or not stepped else None
        self.callbacks.on_step(self.progress, record)
        self._after_step(ends_epoch)
        return verdict.stop

    def _global_counts(self, window: list[Any]) -> PendingSum:
        """The window's samples over every data rank, which the first backward needs. Counted as the
        default adapter counts (a batch's leading size), every data rank holds as many: the sampler pads
        each rank's share of an epoch to the same length, and the loader cuts it into the same batches, so
        the total is known here. An adapter counting its own way (samples it keeps, say) may count
        differently on each rank: then one all-reduce, started now and awaited by the first backward."""
        local = sum(self.batches.count(batch) for batch in window)
        if type(self.batches).count is BatchAdapter.count:
            return PendingSum([local * self.run.data_shard.size], reduce=False)
        return PendingSum([local], self.run.data_shard.group)

    def _forward_backward(self, window: list[Any], first: int, counts: PendingSum, agreement: StepAgreement) -> torch.Tensor:
        """The window's gradients, run by the step's schedule (the strategy's: ``run.schedule``), each
        micro-batch's loss weighted by its share of the global batch (exact with uneven counts:
        ``counts`` summed over the data ranks); returns the local sum of per-sample losses. Where the
        gradients ride with the step's flags, their all-reduce sums these shares (nothing left to divide)."""
        self.optimizer.zero_grad(set_to_none=True)
        step = self._step_number()
        rider = self._gradient_rider
        averaged_over = 1 if rider is not None else self.run.data_shard.size
        weighted = WeightedBackward(self.engine, self.phase, step, counts, averaged_over, agreement)
        with rider.summing() if rider is not None else contextlib.nullcontext():
            return self.run.schedule.forward_backward(window, MicroBatchLoss(self, step, first), weighted)

    @functools.cached_property
    def _gradient_rider(self) -> GradientRider | None:
        """Where the step's flags travel with the gradients (the strategy's say; a DDP hook, made at the first step)."""
        return self.run.strategy.gradient_rider(self.run.model)

    @functools.cached_property
    def _readers(self) -> int:
        """The ranks that read each data coordinate's batches (its tensor-parallel and pipeline ranks)."""
        return self.run.env.world_size // self.run.data_shard.size

    def _tokens(self, window: list[Any]) -> float:
        return float(sum(self.batches.tokens(batch) for batch in window))

    def _apply(self, logging_step: bool) -> tuple[torch.Tensor | None, bool]:
        """Clip (or measure, on logging steps) the gradient norm, step, advance the LR schedule."""
        grad_norm = None
        if self.settings.clip_grad_norm is not None:
            grad_norm = self.engine.clip_grad_norm_([self.optimizer], self.settings.clip_grad_norm)
        elif logging_step:
            grad_norm = self.engine.grad_norm([self.optimizer])
        stepped = self.engine.step(self.optimizer)
        if stepped and self.scheduler is not None:
            self.scheduler.step()
        return grad_norm, stepped

    def _advance(self, samples: int, stepped: bool) -> None:
        progress = self.progress
        progress.global_step += 1
        progress.skipped_steps += int(not stepped)
        progress.samples_seen += samples
        progress.epoch_position = min(progress.epoch_position + samples, len(self.train_set))

    def _record(self, stepped: bool, grad_norm: torch.Tensor | None) -> dict[str, Any]:
        progress = self.progress
        window = self.log_window.take(self._readers)  # one all-reduce, at the same step on every rank
        return {
            "step": progress.global_step, "epoch": progress.epoch, "loss": window.pop("loss"),
            "lr": self.optimizer.param_groups[0]["lr"], "loss_scale": self.engine.loss_scale(),
            "skipped": not stepped, "skipped_steps": progress.skipped_steps,
            "grad_norm": None if grad_norm is None or not stepped else float(grad_norm),
            "data_wait_s": self.input_timer.take(progress.global_step),
            **window,  # loss_mean over the steps since the last record; tokens (-> tokens/s)
        }  # fmt: skip

    def _after_step(self, ends_epoch: bool) -> None:
        """Epoch end and evaluation, then the checkpoint: the last step is evaluated before it is
        saved, so a checkpoint of a finished run always follows its final evaluation (a run killed
        during that evaluation resumes from an earlier checkpoint and evaluates)."""
        step, every = self.progress.global_step, self.settings
        if ends_epoch:
            self._end_epoch()
        elif self.evaluator is not None and (self._finished() or (every.eval_every and step % every.eval_every == 0)):
            self._evaluate_and_report()
        if every.checkpoint_every and step % every.checkpoint_every == 0 and not self.stopping.evaluation_stopped:
            self.save_checkpoint()

    def _diagnose(self, window: list[Any], first: int) -> str:
        """Why the step over ``window`` (batches ``first``... of this pass) went non-finite. Every rank
        calls it (the loss is agreed), and every rank learns of bad inputs on any rank, so all of them
        blame the data and none runs the diagnostic forward alone (a synchronised BatchNorm in it
        would wait for ranks that do not come)."""
        named = [self._samples(first + index, rows) for index, batch in enumerate(window) if (rows := non_finite_rows(batch))]
        if self.run.env.distributed:
            everywhere = gather_objects(named, self.run.env)
            named = [f"rank {rank}: {samples}" for rank, on_rank in enumerate(everywhere) for samples in on_rank]
        batch = self.batches.to_device(window[-1], self.run.env.device)
        module = self.run.module
        runs = self.run.model if self.run.strategy.forwards_through_model else module  # a pipeline's stages: the pipeline
        forward = lambda: self.run.schedule.forward(lambda: self.batches.forward(runs, batch))  # noqa: E731 - re-run by the diagnosis
        return self.guard.diagnose(module, forward, self.engine.forward_context(), self.engine.last_overflow, blame_inputs(named))

    def _samples(self, batch_number: int, rows: list[int] | tuple[int, ...]) -> str:
        """``rows`` of this pass's batch ``batch_number`` named by their dataset indices."""
        return name_batch_rows(self.sampler, self.settings.batch_size, batch_number, rows, "training", f" (epoch {self.sampler.epoch})")

    def state_dict(self) -> dict[str, Any]:
        """Everything shared by the ranks, in checkpoint layout (see ampddp.checkpoint.keys)."""
        return self.checkpointer.state_dict()

    def save_checkpoint(self) -> CheckpointRef | None:
        """Write a checkpoint of this step collectively (every file hashed into its manifest)."""
        self.phase.enter(CHECKPOINT, self.progress.global_step)
        return self.checkpointer.save()

    def load_checkpoint(self, ref: CheckpointRef) -> None:
        """Restore every registered item from ``ref`` (see ``Checkpointer.load``)."""
        self.checkpointer.load(ref, self._is_finished)

    def plan_resume(self) -> ResumePlan | None:
        """Read and check, now, the checkpoint ``fit`` will continue from (None: a fresh start), changing
        nothing: a bad or unfitting checkpoint fails before anything is written (``Checkpointer.plan_resume``)."""
        return self.checkpointer.plan_resume(self._is_finished)


class MicroBatchLoss:
    """A micro-batch's forward and loss as the loop computes them (``compute_loss``), a bad sample named by its index in
    the pass (window ``first``...); ``forward`` alone for a schedule whose first stage reads the inputs itself."""

    def __init__(self, loop: TrainingLoop, step: int, first: int) -> None:
        self.loop, self.step, self.first = loop, step, first

    def __call__(self, index: int, batch: Any) -> tuple[torch.Tensor, int]:
        loop = self.loop
        loop.phase.enter(FORWARD, self.step)
        try:
            return loop.compute_loss(batch)
        except BadSamplesError as error:
            raise error.named(loop._samples(self.first + index, error.rows)) from error

    def forward(self, module: nn.Module, batch: Any) -> Any:
        loop = self.loop
        loop.phase.enter(FORWARD, self.step)
        return loop.batches.forward(module, loop.batches.to_device(batch, loop.run.env.device))


class WeightedBackward:
    """A micro-batch's backward, its mean loss weighted by its share of the global batch: ``count`` samples of the
    ``counts`` summed over the data ranks (exact with uneven micro-batches), as a step's schedule asks for it, times
    ``averaged_over``: the ranks the gradients' reduction then divides by (1 where it sums)."""

    def __init__(self, engine: PrecisionEngine, phase: StepPhase, step: int, counts: PendingSum, averaged_over: int,
                 agreement: StepAgreement) -> None:  # fmt: skip
        self.engine, self.phase, self.step, self.counts, self.averaged_over = engine, phase, step, counts, averaged_over
        self.agreement = agreement

    def _weighted(self, loss: torch.Tensor, count: int) -> torch.Tensor:
        self.phase.enter(AGREEING, self.step)
        weight = count * self.averaged_over / self.counts.result()[0]
        self.phase.enter(BACKWARD, self.step)
        return loss * weight if weight != 1.0 else loss

    def __call__(self, loss: torch.Tensor, count: int) -> None:
        self.engine.backward(self._weighted(loss, count))

    def scaled(self, loss: torch.Tensor, count: int) -> torch.Tensor:
        return self.engine.scale_for_backward(self._weighted(loss, count))

    def done(self) -> None:
        self.engine.backward_done()

    def losses_known(self, loss_sum: torch.Tensor) -> None:
        self.agreement.start(loss_sum, backward_pending=True)
