"""Single-GPU training throughput: ResNet-50 images/s in every mode, a GPT-style model's bf16 MFU.

ResNet-50 runs channels_last on synthetic data already on the GPU, O0 with TF32 allowed (as
NVIDIA's fp32 figures are), each mode side by side with the hand-written loop at the same precision;
one more row feeds it from JPEG files through the input pipeline (loader workers, pinned memory).
The GPT-style model reports achieved TFLOPS and model FLOPs utilisation against the GPU's dense bf16
peak. Both models also train under ``torch.compile(model)`` (inductor, after set-up) in every mode,
side by side with the same engine loop eager (``compile_modes.compiled_vs_eager``: compile time left
out of the timing and reported in the note). On CPU this suite runs only when named
(``--only cuda-suite --smoke``), to check the code; the compiled rows then use ``aot_eager`` on the
GPT-style model in O4 only. ``run.py --device cuda`` also runs the peers' comparison (``peers.py``) on
the GPU, with its fp16 and O2 groups (and its two-process groups only with two GPUs or more).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from compile_modes import compiled_vs_eager
from harness import Budget, Row, side_by_side
from loops import endless, engine_loop, plain_loop, plain_step, resnet, sgd
from torch import nn
from torch.utils.data import DataLoader

RESNET_MODES = ("O0", "O1", "O2", "O3", "O4", "O5", "native-fp16", "native-bf16")
GPT_MODES = ("native-bf16", "O4")  # token ids are integers: the modes that cast inputs to bf16 do not apply
NVIDIA_RESNET50 = "NVIDIA ResNet-50 v1.5 training, 1 GPU: A100 80GB 938 img/s TF32 vs 2470 mixed (2.63x); V100 16GB 367 vs 1200 img/s"
# Dense bf16 tensor-core peaks (no sparsity), FLOP/s, by a substring of the device name.
# More specific names first: an "H100 PCIe" must not match the SXM part's figure.
BF16_PEAK = {"H100 PCIe": 756e12, "H100 NVL": 835e12, "H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 70e12,
             "L4": 121e12}  # fmt: skip


@contextlib.contextmanager
def _fast_fp32() -> Iterator[None]:
    """TF32 matmuls and convolutions plus cuDNN autotuning for the suite, restored afterwards."""
    matmul, benchmark = torch.get_float32_matmul_precision(), torch.backends.cudnn.benchmark
    torch.set_float32_matmul_precision("high")
    torch.backends.cudnn.benchmark = True
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(matmul)
        torch.backends.cudnn.benchmark = benchmark


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(batch, tokens, 3, self.heads, width // self.heads).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(batch, tokens, width)
        x = x + self.proj(attended)
        return x + self.mlp(self.norm2(x))


class TinyGPT(nn.Module):
    """Decoder-only transformer; returns logits flattened to (batch * tokens, vocab) for cross_entropy."""

    def __init__(self, vocab: int, width: int, depth: int, heads: int, context: int) -> None:
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab, width), nn.Embedding(context, width)
        self.blocks = nn.Sequential(*[Block(width, heads) for _ in range(depth)])
        self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, vocab, bias=False)
        self.shape = (width, depth, context)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.blocks(self.tokens(ids) + self.positions(positions))
        return self.head(self.norm(x)).flatten(0, 1)

    def flops_per_token(self) -> float:
        """Training FLOPs per token: 6 per weight outside the embeddings, plus 12 * depth * width * context
        for attention (the usual convention: counted as if not causal)."""
        width, depth, context = self.shape
        weights = sum(p.numel() for name, p in self.named_parameters() if not name.startswith(("tokens.", "positions.")))
        return 6 * weights + 12 * depth * width * context


def _resnet_workload(device: str, budget: Budget) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor], int, int, int]:
    """ResNet-50 channels_last, a synthetic batch already on ``device``, steps and repeats per mode."""
    size, side, steps, repeats = budget.pick((2, 32, 1, 1), (128, 224, 10, 5), (256, 224, 20, 7))
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(size, 3, side, side, generator=generator).to(device).contiguous(memory_format=torch.channels_last)
    data = (x, torch.randint(0, 1000, (size,), generator=generator).to(device))
    model = resnet(50, classes=1000).to(device).to(memory_format=torch.channels_last)
    return model, data, size, steps, repeats


def _resnet_rows(device: str, budget: Budget) -> list[Row]:
    model, data, size, steps, repeats = _resnet_workload(device, budget)
    modes = RESNET_MODES if device == "cuda" or budget.size != "smoke" else ("O0", "O5", "native-bf16")
    rows = []
    for mode in modes:
        ours, theirs = engine_loop(mode, model, data, steps), plain_loop(mode, model, data, steps)
        rows.append(side_by_side(f"cuda-suite/resnet50/{mode}/train", ours, theirs, repeats=repeats, per=steps * size,
                                 unit="images/s", throughput=True, note="vs hand-written loop, same precision"))  # fmt: skip
    reference = next((row.ampddp for row in rows if row.name.endswith("/O0/train")), None)
    for row in rows:
        speedup = f"; {row.ampddp / reference:.2f}x O0" if reference else ""
        row.note += speedup + ("; " + NVIDIA_RESNET50 if row.name.endswith("/O0/train") else "")
    return rows


def _pipeline_rows(device: str, budget: Budget) -> list[Row]:
    """ResNet-50 fed from JPEG files (the input pipeline, loader workers, pinned memory) instead of a
    synthetic batch on the GPU: ampddp's Trainer vs a hand-written torchvision ImageFolder + DataLoader
    loop with the same transforms, workers and precision."""
    import tempfile
    from pathlib import Path

    from input_pipeline import write_jpegs
    from torchvision.datasets import ImageFolder
    from torchvision.io import ImageReadMode, decode_image

    from ampddp.distributed.env import detect_env
    from ampddp.trainer import Trainer
    from ampddp.training import DeviceSettings, LoaderSettings
    from ampddp.zoo.data import imagefolder

    images, side, size, steps, repeats, workers = budget.pick((16, 32, 2, 2, 1, 0), (2048, 224, 128, 15, 3, 8), (4096, 224, 256, 20, 3, 12))
    mode = "native-bf16" if device == "cuda" else "O5"
    pinned = device == "cuda"
    with tempfile.TemporaryDirectory(dir=Path.cwd(), prefix=".ampddp-bench-images-") as folder:
        root = Path(folder)
        source = 256 if budget.size != "smoke" else 48
        write_jpegs(root, images, size=source)
        train_set, _ = imagefolder(str(root), side, augment=True)
        decode = lambda path: decode_image(path, mode=ImageReadMode.RGB)  # noqa: E731 - the hand-written side's loader
        theirs_set = ImageFolder(str(root / "train"), transform=train_set.transform, loader=decode)
        env = detect_env({}, device=device)

        def ours() -> None:
            model = resnet(50, classes=1000)
            trainer = Trainer(model, sgd, train_set, env=env, precision=mode, batch_size=size, max_steps=steps, max_epochs=10**6,
                              log_every=10**6, loading=LoaderSettings(num_workers=workers, pin_memory=pinned),
                              device=DeviceSettings(channels_last=True, cudnn_benchmark=device == "cuda"), report=None)  # fmt: skip
            trainer.fit()

        def theirs() -> None:
            step = plain_step(mode, resnet(50, classes=1000).to(device).to(memory_format=torch.channels_last), device)
            loader = DataLoader(theirs_set, batch_size=size, shuffle=True, num_workers=workers, pin_memory=pinned,
                                persistent_workers=workers > 0, generator=torch.Generator().manual_seed(0))  # fmt: skip
            for _, (x, y) in zip(range(steps), endless(loader)):
                step(x.to(device, non_blocking=True, memory_format=torch.channels_last), y.to(device, non_blocking=True))

        row = side_by_side(f"cuda-suite/resnet50/{mode}/train-from-jpegs", ours, theirs, repeats=repeats, per=steps * size,
                           unit="images/s", throughput=True,
                           note=f"{images} JPEGs {source}px decoded + RandomResizedCrop {side} in {workers} loader workers, channels_last; "
                                "vs a hand-written ImageFolder + DataLoader loop, same transforms, workers and precision")  # fmt: skip
    return [row]


def _gpt_workload(device: str, budget: Budget) -> tuple[TinyGPT, tuple[torch.Tensor, torch.Tensor], int, int, int, int]:
    """The GPT-style model, token ids and next-token labels on ``device``, tokens per batch
    (``size``, ``context``), steps and repeats per mode."""
    vocab, width, depth, heads, context, size = budget.pick(
        (256, 64, 2, 2, 32, 2), (8192, 768, 12, 12, 1024, 8), (32768, 1024, 24, 16, 1024, 8)
    )
    steps, repeats = budget.pick((1, 1), (5, 5), (10, 7))
    model = TinyGPT(vocab, width, depth, heads, context).to(device)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (size, context), generator=generator).to(device)
    data = (ids, torch.randint(0, vocab, (size * context,), generator=generator).to(device))
    return model, data, size, context, steps, repeats


def _gpt_label(model: nn.Module) -> str:
    return f"gpt-{sum(p.numel() for p in model.parameters()) / 1e6:.0f}M"


def _gpt_rows(device: str, budget: Budget) -> list[Row]:
    model, data, size, context, steps, repeats = _gpt_workload(device, budget)
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    peak = next((value for key, value in BF16_PEAK.items() if key in name), None)
    flops = model.flops_per_token() * size * context * steps
    rows = []
    for mode in GPT_MODES:
        ours, theirs = engine_loop(mode, model, data, steps), plain_loop(mode, model, data, steps)
        row = side_by_side(f"cuda-suite/{_gpt_label(model)}/{mode}/train", ours, theirs,
                           repeats=repeats, per=flops / 1e12, unit="TFLOP/s", throughput=True)  # fmt: skip
        mfu = (
            f"MFU {row.ampddp * 1e12 / peak:.1%} of {name}'s {peak / 1e12:.0f} TFLOP/s dense bf16"
            if peak
            else f"no bf16 peak known for {name}"
        )
        row.note = f"{mfu}; vs hand-written autocast(bfloat16) loop"
        rows.append(row)
    return rows


def _compile_rows(device: str, budget: Budget) -> list[Row]:
    """Both models compiled vs eager, same engine loop and mode (ratio: eager time / compiled time);
    on CPU (smoke only) ``aot_eager`` on the GPT-style model in O4, to check the code."""
    backend = "inductor" if device == "cuda" else "aot_eager"
    rows = []
    if device == "cuda":
        model, data, _, steps, repeats = _resnet_workload(device, budget)
        for mode in RESNET_MODES:
            rows.append(compiled_vs_eager(f"cuda-suite/compile/resnet50/{mode}/compiled-vs-eager", mode, model, data, steps,
                                          repeats, backend))  # fmt: skip
    model, data, _, _, steps, repeats = _gpt_workload(device, budget)
    for mode in GPT_MODES if device == "cuda" else ("O4",):
        rows.append(compiled_vs_eager(f"cuda-suite/compile/{_gpt_label(model)}/{mode}/compiled-vs-eager", mode, model, data, steps,
                                      repeats, backend))  # fmt: skip
    return rows


def run(device: str, budget: Budget) -> list[Row]:
    with _fast_fp32() if device == "cuda" else contextlib.nullcontext():
        return _resnet_rows(device, budget) + _pipeline_rows(device, budget) + _gpt_rows(device, budget) + _compile_rows(device, budget)
