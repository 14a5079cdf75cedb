"""The one factory from a bare model to a prepared run: initial weights, set-up, compilation."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from torch import nn
from torch.optim import Optimizer

from ampddp.checkpoint.safetensors_weights import SafetensorsWeights
from ampddp.distributed.env import DistEnv
from ampddp.distributed.meta_init import ModelSource
from ampddp.distributed.parallel import Parallel
from ampddp.precision.choice import Precision
from ampddp.precision.engine import PrecisionEngine
from ampddp.prepare import Prepared, prepare
from ampddp.training.compile_model import ModelCompiler
from ampddp.training.device import DeviceSettings
from ampddp.training.model_build import built_model

logger = logging.getLogger("ampddp.trainer")


@dataclass(frozen=True)
class RunSetup:
    """How a model becomes a prepared run: precision, parallelism (sync-BN, wrapper), compilation, memory format."""

    precision: Precision | PrecisionEngine = field(default_factory=Precision)
    """A choice (its engine built for the strategy), or the caller's own fresh engine."""
    parallel: Parallel = field(default_factory=Parallel)
    compiler: ModelCompiler | None = None
    init_from: str | Path | SafetensorsWeights | None = None
    """A checkpoint or weights file whose model weights the run starts from (nothing else is taken);
    safetensors (a file or a folder of them, or ``SafetensorsWeights`` with a key map) are read into a
    meta build's shards slice by slice."""
    device: DeviceSettings = field(default_factory=DeviceSettings)
    """channels_last (applied to the model here), cuDNN benchmark and TF32 (set while training)."""

    def build(self, model: ModelSource, make_optimizer: Callable[[Iterable[nn.Parameter]], Optimizer], env: DistEnv,
              on_compiled: Callable[[float], None] | None = None) -> Prepared:  # fmt: skip
        """Build ``model`` (a module, a function that builds one, or a ``ModelBuild``: FSDP2 builds a
        function's model on the meta device) and load ``init_from`` into it (built whole for a torch
        checkpoint; safetensors go into a meta build's shards as they are materialised), then
        ``prepare`` (sync-BN, device, optimizer, precision, DDP), then compile: the set-up (cast, masters,
        DDP) is what gets compiled."""
        built = built_model(model, self.parallel, self.init_from)
        built = dataclasses.replace(built, module=self.device.convert(built.module))
        run = prepare(built, make_optimizer, env, precision=self.precision, parallel=self.parallel)
        if self.compiler is not None:
            run = self.compiler.compile(run, on_first_step=on_compiled)
        return run
