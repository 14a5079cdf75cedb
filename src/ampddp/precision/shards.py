"""The engine's tensor work on each rank's own shard, so the opt levels run over DTensor parameters.

Under tensor parallelism (and FSDP2 x TP) parameters and gradients are DTensors. Three things the engine does
to plain tensors go wrong on them: ``param.data = param.data.to(dtype)`` changes a DTensor's outer dtype but
not its local shard (the next matmul mixes Half and Float); torch's foreach kernels (``_foreach_copy_``,
``_foreach_add_``) have no sharding rule for DTensors; and the fused unscale-and-check kernel, dispatched on
DTensors, refuses a list mixing plain tensors and DTensors and agrees its flag over the first gradient's mesh
only. So the engine casts by swapping the tensor whole (``torch.utils.swap_tensors``: the Parameter object,
which optimizers and hooks hold, stays) and does its elementwise work on local shards, where elementwise is
exactly what it is; the one cross-rank decision, the verdict, is agreed explicitly (``precision.verdict``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ampddp.errors import UnsupportedTorchError
from ampddp.torch_compat import is_dtensor


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of ``tensor`` (a DTensor), sharing its storage; a plain tensor is its own shard."""
    return tensor.to_local() if is_dtensor(tensor) else tensor


def locals_of(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """``local`` of each tensor: a list the foreach kernels take."""
    return [local(tensor) for tensor in tensors]


def holds_dtensors(params: Iterable[torch.Tensor]) -> bool:
    """Whether any of ``params`` is a DTensor (a model parallelized over a device mesh)."""
    return any(is_dtensor(param) for param in params)


def like_layout(grad: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``grad`` laid out as ``param`` is (a replicated parameter's gradient can come back as partial sums
    from a sequence-parallel region: their sum is the gradient, a collective DTensor makes), so that shard
    for shard they line up; unchanged when it already is, or plain."""
    if is_dtensor(grad) and is_dtensor(param) and tuple(grad.placements) != tuple(param.placements):
        return grad.redistribute(param.device_mesh, param.placements)
    return grad


@torch.no_grad()
def cast_param_(param: nn.Parameter, dtype: torch.dtype) -> None:
    """Cast ``param`` to ``dtype`` in place, keeping the Parameter object: ``.data`` for a plain tensor, a
    whole swap for a DTensor (whose ``.data`` assignment would leave the shard in its old dtype)."""
    if is_dtensor(param):
        torch.utils.swap_tensors(param, nn.Parameter(param.detach().to(dtype), requires_grad=param.requires_grad))
    else:
        param.data = param.data.to(dtype)


class ShardLocalGradScaler(torch.amp.GradScaler):
    """torch's GradScaler, unscaling and checking each rank's own gradient shards (native-fp16 over DTensor
    parameters): dispatched on DTensors, its kernel refuses a list mixing plain tensors and DTensors and
    agrees its flag over the first gradient's mesh only. The engine then agrees the flags it leaves
    (``NativeAmpEngine._agree_verdict``). Overrides GradScaler's private ``_unscale_grads_`` (the same
    signature since torch 1.6; checked when one is made)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if not callable(getattr(torch.amp.GradScaler, "_unscale_grads_", None)):
            raise UnsupportedTorchError(
                f"torch {torch.__version__}'s GradScaler has no _unscale_grads_ to unscale gradient shards with: native-fp16 "
                "cannot run over DTensor parameters here; use opt level O1 (float16 ops, the same dynamic loss scale)"
            )
        super().__init__(*args, **kwargs)

    def _unscale_grads_(
        self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor, found_inf: torch.Tensor, allow_fp16: bool
    ) -> dict[torch.device, torch.Tensor]:
        groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for group in optimizer.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                if param.grad.is_sparse or (not allow_fp16 and param.grad.dtype == torch.float16):
                    return super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)  # torch's own refusals
                shard = local(param.grad)
                groups.setdefault((shard.device, shard.dtype), []).append(shard)
        found: dict[torch.device, torch.Tensor] = {}
        with torch.no_grad():
            for (device, _), shards in groups.items():
                if device not in found:
                    found[device] = found_inf.to(device, copy=True)
                torch._amp_foreach_non_finite_check_and_unscale_(shards, found[device], inv_scale.to(device))
        return found
