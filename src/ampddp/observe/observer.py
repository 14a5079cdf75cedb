"""The run's observer on rank 0: progress on the console, records appended to metrics.jsonl,
summary.json at the end, then the plots, and every logger fed the same records."""

from __future__ import annotations

import logging
import math
import re
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ampddp.distributed.env import DistEnv
from ampddp.errors import ConfigError, RunIOError
from ampddp.observe.console_streams import write_line
from ampddp.observe.loggers import MetricLogger, logger_named
from ampddp.observe.loggers.base import numbers
from ampddp.observe.metrics_file import read_metrics
from ampddp.observe.plots import plot_metrics
from ampddp.observe.run_plan import RunPlan
from ampddp.rundir import strict_json
from ampddp.rundir.files import (
    METRICS_FILE,
    SUMMARY_FILE,
    drop_torn_tail,
    open_for_append,
    read_summary,
    replace_file,
    run_file_errors,
)
from ampddp.rundir.run_dir import RunDir

LOGGERS_NEED_A_RUN_DIR = "loggers write into the run dir: give one (Trainer(run_dir=...)) or no loggers"
PROGRESS_CHOICES = ("auto", "bar", "lines", "off")
SCALING_FIELDS = ("loss_scale", "skipped", "skipped_steps")
"""Fields of a step record that say something only in modes that scale the loss."""

logger = logging.getLogger("ampddp.observe")


@dataclass(frozen=True)
class Reporting:
    """What a run reports (rank 0): ``progress`` on the console (``auto``: a bar in a terminal, lines
    otherwise; ``bar``, ``lines``, ``off``), and, in the run dir, metrics.jsonl, summary.json, the
    plots (``plots``, when matplotlib is installed) and every logger in ``loggers`` (``MetricLogger``
    objects, or names: tensorboard, csv, wandb, mlflow)."""

    progress: str = "auto"
    loggers: tuple[MetricLogger | str, ...] = ()
    plots: bool = True

    def __post_init__(self) -> None:
        if self.progress not in PROGRESS_CHOICES:
            raise ConfigError(f"progress={self.progress!r} is not valid; valid: {', '.join(PROGRESS_CHOICES)}")
        if not isinstance(self.loggers, (tuple, list)):
            raise ConfigError(f"loggers must be a list of loggers or their names, got {type(self.loggers).__name__}")
        built = tuple(item if isinstance(item, MetricLogger) else logger_named(item) for item in self.loggers)
        names = [item.name for item in built]
        twice = sorted({name for name in names if names.count(name) > 1})
        if twice:
            raise ConfigError(f"loggers: {', '.join(twice)} given twice; give each logger once")
        for item in built:
            item.check_installed()
        object.__setattr__(self, "loggers", built)


@dataclass
class TrackedRuns:
    """The ids of the tracked runs (W&B, MLflow) a run logs to, by logger name: saved with every
    checkpoint, so that a resumed run continues the same tracked runs."""

    ids: dict[str, str] = field(default_factory=dict)

    def state_dict(self) -> dict[str, str]:
        return dict(self.ids)

    def load_state_dict(self, state: Any) -> None:
        """The saved ids whose form a tracker can take (a checkpoint is untrusted bytes); any other is
        dropped with a warning, and its tracker starts a fresh run."""
        entries = state.items() if isinstance(state, Mapping) else []
        kept = {name: run_id for name, run_id in entries if isinstance(name, str) and isinstance(run_id, str) and RUN_ID.fullmatch(run_id)}
        if len(kept) != len(entries) or not isinstance(state, Mapping):
            logger.warning("the checkpoint's tracked-run ids are malformed (%s); those trackers start fresh runs", ascii(state)[:200])
        self.ids = kept


RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")
"""The form of a tracked-run id a checkpoint may hand a tracker (W&B's and MLflow's ids are of it)."""

