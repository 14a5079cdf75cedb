"""``Trainer``: the convenience builder that assembles a ``TrainingLoop`` from a bare model.

It builds each part from plain arguments — the prepared run (``RunSetup``), the loop settings, the
checkpointer, the evaluator, the batch adapter and the callbacks — and hands them to the loop in
``ampddp.training.loop``. To replace a part, pass your own (``batches=``, ``callbacks=``,
``metrics=``, ``loss_fn=``), or build the parts yourself and construct ``TrainingLoop`` directly.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from torch import nn
from torch.optim import Optimizer
from torch.utils.data import Dataset

from ampddp.checkpoint.stage_view import StageView
from ampddp.choices import COMPILE_MODES
from ampddp.distributed.data import ResumableSampler
from ampddp.distributed.env import DistEnv, detect_env, seed_everything
from ampddp.distributed.meta_init import ModelSource
from ampddp.distributed.parallel import Parallel
from ampddp.errors import ConfigError
from ampddp.observe.console import library_console
from ampddp.observe.observer import LOGGERS_NEED_A_RUN_DIR, Reporting, RunObserver
from ampddp.observe.run_plan import RunPlan
from ampddp.precision.choice import Precision
from ampddp.precision.engine import PrecisionEngine
from ampddp.preemption import DEFAULT_STOP_SIGNALS, StopSignals, parse_signals
from ampddp.prepare import MOVED_ARGUMENTS, PREPARE_TAKES, Prepared, Takes, check_arguments, refuse_moved_arguments
from ampddp.rundir.run_dir import RunDir
from ampddp.training.assemble import RunSetup
from ampddp.training.batches import BatchAdapter, LossFn, MetricsFn, accuracy, cross_entropy
from ampddp.training.callbacks import Callback, Callbacks, ObserverCallback, as_callbacks
from ampddp.training.checkpoint_settings import CheckpointSettings
from ampddp.training.checkpointer import Checkpointer, TrainingState
from ampddp.training.compile_model import ModelCompiler
from ampddp.training.device import DeviceSettings
from ampddp.training.evaluator import Evaluator
from ampddp.training.loading import DataLoading, LoaderSettings
from ampddp.training.loop import TrainingLoop
from ampddp.training.resume.kept_precision import kept_precision
from ampddp.training.settings import LoopSettings

RunDirLike = RunDir | str | os.PathLike[str]
"""What ``run_dir=`` takes: a path, or a ``RunDir`` made elsewhere (then shared)."""

DEFAULT_REPORTING = Reporting()
"""Progress on the console; metrics.jsonl, summary.json and plots in the run dir."""

default_loss = cross_entropy
"""The default ``loss_fn(outputs, batch)``: the model's own ``loss`` or cross-entropy (fp32)."""


MOVED_TO_OBJECTS = {
    **MOVED_ARGUMENTS,
    **{name: f"checkpoints=CheckpointSettings({name}=...)" for name in ("keep_last", "resume", "init_from", "config")},
    "observer": "report=Reporting(progress=..., loggers=[...])",
}
"""Trainer arguments that became parts of an object, and where each went."""


def _is_dataset(value: Any) -> bool:
    """A map-style data set: a torch Dataset, or any sequence of samples (``len()`` and ``[index]``), not text."""
    return isinstance(value, Dataset) or (
        hasattr(value, "__len__") and hasattr(value, "__getitem__") and not isinstance(value, (str, bytes))
    )


def _are_signal_names(value: Any) -> bool:
    return isinstance(value, StopSignals) or (isinstance(value, (tuple, list)) and all(isinstance(name, str) for name in value))


