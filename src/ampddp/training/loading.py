"""Feeding the loop: DataLoaders whose batches do not depend on the number of workers or processes.

Each training sample is fetched with torch's global generator seeded from (seed, epoch, sample index)
just around ``dataset[index]``, in the training process or in a loader worker alike, then restored.
So augmentation that draws from torch (torchvision's transforms do) is the same for any
``num_workers``, any number of processes and across a resume, and it never shifts the training
run's own random streams (dropout). Python's ``random`` and numpy are seeded per worker from torch's
seed (torch's documented practice): a dataset drawing from them is reproducible from run to run, but
only torch draws are tied to the sample.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import random
import signal
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from multiprocessing import resource_tracker
from typing import Any

import numpy
import torch
from torch.utils.data import ConcatDataset, DataLoader, Dataset, Sampler, Subset, TensorDataset

from ampddp.choices import MAX_PREFETCH, MAX_PROCESSES
from ampddp.distributed.data import ResumableSampler
from ampddp.errors import ConfigError, DataError, listed, shown, spelled
from ampddp.preemption import blocked_signals
from ampddp.torch_compat import detach_persistent_workers, loader_worker_shutdown

logger = logging.getLogger("ampddp.trainer")
_SPLITMIX = tuple(numpy.uint64(value) for value in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB, 30, 27, 31))


def sample_seeds(seed: int, epochs: Sequence[int], indices: Sequence[int]) -> numpy.ndarray:
    """A 64-bit seed for each (epoch, index) sample (splitmix64 over seed, epoch and index), for a whole
    batch at once: numpy's uint64 arithmetic wraps as the hash needs."""
    golden, first, second, shift_a, shift_b, shift_c = _SPLITMIX
    parts = [numpy.full(len(indices), seed, dtype=numpy.uint64), numpy.asarray(epochs, dtype=numpy.uint64),
             numpy.asarray(indices, dtype=numpy.uint64)]  # fmt: skip
    value = numpy.zeros(len(indices), dtype=numpy.uint64)
    for part in parts:
        value = (value ^ part) + golden
        value = (value ^ (value >> shift_a)) * first
        value = (value ^ (value >> shift_b)) * second
        value ^= value >> shift_c
    return value


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """The seed of one sample (``sample_seeds`` of one)."""
    return int(sample_seeds(seed, [epoch], [index])[0])


class SeededSamples(Dataset):
    """``dataset`` addressed by ``(epoch, index)``: each item fetched under its own torch seed, so a
    sample's random draws (augmentation) are the same whatever the workers, the batch or a resume.

    A DataLoader fetches a batch through ``__getitems__``: the seeds computed for the batch at once, the
    training streams' generator state saved and restored once per batch, not per sample (that, and a
    Python hash per sample, made seeding cost more than the fetch: 0.75 ms against a plain loader's
    0.29 ms for 128 samples). A dataset that draws nothing (``draws_random``) is not seeded at all.
    """

    def __init__(self, dataset: Dataset, seed: int) -> None:
        self.dataset, self.seed = dataset, seed
        self.seeded = draws_random(dataset)

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, key: tuple[int, int]) -> Any:
        return self.__getitems__([key])[0]

    def __getitems__(self, keys: Sequence[tuple[int, int]]) -> list[Any]:
        epochs, indices = zip(*keys) if keys else ((), ())
        seeds = sample_seeds(self.seed, epochs, indices).tolist() if self.seeded else None
        generator = torch.default_generator
        saved = generator.get_state() if seeds is not None else None
        samples: list[Any] = []
        try:
            for position, index in enumerate(indices):
                if seeds is not None:
                    generator.manual_seed(seeds[position])
                samples.append(self.dataset[index])
        except (ConfigError, DataError):
            raise  # ampddp's own datasets already name the file and what is wrong with it
        except Exception as error:
            failed = len(samples)
            raise unloadable(error, f"training sample {indices[failed]} (epoch {epochs[failed]})") from error
        finally:
            if saved is not None:
                generator.set_state(saved)
        return samples


def draws_random(dataset: Dataset) -> bool:
    """Whether loading a sample of ``dataset`` may draw from torch's generator, so that each sample must
    be seeded for its draws to be the same in any worker and after a resume. A dataset says so by a
    ``draws_random`` attribute (ampddp's own do: their augmentation on or off); torch's ``TensorDataset``
    (indexing only) never draws, nor ``Subset``/``ConcatDataset`` of datasets that do not; any other may."""
    said = getattr(dataset, "draws_random", None)
    if isinstance(said, bool):
        return said
    if type(dataset) is TensorDataset:
        return False
    if isinstance(dataset, Subset):
        return draws_random(dataset.dataset)
    if isinstance(dataset, ConcatDataset):
        return any(draws_random(part) for part in dataset.datasets)
    return True


