"""Framework overhead: ampddp's engine loop and apex-style facade vs the hand-written loop, two models.

The MLP (many small layers, ~3 ms/step on CPU) shows per-step Python cost; ResNet-18 shows what a
real convolutional model pays. fp16 convolution backward on CPU is ~40x slower than fp32 (1.7 s per
ResNet-18 step here), so on CPU the fp16 ResNet-18 modes run only without ``--quick``.
"""

from __future__ import annotations

from harness import Budget, Row, side_by_side
from loops import batch, engine_loop, facade_loop, many_layer_mlp, plain_loop, resnet

MODES = ("O0", "O1", "native-bf16", "O2", "O3", "O4", "O5")
FP16_MODES = ("O1", "O2", "O3")


def _workloads(device: str, budget: Budget) -> dict:
    images = budget.pick(2, 16, 16) if device == "cpu" else budget.pick(2, 64, 128)
    side = budget.pick(32, 32, 32) if device == "cpu" else budget.pick(32, 224, 224)
    return {
        "mlp": (many_layer_mlp, batch(64, device)),
        "resnet18": (resnet, batch(images, device, (3, side, side))),
    }


def run(device: str, budget: Budget) -> list[Row]:
    steps, repeats = budget.pick((1, 1), (3, 9), (10, 15))
    rows = []
    for label, (build, data) in _workloads(device, budget).items():
        model = build().to(device)
        slow_on_cpu = label == "resnet18" and device == "cpu"
        for mode in MODES:
            if slow_on_cpu and mode in FP16_MODES and budget.size == "quick":
                continue
            mode_steps, mode_repeats = (1, 3) if slow_on_cpu and mode in FP16_MODES and budget.size == "full" else (steps, repeats)
            baseline = plain_loop(mode, model, data, mode_steps)
            ours = engine_loop(mode, model, data, mode_steps)
            rows.append(side_by_side(f"overhead/{label}/{mode}/engine", ours, baseline, repeats=mode_repeats, per=mode_steps))
            if mode.startswith("O") and label == "mlp":
                facade = facade_loop(mode, model, data, mode_steps)
                rows.append(side_by_side(f"overhead/{label}/{mode}/amp-facade", facade, baseline, repeats=mode_repeats, per=mode_steps))
    return rows
