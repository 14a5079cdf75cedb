"""ampddp.apex.optimizers: apex's fused optimizers against plain reference loops of apex's kernel math.

Each reference below is a per-tensor float64 loop of the rule in apex's CUDA kernel
(csrc/multi_tensor_{sgd,adam,lamb,novograd,adagrad}.cu); the optimizers must follow it over several
steps in every mode, match torch's own optimizers where the rule is torch's, resume exactly from a
state dict, and refuse bad or unsupported arguments with messages that name them.
"""

from __future__ import annotations

import copy
import inspect
import math

import pytest
import torch
import torch.nn.functional as F
from helpers import make_batches, make_mlp
from torch.optim.optimizer import required

from ampddp.apex import optimizers as apex_optimizers
from ampddp.apex.optimizers import FusedAdagrad, FusedAdam, FusedLAMB, FusedNovoGrad, FusedSGD, RefusedOptionError
from ampddp.errors import ConfigError

SHAPES = [(6, 5), (7,), (3, 2, 2), (4,)]
STEPS = 4
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def initial_values(zero_index: int | None = None) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    values = [torch.randn(shape, generator=generator, dtype=torch.float64) * 0.5 for shape in SHAPES]
    if zero_index is not None:
        values[zero_index].zero_()  # ||p|| = 0: LAMB's trust ratio falls back to 1
    return values


