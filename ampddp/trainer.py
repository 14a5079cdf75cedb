"""A small, explicit training loop built from the precision engine, distributed layer and checkpoints.

The trainer never branches on the precision mode: it calls the engine interface. Each optimizer
step: forward in the engine's context, scaled backward per micro-batch (gradient sync only on the
last), unscale -> clip -> step -> scale update, and the LR scheduler advances only when the step
was applied. Checkpoints every ``checkpoint_every`` steps and always at the end; ``resume="auto"``
continues from the newest complete checkpoint in ``run_dir`` exactly where it stopped.
"""

from __future__ import annotations

import contextlib
import logging
import math
import platform
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.optim import Optimizer
from torch.utils.data import DataLoader, Dataset

from ampddp.checkpoint import keys
from ampddp.checkpoint.changes import check_resume_settings
from ampddp.checkpoint.finite import refuse_non_finite
from ampddp.checkpoint.restore import (
    check_model_state,
    check_optimizer_state,
    check_sampler_state,
    initial_weights,
    load_model_state,
    restore_precision,
)
from ampddp.checkpoint.rng import capture_rng, derive_rng, restore_rng
from ampddp.checkpoint.schedule_plan import SchedulePlan, plan_schedule
from ampddp.checkpoint.store import CheckpointRef, CheckpointStore, find_checkpoint, plan_resume
from ampddp.compile_model import ModelCompiler
from ampddp.diagnostics import first_non_finite_module
from ampddp.distributed.data import ResumableSampler, broadcast_from_main, eval_sampler, sum_across_ranks
from ampddp.distributed.env import DistEnv, detect_env, seed_everything
from ampddp.errors import CheckpointError, ConfigError, NonFiniteGradientsError
from ampddp.models import has_convolutions
from ampddp.observe import RunObserver
from ampddp.precision.registry import OpRegistry
from ampddp.preemption import DEFAULT_STOP_SIGNALS, StopSignals, parse_signals
from ampddp.prepare import prepare
from ampddp.progress import Progress, finished

logger = logging.getLogger("ampddp.trainer")
FP16_MODES = ("O1", "O2", "O3", "native-fp16")
RESUME_CHOICES = ("auto", "never")


def _versions() -> dict[str, str]:
    from ampddp import __version__

    return {"ampddp": __version__, "torch": str(torch.__version__), "python": platform.python_version()}


def _check_settings(**settings: Any) -> None:
    """Reject bad trainer arguments before anything is built."""
    required = ("batch_size", "grad_accum_steps", "max_epochs", "log_every", "max_nonfinite_losses")
    for name in (*required, "max_steps", "checkpoint_every", "eval_every"):
        value = settings[name]
        if value is None and name not in required:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{name}={value!r} is not valid; it must be an integer >= 1" + ("" if name in required else " or None"))
    clip = settings["clip_grad_norm"]
    if clip is not None and (isinstance(clip, bool) or not isinstance(clip, (int, float)) or not math.isfinite(clip) or clip <= 0):
        raise ConfigError(f"clip_grad_norm={clip!r} is not valid; it must be a finite number > 0 or None")
    resume = settings["resume"]
    if not isinstance(resume, (str, Path)) or (str(resume) not in RESUME_CHOICES and not Path(resume).exists()):
        raise ConfigError(f"resume={resume!r} is not valid; valid: {', '.join(RESUME_CHOICES)}, or the path of a checkpoint or run dir")


def default_loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(outputs.float(), targets)


