"""Portable SyncBN over two gloo processes equals BatchNorm over the concatenated global batch."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from ampddp import ConfigError, Parallel, Precision
from ampddp.distributed import PortableSyncBatchNorm, convert_sync_batchnorm, launch_local

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
TOLERANCE = {"float32": 1e-5, "float16": 1e-3, "bfloat16": 1e-2}


def global_inputs(sizes, dtype):
    generator = torch.Generator().manual_seed(3)
    x = (torch.randn(sum(sizes), 3, 4, 4, generator=generator) * 2 + 1).to(dtype)
    upstream = torch.randn(sum(sizes), 3, 4, 4, generator=generator)
    return x, upstream


def make_bn():
    torch.manual_seed(0)
    bn = nn.BatchNorm2d(3)
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-0.5, 0.5)
    return bn


def sync_bn_worker(env, sizes, dtype_name):
    dtype = DTYPES[dtype_name]
    x, upstream = global_inputs(sizes, dtype)
    start = sum(sizes[: env.rank])
    mine = slice(start, start + sizes[env.rank])
    reference = make_bn()
    ref_input = x.clone().requires_grad_()
    ref_out = reference(ref_input)
    (ref_out.float() * upstream).sum().backward()

    model = convert_sync_batchnorm(make_bn(), impl="portable")
    local_input = x[mine].clone().requires_grad_()
    out = model(local_input)
    (out.float() * upstream[mine]).sum().backward()
    grads = torch.cat([model.weight.grad, model.bias.grad])
    dist.all_reduce(grads)
    model.eval()
    eval_out = model(x[mine])
    reference.eval()
    return {
        "out": (out.float() - ref_out[mine].float()).abs().max().item(),
        "out_dtype": str(out.dtype),
        "input_grad": (local_input.grad.float() - ref_input.grad[mine].float()).abs().max().item(),
        "param_grads": (grads - torch.cat([reference.weight.grad, reference.bias.grad])).abs().max().item(),
        "running_mean": (model.running_mean - reference.running_mean).abs().max().item(),
        "running_var": (model.running_var - reference.running_var).abs().max().item(),
        "eval": (eval_out.float() - reference(x[mine]).float()).abs().max().item(),
        "batches": int(model.num_batches_tracked),
    }


@pytest.mark.parametrize("sizes", [(4, 4), (3, 5), (1, 6)])
@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_portable_sync_bn_equals_batchnorm_on_the_global_batch(sizes, dtype_name):
    results = launch_local(sync_bn_worker, 2, (sizes, dtype_name), device="cpu", timeout_s=60)
    tolerance = TOLERANCE[dtype_name]
    for result in results:
        assert result["out_dtype"] == str(DTYPES[dtype_name])
        for key in ("out", "input_grad", "eval"):
            assert result[key] <= tolerance, (key, result)
        for key in ("param_grads", "running_mean", "running_var"):
            assert result[key] <= 1e-5, (key, result)
        assert result["batches"] == 1


def ddp_sync_bn_worker(env):
    from ampddp.prepare import prepare

    model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(64, 2))
    prepared = prepare(
        model,
        lambda p: torch.optim.SGD(p, lr=0.1),
        env,
        precision=Precision("O2", overrides={"verbosity": 0}),
        parallel=Parallel(sync_bn="auto"),
    )
    x = torch.randn(4, 3, 4, 4)
    with prepared.engine.forward_context():
        loss = prepared.model(x).sum()
    prepared.engine.backward(loss)
    prepared.engine.step(prepared.optimizer)
    bn = prepared.module[1]
    return type(bn).__name__, str(bn.weight.dtype), str(prepared.module[0].weight.dtype), type(prepared.model).__name__


def test_ddp_wraps_a_portable_sync_bn_model_on_cpu_under_o2():
    results = launch_local(ddp_sync_bn_worker, 2, device="cpu", timeout_s=60)
    assert results[0] == ("PortableSyncBatchNorm", "torch.float32", "torch.float16", "DistributedDataParallel")


def test_conversion_keeps_params_and_stats_and_skips_instance_norm():
    model = nn.Sequential(nn.BatchNorm1d(3), nn.Sequential(nn.BatchNorm2d(2, affine=False)), nn.InstanceNorm2d(2))
    model[0].running_mean.fill_(0.5)
    weight = model[0].weight
    converted = convert_sync_batchnorm(model, impl="portable")
    assert isinstance(converted[0], PortableSyncBatchNorm) and isinstance(converted[1][0], PortableSyncBatchNorm)
    assert isinstance(converted[2], nn.InstanceNorm2d)
    assert converted[0].weight is weight and converted[0].running_mean[0].item() == 0.5
    single = convert_sync_batchnorm(nn.BatchNorm1d(3), impl="portable")
    x = torch.randn(5, 3)
    torch.testing.assert_close(single(x), nn.BatchNorm1d(3)(x))


def test_sync_bn_impl_errors():
    with pytest.raises(ConfigError, match="valid choices: auto, torch, apex, portable"):
        convert_sync_batchnorm(nn.BatchNorm1d(2), impl="fast")
    from ampddp.apex.parallel import SyncBatchNorm as ApexSyncBatchNorm

    assert isinstance(convert_sync_batchnorm(nn.BatchNorm1d(2), impl="apex"), ApexSyncBatchNorm)  # no NVIDIA apex here
    assert isinstance(convert_sync_batchnorm(nn.BatchNorm1d(2), impl="auto"), PortableSyncBatchNorm)


def float64_and_eval_worker(env):
    x, upstream = global_inputs((3, 5), torch.float64)
    start = 0 if env.rank == 0 else 3
    mine = slice(start, start + (3 if env.rank == 0 else 5))
    reference = make_bn().double()
    ref_input = x.clone().requires_grad_()
    (reference(ref_input) * upstream).sum().backward()
    model = convert_sync_batchnorm(make_bn().double(), impl="portable")
    local = x[mine].clone().requires_grad_()
    out = model(local)
    (out * upstream[mine]).sum().backward()
    errors = [(out - reference(x)[mine]).abs().max().item(), (local.grad - ref_input.grad[mine]).abs().max().item()]
    stateless = convert_sync_batchnorm(nn.BatchNorm2d(3, track_running_stats=False), impl="portable").eval()
    for _ in range(1 + env.rank):  # ranks run different numbers of eval batches: must not hang
        local_eval = stateless(x[mine].float())
    plain = nn.BatchNorm2d(3, track_running_stats=False).eval()(x[mine].float())
    return max(errors), (local_eval - plain).abs().max().item()


def test_float64_stays_float64_and_eval_never_synchronises():
    for exactness, eval_difference in launch_local(float64_and_eval_worker, 2, device="cpu", timeout_s=30):
        assert exactness < 1e-12
        assert eval_difference < 1e-6
