"""Datasets: scikit-learn's digits (embedded, no download) by default; cifar10 and imagefolder locally.

Training sets apply their augmentation with torch's global generator, so a checkpoint's RNG state
makes a resumed run draw exactly the same augmentations.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from ampddp.errors import ConfigError

if TYPE_CHECKING:
    import numpy

CIFAR_LAYOUT = "ROOT/cifar-10-batches-py/ (the extracted python version of CIFAR-10)"
IMAGEFOLDER_LAYOUT = "ROOT/train/<class>/<image> and ROOT/val/<class>/<image>"


class TensorImages(Dataset):
    """Images held in memory as a float tensor (N, C, H, W), with optional shift-and-noise augmentation."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, augment: bool) -> None:
        self.images, self.labels, self.augment = images, labels, augment

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        image = self.images[index]
        if self.augment:
            shift = torch.randint(-2, 3, (2,))
            image = torch.roll(image, shifts=(int(shift[0]), int(shift[1])), dims=(1, 2))
            image = image + 0.05 * torch.randn_like(image)
        return image, self.labels[index]


def _normalise(train: torch.Tensor, held_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Standardise both splits per channel with the training split's mean and std.

    The held-out split is data the model has not seen: scaling it by its own statistics would use
    them (and hide a shift between the splits), so it gets the training split's transform.
    """
    mean = train.mean(dim=(0, 2, 3), keepdim=True)
    std = train.std(dim=(0, 2, 3), keepdim=True).clamp_min(1e-6)
    return (train - mean) / std, (held_out - mean) / std


def digits(image_size: int, channels: int, eval_fraction: float, seed: int, augment: bool) -> tuple[Dataset, Dataset]:
    """The 1,797 8x8 handwritten digits shipped inside scikit-learn, resized; a stratified split."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    if not 0 < eval_fraction < 1:
        raise ConfigError(f"data.eval_fraction={eval_fraction} is not valid; it must lie in (0, 1)")
    images, labels = load_digits(return_X_y=True)
    train_x, eval_x, train_y, eval_y = train_test_split(images, labels, test_size=eval_fraction, random_state=seed, stratify=labels)

    def images_of(x: numpy.ndarray) -> torch.Tensor:
        tensor = torch.tensor(x, dtype=torch.float32).view(-1, 1, 8, 8) / 16.0
        tensor = F.interpolate(tensor, size=(image_size, image_size), mode="bilinear", align_corners=False)
        return tensor.repeat(1, channels, 1, 1)

    train_images, eval_images = _normalise(images_of(train_x), images_of(eval_x))
    return (
        TensorImages(train_images, torch.tensor(train_y, dtype=torch.long), augment),
        TensorImages(eval_images, torch.tensor(eval_y, dtype=torch.long), False),
    )


def _require(root: str | None, name: str, layout: str) -> Path:
    if root is None:
        raise ConfigError(f"data.name={name} needs data.root; expected layout: {layout}")
    path = Path(root)
    if not path.is_dir():
        raise ConfigError(f"data.root={root}: no such directory; {name} expects {layout}")
    return path


def cifar10(root: str | None, image_size: int, augment: bool) -> tuple[Dataset, Dataset]:
    from torchvision.datasets import CIFAR10

    path = _require(root, "cifar10", CIFAR_LAYOUT)
    if not (path / "cifar-10-batches-py").is_dir():
        raise ConfigError(f"data.root={root}: no cifar-10-batches-py folder inside; expected {CIFAR_LAYOUT} (ampddp never downloads)")

    def load(train: bool) -> tuple[torch.Tensor, torch.Tensor]:
        raw = CIFAR10(str(path), train=train, download=False)
        images = torch.tensor(raw.data).permute(0, 3, 1, 2).float() / 255.0
        if image_size != 32:
            images = F.interpolate(images, size=(image_size, image_size), mode="bilinear", align_corners=False)
        return images, torch.tensor(raw.targets)

    (train_images, train_labels), (test_images, test_labels) = load(True), load(False)
    train_images, test_images = _normalise(train_images, test_images)
    return TensorImages(train_images, train_labels, augment), TensorImages(test_images, test_labels, False)


def imagefolder(root: str | None, image_size: int, augment: bool) -> tuple[Dataset, Dataset]:
    from torchvision import transforms
    from torchvision.datasets import ImageFolder

    path = _require(root, "imagefolder", IMAGEFOLDER_LAYOUT)
    for split in ("train", "val"):
        if not (path / split).is_dir():
            raise ConfigError(f"data.root={root}: missing {split}/ folder; expected {IMAGEFOLDER_LAYOUT}")
    resize = [transforms.Resize((image_size, image_size)), transforms.ToTensor()]
    train_tf = transforms.Compose(([transforms.RandomHorizontalFlip()] if augment else []) + resize)
    return ImageFolder(str(path / "train"), train_tf), ImageFolder(str(path / "val"), transforms.Compose(resize))


def build_datasets(
    name: str, root: str | None, image_size: int, channels: int, eval_fraction: float, seed: int, augment: bool
) -> tuple[Dataset, Dataset]:
    """Training and evaluation sets for ``data.name``."""
    if name == "digits":
        return digits(image_size, channels, eval_fraction, seed, augment)
    if name == "cifar10":
        return cifar10(root, image_size, augment)
    return imagefolder(root, image_size, augment)