class Trainer:
    """Train ``model`` on ``train_set`` (items ``(input, target)``); evaluate on ``eval_set``.

    ``make_optimizer(params)`` and ``make_scheduler(optimizer)`` build the optimizer and LR
    scheduler after the model is prepared. Override ``compute_loss`` for custom losses.
    ``compile``: False (eager), True or a torch.compile mode (the inductor backend), or a
    ``ModelCompiler``; the prepared model is compiled for training and evaluation, checkpoints hold
    the bare module's state either way.
    """

    def __init__(
        self,
        model: nn.Module,
        make_optimizer: Callable[[Iterable[nn.Parameter]], Optimizer],
        train_set: Dataset,
        *,
        eval_set: Dataset | None = None,
        env: DistEnv | None = None,
        precision: str = "O1",
        impl: str = "builtin",
        precision_overrides: dict[str, Any] | None = None,
        registry: OpRegistry | None = None,
        sync_bn: str = "off",
        strategy: str = "ddp",
        compile: bool | str | ModelCompiler | None = False,
        batch_size: int = 32,
        grad_accum_steps: int = 1,
        clip_grad_norm: float | None = None,
        make_scheduler: Callable[[Optimizer], Any] | None = None,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = default_loss,
        max_epochs: int = 1,
        max_steps: int | None = None,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = False,
        run_dir: str | Path | None = None,
        checkpoint_every: int | None = None,
        keep_last: int | None = 3,
        resume: str | Path = "auto",
        init_from: str | Path | None = None,
        config: dict[str, Any] | None = None,
        eval_every: int | None = None,
        log_every: int = 10,
        max_nonfinite_losses: int = 10,
        observer: RunObserver | None = None,
        stop_signals: tuple[str, ...] | StopSignals = DEFAULT_STOP_SIGNALS,
    ) -> None:
        _check_settings(
            batch_size=batch_size, grad_accum_steps=grad_accum_steps, max_epochs=max_epochs, max_steps=max_steps,
            checkpoint_every=checkpoint_every, eval_every=eval_every, log_every=log_every, max_nonfinite_losses=max_nonfinite_losses,
            clip_grad_norm=clip_grad_norm, resume=resume,
        )  # fmt: skip
        if checkpoint_every is not None and run_dir is None:
            raise ConfigError("checkpoint_every needs a run_dir to write checkpoints into")
        self.compiler = compile if isinstance(compile, ModelCompiler) else ModelCompiler.from_setting(compile)
        self.env = env or detect_env(device="auto")
        seed_everything(seed)
        if init_from is not None:
            load_model_state(initial_weights(init_from), model, str(init_from))
        if self.env.device.type == "cpu" and precision in FP16_MODES and has_convolutions(model):
            logger.warning(
                "precision %s on CPU with convolutions: fp16 convolution backward is about 60x slower than fp32 on CPU in current "
                "PyTorch; prefer O4, O5 or native-bf16 there (fp16 pays off on CUDA)",
                precision,
            )
        self.run = prepare(
            model, make_optimizer, self.env, precision=precision, impl=impl, precision_overrides=precision_overrides,
            registry=registry, sync_bn=sync_bn, strategy=strategy,
        )  # fmt: skip
        if self.compiler is not None:  # last: the set-up (cast, masters, DDP) is what gets compiled
            self.run = self.compiler.compile(self.run, on_first_step=self._compiled)
        self.engine, self.optimizer = self.run.engine, self.run.optimizer
        self.scheduler = make_scheduler(self.optimizer) if make_scheduler is not None else None
        self.train_set, self.eval_set, self.loss_fn = train_set, eval_set, loss_fn
        self.batch_size, self.grad_accum_steps, self.clip_grad_norm = batch_size, grad_accum_steps, clip_grad_norm
        self.max_epochs, self.max_steps, self.seed = max_epochs, max_steps, seed
        self.sampler = ResumableSampler(train_set, self.env, shuffle=shuffle, seed=seed, drop_last=drop_last)
        self.store = CheckpointStore(run_dir, keep_last) if run_dir is not None else None
        self.checkpoint_every = checkpoint_every
        self.resume = resume
        self.config = dict(config or {})
        self.eval_every, self.log_every, self.max_nonfinite_losses = eval_every, log_every, max_nonfinite_losses
        self.observer = observer
        self.stop_signals = stop_signals
        if not isinstance(stop_signals, StopSignals):
            parse_signals(stop_signals)
        self._nonfinite_losses = 0
        self._first_nonfinite_where = ""
        self.progress = Progress()
        self.last_eval: dict[str, float] = {}
        self._saved_step: int | None = None
        self._evaluated_step: int | None = None
        seed_everything(self.env.rank_seed(seed))

    # ---- the loop -------------------------------------------------------------------------------
    def fit(self) -> dict[str, Any]:
        """Train until ``max_epochs`` or ``max_steps``, or until a stop signal arrives.

        Returns the final progress, evaluation and summary; ``preempted`` names the signal when the
        run stopped early (after writing a checkpoint to resume from).
        """
        self._maybe_resume()
        if self._saved_step is not None and self._finished():
            return self._already_complete()
        if self.observer is not None:
            self.observer.started(self.progress.global_step, self.progress.epoch, self.progress.samples_seen)
        own = not isinstance(self.stop_signals, StopSignals)
        stop = StopSignals(self.stop_signals) if own else self.stop_signals
        with stop if own else contextlib.nullcontext():
            preempted = self._train_until_done(stop)
        if not preempted and self.eval_set is not None and self._evaluated_step != self.progress.global_step:
            self._evaluate_and_report()
        if self._saved_step != self.progress.global_step:
            self.save_checkpoint()
        summary = self.observer.close(self.progress.state_dict()) if self.observer is not None else {}
        if preempted:
            logger.warning("stopped by %s at step %d after writing a checkpoint; run again to resume", preempted, self.progress.global_step)
        return {"progress": self.progress.state_dict(), "eval": self.last_eval, "summary": {**summary, "preempted": preempted}}

    def _already_complete(self) -> dict[str, Any]:
        """A re-run of a finished run: say so, change nothing (no evaluation, no summary rewrite)."""
        logger.info("already complete at step %d (epoch %d): nothing to train", self.progress.global_step, self.progress.epoch)
        summary = self.observer.close_unchanged() if self.observer is not None else {}
        return {"progress": self.progress.state_dict(), "eval": {}, "summary": {**summary, "already_complete": True, "preempted": None}}

    def _train_until_done(self, stop: StopSignals) -> str | None:
        while not self._finished():
            self.sampler.set_epoch(self.progress.epoch, start=self.progress.epoch_position)
            loader = DataLoader(self.train_set, batch_size=self.batch_size, sampler=self.sampler, generator=torch.Generator())
            last = len(loader) - 1
            if last < 0:
                self._end_epoch()
                continue
            window: list[Any] = []
            for index, batch in enumerate(loader):
                window.append(batch)
                if len(window) == self.grad_accum_steps or index == last:
                    if self._optimizer_step(window, ends_epoch=index == last, stop=stop):
                        return stop.received or "a stop signal on another rank"
                    window = []
                    if self._finished():
                        break
        return None

    def _finished(self) -> bool:
        return finished(self.progress, self.max_steps, self.max_epochs)

    def compute_loss(self, batch: Any) -> tuple[torch.Tensor, int]:
        """Forward one micro-batch; return the mean loss and the number of samples in it."""
        inputs, targets = (t.to(self.env.device, non_blocking=True) for t in batch)
        with self.engine.forward_context():
            loss = self.loss_fn(self.run.model(inputs), targets)
        return loss, len(targets)

    def _compiled(self, seconds: float) -> None:
        """The first compiled forward and backward ended (inside the step about to be counted)."""
        if self.observer is not None and self.compiler is not None:
            self.observer.compiled(self.progress.global_step + 1, self.progress.epoch, seconds, self.compiler.mode, self.compiler.backend)

    def _end_epoch(self) -> None:
        self.progress.epoch += 1
        self.progress.epoch_position = 0
        if self.eval_set is not None:
            self._evaluate_and_report()

    def _evaluate_and_report(self) -> None:
        self.last_eval = self.evaluate()
        self._evaluated_step = self.progress.global_step
        logger.debug("step %d epoch %d: %s", self.progress.global_step, self.progress.epoch, self.last_eval)
        if self.observer is not None:
            self.observer.evaluation(self.progress.global_step, self.progress.epoch, self.last_eval)

    def _optimizer_step(self, window: list[Any], ends_epoch: bool, stop: StopSignals | None = None) -> bool:
        """One optimizer step over ``window``; returns True when every rank should stop (a signal)."""
        local = [len(batch[-1]) for batch in window]
        total = float(sum_across_ranks(sum(local)).item()) if self.env.distributed else float(sum(local))
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum: torch.Tensor | None = None
        for index, batch in enumerate(window):
            with self.run.grad_sync.micro_step(is_last=index == len(window) - 1):
                loss, count = self.compute_loss(batch)
                # Weight each micro-batch by its share of the global batch: exact with uneven counts.
                weight = count * self.env.world_size / total
                self.engine.backward(loss * weight if weight != 1.0 else loss)
            share = loss.detach().float() * count
            loss_sum = share if loss_sum is None else loss_sum + share
        # The global mean loss, read before the step: every rank takes the same decisions below, and
        # a non-finite loss is traced to its module while the weights are still those that made it.
        # One all-reduce carries the loss and whether any rank received a stop signal.
        local_stop = float(stop is not None and stop.received is not None)
        if self.env.distributed:
            reduced = sum_across_ranks(torch.tensor([loss_sum.item(), local_stop], dtype=torch.float64))
            loss_total, stop_agreed = float(reduced[0]), bool(reduced[1] > 0)
        else:
            loss_total, stop_agreed = loss_sum.item(), local_stop > 0
        loss_value = loss_total / max(total, 1.0)
        self._check_loss(loss_value, window[-1])
        logging_step = (self.progress.global_step + 1) % self.log_every == 0
        grad_norm = None
        if self.clip_grad_norm is not None:
            grad_norm = self.engine.clip_grad_norm_([self.optimizer], self.clip_grad_norm)
        elif logging_step:
            grad_norm = self.engine.grad_norm([self.optimizer])
        stepped = self.engine.step(self.optimizer)
        if stepped and self.scheduler is not None:
            self.scheduler.step()
        if not stepped and math.isfinite(loss_value):
            logger.warning("step %d skipped: %s", self.progress.global_step + 1, self._diagnose(window[-1]))
        self.progress.global_step += 1
        self.progress.skipped_steps += int(not stepped)
        self.progress.samples_seen += int(total)
        self.progress.epoch_position = min(self.progress.epoch_position + int(total), len(self.train_set))
        if self.observer is not None:
            self.observer.advance()
        if self.observer is not None and (logging_step or not stepped):
            record = {
                "step": self.progress.global_step, "epoch": self.progress.epoch, "loss": loss_value,
                "lr": self.optimizer.param_groups[0]["lr"], "loss_scale": self.engine.loss_scale(),
                "skipped": not stepped, "skipped_steps": self.progress.skipped_steps,
                "grad_norm": None if grad_norm is None or not stepped else float(grad_norm),
            }  # fmt: skip
            self.observer.log_step(record, self.progress.samples_seen)
        if ends_epoch:
            self._end_epoch()
        elif self.eval_every and self.eval_set is not None and self.progress.global_step % self.eval_every == 0:
            self._evaluate_and_report()
        if self.checkpoint_every and self.progress.global_step % self.checkpoint_every == 0:
            self.save_checkpoint()
        return stop_agreed

    def _diagnose(self, batch: Any) -> str:
        inputs = batch[0].to(self.env.device)
        module = first_non_finite_module(self.run.module, inputs, self.engine.forward_context())
        if module is not None:
            return f"the forward pass of module '{module}' produced inf/NaN"
        return f"gradients overflowed from {self.engine.last_overflow}"

    def _check_loss(self, loss_value: float, batch: Any) -> None:
        """Name where a non-finite loss came from; stop after too many in a row (apex issue 318)."""
        if math.isfinite(loss_value):
            self._nonfinite_losses = 0
            return
        self._nonfinite_losses += 1
        where = self._diagnose(batch)
        logger.warning("step %d has a non-finite loss: %s", self.progress.global_step + 1, where)
        if self._nonfinite_losses == 1:
            self._first_nonfinite_where = where
        if self._nonfinite_losses >= self.max_nonfinite_losses:
            raise NonFiniteGradientsError(
                f"the loss was non-finite for {self._nonfinite_losses} consecutive steps (first: {self._first_nonfinite_where}); "
                "training stopped instead of continuing with a broken model. Check that module's inputs and weights, the loss, "
                "and the learning rate."
            )

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Loss and accuracy over the whole eval set, every sample counted exactly once."""
        if self.eval_set is None:
            raise ConfigError("evaluate() needs an eval_set")
        rng = capture_rng()
        try:
            return self._evaluate()
        finally:
            restore_rng(rng)  # evaluation must not shift the training run's random streams

    def _evaluate(self) -> dict[str, float]:
        model = self.run.model
        was_training = model.training
        model.eval()
        loss_sum = correct = seen = 0.0
        loader = DataLoader(
            self.eval_set, batch_size=self.batch_size, sampler=eval_sampler(self.eval_set, self.env), generator=torch.Generator()
        )
        for inputs, targets in loader:
            inputs, targets = inputs.to(self.env.device), targets.to(self.env.device)
            with self.engine.forward_context():
                outputs = model(inputs)
            loss_sum += F.cross_entropy(outputs.float(), targets, reduction="sum").item()
            correct += (outputs.argmax(1) == targets).sum().item()
            seen += len(targets)
        model.train(was_training)
        totals = sum_across_ranks(torch.tensor([loss_sum, correct, seen], dtype=torch.float64))
        return {"loss": (totals[0] / totals[2]).item(), "accuracy": (totals[1] / totals[2]).item(), "samples": int(totals[2])}

    # ---- checkpoints ----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything shared by the ranks, in checkpoint layout (see ampddp.checkpoint.keys)."""
        return {
            keys.FORMAT: keys.FORMAT_VERSION,
            keys.VERSIONS: _versions(),
            keys.CONFIG: self.config,
            keys.MODEL: self.run.module.state_dict(),
            keys.OPTIMIZER: self.optimizer.state_dict(),
            keys.PRECISION: self.engine.state_dict(),
            keys.SCHEDULER: self.scheduler.state_dict() if self.scheduler is not None else None,
            keys.PROGRESS: self.progress.state_dict(),
            keys.SAMPLER: self.sampler.state_dict(),
            keys.WORLD_SIZE: self.env.world_size,
        }

    def save_checkpoint(self) -> CheckpointRef | None:
        """Write a checkpoint of this step collectively (every file hashed into its manifest)."""
        if self.store is None:
            return None
        state = self.state_dict()
        refuse_non_finite(state, self.progress.global_step, self._saved_step)
        ref = self.store.save(self.progress.global_step, state, {keys.RNG: capture_rng()}, self.env)
        self._saved_step = self.progress.global_step
        return ref

    def _maybe_resume(self) -> None:
        # Rank 0 decides (the newest checkpoint that verifies, or the one asked for), so ranks on file
        # systems with stale caches cannot resume from different steps; every rank raises its error.
        if self.store is None and self.resume in ("auto", "never"):
            return
        plan = broadcast_from_main(plan_resume(self.store, self.resume) if self.env.is_main else None, self.env)
        if plan["error"] is not None:
            kind, message = plan["error"]
            raise (ConfigError if kind == "ConfigError" else CheckpointError)(message)
        if plan["start"] is not None:
            self.load_checkpoint(find_checkpoint(plan["start"]))

    def load_checkpoint(self, ref: CheckpointRef) -> None:
        """Restore every piece of state; the run continues exactly where the checkpoint was taken.

        Every file read is verified against the checkpoint's manifest (size and checksum), and
        everything is read and checked on every rank — the ranks agree — before anything changes,
        so a bad checkpoint leaves the trainer as it was.
        """
        where = str(ref.shared_file)
        error: Exception | None = None
        try:
            manifest = ref.manifest()
            shared = CheckpointStore.load_shared(ref, manifest)
            rank_state = CheckpointStore.load_rank(ref, self.env.rank, manifest)
            rng = rank_state[keys.RNG] if rank_state is not None else None
            check_model_state(shared[keys.MODEL], self.run.module, where)
            check_optimizer_state(shared[keys.OPTIMIZER], self.optimizer, where)
            check_sampler_state(shared[keys.SAMPLER], self.sampler.state_dict(), where)
        except (CheckpointError, KeyError) as exc:
            error = exc if isinstance(exc, CheckpointError) else CheckpointError(f"{ref.path}: checkpoint lacks entry {exc}")
        failed = int(sum_across_ranks(float(error is not None)).item())
        if error is not None:
            raise error
        if failed:
            raise CheckpointError(f"{ref.path}: {failed} rank(s) could not read or check their part of this checkpoint; nothing loaded")
        changed = check_resume_settings(shared.get(keys.CONFIG), self.config, str(ref.path))
        saved_progress = Progress()
        saved_progress.load_state_dict(shared[keys.PROGRESS])
        applied = saved_progress.global_step - saved_progress.skipped_steps
        plan = (
            SchedulePlan()  # a finished run only reports that it is complete: nothing to re-plan
            if finished(saved_progress, self.max_steps, self.max_epochs)
            else plan_schedule(self.optimizer, self.scheduler, shared[keys.OPTIMIZER], shared.get(keys.SCHEDULER), applied, str(ref.path))
        )
        for line in ([changed] if changed else []) + plan.notes:
            logger.warning(line)
        restore_precision(self.engine, shared[keys.PRECISION], where)
        self.run.module.load_state_dict(shared[keys.MODEL])
        if plan.load_optimizer:
            self.optimizer.load_state_dict(shared[keys.OPTIMIZER])
        if plan.load_scheduler and shared.get(keys.SCHEDULER) is not None:
            self.scheduler.load_state_dict(shared[keys.SCHEDULER])
        plan.apply(self.optimizer, self.scheduler)
        self.progress = saved_progress
        self._saved_step = ref.step
        if rng is not None:
            restore_rng(rng)
        else:
            derive_rng(self.seed, self.env.rank, self.progress.global_step)
            logger.warning(
                "%s has no RNG state for rank %d (saved by %d ranks): derived it from the seed",
                ref.path,
                self.env.rank,
                shared[keys.WORLD_SIZE],
            )
        logger.info("resumed from %s at step %d (epoch %d)", ref.path, self.progress.global_step, self.progress.epoch)
