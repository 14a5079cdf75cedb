"""``trainer.compile``: ``torch.compile`` the prepared model, after the precision set-up and DDP wrapping
(under FSDP2: each sharded block in place, so the model keeps its class, names and FSDP2's hooks).

The model the loop calls (``Prepared.model``: the DDP wrapper when there is one) is compiled last,
once ``engine.setup`` has cast it and made the masters. ``Prepared.module`` stays the bare module,
so checkpoints save and load its keys (never ``_orig_mod.``): a checkpoint moves between compiled
and eager runs unchanged. ``train()`` / ``eval()`` on the compiled module switch the module inside
it; evaluation compiles its own graph at its first call.

The first training forward and its backward compile (the backward graph is compiled lazily, when
it first runs): their wall time is reported once, to a log line and the ``on_first_step`` callback.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from ampddp.choices import COMPILE_CHOICES, COMPILE_MODES, DEFAULT_BACKEND
from ampddp.errors import ConfigError, choice_error, closest
from ampddp.torch_compat import compile_backends

if TYPE_CHECKING:
    from ampddp.prepare import Prepared

logger = logging.getLogger("ampddp.compile")


def _available_backends() -> tuple[list[str], list[str]]:
    """(every registered torch.compile backend, the ones torch lists by default) — imports dynamo."""
    return compile_backends()


@dataclass(frozen=True)
class ModelCompiler:
    """Compile a prepared run's model with ``torch.compile(mode=mode, backend=backend)``."""

    mode: str = "default"
    """One of COMPILE_MODES."""
    backend: str | Callable[..., Any] = DEFAULT_BACKEND
    """inductor (generates kernels), another registered backend such as aot_eager (no code generation),
    or a backend callable."""
    where: str = field(default="", compare=False, repr=False)
    """Prefix of the setting names in error messages (``trainer.`` for a recipe)."""

    def __post_init__(self) -> None:
        if self.mode not in COMPILE_MODES:
            raise choice_error(f"{self.where}compile", self.mode, COMPILE_CHOICES)
        if callable(self.backend):
            return
        registered, listed = _available_backends()
        if not isinstance(self.backend, str) or self.backend not in registered:
            raise ConfigError(
                f"{self.where}compile_backend={self.backend!r} is not a torch.compile backend{closest(str(self.backend), registered)}; "
                f"valid choices: {', '.join(listed)}, or another registered backend such as aot_eager"
            )

    @classmethod
    def from_setting(
        cls, setting: bool | str | None, backend: str | Callable[..., Any] = DEFAULT_BACKEND, where: str = ""
    ) -> ModelCompiler | None:
        """``trainer.compile``'s value: false / None -> None (eager), true -> mode ``default``, a mode -> that mode."""
        if setting is None or setting is False:
            return None
        if setting is True:
            return cls("default", backend, where)
        if not isinstance(setting, str) or setting not in COMPILE_MODES:
            raise choice_error(f"{where}compile", setting, COMPILE_CHOICES)
        return cls(setting, backend, where)

    def compile(self, prepared: Prepared, on_first_step: Callable[[float], None] | None = None) -> Prepared:
        """``prepared`` with its model compiled; ``on_first_step(seconds)`` gets the first training step's
        forward + backward wall time (compilation included) when that backward ends."""
        mode = None if self.mode == "default" else self.mode
        blocks = prepared.strategy.compile_units(prepared.module)
        if blocks:  # FSDP2, a pipeline stage: block by block, as torchtitan; each block's gathers run around its graph
            for block in blocks:
                block.compile(mode=mode, backend=self.backend)
            logger.info("torch.compile: %d block(s) compiled one by one; the root module's own layers run eagerly", len(blocks))
            _FirstStepTimer(prepared.model, self._reporter(on_first_step))
            return prepared
        compiled = torch.compile(prepared.model, mode=mode, backend=self.backend)
        _FirstStepTimer(compiled, self._reporter(on_first_step))
        return dataclasses.replace(prepared, model=compiled)

    def _reporter(self, on_first_step: Callable[[float], None] | None) -> Callable[[float], None]:
        def report(seconds: float) -> None:
            logger.info(
                "torch.compile (mode %s, backend %s): the first training forward and backward took %.1f s, compilation included",
                self.mode,
                self.backend,
                seconds,
            )
            if on_first_step is not None:
                on_first_step(seconds)

        return report


class _FirstStepTimer:
    """Times a compiled module's first training call, from its forward's start to the end of the
    backward pass through its outputs; its hooks are removed after that forward, so later calls
    run without them."""

    def __init__(self, module: nn.Module, report: Callable[[float], None]) -> None:
        self._report = report
        self._start: float | None = None
        self._reported = False
        self._hooks = [module.register_forward_pre_hook(self._before), module.register_forward_hook(self._after)]

    def _before(self, module: nn.Module, args: Any) -> None:
        if self._start is None and module.training and torch.is_grad_enabled():
            self._start = time.perf_counter()

    def _after(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._start is None:
            return  # an evaluation call before the first training step
        for hook in self._hooks:
            hook.remove()
        needs_grad = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
        for tensor in needs_grad:  # whichever output the loss uses
            tensor.register_hook(self._in_backward)
        if not needs_grad:
            self._finish()

    def _in_backward(self, grad: torch.Tensor) -> None:
        # Runs when the backward reaches the output; the rest of the backward (the compiled
        # backward graph, compiled now) ends before the engine runs queued callbacks.
        torch.autograd.Variable._execution_engine.queue_callback(self._finish)

    def _finish(self) -> None:
        if self._start is not None and not self._reported:  # once, even if that output is backpropagated again
            self._reported = True
            self._report(time.perf_counter() - self._start)
