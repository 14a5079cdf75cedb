"""apex's ``amp_C`` extension (the common multi-tensor ops) on torch's ``_foreach`` kernels, for any device.

apex-era code calls ``multi_tensor_applier(amp_C.multi_tensor_scale, overflow_buf, [srcs, dsts], scale)``
and friends; apex built ``amp_C`` as a CUDA-only C++ extension. These functions keep its call
signatures (``chunk_size`` first, then the overflow/noop flag, the tensor lists and the op's arguments)
and its semantics:

* arithmetic in float32 (float64 for float64 tensors), results written in each output's dtype, so
  lists may mix float16/bfloat16/float32 between inputs and outputs;
* ``noop_flag`` (apex: ``torch.zeros(1, dtype=torch.int, device=...)``) is set to 1 when a non-finite
  value is seen in the checked inputs, and never cleared; nothing here reads it first or synchronises
  the host with the device;
* the returned norms are float32 tensors of shape ``[1]`` and ``[ntensors]`` (``[0]`` when
  ``per_tensor`` is false), on the tensors' device.

``chunk_size`` is accepted and unused: torch's foreach kernels choose their own launch shapes. Unlike
apex, tensors need not be CUDA or contiguous, an empty list is a no-op, and matching tensors may differ
in shape as long as their element counts agree (apex paired them by flat position).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ampddp.apex._names import unknown_name

__all__ = ["multi_tensor_scale", "multi_tensor_l2norm", "multi_tensor_unscale_l2norm", "multi_tensor_axpby", "multi_tensor_adam"]

_OPTIMIZER_OPS = "torch.optim with foreach=True/fused=True, or the optimizers in ampddp.apex.optimizers (apex's fused optimizer kernels)"
REPLACEMENTS = {
    "multi_tensor_sgd": "torch.optim.SGD(..., foreach=True) or ampddp.apex.optimizers.FusedSGD",
    "multi_tensor_adam_capturable": "torch.optim.Adam/AdamW(..., capturable=True, fused=True)",
    "multi_tensor_adam_capturable_master": "torch.optim.Adam/AdamW(..., capturable=True, fused=True) on fp32 master params",
    "multi_tensor_adagrad": "ampddp.apex.optimizers.FusedAdagrad (the whole optimizer step)",
    "multi_tensor_novograd": "ampddp.apex.optimizers.FusedNovoGrad (the whole optimizer step)",
    "multi_tensor_lamb": "ampddp.apex.optimizers.FusedLAMB (the whole optimizer step)",
    "multi_tensor_lamb_mp": "ampddp.apex.optimizers.FusedLAMB (the whole optimizer step)",
    "multi_tensor_lamb_stage1_cuda": _OPTIMIZER_OPS,
    "multi_tensor_lamb_stage2_cuda": _OPTIMIZER_OPS,
    "multi_tensor_l2norm_mp": "amp_C.multi_tensor_l2norm (same arguments; float32 accumulation for every input dtype)",
    "multi_tensor_l2norm_scale": "amp_C.multi_tensor_scale followed by amp_C.multi_tensor_l2norm",
    "update_scale_hysteresis": "torch.amp.GradScaler (its growth/backoff replaces apex's hysteresis update)",
}

_FLOATING = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


# ---------------------------------------------------------------------------------------------------
# Argument checks: ValueError naming the bad list/tensor and what is valid
# ---------------------------------------------------------------------------------------------------


def _lists(op: str, tensor_lists: Any, names: tuple[str, ...]) -> list[list[torch.Tensor]]:
    layout = f"tensor_lists=[{', '.join(names)}] ({len(names)} list{'s' if len(names) > 1 else ''} of tensors)"
    if isinstance(tensor_lists, torch.Tensor) or not isinstance(tensor_lists, Sequence):
        raise ValueError(f"{op} expects {layout}, got {type(tensor_lists).__name__}")
    if len(tensor_lists) != len(names):
        raise ValueError(f"{op} expects {layout}, got {len(tensor_lists)} list{'s' if len(tensor_lists) != 1 else ''}")
    lists: list[list[torch.Tensor]] = []
    for name, entry in zip(names, tensor_lists):
        if isinstance(entry, torch.Tensor) or not isinstance(entry, Sequence):
            raise ValueError(f"{op}: the {name} entry of tensor_lists must be a list of tensors, got {type(entry).__name__}")
        lists.append(list(entry))
    count = len(lists[0])
    for name, entry in zip(names[1:], lists[1:]):
        if len(entry) != count:
            raise ValueError(
                f"{op}: the {name} list has {len(entry)} tensors but {names[0]} has {count}; "
                f"each list needs one tensor per {names[0]} tensor"
            )
    for name, entry in zip(names, lists):
        _check_tensors(op, name, entry, names[0], lists[0])
    return lists


def _check_tensors(op: str, name: str, entry: list[Any], first_name: str, first_list: list[torch.Tensor]) -> None:
    """Each of ``entry`` a floating tensor with as many elements as its counterpart in the first list."""
    for i, t in enumerate(entry):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{op}: {name}[{i}] is a {type(t).__name__}, not a torch.Tensor")
        if t.dtype not in _FLOATING:
            raise ValueError(f"{op}: {name}[{i}] has dtype {t.dtype}; valid dtypes are float16, bfloat16, float32, float64")
        first = first_list[i]
        if t.numel() != first.numel():
            raise ValueError(
                f"{op}: {name}[{i}] has {t.numel()} elements (shape {tuple(t.shape)}) but {first_name}[{i}] has {first.numel()} "
                f"(shape {tuple(first.shape)}); matching tensors must have the same number of elements"
            )


def _check_flag(op: str, noop_flag: Any) -> None:
    if not isinstance(noop_flag, torch.Tensor) or noop_flag.numel() < 1:
        got = f"a tensor of shape {tuple(noop_flag.shape)}" if isinstance(noop_flag, torch.Tensor) else type(noop_flag).__name__
        raise ValueError(f"{op}: noop_flag must be a one-element tensor such as torch.zeros(1, dtype=torch.int, device=...), got {got}")
    if noop_flag.numel() > 1 and not noop_flag.is_contiguous():
        raise ValueError(f"{op}: noop_flag has {noop_flag.numel()} non-contiguous elements; pass a one-element tensor")


def _raise_flag(noop_flag: torch.Tensor, nonfinite: torch.Tensor) -> None:
    """Set ``noop_flag``'s first element to 1 where ``nonfinite`` (a one-element bool tensor) is true, on device."""
    mask = nonfinite.reshape(()).to(noop_flag.device)
    target = noop_flag if noop_flag.numel() == 1 else noop_flag.view(-1)[:1]
    target.masked_fill_(mask, 1)