class NamedSamples(Dataset):
    """``dataset`` whose loading errors name the sample (evaluation's view; training's is ``SeededSamples``)."""

    def __init__(self, dataset: Dataset, role: str) -> None:
        self.dataset, self.role = dataset, role

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> Any:
        return load_sample(self.dataset, index, f"{self.role} sample {index}")


def load_sample(dataset: Dataset, index: int, what: str) -> Any:
    """``dataset[index]``; an error raised there becomes a one-line ``DataError`` naming the sample."""
    try:
        return dataset[index]
    except (ConfigError, DataError):
        raise  # ampddp's own datasets already name the file and what is wrong with it
    except Exception as error:
        raise unloadable(error, what) from error


def unloadable(error: Exception, what: str) -> DataError:
    """The one-line ``DataError`` for ``error``, raised loading the sample ``what`` names."""
    reason = " ".join(str(error).split())[:300] or "no message"
    return DataError(f"{what} cannot be loaded: {type(error).__name__}: {reason}; fix or remove that sample")


class KeyedSampler(Sampler[tuple[int, int]]):
    """``sampler``'s indices as ``(epoch, index)`` keys for ``SeededSamples``."""

    def __init__(self, sampler: ResumableSampler) -> None:
        self.sampler = sampler

    def __iter__(self) -> Iterator[tuple[int, int]]:
        epoch = self.sampler.epoch
        return ((epoch, index) for index in self.sampler)

    def __len__(self) -> int:
        return len(self.sampler)


def batch_sample_indices(sampler: Iterable[int], batch_size: int, batch_number: int, rows: Sequence[int]) -> list[int] | None:
    """The dataset indices of ``rows`` of batch ``batch_number`` in one pass over ``sampler``, batched
    as a DataLoader does (consecutive runs of ``batch_size``); None when a row is not a sample of that
    batch (a loss over flattened tokens reports token rows). For naming bad samples: it walks the
    sampler again, so it is used only once something went wrong (ampddp's samplers repeat a pass)."""
    start = batch_number * batch_size
    batch = list(itertools.islice(iter(sampler), start, start + batch_size))
    if any(not 0 <= row < len(batch) for row in rows):
        return None
    return [batch[row] for row in rows]


def name_batch_rows(sampler: Iterable[int], batch_size: int, batch_number: int, rows: Sequence[int], role: str, when: str = "") -> str:
    """``rows`` of ``role``'s (training, evaluation) batch ``batch_number`` in words: their dataset
    indices, or their positions when they are not samples of the batch; ``when``: e.g. " (epoch 2)"."""
    indices = batch_sample_indices(sampler, batch_size, batch_number, rows)
    if indices is None:
        return f"batch position(s) {listed(rows)} of {role} batch {batch_number}{when}"
    return f"{role} sample(s) {listed(set(indices))}{when}"


WORKER_IGNORED_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2") if hasattr(signal, name))
"""A scheduler's stop signal reaches the whole process group; a worker ignores it and lets the
training process checkpoint, after which the loader shuts the worker down."""


def start_worker(worker_id: int) -> None:
    """A loader worker's start: python's and numpy's generators seeded from the seed torch gave it,
    and the job's stop signals ignored (a worker killed by one would crash the run instead of letting
    it write its checkpoint). They arrive blocked (``begin_pass``): ignored first, so that one
    sent since the fork is dropped, then unblocked, as they were in the parent."""
    seed = torch.initial_seed() % 2**32
    random.seed(seed)
    numpy.random.seed(seed)
    for stop_signal in WORKER_IGNORED_SIGNALS:
        signal.signal(stop_signal, signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, WORKER_IGNORED_SIGNALS)


