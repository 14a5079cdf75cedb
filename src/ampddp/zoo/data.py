"""Datasets: scikit-learn's digits (embedded, no download) by default; cifar10 and imagefolder locally.

Augmentation (crops, flips, auto-augment, noise) draws from torch's global generator inside
``dataset[index]`` and keeps no state in the data set: the training loader seeds torch's generator
from (seed, epoch, sample index) around each fetch (``ampddp.training.loading``), so a sample gets the
same augmentation in the main process or in any loader worker, and again after a resume.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from ampddp.choices import AUTO_AUGMENTS, CIFAR_LAYOUT, CROPS, DECODE_DEVICES, IMAGEFOLDER_LAYOUT, NORMALIZATIONS
from ampddp.errors import ConfigError, choice_error

if TYPE_CHECKING:
    import numpy

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp")
"""Files an imagefolder class folder contributes (any case); others are skipped, as ImageFolder skips them."""
DEFAULT_NORMALIZATIONS = {"cifar10": "computed", "imagefolder": "imagenet"}
"""What ``data.normalize: null`` stands for on each data set that normalises its inputs."""
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
EVAL_CROP_FRACTION = 0.875
"""The evaluation transform resizes the short side to image_size / 0.875, then center-crops image_size."""
STATS_IMAGES = 1000
"""``normalize: computed`` on an imagefolder measures this many training images at most (a fixed subset)."""
_STATS_SEED = 0
_JPEG_MAGIC = b"\xff\xd8\xff"

Transform = Callable[[torch.Tensor], torch.Tensor]


class TensorImages(Dataset):
    """Images held in memory as a float tensor (N, C, H, W), with optional shift-and-noise augmentation."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, augment: bool) -> None:
        self.images, self.labels, self.augment = images, labels, augment

    def __len__(self) -> int:
        return len(self.labels)

    @property
    def draws_random(self) -> bool:
        """Only augmentation draws (the trainer seeds each sample for it, and only then)."""
        return self.augment

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        image = self.images[index]
        if self.augment:
            shift = torch.randint(-2, 3, (2,))
            image = torch.roll(image, shifts=(int(shift[0]), int(shift[1])), dims=(1, 2))
            image = image + 0.05 * torch.randn_like(image)
        return image, self.labels[index]


class TransformedImages(Dataset):
    """uint8 images held in memory (N, C, H, W), passed through ``transform`` at each fetch."""

    def __init__(self, images: torch.Tensor, labels: Sequence[int], transform: Transform) -> None:
        self.images, self.labels, self.transform = images, list(labels), transform

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.transform(self.images[index]), self.labels[index]


class ImageFiles(Dataset):
    """Image files decoded at each fetch, so decoding runs in the loader's workers, then transformed.

    ``decode_device="cuda"`` decodes JPEGs with nvjpeg on the current GPU (in the process that
    fetches: the main one) and transforms them there; other formats are decoded on the CPU and moved.
    """

    def __init__(self, samples: list[tuple[str, int]], classes: list[str], transform: Transform, decode_device: str = "cpu") -> None:
        self.samples, self.classes, self.transform, self.decode_device = samples, classes, transform, decode_device
        self.targets = [label for _, label in samples]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        path, label = self.samples[index]
        return self.transform(decode_file(path, self.decode_device)), label


def decode_file(path: str, device: str = "cpu") -> torch.Tensor:
    """The image at ``path`` as uint8 RGB (3, H, W) on ``device``; ConfigError names a file that does not decode."""
    from torchvision.io import ImageReadMode, decode_image, decode_jpeg, read_file

    try:
        data = read_file(path)
        if device == "cuda" and bytes(data[:3].tolist()) == _JPEG_MAGIC:
            try:
                return decode_jpeg(data, mode=ImageReadMode.RGB, device="cuda")
            except RuntimeError:  # a JPEG nvjpeg cannot take (CMYK, progressive corner cases): the CPU decoder can
                pass
        image = decode_image(data, mode=ImageReadMode.RGB)
    except (RuntimeError, OSError) as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ConfigError(
            f"{path}: cannot read this image ({reason[:200]}); imagefolder needs decodable {', '.join(IMAGE_EXTENSIONS)} files"
        ) from None
    if image.dim() != 3:
        raise ConfigError(f"{path}: decodes to shape {tuple(image.shape)}, not one (3, H, W) image; imagefolder needs single-frame images")
    if image.dtype != torch.uint8:  # a 16-bit PNG: scaled to 8 bits like every other image (statistics assume 0-255)
        from torchvision.transforms.v2.functional import to_dtype

        image = to_dtype(image, torch.uint8, scale=True)
    return image.to(device)


