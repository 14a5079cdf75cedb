"""O1/O4 op lists: output dtype per op class, user registrations, decorators and scoping."""

from __future__ import annotations

import functools
import threading
import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ampddp import OpRegistry, build_engine, float_function, half_function, promote_function
from ampddp.precision.casting.cast_context import OpCastContext
from ampddp.precision.casting.op_table import build_op_table
from ampddp.precision.casting.registry import bfloat16_function

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
        "F.rms_norm": lambda: F.rms_norm(h, (4,)),
        "nn.RMSNorm": lambda: nn.RMSNorm(4)(h),
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


def test_cast_weights_are_dropped_when_the_forward_ends():
    """Within one forward a weight's cast is reused (as apex and torch.autocast do); the next forward
    casts again, so an update made between forwards (or inside one) is seen by the next."""
    weight = nn.Parameter(torch.ones(1, 1))
    x = torch.ones(1, 1)
    context = op_context("O1")
    with context:
        first = F.linear(x, weight).item()
        with torch.no_grad():
            weight.mul_(3)
    with context:
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


def every_list_op(h, f):
    """A call for (nearly) every name on apex's lists; ``h`` low precision, ``f`` fp32, both 4x4."""
    p, i = h.abs() + 0.5, torch.tensor([0, 1, 2, 3])
    image, grid = h[None, None], torch.zeros(1, 2, 2, 2, dtype=h.dtype)
    return {
        **low_half_list_ops(f, f[:3].clone()),
        **fp32_list_ops(h),
        **promote_ops(h, f),
        "F.conv1d": lambda: F.conv1d(f[None], torch.randn(2, 4, 1)),
        "F.conv_transpose2d": lambda: F.conv_transpose2d(f[None, None], torch.randn(1, 1, 2, 2)),
        "torch.addmv": lambda: torch.addmv(f[0], f, f[1]),
        "torch.addr": lambda: torch.addr(f, f[0], f[1]),
        "torch.baddbmm": lambda: torch.baddbmm(f[None], f[None], f[None]),
        "torch.addbmm": lambda: torch.addbmm(f, f[None], f[None]),
        "torch.chain_matmul": lambda: torch.linalg.multi_dot([f, f, f]),
        "sdpa": lambda: F.scaled_dot_product_attention(f[None], f[None], f[None]),
        "lstm_cell": lambda: torch.lstm_cell(f, (f[:, :1].repeat(1, 1), f[:, :1]), torch.randn(4, 4), torch.randn(4, 1))[0],
        "F.interpolate": lambda: F.interpolate(image, scale_factor=2, mode="bilinear"),
        "F.grid_sample": lambda: F.grid_sample(image, grid, align_corners=False),
        "F.softplus": lambda: F.softplus(h),
        "F.softmin": lambda: F.softmin(h, -1),
        "F.normalize": lambda: F.normalize(h),
        "F.cosine_similarity": lambda: F.cosine_similarity(h, h),
        "F.local_response_norm": lambda: F.local_response_norm(image, 2),
        "F.kl_div": lambda: F.kl_div(h, p, reduction="batchmean"),
        "F.l1_loss": lambda: F.l1_loss(h, p),
        "F.smooth_l1_loss": lambda: F.smooth_l1_loss(h, p),
        "F.huber_loss": lambda: F.huber_loss(h, p),
        "F.nll_loss": lambda: F.nll_loss(h, i),
        "F.bce_with_logits": lambda: F.binary_cross_entropy_with_logits(h, p.clamp(max=1)),
        "F.poisson_nll_loss": lambda: F.poisson_nll_loss(h, p),
        "F.soft_margin_loss": lambda: F.soft_margin_loss(h, p.sign()),
        "F.multilabel_soft_margin_loss": lambda: F.multilabel_soft_margin_loss(h, (p > 1).to(h.dtype)),
        "F.gaussian_nll_loss": lambda: F.gaussian_nll_loss(h, p, p),
        **{
            f"torch.{name}": functools.partial(getattr(torch, name), p.clamp(max=0.9))
            for name in (
                "acos",
                "asin",
                "cosh",
                "erfinv",
                "expm1",
                "log10",
                "log2",
                "log1p",
                "reciprocal",
                "rsqrt",
                "sinh",
                "tan",
                "cumprod",
                "prod",
                "std",
                "var",
                "logsumexp",
            )
        },
        "torch.cumprod": lambda: torch.cumprod(h, 0),
        "torch.logsumexp": lambda: torch.logsumexp(h, 0),
        "torch.renorm": lambda: torch.renorm(h, 2, 0, 1.0),
        "torch.dist": lambda: torch.dist(h, p),
        "torch.addcdiv": lambda: torch.addcdiv(f, h, p),
        "torch.atan2": lambda: torch.atan2(h, f),
        "torch.cross": lambda: torch.cross(h[:3, :3], f[:3, :3], dim=0),
        "torch.dot": lambda: torch.dot(h[0], f[0]),
        "h - f": lambda: h - f,
        "f / h": lambda: f / p,
        "h < f": lambda: h < f,
        "torch.where": lambda: torch.where(h > 0, h, f),
        "torch.lerp": lambda: torch.lerp(h, f, 0.5),
        "torch.hstack": lambda: torch.hstack([h, f]),
        "torch.concat": lambda: torch.concat([h, f]),
        "h ** f": lambda: p**f,
    }


