"""ampddp.apex.normalization against torch's norms and a float64 reference: values, grads, apex's dtype rules, checkpoints."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ampddp.apex.normalization import FusedLayerNorm, FusedRMSNorm, MixedFusedLayerNorm, MixedFusedRMSNorm
from ampddp.apex.normalization import fused_layer_norm as fln

HALF_TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (1e-2, 1e-2), torch.bfloat16: (2e-2, 4e-2)}
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def rms_reference(x: torch.Tensor, shape: tuple[int, ...], weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm written out in float64: x / sqrt(mean(x^2) + eps) * weight."""
    dims = tuple(range(-len(shape), 0))
    x = x.double()
    y = x / torch.sqrt(x.pow(2).mean(dims, keepdim=True) + eps)
    return y if weight is None else y * weight.double()


def layer_reference(x: torch.Tensor, shape: tuple[int, ...], weight, bias, eps: float) -> torch.Tensor:
    return F.layer_norm(x.double(), shape, None if weight is None else weight.double(), None if bias is None else bias.double(), eps)


def close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    rtol, atol = HALF_TOL[dtype]
    torch.testing.assert_close(actual.double(), expected.double(), rtol=rtol, atol=atol)


def randomize(module: nn.Module) -> nn.Module:
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p) * 0.5 + 1.0)
    return module


