"""Opt level O6 (fp8 matmuls through torchao) against O4, and O5, in the same engine loop on a GPT.

On the CPU there is no fp8 hardware: torch's CPU fp8 matmul is correct and slower than bf16, so the
CPU row is the price of testing fp8 here, not a speed claim. On CUDA (compute capability 8.9+) the
rows are the decision a user makes: a GPT with 4096-wide layers, compiled, in O6, O4 and O5
(tokens/s), and ResNet-50, whose only linear layer is its head (kept bf16 by
default): no layer qualifies, O6 is O4 there, and the row says so with its number. On 2 CPU
processes under FSDP2: the bytes a rank all-gathers per step with tensorwise scaling (fp8 weights
gathered in fp8) against rowwise (gathered in fp32).
"""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import logging

import torch
from harness import Budget, Row, side_by_side
from loops import batch, engine_loop, resnet
from torch.utils._python_dispatch import TorchDispatchMode

from ampddp import Parallel, Precision
from ampddp.distributed import launch_local
from ampddp.prepare import prepare
from ampddp.zoo.models import GPT

logger = logging.getLogger("benchmarks")


def _gpt_loop(mode: str, size: tuple[int, int, int, int], device: str, steps: int, compile: bool, min_size: int | None):
    """A GPT's training loop in ``mode`` (``size``: width, layers, context, batch)."""
    width, layers, context, rows = size
    torch.manual_seed(0)
    model = GPT(32768, layers=layers, width=width, heads=max(1, width // 128), context=context).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    overrides = {"verbosity": 0, **({"fp8_min_size": min_size} if mode == "O6" and min_size else {})}
    engine = Precision(mode, overrides=overrides).build_engine()
    engine.setup([model], [optimizer])
    forward = torch.compile(model) if compile else model
    ids = torch.randint(32768, (rows, context + 1), generator=torch.Generator().manual_seed(1)).to(device)

    def run() -> None:
        for _ in range(steps):
            with engine.forward_context():
                loss = forward(input_ids=ids[:, :-1], labels=ids[:, 1:])["loss"]
            engine.backward(loss)
            engine.step(optimizer)
            engine.zero_grad(optimizer)

    return run, sum(layer["fp8"] for layer in engine.fp8_plan())


def _cpu_rows(budget: Budget) -> list[Row]:
    size = budget.pick((64, 1, 32, 4), (256, 2, 128, 8), (512, 4, 256, 8))
    steps, repeats = budget.pick((1, 1), (3, 5), (5, 7))
    o6, converted = _gpt_loop("O6", size, "cpu", steps, compile=False, min_size=16)
    o4, _ = _gpt_loop("O4", size, "cpu", steps, compile=False, min_size=None)
    tokens = size[2] * size[3] * steps
    return [side_by_side(f"fp8/cpu/gpt-width{size[0]}/O6-vs-O4", o6, o4, repeats=repeats, per=tokens, unit="tokens/s",
                         throughput=True, note=f"{converted} linear layers in fp8 without fp8 hardware (torch's CPU fp8 "
                         "matmul): the price of testing O6 on a CPU, not a speed claim (below 1 expected)")]  # fmt: skip


class GatheredBytes(TorchDispatchMode):
    """The bytes this rank sends into all-gathers (FSDP2 gathering its params), as dispatched."""

    def __init__(self) -> None:
        super().__init__()
        self.sent = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.c10d._allgather_base_.default:
            sent = args[1]  # (output, input, group, ...): the input is this rank's shard
            self.sent += sent.numel() * sent.element_size()
        return func(*args, **(kwargs or {}))


def _gathered_per_step(env, width: int) -> dict[str, int]:
    """Bytes one rank sends into FSDP2's all-gathers in a training step of an O6 GPT, per fp8 recipe."""
    sent = {}
    for recipe in ("rowwise", "tensorwise"):
        torch.manual_seed(0)
        model = GPT(256, layers=2, width=width, heads=max(1, width // 64), context=64)
        precision = Precision("O6", overrides={"fp8_recipe": recipe, "fp8_min_size": 16, "verbosity": 0})
        run = prepare(model, lambda params: torch.optim.AdamW(params, lr=1e-4), env, precision=precision, parallel=Parallel("fsdp2"))
        ids = torch.randint(256, (4, 65), generator=torch.Generator().manual_seed(env.rank))
        for counted in (False, True):  # the first step builds FSDP2's state; the second is counted
            with GatheredBytes() if counted else contextlib.nullcontext() as mode:
                with run.engine.forward_context():
                    loss = run.model(input_ids=ids[:, :-1], labels=ids[:, 1:])["loss"]
                run.engine.backward(loss)
                run.engine.step(run.optimizer)
                run.engine.zero_grad(run.optimizer)
        sent[recipe] = mode.sent
        run.engine.teardown()
    return sent


def _gather_rows(budget: Budget) -> list[Row]:
    width = budget.pick(64, 256, 512)
    sent = launch_local(_gathered_per_step, 2, (width,), device="cpu", timeout_s=600)[0]
    ours, theirs = sent["tensorwise"] / 2**20, sent["rowwise"] / 2**20
    return [Row(f"fp8/2-processes/fsdp2-gpt-width{width}/all-gather-bytes-tensorwise-vs-rowwise", ours, theirs, "MiB/step/rank",
                theirs / ours, 1, 0.0, "bytes a rank sends into FSDP2's all-gathers per O6 step (forward + backward re-gather): "
                "tensorwise gathers the fp8 layers' weights in fp8, rowwise in fp32; embeddings, norms, head stay fp32")]  # fmt: skip


def _cuda_rows(budget: Budget) -> list[Row]:
    size = budget.pick((256, 1, 128, 2), (4096, 2, 2048, 2), (4096, 4, 2048, 4))  # two models alive at once: ~30 GB at full
    steps, repeats = budget.pick((1, 1), (5, 5), (10, 7))
    tokens = size[2] * size[3] * steps
    o6, converted = _gpt_loop("O6", size, "cuda", steps, compile=True, min_size=None)
    rows = []
    for baseline in ("O4", "O5"):
        other, _ = _gpt_loop(baseline, size, "cuda", steps, compile=True, min_size=None)
        rows.append(side_by_side(f"fp8/cuda/gpt-width{size[0]}/O6-vs-{baseline}", o6, other, repeats=repeats, per=tokens,
                                 unit="tokens/s", throughput=True, note=f"compiled (inductor); {converted} linear layers in fp8 "
                                 "(rowwise), the first and the last kept bf16"))  # fmt: skip
        other = None  # its model and optimizer freed before the next baseline is built
        gc.collect()
        torch.cuda.empty_cache()
    model, images = resnet(50, 1000).cuda(), batch(budget.pick(4, 64, 128), "cuda", (3, 224, 224), 1000)
    o6_resnet, o4_resnet = engine_loop("O6", model, images, steps), engine_loop("O4", model, images, steps)
    rows.append(side_by_side("fp8/cuda/resnet50/O6-vs-O4", o6_resnet, o4_resnet, repeats=repeats, per=images[0].shape[0] * steps,
                             unit="images/s", throughput=True, note="ResNet-50's one linear layer is its head, kept bf16: no "
                             "layer runs in fp8, O6 is O4 on a convnet (1 expected)"))  # fmt: skip
    return rows


def run(device: str, budget: Budget) -> list[Row]:
    if importlib.util.find_spec("torchao") is None:
        logger.warning("fp8: skipped, torchao is not installed (pip install 'ampddp[fp8]')")
        return []
    return _cuda_rows(budget) if device == "cuda" else _cpu_rows(budget) + _gather_rows(budget)