def grad_sequence(steps: int = STEPS, scale: float = 1.0) -> list[list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [[torch.randn(shape, generator=generator, dtype=torch.float64) * scale for shape in SHAPES] for _ in range(steps)]


def run(cls, kwargs, values, grads_seq, dtype=torch.float32, device="cpu"):
    params = [torch.nn.Parameter(v.to(device=device, dtype=dtype)) for v in values]
    optimizer = cls(params, **kwargs)
    for grads in grads_seq:
        for p, g in zip(params, grads):
            p.grad = g.to(device=device, dtype=dtype)
        optimizer.step()
    return params, optimizer


def close(ours, reference, rtol=1e-5, atol=1e-6):
    for a, b in zip(ours, reference):
        torch.testing.assert_close(a.detach().double().cpu(), b, rtol=rtol, atol=atol)


# ---------------------------------------------------------------------------------------------
# Reference rules (float64, one tensor at a time). ``round_to``: round the param into that dtype
# after every step, as apex's kernels do for fp16 params.


def ref_sgd(ps, grads_seq, lr, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False, wd_after_momentum=False, round_to=None):
    ps, buffers = [p.clone() for p in ps], [None] * len(ps)
    for grads in grads_seq:
        for i, g in enumerate(grads):
            p = ps[i]
            if weight_decay and not wd_after_momentum:
                g = g + weight_decay * p
            if momentum:
                buffers[i] = g.clone() if buffers[i] is None else buffers[i] * momentum + (1 - dampening) * g
                g = g + momentum * buffers[i] if nesterov else buffers[i]
            if weight_decay and wd_after_momentum:
                g = g + weight_decay * p
            ps[i] = _round(p - lr * g, round_to)
    return ps


def _round(p, dtype):
    return p if dtype is None else p.to(dtype).double()


def ref_adam(ps, grads_seq, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, adam_w_mode=True, bias_correction=True,
             round_to=None):  # fmt: skip
    (b1, b2), ps = betas, [p.clone() for p in ps]
    m, v = [torch.zeros_like(p) for p in ps], [torch.zeros_like(p) for p in ps]
    for t, grads in enumerate(grads_seq, start=1):
        bc1, bc2 = (1 - b1**t, 1 - b2**t) if bias_correction else (1.0, 1.0)
        for i, g in enumerate(grads):
            p = ps[i]
            if weight_decay and not adam_w_mode:
                g = g + weight_decay * p
            m[i] = b1 * m[i] + (1 - b1) * g
            v[i] = b2 * v[i] + (1 - b2) * g * g
            update = (m[i] / bc1) / ((v[i] / bc2).sqrt() + eps)
            if weight_decay and adam_w_mode:
                update = update + weight_decay * p
            ps[i] = _round(p - lr * update, round_to)
    return ps


def ref_lamb(ps, grads_seq, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01, adam_w_mode=True, grad_averaging=True,
             max_grad_norm=1.0, use_nvlamb=False, bias_correction=True, round_to=None):  # fmt: skip
    (b1, b2), ps = betas, [p.clone() for p in ps]
    m, v = [torch.zeros_like(p) for p in ps], [torch.zeros_like(p) for p in ps]
    beta3 = 1 - b1 if grad_averaging else 1.0
    for t, grads in enumerate(grads_seq, start=1):
        bc1, bc2 = (1 - b1**t, 1 - b2**t) if bias_correction else (1.0, 1.0)
        global_norm = math.sqrt(sum(float(g.pow(2).sum()) for g in grads))
        clip = global_norm / max_grad_norm if global_norm > max_grad_norm else 1.0
        for i, g in enumerate(grads):
            p, g = ps[i], g / clip
            if weight_decay and not adam_w_mode:
                g = g + weight_decay * p
            m[i] = b1 * m[i] + beta3 * g
            v[i] = b2 * v[i] + (1 - b2) * g * g
            update = (m[i] / bc1) / ((v[i] / bc2).sqrt() + eps)
            if weight_decay and adam_w_mode:
                update = update + weight_decay * p
            ratio = 1.0
            if weight_decay or use_nvlamb:
                p_norm, u_norm = float(p.norm()), float(update.norm())
                if p_norm != 0 and u_norm != 0:
                    ratio = p_norm / u_norm
            ps[i] = _round(p - lr * ratio * update, round_to)
    return ps


def ref_novograd(ps, grads_seq, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, reg_inside_moment=False,
                 grad_averaging=True, norm_type=2, init_zero=False, bias_correction=True, round_to=None):  # fmt: skip
    (b1, b2), ps = betas, [p.clone() for p in ps]
    m, v = [torch.zeros_like(p) for p in ps], [None] * len(ps)
    beta3 = 1 - b1 if grad_averaging else 1.0
    for t, grads in enumerate(grads_seq, start=1):
        bc1, bc2 = (1 - b1**t, math.sqrt(1 - b2**t)) if bias_correction else (1.0, 1.0)
        for i, g in enumerate(grads):
            p = ps[i]
            norm = float(g.norm()) if norm_type == 2 else float(g.abs().max())
            if v[i] is None:
                v[i] = 0.0 if init_zero else norm
            v[i] = math.sqrt(b2 * v[i] ** 2 + (1 - b2) * norm**2) if norm_type == 2 else b2 * v[i] + (1 - b2) * norm
            denom = v[i] / bc2 + eps
            if reg_inside_moment:
                m[i] = b1 * m[i] + beta3 * (g / denom + weight_decay * p)
                ps[i] = _round(p - lr * m[i] / bc1, round_to)
            else:
                m[i] = b1 * m[i] + beta3 * g
                ps[i] = _round(p - lr * ((m[i] / bc1) / denom + weight_decay * p), round_to)
    return ps


def ref_adagrad(ps, grads_seq, lr=1e-2, eps=1e-10, weight_decay=0.0, adagrad_w_mode=False, round_to=None):
    ps = [p.clone() for p in ps]
    sums = [torch.zeros_like(p) for p in ps]
    for grads in grads_seq:
        for i, g in enumerate(grads):
            p = ps[i]
            if weight_decay and not adagrad_w_mode:
                g = g + weight_decay * p
            sums[i] = sums[i] + g * g
            update = g / (sums[i].sqrt() + eps)
            if weight_decay and adagrad_w_mode:
                update = update + weight_decay * p
            ps[i] = _round(p - lr * update, round_to)
    return ps


# ---------------------------------------------------------------------------------------------
# Update rules, fp32, every mode


@pytest.mark.parametrize("weight_decay", [0.0, 0.05])
@pytest.mark.parametrize(
    "mode",
    [
        {"momentum": 0.0},
        {"momentum": 0.9},
        {"momentum": 0.9, "dampening": 0.3},
        {"momentum": 0.9, "nesterov": True},
        {"momentum": 0.9, "wd_after_momentum": True},
        {"momentum": 0.9, "nesterov": True, "wd_after_momentum": True},
        {"momentum": 0.0, "wd_after_momentum": True},
    ],
)
def test_fused_sgd_follows_apex_kernel(mode, weight_decay):
    values, grads = initial_values(), grad_sequence()
    ours, _ = run(FusedSGD, {"lr": 0.1, "weight_decay": weight_decay, **mode}, values, grads)
    close(ours, ref_sgd(values, grads, 0.1, weight_decay=weight_decay, **mode))


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("adam_w_mode", [True, False])
@pytest.mark.parametrize("bias_correction", [True, False])
def test_fused_adam_follows_apex_kernel(adam_w_mode, bias_correction, weight_decay):
    values, grads = initial_values(), grad_sequence()
    kwargs = {"lr": 1e-2, "betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": weight_decay, "adam_w_mode": adam_w_mode,
              "bias_correction": bias_correction}  # fmt: skip
    ours, _ = run(FusedAdam, kwargs, values, grads)
    close(ours, ref_adam(values, grads, **kwargs))


@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
@pytest.mark.parametrize(
    "mode",
    [
        {},
        {"adam_w_mode": False},
        {"bias_correction": False},
        {"grad_averaging": False},
        {"use_nvlamb": True},
        {"max_grad_norm": 0.5},  # the grads' global norm is ~5: clipping active
        {"max_grad_norm": 1e3},  # inactive
        {"max_grad_norm": math.inf},
        {"adam_w_mode": False, "use_nvlamb": True, "max_grad_norm": 0.5},
    ],
)
def test_fused_lamb_follows_apex_kernel(mode, weight_decay):
    values, grads = initial_values(zero_index=1), grad_sequence()
    kwargs = {"lr": 1e-2, "betas": (0.8, 0.99), "weight_decay": weight_decay, **mode}
    ours, _ = run(FusedLAMB, kwargs, values, grads)
    close(ours, ref_lamb(values, grads, **kwargs))


def test_fused_lamb_trust_ratio_is_one_for_a_zero_norm_param_and_clipping_scales_grads():
    values, grads = initial_values(zero_index=1), grad_sequence(steps=1)
    ours, _ = run(FusedLAMB, {"lr": 0.1, "weight_decay": 0.01}, values, grads)
    assert ours[1].abs().max() > 0.01  # ratio 1 (lr * update), not ||p|| / ||u|| = 0
    # with clipping, only the grads' scale changes, so the first Adam step (m/sqrt(v)) is scale-free
    # except through eps: a tiny eps makes clipped and unclipped first steps agree.
    clipped, _ = run(FusedLAMB, {"lr": 0.1, "weight_decay": 0.0, "eps": 1e-12, "max_grad_norm": 0.01}, values, grads)
    free, _ = run(FusedLAMB, {"lr": 0.1, "weight_decay": 0.0, "eps": 1e-12, "max_grad_norm": math.inf}, values, grads)
    close(clipped, [p.detach().double() for p in free], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("weight_decay", [0.0, 0.02])
@pytest.mark.parametrize(
    "mode",
    [
        {},
        {"reg_inside_moment": True},
        {"init_zero": True},
        {"norm_type": 0},
        {"norm_type": 0, "init_zero": True, "reg_inside_moment": True},
        {"grad_averaging": False},
        {"bias_correction": False},
    ],
)
def test_fused_novograd_follows_apex_kernel(mode, weight_decay):
    values, grads = initial_values(), grad_sequence()
    kwargs = {"lr": 1e-2, "betas": (0.9, 0.98), "weight_decay": weight_decay, **mode}
    ours, optimizer = run(FusedNovoGrad, kwargs, values, grads)
    close(ours, ref_novograd(values, grads, **kwargs))
    assert all(optimizer.state[p]["exp_avg_sq"].shape == () for p in ours)  # one norm per tensor


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("adagrad_w_mode", [False, True])
def test_fused_adagrad_follows_apex_kernel(adagrad_w_mode, weight_decay):
    values, grads = initial_values(), grad_sequence()
    kwargs = {"lr": 0.05, "weight_decay": weight_decay, "adagrad_w_mode": adagrad_w_mode}
    ours, _ = run(FusedAdagrad, kwargs, values, grads)
    close(ours, ref_adagrad(values, grads, **kwargs))


# ---------------------------------------------------------------------------------------------
# The same data through torch's own optimizers


@pytest.mark.parametrize(
    ("ours_cls", "ours_kwargs", "torch_cls", "torch_kwargs"),
    [
        (FusedSGD, {"lr": 0.1}, torch.optim.SGD, {"lr": 0.1}),
        (FusedSGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}, torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}),
        (FusedSGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True}, torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True}),
        (FusedSGD, {"lr": 0.1, "momentum": 0.8, "dampening": 0.2}, torch.optim.SGD, {"lr": 0.1, "momentum": 0.8, "dampening": 0.2}),
        (FusedAdam, {"lr": 1e-2, "weight_decay": 0.1}, torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
        (FusedAdam, {"lr": 1e-2}, torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.0}),
        (FusedAdam, {"lr": 1e-2, "weight_decay": 0.1, "adam_w_mode": False}, torch.optim.Adam, {"lr": 1e-2, "weight_decay": 0.1}),
        (FusedAdagrad, {"lr": 0.05, "weight_decay": 0.1}, torch.optim.Adagrad, {"lr": 0.05, "weight_decay": 0.1}),
    ],
)
def test_matches_torch_optimizer_on_the_same_data(ours_cls, ours_kwargs, torch_cls, torch_kwargs):
    values, grads = initial_values(), grad_sequence(steps=5)
    ours, _ = run(ours_cls, ours_kwargs, values, grads)
    theirs, _ = run(torch_cls, {**torch_kwargs, "foreach": True}, values, grads)
    for a, b in zip(ours, theirs):
        assert (a - b).abs().max() <= 1e-6


