"""Saving and restoring a run's state: the registered items, verified, agreed by every rank.

The items are the model (its bare module), optimizer, precision engine, LR scheduler, progress,
sampler, every rank's RNG, and any user item registered with :meth:`Checkpointer.register` (anything
with ``state_dict``/``load_state_dict``, e.g. an EMA of the weights). A load reads and checks every
file on every rank before anything changes, so a bad checkpoint leaves the run as it was.
"""

from __future__ import annotations

import io
import logging
import platform
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn
from torch.optim import Optimizer

from ampddp.checkpoint import keys
from ampddp.checkpoint.finite import refuse_non_finite
from ampddp.checkpoint.inspect import layout_words
from ampddp.checkpoint.manifest import Manifest, config_digest, step_of
from ampddp.checkpoint.restore import (
    apply_precision,
    check_model_state,
    check_optimizer_state,
    check_sampler_state,
    check_shared_entries,
    precision_conversion,
)
from ampddp.checkpoint.rng import capture_rng, derive_rng, restore_rng
from ampddp.checkpoint.sharded import local_shards, read_into_live, shape_view, shard_files, shards_problem, split_state, verify_shards
from ampddp.checkpoint.stage_view import StageView
from ampddp.checkpoint.store import CheckpointRef, CheckpointStore
from ampddp.distributed.data import ResumableSampler, broadcast_from_main, sum_across_ranks
from ampddp.distributed.env import DistEnv
from ampddp.distributed.full_state import gathered, sharded_model_state, sharded_optimizer_state
from ampddp.errors import CheckpointError, ConfigError
from ampddp.observe.observer import TrackedRuns
from ampddp.precision.engine import PrecisionEngine
from ampddp.precision.state import Conversion
from ampddp.training.progress import Progress
from ampddp.training.resume import SchedulePlan, check_resume_settings, plan_resume, plan_schedule, set_aside_newer

logger = logging.getLogger("ampddp.trainer")
EXTRA = "extra"
"""Checkpoint entry holding the user-registered items, by name."""


class Stateful(Protocol):
    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> None: ...


@dataclass
class TrainingState:
    """Everything a checkpoint holds about a run, by role."""

    module: nn.Module
    optimizer: Optimizer
    engine: PrecisionEngine
    scheduler: Any
    sampler: ResumableSampler
    progress: Progress = field(default_factory=Progress)
    extra: dict[str, Stateful] = field(default_factory=dict)
    tracked_runs: TrackedRuns = field(default_factory=TrackedRuns)
    """The experiment trackers' run ids (W&B, MLflow), continued after a resume."""


@dataclass
class ResumePlan:
    """A checkpoint read and checked against the live run, nothing changed yet: what
    :meth:`Checkpointer.apply` restores. ``notes``: the settings that changed, said when it is applied;
    ``set_aside``: this run's newer step folders, moved into ``abandoned/`` when it is applied."""

    ref: CheckpointRef
    shared: dict[str, Any]
    rng: dict[str, Any] | None
    manifest: Manifest | None
    progress: Progress
    schedule: SchedulePlan
    precision: Conversion
    notes: list[str] = field(default_factory=list)
    set_aside: list[str] = field(default_factory=list)


def _versions() -> dict[str, str]:
    from ampddp import __version__

    return {"ampddp": __version__, "torch": str(torch.__version__), "python": platform.python_version()}


