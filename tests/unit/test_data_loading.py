"""The loading part: per-sample seeds, keyed sampling, loader settings, the input-wait timer."""

from __future__ import annotations

import dataclasses
import logging
import time

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from ampddp.distributed.data import ResumableSampler
from ampddp.distributed.env import detect_env
from ampddp.errors import ConfigError
from ampddp.training.loading import (
    DataLoading,
    InputTimer,
    KeyedSampler,
    LoaderSettings,
    SeededSamples,
    batch_sample_indices,
    sample_seed,
)


class Noisy(Dataset):
    """Each item draws its augmentation from torch's global generator, as torchvision transforms do."""

    def __len__(self) -> int:
        return 10

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.full((3,), float(index)) + torch.randn(3)


def test_a_sample_gets_the_same_draws_for_the_same_key_and_new_ones_each_epoch():
    samples = SeededSamples(Noisy(), seed=7)
    assert torch.equal(samples[(0, 3)], samples[(0, 3)])
    assert not torch.equal(samples[(0, 3)], samples[(1, 3)])
    assert not torch.equal(samples[(0, 3)], SeededSamples(Noisy(), seed=8)[(0, 3)])
    assert len({sample_seed(7, epoch, index) for epoch in range(20) for index in range(500)}) == 10_000


def test_fetching_a_sample_leaves_the_training_streams_where_they_were():
    torch.manual_seed(1)
    expected = torch.rand(4)
    torch.manual_seed(1)
    SeededSamples(Noisy(), seed=0)[(0, 5)]
    assert torch.equal(torch.rand(4), expected)


@pytest.mark.timeout(120)
def test_batches_are_identical_with_and_without_workers():
    env = detect_env({}, device="cpu")

    def batches(workers: int) -> list[torch.Tensor]:
        sampler = ResumableSampler(Noisy(), env, shuffle=True, seed=3)
        loader = DataLoading(LoaderSettings(num_workers=workers), env.device, seed=3).train_loader(Noisy(), sampler, 4)
        found = []
        for epoch in range(2):
            sampler.set_epoch(epoch, start=2 if epoch == 1 else 0)
            found.extend(loader)
        return found

    reference = batches(0)
    for workers in (1, 2):
        assert all(torch.equal(a, b) for a, b in zip(reference, batches(workers), strict=True))