DATASET = "a map-style data set (a torch Dataset, or a sequence of samples with len() and [index])"
TRAINER_TAKES = {
    **PREPARE_TAKES,
    "train_set": Takes(DATASET, _is_dataset),
    "eval_set": Takes(f"{DATASET} or None", lambda value: value is None or _is_dataset(value)),
    "env": Takes.instance("a DistEnv (ampddp.distributed.detect_env() or setup_distributed())", DistEnv, optional=True),
    "compile": Takes.instance(
        f"false, true, {', '.join(COMPILE_MODES)}, a ModelCompiler", bool, str, ModelCompiler, optional=True
    ),
    "make_scheduler": Takes.function("a function of the optimizer that builds the LR scheduler", optional=True),
    "loss_fn": Takes.function("a function loss_fn(outputs, batch) -> a scalar tensor"),
    "metrics": Takes.function("a function metrics(outputs, batch) -> {name: value}", optional=True),
    "batches": Takes.instance("a BatchAdapter", BatchAdapter, optional=True),
    "loading": Takes.instance("a LoaderSettings(num_workers=..., ...)", LoaderSettings, optional=True),
    "device": Takes.instance("a DeviceSettings(channels_last=..., ...)", DeviceSettings, optional=True),
    "checkpoints": Takes.instance("a CheckpointSettings(keep_last=..., resume=...)", CheckpointSettings, optional=True),
    "run_dir": Takes.instance("a path, a RunDir", RunDir, str, os.PathLike, optional=True),
    "report": Takes.instance("a Reporting(progress=..., loggers=[...], plots=...)", Reporting, optional=True),
    "callbacks": Takes("a list of Callback objects", lambda value: isinstance(value, Iterable) and not isinstance(value, (str, bytes))),
    "stop_signals": Takes("signal names, e.g. ('SIGTERM', 'SIGUSR1'), or a StopSignals", _are_signal_names),
    "loop": Takes.instance("a LoopSettings(batch_size=..., max_steps=...)", LoopSettings, optional=True),
}  # fmt: skip
"""What each of the Trainer's named arguments takes (its loop settings as keywords are ``LoopSettings``'s to check)."""


def loop_settings(loop: LoopSettings | None, settings: dict[str, Any]) -> LoopSettings:
    """The loop's ``LoopSettings``: ``loop`` as given, or made from keywords (with an error naming an
    unknown one and the valid names); not both."""
    refuse_moved_arguments("Trainer", settings, MOVED_TO_OBJECTS)
    unknown = sorted(set(settings) - set(LoopSettings.names()))
    if unknown:
        raise ConfigError(f"Trainer got unknown argument(s) {', '.join(unknown)}; loop settings are: {', '.join(LoopSettings.names())}")
    if loop is None:
        return LoopSettings(**settings)
    if settings:
        raise ConfigError(
            f"Trainer got loop=LoopSettings(...) and the loop setting(s) {', '.join(sorted(settings))} as keywords: "
            "give them in one place (inside LoopSettings)"
        )
    return loop


