"""SyncBatchNorm on every backend (``sync_bn: portable``), and the BatchNorm replacement every converter uses.

torch's ``nn.SyncBatchNorm`` only runs on CUDA (and DDP refuses to wrap it elsewhere); its half
path has failed with "Expected counts to have type Half" (pytorch 96203). The portable version here
all-gathers per-rank (count, mean, M2) in fp32 and merges them exactly, so ranks may hold different
batch sizes (even zero), inputs may be fp16/bf16, and any backend (gloo, nccl) works.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm


def _world(group: Any) -> int:
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


class _SyncBatchNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps, momentum, group):
        channels = x.shape[1]
        dims = [d for d in range(x.dim()) if d != 1]
        compute = torch.promote_types(x.dtype, torch.float32)
        xf = x.to(compute)
        count = torch.tensor([x.numel() // max(channels, 1)], dtype=compute, device=x.device)
        local_mean = xf.mean(dims) if count.item() > 0 else torch.zeros(channels, dtype=compute, device=x.device)
        local_m2 = ((xf - local_mean.view(1, -1, *[1] * (x.dim() - 2))) ** 2).sum(dims)
        packed = torch.cat([count, local_mean, local_m2])
        gathered = [torch.empty_like(packed) for _ in range(_world(group))]
        dist.all_gather(gathered, packed, group=group)
        stats = torch.stack(gathered)
        counts, means, m2s = stats[:, :1], stats[:, 1 : channels + 1], stats[:, channels + 1 :]
        total = counts.sum()
        if total.item() < 2:
            raise ValueError(f"SyncBatchNorm needs more than 1 value per channel across all ranks in training, got {int(total.item())}")
        mean = (counts * means).sum(0) / total
        m2 = (m2s + counts * (means - mean) ** 2).sum(0)
        var = m2 / total
        invstd = torch.rsqrt(var + eps)
        if running_mean is not None:
            with torch.no_grad():
                running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
                running_var.mul_(1 - momentum).add_((m2 / (total - 1)).to(running_var.dtype), alpha=momentum)
        shape = (1, -1, *[1] * (x.dim() - 2))
        x_hat = (xf - mean.view(shape)) * invstd.view(shape)
        out = x_hat
        if weight is not None:
            out = out * weight.to(compute).view(shape) + bias.to(compute).view(shape)
        ctx.save_for_backward(x_hat, invstd, weight)
        ctx.total, ctx.group, ctx.dims, ctx.shape = total, group, dims, shape
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        x_hat, invstd, weight = ctx.saved_tensors
        g = grad_out.to(x_hat.dtype)
        local = torch.cat([g.sum(ctx.dims), (g * x_hat).sum(ctx.dims)])
        grad_bias_local, grad_weight_local = local.chunk(2)
        reduced = local.clone()
        dist.all_reduce(reduced, group=ctx.group)
        sum_dy, sum_dy_xhat = reduced.chunk(2)
        shape = ctx.shape
        scale = invstd if weight is None else invstd * weight.to(x_hat.dtype)
        grad_x = scale.view(shape) * (g - sum_dy.view(shape) / ctx.total - x_hat * sum_dy_xhat.view(shape) / ctx.total)
        grad_weight = grad_bias = None
        if weight is not None:
            grad_weight, grad_bias = grad_weight_local.to(weight.dtype), grad_bias_local.to(weight.dtype)
        return grad_x.to(grad_out.dtype), grad_weight, grad_bias, None, None, None, None, None


class PortableSyncBatchNorm(_BatchNorm):
    """BatchNorm whose training statistics span all ranks of ``process_group``, on any backend.

    Outside training, or without a process group of more than one rank, it is plain BatchNorm.
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1, affine: bool = True,
                 track_running_stats: bool = True, process_group: Any = None, device: Any = None, dtype: Any = None) -> None:  # fmt: skip
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype)
        self.process_group = process_group

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        momentum = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            momentum = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        use_batch_stats = self.training or not self.track_running_stats
        if not self.training or _world(self.process_group) == 1:
            # Evaluation never synchronises (ranks may run different numbers of eval batches).
            return F.batch_norm(
                input,
                self.running_mean if not self.training or self.track_running_stats else None,
                self.running_var if not self.training or self.track_running_stats else None,
                self.weight, self.bias, use_batch_stats, momentum, self.eps,
            )  # fmt: skip
        running_mean = self.running_mean if self.track_running_stats else None
        running_var = self.running_var if self.track_running_stats else None
        return self._synchronised(input, running_mean, running_var, momentum)

    def _synchronised(self, input: torch.Tensor, running_mean: Any, running_var: Any, momentum: float) -> torch.Tensor:
        """Training-mode normalisation with statistics over the whole group (portable: all-gather in fp32)."""
        return _SyncBatchNormFunction.apply(
            input, self.weight, self.bias, running_mean, running_var, self.eps, momentum, self.process_group
        )


def replace_batchnorms(module: nn.Module, build: Callable[[_BatchNorm], _BatchNorm], kind: type[_BatchNorm]) -> nn.Module:
    """Replace every BatchNorm that is not already a ``kind`` with ``build(old)``, which then holds
    the old layer's weight and bias Parameters themselves (an optimizer built before still steps
    them), running statistics, ``num_batches_tracked`` and training flag. InstanceNorm is not a
    BatchNorm and is left alone. Returns the converted module (the same object unless it is a BatchNorm)."""
    converted = module
    if isinstance(module, _BatchNorm) and not isinstance(module, kind):
        converted = build(module)
        if module.affine:
            converted.weight, converted.bias = module.weight, module.bias
        converted.running_mean, converted.running_var = module.running_mean, module.running_var
        converted.num_batches_tracked = module.num_batches_tracked
        converted.train(module.training)
    for name, child in module.named_children():
        converted.add_module(name, replace_batchnorms(child, build, kind))
    return converted


def convert_portable_syncbn(module: nn.Module, process_group: Any = None) -> nn.Module:
    """Every BatchNorm of ``module`` as a :class:`PortableSyncBatchNorm` (``replace_batchnorms``)."""

    def build(bn: _BatchNorm) -> PortableSyncBatchNorm:
        return PortableSyncBatchNorm(bn.num_features, bn.eps, bn.momentum, bn.affine, bn.track_running_stats, process_group)

    return replace_batchnorms(module, build, PortableSyncBatchNorm)
