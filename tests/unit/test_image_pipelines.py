"""The cifar10 / imagefolder pipelines: transforms v2, decoding per fetch, normalisation from the
training split only, ImageFolder's class indices, and one-line errors naming the path or setting."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torchvision.datasets
from image_folders import CLASSES, make_image_folder
from torchvision.io import ImageReadMode, decode_image
from torchvision.transforms import v2

from ampddp.errors import ConfigError
from ampddp.recipe.checks import check_recipe
from ampddp.recipe.reading import load_config
from ampddp.zoo.data import (
    AUTO_AUGMENTS,
    IMAGENET_MEAN,
    IMAGENET_STD,
    channel_stats,
    eval_geometry,
    image_transforms,
    imagefolder,
)

QUICKSTART = Path(__file__).resolve().parents[2] / "recipes" / "quickstart.yaml"


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    return make_image_folder(tmp_path / "images")


def normalize_of(dataset: torch.utils.data.Dataset) -> v2.Normalize:
    return next(t for t in dataset.transform.transforms if isinstance(t, v2.Normalize))


def test_samples_are_normalised_float_images_of_the_configured_size(folder):
    train_set, val_set = imagefolder(str(folder), image_size=32, augment=True)
    assert (len(train_set), len(val_set)) == (3 * 8, 3 * 2)
    for dataset in (train_set, val_set):
        image, label = dataset[0]
        assert image.shape == (3, 32, 32) and image.dtype == torch.float32 and image.device.type == "cpu"
        assert label == 0 and isinstance(label, int)
    batch = next(iter(torch.utils.data.DataLoader(train_set, batch_size=5)))
    assert batch[0].shape == (5, 3, 32, 32) and batch[1].dtype == torch.long


def test_imagefolder_defaults_to_the_imagenet_constants(folder):
    train_set, val_set = imagefolder(str(folder), image_size=24, augment=True)
    for dataset in (train_set, val_set):
        assert tuple(normalize_of(dataset).mean) == IMAGENET_MEAN and tuple(normalize_of(dataset).std) == IMAGENET_STD
    path, _ = val_set.samples[0]
    raw = decode_image(str(path), mode=ImageReadMode.RGB)
    expected = v2.Compose(eval_geometry(24))(raw).float() / 255.0
    expected = (expected - torch.tensor(IMAGENET_MEAN).view(3, 1, 1)) / torch.tensor(IMAGENET_STD).view(3, 1, 1)
    torch.testing.assert_close(val_set[0][0], expected)


def test_computed_statistics_come_from_the_training_split_only(tmp_path):
    dim = make_image_folder(tmp_path / "dim", val_brightness=0)
    bright = make_image_folder(tmp_path / "bright", val_brightness=120)
    train_set, val_set = imagefolder(str(dim), image_size=32, augment=True, normalize="computed")
    _, bright_val = imagefolder(str(bright), image_size=32, augment=True, normalize="computed")
    crop = v2.Compose(eval_geometry(32))
    expected_mean, expected_std = channel_stats(crop(decode_image(p, mode=ImageReadMode.RGB)).unsqueeze(0) for p, _ in train_set.samples)
    for dataset in (train_set, val_set, bright_val):
        assert normalize_of(dataset).mean == pytest.approx(expected_mean) and normalize_of(dataset).std == pytest.approx(expected_std)
    val_means = torch.stack([val_set[i][0] for i in range(len(val_set))]).mean(dim=(0, 2, 3))
    bright_means = torch.stack([bright_val[i][0] for i in range(len(bright_val))]).mean(dim=(0, 2, 3))
    assert (bright_means > val_means + 1.0).all(), "the brighter split keeps its shift: it is scaled by the training statistics"


def test_the_eval_transform_is_deterministic(folder):
    _, val_set = imagefolder(str(folder), image_size=32, augment=True, auto_augment="randaugment")
    torch.manual_seed(1)
    first = val_set[3][0]
    torch.manual_seed(2)
    torch.testing.assert_close(val_set[3][0], first, rtol=0, atol=0)


@pytest.mark.parametrize("auto_augment", AUTO_AUGMENTS)
def test_training_draws_follow_torchs_seed(folder, auto_augment):
    train_set, _ = imagefolder(str(folder), image_size=32, augment=True, auto_augment=auto_augment)

    def draw(seed: int) -> torch.Tensor:
        torch.manual_seed(seed)
        return torch.stack([train_set[i][0] for i in range(4)])

    torch.testing.assert_close(draw(7), draw(7), rtol=0, atol=0)
    assert not torch.equal(draw(7), draw(8))
    assert draw(7).shape == (4, 3, 32, 32)


def test_augment_false_gives_training_the_eval_transform(folder):
    train_set, val_set = imagefolder(str(folder), image_size=32, augment=False, auto_augment="trivial")
    assert train_set.transform is val_set.transform
    torch.manual_seed(1)
    first = train_set[0][0]
    torch.manual_seed(2)
    torch.testing.assert_close(train_set[0][0], first, rtol=0, atol=0)


def test_a_bad_auto_augment_is_one_line_listing_the_choices():
    with pytest.raises(ConfigError) as error:
        load_config(QUICKSTART, ["data.auto_augment=autoaugment"])
    message = str(error.value)
    assert "data.auto_augment='autoaugment' is not valid" in message and "valid choices: none, trivial, randaugment" in message
    assert "\n" not in message
    with pytest.raises(ConfigError, match="valid choices: none, trivial, randaugment"):
        image_transforms(32, True, "trivialaugment", IMAGENET_MEAN, IMAGENET_STD)
    with pytest.raises(ConfigError, match="valid choices: imagenet, computed"):
        load_config(QUICKSTART, ["data.normalize=per_split"])
    with pytest.raises(ConfigError, match=r"data.crop='center' is not valid; valid choices: random-resized, padded$"):
        load_config(QUICKSTART, ["data.crop=center"])
    with pytest.raises(ConfigError, match=r"data\.crop='pad' is not valid"):
        image_transforms(32, True, "none", IMAGENET_MEAN, IMAGENET_STD, crop="pad")


def test_a_padded_crop_on_an_imagefolder_evaluates_at_the_training_size(folder):
    train_set, val_set = imagefolder(str(folder), image_size=24, augment=True, crop="padded")
    path, _ = val_set.samples[0]
    raw = decode_image(str(path), mode=ImageReadMode.RGB)
    expected = v2.Compose([v2.Resize(24), v2.CenterCrop(24)])(raw).float() / 255.0
    expected = (expected - torch.tensor(IMAGENET_MEAN).view(3, 1, 1)) / torch.tensor(IMAGENET_STD).view(3, 1, 1)
    torch.testing.assert_close(val_set[0][0], expected)
    assert train_set[0][0].shape == (3, 24, 24)


def test_class_indices_and_sample_order_match_torchvisions_imagefolder(folder):
    nested = folder / "train" / "dog" / "more"
    nested.mkdir()
    (nested / "000.jpg").write_bytes((folder / "train" / "dog" / "000.jpg").read_bytes())
    (folder / "train" / "cat" / "notes.txt").write_text("not an image")
    train_set, val_set = imagefolder(str(folder), image_size=16, augment=False)
    reference = torchvision.datasets.ImageFolder(str(folder / "train"))
    assert train_set.classes == reference.classes == list(CLASSES)
    assert train_set.samples == reference.samples and train_set.targets == reference.targets
    assert [label for _, label in val_set.samples] == [0, 0, 1, 1, 2, 2]


def test_a_val_split_with_fewer_classes_keeps_the_training_indices(folder):
    for image in (folder / "val" / "cat").iterdir():
        image.unlink()
    (folder / "val" / "cat").rmdir()
    _, val_set = imagefolder(str(folder), image_size=16, augment=False)
    assert [label for _, label in val_set.samples] == [1, 1, 2, 2]


def test_an_unreadable_image_is_named_when_it_is_loaded(folder):
    broken = folder / "train" / "dog" / "broken.jpg"
    broken.write_bytes(b"\xff\xd8\xff not really a jpeg")
    train_set, _ = imagefolder(str(folder), image_size=16, augment=True)
    index = [path for path, _ in train_set.samples].index(str(broken))
    with pytest.raises(ConfigError) as error:
        train_set[index]
    assert str(broken) in str(error.value) and "cannot read this image" in str(error.value) and "\n" not in str(error.value)
    with pytest.raises(ConfigError, match=r"broken\.jpg: cannot read this image"):
        imagefolder(str(folder), image_size=16, augment=True, normalize="computed")  # 25 < 1,000 images: all measured


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda root: (root / "val").rename(root / "valid"), "missing val/ folder; expected ROOT/train/<class>/<image>"),
        (lambda root: [p.rename(root / p.name) for p in (root / "train").iterdir()], "train: no class folders inside"),
        (lambda root: (root / "train" / "zebra").mkdir(), "train/zebra: no images in this class folder; valid files end in .jpg"),
        (lambda root: (root / "val" / "cat").rename(root / "val" / "lynx"), "class 'lynx' is not a class of the training split"),
    ],
    ids=["no-val", "no-classes", "empty-class", "unknown-val-class"],
)
def test_layout_problems_are_one_line_naming_the_path(folder, change, message):
    change(folder)
    with pytest.raises(ConfigError) as error:
        imagefolder(str(folder), image_size=16, augment=True)
    assert message in str(error.value) and "\n" not in str(error.value)


def check(tmp_path: Path, *overrides: str) -> None:
    check_recipe(load_config(QUICKSTART, [f"trainer.run_dir={tmp_path / 'run'}", *overrides]))


def test_validate_checks_the_image_settings_against_the_data_set(tmp_path, folder):
    imagefolder_run = ("data.name=imagefolder", f"data.root={folder}", "data.channels=3", "model.name=small_cnn")
    check(tmp_path, *imagefolder_run, "data.auto_augment=trivial", "data.normalize=computed", "data.crop=padded")
    cases = [
        (("data.crop=padded",), "data.crop=padded applies to data.name=cifar10 or imagefolder, not to data.name=digits"),
        (("data.auto_augment=trivial",), "data.auto_augment=trivial applies to data.name=cifar10 or imagefolder, not to data.name=digits"),
        (("data.name=imagefolder", f"data.root={folder}", "data.channels=1"), "data.channels=1: imagefolder images are RGB"),
        ((*imagefolder_run, "data.decode_device=cuda", "data.num_workers=2"), "data.decode_device=cuda decodes in the training process"),
        ((*imagefolder_run, "data.decode_device=cuda", "data.pin_memory=true"), "which cannot be pinned; set data.pin_memory=false"),
    ]
    if not torch.cuda.is_available():
        cases.append(
            ((*imagefolder_run, "data.decode_device=cuda"), "but CUDA is not available on this machine; use data.decode_device=cpu")
        )
    for overrides, message in cases:
        with pytest.raises(ConfigError) as error:
            check(tmp_path, *overrides)
        assert message in str(error.value) and "\n" not in str(error.value), overrides


def test_the_crop_never_changes_computed_statistics(tmp_path):
    folder = make_image_folder(tmp_path / "images")
    resized, _ = imagefolder(str(folder), image_size=24, augment=True, normalize="computed")
    padded, _ = imagefolder(str(folder), image_size=24, augment=True, normalize="computed", crop="padded")
    assert normalize_of(resized).mean == normalize_of(padded).mean and normalize_of(resized).std == normalize_of(padded).std