def test_fused_adam_and_sgd_train_a_model_like_torch():
    batches = make_batches(4)
    for ours_cls, torch_cls, kwargs in [(FusedAdam, torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.01}),
                                         (FusedSGD, torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})]:  # fmt: skip
        models = [make_mlp(), make_mlp()]
        optimizers = [ours_cls(models[0].parameters(), **kwargs), torch_cls(models[1].parameters(), foreach=True, **kwargs)]
        for x, y in batches:
            for model, optimizer in zip(models, optimizers):
                optimizer.zero_grad()
                F.cross_entropy(model(x), y).backward()
                optimizer.step()
        for a, b in zip(models[0].parameters(), models[1].parameters()):
            assert (a - b).abs().max() <= 1e-6


# ---------------------------------------------------------------------------------------------
# Low precision


FP16_CASES = [
    (FusedSGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}, ref_sgd),
    (FusedAdam, {"lr": 1e-2, "weight_decay": 0.1}, ref_adam),
    (FusedAdam, {"lr": 1e-2, "weight_decay": 0.1, "adam_w_mode": False, "bias_correction": False}, ref_adam),
    (FusedLAMB, {"lr": 1e-2, "max_grad_norm": 0.5}, ref_lamb),
    (FusedNovoGrad, {"lr": 1e-2, "weight_decay": 0.01}, ref_novograd),
    (FusedAdagrad, {"lr": 0.05}, ref_adagrad),
]


