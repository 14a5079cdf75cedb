"""apex.parallel on torch: DDP argument semantics, Reducer, SyncBatchNorm, process groups and LARC.

Distributed checks run in two gloo processes (one launch for DDP/Reducer, one for SyncBatchNorm and
its process groups); each worker returns plain data that the tests compare in the parent against
single-process references computed here.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from ampddp.apex.parallel import (
    LARC,
    DistributedDataParallel,
    Reducer,
    SyncBatchNorm,
    convert_syncbn_model,
    create_syncbn_process_group,
)
from ampddp.distributed import launch_local
from ampddp.errors import ConfigError

WORLD = 2
LAUNCH = {"device": "cpu", "timeout_s": 30, "job_timeout_s": 60}


# ---------------------------------------------------------------- DistributedDataParallel


def make_mlp(seed: int, dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3)).to(dtype)


def global_batch(dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(5)
    return torch.randn(8, 6, generator=generator).to(dtype), torch.randn(8, 3, generator=generator).to(dtype)


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((model(x).float() - y.float()) ** 2).mean()


# name: (apex arguments, dtype, expected factor on the global-batch mean gradient)
DDP_CONFIGS = {
    "default": ({}, torch.float32, 1.0),
    "delay_allreduce": ({"delay_allreduce": True}, torch.float32, 1.0),
    "predivide_2": ({"gradient_predivide_factor": 2.0}, torch.float32, 1.0),
    "sum": ({"gradient_average": False}, torch.float32, WORLD),
    "sum_predivide_4": ({"gradient_average": False, "gradient_predivide_factor": 4.0}, torch.float32, WORLD / 4),
    "small_buckets": ({"message_size": 40.0}, torch.float32, 1.0),
    "retain_buffers": ({"retain_allreduce_buffers": True, "message_size": 40}, torch.float32, 1.0),
    "delay_one_bucket": ({"delay_allreduce": True, "retain_allreduce_buffers": True, "message_size": 40}, torch.float32, 1.0),
    "split_factor_alias": ({"gradient_average": False, "gradient_average_split_factor": 4.0}, torch.float32, WORLD / 4),
    "fp16_fp32_reduce": ({"allreduce_always_fp32": True}, torch.float16, 1.0),
    "prof": ({"prof": True}, torch.float32, 1.0),
}


def _ddp_case(env, kwargs: dict, dtype: torch.dtype) -> dict:
    model = make_mlp(100 + env.rank, dtype)  # ranks start different: construction must broadcast rank 0's
    ddp = DistributedDataParallel(model, **kwargs)
    result = {"synced": all(torch.equal(a, b) for a, b in zip(model.parameters(), make_mlp(100, dtype).parameters()))}
    x, y = global_batch(dtype)
    shard = slice(4 * env.rank, 4 * env.rank + 4)
    buckets = []
    with torch.autograd.profiler.profile() as profile:
        for _ in range(2):  # the second backward runs on the buckets torch rebuilds after the first
            ddp.zero_grad(set_to_none=True)
            loss_of(ddp, x[shard], y[shard]).backward()
            buckets.append([b.numel() for b in ddp.allreduce_buffers])
    result["grads"] = [p.grad.clone() for p in model.parameters()]
    result["grad_dtypes"] = {str(p.grad.dtype) for p in model.parameters()}
    result["buckets"] = buckets
    result["ranges"] = sorted({e.name for e in profile.function_events if e.name.startswith("apex.parallel")})
    if kwargs.get("retain_allreduce_buffers"):
        storages = {b.untyped_storage().data_ptr() for b in ddp.allreduce_buffers}
        result["grads_are_buffer_views"] = all(p.grad.untyped_storage().data_ptr() in storages for p in model.parameters())
    return result


def _ddp_structure(env) -> dict:
    model = make_mlp(0)
    ddp = DistributedDataParallel(model, delay_allreduce=True)
    x, y = global_batch()
    shard = slice(4 * env.rank, 4 * env.rank + 4)
    ddp.disable_allreduce()
    loss_of(ddp, x[shard], y[shard]).backward()
    local = [p.grad.clone() for p in model.parameters()]
    ddp.enable_allreduce()
    return {
        "module_is_model": ddp.module is model,
        "is_torch_ddp": isinstance(ddp, nn.parallel.DistributedDataParallel),
        "keys": list(ddp.state_dict()),
        "world_size": ddp.world_size,
        "local_grads": local,
    }


def _overflow_case(env, always_fp32: bool) -> float:
    """Each rank's fp16 gradient is 40000; their sum (80000) overflows fp16 unless reduced in fp32."""
    model = nn.Linear(1, 1, bias=False).half()
    with torch.no_grad():
        model.weight.fill_(1.0)
    ddp = DistributedDataParallel(model, allreduce_always_fp32=always_fp32)
    ddp(torch.full((1, 1), 40000.0, dtype=torch.float16)).sum().backward()
    return model.weight.grad.float().item()