def begin_pass(loader: DataLoader) -> Iterator[Any]:
    """``iter(loader)`` with the job's stop signals blocked while it starts workers. A worker
    inherits the mask until ``start_worker`` ignores them, so a signal sent to the process group as
    it starts cannot kill it (and crash the run); this process gets its own once the mask is back.

    Under the ``forkserver`` start method (Python 3.14's default on Linux) the server forks the
    workers with its own mask, so the few milliseconds before ``start_worker`` stay unprotected."""
    method = _start_method(loader) if hasattr(signal, "pthread_sigmask") else None
    if method not in ("fork", "spawn"):
        return iter(loader)  # a forkserver launched in the block would keep the mask for every process it starts
    if method == "spawn":
        resource_tracker.ensure_running()  # launched in the block, it would unblock SIGINT and SIGTERM there
    iterator = None
    try:
        with blocked_signals(WORKER_IGNORED_SIGNALS):
            iterator = iter(loader)
    except BaseException:  # e.g. a pending SIGINT raised as the mask comes back: the workers exist already
        if iterator is not None:
            stop_workers(iterator)
        raise
    return iterator


def _start_method(loader: Any) -> str | None:
    """How ``loader`` starts its workers (its context, else torch's default); None without workers."""
    if getattr(loader, "num_workers", 0) == 0:
        return None
    return (loader.multiprocessing_context or torch.multiprocessing).get_start_method()


def loader_pass(loader: Any) -> Iterator[Any]:
    """One pass over ``loader`` (a DataLoader, or any iterable), started by ``begin_pass``.
    Workers started for this pass only (not persistent: evaluation) are stopped when it ends, however
    it ends, as ``DataLoading.close`` stops the persistent ones. A worker's ConfigError (e.g. an
    unreadable image) comes out as its one line (``worker_error``)."""
    iterator = begin_pass(loader)
    try:
        yield from iterator
    except ConfigError as error:
        raise worker_error(error) from None
    finally:
        if not getattr(loader, "persistent_workers", False):
            stop_workers(iterator)


def stop_workers(iterator: Any) -> None:
    """Stop a loader iterator's workers through torch's own shutdown, and kill one still alive.

    Workers ignore the job's stop signals, so they cannot be left to torch's fallback or to the
    interpreter's exit (both send SIGTERM, and the exit then waits forever for a hung worker).
    """
    workers = list(getattr(iterator, "_workers", ()))
    shutdown = loader_worker_shutdown(iterator)
    if shutdown is not None:
        shutdown()
    for worker in workers:
        if worker.is_alive():
            worker.kill()
            worker.join()


def _check_count(name: str, value: Any, low: int, high: int, optional: bool) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"data.{name}={value!r} is not valid; it must be an integer >= {low}" + (" or null" if optional else ""))
    if value > high:
        raise ConfigError(f"data.{name}={shown(value)} is out of range; it must be an integer in [{low}, {high}]")


@dataclass(frozen=True)
class LoaderSettings:
    """How batches are loaded: worker processes, pinned memory, prefetching."""

    num_workers: int = 0
    pin_memory: bool | None = None
    """None: on when training on CUDA."""
    persistent_workers: bool | None = None
    """None: on when there are workers."""
    prefetch_factor: int | None = None
    """None: torch's default (2 batches per worker)."""

    def __post_init__(self) -> None:
        _check_count("num_workers", self.num_workers, 0, MAX_PROCESSES, optional=False)
        _check_count("prefetch_factor", self.prefetch_factor, 1, MAX_PREFETCH, optional=True)
        for name in ("pin_memory", "persistent_workers"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), bool):
                raise ConfigError(f"data.{name}={getattr(self, name)!r} is not valid; it must be true, false or null")
        for name in ("persistent_workers", "prefetch_factor"):
            if self.num_workers == 0 and getattr(self, name) not in (None, False):
                value = spelled(getattr(self, name))
                raise ConfigError(f"data.{name}={value} needs worker processes; set data.num_workers >= 1 or leave it null")

    def loader_options(self, device: torch.device) -> dict[str, Any]:
        """DataLoader keywords for training on ``device``."""
        options: dict[str, Any] = {
            "num_workers": self.num_workers,
            "pin_memory": device.type == "cuda" if self.pin_memory is None else self.pin_memory,
        }
        if self.num_workers > 0:
            options["persistent_workers"] = True if self.persistent_workers is None else self.persistent_workers
            options["worker_init_fn"] = start_worker
            if self.prefetch_factor is not None:
                options["prefetch_factor"] = self.prefetch_factor
        return options