@pytest.mark.parametrize(("cls", "kwargs", "reference"), FP16_CASES, ids=lambda c: getattr(c, "__name__", ""))
def test_fp16_params_update_in_fp32_and_round_back_like_apex(cls, kwargs, reference):
    values = [v.half().double() for v in initial_values()]
    grads = [[g.half().double() for g in step] for step in grad_sequence()]
    ours, optimizer = run(cls, kwargs, values, grads, dtype=torch.float16)
    assert all(p.dtype == torch.float16 for p in ours)
    states = [t for p in ours for t in optimizer.state[p].values() if isinstance(t, torch.Tensor) and t.is_floating_point()]
    assert states and all(t.dtype == torch.float32 for t in states)
    close(ours, reference(values, grads, round_to=torch.float16, **kwargs), rtol=0, atol=3e-3)


def test_fused_adam_master_weights_keep_an_fp32_copy_of_fp16_params():
    values = [v.half().double() for v in initial_values()]
    grads = [[g.half().double() for g in step] for step in grad_sequence()]
    kwargs = {"lr": 1e-3, "weight_decay": 0.1}
    ours, optimizer = run(FusedAdam, {**kwargs, "master_weights": True}, values, grads, dtype=torch.float16)
    masters = [optimizer.state[p]["master_param"] for p in ours]
    assert all(m.dtype == torch.float32 for m in masters)
    close(masters, ref_adam(values, grads, **kwargs))  # unrounded: lr=1e-3 steps are below fp16's resolution near 1
    for p, master in zip(ours, masters):
        assert torch.equal(p, master.half())


@pytest.mark.parametrize("cls", [FusedSGD, FusedAdam, FusedLAMB, FusedNovoGrad, FusedAdagrad])
def test_bf16_params_step(cls):
    values, grads = initial_values(), grad_sequence()
    ours, optimizer = run(cls, {"lr": 0.05}, values, grads, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 and torch.isfinite(p).all() for p in ours)
    assert any(not torch.equal(p.double(), v.bfloat16().double()) for p, v in zip(ours, values))
    assert all(t.dtype == torch.float32 for p in ours for t in optimizer.state[p].values() if t.is_floating_point())