class PartlyUsed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used, self.unused = make_mlp(100), nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


def _unused_parameter_case(env) -> dict:
    """delay_allreduce with a parameter that gets no gradient: torch DDP's find_unused_parameters is forwarded."""
    model = PartlyUsed()
    ddp = DistributedDataParallel(model, delay_allreduce=True, find_unused_parameters=True)
    x, y = global_batch()
    shard = slice(4 * env.rank, 4 * env.rank + 4)
    for _ in range(2):
        ddp.zero_grad(set_to_none=True)
        loss_of(ddp, x[shard], y[shard]).backward()
    return {"unused_grads": [p.grad for p in model.unused.parameters()], "grads": [p.grad for p in model.used.parameters()]}


def _reducer_case(env) -> dict:
    model = make_mlp(100 + env.rank)
    reducer = Reducer(model)
    synced = all(torch.equal(a, b) for a, b in zip(model.parameters(), make_mlp(100).parameters()))
    x, y = global_batch()
    shard = slice(4 * env.rank, 4 * env.rank + 4)
    loss_of(model, x[shard], y[shard]).backward()
    reducer.reduce()
    tensors = [torch.full((2,), float(env.rank + 1)), [torch.full((3,), 10.0 * (env.rank + 1), dtype=torch.float64)]]
    Reducer(tensors).reduce()
    return {"synced": synced, "grads": [p.grad.clone() for p in model.parameters()], "tensors": [tensors[0], tensors[1][0]]}


def ddp_worker(env) -> dict:
    results = {name: _ddp_case(env, kwargs, dtype) for name, (kwargs, dtype, _) in DDP_CONFIGS.items()}
    results["structure"] = _ddp_structure(env)
    results["overflow"] = {flag: _overflow_case(env, flag) for flag in (True, False)}
    results["reducer"] = _reducer_case(env)
    results["unused"] = _unused_parameter_case(env)
    return results


@pytest.fixture(scope="module")
def ddp_results() -> list[dict]:
    return launch_local(ddp_worker, WORLD, **LAUNCH)


def reference_grads(dtype: torch.dtype) -> list[torch.Tensor]:
    model = make_mlp(100, dtype)
    loss_of(model, *global_batch(dtype)).backward()
    return [p.grad.float() for p in model.parameters()]


@pytest.mark.parametrize("name", list(DDP_CONFIGS))
def test_ddp_gradients_are_apex_scaled_global_batch_gradients(ddp_results, name):
    _, dtype, factor = DDP_CONFIGS[name]
    tolerance = 2e-2 if dtype == torch.float16 else 1e-5
    reference = reference_grads(dtype)
    for rank, results in enumerate(ddp_results):
        result = results[name]
        assert result["synced"], f"rank {rank} did not start from rank 0's weights"
        assert result["grad_dtypes"] == {str(dtype)}
        for grad, ref in zip(result["grads"], reference):
            torch.testing.assert_close(grad.float(), ref * factor, rtol=tolerance, atol=tolerance / 10)
    for a, b in zip(ddp_results[0][name]["grads"], ddp_results[1][name]["grads"]):
        assert torch.equal(a, b), "ranks must hold identical reduced gradients"


def test_ddp_message_size_makes_several_buckets_and_retained_buffers_hold_the_grads(ddp_results):
    result = ddp_results[0]["retain_buffers"]
    assert len(result["buckets"][1]) > 1, result["buckets"]
    assert sum(result["buckets"][1]) == sum(p.numel() for p in make_mlp(0).parameters())
    assert result["grads_are_buffer_views"]
    assert ddp_results[0]["default"]["buckets"] == [[], []], "allreduce_buffers is empty unless retained"
    total = sum(p.numel() for p in make_mlp(0).parameters())
    assert ddp_results[0]["delay_one_bucket"]["buckets"] == [[total], [total]], "delay_allreduce: one bucket, whatever message_size"


