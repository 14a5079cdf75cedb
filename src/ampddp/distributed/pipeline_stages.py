"""A pipeline stage on a rank and what the stages send each other: the hooks that make a set-up module a stage
(``StageHooks``), the rank's place (``PipelineParts``), micro-batches through the stages in turn by point-to-point sends
(``StagesInTurn``), and the model the training loop calls under a pipeline (``PipelineModel``). torch's schedules run
the training steps (``ampddp.distributed.pipeline.PipelineSchedule``); these run what they cannot.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

Feed = Callable[[int], tuple[tuple[Any, ...], dict[str, Any]]]
"""Micro-batch index -> the positional and keyword inputs the first stage's module is called with."""


class StageHooks:
    """What makes a set-up stage (bare, or FSDP2's module: torch's ``PipelineStage`` drives its gradient sync and
    resharding itself when it holds it) a pipeline stage: its forward runs in the precision engine's context, and on the first
    stage the micro-batch index torch feeds it becomes that micro-batch's inputs (``feed``: the loop's own way of
    feeding a model, a dict batch as keywords, ``(inputs, targets)`` as inputs). Hooks on the module, so it stays the
    module torch's stage and the strategy see."""

    def __init__(self, module: nn.Module, forward_context: Callable[[], AbstractContextManager[Any]], first: bool) -> None:
        self.module, self.forward_context, self.first = module, forward_context, first
        self.feed: Feed | None = None
        self._entered: list[AbstractContextManager[Any]] = []
        module.register_forward_pre_hook(self._enter, with_kwargs=True, prepend=True)
        module.register_forward_hook(self._leave, always_call=True)

    def _enter(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        if self.first and self.feed is None:
            raise RuntimeError("the pipeline's first stage ran without its inputs")
        inputs = self.feed(int(args[0].reshape(-1)[0])) if self.first and self.feed is not None else None
        context = self.forward_context()
        context.__enter__()
        self._entered.append(context)
        return inputs

    def _leave(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._entered:
            self._entered.pop().__exit__(None, None, None)

    @contextlib.contextmanager
    def feeding(self, feed: Feed) -> Iterator[None]:
        self.feed = feed
        try:
            yield
        finally:
            self.feed = None


class ModelInputs:
    """Stands for a model where the loop feeds it a micro-batch: returns what it was called with."""

    def __call__(self, *args: Any, **kwargs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
        return args, kwargs


@dataclass
class PipelineParts:
    """A rank's place in the pipeline, made by the strategy's set-up: the stages it holds (``held``: stage index -> its
    hooks, the stage's module in ``hooks.module``; several under a looped schedule), the number of stages, the pipeline's
    process group and this rank's device, and the global rank holding each stage (``owners[i]``: stage ``i``'s)."""

    held: dict[int, StageHooks]
    stages: int
    group: Any
    device: torch.device
    owners: tuple[int, ...]
    rank: int
    """This process's global rank."""

    @property
    def is_first(self) -> bool:
        return 0 in self.held

    @property
    def is_last(self) -> bool:
        return self.stages - 1 in self.held

    @property
    def ranks(self) -> int:
        """The pipeline's ranks (each holding one stage or several)."""
        return len(set(self.owners))

    @property
    def indices(self) -> tuple[int, ...]:
        """The stages this rank holds, in the model's order."""
        return tuple(sorted(self.held))

    def feeding(self, feed: Feed) -> AbstractContextManager[None]:
        """The first stage's inputs taken from ``feed`` meanwhile (on the rank holding it; nothing elsewhere)."""
        return self.held[0].feeding(feed) if self.is_first else contextlib.nullcontext()

    def torch_stages(self) -> list[Any]:
        """New torch ``PipelineStage`` objects over this rank's stages (each fixes its inputs' shapes at its first step)."""
        from torch.distributed.pipelining import PipelineStage

        return [PipelineStage(self.held[index].module, index, self.stages, self.device, group=self.group) for index in self.indices]


class StagesInTurn:
    """One micro-batch through the stages in turn (the model's order, whichever rank holds each), the activations (and
    their gradients) sent point to point between ranks and handed over within one: a forward of the whole model (its
    outputs sent to every rank), or a forward and backward for a batch the micro-batches cannot cut into a count torch's
    schedule takes (torch's schedules take neither on every release ampddp supports)."""

    def __init__(self, parts: PipelineParts) -> None:
        self.parts = parts

    def _forwards(self, feed: Feed, keep_grad: bool) -> dict[int, tuple[Any, tuple[torch.Tensor, ...]]]:
        """Each held stage's output and the inputs it received (leaves needing gradients where ``keep_grad``)."""
        parts, runs = self.parts, {}
        handed: tuple[torch.Tensor, ...] = ()
        for index in parts.indices:
            hooks = parts.held[index]
            if index == 0:
                with hooks.feeding(feed):
                    output, received = hooks.module(torch.zeros(1, dtype=torch.int64)), ()
            else:
                before = parts.owners[index - 1]
                incoming = handed if before == parts.rank else _receive(before, parts.group, parts.device)
                received = tuple(tensor.detach().requires_grad_(keep_grad and tensor.is_floating_point()) for tensor in incoming)
                output = hooks.module(*received)
            runs[index] = (output, received)
            if index < parts.stages - 1:
                after = parts.owners[index + 1]
                if after == parts.rank:
                    handed = _tensors(output)
                else:
                    _send(output, after, parts.group)
        return runs

    def forward(self, feed: Feed) -> Any:
        """The whole model's outputs of ``feed`` (the first stage's inputs), on every rank."""
        import torch.distributed as dist

        parts = self.parts
        runs = self._forwards(feed, keep_grad=False)
        sent = [runs[parts.stages - 1][0] if parts.is_last else None]
        dist.broadcast_object_list(sent, src=parts.owners[-1], group=parts.group)
        return sent[0]

    def forward_backward(self, feed: Feed, score: Callable[[Any], torch.Tensor]) -> None:
        """The gradients of one micro-batch: ``score(outputs)`` on the last stage is the (scaled) loss it runs the backward
        of; each stage's backward starts from the gradients the next one hands or sends."""
        parts = self.parts
        runs = self._forwards(feed, keep_grad=True)
        handed: dict[int, tuple[torch.Tensor, ...]] = {}
        for index in reversed(parts.indices):
            output, received = runs[index]
            if index == parts.stages - 1:
                score(output).backward()
            else:
                after = parts.owners[index + 1]
                grads = handed.pop(index) if after == parts.rank else _receive(after, parts.group, parts.device)
                torch.autograd.backward(_tensors(output), grads)
            if index > 0:
                back = tuple(tensor.grad if tensor.grad is not None else torch.zeros_like(tensor) for tensor in received)
                if parts.owners[index - 1] == parts.rank:
                    handed[index - 1] = back
                else:
                    _send(back, parts.owners[index - 1], parts.group)


def _tensors(value: Any) -> tuple[torch.Tensor, ...]:
    return (value,) if isinstance(value, torch.Tensor) else tuple(value)


def _send(value: Any, to: int, group: Any) -> None:
    """A stage's tensor (or tuple of tensors) to global rank ``to``: their shapes and dtypes first, then the data."""
    import torch.distributed as dist

    tensors = _tensors(value)
    dist.send_object_list([[(tuple(tensor.shape), tensor.dtype) for tensor in tensors]], dst=to, group=group)
    for tensor in tensors:
        dist.send(tensor.detach().contiguous(), dst=to, group=group)


def _receive(source: int, group: Any, device: torch.device) -> tuple[torch.Tensor, ...]:
    import torch.distributed as dist

    described: list[Any] = [None]
    dist.recv_object_list(described, src=source, group=group)
    received = []
    for shape, dtype in described[0]:
        tensor = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(tensor, src=source, group=group)
        received.append(tensor)
    return tuple(received)


class PipelineModel(nn.Module):
    """What the training loop calls as its model under pipeline parallelism. Inside a training step, on the last stage:
    the outputs the pipeline computed for the micro-batch being scored (so the loop's own loss reads them as a whole
    model's). Outside one (evaluation, the last-batch check, the diagnosis of a non-finite step), called on every rank of
    the pipeline with the same batch: a forward of the whole model through the stages in turn (the first reads the
    inputs, the last computes the outputs), the outputs sent to every stage, so every rank scores them as one model
    would."""

    def __init__(self, parts: PipelineParts) -> None:
        super().__init__()
        self.parts = parts
        self.current: Any = None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.current is not None:
            return self.current
        return StagesInTurn(self.parts).forward(lambda index: (args, kwargs))