def test_fp16_param_state_stays_fp32_through_load_state_dict():
    values, grads = initial_values(), grad_sequence()
    ours, optimizer = run(FusedLAMB, {"lr": 1e-2}, values, grads, dtype=torch.float16)
    saved = copy.deepcopy(optimizer.state_dict())
    fresh = FusedLAMB(ours, lr=1e-2)
    fresh.load_state_dict(saved)
    for p in ours:
        assert fresh.state[p]["exp_avg_sq"].dtype == torch.float32
        assert torch.equal(fresh.state[p]["exp_avg_sq"], optimizer.state[p]["exp_avg_sq"])  # no fp16 round trip


# ---------------------------------------------------------------------------------------------
# State dicts


ROUND_TRIP = [
    (FusedSGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True}),
    (FusedSGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01, "wd_after_momentum": True}),
    (FusedAdam, {"lr": 1e-2, "weight_decay": 0.1}),
    (FusedAdam, {"lr": 1e-2, "bias_correction": False, "master_weights": True}),
    (FusedLAMB, {"lr": 1e-2, "max_grad_norm": 0.5}),
    (FusedNovoGrad, {"lr": 1e-2, "init_zero": True}),
    (FusedAdagrad, {"lr": 0.05, "adagrad_w_mode": True, "weight_decay": 0.1}),
]


def mixed_params(values):
    return [torch.nn.Parameter(v.to(torch.float16 if i % 2 else torch.float32)) for i, v in enumerate(values)]


def step_all(optimizer, params, grads_seq):
    for grads in grads_seq:
        for p, g in zip(params, grads):
            p.grad = g.to(p.dtype)
        optimizer.step()


@pytest.mark.parametrize(("cls", "kwargs"), ROUND_TRIP, ids=lambda c: getattr(c, "__name__", ""))
def test_state_dict_round_trip_resumes_identically(cls, kwargs):
    grads = grad_sequence(steps=6)
    params = mixed_params(initial_values())
    optimizer = cls(params, **kwargs)
    step_all(optimizer, params, grads[:3])
    saved, saved_params = copy.deepcopy(optimizer.state_dict()), [p.detach().clone() for p in params]
    step_all(optimizer, params, grads[3:])

    resumed = [torch.nn.Parameter(p) for p in saved_params]
    other = cls(resumed, **kwargs)
    other.load_state_dict(saved)
    step_all(other, resumed, grads[3:])
    for a, b in zip(params, resumed):
        assert torch.equal(a, b)
    for a, b in zip(params, resumed):
        for key, value in optimizer.state[a].items():
            assert torch.equal(value, other.state[b][key]), key


@pytest.mark.parametrize(("cls", "kwargs"), ROUND_TRIP, ids=lambda c: getattr(c, "__name__", ""))
def test_deepcopy_keeps_the_constructor_settings(cls, kwargs):
    params = mixed_params(initial_values())
    optimizer = cls(params, **kwargs)
    step_all(optimizer, params, grad_sequence(steps=2))
    twin_params, twin = copy.deepcopy((params, optimizer))
    for name in cls._settings:
        assert getattr(twin, name) == getattr(optimizer, name), name
    step_all(optimizer, params, grad_sequence(steps=2))
    step_all(twin, twin_params, grad_sequence(steps=2))
    for a, b in zip(params, twin_params):
        assert torch.equal(a, b)


def test_fused_adam_loads_apex_layout_with_a_per_group_step():
    grads = grad_sequence(steps=4)
    params = mixed_params(initial_values())
    optimizer = FusedAdam(params, lr=1e-2)
    step_all(optimizer, params, grads[:2])
    saved = copy.deepcopy(optimizer.state_dict())
    for state in saved["state"].values():
        del state["step"]
    saved["param_groups"][0]["step"] = 2  # how apex's FusedAdam counted
    resumed = [torch.nn.Parameter(p.detach().clone()) for p in params]
    other = FusedAdam(resumed, lr=1e-2)
    other.load_state_dict(saved)
    step_all(optimizer, params, grads[2:])
    step_all(other, resumed, grads[2:])
    for a, b in zip(params, resumed):
        assert torch.equal(a, b)
    assert "step" not in other.param_groups[0]


def test_fused_novograd_loads_apex_layout_with_per_group_norms():
    grads = grad_sequence(steps=4)
    params = mixed_params(initial_values())
    optimizer = FusedNovoGrad(params, lr=1e-2)
    step_all(optimizer, params, grads[:2])
    saved = copy.deepcopy(optimizer.state_dict())
    norms = {dtype: [saved["state"][i].pop("exp_avg_sq") for i, p in enumerate(params) if p.dtype == dtype]
             for dtype in (torch.float16, torch.float32)}  # fmt: skip
    saved["param_groups"][0]["exp_avg_sq"] = [torch.stack(norms[torch.float16]), torch.stack(norms[torch.float32])]
    resumed = [torch.nn.Parameter(p.detach().clone()) for p in params]
    other = FusedNovoGrad(resumed, lr=1e-2)
    other.load_state_dict(saved)
    step_all(optimizer, params, grads[2:])
    step_all(other, resumed, grads[2:])
    for a, b in zip(params, resumed):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------------------------------