def test_ddp_prof_records_ranges_only_when_asked(ddp_results):
    assert ddp_results[0]["prof"]["ranges"] == [
        "apex.parallel.DistributedDataParallel.allreduce_bucket",
        "apex.parallel.DistributedDataParallel.forward",
    ]
    assert ddp_results[0]["default"]["ranges"] == []


def test_ddp_allreduce_always_fp32_reduces_fp16_grads_in_fp32(ddp_results):
    for results in ddp_results:
        assert results["overflow"][True] == 40000.0
        assert results["overflow"][False] == float("inf"), "control: an fp16 all-reduce of 2 x 40000 overflows"


def test_ddp_structure_module_state_dict_and_disable_allreduce(ddp_results):
    structure = ddp_results[0]["structure"]
    assert structure["module_is_model"] and structure["is_torch_ddp"]
    assert structure["keys"] == [f"module.{key}" for key in make_mlp(0).state_dict()]
    assert structure["world_size"] == 2.0
    x, y = global_batch()
    for rank, results in enumerate(ddp_results):
        model = make_mlp(0)
        loss_of(model, x[4 * rank : 4 * rank + 4], y[4 * rank : 4 * rank + 4]).backward()
        for grad, local in zip(results["structure"]["local_grads"], model.parameters()):
            torch.testing.assert_close(grad, local.grad)


def test_ddp_forwards_torch_options_for_unused_parameters(ddp_results):
    reference = reference_grads(torch.float32)
    for results in ddp_results:
        assert results["unused"]["unused_grads"] == [None, None]
        for grad, ref in zip(results["unused"]["grads"], reference):
            torch.testing.assert_close(grad, ref, rtol=1e-5, atol=1e-6)


def test_reducer_broadcasts_the_module_and_averages_on_reduce(ddp_results):
    reference = reference_grads(torch.float32)
    for results in ddp_results:
        reducer = results["reducer"]
        assert reducer["synced"]
        for grad, ref in zip(reducer["grads"], reference):
            torch.testing.assert_close(grad, ref, rtol=1e-5, atol=1e-6)
        assert reducer["tensors"][0].tolist() == [1.5, 1.5]
        assert reducer["tensors"][1].dtype == torch.float64 and reducer["tensors"][1].tolist() == [15.0] * 3


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"shared_param": True}, r"shared_param=True.*apex itself removed it.*delay_allreduce=True"),
        ({"allreduce_trigger_params": []}, r"allreduce_trigger_params.*buckets by size.*message_size"),
        ({"num_allreduce_streams": 2}, r"num_allreduce_streams=2.*one process group.*num_allreduce_streams=1"),
        ({"num_allreduce_streams": 0}, r"num_allreduce_streams=0 is not valid"),
        ({"allreduce_communicators": ([], [])}, r"allreduce_communicators.*single process group.*process_group="),
        ({"message_size": 0}, r"message_size=0 is not valid"),
        ({"gradient_predivide_factor": 0.0}, r"gradient_predivide_factor=0.0 is not valid"),
        ({"gradient_average_split_factor": 2.0, "gradient_predivide_factor": 4.0}, r"old name"),
        ({"bucket_cap_mb": 1}, r"pass message_size instead"),
    ],
)
def test_ddp_refused_arguments_say_why_and_what_to_pass(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        DistributedDataParallel(nn.Linear(2, 2), **kwargs)


def test_ddp_and_reducer_without_a_process_group_name_what_to_call():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match=r"init_process_group"):
        DistributedDataParallel(nn.Linear(2, 2))
    with pytest.raises(RuntimeError, match=r"init_process_group"):
        Reducer(nn.Linear(2, 2))


# ---------------------------------------------------------------- SyncBatchNorm

SIZES = (3, 5)  # different per-rank batch sizes


def make_bn(cls=nn.BatchNorm2d, channels: int = 3, **kwargs) -> nn.Module:
    torch.manual_seed(0)
    bn = cls(channels, **kwargs)
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-0.5, 0.5)
    return bn


