"""O1/O4 op lists: output dtype per op class, user registrations, decorators and scoping."""

from __future__ import annotations

import threading
import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ampddp import OpRegistry, build_engine, float_function, half_function, promote_function
from ampddp.precision.registry import bfloat16_function

LEVELS = {"O1": torch.float16, "O4": torch.bfloat16}


def op_context(level: str, registry: OpRegistry | None = None, device: str = "cpu"):
    engine = build_engine(level, registry=registry, verbosity=0)
    engine.setup([nn.Linear(2, 2).to(device)], [])
    return engine.forward_context()


def low_half_list_ops(x, w):
    m = torch.randn(4, 4, device=x.device)
    return {
        "F.linear": lambda: F.linear(x, w),
        "torch.mm": lambda: torch.mm(x, m),
        "torch.matmul": lambda: torch.matmul(x, m),
        "x @ m": lambda: x @ m,
        "torch.mv": lambda: torch.mv(m, x[0]),
        "torch.addmm": lambda: torch.addmm(x, x, m),
        "torch.bmm": lambda: torch.bmm(x[None], m[None]),
        "F.conv2d": lambda: F.conv2d(x[None, None], torch.randn(1, 1, 2, 2, device=x.device)),
        "F.prelu": lambda: F.prelu(x, torch.tensor([0.25], device=x.device)),
    }


def fp32_list_ops(h):
    return {
        "F.softmax": lambda: F.softmax(h, dim=-1),
        "Tensor.softmax": lambda: h.softmax(-1),
        "F.log_softmax": lambda: F.log_softmax(h, dim=-1),
        "torch.exp": lambda: torch.exp(h),
        "torch.log": lambda: torch.log(h.abs() + 1),
        "Tensor.sum": lambda: h.sum(),
        "torch.cumsum": lambda: torch.cumsum(h, 0),
        "F.layer_norm": lambda: F.layer_norm(h, (4,)),
        "F.gelu": lambda: F.gelu(h),
        "F.cross_entropy": lambda: F.cross_entropy(h, torch.tensor([0, 1, 2, 3])),
        "F.mse_loss": lambda: F.mse_loss(h, h.detach()),
        "pow": lambda: h.pow(2),
        "**": lambda: h**2,
        "torch.norm": lambda: torch.norm(h),
        "F.group_norm": lambda: F.group_norm(h[None], 2),
    }


def promote_ops(h, f):
    return {
        "torch.add": lambda: torch.add(h, f),
        "h + f": lambda: h + f,
        "f * h": lambda: f * h,
        "h + zero-dim f": lambda: h + f[0, 0],
        "torch.cat": lambda: torch.cat([h, f]),
        "torch.stack": lambda: torch.stack([h, f]),
        "torch.addcmul": lambda: torch.addcmul(f, h, h),
    }


@pytest.mark.parametrize("level", LEVELS)
def test_half_list_runs_in_low_precision(level):
    x, w = torch.randn(4, 4), torch.randn(3, 4, requires_grad=True)
    with op_context(level):
        dtypes = {name: op().dtype for name, op in low_half_list_ops(x, w).items()}
    assert dtypes == dict.fromkeys(dtypes, LEVELS[level])


@pytest.mark.parametrize("level", LEVELS)
def test_fp32_list_runs_in_fp32_even_on_low_precision_input(level):
    h = torch.randn(4, 4).to(LEVELS[level])
    with op_context(level):
        dtypes = {name: op().dtype for name, op in fp32_list_ops(h).items()}
    assert dtypes == dict.fromkeys(dtypes, torch.float32)


@pytest.mark.parametrize("level", LEVELS)
def test_promote_list_uses_widest_input_type(level):
    h, f = torch.randn(4, 4).to(LEVELS[level]), torch.randn(4, 4)
    with op_context(level):
        dtypes = {name: op().dtype for name, op in promote_ops(h, f).items()}
        same_type = (h + h).dtype
    assert dtypes == dict.fromkeys(dtypes, torch.float32)
    assert same_type == LEVELS[level]


@pytest.mark.parametrize("level", LEVELS)
def test_batchnorm_follows_its_input(level):
    bn = nn.BatchNorm1d(4)
    with op_context(level):
        assert bn(torch.randn(8, 4).to(LEVELS[level])).dtype == LEVELS[level]
        assert bn(torch.randn(8, 4)).dtype == torch.float32


@pytest.mark.parametrize("level", LEVELS)
def test_nothing_is_cast_after_the_context_exits(level):
    low = LEVELS[level]
    with op_context(level):
        pass
    x = torch.randn(4, 4)
    assert F.linear(x, torch.randn(2, 4)).dtype == torch.float32
    assert F.softmax(x.to(low), -1).dtype == low
    assert (x.to(low) + x[0, 0]).dtype == low


def test_user_registrations_override_the_lists_and_apply_only_to_their_engine():
    registry = OpRegistry()
    registry.register(torch, "sigmoid", "float")
    registry.register(torch, "softmax", "half")
    h = torch.randn(4, 4).half()
    with op_context("O1", registry):
        assert torch.sigmoid(h).dtype == torch.float32
        assert h.sigmoid().dtype == torch.float32
        assert torch.softmax(h.float(), -1).dtype == torch.float16
    with op_context("O1"):
        assert torch.sigmoid(h).dtype == torch.float16
        assert torch.softmax(h, -1).dtype == torch.float32