class Trainer(TrainingLoop):
    """Train ``model`` on ``train_set``; evaluate on ``eval_set``. It takes these arguments, and no others:

    - ``model``: a module, or a function that builds one (under FSDP2 it runs on the meta device and
      each rank materialises only its shards), or a ``ModelBuild``;
    - ``make_optimizer(params)``, ``make_scheduler(optimizer)``: build the optimizer and LR scheduler
      after the model is prepared (``params``: the model's, or its fp32 masters under O2/O5);
    - ``train_set``, ``eval_set``: map-style data sets (``len()`` and ``[index]``); batches are
      ``(inputs, targets)``, dicts (``model(**batch)``) or whatever ``batches`` (a ``BatchAdapter``)
      understands;
    - ``env``: a ``DistEnv`` (None: detected from the launcher's environment);
    - ``precision``: a mode's name, a ``Precision`` (mode, impl, the mode's settings, registered
      functions) or a fresh ``PrecisionEngine`` of your own (used as it is); ``"auto"`` (the default)
      picks the fastest numerically safe mode of the device and says which (bf16 where it is native,
      fp16 on GPUs before compute capability 8.0, else fp32);
    - ``parallel``: a ``Parallel`` (strategy, sync-BN, DDP's and FSDP2's settings; None: torch DDP
      without sync-BN);
    - ``compile``: False (eager), True or a torch.compile mode, or a ``ModelCompiler``; checkpoints
      hold the bare module either way;
    - ``loss_fn(outputs, batch)``, ``metrics(outputs, batch)``: used by training and evaluation alike;
    - ``batches``: a ``BatchAdapter`` (to the device, counting samples, calling the model);
    - ``loading``: a ``LoaderSettings`` (loader workers, pinned memory, prefetching; batches do not
      depend on them: each sample is fetched under its own seed);
    - ``device``: a ``DeviceSettings`` (channels_last, cuDNN benchmark, TF32);
    - ``checkpoints``: a ``CheckpointSettings`` (keep_last, resume, init_from, config, layout; its
      run_dir is the older spelling of ``run_dir``);
    - ``run_dir``: where the run writes (checkpoints, metrics.jsonl, summary.json, plots, the loggers'
      folders): a path or a ``RunDir``, made once and shared by the checkpoint store and the observer;
      None: nothing on disk;
    - ``report``: a ``Reporting`` (console progress; metrics.jsonl, summary.json, plots and loggers
      such as W&B or MLflow in the run dir), by default progress and the run dir's files; None: silent;
    - ``callbacks``: your ``Callback`` objects, called in order after the reporting;
    - ``stop_signals``: signal names (SIGTERM, SIGINT, SIGHUP, SIGUSR1 by default) or a ``StopSignals``: a
      signal during training ends the step on every rank, checkpoints it and stops the run;
    - ``loop``: a ``LoopSettings``, or instead its fields as keywords (``**settings``, not both):
      ``batch_size``, ``grad_accum_steps``, ``clip_grad_norm``, ``max_epochs``, ``max_steps``, ``seed``,
      ``shuffle``, ``drop_last``, ``checkpoint_every``, ``eval_every``, ``log_every``,
      ``max_nonfinite_losses``. Any other keyword is refused, naming these; why the keywords stay
      beside ``loop=``: docs/trainer.md.
    """

    def __init__(
        self,
        model: ModelSource,
        make_optimizer: Callable[[Iterable[nn.Parameter]], Optimizer],
        train_set: Dataset,
        *,
        eval_set: Dataset | None = None,
        env: DistEnv | None = None,
        precision: str | Precision | PrecisionEngine = "auto",
        parallel: Parallel | None = None,
        compile: bool | str | ModelCompiler | None = False,
        make_scheduler: Callable[[Optimizer], Any] | None = None,
        loss_fn: LossFn = default_loss,
        metrics: MetricsFn | None = accuracy,
        batches: BatchAdapter | None = None,
        loading: LoaderSettings | None = None,
        device: DeviceSettings | None = None,
        checkpoints: CheckpointSettings | None = None,
        run_dir: RunDirLike | None = None,
        report: Reporting | None = DEFAULT_REPORTING,
        callbacks: Sequence[Callback] = (),
        stop_signals: tuple[str, ...] | StopSignals = DEFAULT_STOP_SIGNALS,
        loop: LoopSettings | None = None,
        **settings: Any,
    ) -> None:
        check_arguments("Trainer", locals(), TRAINER_TAKES)  # the named arguments as given, before anything is made
        loop = loop_settings(loop, settings)
        checkpoints, place = _checked_parts(checkpoints, run_dir, report, loop, stop_signals)
        hooks = as_callbacks(callbacks)
        self.compiler = compile if isinstance(compile, ModelCompiler) else ModelCompiler.from_setting(compile)
        env = env or detect_env(device="auto")
        device = device or DeviceSettings()
        self._notes_shown = report is not None
        with library_console(env, self._notes_shown):  # the precision chosen, as the command line says it
            if not isinstance(precision, PrecisionEngine):
                precision = kept_precision(Precision.of(precision), checkpoints.run_dir, checkpoints.resume, env)
            setup = RunSetup(precision, parallel or Parallel(), self.compiler, checkpoints.init_from, device)
            run = setup.build(model, make_optimizer, env, on_compiled=self._compiled)
        state = TrainingState(
            run.module, run.optimizer, run.engine, make_scheduler(run.optimizer) if make_scheduler is not None else None,
            ResumableSampler(train_set, run.data_shard, shuffle=loop.shuffle, seed=loop.seed, drop_last=loop.drop_last),
        )  # fmt: skip
        store = checkpoints.store(place)  # the run dir, made once: the store and the observer share it
        batches = batches or BatchAdapter(images=device.memory_format)
        data = DataLoading(loading or LoaderSettings(), env.device, loop.seed, worker_seed=env.rank_seed(loop.seed))
        scoring = {"loss_fn": loss_fn, "metrics": metrics, "batches": batches, "loading": data}
        placed = {"shard": run.data_shard, "schedule": run.schedule, "collective_forward": run.strategy.collective_forward}
        evaluator = None if eval_set is None else Evaluator(eval_set, loop.batch_size, env, **scoring, **placed)
        super().__init__(
            run, train_set, loop,
            checkpointer=Checkpointer(state, store, env, resume=checkpoints.resume, config=checkpoints.config, seed=loop.seed,
                                      layout=run.strategy.checkpoint_layout if checkpoints.layout == "auto" else checkpoints.layout,
                                      mesh=None if run.dims is None else run.strategy.recorded_layout(run.dims),
                                      view=stage_view(run, env)),
            loss_fn=loss_fn, batches=batches, loading=data,
            evaluator=evaluator,
            callbacks=Callbacks([*self._observer(report, place, checkpoints, run, loop, len(train_set),
                                                 None if eval_set is None else len(eval_set), state), *hooks]),
            stop_signals=stop_signals, device=device,
        )  # fmt: skip
        seed_everything(env.rank_seed(loop.seed))  # the one seeding point of the training streams, per rank

    def fit(self) -> dict[str, Any]:
        """See ``TrainingLoop.fit``; what the run says (where it writes, "already complete") is shown
        when the application has not configured logging (``library_console``)."""
        with library_console(self.run.env, self._notes_shown):
            return super().fit()

    def _observer(self, report: Reporting | None, place: RunDir | None, checkpoints: CheckpointSettings, run: Prepared,
                  loop: LoopSettings, samples: int, eval_samples: int | None, state: TrainingState) -> list[Callback]:  # fmt: skip
        """What the run reports (see ``Reporting``), as a callback: none when ``report`` is None."""
        if report is None:
            return []
        data_ranks = run.data_shard.size
        plan = RunPlan(samples, eval_samples, loop.batch_size, data_ranks, loop.grad_accum_steps, loop.max_epochs, loop.max_steps)
        observer = RunObserver(
            place, run.env, progress=report.progress, loggers=report.loggers, plots=report.plots, plan=plan, config=checkpoints.config,
            tracked_runs=state.tracked_runs, scales_loss=state.engine.scales_loss, fp8_layers=state.engine.fp8_plan(),
            precision=state.engine.mode,
        )  # fmt: skip
        return [ObserverCallback(observer, epoch_samples=samples)]

    def _compiled(self, seconds: float) -> None:
        """The first compiled forward and backward ended (inside the step about to be counted)."""
        if self.compiler is not None:
            self.callbacks.on_compiled(self.progress, seconds, self.compiler.mode, self.compiler.backend)


