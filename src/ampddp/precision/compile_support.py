"""How ampddp's hooks and cast mode meet ``torch.compile``: see ``run_eagerly_as_own_frame``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ampddp.torch_compat import run_as_plain_python_under_compile


def run_eagerly_as_own_frame(*functions: Callable[..., Any]) -> None:
    """Dynamo runs these (and what they call) as plain Python when it meets them as frames of their
    own, and still traces them when it inlines them into a caller's graph.

    Why: ``torch.compile(model)`` calls a module's hooks outside the module's graph unless it inlines
    the module's call (it does for ``nn.Sequential``, and for a model called inside a compiled
    function), and dynamo then compiles each hook as a frame of its own: a hook that enters device
    autocast there makes a graph that mutates autocast state, which AOTAutograd rejects. And while the
    cast mode is active, torch's runtime code around a compiled graph (reads of tensor attributes)
    reaches the mode's ``__torch_function__``, which dynamo would compile again for each parameter up
    to its recompile limit. The setting belongs to these functions' code objects (ampddp's own) and
    changes nothing outside ``torch.compile``; setting it again is a no-op.
    """
    run_as_plain_python_under_compile(*functions)  # imports dynamo at the first set-up, not with ampddp (~2 s)
