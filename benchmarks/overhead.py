"""Framework overhead: ampddp's engine loop and apex-style facade vs the hand-written loop."""

from __future__ import annotations

from harness import Row, side_by_side
from loops import batch, engine_loop, facade_loop, many_layer_mlp, plain_loop

MODES = ("O0", "O1", "native-bf16", "O2", "O3")


def run(device: str, quick: bool) -> list[Row]:
    model = many_layer_mlp()
    data = batch(64, device)
    model = model.to(device)
    steps, repeats = (3, 5) if quick else (10, 15)
    rows = []
    for mode in MODES:
        baseline = plain_loop(mode, model, data, steps)
        rows.append(
            side_by_side(f"overhead/mlp/{mode}/engine", engine_loop(mode, model, data, steps), baseline, repeats=repeats, per=steps)
        )
        if mode.startswith("O"):
            rows.append(
                side_by_side(f"overhead/mlp/{mode}/amp-facade", facade_loop(mode, model, data, steps), baseline, repeats=repeats, per=steps)
            )
    return rows