class DataLoading:
    """Builds the run's loaders once (workers persist across epochs); the training loader fetches
    every sample under its own seed."""

    def __init__(self, settings: LoaderSettings, device: torch.device, seed: int, worker_seed: int | None = None) -> None:
        self.settings, self.device, self.seed = settings, device, seed
        self.worker_seed = seed if worker_seed is None else worker_seed
        """Seeds the workers' python and numpy generators: give each rank its own (``DistEnv.rank_seed``)."""
        self._loaders: list[DataLoader] = []

    def _options(self, sample: Any) -> dict[str, Any]:
        """Loader options; pinned memory by default only for batches made on the CPU (torch cannot pin
        tensors already on a GPU)."""
        options = self.settings.loader_options(self.device)
        if self.settings.pin_memory is None and options["pin_memory"] and not _all_on_cpu(sample):
            options["pin_memory"] = False
        return options

    def train_loader(self, dataset: Dataset, sampler: ResumableSampler, batch_size: int) -> DataLoader:
        samples = SeededSamples(dataset, self.seed)
        options = self._options(samples[(0, 0)] if len(samples) and self._pin_asked() else None)
        return self._kept(
            DataLoader(
                samples, batch_size=batch_size, sampler=KeyedSampler(sampler),
                generator=torch.Generator().manual_seed(self.worker_seed), **options,
            )
        )  # fmt: skip

    def eval_loader(self, dataset: Dataset, sampler: Sampler[int], batch_size: int) -> DataLoader:
        """Workers start and stop with each evaluation (``evaluate()`` may be called after ``fit``)."""
        sample = dataset[0] if len(dataset) and self._pin_asked() else None  # type: ignore[arg-type]
        options = {**self._options(sample), "persistent_workers": False}
        generator = torch.Generator().manual_seed(self.worker_seed)
        return DataLoader(NamedSamples(dataset, "evaluation"), batch_size=batch_size, sampler=sampler, generator=generator, **options)

    def _pin_asked(self) -> bool:
        """Whether the default would pin (then one sample is looked at first)."""
        return self.settings.pin_memory is None and self.device.type == "cuda"

    def _kept(self, loader: DataLoader) -> DataLoader:
        self._loaders.append(loader)
        return loader

    def close(self) -> None:
        """Stop the workers of every loader built here (persistent ones live until told), at the end
        of training (``stop_workers``)."""
        for loader in self._loaders:
            stop_workers(detach_persistent_workers(loader))
        self._loaders.clear()


def _all_on_cpu(sample: Any) -> bool:
    if isinstance(sample, torch.Tensor):
        return sample.device.type == "cpu"
    items = sample.values() if isinstance(sample, dict) else sample if isinstance(sample, (tuple, list)) else ()
    return all(_all_on_cpu(item) for item in items)


WORKER_ERROR = "in DataLoader worker process"


def worker_error(error: ConfigError) -> ConfigError:
    """A ConfigError raised in a loader worker, as its one line (torch re-raises it with the worker's
    whole traceback as the message)."""
    text = str(error)
    if WORKER_ERROR not in text.splitlines()[0]:
        return error
    last = [line for line in text.strip().splitlines() if line.strip()][-1]
    return ConfigError(last.split("ConfigError: ", 1)[-1])


class InputTimer:
    """Time the loop spends waiting for batches (``data_wait_s``), and a warning when the input
    pipeline, not the model, sets the pace."""

    SLOW_SHARE = 0.25
    """Share of wall time spent waiting above which the pipeline is called the bottleneck."""

    def __init__(self) -> None:
        self.total = 0.0
        self._since_take = 0.0
        self._taken_at = time.perf_counter()
        self._takes = 0
        self._warned = False

    def batches(self, loader: DataLoader) -> Iterator[Any]:
        with contextlib.closing(loader_pass(loader)) as iterator:  # its workers stop with this pass, not at collection
            while True:
                started = time.perf_counter()
                try:
                    batch = next(iterator)
                except StopIteration:
                    return
                waited = time.perf_counter() - started
                self.total += waited
                self._since_take += waited
                yield batch

    def take(self, step: int) -> float:
        """Seconds waited since the last ``take``; warns once when that was most of the time."""
        now = time.perf_counter()
        waited, elapsed = self._since_take, now - self._taken_at
        self._since_take, self._taken_at = 0.0, now
        self._takes += 1
        # The first interval holds the workers' start-up (and compilation): judge from the second on.
        if self._takes > 1 and not self._warned and elapsed > 0 and waited / elapsed > self.SLOW_SHARE:
            self._warned = True
            logger.warning(
                "the input pipeline is the bottleneck: %.0f%% of the time up to step %d was spent waiting for batches; "
                "raise data.num_workers (or make the dataset's __getitem__ cheaper)",
                100 * waited / elapsed,
                step,
            )
        return waited
