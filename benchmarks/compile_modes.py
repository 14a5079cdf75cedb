"""torch.compile vs eager in every precision mode: the same ampddp engine loop, with ``torch.compile(model)``
applied after ``engine.setup`` (the default inductor backend) or not.

ratio = eager time / compiled time (> 1: compiling pays). Compile time is excluded from the timing (two
compiled steps, then a warm-up loop of each side, run before the timed repeats); the first step's wall
time, which is almost all compilation, is in the note with the number of graphs dynamo made and whether
inductor's on-disk FX-graph cache already held them ("cold": C++ generated and built now; "cached": an
earlier run built the same graph), and so is a recompile at the second step where one happens. Dynamo
is reset before each mode, so every mode gets its own graphs and none runs into the recompile limit.

On this project's 2-core CPU machine a cold inductor compile of one training step took 20-50 s for the
MLP and about 150 s for ResNet-18 (on a loaded machine: a quick run compiling all MLP modes and two
ResNet-18 ones took 24 minutes), so ``--quick`` compiles only the MLP, in O0, O1, O4 and O5 (fp32, fp16
and bf16 op casting, bf16 master weights): about 130 s of compilation cold, 12 s with a warm FX-graph
cache, plus the timed loops (seconds idle, minutes when other work shares the cores). Without
``--quick`` both models run in every mode; as in ``overhead.py`` fp16 ResNet-18 on CPU (convolution
backward ~40-60x slower than fp32) gets few steps. ``--smoke`` uses the ``aot_eager`` backend (no C++
code generation) on a tiny MLP in every mode: it checks the code runs.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch._dynamo
import torch.nn.functional as F
from harness import Budget, Row, side_by_side, timed
from loops import batch, many_layer_mlp, resnet, sgd
from torch import nn
from torch._dynamo.utils import counters

from ampddp import build_engine

MODES = ("O0", "O1", "O2", "O3", "O4", "O5", "native-fp16", "native-bf16")
FP16_MODES = ("O1", "O2", "O3", "native-fp16")
QUICK_CPU_MODES = {"mlp": ("O0", "O1", "O4", "O5"), "resnet18": ()}
"""What a quick CPU run compiles: each cold inductor compile costs 25-50 s (MLP) or ~150 s (ResNet-18) here."""


def engine_loop(mode: str, model: nn.Module, data, steps: int, backend: str | None) -> tuple[Callable[[], None], Callable[[], None]]:
    """``loops.engine_loop`` on a copy of ``model``, compiled after set-up when ``backend`` is given:
    returns ``steps`` steps, and one step of the same loop (same model, engine and optimizer)."""
    model = copy.deepcopy(model)
    optimizer = sgd(model.parameters())
    engine = build_engine(mode, **({"verbosity": 0} if mode.startswith("O") else {}))
    engine.setup([model], [optimizer])
    forward = torch.compile(model, backend=backend) if backend else model
    x, y = data

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        with engine.forward_context():
            loss = F.cross_entropy(forward(x), y)
        engine.backward(loss)
        engine.step(optimizer)

    def run() -> None:
        for _ in range(steps):
            step()

    return run, step


def _counts() -> tuple[int, int, int, int]:
    """Dynamo's graphs and graph breaks, inductor's FX-graph cache hits and misses, so far in this process."""
    return (
        counters["stats"]["unique_graphs"],
        sum(counters["graph_break"].values()),
        counters["inductor"]["fxgraph_cache_hit"],
        counters["inductor"]["fxgraph_cache_miss"],
    )


def _cache_state(hits: int, misses: int, backend: str) -> str:
    if backend != "inductor":
        return backend
    if hits and not misses:
        return "inductor, cached"
    return "inductor, cold" if misses and not hits else f"inductor, FX-graph cache {hits} hits + {misses} misses"


def compiled_vs_eager(name: str, mode: str, model: nn.Module, data, steps: int, repeats: int, backend: str) -> Row:
    """One row: the compiled engine loop (ampddp column) vs the same loop eager (baseline column), per step."""
    torch._dynamo.reset()
    before = _counts()
    compiled, first_step = engine_loop(mode, model, data, steps, backend)
    eager, _ = engine_loop(mode, model, data, steps, None)
    first_s = timed(first_step)
    after_first = _counts()
    second_s = timed(first_step)  # where a graph is specialised at the first step, dynamo recompiles here
    after_second = _counts()
    row = side_by_side(name, compiled, eager, repeats=repeats, per=steps)
    graphs, breaks, hits, misses = (b - a for a, b in zip(before, after_first))
    recompiled, late = after_second[0] - after_first[0], _counts()[0] - after_second[0]
    row.note = (
        f"first compiled step {first_s:.1f} s ({_cache_state(hits, misses, backend)}), {graphs} graph{'s' * (graphs != 1)}"
        + (f", {breaks} graph break{'s' * (breaks != 1)}" if breaks else "")
        + (f"; recompiled at the second step ({second_s:.1f} s, {recompiled} graph{'s' * (recompiled != 1)})" if recompiled else "")
        + (f"; {late} more graph{'s' * (late != 1)} compiled during warm-up/timing" if late else "")
    )
    torch._dynamo.reset()
    return row


def _workloads(device: str, budget: Budget) -> dict:
    """The models and batches of ``overhead.py`` (smoke: a tiny MLP)."""
    images = budget.pick(2, 16, 16) if device == "cpu" else budget.pick(2, 64, 128)
    side = 32 if device == "cpu" else budget.pick(32, 224, 224)
    mlp = budget.pick(lambda: many_layer_mlp(width=16, depth=1), many_layer_mlp, many_layer_mlp)
    return {
        "mlp": (mlp, batch(budget.pick(8, 64, 64), device)),
        "resnet18": (resnet, batch(images, device, (3, side, side))),
    }


def modes_for(label: str, device: str, budget: Budget) -> tuple[str, ...]:
    if budget.size == "smoke":
        return MODES if label == "mlp" else ()
    if device == "cpu" and budget.size == "quick":
        return QUICK_CPU_MODES[label]
    return MODES


def steps_and_repeats(label: str, mode: str, device: str, budget: Budget) -> tuple[int, int]:
    """As ``overhead.py``: fewer steps where fp16 is slow (CPU)."""
    slow = device == "cpu" and mode in FP16_MODES
    if slow and label == "resnet18":
        return budget.pick((1, 1), (1, 3), (1, 3))
    if slow:
        return budget.pick((1, 1), (3, 9), (10, 15))
    if label == "resnet18":
        return budget.pick((1, 1), (5, 7), (20, 15))
    return budget.pick((1, 1), (10, 11), (20, 15))


def run(device: str, budget: Budget) -> list[Row]:
    backend = "aot_eager" if budget.size == "smoke" else "inductor"
    rows = []
    for label, (build, data) in _workloads(device, budget).items():
        modes = modes_for(label, device, budget)
        model = build().to(device) if modes else None
        for mode in modes:
            steps, repeats = steps_and_repeats(label, mode, device, budget)
            rows.append(compiled_vs_eager(f"compile/{label}/{mode}/compiled-vs-eager", mode, model, data, steps, repeats, backend))
    return rows