class Checkpointer:
    """Writes ``state`` into ``store`` and restores it; decides where a run resumes.

    ``resume``: ``"auto"`` (the newest checkpoint in ``store`` that verifies), ``"never"``, or the
    path of a checkpoint or run dir. ``config``: the run's settings, saved and compared on resume.
    ``seed`` derives a rank's RNG when the checkpoint was saved by fewer ranks. ``layout``: whole
    (one shared file of whole tensors) or sharded (each rank its shards; where a recipe says auto,
    the strategy's word: ``Strategy.checkpoint_layout``). ``mesh``: how the ranks that write it are laid out (the
    strategy and the mesh's dimension sizes), saved for ``ampddp inspect`` and the next run to read. ``view``: where
    the live module is a pipeline stage, its part of the whole model (``StageView``): the checkpoint is written and
    read as the whole model's (sharded layout only).
    """

    def __init__(self, state: TrainingState, store: CheckpointStore | None, env: DistEnv, *, resume: str | Path = "auto",
                 config: dict[str, Any] | None = None, seed: int = 0, layout: str = "whole",
                 mesh: dict[str, Any] | None = None, view: StageView | None = None) -> None:  # fmt: skip
        if view is not None and layout != "sharded":
            raise ConfigError(f"checkpoint layout {layout} under pipeline parallelism: each stage holds part of the model and "
                              "writes it itself; use layout sharded (or auto)")  # fmt: skip
        self.state, self.store, self.env, self.view = state, store, env, view
        self.resume, self.config, self.seed, self.mesh = resume, dict(config or {}), seed, mesh
        self.sharded = layout == "sharded"
        self.saved_step: int | None = None
        self.planned = False
        self.plan: ResumePlan | None = None

    def register(self, name: str, item: Stateful) -> None:
        """Save and restore ``item`` with every checkpoint, under ``name``.

        Its state is saved once, from rank 0, with the shared state: register state that is the same
        on every rank (an EMA of the synchronised weights, a global counter). Its ``state_dict`` must
        hold only tensors, plain containers, numbers and strings, as every checkpoint file does (they
        load with ``weights_only=True``); anything else is refused when the checkpoint is written.
        """
        if not isinstance(name, str) or not name:
            raise ConfigError(f"a checkpoint item needs a non-empty string name, got {name!r}")
        if name in self.state.extra:
            raise ConfigError(f"a checkpoint item named {name!r} is already registered")
        if not callable(getattr(item, "state_dict", None)) or not callable(getattr(item, "load_state_dict", None)):
            raise ConfigError(f"checkpoint item {name!r} is a {type(item).__name__}, which has no state_dict/load_state_dict")
        self.state.extra[name] = item

    def state_dict(self, everywhere: bool = True) -> dict[str, Any]:
        """Everything shared by the ranks, in checkpoint layout (see ampddp.checkpoint.keys), with whole
        tensors (FSDP2's shards gathered: the layout every strategy reads). ``everywhere=False``: the
        gathered tensors are kept by rank 0 alone (None elsewhere), which writes them."""
        keep = everywhere or self.env.is_main
        return self._state_dict(gathered(self.state.module.state_dict(), keep), gathered(self.state.optimizer.state_dict(), keep))

    def _state_dict(self, model: dict[str, Any] | None, optimizer: dict[str, Any]) -> dict[str, Any]:
        state = self.state
        shared = {
            keys.FORMAT: keys.FORMAT_VERSION,
            keys.VERSIONS: _versions(),
            keys.CONFIG: self.config,
            keys.MODEL: model,
            keys.OPTIMIZER: optimizer,
            keys.PRECISION: state.engine.state_dict(),
            keys.SCHEDULER: state.scheduler.state_dict() if state.scheduler is not None else None,
            keys.PROGRESS: state.progress.state_dict(),
            keys.SAMPLER: state.sampler.state_dict(),
            keys.WORLD_SIZE: self.env.world_size,
            keys.MESH: self.mesh,
            keys.TRACKED_RUNS: state.tracked_runs.state_dict(),
        }
        if state.extra:
            shared[EXTRA] = {name: _loadable(name, item.state_dict()) for name, item in state.extra.items()}
        return shared

    def save(self) -> CheckpointRef | None:
        """Write a checkpoint of this step collectively (every file hashed into its manifest)."""
        if self.store is None:
            return None
        step = self.state.progress.global_step
        shards = None
        if self.sharded:  # each rank writes what it holds: no gather
            shards, optimizer, record = split_state(self.state.module.state_dict(), self.state.optimizer.state_dict())
            if self.view is not None:  # a pipeline stage: written as its part of the whole model
                shards, optimizer, record = self.view.to_whole(shards, optimizer, record, self.env)
            shared = {**self._state_dict(None, optimizer), keys.FORMAT: keys.SHARDED_FORMAT_VERSION, keys.SHARDS: record}
            checked = {**local_shards(shards), keys.PRECISION: shared[keys.PRECISION]}
        else:
            shared = self.state_dict(everywhere=False)
            checked = {name: shared[name] for name in (keys.MODEL, keys.OPTIMIZER, keys.PRECISION)}
        refuse_non_finite(checked, step, self.saved_step, self.env)
        run = {"progress": shared[keys.PROGRESS], "config_sha256": config_digest(self.config), "ampddp": shared[keys.VERSIONS]["ampddp"],
               keys.RUN_PRECISION_MODE: self.state.engine.mode}  # fmt: skip
        ref = self.store.save(step, shared, {keys.RNG: capture_rng()}, self.env, run=run, shards=shards)
        self.saved_step = step
        return ref

    def plan_resume(self, finished: Callable[[Progress], bool]) -> ResumePlan | None:
        """Read and check the checkpoint this run continues from, if any, against the live run,
        changing nothing (:meth:`resume_if_asked` applies it). Rank 0 decides (the newest checkpoint
        that verifies, or the one asked for), so ranks on file systems with stale caches cannot resume
        from different steps; every rank raises its error."""
        self.planned = True
        self.plan = None
        if self.store is None and self.resume in ("auto", "never"):
            return None
        passed_over: list[str] = []
        while True:
            decided = broadcast_from_main(plan_resume(self.store, self.resume, passed_over) if self.env.is_main else None, self.env)
            if decided["error"] is not None:
                kind, message = decided["error"]
                raise (ConfigError if kind == "ConfigError" else CheckpointError)(message)
            if decided["start"] is None:
                return None
            ref = CheckpointRef(Path(decided["start"]), step_of(Path(decided["start"])) or 0)  # rank 0 found it: no look on this rank
            problem = None if decided["shards_verified"] else shards_problem(ref.path, self.env)
            if problem is None:
                self.plan = replace(self.read(ref, finished, shards_verified=True), set_aside=decided["set_aside"])
                return self.plan
            logger.warning("checkpoint step %d does not verify, skipped and left on disk: %s", ref.step, problem)
            passed_over.append(decided["start"])

    def resume_if_asked(self, finished: Callable[[Progress], bool]) -> None:
        """Restore the checkpoint this run continues from, if any: the one :meth:`plan_resume` chose
        (planned now unless it was before)."""
        plan = self.plan if self.planned else self.plan_resume(finished)
        if plan is not None:
            self.apply(plan)

    def _read_and_check(self, ref: CheckpointRef, shards_verified: bool) -> tuple[dict[str, Any], dict[str, Any] | None, Manifest | None]:
        """The shared entries, this rank's RNG and the manifest, read, verified and checked against the
        live run on every rank."""
        where = str(ref.shared_file)
        error: Exception | None = None
        shared: dict[str, Any] = {}
        rng = manifest = None
        try:
            manifest = ref.manifest()
            shared = CheckpointStore.load_shared(ref, manifest)
            rng = self._rank_rng(ref, manifest)
            if shared.get(keys.SHARDS) is not None:  # checked by shape and dtype; this rank verifies its share of the files
                if shards_verified:
                    shard_files(ref.path, manifest)  # the manifest vouches for the shards DCP will read
                else:
                    verify_shards(ref.path, manifest, self.env)
                shared = shape_view(shared, where)
            check_shared_entries(shared, where)
            if self.view is not None:
                shared = self.view.restrict(shared, where)
            check_model_state(shared[keys.MODEL], self.state.module, where)
            check_optimizer_state(shared[keys.OPTIMIZER], self.state.optimizer, where)
            check_sampler_state(shared[keys.SAMPLER], self.state.sampler.state_dict(), where)
            self._check_extra(shared.get(EXTRA), where)
        except (CheckpointError, KeyError) as exc:
            error = exc if isinstance(exc, CheckpointError) else CheckpointError(f"{ref.path}: checkpoint lacks entry {exc}")
        failed = int(sum_across_ranks(float(error is not None)).item())
        if error is not None:
            raise error
        if failed:
            raise CheckpointError(f"{ref.path}: {failed} rank(s) could not read or check their part of this checkpoint; nothing loaded")
        return shared, rng, manifest

    def _rank_rng(self, ref: CheckpointRef, manifest: Manifest) -> dict[str, Any] | None:
        """This rank's saved RNG state (None when the checkpoint was saved by fewer ranks)."""
        rank_state = CheckpointStore.load_rank(ref, self.env.rank, manifest)
        if rank_state is None:
            return None
        if not isinstance(rank_state.get(keys.RNG), dict):
            raise CheckpointError(f"{ref.rank_file(self.env.rank)}: not a complete ampddp checkpoint: no {keys.RNG!r} state")
        return rank_state[keys.RNG]

    def _check_extra(self, saved: Any, where: str) -> None:
        missing = [name for name in self.state.extra if not isinstance(saved, dict) or name not in saved]
        if missing:
            has = ", ".join(saved) if isinstance(saved, dict) and saved else "none"
            raise CheckpointError(f"{where}: holds no state for the registered item(s) {', '.join(missing)} (it holds: {has})")

    def read(self, ref: CheckpointRef, finished: Callable[[Progress], bool], shards_verified: bool = False) -> ResumePlan:
        """Everything restoring ``ref`` needs, read and checked against the live run (entries, shapes,
        precision, progress, the run's settings, the LR schedule's extension), changing nothing.

        ``finished(progress)`` says whether the saved run is complete (then its schedule is not
        re-planned); ``shards_verified``: a sharded checkpoint's files were just hashed (not again).
        """
        shared, rng, manifest = self._read_and_check(ref, shards_verified)
        where = str(ref.shared_file)
        changed = check_resume_settings(shared.get(keys.CONFIG), self.config, str(ref.path))
        saved_progress = Progress()
        try:
            saved_progress.load_state_dict(shared[keys.PROGRESS])
        except (TypeError, ValueError, KeyError) as error:
            raise CheckpointError(f"{where}: its {keys.PROGRESS!r} entry is malformed ({error})") from None
        applied = saved_progress.global_step - saved_progress.skipped_steps
        state = self.state
        schedule = (
            SchedulePlan()  # a finished run only reports that it is complete: nothing to re-plan
            if finished(saved_progress)
            else plan_schedule(state.optimizer, state.scheduler, shared[keys.OPTIMIZER], shared.get(keys.SCHEDULER), applied, str(ref.path))
        )
        precision = precision_conversion(state.engine, shared[keys.PRECISION], where)
        return ResumePlan(ref, shared, rng, manifest, saved_progress, schedule, precision, [changed] if changed else [])

    def load(self, ref: CheckpointRef, finished: Callable[[Progress], bool], shards_verified: bool = False) -> None:
        """Restore every item; the run continues exactly where the checkpoint was taken (:meth:`read`,
        then :meth:`apply`)."""
        self.apply(self.read(ref, finished, shards_verified))

    def apply(self, plan: ResumePlan) -> None:
        """Restore what ``plan`` read and checked: the newer folders it sets aside moved first (rank 0),
        a sharded checkpoint's tensors read into the live ones, then every item."""
        state, ref, shared = self.state, plan.ref, plan.shared
        if self.store is not None and self.env.is_main:
            set_aside_newer(self.store, ref.step, plan.set_aside)
        if shared.get(keys.SHARDS) is not None:  # collective: each rank reads its part, cut as it holds the tensors
            shared = read_into_live(ref.path, shared, plan.manifest, state.module.state_dict(), state.optimizer, self.env,
                                    None if self.view is None else self.view.local_index)  # fmt: skip
        for line in plan.notes + plan.schedule.notes:
            logger.warning(line)
        self._load_extra(shared.get(EXTRA, {}), str(ref.shared_file))  # first: a user item that refuses its state changes nothing else
        apply_precision(state.engine, plan.precision, str(ref.shared_file))
        state.module.load_state_dict(sharded_model_state(shared[keys.MODEL], state.module.state_dict()))
        if plan.schedule.load_optimizer:
            state.optimizer.load_state_dict(sharded_optimizer_state(shared[keys.OPTIMIZER], state.optimizer))
        if plan.schedule.load_scheduler and shared.get(keys.SCHEDULER) is not None:
            state.scheduler.load_state_dict(shared[keys.SCHEDULER])
        plan.schedule.apply(state.optimizer, state.scheduler)
        state.progress.load_state_dict(plan.progress.state_dict())
        self._continue_tracked_runs(ref, shared.get(keys.TRACKED_RUNS) or {})
        self.saved_step = ref.step
        self._restore_rng(plan.rng, ref, shared[keys.WORLD_SIZE])
        logger.info("resumed from %s at step %d (epoch %d)", ref.path, state.progress.global_step, state.progress.epoch)
        saved = shared.get(keys.MESH)
        if saved and self.mesh and saved != self.mesh:
            logger.info("its tensors were written by %s and read into %s", layout_words(saved), layout_words(self.mesh))

    def _continue_tracked_runs(self, ref: CheckpointRef, saved: dict[str, str]) -> None:
        """The trackers' runs continue when the checkpoint is this run dir's own; one taken from another
        run dir (``resume_from``) starts fresh tracked runs rather than logging into that run's."""
        own = self.store is not None and ref.path.parent.resolve() == self.store.root.resolve()
        if saved and not own:
            logger.info("%s belongs to another run dir: its tracked runs (%s) are not continued", ref.path, ", ".join(saved))
        self.state.tracked_runs.load_state_dict(saved if own else {})

    def _load_extra(self, saved: dict[str, Any], where: str) -> None:
        for name, item in self.state.extra.items():
            try:
                item.load_state_dict(saved[name])
            except Exception as error:  # a user item's own failure: named, and nothing of the run loaded
                reason = f"{type(error).__name__}: {error}"
                raise CheckpointError(f"{where}: registered item {name!r} refused its saved state ({reason})") from error

    def _restore_rng(self, rng: dict[str, Any] | None, ref: CheckpointRef, saved_world: int) -> None:
        if rng is not None:
            restore_rng(rng)
            return
        derive_rng(self.seed, self.env.rank, self.state.progress.global_step)
        rank = self.env.rank
        logger.warning("%s has no RNG state for rank %d (saved by %d ranks): derived it from the seed", ref.path, rank, saved_world)


def _loadable(name: str, state: Any) -> Any:
    """``state`` if it survives a ``weights_only`` round trip, else a ConfigError naming the item: a
    checkpoint that could never be loaded is not written."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    try:
        torch.load(buffer, weights_only=True)
    except Exception as error:  # pickle's refusal names the type it would have to import
        reason = str(error).strip().splitlines()[-1] if str(error).strip() else type(error).__name__
        raise ConfigError(
            f"checkpoint item {name!r}: its state_dict holds objects a safe load cannot read ({reason[:200]}); "
            "keep it to tensors, lists, tuples, dicts, numbers and strings"
        ) from None
    return state


RESUME_CHOICES = ("auto", "never")


def check_resume_choice(resume: str | Path) -> None:
    """``resume`` is auto, never, or an existing checkpoint or run dir."""
    if not isinstance(resume, (str, Path)) or (str(resume) not in RESUME_CHOICES and not Path(resume).exists()):
        raise ConfigError(f"resume={resume!r} is not valid; valid: {', '.join(RESUME_CHOICES)}, or the path of a checkpoint or run dir")
