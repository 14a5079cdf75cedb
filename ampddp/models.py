"""Model factory: small built-ins for CPU runs and every torchvision classification model."""

from __future__ import annotations

from torch import nn

from ampddp.errors import ConfigError, closest

BUILTINS = ("mlp", "small_cnn")


def _mlp(num_classes: int, channels: int, image_size: int) -> nn.Module:
    width = 256
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(channels * image_size * image_size, width), nn.BatchNorm1d(width), nn.ReLU(),
        nn.Linear(width, width), nn.BatchNorm1d(width), nn.ReLU(),
        nn.Linear(width, num_classes),
    )  # fmt: skip


def _small_cnn(num_classes: int, channels: int, image_size: int) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(channels, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.AdaptiveAvgPool2d(4),
        nn.Flatten(), nn.Linear(32 * 16, num_classes),
    )  # fmt: skip


def classification_models() -> list[str]:
    import torchvision

    return sorted(torchvision.models.list_models(module=torchvision.models))


def build_model(name: str, num_classes: int, channels: int, image_size: int) -> nn.Module:
    """``mlp``, ``small_cnn`` or a torchvision classification model (random init, ``num_classes`` outputs)."""
    if name == "mlp":
        return _mlp(num_classes, channels, image_size)
    if name == "small_cnn":
        return _small_cnn(num_classes, channels, image_size)
    available = classification_models()
    if name not in available:
        hint = closest(name, [*BUILTINS, *available])
        examples = ", ".join(available[:6])
        raise ConfigError(
            f"model.name={name!r} is not valid{hint}; valid: {', '.join(BUILTINS)}, a torchvision classification model ({examples}, ...) "
            "or a function of yours as package.module:function"
        )
    import torchvision

    return torchvision.models.get_model(name, weights=None, num_classes=num_classes)


def has_convolutions(model: nn.Module) -> bool:
    return any(isinstance(module, nn.modules.conv._ConvNd) for module in model.modules())
