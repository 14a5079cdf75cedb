"""What a run shows: progress on rank 0, metrics.jsonl, summary.json, PNG plots, optional TensorBoard."""

from __future__ import annotations

import io
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

from ampddp.distributed.env import DistEnv
from ampddp.run_files import (
    METRICS_FILE,
    SUMMARY_FILE,
    RunDirIdentity,
    drop_torn_tail,
    open_for_append,
    read_summary,
    replace_file,
    run_file_errors,
)

PLOTS_SKIPPED = "plots skipped: matplotlib is not installed (pip install 'ampddp[plots]')"

logger = logging.getLogger("ampddp.observe")


class RunObserver:
    """Receives step and evaluation records from the trainer; only rank 0 writes or prints."""

    def __init__(self, run_dir: str | Path, env: DistEnv, *, progress: str = "auto", tensorboard: bool = False,
                 total_steps: int | None = None) -> None:  # fmt: skip
        self.run_dir = Path(run_dir)
        self.env = env
        self.active = env.is_main
        self.start = time.perf_counter()
        self._last_time, self._last_samples = self.start, 0
        self.best_accuracy: float | None = None
        self.data_wait_s = 0.0
        """Seconds the loop waited for batches, over the logged steps of this process's run."""
        self.last_eval: dict[str, Any] = {}
        self._bar = None
        self._lines = progress == "lines" or (progress == "auto" and not sys.stderr.isatty())
        self._writer = None
        self._metrics: Any = None
        self._identity = RunDirIdentity(self.run_dir)
        if not self.active:
            return
        if progress in ("bar", "auto") and not self._lines:
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, desc="train", unit="step", dynamic_ncols=True)
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as error:
                raise RuntimeError("trainer.tensorboard=true needs the tensorboard package: pip install 'ampddp[tensorboard]'") from error
            self._writer = SummaryWriter(str(self.run_dir / "tensorboard"))

    def _write(self, record: dict[str, Any]) -> None:
        path = self.run_dir / METRICS_FILE
        with run_file_errors(path):
            self._identity.check()  # the first record makes the run dir (a run refused before writes nothing)
            if self._metrics is None:
                drop_torn_tail(path)
                self._metrics = open_for_append(path)  # closed in close()
            self._metrics.write(json.dumps(record) + "\n")  # one write per record, then flushed
            self._metrics.flush()
        if self._writer is not None:
            for key, value in record.items():
                if isinstance(value, (int, float)) and key not in ("step", "epoch"):
                    self._writer.add_scalar(f"{record['kind']}/{key}", value, record["step"])

    def advance(self) -> None:
        """One optimizer step done (moves the progress bar)."""
        if self.active and self._bar is not None:
            self._bar.update(1)

    def log_step(self, record: dict[str, Any], samples_seen: int) -> None:
        """Record a logged step (the trainer logs every ``log_every`` steps and every skipped one)."""
        self.data_wait_s += record.get("data_wait_s") or 0.0
        if not self.active:
            return
        now = time.perf_counter()
        rate = (samples_seen - self._last_samples) / max(now - self._last_time, 1e-9)
        self._last_time, self._last_samples = now, samples_seen
        record = {"kind": "train", **record, "samples_per_s": rate, "world_size": self.env.world_size}
        self._write(record)
        text = (f"step {record['step']} epoch {record['epoch']} loss {record['loss']:.4f} scale {record['loss_scale']:g} "
                f"skipped {record['skipped_steps']} {rate:.0f} samples/s")  # fmt: skip
        if self._bar is not None:
            self._bar.set_postfix_str(text.split(" ", 4)[-1])
        elif self._lines:
            print(text, flush=True)

    def started(self, step: int, epoch: int, samples_seen: int) -> None:
        """Mark where this run starts (0, or the step it resumed at): records of later steps written
        before it, by a run that died after them, were never applied to the model."""
        self._last_time, self._last_samples = time.perf_counter(), samples_seen
        if self.active:
            self._write({"kind": "start", "step": step, "epoch": epoch})

    def compiled(self, step: int, epoch: int, seconds: float, mode: str, backend: Any) -> None:
        """torch.compile's first training forward and backward took ``seconds`` (in step ``step``)."""
        if self.active:
            self._write({"kind": "compile", "step": step, "epoch": epoch, "compile_s": seconds, "mode": mode, "backend": str(backend)})

    def evaluation(self, step: int, epoch: int, result: dict[str, Any]) -> None:
        self.last_eval = result
        if result.get("accuracy") is not None:
            self.best_accuracy = max(self.best_accuracy or 0.0, result["accuracy"])
        if not self.active:
            return
        self._write({"kind": "eval", "step": step, "epoch": epoch, **result})
        values = " ".join(f"{name} {value:.4f}" for name, value in result.items() if name != "samples" and isinstance(value, float))
        message = f"eval step {step} epoch {epoch}: {values} ({result.get('samples', 0)} samples)"
        if self._bar is not None:
            self._bar.write(message)
        elif self._lines:
            print(message, flush=True)

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
        self._identity.check()
        # The best evaluation of the whole run, including those before a resume.
        accuracies = [r["accuracy"] for r in read_metrics(self.run_dir) if r.get("kind") == "eval" and r.get("accuracy") is not None]
        summary["best_eval_accuracy"] = max(accuracies, default=self.best_accuracy)
        if self._bar is not None:
            self._bar.close()
        if self._writer is not None:
            self._writer.close()
        if self._metrics is not None:
            self._metrics.close()
        with run_file_errors(self.run_dir / SUMMARY_FILE):
            replace_file(self.run_dir / SUMMARY_FILE, json.dumps(summary, indent=2).encode())
        plot_metrics(self.run_dir)
        return summary

    def close_unchanged(self, progress: dict[str, Any] | None = None) -> dict[str, Any]:
        """Close without writing anything; returns the summary the finished run wrote: what a re-run
        of a complete run reports instead of overwriting it.

        Given the finished run's ``progress``, a summary that is missing or stops short of it (a crash
        or a full disk while the run wrote its last files, after its final checkpoint) is rebuilt from
        metrics.jsonl, with the plots, and a warning."""
        summary = read_summary(self.run_dir)
        if not self.active or progress is None or summary.get("steps") == progress["global_step"]:
            for stream in (self._bar, self._writer, self._metrics):
                if stream is not None:
                    stream.close()
            return summary
        evaluations = [record for record in read_metrics(self.run_dir) if record.get("kind") == "eval"]
        if evaluations:
            self.last_eval = {key: value for key, value in evaluations[-1].items() if key not in ("kind", "step", "epoch")}
        logger.warning(
            "%s: missing or stale for this finished run (a crash or a full disk while it was written); rebuilt from %s",
            self.run_dir / SUMMARY_FILE, METRICS_FILE,
        )  # fmt: skip
        return self.close(progress, timed=False)


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The run's history as it applies to the final model.

    metrics.jsonl is append-only; a run that died after logging step k+n but whose last checkpoint
    was step k logged those n steps again after resuming. Each ``start`` record drops the earlier
    records of steps beyond it, so every optimizer step appears once, as it was really applied.
    """
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        return []
    history: list[dict[str, Any]] = []
    for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:  # a record torn by a crash or a full disk: everything before it stands
            logger.warning("%s: line %d is not a whole record (torn by a crash or a full disk); skipped", path, number)
            continue
        if not isinstance(record, dict) or "step" not in record:
            logger.warning("%s: line %d is not a metrics record; skipped", path, number)
            continue
        if record.get("kind") == "start":
            history = [kept for kept in history if kept.get("kind") == "start" or kept["step"] <= record["step"]]
        history.append(record)
    return history


EVAL_FIELDS = ("kind", "step", "epoch", "loss", "samples")
"""Fields of an eval record that are not a metric to plot (the eval loss is in the summary)."""


def plot_metrics(run_dir: str | Path) -> list[Path]:
    """loss.png, eval_<metric>.png per evaluation metric (eval_accuracy.png by default) and
    loss_scale.png (skipped steps marked) from metrics.jsonl.

    Figures are made with matplotlib's object API, not pyplot: no backend is chosen for the whole
    process (a user's interactive backend stays) and no figure is left registered anywhere.
    matplotlib is an optional extra (``ampddp[plots]``) that keeps the core install lean: without
    it this logs one warning saying how to install it and returns no paths, so a run still ends
    with its metrics and summary written.
    """
    try:
        from matplotlib.figure import Figure
    except ImportError:
        logger.warning(PLOTS_SKIPPED)
        return []

    records = read_metrics(run_dir)
    train = [r for r in records if r.get("kind") == "train"]
    evals = [r for r in records if r.get("kind") == "eval"]
    outputs = []
    metrics = dict.fromkeys(key for r in evals for key, value in r.items() if key not in EVAL_FIELDS and isinstance(value, (int, float)))
    specs = [
        ("loss.png", train, "loss", "training loss"),
        *((f"eval_{key}.png", [r for r in evals if key in r], key, f"held-out {key}") for key in metrics),
        ("loss_scale.png", train, "loss_scale", "loss scale"),
    ]
    for name, rows, key, title in specs:
        figure = Figure(figsize=(6, 3.5))
        axes = figure.subplots()
        axes.plot([r["step"] for r in rows], [r[key] for r in rows], marker="." if len(rows) < 50 else None)
        if key == "loss_scale":
            skipped = [r for r in rows if r.get("skipped")]
            axes.scatter([r["step"] for r in skipped], [r[key] for r in skipped], color="red", marker="x", label="skipped step", zorder=3)
            if skipped:
                axes.legend()
            if rows and all(r[key] > 0 for r in rows):
                axes.set_yscale("log", base=2)
        axes.set_xlabel("optimizer step")
        axes.set_title(title)
        figure.tight_layout()
        path = Path(run_dir) / name
        image = io.BytesIO()
        figure.savefig(image, format="png", dpi=100)
        with run_file_errors(path):
            replace_file(path, image.getvalue())
        outputs.append(path)
    return outputs
