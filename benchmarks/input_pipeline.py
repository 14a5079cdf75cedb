"""The input pipeline: ampddp's imagefolder loading vs a hand-written torchvision ImageFolder +
DataLoader with the same transforms and workers, and the Trainer with loader workers vs without.

The benchmark writes its own image folder of JPEGs (256x256, 10 classes) into a temporary folder.
ampddp's side pays for what the hand-written one lacks: each sample fetched under its own seed
(batches independent of the worker count) and the resumable sampler.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from harness import Budget, Row, side_by_side
from torch.utils.data import DataLoader

CLASSES = 10


def write_jpegs(root: Path, count: int, size: int) -> None:
    """``count`` training JPEGs (a class colour plus noise) and one validation image per class."""
    from torchvision.io import write_jpeg

    generator = torch.Generator().manual_seed(0)
    for split, per_class in (("train", max(1, count // CLASSES)), ("val", 1)):
        for label in range(CLASSES):
            folder = root / split / f"class{label:02d}"
            folder.mkdir(parents=True, exist_ok=True)
            colour = torch.tensor([25 * label, 255 - 25 * label, 128]).view(3, 1, 1)
            for number in range(per_class):
                noise = torch.randint(-60, 61, (3, size, size), generator=generator)
                write_jpeg((colour + noise).clamp(0, 255).to(torch.uint8), str(folder / f"{number:04d}.jpg"), quality=90)


def pipeline_rows(root: Path, source: int, image_size: int, batch_size: int, repeats: int, workers: tuple[int, ...]) -> list[Row]:
    from torchvision.datasets import ImageFolder
    from torchvision.io import ImageReadMode, decode_image

    from ampddp.distributed.data import ResumableSampler
    from ampddp.distributed.env import detect_env
    from ampddp.training.loading import DataLoading, LoaderSettings
    from ampddp.zoo.data import imagefolder

    env = detect_env({}, device="cpu")
    train_set, _ = imagefolder(str(root), image_size, augment=True)
    transform = train_set.transform  # the same transforms v2 pipeline on both sides
    theirs_set = ImageFolder(str(root / "train"), transform=transform, loader=lambda path: decode_image(path, mode=ImageReadMode.RGB))
    rows = []
    for count in workers:

        def ours(count: int = count) -> None:
            sampler = ResumableSampler(train_set, env, shuffle=True, seed=0)
            for _ in DataLoading(LoaderSettings(num_workers=count), env.device, seed=0).train_loader(train_set, sampler, batch_size):
                pass

        def theirs(count: int = count) -> None:
            generator = torch.Generator().manual_seed(0)
            for _ in DataLoader(theirs_set, batch_size=batch_size, shuffle=True, num_workers=count, generator=generator):
                pass

        rows.append(
            side_by_side(
                f"input/imagefolder-{count}-workers", ours, theirs, repeats=repeats, per=len(train_set), unit="images/s", throughput=True,
                note=f"{len(train_set)} JPEGs {source}px -> RandomResizedCrop {image_size} + flip + normalize, one epoch incl. "
                "worker start; vs torchvision ImageFolder + DataLoader, same transforms and workers",
            )
        )  # fmt: skip
    return rows


def trainer_rows(root: Path, image_size: int, batch_size: int, repeats: int, steps: int, workers: int) -> list[Row]:
    from ampddp.distributed.env import detect_env
    from ampddp.trainer import Trainer
    from ampddp.training.loading import LoaderSettings
    from ampddp.zoo.data import imagefolder
    from ampddp.zoo.models import build_model

    env = detect_env({}, device="cpu")
    train_set, _ = imagefolder(str(root), image_size, augment=True)

    def fit(count: int) -> None:
        model = build_model("small_cnn", CLASSES, 3, image_size)
        trainer = Trainer(model, lambda p: torch.optim.SGD(p, lr=0.05), train_set, env=env, precision="O4", batch_size=batch_size,
                          max_steps=steps, max_epochs=10**6, log_every=10**6, loading=LoaderSettings(num_workers=count),
                          report=None)  # fmt: skip
        trainer.fit()

    row = side_by_side(
        f"input/trainer-{workers}-workers-vs-0", lambda: fit(workers), lambda: fit(0), repeats=repeats, per=steps * batch_size,
        unit="samples/s", throughput=True,
        note=f"Trainer, small_cnn O4 at {image_size}px from the JPEG folder, {steps} steps: data.num_workers={workers} vs 0",
    )  # fmt: skip
    return [row]


def run(device: str, budget: Budget) -> list[Row]:
    count = budget.pick(40, 600, 2000)
    image_size = budget.pick(32, 128, 224)
    batch_size = budget.pick(8, 32, 64)
    repeats = budget.pick(1, 3, 5)
    workers = budget.pick((0,), (0, 2), (0, 2))
    with tempfile.TemporaryDirectory(dir=Path.cwd(), prefix=".ampddp-bench-images-") as folder:
        root = Path(folder)
        source = budget.pick(64, 256, 256)
        write_jpegs(root, count, size=source)
        rows = pipeline_rows(root, source, image_size, batch_size, repeats, workers)
        rows += trainer_rows(root, image_size, batch_size, repeats, steps=budget.pick(2, 15, 30), workers=budget.pick(1, 2, 2))
    return rows
