"""Pinned loss curves of the quickstart recipe, one per precision mode.

A torch upgrade (or a change of ours) that moves the numerics of any mode shows up here as a curve
that no longer matches, instead of as a quiet drift in users' results. The curves were written on
the CI machine's kind of CPU; regenerate them deliberately, after checking why they moved, with
``python tests/e2e/test_golden_curves.py --write``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).parent / "golden" / "quickstart_losses.json"
MODES = ("O0", "O1", "O2", "O3", "O4", "O5", "native-fp16", "native-bf16")
STEPS, EVERY = 16, 4
RTOL = 1e-5
"""A run repeats bit for bit on one machine; the fp16 modes' curves differ from each other by ~1e-4."""


def loss_curve(mode: str, run_dir: Path) -> list[float]:
    """The logged training losses of the quickstart recipe at ``mode`` over its first ``STEPS`` steps."""
    from ampddp.recipe.reading import load_config
    from ampddp.run import launch

    overrides = [f"precision.mode={mode}", f"trainer.run_dir={run_dir}", f"trainer.max_steps={STEPS}",
                 f"trainer.log_every_steps={EVERY}", "trainer.progress=off", "distributed.device=cpu"]  # fmt: skip
    launch(load_config(ROOT / "recipes" / "quickstart.yaml", overrides))
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [record["loss"] for record in records if record["kind"] == "train" and record["step"] % EVERY == 0]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", MODES)
def test_the_quickstart_loss_curve_matches_the_pinned_one(tmp_path, mode):
    pinned = json.loads(GOLDEN.read_text())[mode]
    measured = loss_curve(mode, tmp_path)
    assert len(measured) == STEPS // EVERY
    assert measured == pytest.approx(pinned, rel=RTOL), (
        f"{mode}: the quickstart loss curve moved (pinned {pinned}, now {measured}); find out why before regenerating"
    )


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    import tempfile

    curves = {}
    for mode in MODES:
        with tempfile.TemporaryDirectory() as folder:
            curves[mode] = loss_curve(mode, Path(folder))
    GOLDEN.write_text(json.dumps(curves, indent=1) + "\n")
    print(json.dumps(curves, indent=1))