LOGGER_PLACES = {"csv": "csv/", "tensorboard": "tensorboard/", "wandb": "W&B (wandb/ when offline)", "mlflow": "MLflow"}
"""Where each logger's records go, for the run's first line."""
FILE_ONLY_RECORDS = ("start", "fp8_layers")
"""Records metrics.jsonl keeps that are no time series for the loggers: where a run starts, and what
O6's set-up made of each linear layer."""


class RunObserver:
    """Receives step and evaluation records from the trainer; only rank 0 writes or prints.

    ``run_dir`` None: progress on the console only. ``scales_loss`` False: the loss scale and skipped
    steps (always 1 and 0) are left out of the console and the loggers; metrics.jsonl keeps them.
    ``fp8_layers``: O6's verdict on each linear layer, recorded where the run starts.
    ``precision``: the precision mode, in the start record (a run resumed in another mode, O6 -> O4
    say, tells from which step its records are that mode's).
    """

    def __init__(self, run_dir: RunDir | str | Path | None, env: DistEnv, *, progress: str = "auto", loggers: Sequence[MetricLogger] = (),
                 plan: RunPlan | None = None, config: Mapping[str, Any] | None = None,
                 tracked_runs: TrackedRuns | None = None, scales_loss: bool = True, plots: bool = True,
                 fp8_layers: Sequence[Mapping[str, Any]] = (), precision: str | None = None) -> None:  # fmt: skip
        self.place = None if run_dir is None else RunDir.of(run_dir)
        """The run dir as one value (shared with the checkpoint store when the Trainer made both)."""
        self.run_dir = None if self.place is None else self.place.path
        self.env = env
        self.fp8_layers = [dict(layer) for layer in fp8_layers]
        self.precision = precision
        self.active = env.is_main
        self.start = time.perf_counter()
        self._last_time, self._last_samples = self.start, 0
        self._rate_steps: tuple[float, int] | None = None
        self.best_accuracy: float | None = None
        self.data_wait_s = 0.0
        """Seconds the loop waited for batches, over the logged steps of this process's run."""
        self.last_eval: dict[str, Any] = {}
        self._warned_nonfinite = False
        self._bar = None
        self._lines = progress == "lines" or (progress == "auto" and not sys.stderr.isatty())
        self._metrics: Any = None
        self._plan = plan
        self._total_steps = plan.total_steps if plan is not None else None
        self._config = config
        self._scales_loss = scales_loss
        self._plots = plots
        self.tracked_runs = tracked_runs if tracked_runs is not None else TrackedRuns()
        self._loggers = list(loggers) if self.active and self.run_dir is not None else []
        if self.run_dir is None and loggers:
            raise ConfigError(LOGGERS_NEED_A_RUN_DIR)
        self._started_loggers: list[MetricLogger] = []
        self._wants_bar = self.active and progress in ("bar", "auto") and not self._lines
        self._log_redirect: Any = None

    def _write(self, record: dict[str, Any]) -> None:
        if self.place is not None:
            path = self.place.metrics
            with run_file_errors(path):
                self.place.check()  # the first record makes the run dir (a run refused before writes nothing)
                if self._metrics is None:
                    drop_torn_tail(path)
                    self._metrics = open_for_append(path)  # closed in close()
                self._metrics.write(strict_json.dumps(record) + "\n")  # one write per record, then flushed
                self._metrics.flush()
        if record["kind"] in FILE_ONLY_RECORDS:
            return
        values = numbers(record)
        if not self._scales_loss:
            values = {key: value for key, value in values.items() if key not in SCALING_FIELDS}
        for sink in list(self._started_loggers):
            try:
                sink.log(record["kind"], values, record["step"])
            except Exception as error:  # a tracker's failure (a server gone, a name it refuses) never ends the training
                self._drop(sink, error)

    def _drop(self, sink: MetricLogger, error: Exception) -> None:
        """Stop logging to ``sink`` for the rest of the run, with one warning; the others go on."""
        logger.warning("logger %s failed (%s: %s); the run goes on without it", sink.name, type(error).__name__, error)
        self._started_loggers.remove(sink)
        _close_quietly(sink, failed=True)

    def _start_loggers(self, step: int) -> None:
        """Open every logger, continuing the tracked runs this run logged to before a resume."""
        for sink in self._loggers:
            try:
                run_id = sink.start(self.run_dir, self._config, self.tracked_runs.ids.get(sink.name), step)
            except Exception as error:  # a broken store or a refused id: the run's own files keep everything
                _close_quietly(sink, failed=True)  # what it opened before failing (an MLflow run) is not left running
                logger.warning("logger %s could not start (%s: %s); the run goes on without it", sink.name, type(error).__name__,
                               str(error)[:300])  # fmt: skip
                continue
            except BaseException:
                _close_quietly(sink, failed=True)
                raise
            self._started_loggers.append(sink)
            if run_id is not None:
                self.tracked_runs.ids[sink.name] = run_id

    def advance(self) -> None:
        """One optimizer step done (moves the progress bar)."""
        if self.active and self._bar is not None:
            self._bar.update(1)

    def log_step(self, record: dict[str, Any], samples_seen: int, shown_epoch: float | None = None) -> None:
        """Record a logged step (the trainer logs every ``log_every`` steps and every skipped one)."""
        self.data_wait_s += record.get("data_wait_s") or 0.0
        if not self.active:
            return
        now = time.perf_counter()
        elapsed = max(now - self._last_time, 1e-9)
        rate = (samples_seen - self._last_samples) / elapsed
        self._last_time, self._last_samples = now, samples_seen
        record = dict(record)  # the callbacks after this one see the record as the loop made it
        tokens = record.pop("tokens", None)
        token_rate = {"tokens_per_s": tokens / elapsed} if tokens else {}
        record = {"kind": "train", **record, "samples_per_s": rate, **token_rate, "world_size": self.env.world_size}
        self._write(record)
        loss = record["loss"] if record.get("loss_mean") is None else record["loss_mean"]  # the window's mean: less noise
        parts = [f"loss {loss:.4f}", f"lr {record['lr']:.3g}"]
        if self._scales_loss:
            parts += [f"scale {record['loss_scale']:g}", f"skipped {record['skipped_steps']}"]
        parts.append(f"{rate:.0f} samples/s")
        if token_rate:
            parts.append(f"{token_rate['tokens_per_s']:.0f} tokens/s")
        if self._bar is not None:
            self._bar.set_postfix_str(" ".join(parts))
        elif self._lines:
            epoch = _epoch_text(record["epoch"], shown_epoch)
            write_line(f"step {record['step']} epoch {epoch} {' '.join(parts)}{self._eta(record['step'], now)}")

    def _eta(self, step: int, now: float) -> str:
        """`` eta 3m12s`` from the pace since this run started, when the total is known."""
        if self._total_steps is None or self._rate_steps is None or step <= self._rate_steps[1]:
            return ""
        since, first = self._rate_steps
        seconds = max(self._total_steps - step, 0) * (now - since) / (step - first)
        minutes, secs = divmod(math.ceil(seconds), 60)
        hours, minutes = divmod(minutes, 60)
        return f" eta {hours}h{minutes:02d}m" if hours else f" eta {minutes}m{secs:02d}s"

    def started(self, step: int, epoch: int, samples_seen: int) -> None:
        """Mark where this run starts (0, or the step it resumed at): records of later steps written
        before it, by a run that died after them, were never applied to the model. The loggers open
        here (after a resume has restored the ids of the tracked runs they continue)."""
        self._last_time, self._last_samples = time.perf_counter(), samples_seen
        self._rate_steps = (self._last_time, step)
        if self.active:
            self._say_where_it_goes()
            self._write({"kind": "start", "step": step, "epoch": epoch, **({"precision": self.precision} if self.precision else {})})
            if self.fp8_layers:
                in_fp8 = sum(bool(layer["fp8"]) for layer in self.fp8_layers)
                self._write({"kind": "fp8_layers", "step": step, "in_fp8": in_fp8, "layers": self.fp8_layers})
            self._start_loggers(step)
        if self._wants_bar and self._bar is None:
            self._open_bar(step)

    def _say_where_it_goes(self) -> None:
        """The run's first lines: where it writes and what it will hold, and the data it trains on."""
        if self.run_dir is not None:
            plots = ", plots (loss.png, eval_*.png, report.png)" if self._plots else ""
            trackers = "".join(f", {LOGGER_PLACES.get(sink.name, sink.name)}" for sink in self._loggers)
            logger.info("run dir %s: checkpoints/, metrics.jsonl, summary.json%s%s", self.run_dir, plots, trackers)
        if self._plan is not None:
            logger.info(self._plan.describe())

    def _open_bar(self, step: int) -> None:
        """The progress bar, from the step the run starts at; log lines print above it (not onto it)
        until it closes."""
        from tqdm import tqdm
        from tqdm.contrib.logging import logging_redirect_tqdm

        self._bar = tqdm(total=self._total_steps, initial=step, desc="train", unit="step", dynamic_ncols=True)
        self._log_redirect = logging_redirect_tqdm()
        self._log_redirect.__enter__()

    def compiled(self, step: int, epoch: int, seconds: float, mode: str, backend: Any) -> None:
        """torch.compile's first training forward and backward took ``seconds`` (in step ``step``)."""
        if self.active:
            self._write({"kind": "compile", "step": step, "epoch": epoch, "compile_s": seconds, "mode": mode, "backend": str(backend)})

    def evaluation(self, step: int, epoch: int, result: dict[str, Any], shown_epoch: float | None = None) -> None:
        self.last_eval = result
        if result.get("accuracy") is not None:
            self.best_accuracy = max(self.best_accuracy or 0.0, result["accuracy"])
        if not self.active:
            return
        self._warn_nonfinite(step, result)
        self._write({"kind": "eval", "step": step, "epoch": epoch, **result})
        values = " ".join(f"{name} {value:.4f}" for name, value in result.items() if name != "samples" and isinstance(value, float))
        message = f"eval step {step} epoch {_epoch_text(epoch, shown_epoch)}: {values} ({result.get('samples', 0)} samples)"
        if self._bar is not None:
            self._bar.write(message)
        elif self._lines:
            write_line(message)

    def _warn_nonfinite(self, step: int, result: Mapping[str, Any]) -> None:
        """One warning per run at the first evaluation with a NaN or infinite loss or metric: the run goes on
        (training losses have their own limit), and the files record it as null (``strict_json``)."""
        bad = {name: value for name, value in result.items() if isinstance(value, float) and not math.isfinite(value)}
        if bad and not self._warned_nonfinite:
            self._warned_nonfinite = True
            named = ", ".join(f"{name} {value}" for name, value in bad.items())
            logger.warning(
                "evaluation at step %d: %s; the model or the evaluation data holds inf/NaN (%s and %s record it as null, "
                "named in their %r field)", step, named, METRICS_FILE, SUMMARY_FILE, strict_json.NONFINITE_FIELD,
            )  # fmt: skip

    def close(self, progress: dict[str, Any], *, timed: bool = True) -> dict[str, Any]:
        """Write summary.json and the plots; returns the summary. ``timed=False``: this process did
        not run the training, so the wall and data-wait times are unknown (None)."""
        summary = {
            "final_eval_accuracy": self.last_eval.get("accuracy"),
            "best_eval_accuracy": self.best_accuracy,
            "final_eval_loss": self.last_eval.get("loss"),
            "steps": progress["global_step"],
            "epochs": progress["epoch"],
            "skipped_steps": progress["skipped_steps"],
            "samples_seen": progress["samples_seen"],
            "wall_time_s": time.perf_counter() - self.start if timed else None,
            "data_wait_s": self.data_wait_s if timed else None,
            "world_size": self.env.world_size,
        }
        if not self.active:
            return summary
        self._close_streams()
        if self.place is None:
            return summary
        self.place.check()
        # The best evaluation of the whole run, including those before a resume.
        accuracies = [r["accuracy"] for r in read_metrics(self.run_dir) if r.get("kind") == "eval" and r.get("accuracy") is not None]
        summary["best_eval_accuracy"] = max(accuracies, default=self.best_accuracy)
        with run_file_errors(self.place.summary):
            replace_file(self.place.summary, strict_json.dumps(summary, indent=2).encode())
        if self._plots:
            plot_metrics(self.run_dir)
        return summary

    def abandon(self) -> None:
        """The run raised: end the progress bar and metrics.jsonl, and mark the tracked runs failed."""
        if self.active:
            self._close_streams(failed=True)

    def _close_streams(self, failed: bool = False) -> None:
        """End the progress bar, metrics.jsonl and every logger that started (each once)."""
        if self._log_redirect is not None:
            self._log_redirect.__exit__(None, None, None)
            self._log_redirect = None
        if self._bar is not None:
            self._bar.close()
        if self._metrics is not None:
            metrics, self._metrics = self._metrics, None
            self._close_metrics(metrics, failed)
        started, self._started_loggers = self._started_loggers, []
        for sink in started:  # every logger gets its close, whichever fails; a tracker never fails a finished run
            _close_quietly(sink, failed)

    def _close_metrics(self, metrics: Any, failed: bool) -> None:
        """Close metrics.jsonl. Every record was flushed as written, so only one whose write already
        failed (a full disk) is still buffered: after a failure it is dropped (the resume cuts the torn
        tail), otherwise it is this close's RunIOError."""
        try:
            metrics.close()  # the file is closed even when the flush in it fails
        except OSError as error:
            if not failed:
                raise RunIOError(f"{self.place.metrics}: cannot write ({error.strerror or error})") from error

    def close_unchanged(self, progress: dict[str, Any] | None = None) -> dict[str, Any]:
        """Close without writing anything; returns the summary the finished run wrote: what a re-run
        of a complete run reports instead of overwriting it.

        Given the finished run's ``progress``, a summary that is missing or stops short of it (a crash
        or a full disk while the run wrote its last files, after its final checkpoint) is rebuilt from
        metrics.jsonl, with the plots, and a warning."""
        summary = read_summary(self.run_dir) if self.run_dir is not None else {}
        if not self.active or progress is None or self.run_dir is None or summary.get("steps") == progress["global_step"]:
            self._close_streams()
            return summary
        evaluations = [record for record in read_metrics(self.run_dir) if record.get("kind") == "eval"]
        if evaluations:
            self.last_eval = {key: value for key, value in evaluations[-1].items() if key not in ("kind", "step", "epoch")}
        logger.warning(
            "%s: missing or stale for this finished run (a crash or a full disk while it was written); rebuilt from %s",
            self.place.summary, METRICS_FILE,
        )  # fmt: skip
        return self.close(progress, timed=False)


def _close_quietly(sink: MetricLogger, failed: bool) -> None:
    """Close a logger that already failed; a second failure is only logged."""
    try:
        sink.close(failed=failed)
    except Exception as error:
        logger.warning("logger %s did not close: %s: %s", sink.name, type(error).__name__, error)


def _epoch_text(epoch: int, shown: float | None) -> str:
    """The console's epoch: epochs done, with the part of the current one (``0.93``, then ``1.00`` at
    its end), the same in training and evaluation lines; the records keep the whole ``epoch``."""
    return f"{shown:.2f}" if shown is not None else str(epoch)
