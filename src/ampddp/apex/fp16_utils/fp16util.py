"""apex.fp16_utils.fp16util: the "manual mixed precision" helpers of pre-amp apex, on native torch.

Scripts from before ``apex.amp`` made the model half by hand (``network_to_half`` / ``FP16Model``),
kept fp32 master copies themselves (``prep_param_lists``) and moved gradients and weights between
the two (``model_grads_to_master_grads`` / ``master_params_to_model_params``). apex deleted these
with amp; they are kept here with apex's semantics so such scripts run unchanged. The copies use
torch's foreach kernels (one call per list instead of one per tensor).

Deviations from apex, each where apex crashed or silently did the wrong thing: ``FP16Model``
casts only floating-point inputs (apex also turned integer token ids into half); the flat-master
helpers reject mismatched lists and missing gradients with a message instead of an AttributeError;
a flat master's ``.grad`` starts zeroed instead of uninitialised.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.nn.modules.batchnorm import _BatchNorm

from ampddp.apex._names import unknown_name
from ampddp.errors import AmpUsageError, ConfigError

__all__ = [
    "BN_convert_float",
    "FP16Model",
    "backwards_debug_hook",
    "clip_grad_norm",
    "convert_module",
    "convert_network",
    "master_params_to_model_params",
    "model_grads_to_master_grads",
    "network_to_half",
    "prep_param_lists",
    "to_python_float",
    "tofp16",
]
REPLACEMENTS = {
    "FP16_Module": "apex.fp16_utils.FP16Model (or network_to_half)",
    "fp32_to_fp16": "tensor.half(), or ampddp.precision.casting.cast_floating(obj, torch.float16) for nested inputs",
    "fp16_to_fp32": "tensor.float(), or ampddp.precision.casting.cast_floating(obj, torch.float32) for nested outputs",
    "Fused_Weight_Norm": "torch.nn.utils.parametrizations.weight_norm",
}

clip_grad_norm = torch.nn.utils.clip_grad_norm_
"""apex's alias for torch's in-place gradient clipping (``clip_grad_norm_``)."""


class tofp16(nn.Module):
    """A module whose forward is ``input.half()``: the first layer ``network_to_half`` adds."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return input.half()


def _is_affine_batchnorm(module: nn.Module) -> bool:
    return isinstance(module, _BatchNorm) and module.affine is True


def BN_convert_float(module: nn.Module) -> nn.Module:
    """Put every affine BatchNorm inside ``module`` (itself included) back in fp32; returns ``module``.

    Non-affine BatchNorm stays as it is, as in apex: it has no weights to keep precise.
    """
    for sub in module.modules():
        if _is_affine_batchnorm(sub):
            sub.float()
    return module


def network_to_half(network: nn.Module) -> nn.Sequential:
    """``nn.Sequential(tofp16(), network)`` with ``network`` made half except its affine BatchNorms."""
    if not isinstance(network, nn.Module):
        raise ConfigError(f"network_to_half needs a torch.nn.Module, got {type(network).__name__}")
    return nn.Sequential(tofp16(), BN_convert_float(network.half()))


def convert_module(module: nn.Module, dtype: torch.dtype) -> None:
    """Cast ``module``'s own floating params (and their grads) and buffers to ``dtype``, in place.

    Parameter objects are kept (only ``.data`` changes), so optimizers built earlier still hold them.
    """
    for param in module.parameters(recurse=False):
        if param.is_floating_point():
            param.data = param.data.to(dtype=dtype)
        if param.grad is not None and param.grad.is_floating_point():
            param.grad.data = param.grad.data.to(dtype=dtype)
    for buffer in module.buffers(recurse=False):
        if buffer.is_floating_point():
            buffer.data = buffer.data.to(dtype=dtype)


def convert_network(network: nn.Module, dtype: torch.dtype) -> nn.Module:
    """``convert_module`` on every module of ``network`` except affine BatchNorms; returns ``network``.

    RNN modules get ``flatten_parameters()`` afterwards, as in apex, so cuDNN sees contiguous weights.
    """
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ConfigError(f"convert_network: dtype={dtype!r} is not valid; pass a floating torch.dtype such as torch.half")
    for module in network.modules():
        if _is_affine_batchnorm(module):
            continue
        convert_module(module, dtype)
        if isinstance(module, nn.RNNBase):
            module.flatten_parameters()
    return network


class FP16Model(nn.Module):
    """The network in half precision (affine BatchNorm kept fp32); floating inputs are cast to half."""

    def __init__(self, network: nn.Module) -> None:
        super().__init__()
        self.network = convert_network(network, dtype=torch.half)

    def forward(self, *inputs: Any) -> Any:
        inputs = tuple(t.half() if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in inputs)
        return self.network(*inputs)


