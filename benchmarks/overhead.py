"""Framework overhead: ampddp's engine, apex-style facade and Trainer vs the hand-written loop.

The MLP (many small layers, ~3 ms/step on CPU) shows per-step Python cost, for all three; ResNet-18
shows what a real convolutional model pays. fp16 convolution backward on CPU is ~40x slower than
fp32 (1.7 s per ResNet-18 step here), so on CPU the fp16 ResNet-18 modes run only without ``--quick``.
"""

from __future__ import annotations

from harness import Budget, Row, side_by_side
from loops import batch, engine_loop, facade_loop, many_layer_mlp, plain_loop, python_registration, resnet, trainer_and_plain_epochs

MODES = ("O0", "O1", "native-bf16", "O2", "O3", "O4", "O5")
FP16_MODES = ("O1", "O2", "O3")
OP_LIST_MODES = ("O1", "O4")
MODE_PATH_NOTE = "set-up with a registration of a plain Python function: every torch call seen in Python"
TRAINER_SAMPLES = 4096  # the MLP's data set for the Trainer rows: 64 batches of 64


def _workloads(device: str, budget: Budget) -> dict:
    images = budget.pick(2, 16, 16) if device == "cpu" else budget.pick(2, 64, 128)
    side = budget.pick(32, 32, 32) if device == "cpu" else budget.pick(32, 224, 224)
    return {
        "mlp": (many_layer_mlp, batch(64, device)),
        "resnet18": (resnet, batch(images, device, (3, side, side))),
    }


def _steps_and_repeats(label: str, mode: str, device: str, budget: Budget) -> tuple[int, int]:
    """Enough steps per timed block that fast modes are not timer noise; fewer where fp16 is slow (CPU)."""
    slow = device == "cpu" and mode in FP16_MODES
    if slow and label == "resnet18":
        return budget.pick((1, 1), (0, 0), (1, 3))  # quick: skipped
    return budget.pick((1, 1), (3, 9), (10, 15)) if slow else budget.pick((1, 1), (10, 11), (20, 15))


def run(device: str, budget: Budget) -> list[Row]:
    rows = []
    for label, (build, data) in _workloads(device, budget).items():
        model = build().to(device)
        for mode in MODES:
            steps, repeats = _steps_and_repeats(label, mode, device, budget)
            if not steps:
                continue
            baseline = plain_loop(mode, model, data, steps)
            ours = engine_loop(mode, model, data, steps)
            rows.append(side_by_side(f"overhead/{label}/{mode}/engine", ours, baseline, repeats=repeats, per=steps))
            if mode in OP_LIST_MODES:
                mode_path = engine_loop(mode, model, data, steps, registry=python_registration())
                name = f"overhead/{label}/{mode}/engine-torch-function-mode"
                rows.append(side_by_side(name, mode_path, baseline, repeats=repeats, per=steps, note=MODE_PATH_NOTE))
            if mode.startswith("O") and label == "mlp":
                facade = facade_loop(mode, model, data, steps)
                rows.append(side_by_side(f"overhead/{label}/{mode}/amp-facade", facade, baseline, repeats=repeats, per=steps))
            if label == "mlp":
                rows.append(_trainer_row(mode, model, device, steps, repeats))
    return rows


def _trainer_row(mode: str, model, device: str, steps: int, repeats: int) -> Row:
    """The whole Trainer step (data loading, logging every 10 steps, stop checks) vs the same hand-written epoch loop."""
    data = batch(TRAINER_SAMPLES, device)
    ours, theirs = trainer_and_plain_epochs(mode, model, data, 64, steps)
    return side_by_side(f"overhead/mlp/{mode}/trainer", ours, theirs, repeats=repeats, per=steps,
                        note="both fed by a shuffling DataLoader")  # fmt: skip
