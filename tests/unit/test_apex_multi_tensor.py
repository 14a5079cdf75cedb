"""ampddp.apex.amp_C and multi_tensor_applier against per-tensor references: values, mixed dtypes, the overflow flag."""

from __future__ import annotations

import itertools

import pytest
import torch

from ampddp.apex import amp_C
from ampddp.apex.multi_tensor_apply import MultiTensorApply, multi_tensor_applier

HALVES = (torch.float32, torch.float16, torch.bfloat16)
SIZES = ((777, 555), (555, 2048 * 32 + 1), (33, 1))


def flag() -> torch.Tensor:
    return torch.zeros(1, dtype=torch.int)


def filled(sizes, value: float, dtype: torch.dtype, repeat: int = 2) -> list[torch.Tensor]:
    return [torch.full((n,), value, dtype=dtype) for _ in range(repeat) for n in sizes]


def rand_list(sizes, dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, generator=g) * 3).to(dtype) for n in sizes]


# ---------------------------------------------------------------------------------------------------
# multi_tensor_scale
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("in_type", "out_type"), list(itertools.product(HALVES, HALVES)))
def test_scale_matches_per_tensor_reference_across_dtypes(in_type, out_type):
    buf = flag()
    ins = rand_list(SIZES[1] + SIZES[2], in_type)
    outs = [torch.empty(t.shape, dtype=out_type) for t in ins]
    multi_tensor_applier(amp_C.multi_tensor_scale, buf, [ins, outs], 1.0 / 3.0)
    for src, dst in zip(ins, outs):
        assert dst.dtype == out_type
        expected = (src.float() * torch.tensor(1.0 / 3.0, dtype=torch.float32)).to(out_type)  # fp32 math, then the output dtype
        torch.testing.assert_close(dst, expected, rtol=0, atol=0)
    assert buf.item() == 0


@pytest.mark.parametrize("dtype", HALVES)
def test_scale_in_place(dtype):
    buf = flag()
    tensors = filled(SIZES[0], 4.0, dtype)
    multi_tensor_applier(amp_C.multi_tensor_scale, buf, [tensors, tensors], 0.25)
    assert all(torch.equal(t, torch.ones_like(t)) for t in tensors)
    assert buf.item() == 0


@pytest.mark.parametrize(
    ("in_type", "out_type"), [(torch.float32, torch.float32), (torch.float16, torch.float32), (torch.float32, torch.float16)]
)
@pytest.mark.parametrize(("index", "value"), [((0, 0), float("nan")), ((-1, -1), float("inf")), ((1, 277), float("-inf"))])
def test_scale_sets_flag_for_non_finite_input(in_type, out_type, index, value):
    buf = flag()
    ins = filled(SIZES[0], 4.0, in_type)
    ins[index[0]][index[1]] = value
    outs = [torch.empty_like(t, dtype=out_type) for t in ins]
    amp_C.multi_tensor_scale(2048 * 32, buf, [ins, outs], 0.25)
    assert buf.item() == 1
    assert not torch.isfinite(outs[index[0]][index[1]])  # outputs are still written, as apex did
    assert torch.equal(outs[0][1:], torch.ones_like(outs[0][1:]))


def test_scale_flag_checks_inputs_not_the_rounded_outputs():
    buf = flag()
    ins = [torch.full((4,), 60000.0)]
    outs = [torch.empty(4, dtype=torch.float16)]
    amp_C.multi_tensor_scale(1, buf, [ins, outs], 4.0)  # 240000 overflows fp16, but the inputs are finite
    assert torch.isinf(outs[0]).all() and buf.item() == 0


def test_scale_never_clears_the_flag_and_accepts_a_tensor_scale():
    buf = torch.ones(1, dtype=torch.int)
    ins = filled((5,), 2.0, torch.float32)
    outs = [torch.empty(5, dtype=torch.bfloat16) for _ in ins]
    amp_C.multi_tensor_scale(1, buf, [ins, outs], torch.tensor(0.5))
    assert buf.item() == 1
    assert all(torch.equal(o, torch.ones(5, dtype=torch.bfloat16)) for o in outs)


def test_scale_mixed_dtypes_within_a_list_and_odd_layouts():
    buf = flag()
    nchw = torch.randn(2, 3, 4, 5)
    ins = [nchw.to(memory_format=torch.channels_last), torch.randn(6, 4).t(), torch.randn(7).half()]
    outs = [torch.empty(2, 3, 4, 5, dtype=torch.float16), torch.empty(24), torch.empty(7, 1)]  # same numel, other shapes
    amp_C.multi_tensor_scale(1, buf, [ins, outs], 2.0)
    torch.testing.assert_close(outs[0], (ins[0] * 2).half())
    torch.testing.assert_close(outs[1], (ins[1] * 2).reshape(24))
    torch.testing.assert_close(outs[2], (ins[2].float() * 2).reshape(7, 1))
    assert buf.item() == 0