# torch.optim.Optimizer behaviour


def test_zero_grad_follows_set_grad_none():
    params = [torch.nn.Parameter(torch.ones(3))]
    cases = [(FusedAdam(params), True), (FusedSGD(params, lr=0.1), False), (FusedSGD(params, lr=0.1, set_grad_none=True), True),
             (FusedLAMB(params, set_grad_none=False), False)]  # fmt: skip
    for optimizer, expect_none in cases:
        params[0].grad = torch.ones(3)
        optimizer.zero_grad()
        assert (params[0].grad is None) == expect_none
        if not expect_none:
            assert torch.equal(params[0].grad, torch.zeros(3))
    params[0].grad = torch.ones(3)
    FusedSGD(params, lr=0.1).zero_grad(set_to_none=True)
    assert params[0].grad is None


@pytest.mark.parametrize("cls", [FusedSGD, FusedAdam, FusedLAMB, FusedNovoGrad, FusedAdagrad])
def test_hooks_param_groups_schedulers_and_closures_work(cls):
    first, second = torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(2))
    optimizer = cls([first], lr=0.1)
    assert isinstance(optimizer, torch.optim.Optimizer)
    calls = []
    optimizer.register_step_pre_hook(lambda *_: calls.append("pre"))
    optimizer.register_step_post_hook(lambda *_: calls.append("post"))
    optimizer.add_param_group({"params": [second], "lr": 0.05})
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)

    def closure():
        optimizer.zero_grad()
        loss = (first * torch.arange(4.0)).sum() + (second * 2).sum()
        loss.backward()
        return loss

    loss = optimizer.step(closure)
    scheduler.step()
    assert float(loss.detach()) == pytest.approx(10.0)
    assert calls == ["pre", "post"]
    assert not torch.equal(second, torch.ones(2)) and not torch.equal(first, torch.ones(4))
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.05) and optimizer.param_groups[1]["lr"] == pytest.approx(0.025)


def test_torch_base_classes_where_the_rule_is_torchs():
    params = [torch.nn.Parameter(torch.ones(2))]
    assert isinstance(FusedSGD(params, lr=0.1), torch.optim.SGD)
    assert isinstance(FusedAdam(params), torch.optim.Adam)
    assert isinstance(FusedAdagrad(params), torch.optim.Adagrad)


def test_params_without_grads_are_left_alone():
    used, unused = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))
    for cls in (FusedSGD, FusedAdam, FusedLAMB, FusedNovoGrad, FusedAdagrad):
        optimizer = cls([used, unused], lr=0.1)
        used.grad, unused.grad = torch.ones(3), None
        optimizer.step()
        assert torch.equal(unused, torch.ones(3)) and unused not in optimizer.state


def test_fused_lamb_under_ampddp_o2_steps_fp32_masters():
    from ampddp.amp import Amp

    amp, model = Amp(), make_mlp()
    model, optimizer = amp.initialize(model, FusedLAMB(model.parameters(), lr=1e-2), opt_level="O2", verbosity=0)
    x, y = make_batches(1)[0]
    before = [p.detach().clone() for p in model.parameters()]
    for _ in range(2):
        optimizer.zero_grad()
        with amp.scale_loss(F.cross_entropy(model(x).float(), y), optimizer) as scaled:
            scaled.backward()
        optimizer.step()
    assert all(m.dtype == torch.float32 for m in amp.master_params(optimizer))
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


# ---------------------------------------------------------------------------------------------
# apex's signatures, refusals and bad values

