"""apex's SyncBatchNorm (``sync_bn: apex``) on any backend, built on ampddp's PortableSyncBatchNorm.

apex deleted ``apex.parallel`` in May 2025; its SyncBatchNorm needed apex's CUDA extension for
``channel_last`` and ``fuse_relu``. This one keeps apex's signature and numerics (batch statistics over
every rank of the process group, unbiased variance in the running estimate, evaluation from the
running statistics without communication) and adds what apex lacked: exact statistics when ranks hold
different batch sizes, and CPU/gloo. On CUDA the statistics come from torch's sync-BN kernels.
``channel_last=True`` means the input's last dimension holds the channels (e.g. ``(N, H, W, C)``);
``fuse_relu=True`` applies ``relu(bn(x) + z)``, which apex offered only on its channel-last path, so
it is accepted only with ``channel_last=True``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.modules._functions import SyncBatchNorm as _TorchSyncBatchNorm
from torch.nn.modules.batchnorm import _BatchNorm

from ampddp.distributed.portable_sync_bn import PortableSyncBatchNorm, replace_batchnorms
from ampddp.errors import ConfigError

__all__ = ["SyncBatchNorm", "convert_syncbn_model"]


class SyncBatchNorm(PortableSyncBatchNorm):
    """apex's SyncBatchNorm: BatchNorm whose training statistics span all ranks of ``process_group``.

    ``process_group=None`` means the default (whole-world) group. ``channel_last``: the channel
    dimension is the input's last one (2-D ``(N, C)`` input is the same either way). ``fuse_relu``
    (only with ``channel_last=True``, as in apex): the output is ``relu(bn(x) + z)``, with
    ``z`` the optional second argument of ``forward``. Evaluation with running statistics never
    communicates, so ranks may run different numbers of evaluation batches.
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1, affine: bool = True,
                 track_running_stats: bool = True, process_group: Any = None, channel_last: bool = False,
                 fuse_relu: bool = False) -> None:  # fmt: skip
        if fuse_relu and not channel_last:
            raise ConfigError(
                "SyncBatchNorm(fuse_relu=True) needs channel_last=True: apex fused the ReLU (and the residual z) only in its "
                "channel-last kernel and silently skipped it for channel-first input; pass channel_last=True with (N, ..., C) "
                "input, or keep fuse_relu=False and apply torch.relu after the layer"
            )
        super().__init__(num_features, eps, momentum, affine, track_running_stats, process_group)
        self.channel_last = bool(channel_last)
        self.fuse_relu = bool(fuse_relu)

    def _specify_process_group(self, process_group: Any) -> None:
        """Set the group statistics are synchronised over (apex's method)."""
        self.process_group = process_group

    def _specify_channel_last(self, channel_last: bool) -> None:
        """Switch the expected input layout (apex's method)."""
        if self.fuse_relu and not channel_last:
            raise ConfigError("channel_last=False cannot be set on a SyncBatchNorm with fuse_relu=True (apex fused ReLU only channel-last)")
        self.channel_last = bool(channel_last)

    def forward(self, input: torch.Tensor, z: torch.Tensor | None = None) -> torch.Tensor:
        """Normalise ``input``; with channel_last, ``z`` (same shape) is added and ``fuse_relu`` applied."""
        if z is not None and not self.channel_last:
            raise ConfigError("SyncBatchNorm.forward(input, z): z (the residual added before the ReLU) needs channel_last=True, as in apex")
        moved = self.channel_last and input.dim() > 2
        if input.dim() >= 2 and input.shape[-1 if self.channel_last else 1] != self.num_features:
            where = "last" if self.channel_last else "second"
            shape = tuple(input.shape)
            raise ValueError(
                f"SyncBatchNorm({self.num_features}) expected {self.num_features} channels in the {where} dimension, got {shape}"
            )
        out = super().forward(input.movedim(-1, 1) if moved else input)
        if moved:
            out = out.movedim(1, -1)
        if z is not None:
            out = out + z
        return F.relu(out) if self.fuse_relu else out

    def _synchronised(self, input: torch.Tensor, running_mean: Any, running_var: Any, momentum: float) -> torch.Tensor:
        """On CUDA, torch's sync-BN kernels (what torch's nn.SyncBatchNorm runs); elsewhere the portable
        implementation. The choice depends on the device only, so every rank makes the same one."""
        if input.device.type != "cuda":
            return super()._synchronised(input, running_mean, running_var, momentum)
        group = self.process_group if self.process_group is not None else dist.group.WORLD
        return _TorchSyncBatchNorm.apply(
            input, self.weight, self.bias, running_mean, running_var, self.eps, momentum, group, dist.get_world_size(group)
        )

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, channel_last={self.channel_last}, fuse_relu={self.fuse_relu}"


def convert_syncbn_model(module: nn.Module, process_group: Any = None, channel_last: bool = False) -> nn.Module:
    """Replace every BatchNorm (``_BatchNorm``; InstanceNorm is left alone) with :class:`SyncBatchNorm`.

    The new layers hold the old ones' weight and bias Parameters themselves (so an optimizer built
    before the conversion still steps them), running statistics, ``num_batches_tracked`` and
    training flag. Returns the converted module (the same object unless ``module`` is a BatchNorm).
    """

    def build(bn: _BatchNorm) -> SyncBatchNorm:
        return SyncBatchNorm(
            bn.num_features, bn.eps, bn.momentum, bn.affine, bn.track_running_stats, process_group, channel_last=channel_last
        )

    return replace_batchnorms(module, build, SyncBatchNorm)
