"""Pinned loss curves of the quickstart recipe, one per precision mode and numerics key.

A torch upgrade (or a change of ours) that moves the numerics of any mode shows up here as a curve
that no longer matches, instead of as a quiet drift in users' results.

What decides the low-precision curves is the torch release and the CPU kernels oneDNN picks for the
machine's instruction set (an AMD EPYC with avx512_bf16 and an Intel machine differ by up to 7e-4
relative in the fp16/bf16 modes; O0 agrees to 1e-7). So curves are recorded per *numerics key*
(``numerics_key()``): on a machine whose key is recorded every mode must match to ``RTOL``; on any
other machine each mode is compared with the nearest recorded curve at twice the spread measured
between the recorded machines, and O0 stays at ``RTOL``. Record this machine's curves deliberately,
after checking why they moved, with ``python tests/e2e/test_golden_curves.py --write`` (it adds or
replaces this key only).
"""

from __future__ import annotations

import json
import platform
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).parent / "golden" / "quickstart_losses.json"
MODES = ("O0", "O1", "O2", "O3", "O4", "O5", "native-fp16", "native-bf16")
STEPS, EVERY = 16, 4
RTOL = 1e-5
"""A run repeats bit for bit on one machine; the fp16 modes' curves differ from each other by ~1e-4."""
FULL_PRECISION = ("O0",)
"""Modes whose curve must match on every machine at ``RTOL`` (fp32 kernels agree across CPUs)."""
INSTRUCTION_FAMILIES = ("amx_bf16", "avx512_fp16", "avx512_bf16", "avx512f", "avx2")
"""The CPU flags that change which low-precision kernels oneDNN runs, widest first."""


def instruction_family() -> str:
    """The widest of ``INSTRUCTION_FAMILIES`` this CPU has (from /proc/cpuinfo), or ``"unknown"``."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return "unknown"
    flags = next((line.split(":", 1)[1].split() for line in lines if line.startswith("flags")), [])
    return next((family for family in INSTRUCTION_FAMILIES if family in flags), "unknown")


def numerics_key() -> str:
    """What decides this machine's curves: torch minor release, machine, instruction family, ATen's CPU capability."""
    import torch

    major, minor = torch.__version__.split(".")[:2]
    capability = torch.backends.cpu.get_cpu_capability()
    return f"torch{major}.{minor}/{platform.machine()}/{instruction_family()}/{capability}"


def loss_curve(mode: str, run_dir: Path) -> list[float]:
    """The logged training losses of the quickstart recipe at ``mode`` over its first ``STEPS`` steps."""
    from ampddp.recipe.reading import load_config
    from ampddp.run import launch

    overrides = [f"precision.mode={mode}", f"trainer.run_dir={run_dir}", f"trainer.max_steps={STEPS}",
                 f"trainer.log_every_steps={EVERY}", "trainer.progress=off", "distributed.device=cpu"]  # fmt: skip
    launch(load_config(ROOT / "recipes" / "quickstart.yaml", overrides))
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [record["loss"] for record in records if record["kind"] == "train" and record["step"] % EVERY == 0]


def relative_gap(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


def cross_machine_rtol(curves: dict[str, dict[str, list[float]]], mode: str) -> float:
    """Twice the largest gap between the recorded machines' curves of ``mode`` (``RTOL`` for full precision)."""
    if mode in FULL_PRECISION:
        return RTOL
    recorded = [machine[mode] for machine in curves.values()]
    spread = max((relative_gap(a, b) for a in recorded for b in recorded), default=0.0)
    return max(2 * spread, RTOL)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", MODES)
def test_the_quickstart_loss_curve_matches_the_pinned_one(tmp_path, mode):
    curves = json.loads(GOLDEN.read_text())["curves"]
    measured = loss_curve(mode, tmp_path)
    assert len(measured) == STEPS // EVERY
    key = numerics_key()
    record_hint = "record this machine's curves with `python tests/e2e/test_golden_curves.py --write` once you know why"
    if key in curves:
        pinned = curves[key][mode]
        assert measured == pytest.approx(pinned, rel=RTOL), (
            f"{mode} on {key!r}: the quickstart loss curve moved (pinned {pinned}, now {measured}); find out why, then {record_hint}"
        )
        return
    nearest = min(curves, key=lambda recorded: relative_gap(measured, curves[recorded][mode]))
    rtol = cross_machine_rtol(curves, mode)
    assert measured == pytest.approx(curves[nearest][mode], rel=rtol), (
        f"{mode}: no curve is recorded for this machine ({key!r}); the nearest recorded one ({nearest!r}: "
        f"{curves[nearest][mode]}) differs from {measured} by more than rtol={rtol:.2g} (twice the spread between "
        f"recorded machines); {record_hint}"
    )


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    import tempfile

    document = json.loads(GOLDEN.read_text())
    curves = {}
    for mode in MODES:
        with tempfile.TemporaryDirectory() as folder:
            curves[mode] = loss_curve(mode, Path(folder))
    document["curves"][numerics_key()] = curves
    GOLDEN.write_text(json.dumps(document, indent=1) + "\n")
    print(numerics_key(), json.dumps(curves, indent=1))