def test_scale_works_on_leaf_params_and_grads():
    p = torch.nn.Parameter(torch.full((3,), 8.0))
    p.grad = torch.full((3,), 8.0)
    buf = flag()
    amp_C.multi_tensor_scale(1, buf, [[p.grad, p], [p.grad, p]], 0.5)
    assert torch.equal(p.grad, torch.full((3,), 4.0)) and torch.equal(p.detach(), torch.full((3,), 4.0))


# ---------------------------------------------------------------------------------------------------
# multi_tensor_l2norm / multi_tensor_unscale_l2norm
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", HALVES)
@pytest.mark.parametrize("per_tensor", [False, True])
def test_l2norm_matches_reference(dtype, per_tensor):
    buf = flag()
    tensors = rand_list(SIZES[1] + SIZES[0], dtype)
    norm, norms = multi_tensor_applier(amp_C.multi_tensor_l2norm, buf, [tensors], per_tensor)
    reference = torch.cat([t.double().flatten() for t in tensors]).norm()
    assert norm.shape == (1,) and norm.dtype == torch.float32
    torch.testing.assert_close(norm.double(), reference.reshape(1), rtol=1e-5, atol=0)
    if per_tensor:
        assert norms.shape == (len(tensors),) and norms.dtype == torch.float32
        torch.testing.assert_close(norms.double(), torch.stack([t.double().norm() for t in tensors]), rtol=1e-5, atol=0)
    else:
        assert norms.shape == (0,) and norms.dtype == torch.float32
    assert buf.item() == 0


def test_l2norm_accumulates_half_in_float32_and_default_per_tensor_is_false():
    buf = flag()
    tensors = [torch.full((1000,), 300.0, dtype=torch.float16)]  # 300**2 * 1000 is far beyond fp16's range
    norm, norms = amp_C.multi_tensor_l2norm(1, buf, [tensors])
    torch.testing.assert_close(norm, torch.tensor([300.0 * 1000**0.5]))
    assert norms.numel() == 0 and buf.item() == 0


@pytest.mark.parametrize("value", [float("inf"), float("nan")])
def test_l2norm_sets_flag_for_non_finite(value):
    buf = flag()
    tensors = rand_list((10, 20), torch.float16)
    tensors[1][3] = value
    norm, norms = amp_C.multi_tensor_l2norm(1, buf, [tensors], True)
    assert buf.item() == 1 and not torch.isfinite(norm).any()
    assert torch.isfinite(norms[0]) and not torch.isfinite(norms[1])


def test_l2norm_float64_and_mixed_list():
    buf = flag()
    tensors = [torch.randn(5, dtype=torch.float64), torch.randn(4).half(), torch.randn(3)]
    norm, norms = amp_C.multi_tensor_l2norm(1, buf, [tensors], True)
    assert norm.dtype == norms.dtype == torch.float32
    torch.testing.assert_close(norms.double(), torch.stack([t.double().norm() for t in tensors]), rtol=1e-5, atol=0)


@pytest.mark.parametrize("per_tensor", [False, True])
def test_unscale_l2norm_is_the_norm_of_the_unscaled_tensors(per_tensor):
    buf = flag()
    tensors = filled((777, 555), 4.0, torch.float16)
    before = [t.clone() for t in tensors]
    inv_scale = torch.tensor([0.5])
    norm, norms = multi_tensor_applier(amp_C.multi_tensor_unscale_l2norm, buf, [tensors], inv_scale, per_tensor)
    torch.testing.assert_close(norm, torch.full(((777 + 555) * 2,), 2.0).norm().reshape(1))
    if per_tensor:
        torch.testing.assert_close(norms, torch.tensor([2.0 * 777**0.5, 2.0 * 555**0.5] * 2))
    else:
        assert norms.shape == (0,)
    assert all(torch.equal(a, b) for a, b in zip(tensors, before))
    assert buf.item() == 0
    amp_C.multi_tensor_unscale_l2norm(1, buf, [tensors], torch.tensor([float("inf")]))
    assert buf.item() == 1


# ---------------------------------------------------------------------------------------------------
# multi_tensor_axpby
# ---------------------------------------------------------------------------------------------------

AXPBY_TYPES = (torch.float32, torch.float16)


AXPBY_CASES = [
    (x_type, y_type, out_type, inplace)
    for x_type, y_type, out_type in itertools.product(AXPBY_TYPES, AXPBY_TYPES, (*AXPBY_TYPES, torch.bfloat16))
    for inplace in (False, True)
    if not inplace or y_type == out_type  # in place means out is y
]