DEVICES = [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("level", LEVELS)
def test_dispatcher_kernels_cast_every_list_op_as_the_torch_function_mode_does(level, device):
    """The fast path (device autocast + dispatcher kernels) against the reference that sees every
    torch call in Python: the same dtype for every list op, the same values within fp16 rounding."""
    low = LEVELS[level]
    torch.manual_seed(0)
    torch.set_default_device(device)
    try:
        h, f = torch.randn(4, 4).to(low), torch.randn(4, 4)
    finally:
        torch.set_default_device(None)
    fast = OpCastContext(build_op_table(()), low, (device,))
    reference = OpCastContext(build_op_table(()), low, (device,), kernels=False)
    assert fast.uses_kernels and not reference.uses_kernels
    ops = every_list_op(h, f)

    def run_all(context: OpCastContext) -> dict[str, torch.Tensor]:
        results = {}
        with context, torch.device(device):
            for name, op in ops.items():
                torch.manual_seed(1)  # some calls draw their own weights
                results[name] = op()
        return results

    got, expected = run_all(fast), run_all(reference)
    assert {name: t.dtype for name, t in got.items()} == {name: t.dtype for name, t in expected.items()}
    for name in ops:
        torch.testing.assert_close(got[name].double(), expected[name].double(), rtol=2e-2, atol=2e-2, msg=name)


def test_dispatcher_kernels_are_shared_counted_and_removed_with_the_last_context():
    import gc

    from ampddp.precision.casting.aten_casts import KERNELS

    gc.collect()
    before = KERNELS.registered()
    contexts = [OpCastContext(build_op_table(()), torch.float16, ("cpu",)) for _ in range(2)]
    registered = KERNELS.registered()
    assert registered > before or before > 0
    del contexts[0]
    gc.collect()
    assert KERNELS.registered() == registered
    del contexts[0]
    gc.collect()
    assert KERNELS.registered() == before


def test_a_users_own_autocast_is_unchanged_while_ampddp_kernels_are_registered():
    h = torch.randn(4, 4).half()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        before = {
            "softmax": F.softmax(h, -1).dtype,
            "exp": torch.exp(h).dtype,
            "bce": F.binary_cross_entropy(torch.rand(3).half(), torch.rand(3)).dtype,
        }
    context = OpCastContext(build_op_table(()), torch.float16, ("cpu",))
    assert context.uses_kernels
    with torch.autocast("cpu", dtype=torch.bfloat16):
        after = {
            "softmax": F.softmax(h, -1).dtype,
            "exp": torch.exp(h).dtype,
            "bce": F.binary_cross_entropy(torch.rand(3).half(), torch.rand(3)).dtype,
        }
    assert after == before == {"softmax": torch.float16, "exp": torch.float16, "bce": torch.float32}


def test_a_registration_that_would_replace_a_torch_autocast_kernel_uses_the_torch_function_mode():
    registry = OpRegistry()
    registry.register(F, "linear", "float")  # torch's CPU autocast casts linear itself
    engine = build_engine("O1", registry=registry, verbosity=0)
    engine.setup([nn.Linear(2, 2)], [])
    assert not engine.forward_context().uses_kernels
    with engine.forward_context():
        assert F.linear(torch.randn(2, 2), torch.randn(2, 2)).dtype == torch.float32


def test_moving_to_the_device_a_tensor_is_on_keeps_it_under_the_kernels():
    """Tensor.cpu() casts to fp32 only when it copies to the host; same-device moves alias (x.to(x.device))."""
    context = OpCastContext(build_op_table(()), torch.bfloat16, ("cpu",))
    cache = torch.zeros(3, dtype=torch.bfloat16)
    with context:
        moved = [cache.cpu(), cache.to("cpu"), cache.to(cache.device)]
    assert all(t is cache for t in moved)


def test_contexts_closed_out_of_order_leave_no_casts_behind():
    """Run on a thread of its own: autocast's state is per thread, and closing autocast out of order
    leaves it as it was when the second context was entered (enabled), which must not leak into
    other tests."""
    first, second = (OpCastContext(build_op_table(()), torch.float16, ("cpu",)) for _ in range(2))
    seen = {}

    def close_out_of_order() -> None:
        h = torch.randn(4).half()
        first.__enter__()
        second.__enter__()
        first.__exit__(None, None, None)
        second.__exit__(None, None, None)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            seen["softmax under the user's autocast"] = F.softmax(h, -1).dtype
        seen["tagged function outside"] = float_function(lambda x: x + 0)(h).dtype

    thread = threading.Thread(target=close_out_of_order)
    thread.start()
    thread.join()
    assert seen == {"softmax under the user's autocast": torch.float16, "tagged function outside": torch.float16}


def test_registrations_of_ops_several_list_names_reach_use_the_torch_function_mode():
    registry = OpRegistry()
    registry.register(torch, "pow", "half")  # aten pow is also what ** reaches, which stays fp32
    engine = build_engine("O1", registry=registry, verbosity=0)
    engine.setup([nn.Linear(2, 2)], [])
    assert not engine.forward_context().uses_kernels
    h = torch.rand(4).half()
    with engine.forward_context():
        assert (torch.pow(h, 2).dtype, (h**2).dtype) == (torch.float16, torch.float32)


def test_a_registration_of_an_op_named_differently_in_aten_reaches_it():
    registry = OpRegistry()
    registry.register(torch, "norm", "half")  # torch.norm calls aten linalg_vector_norm
    engine = build_engine("O1", registry=registry, verbosity=0)
    engine.setup([nn.Linear(2, 2)], [])
    assert engine.forward_context().uses_kernels
    with engine.forward_context():
        assert torch.norm(torch.rand(4)).dtype == torch.float16
