"""Text data without a download: CPython's own help texts as a byte-level corpus.

``pydoc_data.topics`` ships with every Python (about 465 KB of English about the language): enough
for a small GPT to learn from on a CPU in minutes, and the same bytes on every machine, so a text
recipe runs anywhere and its loss curve can be compared across runs.
"""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

from ampddp.errors import ConfigError

VOCAB_SIZE = 256
"""Byte-level: every token is one byte of the UTF-8 text."""


class ByteWindows(Dataset):
    """Consecutive windows of ``sequence_length`` bytes of ``data`` as ``{"input_ids", "labels"}``,
    the labels being the next byte at each position."""

    draws_random = False
    """A window is read, never drawn: the trainer need not seed each sample."""

    def __init__(self, data: torch.Tensor, sequence_length: int) -> None:
        self.data, self.sequence_length = data, sequence_length

    def __len__(self) -> int:
        return max(0, (len(self.data) - 1) // self.sequence_length)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"window {index} is outside 0..{len(self) - 1}")
        start = index * self.sequence_length
        window = self.data[start : start + self.sequence_length + 1].long()
        return {"input_ids": window[:-1], "labels": window[1:]}


def corpus_bytes() -> torch.Tensor:
    """The corpus: every help topic of ``pydoc_data.topics`` in name order, as uint8 bytes."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[name] for name in sorted(topics))
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8)


def python_docs(sequence_length: int = 128, eval_fraction: float = 0.05) -> tuple[ByteWindows, ByteWindows]:
    """A recipe's ``data.name: ampddp.zoo.text:python_docs``: (train, eval) windows of the corpus, the
    last ``eval_fraction`` of it held out (no window crosses the split)."""
    if isinstance(sequence_length, bool) or not isinstance(sequence_length, int) or sequence_length < 1:
        raise ConfigError(f"sequence_length={sequence_length!r} is not valid; it must be an integer >= 1")
    if isinstance(eval_fraction, bool) or not isinstance(eval_fraction, (int, float)) or not 0 < eval_fraction < 1:
        raise ConfigError(f"eval_fraction={eval_fraction!r} is not valid; it must lie in (0, 1)")
    data = corpus_bytes()
    split = int(len(data) * (1 - eval_fraction))
    train, held_out = ByteWindows(data[:split], sequence_length), ByteWindows(data[split:], sequence_length)
    if len(held_out) == 0:
        raise ConfigError(
            f"eval_fraction={eval_fraction} holds out {len(data) - split} bytes, fewer than one window of {sequence_length + 1}"
        )
    return train, held_out
