"""Cost per torch call in the launch-bound regime: O1/O4's ``forward_context()`` vs plain ``torch.autocast``.

A forward of tiny tensors (8x8, fp32 parameters and input) through a chain of 200 torch calls (a
mix of linear, relu, add, layer_norm, softmax, mul, sum, sub, tanh, matmul, as functions, tensor
methods and operators), where the kernels cost next to nothing and what is measured is what each
call pays on its way to one: Python dispatch, then whatever O1/O4's context adds per call (its casts
on the autocast dispatch key, or its torch-function mode where a set-up needs one) against device
autocast's casts for the baseline. The op lists differ (apex's for ampddp, torch's for autocast), so
the note also counts the casts each side makes per forward. Each forward enters its context once (that
cost is spread over its 200 calls). Grad mode is on, as in a training forward (autograd records each
op, both sides alike), and no backward runs. The chain is called directly inside the context, not
through a module's ``__call__``, so ampddp's forward hooks are not part of the figure. The group runs
on one intra-op thread (restored afterwards): 8x8 kernels gain nothing from a second, and on a
shared machine waiting for a descheduled second thread made single calls cost milliseconds.

Values are microseconds per call; ratio = autocast / ampddp (> 1: ampddp cheaper). The note has the
difference per call and, for reference, the same chain in fp32 without any context.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from harness import Budget, Row, side_by_side
from loops import sgd
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from ampddp import build_engine

LEVELS = {"O1": torch.float16, "O4": torch.bfloat16}
WIDTH = 8
BLOCKS = 20  # of 10 calls each


class Weights(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.weight = nn.Parameter(torch.randn(WIDTH, WIDTH, generator=generator) / WIDTH**0.5)
        self.bias = nn.Parameter(torch.zeros(WIDTH))
        self.gamma = nn.Parameter(torch.ones(WIDTH))
        self.beta = nn.Parameter(torch.zeros(WIDTH))


def chain(weights: Weights, x: torch.Tensor) -> torch.Tensor:
    """``BLOCKS`` x 10 torch calls (the comment numbers them); values stay bounded (layer_norm, tanh)."""
    h = x
    for _ in range(BLOCKS):
        h = F.linear(h, weights.weight, weights.bias)  # 1
        h = F.relu(h)  # 2
        h = h + x  # 3
        h = F.layer_norm(h, (WIDTH,), weights.gamma, weights.beta)  # 4
        p = F.softmax(h, dim=-1)  # 5
        h = torch.mul(h, p)  # 6
        s = h.sum(dim=-1, keepdim=True)  # 7
        h = torch.sub(h, s)  # 8
        h = torch.tanh(h)  # 9
        h = torch.matmul(h, weights.weight)  # 10
    return h


class _Counting(TorchFunctionMode):
    """Counts the calls a torch-function mode sees (one per call in ``chain``: calls made while a mode
    handles one are not seen again)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


def calls_per_forward(weights: Weights, x: torch.Tensor) -> int:
    with _Counting() as counting:
        chain(weights, x)
    return counting.calls


class _CountingCasts(TorchDispatchMode):
    """Counts the dtype casts (``aten._to_copy``) that reach the kernels, autocast's included."""

    def __init__(self) -> None:
        super().__init__()
        self.casts = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.casts += func.overloadpacket is torch.ops.aten._to_copy
        return func(*args, **(kwargs or {}))


def casts_per_forward(context, weights: Weights, x: torch.Tensor) -> int:
    """Casts one forward makes: the op lists differ (apex's vs autocast's), so may the work per call."""
    with context(), _CountingCasts() as counting:
        chain(weights, x)
    return counting.casts


def _forwards(context, weights: Weights, x: torch.Tensor, forwards: int):
    def run() -> None:
        for _ in range(forwards):
            with context():
                chain(weights, x)

    return run


def run(device: str, budget: Budget) -> list[Row]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _rows(device, budget)
    finally:
        torch.set_num_threads(threads)


def _rows(device: str, budget: Budget) -> list[Row]:
    forwards, repeats = budget.pick((1, 1), (20, 21), (100, 31))
    x = torch.randn(WIDTH, WIDTH, generator=torch.Generator().manual_seed(1)).to(device)
    rows = []
    for level, dtype in LEVELS.items():
        weights = Weights().to(device)
        engine = build_engine(level, verbosity=0)
        engine.setup([weights], [sgd(weights.parameters())])
        calls = calls_per_forward(weights, x)
        per = forwards * calls / 1e6  # harness values are seconds / per: microseconds per call

        def autocast(dtype=dtype):
            return torch.autocast(device, dtype=dtype)

        ours = _forwards(engine.forward_context, weights, x, forwards)
        theirs = _forwards(autocast, weights, x, forwards)
        row = side_by_side(f"op-cost/{level}/us-per-call", ours, theirs, repeats=repeats, warmup=2, per=per, unit="us/call")
        fp32 = side_by_side("fp32", _forwards(contextlib.nullcontext, weights, x, forwards), theirs, repeats=max(1, repeats // 2), per=per,
                            unit="us/call").ampddp  # fmt: skip
        difference = row.ampddp - row.baseline
        casts = casts_per_forward(engine.forward_context, weights, x), casts_per_forward(autocast, weights, x)
        row.note = (
            f"ampddp - autocast({str(dtype).removeprefix('torch.')}) = {difference:+.2f} us/call ({difference / row.baseline:+.0%}); "
            f"fp32, no context: {fp32:.2f} us/call; casts/forward: ampddp {casts[0]}, autocast {casts[1]}; "
            f"{calls} calls/forward on {WIDTH}x{WIDTH}, grad mode on, forward only, 1 thread"
        )
        rows.append(row)
        engine.teardown()
    return rows
