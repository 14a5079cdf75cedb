"""What a batch is to the loop: moved to the device, counted, fed to the model, scored.

A batch is whatever the DataLoader yields: a ``(inputs, targets)`` pair, a dict (Hugging Face style:
``model(**batch)``), a single tensor, or any nesting of tuples, lists and dicts. The loop never looks
inside one; it calls a :class:`BatchAdapter`. Subclass the adapter for other shapes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ampddp.errors import BadSamplesError, listed

LossFn = Callable[[Any, Any], torch.Tensor]
"""``loss_fn(outputs, batch)`` -> the mean loss of the batch (a scalar tensor)."""
MetricsFn = Callable[[Any, Any], Mapping[str, Any]]
"""``metrics(outputs, batch)`` -> {name: sum over the batch's samples} (e.g. the number correct); the
evaluator adds the sums over batches and ranks and divides by the number of samples."""

TARGET_KEYS = ("labels", "label", "targets", "target")


def move_to(value: Any, device: torch.device, non_blocking: bool = False, images: torch.memory_format | None = None) -> Any:
    """``value`` with every tensor inside (tuples, lists, dicts, namedtuples) on ``device``; 4-D
    floating tensors (image batches) in the ``images`` memory format when one is given."""
    if isinstance(value, torch.Tensor):
        if images is not None and value.dim() == 4 and value.is_floating_point():
            return value.to(device, non_blocking=non_blocking, memory_format=images)
        return value.to(device, non_blocking=non_blocking)
    if isinstance(value, Mapping):
        return type(value)({key: move_to(item, device, non_blocking, images) for key, item in value.items()})
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(move_to(item, device, non_blocking, images) for item in value))
    if isinstance(value, (tuple, list)):
        return type(value)(move_to(item, device, non_blocking, images) for item in value)
    return value


def first_tensor(value: Any) -> torch.Tensor | None:
    """The first tensor in ``value``, depth first (dicts in insertion order)."""
    if isinstance(value, torch.Tensor):
        return value
    items = value.values() if isinstance(value, Mapping) else value if isinstance(value, (tuple, list)) else ()
    for item in items:
        found = first_tensor(item)
        if found is not None:
            return found
    return None


class BatchAdapter:
    """Moves a batch to the device, counts its samples and calls the model on it.

    Sequences are ``(inputs, *rest)`` and the model gets ``inputs``; mappings are passed as keyword
    arguments; a tensor is the input itself. The sample count is the leading size of the first tensor.
    ``images``: the memory format for 4-D floating tensors (``torch.channels_last``), None: as loaded.
    """

    images: torch.memory_format | None = None

    def __init__(self, images: torch.memory_format | None = None) -> None:
        self.images = images

    def to_device(self, batch: Any, device: torch.device) -> Any:
        return move_to(batch, device, non_blocking=True, images=self.images)

    def count(self, batch: Any) -> int:
        tensor = first_tensor(batch)
        if tensor is None or tensor.dim() == 0:
            raise TypeError(f"cannot count the samples of a {type(batch).__name__} batch: it holds no tensor with a batch dimension")
        return int(tensor.shape[0])

    def tokens(self, batch: Any) -> int:
        """Tokens in a batch of token ids, for tokens/s (0 for other data): the ``attention_mask``'s
        ones (padding left out) or the ``input_ids`` of a dict batch, else the elements of an integer
        input tensor of shape batch x sequence."""
        if isinstance(batch, Mapping):
            mask, ids = batch.get("attention_mask"), batch.get("input_ids")
            if isinstance(mask, torch.Tensor):
                return int(mask.count_nonzero())
            return ids.numel() if isinstance(ids, torch.Tensor) and _is_token_ids(ids) else 0
        inputs = batch[0] if isinstance(batch, (tuple, list)) and batch else batch
        return inputs.numel() if isinstance(inputs, torch.Tensor) and _is_token_ids(inputs) else 0

    def forward(self, model: nn.Module, batch: Any) -> Any:
        if isinstance(batch, Mapping):
            return model(**batch)
        if isinstance(batch, (tuple, list)):
            return model(batch[0])
        return model(batch)


def _is_token_ids(tensor: torch.Tensor) -> bool:
    """int64 / int32 ids of shape batch x sequence (not class labels; not uint8 pixels)."""
    return tensor.dim() == 2 and tensor.dtype in (torch.int64, torch.int32)


def targets_of(batch: Any) -> torch.Tensor:
    """The class targets in a batch: the last entry of a sequence, or ``labels``/``label``/``targets``/``target``."""
    if isinstance(batch, Mapping):
        for key in TARGET_KEYS:
            if key in batch:
                return batch[key]
        wanted, found = ", ".join(TARGET_KEYS), ", ".join(map(str, batch))
        raise KeyError(f"a dict batch needs one of the keys {wanted} for the default loss and metrics; it has {found}")
    if isinstance(batch, (tuple, list)) and len(batch) >= 2:
        return batch[-1]
    raise TypeError(f"the default loss and metrics need (inputs, targets) or a dict with labels; got a {type(batch).__name__}")


def logits_of(outputs: Any) -> torch.Tensor:
    """Class scores from a model's outputs: a tensor, or ``.logits`` / ``["logits"]`` (Hugging Face style)."""
    if isinstance(outputs, torch.Tensor):
        return outputs
    if isinstance(outputs, Mapping) and "logits" in outputs:
        return outputs["logits"]
    logits = getattr(outputs, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    raise TypeError(f"cannot find class scores in the model's {type(outputs).__name__} outputs: expected a tensor or a 'logits' entry")


IGNORE_INDEX = -100
"""``F.cross_entropy``'s default label for "no target here"."""


def cross_entropy(outputs: Any, batch: Any) -> torch.Tensor:
    """The default loss: the model's own ``loss`` when it returns one (Hugging Face style), else
    cross-entropy of the logits (in fp32) against the batch's targets (a target per position, the class scores
    last, as a language model's logits: each position counted once)."""
    own = outputs.get("loss") if isinstance(outputs, Mapping) else getattr(outputs, "loss", None)
    if isinstance(own, torch.Tensor):
        return own.float()
    logits, targets = logits_of(outputs).float(), targets_of(batch)
    if logits.dim() >= 3 and logits.shape[:-1] == targets.shape and not targets.is_floating_point():
        logits, targets = logits.flatten(0, -2), targets.flatten()  # a class score per position, last (a language model's)
    try:
        return F.cross_entropy(logits, targets)
    except (IndexError, RuntimeError) as error:
        bad = _labels_outside(logits, targets)
        if bad is None:
            raise
        raise bad from error


def _labels_outside(logits: torch.Tensor, targets: torch.Tensor) -> BadSamplesError | None:
    """The batch's samples whose labels are outside the model's classes (None: none is). Checked only
    after the loss failed, so a good step pays nothing (the check needs the values on the host)."""
    if targets.is_floating_point() or logits.dim() < 2 or targets.dim() == 0:
        return None
    classes = logits.shape[1]
    outside = ((targets < 0) & (targets != IGNORE_INDEX)) | (targets >= classes)
    if not bool(outside.any()):
        return None
    rows = outside.reshape(outside.shape[0], -1).any(dim=1).nonzero().flatten().tolist()
    labels = listed(set(targets[outside].tolist()), limit=4)
    return BadSamplesError(
        lambda samples: (
            f"label(s) {labels} of {samples} fall outside the model's {classes} classes "
            f"(valid: 0..{classes - 1}, or {IGNORE_INDEX} to ignore); fix the dataset's labels or the model's number of classes"
        ),
        rows,
    )


def accuracy(outputs: Any, batch: Any) -> dict[str, torch.Tensor]:
    """The default metric: the number of samples whose arg-max class is the target (with a target per
    position, each sample counts the fraction of its positions that are right)."""
    correct = logits_of(outputs).argmax(-1) == targets_of(batch)
    if correct.dim() > 1:  # a target per position (a language model's next tokens): each sample's share right
        return {"accuracy": correct.flatten(1).double().mean(1).sum()}
    return {"accuracy": correct.sum()}