def run(module: nn.Module, x: torch.Tensor, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    x = x.detach().requires_grad_(True)
    y = module(x)
    y.backward(dy)
    return y, x.grad, [p.grad for p in module.parameters()]


def reference_grads(fn, x: torch.Tensor, params: list[torch.Tensor], dy: torch.Tensor):
    x64 = x.detach().double().requires_grad_(True)
    p64 = [p.detach().double().requires_grad_(True) for p in params]
    y = fn(x64, *p64)
    y.backward(dy.double())
    return y, x64.grad, [p.grad for p in p64]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("shape", [(8,), (5, 8)])
def test_fused_layer_norm_matches_float64_forward_and_backward(dtype, affine, shape):
    module = randomize(FusedLayerNorm(shape, elementwise_affine=affine)).to(dtype)
    x = torch.randn(6, 5, 8).to(dtype) * 3 + 1
    dy = torch.randn(6, 5, 8).to(dtype)
    y, dx, dparams = run(module, x, dy)
    assert y.dtype == dtype and dx.dtype == dtype
    params = list(module.parameters())
    ref_y, ref_dx, ref_dparams = reference_grads(
        lambda x, *p: layer_reference(x, shape, *(p if affine else (None, None)), 1e-5), x, params, dy
    )
    close(y, ref_y, dtype)
    close(dx, ref_dx, dtype)
    assert len(dparams) == (2 if affine else 0)
    for got, want in zip(dparams, ref_dparams):
        assert got.dtype == dtype
        close(got, want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("affine", [True, False])
def test_fused_layer_norm_equals_torch_layer_norm(dtype, affine):
    ours = randomize(FusedLayerNorm(8, elementwise_affine=affine)).to(dtype)
    native = nn.LayerNorm(8, elementwise_affine=affine).to(dtype)
    native.load_state_dict(ours.state_dict())
    x = torch.randn(4, 8).to(dtype)
    torch.testing.assert_close(ours(x), native(x), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("shape", [(8,), (5, 8)])
def test_fused_rms_norm_matches_float64_forward_and_backward(dtype, affine, shape):
    module = randomize(FusedRMSNorm(shape, elementwise_affine=affine)).to(dtype)
    x = torch.randn(6, 5, 8).to(dtype) * 3 + 1
    dy = torch.randn(6, 5, 8).to(dtype)
    y, dx, dparams = run(module, x, dy)
    assert y.dtype == dtype and dx.dtype == dtype
    params = list(module.parameters())
    ref_y, ref_dx, ref_dparams = reference_grads(lambda x, *p: rms_reference(x, shape, p[0] if p else None, 1e-5), x, params, dy)
    close(y, ref_y, dtype)
    close(dx, ref_dx, dtype)
    for got, want in zip(dparams, ref_dparams):
        assert got.dtype == dtype
        close(got, want, dtype)
    native = F.rms_norm(x, shape, module.weight, 1e-5)
    torch.testing.assert_close(y, native)


def test_apex_defaults_and_signatures():
    assert FusedLayerNorm(4).eps == 1e-5 and FusedRMSNorm(4).eps == 1e-5
    assert MixedFusedLayerNorm(4).eps == 1e-5 and MixedFusedRMSNorm(4).eps == 1e-5
    m = FusedLayerNorm([2, 4], 1e-3, False, True)  # apex's positional order
    assert m.normalized_shape == (2, 4) and m.eps == 1e-3 and m.weight is None and m.bias is None and m.memory_efficient
    for fn in (
        fln.fused_layer_norm_affine,
        fln.fused_layer_norm,
        fln.mixed_dtype_fused_layer_norm_affine,
        fln.fused_rms_norm_affine,
        fln.fused_rms_norm,
        fln.mixed_dtype_fused_rms_norm_affine,
    ):
        params = inspect.signature(fn).parameters
        assert params["eps"].default == 1e-6, fn.__name__
        assert params["memory_efficient"].default is False, fn.__name__
    assert list(inspect.signature(fln.fused_layer_norm_affine).parameters)[:4] == ["input", "weight", "bias", "normalized_shape"]
    assert list(inspect.signature(fln.fused_rms_norm_affine).parameters)[:3] == ["input", "weight", "normalized_shape"]
    assert "memory_efficient" in inspect.getfullargspec(fln.FusedLayerNormAffineFunction.forward).args  # Megatron probes this
    assert "elementwise_affine=True" in repr(FusedRMSNorm(4))


def test_functional_forms_match_torch():
    x = torch.randn(3, 4, 6)
    w, b = torch.randn(4, 6), torch.randn(4, 6)
    shape = [4, 6]
    torch.testing.assert_close(fln.fused_layer_norm_affine(x, w, b, shape), F.layer_norm(x, shape, w, b, 1e-6))
    torch.testing.assert_close(fln.fused_layer_norm(x, shape), F.layer_norm(x, shape, eps=1e-6))
    torch.testing.assert_close(fln.fused_rms_norm_affine(x, w, shape), rms_reference(x, (4, 6), w, 1e-6).float())
    torch.testing.assert_close(fln.fused_rms_norm(x, shape), rms_reference(x, (4, 6), None, 1e-6).float())
    torch.testing.assert_close(fln.fused_layer_norm(x, 6, 1e-2, memory_efficient=True), F.layer_norm(x, (6,), eps=1e-2))
    torch.testing.assert_close(fln.mixed_dtype_fused_layer_norm_affine(x, w, b, shape), F.layer_norm(x, shape, w, b, 1e-6))
    torch.testing.assert_close(fln.mixed_dtype_fused_rms_norm_affine(x, w, shape), fln.fused_rms_norm_affine(x, w, shape))
    # apex's autograd.Function entry points, positional as Megatron calls them
    torch.testing.assert_close(fln.FusedLayerNormAffineFunction.apply(x, w, b, shape, 1e-5), F.layer_norm(x, shape, w, b, 1e-5))
    torch.testing.assert_close(fln.FusedRMSNormAffineFunction.apply(x, w, shape, 1e-5, False), fln.fused_rms_norm_affine(x, w, shape, 1e-5))
    torch.testing.assert_close(fln.FusedLayerNormFunction.apply(x, shape, 1e-5), F.layer_norm(x, shape, eps=1e-5))
    torch.testing.assert_close(fln.FusedRMSNormFunction.apply(x, shape, 1e-5), fln.fused_rms_norm(x, shape, 1e-5))
    half = x.half()
    assert fln.FusedLayerNormAffineMixedDtypesFunction.apply(half, w, b, shape, 1e-5).dtype == torch.float32
    assert fln.FusedRMSNormAffineMixedDtypesFunction.apply(half, w, shape, 1e-5).dtype == torch.float32


def test_functional_backward_reaches_weight_and_input():
    x = torch.randn(3, 6, requires_grad=True)
    w = torch.randn(6, requires_grad=True)
    fln.fused_rms_norm_affine(x, w, (6,)).square().sum().backward()
    _, ref_dx, (ref_dw,) = reference_grads(
        lambda x, w: rms_reference(x, (6,), w, 1e-6), x, [w], 2 * fln.fused_rms_norm_affine(x, w, (6,)).detach()
    )
    torch.testing.assert_close(x.grad, ref_dx.float(), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(w.grad, ref_dw.float(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("cls", [MixedFusedLayerNorm, MixedFusedRMSNorm])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_mixed_keeps_fp32_params_and_returns_their_dtype(cls, dtype):
    module = randomize(cls(8))
    assert all(p.dtype == torch.float32 for p in module.parameters())
    x = (torch.randn(4, 8) * 2).to(dtype)
    dy = torch.randn(4, 8)
    y, dx, dparams = run(module, x, dy)
    assert y.dtype == torch.float32  # apex's *_mixed_dtypes kernels: output in the weight's dtype
    assert dx.dtype == dtype and all(g.dtype == torch.float32 for g in dparams)
    params = list(module.parameters())
    if cls is MixedFusedLayerNorm:
        ref = reference_grads(lambda x, w, b: layer_reference(x, (8,), w, b, 1e-5), x, params, dy)
    else:
        ref = reference_grads(lambda x, w: rms_reference(x, (8,), w, 1e-5), x, params, dy)
    close(y, ref[0], torch.float32)
    close(dx, ref[1], dtype)
    for got, want in zip(dparams, ref[2]):
        close(got, want, torch.float32)


@pytest.mark.parametrize("cls", [MixedFusedLayerNorm, MixedFusedRMSNorm])
def test_mixed_with_half_params_gives_half_output_for_fp32_input(cls):
    module = randomize(cls(8)).half()  # Megatron: fp16 model, fp32 residual stream into the norm
    x = torch.randn(4, 8)
    y = module(x)
    assert y.dtype == torch.float16
    ref = (
        layer_reference(x, (8,), module.weight, module.bias, 1e-5)
        if cls is MixedFusedLayerNorm
        else rms_reference(x, (8,), module.weight, 1e-5)
    )
    close(y, ref, torch.float16)


@pytest.mark.parametrize("cls", [FusedLayerNorm, FusedRMSNorm])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fused_with_fp32_params_returns_input_dtype(cls, dtype):
    module = randomize(cls(8))
    x = torch.randn(4, 8).to(dtype)
    y, dx, dparams = run(module, x, torch.randn(4, 8).to(dtype))
    assert y.dtype == dtype and dx.dtype == dtype and all(g.dtype == torch.float32 for g in dparams)
    ref = (
        layer_reference(x, (8,), module.weight, module.bias, 1e-5) if cls is FusedLayerNorm else rms_reference(x, (8,), module.weight, 1e-5)
    )
    close(y, ref, dtype)


@pytest.mark.parametrize("cls", [FusedLayerNorm, FusedRMSNorm, MixedFusedLayerNorm, MixedFusedRMSNorm])
def test_autocast_runs_in_the_autocast_dtype_like_apex(cls):
    module = randomize(cls(8))
    x = torch.randn(4, 8, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = module(x)
    assert y.dtype == torch.bfloat16  # apex cast input and params to the autocast dtype (not fp32 as nn.LayerNorm)
    y.float().sum().backward()
    assert x.grad.dtype == torch.float32 and module.weight.grad.dtype == torch.float32
    ref = (
        layer_reference(x, (8,), module.weight, module.bias, 1e-5)
        if "Layer" in cls.__name__
        else rms_reference(x, (8,), module.weight, 1e-5)
    )
    close(y, ref, torch.bfloat16)


def test_mixed_refuses_elementwise_affine_false():
    for cls in (MixedFusedLayerNorm, MixedFusedRMSNorm):
        with pytest.raises(ValueError, match="elementwise_affine=False"):
            cls(8, elementwise_affine=False)
        assert cls(8, elementwise_affine=True).weight is not None
        with pytest.raises(TypeError):
            cls(8, 1e-5, True)  # apex: memory_efficient and the rest are keyword-only


@pytest.mark.parametrize(("ours", "native"), [(FusedLayerNorm, nn.LayerNorm), (MixedFusedLayerNorm, nn.LayerNorm)])
def test_layer_norm_state_dict_loads_both_ways(ours, native):
    a = randomize(ours(8))
    b = native(8)
    b.load_state_dict(a.state_dict(), strict=True)
    assert set(a.state_dict()) == {"weight", "bias"}
    torch.testing.assert_close(b.weight, a.weight)
    c = ours(8)
    c.load_state_dict(randomize(native(8)).state_dict(), strict=True)
    assert isinstance(a, nn.LayerNorm)
    assert FusedLayerNorm(8, elementwise_affine=False).state_dict() == {}


@pytest.mark.parametrize("ours", [FusedRMSNorm, MixedFusedRMSNorm])
def test_rms_norm_state_dict_loads_both_ways(ours):
    a = randomize(ours(8))
    b = nn.RMSNorm(8)
    b.load_state_dict(a.state_dict(), strict=True)
    assert set(a.state_dict()) == {"weight"}
    ours(8).load_state_dict(randomize(nn.RMSNorm(8)).state_dict(), strict=True)
    assert isinstance(a, nn.RMSNorm)
    x = torch.randn(3, 8)
    torch.testing.assert_close(a(x), F.rms_norm(x, (8,), b.weight, 1e-5))


def test_manual_rms_norm_keeps_apex_dtypes():
    x = torch.randn(3, 8).half()
    assert fln.manual_rms_norm(x, (8,), None, 1e-5).dtype == torch.float32
    assert fln.manual_rms_norm(x, (8,), torch.ones(8, dtype=torch.bfloat16), 1e-5).dtype == torch.bfloat16
    y = fln.manual_rms_norm(x, [8], torch.full((8,), 2.0), 1e-5)
    assert y.dtype == torch.float32
    close(y, rms_reference(x, (8,), torch.full((8,), 2.0), 1e-5), torch.float32)


def test_bad_inputs_raise_value_errors_naming_the_problem():
    with pytest.raises(ValueError, match=r"does not end in normalized_shape \(8,\)"):
        FusedLayerNorm(8)(torch.randn(3, 7))
    with pytest.raises(ValueError, match="does not end in normalized_shape"):
        fln.fused_rms_norm(torch.randn(8), (2, 8))
    with pytest.raises(ValueError, match=r"weight has shape \(7,\)"):
        fln.fused_layer_norm_affine(torch.randn(2, 8), torch.ones(7), torch.zeros(8), (8,))
    with pytest.raises(ValueError, match="floating"):
        FusedRMSNorm(4)(torch.ones(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="normalized_shape"):
        fln.fused_layer_norm(torch.randn(2, 4), "4")


def test_unknown_names_get_clear_errors():
    import ampddp.apex.normalization as norm_pkg

    with pytest.raises(ImportError, match=r"apex\.normalization\.FusedGroupNorm is not provided by ampddp\.apex; use torch\.nn\.GroupNorm"):
        from ampddp.apex.normalization import FusedGroupNorm  # noqa: F401
    with pytest.raises(ImportError, match=r"provides: .*fused_rms_norm_affine"):
        from ampddp.apex.normalization.fused_layer_norm import fused_group_norm  # noqa: F401
    assert not hasattr(norm_pkg, "fused_layer_norm_cuda")
    assert norm_pkg.fused_layer_norm is fln


def test_compiles_without_graph_breaks():
    module = FusedRMSNorm(8)
    x = torch.randn(2, 8)
    compiled = torch.compile(module, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(x), module(x))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("cls", [FusedLayerNorm, FusedRMSNorm, MixedFusedLayerNorm, MixedFusedRMSNorm])
def test_cuda_matches_cpu(cls):
    cpu = randomize(cls(64))
    gpu = cls(64).cuda()
    gpu.load_state_dict(cpu.state_dict())
    x = torch.randn(32, 64)
    for dtype in DTYPES:
        got = gpu(x.to("cuda", dtype))
        want = cpu(x.to(dtype))
        assert got.dtype == want.dtype
        close(got.cpu(), want, dtype)
