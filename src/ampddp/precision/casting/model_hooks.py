"""Per-model hooks of the opt-level engine: forward casting/context and fp32 state dicts.

Only public per-module hooks are used, and every handle is returned so the engine can remove them.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ampddp.precision.casting.cast_context import OpCastContext
from ampddp.precision.casting.tensors import cast_floating
from ampddp.precision.compile_support import run_eagerly_as_own_frame

logger = logging.getLogger("ampddp.precision")
MasterLookup = Callable[[nn.Parameter], "nn.Parameter | None"]


class ForwardHooks:
    """Cast inputs/outputs and hold the op-cast context for the duration of a model's forward.

    torch runs ``always_call`` forward hooks after an Exception but not after a KeyboardInterrupt.
    A forward interrupted that way leaves the context entered; the model's next forward on the same
    thread notices (the model is still marked as running) and unwinds it first.
    """

    def __init__(self, context: OpCastContext | None, input_dtype: torch.dtype | None, output_dtype: torch.dtype | None) -> None:
        self._context = context
        self._input_dtype = input_dtype
        self._output_dtype = output_dtype
        self._local = threading.local()
        self._local.running = []  # set here, not at the first forward: a compiled step guards on it

    def __deepcopy__(self, memo: dict[int, Any]) -> ForwardHooks:
        """A deep copy of a set-up model (an EMA copy, as timm's ModelEma makes) shares its engine's hooks."""
        return self

    @property
    def needed(self) -> bool:
        return self._context is not None or self._input_dtype is not None or self._output_dtype is not None

    def _running(self) -> list[int]:
        if not hasattr(self._local, "running"):
            self._local.running = []
        return self._local.running

    def drop_context(self) -> None:
        """Forwards stop entering the op-cast context (input/output casts go on)."""
        self.unwind_interrupted()
        self._context = None

    def unwind_interrupted(self, module_id: int | None = None) -> None:
        """Exit contexts left entered by forwards that never returned (all, or down to one model)."""
        running = self._running()
        while running and (module_id is None or module_id in running):
            running.pop()
            if self._context is not None:
                self._context.__exit__(None, None, None)
            logger.warning("ampddp: unwound the op-cast context of a forward pass that was interrupted")

    def before(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        self.unwind_interrupted(id(module))
        if self._context is not None:
            self._context.__enter__()
        self._running().append(id(module))
        if self._input_dtype is not None:
            return cast_floating(args, self._input_dtype), cast_floating(kwargs, self._input_dtype)
        return None

    def after(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        running = self._running()
        if running and running[-1] == id(module):
            running.pop()
            if self._context is not None:
                self._context.__exit__(None, None, None)
        if self._output_dtype is not None and output is not None:
            return cast_floating(output, self._output_dtype)
        return None

    def install(self, model: nn.Module) -> list[RemovableHandle]:
        if not self.needed:
            return []
        run_eagerly_as_own_frame(self.before, self.after)
        return [
            model.register_forward_pre_hook(self.before, with_kwargs=True),
            model.register_forward_hook(self.after, always_call=True),
        ]


def install_fp32_state_hooks(model: nn.Module, master_of: MasterLookup) -> list[RemovableHandle]:
    """Make ``state_dict`` fp32 with master values, and ``load_state_dict`` set the masters.

    Hooks go on every submodule that owns params or buffers, so saving or loading any submodule
    (a pretrained backbone, say) behaves the same as the whole model.
    """
    handles = []
    for module in model.modules():
        if not any(True for _ in module.parameters(recurse=False)) and not any(True for _ in module.buffers(recurse=False)):
            continue

        def save(mod: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
            _fp32_state_dict(mod, state_dict, prefix, master_of)

        def load(mod: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
            _load_into_masters(mod, state_dict, prefix, master_of)

        handles.append(module.register_state_dict_post_hook(save))
        handles.append(module.register_load_state_dict_pre_hook(load))
    return handles


def _fp32_state_dict(module: nn.Module, state_dict: dict[str, Any], prefix: str, master_of: MasterLookup) -> None:
    """Checkpoints hold fp32 master values, not upcast half weights (apex issues 180/388)."""
    for name, param in module.named_parameters(recurse=False):
        key = prefix + name
        if key in state_dict:
            master = master_of(param)
            state_dict[key] = master.detach() if master is not None else param.detach().float()
    for name, buffer in module.named_buffers(recurse=False):
        key = prefix + name
        if key in state_dict and buffer.is_floating_point() and buffer.dtype != torch.float32:
            state_dict[key] = buffer.detach().float()


@torch.no_grad()
def _load_into_masters(module: nn.Module, state_dict: dict[str, Any], prefix: str, master_of: MasterLookup) -> None:
    for name, param in module.named_parameters(recurse=False):
        value = state_dict.get(prefix + name)
        master = master_of(param)
        if master is not None and isinstance(value, torch.Tensor) and value.shape == master.shape:
            master.copy_(value)