def test_registration_made_after_setup_waits_for_the_next_setup():
    registry = OpRegistry()
    context = op_context("O1", registry)
    registry.register(torch, "sigmoid", "float")
    with context:
        assert torch.sigmoid(torch.randn(2).half()).dtype == torch.float16
    with op_context("O1", registry):
        assert torch.sigmoid(torch.randn(2).half()).dtype == torch.float32


def test_registering_a_plain_python_function_swaps_it_only_inside_the_context():
    def scale(x):
        return x * 3

    namespace = types.SimpleNamespace(scale=scale)
    registry = OpRegistry()
    registry.register(namespace, "scale", "float")
    registry.register(namespace, "scale", "promote")
    registry.register(namespace, "scale", "float")
    with op_context("O1", registry):
        assert namespace.scale is not scale
        assert namespace.scale(torch.ones(2).half()).dtype == torch.float32
    assert namespace.scale is scale
    assert len(registry.entries()) == 1


def test_registering_a_missing_attribute_raises_value_error():
    with pytest.raises(ValueError, match="no attribute 'not_an_op'"):
        OpRegistry().register(torch, "not_an_op", "float")
    with pytest.raises(ValueError, match="valid choices"):
        OpRegistry().register(torch, "sigmoid", "double")


def test_decorators_cast_inside_any_op_context_and_are_plain_outside():
    @float_function
    def to_float(x):
        return x + 0

    @half_function
    def to_half(x):
        return x + 0

    @promote_function
    def mix(a, b):
        return torch.cat([a, b])

    @bfloat16_function
    def to_bf16(x):
        return x + 0

    h, f = torch.randn(2).half(), torch.randn(2)
    assert (to_float(h).dtype, to_half(f).dtype, to_bf16(f).dtype) == (torch.float16, torch.float32, torch.float32)
    with op_context("O1"):
        assert to_float(h).dtype == torch.float32
        assert to_half(f).dtype == torch.float16
        assert to_bf16(f).dtype == torch.bfloat16
        assert mix(h, f).dtype == torch.float32
    assert to_float.__name__ == "to_float"


@pytest.mark.parametrize("level", LEVELS)
def test_binary_cross_entropy_on_low_precision_input_is_refused_with_guidance(level):
    logits = torch.randn(4, 1)
    target = torch.rand(4, 1)
    with op_context(level), pytest.raises(RuntimeError, match="BCEWithLogits"):
        F.binary_cross_entropy(torch.sigmoid(F.linear(logits, torch.ones(1, 1))), target)
    registry = OpRegistry()
    registry.register(torch, "sigmoid", "float")
    with op_context(level, registry):
        loss = F.binary_cross_entropy(torch.sigmoid(F.linear(logits, torch.ones(1, 1))), target)
    assert loss.dtype == torch.float32


def test_cast_cache_is_reused_within_a_forward_and_stays_correct_across_grad_modes():
    weight = nn.Parameter(torch.randn(3, 4))
    x = torch.randn(2, 4)
    with op_context("O1"):
        with torch.no_grad():
            F.linear(x, weight)
        out = F.linear(x, weight) + F.linear(x, weight)
        out.float().sum().backward()
    assert weight.grad is not None and weight.grad.dtype == torch.float32
    expected = 2 * x.half().float().sum(0).expand(3, 4)
    torch.testing.assert_close(weight.grad, expected, rtol=1e-2, atol=1e-2)


def test_cast_cache_sees_in_place_updates():
    weight = nn.Parameter(torch.ones(1, 1))
    x = torch.ones(1, 1)
    with op_context("O1"):
        first = F.linear(x, weight).item()
        with torch.no_grad():
            weight.mul_(3)
        second = F.linear(x, weight).item()
    assert (first, second) == (1.0, 3.0)


def test_lstm_runs_in_half_and_trains_fp32_weights():
    lstm = nn.LSTM(4, 3, batch_first=True)
    with op_context("O1"):
        out, _ = lstm(torch.randn(2, 5, 4))
    assert out.dtype == torch.float16
    out.float().sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in lstm.parameters())


def test_context_is_per_thread():
    seen = {}

    def other_thread():
        seen["other"] = F.softmax(torch.randn(2).half(), -1).dtype

    with op_context("O1"):
        thread = threading.Thread(target=other_thread)
        thread.start()
        thread.join()
        seen["inside"] = F.softmax(torch.randn(2).half(), -1).dtype
    assert seen == {"other": torch.float16, "inside": torch.float32}


def test_contexts_nest_and_unwind_cleanly():
    context = op_context("O1")
    with context:
        with context:
            assert F.softmax(torch.randn(2).half(), -1).dtype == torch.float32
        assert F.softmax(torch.randn(2).half(), -1).dtype == torch.float32
    assert F.softmax(torch.randn(2).half(), -1).dtype == torch.float16


def test_context_unwinds_when_the_forward_raises():
    context = op_context("O1")
    with pytest.raises(ZeroDivisionError), context:
        raise ZeroDivisionError
    assert not context.active
    assert F.softmax(torch.randn(2).half(), -1).dtype == torch.float16


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("level", LEVELS)
def test_cuda_gives_the_same_dtypes_as_cpu(level):
    def table(device):
        x, w = torch.randn(4, 4, device=device), torch.randn(3, 4, device=device)
        h, f = x.to(LEVELS[level]), torch.randn(4, 4, device=device)
        with op_context(level, device=device):
            ops = {**low_half_list_ops(x, w), **promote_ops(h, f)}
            ops.update({k: v for k, v in fp32_list_ops(h).items() if k != "F.cross_entropy"})
            return {name: op().dtype for name, op in ops.items()}

    assert table("cuda") == table("cpu")