# name: (SyncBatchNorm kwargs, input shape after N, reference class, channels-last layout, residual z)
BN_CASES = {
    "nchw": ({}, (3, 4, 4), nn.BatchNorm2d, False, False),
    "nhwc": ({"channel_last": True}, (4, 4, 3), nn.BatchNorm2d, True, False),
    "nhwc_relu_z": ({"channel_last": True, "fuse_relu": True}, (4, 4, 3), nn.BatchNorm2d, True, True),
    "nhwc_relu": ({"channel_last": True, "fuse_relu": True}, (4, 4, 3), nn.BatchNorm2d, True, False),
    "2d": ({}, (3,), nn.BatchNorm1d, False, False),
    "ncl_momentum_none": ({"momentum": None}, (3, 5), nn.BatchNorm1d, False, False),
}


def bn_inputs(shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(sum(SIZES), *shape, generator=generator) * 2 + 1
    return x, torch.randn(x.shape, generator=generator), torch.randn(x.shape, generator=generator)


def bn_reference(name: str) -> dict:
    kwargs, shape, cls, channel_last, with_z = BN_CASES[name]
    x, z, upstream = bn_inputs(shape)
    bn = make_bn(cls, momentum=kwargs.get("momentum", 0.1))
    x, z = x.clone().requires_grad_(), z.clone().requires_grad_()
    to_first = (lambda t: t.movedim(-1, 1)) if channel_last else (lambda t: t)
    to_last = (lambda t: t.movedim(1, -1)) if channel_last else (lambda t: t)
    out = to_last(bn(to_first(x)))
    out = out + z if with_z else out
    out = torch.relu(out) if kwargs.get("fuse_relu") else out
    (out * upstream).sum().backward()
    bn.eval()
    evaluated = to_last(bn(to_first(x.detach())))
    evaluated = torch.relu(evaluated) if kwargs.get("fuse_relu") else evaluated  # eval keeps the fused ReLU (no z here)
    return {"out": out.detach(), "x_grad": x.grad, "z_grad": z.grad, "weight_grad": bn.weight.grad, "bias_grad": bn.bias.grad,
            "running_mean": bn.running_mean, "running_var": bn.running_var, "eval": evaluated}  # fmt: skip


def _bn_case(env, name: str) -> dict:
    kwargs, shape, cls, _, with_z = BN_CASES[name]
    x, z, upstream = bn_inputs(shape)
    mine = slice(sum(SIZES[: env.rank]), sum(SIZES[: env.rank + 1]))
    reference = make_bn(cls, momentum=kwargs.get("momentum", 0.1))
    bn = SyncBatchNorm(3, **kwargs)
    bn.load_state_dict(reference.state_dict())
    local_x, local_z = x[mine].clone().requires_grad_(), z[mine].clone().requires_grad_()
    out = bn(local_x, local_z) if with_z else bn(local_x)
    (out * upstream[mine]).sum().backward()
    param_grads = torch.cat([bn.weight.grad, bn.bias.grad])
    dist.all_reduce(param_grads)
    bn.eval()
    for _ in range(1 + env.rank):  # ranks run different numbers of eval batches: must not communicate
        evaluated = bn(x[mine])
    return {"out": out.detach(), "x_grad": local_x.grad, "z_grad": local_z.grad if with_z else None,
            "weight_grad": param_grads[:3], "bias_grad": param_grads[3:], "running_mean": bn.running_mean,
            "running_var": bn.running_var, "eval": evaluated, "batches": int(bn.num_batches_tracked)}  # fmt: skip


def _group_case(env) -> dict:
    x, _, _ = bn_inputs((3, 4, 4))
    mine = x[sum(SIZES[: env.rank]) : sum(SIZES[: env.rank + 1])]
    outputs = {}
    for size in (1, 2, 0):
        group = create_syncbn_process_group(size)
        outputs[size] = (group is None, SyncBatchNorm(3, process_group=group)(mine).detach())
    try:
        create_syncbn_process_group(3)
        bad = ""
    except ConfigError as error:
        bad = str(error)
    return {"outputs": outputs, "bad": bad}


def sync_bn_worker(env) -> dict:
    results = {name: _bn_case(env, name) for name in BN_CASES}
    results["groups"] = _group_case(env)
    return results


@pytest.fixture(scope="module")
def bn_results() -> list[dict]:
    return launch_local(sync_bn_worker, WORLD, **LAUNCH)


@pytest.mark.parametrize("name", list(BN_CASES))
def test_sync_batchnorm_equals_batchnorm_over_the_concatenated_uneven_batch(bn_results, name):
    reference = bn_reference(name)
    for rank, results in enumerate(bn_results):
        result = results[name]
        mine = slice(sum(SIZES[:rank]), sum(SIZES[: rank + 1]))
        for key in ("out", "x_grad", "z_grad", "eval"):
            if result[key] is not None:
                torch.testing.assert_close(result[key], reference[key][mine], rtol=1e-4, atol=1e-5, msg=f"{key} on rank {rank}")
        for key in ("weight_grad", "bias_grad", "running_mean", "running_var"):
            torch.testing.assert_close(result[key], reference[key], rtol=1e-4, atol=1e-5, msg=f"{key} on rank {rank}")
        assert result["batches"] == 1


def test_syncbn_process_groups_of_one_two_and_the_world(bn_results):
    x, _, _ = bn_inputs((3, 4, 4))
    for rank, results in enumerate(bn_results):
        outputs = results["groups"]["outputs"]
        mine = slice(sum(SIZES[:rank]), sum(SIZES[: rank + 1]))
        local = nn.BatchNorm2d(3)(x[mine]).detach()
        torch.testing.assert_close(outputs[1][1], local, rtol=1e-4, atol=1e-5)  # a group of one: local statistics
        whole = nn.BatchNorm2d(3)(x).detach()[mine]
        torch.testing.assert_close(outputs[2][1], whole, rtol=1e-4, atol=1e-5)
        assert outputs[0][0], "group_size 0 means the whole world: None (the default group)"
        torch.testing.assert_close(outputs[0][1], whole, rtol=1e-4, atol=1e-5)
        assert "world size 2 is not divisible by 3" in results["groups"]["bad"]


def test_sync_batchnorm_refuses_what_apex_did_not_fuse():
    with pytest.raises(ConfigError, match=r"fuse_relu=True\) needs channel_last=True"):
        SyncBatchNorm(3, fuse_relu=True)
    with pytest.raises(ConfigError, match=r"z .* needs channel_last=True"):
        SyncBatchNorm(3)(torch.randn(4, 3, 2), torch.randn(4, 3, 2))
    with pytest.raises(ValueError, match=r"expected 3 channels in the last dimension"):
        SyncBatchNorm(3, channel_last=True)(torch.randn(4, 3, 2))
    with pytest.raises(ConfigError, match=r"group_size=-1 is not valid"):
        create_syncbn_process_group(-1)
    single = SyncBatchNorm(3, channel_last=True, fuse_relu=True)  # single process: plain BatchNorm + ReLU
    x = torch.randn(5, 2, 3)
    torch.testing.assert_close(single(x), torch.relu(nn.BatchNorm1d(3)(x.movedim(-1, 1)).movedim(1, -1)))


def test_convert_syncbn_model_keeps_parameters_stats_and_mode_and_skips_instance_norm():
    model = nn.Sequential(nn.Conv2d(3, 3, 1), nn.BatchNorm2d(3), nn.Sequential(nn.BatchNorm1d(2, affine=False)), nn.InstanceNorm2d(3))
    model[1].running_mean.fill_(0.25)
    model[1].num_batches_tracked.fill_(7)
    model[2][0].eval()
    weight, running_var = model[1].weight, model[1].running_var
    group = object()
    converted = convert_syncbn_model(model, process_group=group, channel_last=True)
    assert converted is model
    assert type(converted[1]) is SyncBatchNorm and type(converted[2][0]) is SyncBatchNorm
    assert type(converted[3]) is nn.InstanceNorm2d
    assert converted[1].weight is weight and converted[1].running_var is running_var
    assert converted[1].running_mean[0].item() == 0.25 and int(converted[1].num_batches_tracked) == 7
    assert converted[1].training and not converted[2][0].training
    assert converted[1].process_group is group and converted[1].channel_last
    assert converted[2][0].weight is None
    top = convert_syncbn_model(nn.BatchNorm1d(4, momentum=None, eps=1e-3))
    assert isinstance(top, SyncBatchNorm) and top.momentum is None and top.eps == 1e-3


# ---------------------------------------------------------------- LARC


def larc_reference_step(params, grads, lr, weight_decay, trust, clip, eps):
    """apex's rule written out: the step SGD(lr, no momentum) takes under LARC."""
    updated = []
    for p, g in zip(params, grads):
        p_norm, g_norm = p.norm(), g.norm()
        if p_norm != 0 and g_norm != 0:
            local_lr = trust * p_norm / (g_norm + p_norm * weight_decay + eps)
            effective = min(local_lr, lr) if clip else local_lr * lr
            updated.append(p - effective * (g + weight_decay * p))
        else:
            updated.append(p - lr * g)  # LARC zeroes the group's weight decay for the inner step
    return updated


def larc_setup(weight_decay: float, **larc_kwargs):
    torch.manual_seed(1)
    params = [nn.Parameter(torch.randn(4, 3)), nn.Parameter(torch.randn(5) * 0.01), nn.Parameter(torch.zeros(3))]
    for p, scale in zip(params, (0.001, 30.0, 1.0)):
        p.grad = torch.randn(p.shape) * scale
    inner = torch.optim.SGD(params, lr=0.5, weight_decay=weight_decay)
    return params, inner, LARC(inner, **larc_kwargs)


@pytest.mark.parametrize("clip", [True, False])
@pytest.mark.parametrize("weight_decay", [0.0, 1e-2])
def test_larc_step_follows_apex_rule(clip, weight_decay):
    params, inner, larc = larc_setup(weight_decay, trust_coefficient=0.02, clip=clip, eps=1e-8)
    before = [p.detach().clone() for p in params]
    grads = [p.grad.clone() for p in params]
    seen = []
    inner.register_step_pre_hook(lambda opt, args, kwargs: seen.append(opt.param_groups[0]["weight_decay"]))
    larc.step()
    expected = larc_reference_step(before, grads, 0.5, weight_decay, 0.02, clip, 1e-8)
    for p, ref in zip(params, expected):
        torch.testing.assert_close(p.detach(), ref, rtol=1e-6, atol=1e-7)
    assert seen == [0], "the inner optimizer steps with weight decay zeroed"
    assert inner.param_groups[0]["weight_decay"] == weight_decay, "and gets it back afterwards"


def test_larc_is_an_optimizer_whose_step_hooks_fire():
    _, inner, larc = larc_setup(0.0)
    assert isinstance(larc, torch.optim.Optimizer)
    calls = []
    larc.register_step_pre_hook(lambda opt, args, kwargs: calls.append(("pre", opt)))
    larc.register_step_post_hook(lambda opt, args, kwargs: calls.append(("post", opt)))
    larc.step()
    assert calls == [("pre", larc), ("post", larc)]
    scheduler = torch.optim.lr_scheduler.StepLR(larc, step_size=1, gamma=0.5)
    larc.step()
    scheduler.step()
    assert inner.param_groups[0]["lr"] == 0.25


def test_larc_shares_param_groups_and_state_with_the_inner_optimizer():
    params, inner, larc = larc_setup(0.0)
    assert larc.param_groups is inner.param_groups and larc.state is inner.state and larc.defaults is inner.defaults
    master = nn.Parameter(params[0].detach().clone())
    master.grad = params[0].grad.clone()
    larc.param_groups[0]["params"][0] = master  # the amp engine swaps fp32 masters in like this
    original = params[0].detach().clone()
    larc.step()
    assert not torch.equal(master.detach(), original) and torch.equal(params[0].detach(), original)
    extra = nn.Parameter(torch.ones(2))
    larc.add_param_group({"params": [extra], "lr": 0.1})
    assert inner.param_groups[-1]["params"] == [extra] and "momentum" in inner.param_groups[-1]
    larc.zero_grad()
    assert all(p.grad is None for p in inner.param_groups[0]["params"])
    assert repr(larc).startswith("LARC(trust_coefficient=0.02, clip=True, eps=1e-08,") and "SGD" in repr(larc)


def test_larc_state_dict_round_trip_and_closure():
    def build():
        torch.manual_seed(2)
        model = nn.Linear(3, 2)
        return model, LARC(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3))

    x = torch.randn(4, 3)
    model, larc = build()

    def closure() -> torch.Tensor:
        larc.zero_grad()
        loss = model(x).pow(2).sum()
        loss.backward()
        return loss

    losses = [larc.step(closure) for _ in range(2)]
    assert losses[1] < losses[0]
    saved = copy.deepcopy(larc.state_dict())
    clone, restored = build()
    clone.load_state_dict(model.state_dict())
    restored.load_state_dict(saved)
    assert restored.state_dict()["param_groups"] == saved["param_groups"]
    for a, b in zip(model.parameters(), clone.parameters()):
        torch.testing.assert_close(restored.state[b]["momentum_buffer"], larc.state[a]["momentum_buffer"])
    for m, opt in ((model, larc), (clone, restored)):
        opt.zero_grad()
        m(x).pow(2).sum().backward()
        opt.step()
    for a, b in zip(model.parameters(), clone.parameters()):
        torch.testing.assert_close(a, b)