APEX_SIGNATURES = {
    FusedSGD: [("lr", "required"), ("momentum", 0), ("dampening", 0), ("weight_decay", 0), ("nesterov", False),
               ("wd_after_momentum", False), ("materialize_master_grads", True), ("set_grad_none", False)],
    FusedAdam: [("lr", 1e-3), ("bias_correction", True), ("betas", (0.9, 0.999)), ("eps", 1e-8), ("adam_w_mode", True),
                ("weight_decay", 0.0), ("amsgrad", False), ("set_grad_none", True), ("capturable", False), ("master_weights", False)],
    FusedLAMB: [("lr", 1e-3), ("bias_correction", True), ("betas", (0.9, 0.999)), ("eps", 1e-6), ("weight_decay", 0.01),
                ("amsgrad", False), ("adam_w_mode", True), ("grad_averaging", True), ("set_grad_none", True),
                ("max_grad_norm", 1.0), ("use_nvlamb", False)],
    FusedNovoGrad: [("lr", 1e-3), ("bias_correction", True), ("betas", (0.9, 0.999)), ("eps", 1e-8), ("weight_decay", 0.0),
                    ("amsgrad", False), ("reg_inside_moment", False), ("grad_averaging", True), ("norm_type", 2),
                    ("init_zero", False), ("set_grad_none", True)],
    FusedAdagrad: [("lr", 1e-2), ("eps", 1e-10), ("weight_decay", 0.0), ("set_grad_none", True), ("adagrad_w_mode", False)],
}  # fmt: skip


@pytest.mark.parametrize("cls", list(APEX_SIGNATURES), ids=lambda c: c.__name__)
def test_constructor_signature_is_apexs(cls):
    parameters = list(inspect.signature(cls.__init__).parameters.values())[1:]
    assert parameters[0].name == "params"
    got = [(p.name, "required" if p.default is required else p.default) for p in parameters[1:]]
    assert got == APEX_SIGNATURES[cls]


@pytest.mark.parametrize(
    ("cls", "kwargs", "expected"),
    [
        (FusedAdam, {"lr": -1.0}, "lr=-1.0 is not valid; lr must be a number >= 0"),
        (FusedAdam, {"betas": (1.0, 0.999)}, "betas=(1.0, 0.999) is not valid; betas must be a pair (beta1, beta2) with each in [0, 1)"),
        (FusedAdam, {"betas": (0.9, -0.1)}, "betas=(0.9, -0.1)"),
        (FusedAdam, {"eps": -1e-8}, "eps=-1e-08 is not valid"),
        (FusedAdam, {"weight_decay": -0.1}, "weight_decay=-0.1"),
        (FusedLAMB, {"lr": -0.1}, "FusedLAMB: lr=-0.1"),
        (FusedLAMB, {"betas": (0.9, 1.5)}, "betas=(0.9, 1.5)"),
        (FusedLAMB, {"max_grad_norm": 0.0}, "max_grad_norm=0.0 is not valid; max_grad_norm must be a number > 0"),
        (FusedNovoGrad, {"norm_type": 1}, "norm_type=1 is not valid; norm_type must be 0 (infinity norm) or 2"),
        (FusedNovoGrad, {"eps": -1.0}, "FusedNovoGrad: eps=-1.0"),
        (FusedAdagrad, {"lr": -0.01}, "FusedAdagrad: lr=-0.01"),
        (FusedSGD, {"lr": -0.1}, "FusedSGD: lr=-0.1"),
        (FusedSGD, {"lr": 0.1, "momentum": -0.5}, "momentum=-0.5"),
        (FusedSGD, {"lr": 0.1, "nesterov": True}, "nesterov=True needs momentum > 0 and dampening=0"),
        (FusedSGD, {"lr": 0.1, "momentum": 0.9, "dampening": 0.1, "nesterov": True}, "dampening=0.1"),
    ],
)
def test_bad_values_raise_config_errors_naming_them(cls, kwargs, expected):
    with pytest.raises(ConfigError) as caught:
        cls([torch.nn.Parameter(torch.ones(2))], **kwargs)
    assert isinstance(caught.value, ValueError) and expected in str(caught.value)


def test_bad_param_group_values_are_refused_with_the_group_named():
    params = [torch.nn.Parameter(torch.ones(2))]
    with pytest.raises(ConfigError, match=r"FusedAdam: param group 1: lr=-0.5 is not valid; lr must be a number >= 0"):
        FusedAdam([{"params": params}, {"params": [torch.nn.Parameter(torch.ones(1))], "lr": -0.5}])
    optimizer = FusedLAMB(params)
    with pytest.raises(ConfigError, match=r"FusedLAMB: param group 1: betas=\(0.9, 1.0\) is not valid"):
        optimizer.add_param_group({"params": [torch.nn.Parameter(torch.ones(1))], "betas": (0.9, 1.0)})


def test_fused_sgd_needs_lr_like_apex():
    with pytest.raises(ValueError, match="lr"):
        FusedSGD([torch.nn.Parameter(torch.ones(2))])


