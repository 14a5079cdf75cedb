"""The training loop and its parts, each with one job.

- ``settings.LoopSettings``: batch size, accumulation, clipping, horizon, cadences (frozen, checked);
- ``assemble.RunSetup``: a bare model -> a prepared run (initial weights, precision, sync-BN, DDP, compile);
- ``batches.BatchAdapter``: moves any batch to the device, counts it, feeds the model; default loss and metric;
- ``evaluator.Evaluator``: loss and metrics over a split, every sample once across ranks;
- ``checkpoint_settings.CheckpointSettings``: run_dir, retention, where to resume or start from;
- ``checkpointer.Checkpointer``: saves/restores the ``TrainingState`` items and user-registered ones;
- ``callbacks.Callback``: logging, progress and user hooks at fixed points;
- ``nonfinite.NonFiniteGuard``: where a non-finite loss came from, when to stop;
- ``loading.LoaderSettings`` / ``DataLoading``: loader workers, per-sample seeds, time waiting for data;
- ``device.DeviceSettings``: channels_last, cuDNN benchmark, TF32 for the run;
- ``loop.TrainingLoop``: the order of a step, calling the parts above.
"""

from ampddp.training.assemble import RunSetup
from ampddp.training.batches import BatchAdapter, accuracy, cross_entropy
from ampddp.training.callbacks import Callback, Callbacks, ObserverCallback
from ampddp.training.checkpoint_settings import CheckpointSettings
from ampddp.training.checkpointer import Checkpointer, Stateful, TrainingState
from ampddp.training.device import DeviceSettings
from ampddp.training.evaluator import Evaluator
from ampddp.training.loading import DataLoading, LoaderSettings
from ampddp.training.loop import TrainingLoop
from ampddp.training.nonfinite import NonFiniteGuard
from ampddp.training.settings import LoopSettings

__all__ = [
    "BatchAdapter",
    "Callback",
    "Callbacks",
    "CheckpointSettings",
    "Checkpointer",
    "DataLoading",
    "DeviceSettings",
    "Evaluator",
    "LoaderSettings",
    "LoopSettings",
    "NonFiniteGuard",
    "ObserverCallback",
    "RunSetup",
    "Stateful",
    "TrainingLoop",
    "TrainingState",
    "accuracy",
    "cross_entropy",
]
