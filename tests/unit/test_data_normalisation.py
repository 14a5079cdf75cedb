"""Held-out data is standardised with the training split's statistics, never with its own."""

from __future__ import annotations

import numpy
import torch
import torchvision.datasets

from ampddp.data import _normalise, cifar10, digits


def images(dataset: torch.utils.data.Dataset) -> torch.Tensor:
    return dataset.images


def test_the_held_out_split_keeps_its_shift_from_the_training_split():
    generator = torch.Generator().manual_seed(0)
    train = torch.randn(256, 2, 4, 4, generator=generator)
    held_out = 3.0 + 2.0 * torch.randn(64, 2, 4, 4, generator=generator)
    train_n, held_out_n = _normalise(train, held_out)
    assert torch.allclose(train_n.mean(dim=(0, 2, 3)), torch.zeros(2), atol=1e-5)
    assert torch.allclose(train_n.std(dim=(0, 2, 3)), torch.ones(2), atol=1e-5)
    mean, std = train.mean(dim=(0, 2, 3), keepdim=True), train.std(dim=(0, 2, 3), keepdim=True)
    torch.testing.assert_close(held_out_n, (held_out - mean) / std)
    assert (held_out_n.mean(dim=(0, 2, 3)) > 2.0).all()  # its own statistics would have forced it to 0


def test_digits_eval_split_uses_the_training_statistics():
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    train_set, eval_set = digits(image_size=8, channels=1, eval_fraction=0.25, seed=0, augment=False)
    raw, labels = load_digits(return_X_y=True)
    raw_train, raw_eval, _, _ = train_test_split(raw, labels, test_size=0.25, random_state=0, stratify=labels)
    raw_train = torch.tensor(raw_train, dtype=torch.float32) / 16.0
    raw_eval = torch.tensor(raw_eval, dtype=torch.float32) / 16.0
    mean, std = raw_train.mean(), raw_train.std()
    torch.testing.assert_close(images(eval_set).flatten(1), (raw_eval - mean) / std)
    assert abs(float(images(train_set).mean())) < 1e-5


class FakeCIFAR10:
    """torchvision's CIFAR10 interface (``data`` N,H,W,C uint8, ``targets``) without the files."""

    def __init__(self, root: str, train: bool, download: bool) -> None:
        rng = numpy.random.default_rng(0 if train else 1)
        low, high = (0, 128) if train else (128, 256)  # the test split is brighter
        self.data = rng.integers(low, high, size=(20 if train else 10, 32, 32, 3), dtype=numpy.uint8)
        self.targets = list(range(len(self.data)))


def test_cifar10_test_split_uses_the_training_statistics(tmp_path, monkeypatch):
    (tmp_path / "cifar-10-batches-py").mkdir()
    monkeypatch.setattr(torchvision.datasets, "CIFAR10", FakeCIFAR10)
    train_set, test_set = cifar10(str(tmp_path), image_size=32, augment=True)
    assert train_set.augment and not test_set.augment
    raw_train = torch.tensor(FakeCIFAR10("", True, False).data).permute(0, 3, 1, 2).float() / 255.0
    raw_test = torch.tensor(FakeCIFAR10("", False, False).data).permute(0, 3, 1, 2).float() / 255.0
    mean, std = raw_train.mean(dim=(0, 2, 3), keepdim=True), raw_train.std(dim=(0, 2, 3), keepdim=True)
    torch.testing.assert_close(images(test_set), (raw_test - mean) / std)
    assert (images(test_set).mean(dim=(0, 2, 3)) > 1.0).all()
    assert images(train_set).mean(dim=(0, 2, 3)).abs().max() < 1e-4