@pytest.mark.parametrize("cls", [FusedAdam, FusedLAMB, FusedNovoGrad])
def test_amsgrad_is_refused_as_apex_refuses_it(cls):
    with pytest.raises(RefusedOptionError, match=rf"{cls.__name__}\(amsgrad=True\).*torch.optim.AdamW\(params, amsgrad=True\)") as caught:
        cls([torch.nn.Parameter(torch.ones(2))], amsgrad=True)
    assert isinstance(caught.value, RuntimeError) and isinstance(caught.value, ValueError)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_capturable_needs_cuda_params():
    with pytest.raises(RefusedOptionError, match=r"capturable=True.*CUDA-graph.*not on a CUDA device"):
        FusedAdam([torch.nn.Parameter(torch.ones(2))], capturable=True)


def test_fused_adam_step_refuses_apexs_removed_and_hook_arguments():
    param = torch.nn.Parameter(torch.ones(2))
    optimizer = FusedAdam([param])
    param.grad = torch.ones(2)
    with pytest.raises(RefusedOptionError, match="apex removed these arguments"):
        optimizer.step(scale=128.0)
    with pytest.raises(RefusedOptionError, match=r"scaler.step\(optimizer\)"):
        optimizer.step(grad_scaler=torch.amp.GradScaler("cpu"))
    assert torch.equal(param, torch.ones(2))


def test_sparse_grads_are_refused():
    param = torch.nn.Parameter(torch.ones(3, 2))
    param.grad = torch.ones(3, 2).to_sparse()
    with pytest.raises(RuntimeError, match="sparse gradients"):
        FusedLAMB([param]).step()


def test_unknown_names_say_what_to_use():
    with pytest.raises(ImportError, match=r"apex.optimizers.DistributedFusedAdam is not provided.*ZeroRedundancyOptimizer"):
        from ampddp.apex.optimizers import DistributedFusedAdam  # noqa: F401
    with pytest.raises(ImportError, match=r"FusedMixedPrecisionLamb.*FusedLAMB"):
        from ampddp.apex.optimizers import FusedMixedPrecisionLamb  # noqa: F401
    with pytest.raises(AttributeError, match=r"apex.optimizers.FusedThing is not provided.*FusedAdam, FusedLAMB"):
        apex_optimizers.FusedThing  # noqa: B018
    assert not hasattr(apex_optimizers, "DistributedFusedLAMB")
    assert sorted(apex_optimizers.__all__) == ["FusedAdagrad", "FusedAdam", "FusedLAMB", "FusedNovoGrad", "FusedSGD"]


# ---------------------------------------------------------------------------------------------
# CUDA (skipped without a GPU)


@CUDA
@pytest.mark.cuda
@pytest.mark.parametrize(("cls", "kwargs"), ROUND_TRIP, ids=lambda c: getattr(c, "__name__", ""))
def test_cuda_matches_cpu(cls, kwargs):
    values, grads = initial_values(), grad_sequence()
    for dtype, tolerance in [(torch.float32, 1e-5), (torch.float16, 3e-3)]:
        on_gpu, optimizer = run(cls, kwargs, values, grads, dtype=dtype, device="cuda")
        on_cpu, _ = run(cls, kwargs, values, grads, dtype=dtype)
        close(on_gpu, [p.detach().double() for p in on_cpu], rtol=tolerance, atol=tolerance)
        saved = copy.deepcopy(optimizer.state_dict())
        cls(on_gpu, **kwargs).load_state_dict(saved)


@CUDA
@pytest.mark.cuda
def test_cuda_fused_adam_matches_torch_fused_adamw_and_capturable_graph_replays():
    values, grads = initial_values(), grad_sequence()
    ours, _ = run(FusedAdam, {"lr": 1e-2, "weight_decay": 0.1}, values, grads, device="cuda")
    theirs, _ = run(torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1, "fused": True}, values, grads, device="cuda")
    for a, b in zip(ours, theirs):
        assert (a - b).abs().max() <= 1e-6

    params = [torch.nn.Parameter(v.float().cuda()) for v in values]
    optimizer = FusedAdam(params, lr=1e-2, capturable=True)
    eager = [torch.nn.Parameter(v.float().cuda()) for v in values]
    reference = FusedAdam(eager, lr=1e-2, capturable=True)
    for p, q, g in zip(params, eager, grads[0]):
        p.grad, q.grad = g.float().cuda(), g.float().cuda()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        optimizer.step()  # warm-up creates the state outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    reference.step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        optimizer.step()
    for _ in range(3):
        graph.replay()
        reference.step()
    torch.cuda.synchronize()
    for p, q in zip(params, eager):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6)
