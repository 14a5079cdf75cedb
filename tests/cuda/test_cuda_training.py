"""What only a GPU shows: NCCL DDP, torch SyncBN under O2 with fp16 inputs, the O1/O4 dtype table on
CUDA against CPU, channels_last convolutions, the GradScaler path of native fp16, and FSDP2's CPU
offload (params on the host, compute on the GPU)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ampddp import Parallel, Precision, build_engine
from ampddp.distributed import FSDPOptions, launch_local
from ampddp.distributed.env import detect_env
from ampddp.prepare import prepare


def small_convnet() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16),
        nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10),
    )  # fmt: skip


def images(batch: int = 16, seed: int = 0, device: str = "cuda") -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 3, 16, 16, generator=generator)
    return x.to(device), torch.randint(0, 10, (batch,), generator=generator).to(device)


def sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def train_steps(prepared, batches) -> list[float]:
    losses = []
    for x, y in batches:
        prepared.optimizer.zero_grad(set_to_none=True)
        with prepared.engine.forward_context():
            loss = F.cross_entropy(prepared.model(x).float(), y)
        prepared.engine.backward(loss)
        prepared.engine.step(prepared.optimizer)
        losses.append(loss.item())
    return losses


def nccl_worker(env, mode):
    prepared = prepare(small_convnet(), sgd, env, precision=mode, parallel=Parallel(sync_bn="torch"))
    x, y = images(16, seed=env.rank)
    losses = train_steps(prepared, [(x, y)] * 3)
    params = torch.cat([p.detach().float().flatten() for p in prepared.module.parameters()]).cpu()
    return losses, params, type(prepared.model).__name__, prepared.module[1].__class__.__name__


@pytest.mark.timeout(300)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL DDP needs 2 GPUs (one process per GPU)")
@pytest.mark.parametrize("mode", ["O1", "O2", "native-bf16"])
def test_nccl_ddp_with_torch_sync_bn_keeps_the_ranks_identical(mode):
    results = launch_local(nccl_worker, 2, (mode,), device="cuda", backend="nccl")
    (losses_0, params_0, wrapper, bn), (_, params_1, _, _) = results
    assert wrapper == "DistributedDataParallel" and bn == "SyncBatchNorm"
    assert all(torch.isfinite(torch.tensor(losses_0)))
    torch.testing.assert_close(params_0, params_1, rtol=0, atol=0)


def test_torch_sync_bn_under_o2_keeps_batchnorm_fp32_with_fp16_inputs():
    env = detect_env({}, device="cuda")
    model = nn.SyncBatchNorm.convert_sync_batchnorm(small_convnet())
    prepared = prepare(model, sgd, env, precision="O2")
    bn = prepared.module[1]
    assert prepared.module[0].weight.dtype == torch.float16 and bn.weight.dtype == torch.float32
    x, y = images()
    seen = {}
    handle = bn.register_forward_pre_hook(lambda module, args: seen.setdefault("input", args[0].dtype))
    losses = train_steps(prepared, [(x, y)] * 3)
    handle.remove()
    assert seen["input"] == torch.float16 and all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0]


OPS = {
    "linear": lambda x, w: F.linear(x, w),
    "matmul": lambda x, w: x @ w.t(),
    "softmax": lambda x, w: torch.softmax(x, -1),
    "log_softmax": lambda x, w: F.log_softmax(x, -1),
    "exp": lambda x, w: torch.exp(x),
    "sum": lambda x, w: x.sum(),
    "layer_norm": lambda x, w: F.layer_norm(x, x.shape[-1:]),
    "add_mixed": lambda x, w: x + F.linear(x, w),
    "cat_mixed": lambda x, w: torch.cat([x, F.linear(x, w)]),
    "mse_loss": lambda x, w: F.mse_loss(F.linear(x, w), x),
}


def output_dtypes(mode: str, device: str) -> dict[str, torch.dtype]:
    engine = build_engine(mode)
    model = nn.Linear(8, 8).to(device)
    engine.setup([model], [torch.optim.SGD(model.parameters(), lr=0.1)])
    x = torch.randn(4, 8, device=device)
    w = torch.randn(8, 8, device=device)
    with engine.forward_context():
        result = {name: op(x, w).dtype for name, op in OPS.items()}
    engine.teardown()
    return result


@pytest.mark.parametrize("mode", ["O1", "O4"])
def test_the_o1_o4_cast_table_is_the_same_on_cuda_as_on_cpu(mode):
    assert output_dtypes(mode, "cuda") == output_dtypes(mode, "cpu")


@pytest.mark.parametrize("mode", ["O1", "O2", "O4", "native-fp16"])
def test_channels_last_convolutions_train_like_contiguous_ones(mode):
    env = detect_env({}, device="cuda")
    contiguous = prepare(small_convnet(), sgd, env, precision=mode)
    channels_last = prepare(small_convnet().to(memory_format=torch.channels_last), sgd, env, precision=mode)
    x, y = images()
    losses = train_steps(contiguous, [(x, y)] * 3)
    losses_cl = train_steps(channels_last, [(x.contiguous(memory_format=torch.channels_last), y)] * 3)
    assert channels_last.module[0].weight.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(torch.tensor(losses_cl), torch.tensor(losses), rtol=2e-2, atol=2e-3)


def test_native_fp16_on_cuda_skips_an_overflowed_step_and_halves_the_scale():
    env = detect_env({}, device="cuda")
    prepared = prepare(small_convnet(), sgd, env, precision=Precision("native-fp16", overrides={"init_loss_scale": 2.0**16}))
    before = copy.deepcopy(prepared.module.state_dict())
    x, y = images()
    prepared.optimizer.zero_grad(set_to_none=True)
    with prepared.engine.forward_context():
        loss = F.cross_entropy(prepared.model(x).float(), y) * float("inf")
    prepared.engine.backward(loss)
    assert not prepared.engine.step(prepared.optimizer)
    assert prepared.engine.loss_scale() == 2.0**15 and prepared.engine.skipped_steps == 1
    for name, value in prepared.module.state_dict().items():
        torch.testing.assert_close(value, before[name], rtol=0, atol=0, msg=name)
    assert train_steps(prepared, [(x, y)])[0] > 0 and prepared.engine.loss_scale() == 2.0**15


def offload_worker(env, mode):
    from ampddp.zoo.models import GPT

    runs = {}
    for offload in (False, True):
        torch.manual_seed(0)
        parallel = Parallel("fsdp2", fsdp=FSDPOptions(cpu_offload=offload))
        prepared = prepare(GPT(256, layers=2, width=64, heads=2, context=32), lambda p: torch.optim.AdamW(p, lr=1e-3), env,
                           precision=mode, parallel=parallel)  # fmt: skip
        generator = torch.Generator().manual_seed(env.rank)
        losses = []
        for _ in range(5):
            tokens = torch.randint(256, (4, 33), generator=generator).cuda()
            with prepared.engine.forward_context():
                loss = prepared.model(tokens[:, :-1], labels=tokens[:, 1:])["loss"]
            prepared.engine.backward(loss)
            prepared.engine.step(prepared.optimizer)
            prepared.engine.zero_grad(prepared.optimizer)
            losses.append(loss.item())
        runs[offload] = (losses, {p.to_local().device.type for p in prepared.module.parameters()})
        prepared.engine.teardown()
    return runs


@pytest.mark.timeout(300)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="FSDP2 over NCCL needs 2 GPUs (one process per GPU)")
@pytest.mark.parametrize("mode", ["O2", "O5", "native-fp16"])
def test_fsdp2_cpu_offload_keeps_the_shards_on_the_host_and_trains_as_without(mode):
    (on_device, devices), (offloaded, offloaded_devices) = launch_local(
        offload_worker, 2, (mode,), device="cuda", backend="cpu:gloo,cuda:nccl"
    )[0].values()
    assert devices == {"cuda"} and offloaded_devices == {"cpu"}
    assert all(torch.isfinite(torch.tensor(offloaded)))
    torch.testing.assert_close(torch.tensor(offloaded), torch.tensor(on_device), rtol=1e-2, atol=1e-2)