def _scalar(op: str, name: str, value: Any, device: torch.device) -> torch.Tensor:
    """``value`` (a number or one-element tensor) as the one-element float32 tensor torch's unscale kernel takes."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{op}: {name} must be a number or a one-element tensor, got a tensor of shape {tuple(value.shape)}")
        return value.detach().to(device=device, dtype=torch.float32).reshape(1)
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{op}: {name} must be a number or a one-element tensor, got {type(value).__name__}") from None
    return torch.full((1,), number, dtype=torch.float32, device=device)


def _by_device(tensors: list[torch.Tensor]) -> dict[torch.device, list[int]]:
    groups: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault(t.device, []).append(i)
    return groups


def _by_dtype(tensors: list[torch.Tensor]) -> dict[torch.dtype, list[int]]:
    groups: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault(t.dtype, []).append(i)
    return groups


def _holds(out: torch.dtype, src: torch.dtype) -> bool:
    """Whether every ``src`` value converts to ``out`` exactly (so copying first, then scaling, is exact)."""
    return (
        out == src
        or (src in (torch.float16, torch.bfloat16) and out in (torch.float32, torch.float64))
        or (src, out)
        == (
            torch.float32,
            torch.float64,
        )
    )


def _acc(*dtypes: torch.dtype) -> torch.dtype:
    result = torch.float32
    for d in dtypes:
        result = torch.promote_types(result, d)
    return result


def _check_and_scale(tensors: list[torch.Tensor], found: torch.Tensor, scale: torch.Tensor) -> None:
    """In place: ``t *= scale`` for each tensor, ``found`` set to 1.0 if any *input* value was inf/nan.

    torch's kernel (GradScaler's) takes the fast multi-tensor route only for one dtype at a time, so the
    tensors go to it grouped by dtype, as GradScaler groups them.
    """
    for group in _by_dtype(tensors).values():
        torch._amp_foreach_non_finite_check_and_unscale_([tensors[i] for i in group], found, scale)


# ---------------------------------------------------------------------------------------------------
# Ops
# ---------------------------------------------------------------------------------------------------


def multi_tensor_scale(
    chunk_size: int, noop_flag: torch.Tensor, tensor_lists: Sequence[Sequence[torch.Tensor]], scale: float | torch.Tensor
) -> None:
    """``outputs[i] = inputs[i] * scale`` (float32 math, written in ``outputs[i]``'s dtype); in place when they are the same tensor.

    ``noop_flag`` is set to 1 if any input holds inf/nan (the outputs are still written, as apex did).
    ``scale`` may also be a one-element tensor, which avoids a host-device sync.
    """
    op = "multi_tensor_scale"
    _check_flag(op, noop_flag)
    inputs, outputs = _lists(op, tensor_lists, ("inputs", "outputs"))
    with torch.no_grad():
        for device, idx in _by_device(outputs).items():
            found = torch.zeros(1, dtype=torch.float32, device=device)
            factor = _scalar(op, "scale", scale, device)
            direct: list[torch.Tensor] = []  # outputs holding the inputs' values, scaled in place
            copy_dst: list[torch.Tensor] = []
            copy_src: list[torch.Tensor] = []
            staged: list[torch.Tensor] = []  # float32 copies of inputs whose output dtype would round them
            staged_dst: list[torch.Tensor] = []
            for i in idx:
                src, dst = inputs[i], outputs[i]
                if src is dst:
                    direct.append(dst)
                elif _holds(dst.dtype, src.dtype):
                    copy_dst.append(dst)
                    copy_src.append(src.reshape(dst.shape))
                    direct.append(dst)
                else:
                    staged.append(src.to(device=device, dtype=_acc(src.dtype), copy=True).reshape(dst.shape))
                    staged_dst.append(dst)
            if copy_dst:
                torch._foreach_copy_(copy_dst, copy_src)
            _check_and_scale(direct + staged, found, factor)
            if staged_dst:
                torch._foreach_copy_(staged_dst, staged)
            _raise_flag(noop_flag, found > 0)


def multi_tensor_axpby(
    chunk_size: int, noop_flag: torch.Tensor, tensor_lists: Sequence[Sequence[torch.Tensor]], a: float, b: float, arg_to_check: int
) -> None:
    """``out[i] = a * x[i] + b * y[i]`` in float32 math, written in ``out[i]``'s dtype (``out`` may be ``y`` or ``x``).

    ``arg_to_check`` says whose inf/nan values set ``noop_flag``: -1 both x and y, 0 only x, 1 only y.
    """
    op = "multi_tensor_axpby"
    _check_flag(op, noop_flag)
    if arg_to_check not in (-1, 0, 1) or isinstance(arg_to_check, bool):
        raise ValueError(f"{op}: arg_to_check must be -1 (check x and y), 0 (check x) or 1 (check y), got {arg_to_check!r}")
    xs, ys, outs = _lists(op, tensor_lists, ("x", "y", "out"))
    with torch.no_grad():
        for device, idx in _by_device(outs).items():
            found = torch.zeros(1, dtype=torch.float32, device=device)
            xt, yt = [], []
            for i in idx:
                acc = _acc(xs[i].dtype, ys[i].dtype)
                shape = outs[i].shape
                xt.append(xs[i].to(device=device, dtype=acc, copy=True).reshape(shape))
                yt.append(ys[i].to(device=device, dtype=acc, copy=True).reshape(shape))
            for name, temps, factor, checked in (("a", xt, a, arg_to_check in (-1, 0)), ("b", yt, b, arg_to_check in (-1, 1))):
                factor_t = _scalar(op, name, factor, device)
                if checked:
                    _check_and_scale(temps, found, factor_t)
                else:
                    torch._foreach_mul_(temps, factor_t.reshape(()))
            torch._foreach_add_(xt, yt)
            torch._foreach_copy_([outs[i] for i in idx], xt)
            _raise_flag(noop_flag, found > 0)


def _norms(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Per-tensor L2 norms as one float32 vector on ``device``; float32 accumulation (float64 for float64 tensors)."""
    norms: list[torch.Tensor] = [torch.empty(0)] * len(tensors)
    for dtype, group in _by_dtype(tensors).items():  # one dtype per call keeps torch's fast multi-tensor route
        members = [tensors[i] for i in group]
        # float64 cannot be reduced "to" float32 by vector_norm's dtype argument: reduce in float64, then convert.
        results = torch._foreach_norm(members, 2) if dtype == torch.float64 else torch._foreach_norm(members, 2, dtype=torch.float32)
        for i, n in zip(group, results):
            norms[i] = n.to(device=device, dtype=torch.float32)
    return torch.stack(norms)


def _l2norm(
    op: str, noop_flag: torch.Tensor, tensors: list[torch.Tensor], per_tensor: bool | None, inv_scale: Any = None
) -> tuple[torch.Tensor, torch.Tensor]:
    device = tensors[0].device if tensors else noop_flag.device
    with torch.no_grad():
        if not tensors:
            per = torch.zeros(0, dtype=torch.float32, device=device)
        else:
            per = _norms(tensors, device)
            if inv_scale is not None:
                per = per * _scalar(op, "inv_scale", inv_scale, device).abs()
        total = torch.linalg.vector_norm(per).reshape(1)
        _raise_flag(noop_flag, ~torch.isfinite(total))
    if not per_tensor:
        per = torch.empty(0, dtype=torch.float32, device=device)
    return total, per


def multi_tensor_l2norm(
    chunk_size: int, noop_flag: torch.Tensor, tensor_lists: Sequence[Sequence[torch.Tensor]], per_tensor: bool | None = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(total_norm, per_tensor_norms)``: the L2 norm over all tensors, shape ``[1]`` float32, and each tensor's norm.

    ``per_tensor_norms`` has shape ``[ntensors]`` when ``per_tensor`` is true, else shape ``[0]``, as apex
    returned. Squares are accumulated in float32 for half inputs. ``noop_flag`` is set to 1 if the norm
    is not finite.
    """
    op = "multi_tensor_l2norm"
    _check_flag(op, noop_flag)
    (tensors,) = _lists(op, tensor_lists, ("tensors",))
    return _l2norm(op, noop_flag, tensors, per_tensor)


def multi_tensor_unscale_l2norm(
    chunk_size: int,
    noop_flag: torch.Tensor,
    tensor_lists: Sequence[Sequence[torch.Tensor]],
    inv_scale: torch.Tensor | float,
    per_tensor: bool | None = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`multi_tensor_l2norm` of the tensors multiplied by ``inv_scale`` (a one-element tensor), without changing them."""
    op = "multi_tensor_unscale_l2norm"
    _check_flag(op, noop_flag)
    (tensors,) = _lists(op, tensor_lists, ("tensors",))
    return _l2norm(op, noop_flag, tensors, per_tensor, inv_scale)


ADAM_L2, ADAM_W = 0, 1
"""``multi_tensor_adam``'s ``mode``: weight decay added to the gradient (L2), or decoupled (AdamW)."""


def multi_tensor_adam(
    chunk_size: int,
    noop_flag: torch.Tensor,
    tensor_lists: Sequence[Sequence[torch.Tensor]],
    lr: float,
    beta1: float,
    beta2: float,
    epsilon: float,
    step: int,
    mode: int,
    bias_correction: int,
    weight_decay: float,
) -> None:
    """One Adam step over ``[grads, params, exp_avgs, exp_avg_sqs]`` in place, apex's kernel math in float32
    (fairseq's FusedAdamV2 calls it through ``FusedAdam.multi_tensor_adam``): ``mode`` 0 adds
    ``weight_decay * p`` to the gradient, 1 decays ``p`` decoupled; ``bias_correction`` 1 divides the
    moments by ``1 - beta**step``. Params and moments keep their dtypes. ``noop_flag`` is not read, as
    apex's kernel did not."""
    op = "multi_tensor_adam"
    _check_flag(op, noop_flag)
    if mode not in (ADAM_L2, ADAM_W) or isinstance(mode, bool):
        raise ValueError(f"{op}: mode must be 0 (L2 weight decay) or 1 (decoupled, AdamW), got {mode!r}")
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ValueError(f"{op}: step must be a whole number >= 1 (the step being taken), got {step!r}")
    grads, params, exp_avgs, exp_avg_sqs = _lists(op, tensor_lists, ("grads", "params", "exp_avgs", "exp_avg_sqs"))
    corrections = (1 - beta1**step, 1 - beta2**step) if bias_correction == 1 else (1.0, 1.0)
    with torch.no_grad():
        for _, idx in _by_device(params).items():
            g, p, m, v = _accumulation_copies(grads, params, exp_avgs, exp_avg_sqs, idx)
            decays = (0.0, weight_decay) if mode == ADAM_W else (weight_decay, 0.0)
            _adam_in_place(g, p, m, v, lr, (beta1, beta2), epsilon, corrections, decays)
            for targets, values in ((params, p), (exp_avgs, m), (exp_avg_sqs, v)):
                torch._foreach_copy_([targets[i] for i in idx], values)


def _accumulation_copies(
    grads: list[torch.Tensor], params: list[torch.Tensor], exp_avgs: list[torch.Tensor], exp_avg_sqs: list[torch.Tensor],
    idx: list[int],
) -> tuple[list[torch.Tensor], ...]:  # fmt: skip
    """Copies of the ``idx`` entries in the accumulation dtype (float32 for low-precision tensors), in the params' shapes."""
    acc = [_acc(params[i].dtype, grads[i].dtype) for i in idx]
    return tuple(
        [tensors[i].to(dtype=a, copy=True).reshape(params[i].shape) for i, a in zip(idx, acc)]
        for tensors in (grads, params, exp_avgs, exp_avg_sqs)
    )


def _adam_in_place(
    g: list[torch.Tensor], p: list[torch.Tensor], m: list[torch.Tensor], v: list[torch.Tensor], lr: float,
    betas: tuple[float, float], epsilon: float, corrections: tuple[float, float], decays: tuple[float, float],
) -> None:  # fmt: skip
    """Adam's step on the accumulation-dtype copies; ``decays``: (L2 weight decay added to the gradient,
    decoupled weight decay added to the update, AdamW's), one of them 0."""
    if decays[0] != 0:
        torch._foreach_add_(g, p, alpha=decays[0])
    torch._foreach_lerp_(m, g, 1 - betas[0])
    torch._foreach_mul_(v, betas[1])
    torch._foreach_addcmul_(v, g, g, value=1 - betas[1])
    denom = torch._foreach_div(v, corrections[1])
    torch._foreach_sqrt_(denom)
    torch._foreach_add_(denom, epsilon)
    update = torch._foreach_div(m, corrections[0])
    torch._foreach_div_(update, denom)
    if decays[1] != 0:
        torch._foreach_add_(update, p, alpha=decays[1])
    torch._foreach_add_(p, update, alpha=-lr)


def __getattr__(name: str) -> Any:
    raise unknown_name(__name__, name, REPLACEMENTS, __all__)