def _normalise(train: torch.Tensor, held_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Standardise both splits per channel with the training split's mean and std.

    The held-out split is data the model has not seen: scaling it by its own statistics would use
    them (and hide a shift between the splits), so it gets the training split's transform.
    """
    mean = train.mean(dim=(0, 2, 3), keepdim=True)
    std = train.std(dim=(0, 2, 3), keepdim=True).clamp_min(1e-6)
    return (train - mean) / std, (held_out - mean) / std


def channel_stats(batches: Iterable[torch.Tensor]) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel mean and (unbiased) std of uint8 image batches (B, C, H, W) scaled to [0, 1].

    Accumulated in float64 batch by batch, so a large training split never sits in memory as floats.
    """
    total = squares = None
    count = 0
    for batch in batches:
        values = batch.to(torch.float64).div_(255.0).transpose(0, 1).flatten(1)
        total = values.sum(1) if total is None else total + values.sum(1)
        squares = values.square().sum(1) if squares is None else squares + values.square().sum(1)
        count += values.shape[1]
    if total is None or squares is None or count < 2:
        raise ConfigError("data.normalize=computed: the training split has too few pixels to measure a spread; use data.normalize=imagenet")
    mean = total / count
    std = ((squares - count * mean.square()) / (count - 1)).clamp_min(0).sqrt().clamp_min(1e-6)
    return tuple(mean.tolist()), tuple(std.tolist())


def image_transforms(
    image_size: int,
    augment: bool,
    auto_augment: str,
    mean: Sequence[float],
    std: Sequence[float],
    crop: str = "random-resized",
) -> tuple[Transform, Transform]:
    """(train, eval) transforms v2 on uint8 (C, H, W) images, as ImageNet- or CIFAR-style training uses them.

    Train: the ``crop`` (``train_geometry``) + horizontal flip (+ TrivialAugmentWide / RandAugment),
    then to float in [0, 1] and Normalize; eval: ``eval_geometry`` and the same Normalize.
    ``augment=False`` gives training the evaluation transform.
    """
    from torchvision.transforms import v2

    if auto_augment not in AUTO_AUGMENTS:
        raise choice_error("data.auto_augment", auto_augment, AUTO_AUGMENTS)
    to_float = [v2.ToDtype(torch.float32, scale=True), v2.Normalize(list(mean), list(std))]
    eval_tf = v2.Compose([*eval_geometry(image_size, crop), *to_float])
    if not augment:
        return eval_tf, eval_tf
    policy = {"none": [], "trivial": [v2.TrivialAugmentWide()], "randaugment": [v2.RandAugment()]}[auto_augment]
    train_tf = v2.Compose([*train_geometry(image_size, crop), v2.RandomHorizontalFlip(), *policy, *to_float])
    return train_tf, eval_tf


def train_geometry(image_size: int, crop: str = "random-resized") -> list[Transform]:
    """random-resized: RandomResizedCrop to image_size; padded: the evaluation geometry, then a random
    image_size crop of it zero-padded by image_size / 8 on each side (4 pixels at CIFAR's 32)."""
    from torchvision.transforms import v2

    _check_crop(crop)
    if crop == "padded":
        return [*eval_geometry(image_size, crop), v2.RandomCrop(image_size, padding=max(1, round(image_size / 8)))]
    return [v2.RandomResizedCrop(image_size)]


def eval_geometry(image_size: int, crop: str = "random-resized") -> list[Transform]:
    """Resize the short side, then center-crop image_size (uint8 stays uint8): to image_size / 0.875
    after a random-resized crop (ImageNet practice), to image_size itself after a padded one (the
    whole image, as CIFAR evaluates: unchanged at its own size)."""
    from torchvision.transforms import v2

    _check_crop(crop)
    short_side = image_size if crop == "padded" else round(image_size / EVAL_CROP_FRACTION)
    return [v2.Resize(short_side), v2.CenterCrop(image_size)]


def _check_crop(crop: str) -> None:
    if crop not in CROPS:
        raise choice_error("data.crop", crop, CROPS)


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


def _stats(normalize: str, measure: Callable[[], Iterable[torch.Tensor]]) -> tuple[Sequence[float], Sequence[float]]:
    """ImageNet's constants, or the per-channel statistics of the training batches ``measure`` yields."""
    if normalize not in NORMALIZATIONS:
        raise choice_error("data.normalize", normalize, NORMALIZATIONS)
    return (IMAGENET_MEAN, IMAGENET_STD) if normalize == "imagenet" else channel_stats(measure())


def cifar10(
    root: str | None,
    image_size: int,
    augment: bool,
    auto_augment: str = "none",
    normalize: str = "computed",
    crop: str = "random-resized",
) -> tuple[Dataset, Dataset]:
    """CIFAR-10's 50,000 training and 10,000 test images from data.root (never downloaded), through
    ``image_transforms``; ``computed`` statistics come from the whole training split."""
    from torchvision.datasets import CIFAR10

    path = _require(root, "cifar10", CIFAR_LAYOUT)
    if not (path / "cifar-10-batches-py").is_dir():
        raise ConfigError(f"data.root={root}: no cifar-10-batches-py folder inside; expected {CIFAR_LAYOUT} (ampddp never downloads)")

    def load(train: bool) -> tuple[torch.Tensor, list[int]]:
        raw = CIFAR10(str(path), train=train, download=False)
        return torch.as_tensor(raw.data).permute(0, 3, 1, 2).contiguous(), [int(label) for label in raw.targets]

    (train_images, train_labels), (test_images, test_labels) = load(True), load(False)
    mean, std = _stats(normalize, lambda: train_images.split(STATS_IMAGES))
    train_tf, eval_tf = image_transforms(image_size, augment, auto_augment, mean, std, crop)
    return TransformedImages(train_images, train_labels, train_tf), TransformedImages(test_images, test_labels, eval_tf)


def find_classes(folder: Path) -> list[str]:
    """The class folder names under ``folder``, sorted: class i is the i-th, as in torchvision's ImageFolder."""
    try:
        with os.scandir(folder) as entries:
            classes = sorted(entry.name for entry in entries if entry.is_dir())
    except OSError as error:
        raise ConfigError(f"{folder}: cannot list the class folders ({error.strerror or error}); expected {IMAGEFOLDER_LAYOUT}") from None
    if not classes:
        raise ConfigError(f"{folder}: no class folders inside; expected {IMAGEFOLDER_LAYOUT} (one folder of images per class)")
    return classes


def find_images(folder: Path, class_to_idx: dict[str, int]) -> list[tuple[str, int]]:
    """(path, class index) of every image under ``folder``'s class folders, in ImageFolder's order
    (classes sorted, then each class folder walked with sorted directories and file names)."""
    samples = []
    for name in find_classes(folder):
        if name not in class_to_idx:
            known = ", ".join(list(class_to_idx)[:10]) + (", ..." if len(class_to_idx) > 10 else "")
            raise ConfigError(f"{folder / name}: class {name!r} is not a class of the training split; valid classes: {known}")
        found = [
            (os.path.join(where, file), class_to_idx[name])
            for where, _, files in sorted(os.walk(folder / name, followlinks=True))
            for file in sorted(files)
            if file.lower().endswith(IMAGE_EXTENSIONS)
        ]
        if not found:
            raise ConfigError(f"{folder / name}: no images in this class folder; valid files end in {', '.join(IMAGE_EXTENSIONS)}")
        samples += found
    return samples


def imagefolder(
    root: str | None,
    image_size: int,
    augment: bool,
    auto_augment: str = "none",
    normalize: str = "imagenet",
    decode_device: str = "cpu",
    crop: str = "random-resized",
) -> tuple[Dataset, Dataset]:
    """ROOT/train/<class>/ and ROOT/val/<class>/ image files, decoded at each fetch (on ``decode_device``);
    class indices follow the training split's sorted folder names. ``computed`` statistics come from a
    fixed subset of at most STATS_IMAGES training images after the random-resized crop's evaluation
    resize and crop, whatever ``crop`` is (so a crop setting never changes the normalisation)."""
    path = _require(root, "imagefolder", IMAGEFOLDER_LAYOUT)
    for split in ("train", "val"):
        if not (path / split).is_dir():
            raise ConfigError(f"data.root={root}: missing {split}/ folder; expected {IMAGEFOLDER_LAYOUT}")
    if decode_device not in DECODE_DEVICES:
        raise choice_error("data.decode_device", decode_device, DECODE_DEVICES)
    classes = find_classes(path / "train")
    class_to_idx = {name: index for index, name in enumerate(classes)}
    train_samples, val_samples = find_images(path / "train", class_to_idx), find_images(path / "val", class_to_idx)

    def measure() -> Iterable[torch.Tensor]:
        from torchvision.transforms import v2

        geometry = v2.Compose(eval_geometry(image_size))  # whatever data.crop: a crop never changes the normalisation
        count = min(len(train_samples), STATS_IMAGES)
        chosen = torch.randperm(len(train_samples), generator=torch.Generator().manual_seed(_STATS_SEED))[:count]
        return (geometry(decode_file(train_samples[i][0])).unsqueeze(0) for i in sorted(chosen.tolist()))

    mean, std = _stats(normalize, measure)
    train_tf, eval_tf = image_transforms(image_size, augment, auto_augment, mean, std, crop)
    return (
        ImageFiles(train_samples, classes, train_tf, decode_device),
        ImageFiles(val_samples, classes, eval_tf, decode_device),
    )


def resolve_normalize(name: str, normalize: str | None) -> str | None:
    """The normalisation data set ``name`` applies for ``data.normalize``: null stands for the set's
    default, so a null and that default describe the same inputs (a resume compares these). None
    where the set takes no such setting (digits standardises itself; a user's function does its own)."""
    default = DEFAULT_NORMALIZATIONS.get(name)
    return None if default is None else normalize or default


def build_datasets(
    name: str,
    root: str | None,
    image_size: int,
    channels: int,
    eval_fraction: float,
    seed: int,
    augment: bool,
    auto_augment: str = "none",
    normalize: str | None = None,
    decode_device: str = "cpu",
    crop: str = "random-resized",
) -> tuple[Dataset, Dataset]:
    """Training and evaluation sets for ``data.name``; ``normalize`` None: each set's default
    (``resolve_normalize``)."""
    if name == "digits":
        return digits(image_size, channels, eval_fraction, seed, augment)
    if name == "cifar10":
        return cifar10(root, image_size, augment, auto_augment, resolve_normalize(name, normalize), crop)
    return imagefolder(root, image_size, augment, auto_augment, resolve_normalize("imagefolder", normalize), decode_device, crop)
