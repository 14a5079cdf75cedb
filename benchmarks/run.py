"""Run ampddp's benchmarks side by side with the baselines they replace.

    python benchmarks/run.py --quick --out results.json      # a few minutes on 2 CPU cores
    python benchmarks/run.py --device cuda --out cuda.json   # adds the CUDA suite (ResNet-50, GPT MFU)
    python benchmarks/run.py --smoke --out smoke.json        # seconds: checks every benchmark runs

Writes JSON rows {name, ampddp, baseline, unit, ratio, repeats, spread} (ratio > 1: ampddp better)
and a markdown table next to them.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import checkpoint_io
import compile_modes
import cuda_suite
import ddp_scaling
import fp8
import fused_optimizers
import hsdp_traffic
import input_pipeline
import memory
import meta_build
import modes
import op_cost
import optimizer_step
import overhead
import peers
import pipeline
import sharding
import startup
import tensor_parallel
import torch
from harness import Budget

from ampddp.precision.hardware import cpu_description

BENCHMARKS = {
    "overhead": overhead.run,
    "modes": modes.run,
    "memory": memory.run,
    "optimizer-step": optimizer_step.run,
    "fused-optimizers": fused_optimizers.run,
    "checkpoint": checkpoint_io.run,
    "ddp": ddp_scaling.run,
    "sharding": sharding.run,
    "meta-build": meta_build.run,
    "hsdp": hsdp_traffic.run,
    "tensor-parallel": tensor_parallel.run,
    "pipeline": pipeline.run,
    "fp8": fp8.run,
    "compile": compile_modes.run,
    "op-cost": op_cost.run,
    "input": input_pipeline.run,
    "startup": startup.run,
    "peers": peers.run,
    "cuda-suite": cuda_suite.run,
}
CUDA_ONLY = ("cuda-suite",)  # run on CPU only when named with --only
NAMED_ONLY = ("peers",)  # on CPU only when named with --only: 15-45 minutes, and the peers live in an environment of their own


def markdown(rows: list[dict], header: str) -> str:
    lines = [
        header,
        "",
        "| benchmark | ampddp | baseline | unit | ratio (>1: ampddp better) | spread | note |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['name']} | {row['ampddp']:.4g} | {row['baseline']:.4g} | {row['unit']} | {row['ratio']:.3f} | "
            f"{row['spread']:.2f} | {row.get('note', '')} |"
        )
    return "\n".join(lines) + "\n"


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters


def steady_host_allocator() -> bool:
    """Keep glibc from returning freed heap to the OS after every step (and faulting it back in).

    Why: a step that frees a large block at the top of the heap (O2/O5 free ~27 MiB of fp32 gradient
    copies of ResNet-18's layer4) makes glibc trim it; the next step touches fresh pages again:
    ~6,900-9,200 minor page faults per step measured, against none for a loop whose frees land
    elsewhere. Which side trims depends on heap layout, not on the work, so both sides of every
    comparison run with the same fixed thresholds. False where the C library is not glibc.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(M_TRIM_THRESHOLD, 256 << 20)) and bool(libc.mallopt(M_MMAP_THRESHOLD, 32 << 20))
    except (OSError, AttributeError):
        return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="fewer repeats and smaller sizes (under 5 minutes on 2 CPU cores)")
    size.add_argument("--smoke", action="store_true", help="tiny sizes, one repeat: checks the code runs; the numbers mean nothing")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--only", nargs="+", choices=sorted(BENCHMARKS), help="run only these benchmarks")
    parser.add_argument("--out", default="results.json", help="JSON output (a .md table is written beside it)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")
    steady_host_allocator()
    budget = Budget("smoke" if args.smoke else "quick" if args.quick else "full")
    names = args.only or [name for name in BENCHMARKS if args.device == "cuda" or name not in CUDA_ONLY + NAMED_ONLY]
    torch.manual_seed(0)
    rows = []
    for name in names:
        start = time.perf_counter()
        rows += [row.to_dict() for row in BENCHMARKS[name](args.device, budget)]
        print(f"{name}: {time.perf_counter() - start:.1f}s", file=sys.stderr)
    bad = [row["name"] for row in rows if not (math.isfinite(row["ratio"]) and row["ratio"] > 0)]
    if bad:
        print(f"non-finite or non-positive ratios: {bad}", file=sys.stderr)
        return 1
    cpu = cpu_description()  # bf16 emulated or native decides every bf16 row on a CPU: each row says which
    rows = [{**row, "cpu": cpu} for row in rows]
    out = Path(args.out)
    out.write_text(json.dumps(rows, indent=2))
    machine = f"{platform.machine()} ({cpu}), {torch.get_num_threads()} threads, torch {torch.__version__}, device {args.device}"
    date = time.strftime("%Y-%m-%d")
    out.with_suffix(".md").write_text(markdown(rows, f"ampddp benchmarks ({budget.size}) on {machine}, {date}") + peers.table(rows))
    print(markdown(rows, f"results on {machine}") + peers.table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
