"""Every precision mode on one model: samples/s and peak memory, each against the fp32 hand-written loop.

Peak memory is ``torch.cuda.max_memory_allocated`` on CUDA. On CPU there is no allocator counter,
so each side runs in a fresh process and reports how far its resident set grew while it copied the
model and trained (Linux's high-water mark VmHWM, reset just before): params, grads, masters,
optimizer state and activations, plus whatever the C library keeps cached.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import sys

import torch
from harness import Budget, Row, side_by_side
from loops import batch, engine_loop, many_layer_mlp, plain_loop

MODES = ("O0", "O1", "O2", "O3", "O4", "O5", "native-fp16", "native-bf16")
MB = 2**20
PAGE = 4096  # growth is at least a page, so a ratio never divides by zero


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024  # reported in kB


def _reset_peak_resident() -> bool:
    """VmHWM := VmRSS (Linux >= 4.0); False where the kernel or a container refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
    except OSError:
        return False
    return True


def _workload(device: str, budget: Budget):
    width = budget.pick(64, 512, 1024)
    size = budget.pick(8, 64, 256) if device == "cpu" else budget.pick(8, 1024, 4096)
    return lambda: many_layer_mlp(width=width, depth=8), batch(size, device)


def _make_loop(mode: str, ours: bool, model, data, steps: int):
    return engine_loop(mode, model, data, steps) if ours else plain_loop("O0", model, data, steps)


def _cpu_peak_mb(mode: str, ours: bool, size: str, threads: int) -> float | None:
    """Runs in a fresh process: growth of the resident set while copying and training, in MB
    (None where the peak cannot be reset, so it would include the start-up's)."""
    torch.set_num_threads(threads)
    build, data = _workload("cpu", Budget(size))
    _make_loop(mode, ours, many_layer_mlp(width=8, depth=1), batch(2, "cpu"), 1)()  # one-time library set-up is not the mode's cost
    model = build()  # each loop trains its own copy: counted from here
    if not _reset_peak_resident():
        return None
    before = _status_bytes("VmRSS")
    _make_loop(mode, ours, model, data, 2)()
    return max(_status_bytes("VmHWM") - before, PAGE) / MB


def _cuda_peak_mb(mode: str, ours: bool, budget: Budget) -> float:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    build, data = _workload("cuda", budget)
    model = build().cuda()  # each loop trains its own copy: counted from here
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    _make_loop(mode, ours, model, data, 2)()
    torch.cuda.synchronize()
    return max(torch.cuda.max_memory_allocated() - before, PAGE) / MB


def _peaks(device: str, budget: Budget) -> dict[tuple[str, bool], float | None]:
    jobs = [(mode, True) for mode in MODES] + [("O0", False)]
    if device == "cuda":
        return {job: _cuda_peak_mb(*job, budget) for job in jobs}
    if not sys.platform.startswith("linux"):
        return {}
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(2, mp_context=context, max_tasks_per_child=1) as pool:
        futures = {job: pool.submit(_cpu_peak_mb, *job, budget.size, torch.get_num_threads()) for job in jobs}
        return {job: future.result(timeout=600) for job, future in futures.items()}


def run(device: str, budget: Budget) -> list[Row]:
    build, data = _workload(device, budget)
    model = build().to(device)
    steps, repeats = budget.pick((1, 1), (2, 5), (5, 9))
    fp32 = plain_loop("O0", model, data, steps)
    label = f"modes/mlp-{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M"
    rows = []
    for mode in MODES:
        row = side_by_side(f"{label}/{mode}/throughput", engine_loop(mode, model, data, steps), fp32, repeats=repeats,
                           per=steps * len(data[0]), unit="samples/s", throughput=True, note="vs the fp32 hand-written loop")  # fmt: skip
        rows.append(row)
    peaks = _peaks(device, budget)
    if peaks and None in peaks.values():
        print("modes: peak memory left out: /proc/self/clear_refs cannot reset the resident high-water mark here", file=sys.stderr)
    elif peaks:
        baseline = peaks[("O0", False)]
        where = "CUDA max_memory_allocated" if device == "cuda" else "resident-set growth, fresh process"
        for mode in MODES:
            ours = peaks[(mode, True)]
            rows.append(Row(f"{label}/{mode}/peak-memory", ours, baseline, "MB", baseline / ours, 1, 0.0, f"vs fp32 hand-written; {where}"))
    return rows
