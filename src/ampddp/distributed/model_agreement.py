"""Every rank must wrap the same model.

Ranks build their model themselves; a per-rank environment, a different checkout on one node or a
rank-dependent branch in a user's code can give one rank another width or an extra buffer. torch's
DDP then fails with a multi-line report (or, for a buffer or apex's DDP, not at all: its broadcasts
and all-reduces pair different tensors), so before wrapping the ranks compare a digest of their
models' parameter and buffer names, shapes and dtypes, and a difference stops every rank with one
line naming the first differing tensor. ``prepare`` checks before giving every rank rank 0's
weights, ``wrap_model`` before wrapping.
"""

from __future__ import annotations

import hashlib

from torch import nn

from ampddp.distributed.data import broadcast_from_main, gather_objects
from ampddp.distributed.env import DistEnv
from ampddp.errors import ConfigError

__all__ = ["check_models_agree", "model_layout"]

Entry = tuple[str, tuple[int, ...], str]
"""(kind and name, shape, dtype) of one tensor of a model."""


def model_layout(model: nn.Module) -> list[Entry]:
    """Every parameter and buffer of ``model`` as (``"parameter 'name'"``, shape, dtype), in order."""
    named = [*(("parameter", item) for item in model.named_parameters()), *(("buffer", item) for item in model.named_buffers())]
    return [(f"{kind} '{name}'", tuple(tensor.shape), str(tensor.dtype).removeprefix("torch.")) for kind, (name, tensor) in named]


def check_models_agree(model: nn.Module, env: DistEnv) -> None:
    """Collective: raise ConfigError on every rank unless every rank's model has rank 0's layout.
    One all-gather of a digest when they agree (the usual case)."""
    if not env.distributed:
        return
    layout = model_layout(model)
    digests = gather_objects(hashlib.sha256(repr(layout).encode()).hexdigest(), env)
    if len(set(digests)) == 1:
        return
    main = broadcast_from_main(layout if env.is_main else None, env)
    reports = gather_objects(first_difference(main, layout), env)
    rank, report = next((rank, report) for rank, report in enumerate(reports) if report)
    others = [r for r, other in enumerate(reports) if other and r != rank]
    also = f"; rank(s) {', '.join(map(str, others))} differ too" if others else ""
    raise ConfigError(
        f"the ranks built different models: rank {rank} {report}{also}; every rank must build the same model "
        "(same code, settings and weights files)"
    )


def first_difference(main: list[Entry], mine: list[Entry]) -> str | None:
    """The first tensor where ``mine`` differs from rank 0's ``main``, in words (None: none does)."""
    theirs = {name: (shape, dtype) for name, shape, dtype in main}
    ours = {name: (shape, dtype) for name, shape, dtype in mine}
    for name, shape, dtype in main:
        if name not in ours:
            return f"lacks {name} that rank 0 has"
        our_shape, our_dtype = ours[name]
        if our_shape != shape:
            return f"has {name} of shape {list(our_shape)} where rank 0 has {list(shape)}"
        if our_dtype != dtype:
            return f"has {name} in {our_dtype} where rank 0 has {dtype}"
    extra = next((name for name, _, _ in mine if name not in theirs), None)
    if extra is not None:
        return f"has {extra} that rank 0 lacks"
    if [name for name, _, _ in mine] != [name for name, _, _ in main]:
        return "registers its tensors in another order than rank 0"
    return None