@pytest.mark.parametrize(("x_type", "y_type", "out_type", "inplace"), AXPBY_CASES)
def test_axpby_matches_apex_reference(x_type, y_type, out_type, inplace):
    buf = flag()
    ys = filled((555, 2049), 16.0, y_type)
    xs = filled((555, 2049), 4.0, x_type)
    outs = ys if inplace else [torch.full(t.shape, 3.0, dtype=out_type) for t in ys]
    multi_tensor_applier(amp_C.multi_tensor_axpby, buf, [xs, ys, outs], 2.0, 8.0, -1)
    assert all(o.dtype == out_type and torch.equal(o, torch.full_like(o, 136.0)) for o in outs)
    assert buf.item() == 0


def test_axpby_random_values_in_float32_math():
    buf = flag()
    xs, ys = rand_list((300, 17), torch.float16, seed=1), rand_list((300, 17), torch.bfloat16, seed=2)
    outs = [torch.empty(t.shape) for t in xs]
    amp_C.multi_tensor_axpby(1, buf, [xs, ys, outs], 0.75, -1.5, -1)
    for x, y, o in zip(xs, ys, outs):
        torch.testing.assert_close(o, 0.75 * x.float() - 1.5 * y.float(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    ("bad", "arg_to_check", "flagged"),
    [("x", -1, True), ("y", -1, True), ("x", 0, True), ("y", 0, False), ("x", 1, False), ("y", 1, True)],
)
def test_axpby_flag_follows_arg_to_check(bad, arg_to_check, flagged):
    buf = flag()
    xs = filled((8, 9), 1.0, torch.float16)
    ys = filled((8, 9), 1.0, torch.float32)
    (xs if bad == "x" else ys)[3][5] = float("nan")
    outs = [torch.empty(t.shape) for t in xs]
    amp_C.multi_tensor_axpby(1, buf, [xs, ys, outs], 1.0, 1.0, arg_to_check)
    assert buf.item() == int(flagged)
    assert torch.isnan(outs[3][5]) and torch.equal(outs[0], torch.full((8,), 2.0))


def test_axpby_rejects_unknown_arg_to_check():
    with pytest.raises(ValueError, match=r"arg_to_check must be -1 .* 0 .* or 1"):
        amp_C.multi_tensor_axpby(1, flag(), [[torch.ones(2)], [torch.ones(2)], [torch.ones(2)]], 1.0, 1.0, 2)


# ---------------------------------------------------------------------------------------------------
# The applier, bad inputs, empty lists, unknown names
# ---------------------------------------------------------------------------------------------------


def test_applier_passes_its_chunk_size_and_arguments():
    seen = []
    applier = MultiTensorApply(333)
    result = applier(lambda *args: seen.append(args) or "done", "buf", [["a"]], 1, 2)
    assert result == "done" and seen == [(333, "buf", [["a"]], 1, 2)]
    assert multi_tensor_applier.chunk_size == 2048 * 32 and multi_tensor_applier.available and MultiTensorApply.available
    multi_tensor_applier.check_avail()
    with pytest.raises(ValueError, match="chunk_size must be a positive int"):
        MultiTensorApply(0)
    with pytest.raises(ValueError, match="op must be an amp_C function"):
        multi_tensor_applier("multi_tensor_scale", flag(), [[], []])


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (
            lambda: amp_C.multi_tensor_scale(1, flag(), [[torch.ones(2)]], 1.0),
            r"tensor_lists=\[inputs, outputs\] \(2 lists of tensors\), got 1 list",
        ),
        (lambda: amp_C.multi_tensor_axpby(1, flag(), [[], []], 1.0, 1.0, -1), r"tensor_lists=\[x, y, out\] \(3 lists"),
        (lambda: amp_C.multi_tensor_l2norm(1, flag(), [torch.ones(2)]), "tensors entry of tensor_lists must be a list"),
        (
            lambda: amp_C.multi_tensor_scale(1, flag(), [[torch.ones(2), torch.ones(2)], [torch.ones(2)]], 1.0),
            "outputs list has 1 tensors but inputs has 2",
        ),
        (
            lambda: amp_C.multi_tensor_scale(1, flag(), [[torch.ones(2)], [torch.ones(3)]], 1.0),
            r"outputs\[0\] has 3 elements .* inputs\[0\] has 2",
        ),
        (lambda: amp_C.multi_tensor_l2norm(1, flag(), [[torch.ones(2, dtype=torch.int64)]]), "dtype torch.int64; valid dtypes"),
        (lambda: amp_C.multi_tensor_l2norm(1, None, [[torch.ones(2)]]), "noop_flag must be a one-element tensor"),
        (lambda: amp_C.multi_tensor_scale(1, flag(), [[torch.ones(2)], [torch.ones(2)]], "x"), "scale must be a number"),
    ],
)
def test_bad_inputs_raise_value_errors(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_empty_lists_are_no_ops():
    buf = flag()
    assert amp_C.multi_tensor_scale(1, buf, [[], []], 2.0) is None
    amp_C.multi_tensor_axpby(1, buf, [[], [], []], 1.0, 1.0, -1)
    norm, norms = amp_C.multi_tensor_l2norm(1, buf, [[]], True)
    assert torch.equal(norm, torch.zeros(1)) and norms.shape == (0,)
    assert buf.item() == 0


@pytest.mark.parametrize("mode, reference", [(0, torch.optim.Adam), (1, torch.optim.AdamW)], ids=["L2", "AdamW"])
def test_multi_tensor_adam_is_apex_kernels_step(mode, reference):
    """fairseq's FusedAdamV2 steps through it: mode 0 adds the decay to the gradient (torch's Adam), 1
    decays decoupled (AdamW); fp16 params and fp32 moments in fp32 math; bias_correction=0 skips it."""
    torch.manual_seed(0)
    params = [torch.randn(7, 3), torch.randn(5)]
    grads = [torch.randn_like(p) for p in params]
    ref = [p.clone().requires_grad_() for p in params]
    optimizer = reference(ref, lr=0.01, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1)
    moments = [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params]
    half = [p.half() for p in params]
    half_moments = [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params]
    for step in range(1, 4):
        for r, g in zip(ref, grads):
            r.grad = g.clone()
        optimizer.step()
        amp_C.multi_tensor_adam(2048, torch.zeros(1, dtype=torch.int), [grads, params, *moments], 0.01, 0.8, 0.99, 1e-6, step, mode, 1, 0.1)
        fp16_grads = [g.half() for g in grads]
        amp_C.multi_tensor_adam(
            2048, torch.zeros(1, dtype=torch.int), [fp16_grads, half, *half_moments], 0.01, 0.8, 0.99, 1e-6, step, mode, 1, 0.1
        )
    for got, want, low in zip(params, ref, half):
        torch.testing.assert_close(got, want.detach(), atol=1e-6, rtol=1e-5)
        assert low.dtype == torch.float16
        torch.testing.assert_close(low.float(), want.detach(), atol=2e-3, rtol=2e-3)
    p, g, m, v = torch.ones(4), torch.ones(4), torch.zeros(4), torch.zeros(4)
    amp_C.multi_tensor_adam(2048, torch.zeros(1, dtype=torch.int), [[g], [p], [m], [v]], 0.1, 0.9, 0.999, 0.0, 1, mode, 0, 0.0)
    torch.testing.assert_close(p, torch.full((4,), 1 - 0.1 * 0.1 / 0.001**0.5))  # uncorrected moments: m=0.1, v=0.001
    with pytest.raises(ValueError, match="mode must be 0"):
        amp_C.multi_tensor_adam(2048, torch.zeros(1, dtype=torch.int), [[g], [p], [m], [v]], 0.1, 0.9, 0.999, 1e-8, 1, 2, 1, 0.0)
    with pytest.raises(ValueError, match="step must be a whole number >= 1"):
        amp_C.multi_tensor_adam(2048, torch.zeros(1, dtype=torch.int), [[g], [p], [m], [v]], 0.1, 0.9, 0.999, 1e-8, 0, mode, 1, 0.0)


def test_unknown_names_point_to_replacements():
    with pytest.raises(ImportError, match=r"amp_C.multi_tensor_adam_capturable is not provided by ampddp.apex; use torch.optim"):
        from ampddp.apex.amp_C import multi_tensor_adam_capturable  # noqa: F401
    assert not hasattr(amp_C, "multi_tensor_lamb")
    with pytest.raises(ImportError, match="provides: MultiTensorApply, multi_tensor_applier"):
        from ampddp.apex.multi_tensor_apply import something_else  # noqa: F401


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_ops_match_cpu_and_do_not_sync():
    buf = torch.zeros(1, dtype=torch.int, device="cuda")
    ins = [t.cuda() for t in rand_list((1000, 33), torch.float16)]
    outs = [torch.empty(t.shape, device="cuda") for t in ins]
    amp_C.multi_tensor_scale(1, buf, [ins, outs], 0.5)
    norm, norms = amp_C.multi_tensor_l2norm(1, buf, [outs], True)
    amp_C.multi_tensor_axpby(1, buf, [ins, outs, outs], 1.0, 2.0, -1)
    assert norm.device.type == "cuda" and buf.item() == 0
    torch.testing.assert_close(norms.cpu(), torch.stack([(t.float() * 0.5).norm() for t in ins]).cpu())
    torch.testing.assert_close(outs[0].cpu(), ins[0].float().cpu() * 2)