def test_the_keyed_sampler_tags_each_index_with_the_sampler_epoch():
    env = detect_env({}, device="cpu")
    sampler = ResumableSampler(Noisy(), env, shuffle=False)
    sampler.set_epoch(4, start=7)
    assert list(KeyedSampler(sampler)) == [(4, 7), (4, 8), (4, 9)] and len(KeyedSampler(sampler)) == 3


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"num_workers": -1}, "data.num_workers=-1 is not valid; it must be an integer >= 0"),
        ({"num_workers": 1.5}, "data.num_workers=1.5 is not valid"),
        ({"prefetch_factor": 0, "num_workers": 2}, "data.prefetch_factor=0 is not valid; it must be an integer >= 1 or null"),
        ({"prefetch_factor": 4}, "data.prefetch_factor=4 needs worker processes; set data.num_workers >= 1"),
        ({"persistent_workers": True}, "data.persistent_workers=true needs worker processes"),
        ({"pin_memory": "yes"}, "data.pin_memory='yes' is not valid; it must be true, false or null"),
    ],
)
def test_bad_loader_settings_name_the_key_and_the_rule(settings, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        LoaderSettings(**settings)


def test_loader_options_pin_memory_for_cuda_and_keep_workers():
    options = LoaderSettings(num_workers=2).loader_options(torch.device("cuda"))
    assert options["pin_memory"] and options["persistent_workers"] and options["num_workers"] == 2
    assert not LoaderSettings().loader_options(torch.device("cpu"))["pin_memory"]
    assert "persistent_workers" not in LoaderSettings().loader_options(torch.device("cpu"))


class Slow(Dataset):
    def __len__(self) -> int:
        return 6

    def __getitem__(self, index: int) -> torch.Tensor:
        time.sleep(0.05)
        return torch.zeros(1)


def test_the_input_timer_counts_waiting_and_warns_once_when_it_dominates(caplog):
    timer = InputTimer()
    with caplog.at_level(logging.WARNING, logger="ampddp"):
        for step, _ in enumerate(timer.batches(DataLoader(Slow(), batch_size=2)), start=1):
            assert timer.take(step) >= 0.09  # two samples of 0.05 s each
    assert timer.total >= 0.29
    warnings = [r.getMessage() for r in caplog.records if "input pipeline is the bottleneck" in r.getMessage()]
    assert len(warnings) == 1 and "up to step 2" in warnings[0]


@pytest.mark.timeout(120)
def test_fit_stops_its_loader_workers_even_though_they_ignore_stop_signals():
    import multiprocessing

    from torch import nn
    from torch.utils.data import TensorDataset

    from ampddp.trainer import Trainer

    data = TensorDataset(torch.randn(24, 4), torch.randint(0, 2, (24,)))
    trainer = Trainer(nn.Linear(4, 2), lambda p: torch.optim.SGD(p, lr=0.1), data, eval_set=data, precision="O0", batch_size=4,
                      max_epochs=2, loading=LoaderSettings(num_workers=2))  # fmt: skip
    trainer.fit()
    assert multiprocessing.active_children() == []
    trainer.evaluate()  # after fit: its workers start and stop with it
    assert multiprocessing.active_children() == []


class Unreadable(Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int):
        if index == 5:
            raise ConfigError("/data/train/cat/005.jpg: cannot read this image (corrupt)")
        return torch.zeros(4), 0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", [0, 2])
def test_an_error_raised_in_a_worker_comes_out_as_its_one_line(workers):
    from torch import nn

    from ampddp.trainer import Trainer

    trainer = Trainer(nn.Linear(4, 2), lambda p: torch.optim.SGD(p, lr=0.1), Unreadable(), precision="O0", batch_size=2,
                      shuffle=False, loading=LoaderSettings(num_workers=workers))  # fmt: skip
    with pytest.raises(ConfigError) as caught:
        trainer.fit()
    assert str(caught.value) == "/data/train/cat/005.jpg: cannot read this image (corrupt)"


def test_memory_is_pinned_by_default_only_for_batches_made_on_the_cpu():
    cuda = DataLoading(LoaderSettings(), torch.device("cuda"), seed=0)
    assert cuda._options((torch.zeros(2), torch.tensor(1)))["pin_memory"]
    assert not cuda._options((torch.zeros(2, device="meta"), torch.tensor(1)))["pin_memory"]  # e.g. data already on the GPU
    assert DataLoading(LoaderSettings(pin_memory=True), torch.device("cuda"), seed=0)._options(None)["pin_memory"]


class Indices(Dataset):
    def __len__(self) -> int:
        return 23

    def __getitem__(self, index: int) -> int:
        return index


@pytest.mark.parametrize(("rank", "start", "drop_last"), [(0, 0, False), (1, 5, False), (2, 9, True)])
def test_a_batch_row_is_named_by_the_dataset_index_the_loader_put_there(rank, start, drop_last):
    """How a bad sample is named: every row of every batch, any rank, resumed mid-epoch or not."""
    env = dataclasses.replace(detect_env(), rank=rank, world_size=3)
    sampler = ResumableSampler(Indices(), env, seed=4, drop_last=drop_last)
    sampler.set_epoch(2, start=start)
    for number, batch in enumerate(DataLoader(Indices(), batch_size=3, sampler=sampler)):
        assert batch_sample_indices(sampler, 3, number, range(len(batch))) == batch.tolist()
        assert batch_sample_indices(sampler, 3, number, [len(batch) - 1, 7]) is None  # row 7 is no sample of it (token rows)


def test_a_batch_fetched_at_once_is_the_samples_fetched_one_by_one_and_leaves_the_streams_alone():
    samples = SeededSamples(Noisy(), seed=7)
    keys = [(2, 9), (2, 0), (2, 4)]
    torch.manual_seed(1)
    expected = torch.rand(4)
    torch.manual_seed(1)
    batch = samples.__getitems__(keys)
    assert torch.equal(torch.rand(4), expected)
    assert all(torch.equal(a, samples[key]) for a, key in zip(batch, keys, strict=True))


def test_only_datasets_that_may_draw_are_seeded():
    from torch.utils.data import ConcatDataset, Subset, TensorDataset

    from ampddp.training.loading import draws_random
    from ampddp.zoo.data import TensorImages

    plain = TensorDataset(torch.zeros(4, 2))
    images = torch.zeros(4, 1, 8, 8), torch.zeros(4, dtype=torch.long)
    assert not draws_random(plain) and not draws_random(Subset(plain, [0, 1])) and not draws_random(ConcatDataset([plain, plain]))
    assert draws_random(Noisy()) and draws_random(ConcatDataset([plain, Noisy()]))
    assert draws_random(TensorImages(*images, augment=True)) and not draws_random(TensorImages(*images, augment=False))
    torch.manual_seed(1)
    state = torch.get_rng_state()
    fetched = SeededSamples(plain, seed=0).__getitems__([(0, 1), (0, 3)])
    assert [sample[0].tolist() for sample in fetched] == [plain[1][0].tolist(), plain[3][0].tolist()]
    assert torch.equal(torch.get_rng_state(), state)
