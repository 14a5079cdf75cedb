"""Held-out data is standardised with the training split's statistics, never with its own."""

from __future__ import annotations

import numpy
import pytest
import torch
import torchvision.datasets
from torchvision.transforms import v2

from ampddp.zoo.data import _normalise, cifar10, digits, eval_geometry


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
    raw_train = torch.tensor(FakeCIFAR10("", True, False).data).permute(0, 3, 1, 2)
    raw_test = torch.tensor(FakeCIFAR10("", False, False).data).permute(0, 3, 1, 2)
    scaled = raw_train.float() / 255.0  # the statistics ampddp standardised cifar10 with before transforms v2
    mean, std = scaled.mean(dim=(0, 2, 3)), scaled.std(dim=(0, 2, 3))
    for dataset in (train_set, test_set):
        normalize = next(t for t in dataset.transform.transforms if isinstance(t, v2.Normalize))
        assert normalize.mean == pytest.approx(mean.tolist(), rel=1e-6) and normalize.std == pytest.approx(std.tolist(), rel=1e-6)
    expected = (v2.Compose(eval_geometry(32))(raw_test).float() / 255.0 - mean.view(1, 3, 1, 1)) / std.view(1, 3, 1, 1)
    test_images = torch.stack([test_set[i][0] for i in range(len(test_set))])
    torch.testing.assert_close(test_images, expected)
    assert (test_images.mean(dim=(0, 2, 3)) > 1.0).all(), "the brighter test split keeps its shift"
    image, label = train_set[3]
    assert image.shape == (3, 32, 32) and image.dtype == torch.float32 and label == 3


def test_cifar10_padded_crop_evaluates_the_whole_image_and_trains_on_shifted_crops(tmp_path, monkeypatch):
    """data.crop=padded: CIFAR's practice (random 32 crop of the image padded by 4, flip; eval unchanged)."""
    (tmp_path / "cifar-10-batches-py").mkdir()
    monkeypatch.setattr(torchvision.datasets, "CIFAR10", FakeCIFAR10)
    train_set, test_set = cifar10(str(tmp_path), image_size=32, augment=True, crop="padded")
    normalize = next(t for t in test_set.transform.transforms if isinstance(t, v2.Normalize))
    mean, std = torch.tensor(normalize.mean).view(3, 1, 1), torch.tensor(normalize.std).view(3, 1, 1)
    raw_test = torch.tensor(FakeCIFAR10("", False, False).data).permute(0, 3, 1, 2)
    torch.testing.assert_close(test_set[2][0], (raw_test[2].float() / 255.0 - mean) / std)
    raw = torch.tensor(FakeCIFAR10("", True, False).data).permute(0, 3, 1, 2)[5].float() / 255.0
    padded = torch.nn.functional.pad(raw, (4, 4, 4, 4))
    crops = {(top, left, flip) for top in range(9) for left in range(9) for flip in (False, True)}
    seen = set()
    for seed in range(40):
        torch.manual_seed(seed)
        image = train_set[5][0] * std + mean
        match = [c for c in crops if torch.allclose(image, _window(padded, *c), atol=1e-5)]
        assert len(match) >= 1, "every training image is a 32x32 window of the zero-padded image, maybe flipped"
        seen.add(match[0])
    assert len(seen) > 10, "the windows are drawn at random"


def _window(padded: torch.Tensor, top: int, left: int, flip: bool) -> torch.Tensor:
    window = padded[:, top : top + 32, left : left + 32]
    return window.flip(-1) if flip else window
