"""Model factory: small built-ins for CPU runs, every torchvision classification model, and a small GPT."""

from __future__ import annotations

from typing import Any

import torch
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


class CausalSelfAttention(nn.Module):
    """Multi-head attention over earlier positions, with its softmax written out (the op apex's
    lists keep in fp32: what FSDP2's plain bf16 loses)."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = (part.view(batch, length, self.heads, width // self.heads).transpose(1, 2) for part in self.qkv(x).split(width, dim=2))
        scores = (q @ k.transpose(-2, -1)) * (k.shape[-1] ** -0.5)
        future = torch.ones(length, length, dtype=torch.bool, device=x.device).triu(1)
        weights = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
        return self.proj((weights.to(v.dtype) @ v).transpose(1, 2).reshape(batch, length, width))


class Block(nn.Module):
    """A pre-norm transformer block: attention, then a 4x MLP, each added to the residual stream."""

    def __init__(self, width: int, heads: int, norm: type[nn.Module]) -> None:
        super().__init__()
        self.attention_norm, self.attention = norm(width), CausalSelfAttention(width, heads)
        self.mlp_norm = norm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.mlp(self.mlp_norm(x))


NORMS = {"rms": nn.RMSNorm, "layer": nn.LayerNorm}


class GPT(nn.Module):
    """A small GPT: token and position embeddings, ``layers`` pre-norm blocks, a final norm and a head.

    ``forward(input_ids, labels=None)`` returns ``{"logits"}`` and, given labels (the next token at
    each position), ``{"loss"}``: mean cross-entropy over the tokens (Hugging Face's convention, so
    ampddp's default loss and tokens/s use it as is).
    """

    def __init__(self, vocab_size: int, layers: int = 4, width: int = 128, heads: int = 4, context: int = 256, norm: str = "rms") -> None:
        super().__init__()
        for name, value in (("vocab_size", vocab_size), ("layers", layers), ("width", width), ("heads", heads), ("context", context)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"gpt {name}={value!r} is not valid; it must be an integer >= 1")
        if width % heads:
            raise ConfigError(f"gpt width={width} is not a multiple of heads={heads}; each head takes width/heads features")
        if norm not in NORMS:
            raise ConfigError(f"gpt norm={norm!r} is not valid; valid: {', '.join(NORMS)}")
        self.context = context
        self.token_embedding = nn.Embedding(vocab_size, width)
        self.position_embedding = nn.Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width, heads, NORMS[norm]) for _ in range(layers))
        self.final_norm = NORMS[norm](width)
        self.head = nn.Linear(width, vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        length = input_ids.shape[1]
        if length > self.context:
            raise ValueError(f"a sequence of {length} tokens is longer than the GPT's context of {self.context}; raise its context")
        positions = torch.arange(length, device=input_ids.device)
        x = self.token_embedding(input_ids) + self.position_embedding(positions)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.final_norm(x))
        if labels is None:
            return {"logits": logits}
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return {"logits": logits, "loss": loss}


def gpt(num_classes: int, **settings: Any) -> GPT:
    """A recipe's ``model.name: ampddp.zoo.models:gpt``: ``num_classes`` is the vocabulary (256 for
    ``ampddp.zoo.text``'s bytes); ``model.kwargs``: layers, width, heads, context, norm (rms | layer)."""
    return GPT(num_classes, **settings)
