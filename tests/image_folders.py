"""Small image folders of generated JPEGs (ROOT/train/<class>/, ROOT/val/<class>/) for the imagefolder tests."""

from __future__ import annotations

from pathlib import Path

import torch
from torchvision.io import write_jpeg

CLASSES = ("cat", "dog", "emu")


def make_image_folder(
    root: Path, per_class: int = 8, val_per_class: int = 2, size: int = 40, val_brightness: int = 0, seed: int = 0
) -> Path:
    """``per_class`` training and ``val_per_class`` validation JPEGs of ``size`` x ``size`` per class:
    a class colour plus noise; ``val_brightness`` is added to every validation pixel."""
    generator = torch.Generator().manual_seed(seed)
    for split, count, shift in (("train", per_class, 0), ("val", val_per_class, val_brightness)):
        for index, name in enumerate(CLASSES):
            folder = root / split / name
            folder.mkdir(parents=True, exist_ok=True)
            colour = torch.tensor([60 + 50 * index, 140 - 40 * index, 90]).view(3, 1, 1)
            for number in range(count):
                noise = torch.randint(-40, 41, (3, size, size), generator=generator)
                image = (colour + noise + shift).clamp(0, 255).to(torch.uint8)
                write_jpeg(image, str(folder / f"{number:03d}.jpg"), quality=95)
    return root