def backwards_debug_hook(grad: torch.Tensor) -> None:
    """A tensor hook that fails loudly: register it on master params that must never get a gradient."""
    raise RuntimeError("master_params recieved a gradient in the backward pass!")


def prep_param_lists(model: nn.Module, flat_master: bool = False) -> tuple[list[nn.Parameter], list[torch.Tensor]]:
    """``(model_params, master_params)``: the model's trainable params and fp32 copies of them.

    With ``flat_master=True`` the masters are one flat fp32 ``nn.Parameter`` (with a zeroed ``.grad``)
    holding every param back to back, as a one-element list.
    """
    if not isinstance(model, nn.Module):
        raise ConfigError(f"prep_param_lists needs a torch.nn.Module, got {type(model).__name__}")
    model_params = [param for param in model.parameters() if param.requires_grad]
    if not flat_master:
        masters = [param.detach().clone().float() for param in model_params]
        for master in masters:
            master.requires_grad_(True)
        return model_params, masters
    if not model_params:
        raise ConfigError("prep_param_lists(flat_master=True): the model has no parameters that require grad")
    devices = {param.device for param in model_params}
    if len(devices) > 1:
        raise ConfigError(
            f"prep_param_lists(flat_master=True) needs every parameter on one device, got {sorted(map(str, devices))}; "
            "use flat_master=False, or FP16_Optimizer"
        )
    flat = nn.Parameter(_flatten_dense_tensors([param.detach() for param in model_params]).float())
    flat.grad = torch.zeros_like(flat)
    return model_params, [flat]


def _check_pairs(what: str, model_params: Sequence[torch.Tensor], master_params: Sequence[torch.Tensor], flat_master: bool) -> None:
    if flat_master:
        total = sum(param.numel() for param in model_params)
        if len(master_params) != 1 or master_params[0].numel() != total:
            sizes = [m.numel() for m in master_params]
            raise ConfigError(
                f"{what}(flat_master=True) needs the one-element master list prep_param_lists(flat_master=True) made "
                f"({total} elements for these model params); got {len(master_params)} master tensor(s) of sizes {sizes}"
            )
    elif len(model_params) != len(master_params):
        raise ConfigError(
            f"{what}: {len(model_params)} model params but {len(master_params)} master params; pass the two lists "
            "prep_param_lists returned (with flat_master=True if the masters are flat)"
        )


def model_grads_to_master_grads(
    model_params: Sequence[torch.Tensor], master_params: Sequence[torch.Tensor], flat_master: bool = False
) -> None:
    """Copy each model param's ``.grad`` into its master's ``.grad`` (fp32); a missing grad clears the master's."""
    model_params, master_params = list(model_params), list(master_params)
    _check_pairs("model_grads_to_master_grads", model_params, master_params, flat_master)
    with torch.no_grad():
        if flat_master:
            missing = [index for index, param in enumerate(model_params) if param.grad is None]
            if missing:
                raise AmpUsageError(
                    f"model_grads_to_master_grads(flat_master=True): model params {missing[:10]} have no .grad (unused in "
                    "the forward pass, or zeroed with set_to_none); a flat master needs every gradient — use flat_master=False"
                )
            flat = master_params[0]
            if flat.grad is None:
                flat.grad = torch.empty_like(flat)
            flat.grad.copy_(_flatten_dense_tensors([param.grad for param in model_params]))
            return
        targets, sources = [], []
        for model, master in zip(model_params, master_params):
            if model.grad is None:
                master.grad = None
                continue
            if master.grad is None:
                master.grad = torch.empty_like(master)
            targets.append(master.grad)
            sources.append(model.grad)
        if targets:
            torch._foreach_copy_(targets, sources)


def master_params_to_model_params(
    model_params: Sequence[torch.Tensor], master_params: Sequence[torch.Tensor], flat_master: bool = False
) -> None:
    """Copy the master weights back into the model params (cast to their dtype)."""
    model_params, master_params = list(model_params), list(master_params)
    _check_pairs("master_params_to_model_params", model_params, master_params, flat_master)
    if not model_params:
        return
    with torch.no_grad():
        if flat_master:
            sources = list(_unflatten_dense_tensors(master_params[0].detach(), model_params))
        else:
            sources = [master.detach() for master in master_params]
        torch._foreach_copy_(model_params, sources)


def to_python_float(t: Any) -> Any:
    """``t.item()`` (a one-element tensor's Python number); plain numbers pass through; else ``t[0]`` as apex."""
    if hasattr(t, "item"):
        return t.item()
    if isinstance(t, (int, float)):
        return t
    return t[0]


def __getattr__(name: str) -> Any:
    raise unknown_name(__name__, name, REPLACEMENTS, __all__)
