"""Strategies keeping a whole copy of the model per process and syncing its gradients: torch DDP and
apex's DDP (and ``dp``, ``none``: one process, or the user's own wrapper)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ampddp.distributed.apex_ddp import DistributedDataParallel as ApexDistributedDataParallel
from ampddp.distributed.env import DistEnv
from ampddp.distributed.gradient_rider import GradientRider, ride_gradients
from ampddp.distributed.installed_apex import installed_apex_parallel
from ampddp.distributed.model_agreement import check_models_agree
from ampddp.distributed.strategies.base import Strategy
from ampddp.distributed.strategies.sharded import TensorParallelOnly
from ampddp.distributed.wrap import DDPOptions
from ampddp.errors import ConfigError


class _Replicated(Strategy, ABC):
    """A wrapper that keeps a whole copy per process and syncs gradients; a single process's model
    stays bare (nobody to sync with), and the ranks' models are compared before wrapping."""

    def wrap(self, model: nn.Module, env: DistEnv) -> nn.Module:
        if not env.distributed:
            return model
        check_models_agree(model, env)
        return self._replicate(model, env)

    @abstractmethod
    def _replicate(self, model: nn.Module, env: DistEnv) -> nn.Module:
        """``model`` in the wrapper (several processes, the same model on each)."""


class TorchDDP(_Replicated):
    """torch DDP (device_ids bound on CUDA), with its settings and the wrapper's other options."""

    name = "ddp"
    takes = ("ddp", "wrap_options")

    def __init__(self, ddp: DDPOptions | None = None, wrap_options: Mapping[str, Any] | None = None) -> None:
        self.ddp = ddp if ddp is not None else DDPOptions()
        self.wrap_options = dict(wrap_options or {})

    def _replicate(self, model: nn.Module, env: DistEnv) -> nn.Module:
        return self.ddp.wrap(model, [env.device.index] if env.device.type == "cuda" else None, **self.wrap_options)

    def gradient_rider(self, model: nn.Module) -> GradientRider | None:
        """The flags of a step ride torch DDP's gradient buckets over gloo (``ride_gradients`` says when); ``model`` may be
        the compiled wrapper."""
        wrapper = getattr(model, "_orig_mod", model)
        return ride_gradients(wrapper) if isinstance(wrapper, DistributedDataParallel) else None


class ApexDDP(_Replicated):
    """apex's DDP: NVIDIA's from an old apex build, else ampddp's apex-style one, with apex's options."""

    name = "apex-ddp"
    takes = ("wrap_options",)

    def __init__(self, wrap_options: Mapping[str, Any] | None = None) -> None:
        self.wrap_options = dict(wrap_options or {})

    def _replicate(self, model: nn.Module, env: DistEnv) -> nn.Module:
        wrapper = installed_apex_parallel("DistributedDataParallel") or ApexDistributedDataParallel
        return wrapper(model, **self.wrap_options)


class DataParallel(Strategy):
    """nn.DataParallel over every visible GPU, in one process."""

    name = "dp"
    takes = ("wrap_options",)

    def __init__(self, wrap_options: Mapping[str, Any] | None = None) -> None:
        self.wrap_options = dict(wrap_options or {})

    def wrap(self, model: nn.Module, env: DistEnv) -> nn.Module:
        if env.distributed:
            raise ConfigError("strategy 'dp' (nn.DataParallel) is single-process; with several processes use 'ddp'")
        return nn.DataParallel(model, **self.wrap_options)


class Unwrapped(Strategy):
    """The model as it is (one process, or the user's own wrapper): it takes no settings."""

    name = "none"
    pipelines = True

    @classmethod
    def with_tensor_parallel(cls, where: str = "") -> type[Strategy]:
        """Tensor parallelism alone (``strategies.sharded.TensorParallelOnly``)."""
        return TensorParallelOnly