def test_larc_deepcopies_with_its_settings_and_hooks_machinery():
    _, _, larc = larc_setup(1e-2, trust_coefficient=0.05, clip=False)
    twin = copy.deepcopy(larc)
    assert (twin.trust_coefficient, twin.clip, twin.eps) == (0.05, False, 1e-8)
    assert twin.param_groups is twin.optim.param_groups and twin.param_groups is not larc.param_groups
    fired = []
    twin.register_step_post_hook(lambda opt, args, kwargs: fired.append(opt))
    twin.step()
    assert fired == [twin]


def test_larc_refuses_what_it_cannot_wrap():
    with pytest.raises(ConfigError, match=r"wraps a torch.optim.Optimizer"):
        LARC(object())
    _, _, larc = larc_setup(0.0)
    with pytest.raises(ConfigError, match=r"twice"):
        LARC(larc)
    with pytest.raises(ConfigError, match=r"trust_coefficient=0 is not valid"):
        LARC(torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=0.1), trust_coefficient=0)


def test_apex_parallel_names_resolve_and_unknown_ones_explain():
    import ampddp.apex.parallel as parallel
    from ampddp.apex.parallel.distributed import DistributedDataParallel as FromSubmodule
    from ampddp.apex.parallel.LARC import LARC as FromLarcModule
    from ampddp.apex.parallel.optimized_sync_batchnorm import SyncBatchNorm as Optimized
    from ampddp.apex.parallel.sync_batchnorm import SyncBatchNorm as Fallback

    assert FromSubmodule is DistributedDataParallel and FromLarcModule is LARC and parallel.LARC is LARC
    assert Optimized is Fallback is SyncBatchNorm
    assert parallel.ReduceOp is dist.ReduceOp
    with pytest.raises(ImportError, match=r"apex.parallel.multiproc is not provided.*torchrun"):
        from ampddp.apex.parallel import multiproc  # noqa: F401
    with pytest.raises(AttributeError, match=r"provides: .*convert_syncbn_model"):
        parallel.not_a_name  # noqa: B018


