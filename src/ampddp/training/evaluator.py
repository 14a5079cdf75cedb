"""Evaluation over a whole split: every sample counted exactly once across ranks, no padding."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, closing
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset, Sampler

from ampddp.checkpoint.rng import capture_rng, restore_rng
from ampddp.distributed.data import eval_sampler, sum_across_ranks
from ampddp.distributed.env import DistEnv
from ampddp.distributed.mesh import DataShard
from ampddp.distributed.schedule import MicroBatches, StepSchedule
from ampddp.distributed.wrap import GradSync
from ampddp.errors import BadSamplesError, ConfigError
from ampddp.rundir.strict_json import NONFINITE_FIELD
from ampddp.training.batches import BatchAdapter, LossFn, MetricsFn
from ampddp.training.loading import DataLoading, LoaderSettings, loader_pass, name_batch_rows

RESERVED_NAMES = ("loss", "samples", "kind", "step", "epoch", NONFINITE_FIELD)
"""Names an evaluation record already uses: a metric may not take them."""


class EvaluationStopped(Exception):
    """A stop signal reached a rank during an evaluation: every rank left it at the same batch."""


class Evaluator:
    """The loss (``loss_fn``, as in training) and ``metrics`` over ``eval_set``, averaged per sample.

    Each rank reads its own contiguous shard (no sample repeated to even out the ranks), sums loss
    and metric values weighted by batch size, and one all-reduce gives the exact means over the split.
    Evaluation leaves the training run's random streams as they were.
    """

    def __init__(self, eval_set: Dataset, batch_size: int, env: DistEnv, *, loss_fn: LossFn, metrics: MetricsFn | None,
                 batches: BatchAdapter, loading: DataLoading | None = None, collective_forward: bool = False,
                 shard: DataShard | None = None, schedule: StepSchedule | None = None) -> None:  # fmt: skip
        self.eval_set, self.batch_size, self.env = eval_set, batch_size, env
        self.shard = shard if shard is not None else DataShard.of(env)
        """Where this rank reads the split: its data-parallel coordinates (sums add up over their group)."""
        self.schedule = schedule if schedule is not None else MicroBatches(GradSync(nn.Identity()))
        """Runs each forward as the step's schedule runs a whole-model forward (a pipeline's, through its stages)."""
        self.collective_forward = collective_forward
        """Every forward gathers with every rank (the strategy's word: FSDP2), so each rank runs as many."""
        self.loss_fn, self.metrics, self.batches = loss_fn, metrics, batches
        self.loading = loading or DataLoading(LoaderSettings(), env.device, seed=0)
        self._loader: DataLoader | None = None
        self._sampler: Sampler[int] | None = None

    @torch.no_grad()
    def evaluate(self, model: nn.Module, forward_context: Callable[[], AbstractContextManager[Any]],
                 stop: Callable[[], bool] | None = None) -> dict[str, float]:  # fmt: skip
        """The means over the split. ``stop``: whether a stop signal arrived; before each batch the
        ranks agree on it and, when any rank has one, all raise ``EvaluationStopped`` together."""
        rng = capture_rng()
        modes = [(module, module.training) for module in model.modules()]  # a frozen (eval-mode) part stays frozen
        model.eval()
        try:
            sums, seen = self._sums(model, forward_context, stop)
        finally:
            for module, training in modes:
                module.training = training
            restore_rng(rng)  # evaluation must not shift the training run's random streams
        names = self._names_on_every_rank(list(sums))
        totals = sum_across_ranks(torch.tensor([*(sums.get(name, 0.0) for name in names), seen], dtype=torch.float64), self.shard.group)
        count = totals[-1]
        return {**{name: (total / count).item() for name, total in zip(names, totals[:-1])}, "samples": int(count)}

    def _sums(self, model: nn.Module, forward_context: Callable[[], AbstractContextManager[Any]],
              stop: Callable[[], bool] | None) -> tuple[dict[str, float], float]:  # fmt: skip
        if self._loader is None:  # built once; its workers (if any) start and stop with each evaluation
            self._sampler = eval_sampler(self.eval_set, self.shard)
            self._loader = self.loading.eval_loader(self.eval_set, self._sampler, self.batch_size)
        sums: dict[str, float] = {}
        seen = 0.0
        positions = self._positions(len(self._loader), stop is not None)
        batch = None
        with closing(loader_pass(self._loader)) as batches:  # a failing batch stops the workers here and now
            for number in range(positions):
                if stop is not None and self._stop_agreed(stop()):
                    raise EvaluationStopped
                loaded = next(batches, None)
                if loaded is None:  # this rank's shard is done; the others still gather (FSDP2) or agree on stops
                    if self.collective_forward:
                        filler = batch if batch is not None else self.batches.to_device(self._loader.collate_fn([self.eval_set[0]]),
                                                                                         self.env.device)  # fmt: skip
                        with forward_context():  # counted nowhere: only to take part in the sharded model's gathers
                            self._forward(model, filler)
                    continue
                batch = self.batches.to_device(loaded, self.env.device)
                for name, value in self._values(model, forward_context, batch, number).items():
                    sums[name] = sums.get(name, 0.0) + float(value)
                seen += self.batches.count(batch)
        return sums, seen

    def _forward(self, model: nn.Module, batch: Any) -> Any:
        return self.schedule.forward(lambda: self.batches.forward(model, batch))

    def _values(self, model: nn.Module, forward_context: Callable[[], AbstractContextManager[Any]], batch: Any,
                number: int) -> dict[str, Any]:  # fmt: skip
        """Loss (times the batch's sample count) and metric sums of batch ``number``."""
        count = self.batches.count(batch)
        with forward_context():
            outputs = self._forward(model, batch)
            try:
                values = {"loss": self.loss_fn(outputs, batch).detach().double() * count}
            except BadSamplesError as error:
                raise error.named(self._samples(number, error.rows)) from error
        values.update(self._metric_values(outputs, batch))
        return values

    def _positions(self, batches_here: int, agreeing: bool) -> int:
        """How many batch positions this rank goes through: its own batches, or, where each position
        is a collective (a sharded model gathers its params in every forward; ranks agree on a stop
        before every batch), the most batches any rank has (the shards of an unpadded split differ)."""
        if not self.env.distributed or not (self.collective_forward or agreeing):
            return batches_here
        most = torch.tensor([batches_here], dtype=torch.int64, device=self.env.device)
        dist.all_reduce(most, op=dist.ReduceOp.MAX)
        return int(most.item())

    def _stop_agreed(self, local: bool) -> bool:
        """Whether any rank has a stop signal (one small all-reduce when distributed)."""
        if not self.env.distributed:
            return local
        flag = torch.tensor([float(local)], device=self.env.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item() > 0)

    def _samples(self, batch_number: int, rows: tuple[int, ...]) -> str:
        """``rows`` of evaluation batch ``batch_number`` named by their dataset indices."""
        return name_batch_rows(self._sampler or [], self.batch_size, batch_number, rows, "evaluation")

    def _metric_values(self, outputs: Any, batch: Any) -> dict[str, Any]:
        if self.metrics is None:
            return {}
        values = dict(self.metrics(outputs, batch))
        taken = sorted(set(values) & set(RESERVED_NAMES))
        if taken:
            raise ConfigError(f"metric name(s) {', '.join(taken)} are reserved ({', '.join(RESERVED_NAMES)}); rename them")
        return values

    def _names_on_every_rank(self, local: list[str]) -> list[str]:
        """The metric names every rank reduces, in one order: a rank with an empty shard (or a metric
        that returned a name only on some batches) still takes part in the same all-reduce."""
        if not self.env.distributed:
            return local
        gathered: list[list[str]] = [[] for _ in range(self.env.world_size)]
        dist.all_gather_object(gathered, local)
        return list(dict.fromkeys(name for names in gathered for name in names))