def _checked_parts(checkpoints: CheckpointSettings | None, run_dir: RunDirLike | None, report: Reporting | None, loop: LoopSettings,
                   stop_signals: tuple[str, ...] | StopSignals) -> tuple[CheckpointSettings, RunDir | None]:  # fmt: skip
    """The Trainer's parts checked together before anything is built; the checkpoint settings to use
    and the run dir (one value, or None)."""
    checkpoints, place = _with_run_dir(checkpoints or CheckpointSettings(), run_dir)
    if report is not None and report.loggers and checkpoints.run_dir is None:
        raise ConfigError(LOGGERS_NEED_A_RUN_DIR)
    if loop.checkpoint_every is not None and checkpoints.run_dir is None:
        raise ConfigError("checkpoint_every needs a run_dir to write checkpoints into: Trainer(run_dir=...)")
    if not isinstance(stop_signals, StopSignals):
        parse_signals(stop_signals)
    return checkpoints, place


def _with_run_dir(checkpoints: CheckpointSettings, run_dir: RunDirLike | None) -> tuple[CheckpointSettings, RunDir | None]:
    """``run_dir`` (where the run writes: checkpoints, metrics, summary, plots, loggers), or the one
    ``checkpoints`` names (its older spelling); two different ones are refused."""
    if run_dir is None:
        return checkpoints, checkpoints.place()
    place = RunDir.of(run_dir)
    if checkpoints.run_dir is not None and Path(checkpoints.run_dir) != place.path:
        raise ConfigError(
            f"run_dir={place.given} and checkpoints=CheckpointSettings(run_dir={checkpoints.run_dir}) name two run dirs; give it once, "
            "as Trainer(run_dir=...)"
        )
    return dataclasses.replace(checkpoints, run_dir=place.path), place


def stage_view(run: Prepared, env: DistEnv) -> StageView | None:
    """Where the run's module is a pipeline stage, its part of the whole model's checkpoint (collective: every rank)."""
    stages = run.strategy.optimizer_stages()
    return None if stages is None else StageView.agreed(run.module, run.optimizer, stages, env)