def _cuda_sync_bn_case(env) -> dict:
    sizes = (3, 5)
    x = torch.randn(sum(sizes), 3, 4, 4, generator=torch.Generator().manual_seed(11)) * 2 + 1
    mine = slice(sum(sizes[: env.rank]), sum(sizes[: env.rank + 1]))
    layer = SyncBatchNorm(3).cuda()
    local = x[mine].cuda().requires_grad_()
    out = layer(local)
    out.sum().backward()
    return {"out": out.detach().cpu(), "running_mean": layer.running_mean.cpu(), "slice": (mine.start, mine.stop)}


@pytest.mark.cuda
@pytest.mark.timeout(200)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_sync_batchnorm_on_cuda_uses_torch_kernels_with_the_same_numerics():
    """Both ranks on one GPU over gloo (CUDA tensors), so a single-GPU machine runs it too."""
    results = launch_local(_cuda_sync_bn_case, WORLD, device="cpu", backend="gloo", timeout_s=60, job_timeout_s=150)
    x = torch.randn(8, 3, 4, 4, generator=torch.Generator().manual_seed(11)) * 2 + 1
    reference = nn.BatchNorm2d(3)
    expected = reference(x).detach()
    for result in results:
        start, stop = result["slice"]
        torch.testing.assert_close(result["out"], expected[start:stop], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(result["running_mean"], reference.running_mean, rtol=1e-4, atol=1e-5)
