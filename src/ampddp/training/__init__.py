"""The training loop and its parts, each with one job.

- ``settings.LoopSettings``: batch size, accumulation, clipping, horizon, cadences (frozen, checked);
- ``assemble.RunSetup``: a bare model -> a prepared run (initial weights, precision, sync-BN, DDP, compile);
- ``model_build.built_model``: the one door that builds the model, starting from its initial weights;
- ``batches.BatchAdapter``: moves any batch to the device, counts it, feeds the model; default loss and metric;
- ``evaluator.Evaluator``: loss and metrics over a split, every sample once across ranks;
- ``checkpoint_settings.CheckpointSettings``: run_dir, retention, where to resume or start from;
- ``checkpointer.Checkpointer``: saves/restores the ``TrainingState`` items and user-registered ones;
- ``resume``: the resume policy (which checkpoint a run continues from, what a resume may change);
- ``progress.Progress``: where a run stands (epoch, step, samples), saved in every checkpoint;
- ``callbacks.Callback``: logging, progress and user hooks at fixed points;
- ``nonfinite.NonFiniteGuard``: where a non-finite loss came from, when to stop;
- ``loading.LoaderSettings`` / ``DataLoading``: loader workers, per-sample seeds, time waiting for data;
- ``device.DeviceSettings``: channels_last, cuDNN benchmark, TF32 for the run;
- ``loop.TrainingLoop``: the order of a step, calling the parts above.

The public names load on first use, so that the torch-free parts (``progress``) import without
torch: ``ampddp train`` answers a finished run from its manifest before torch loads.
"""

from __future__ import annotations

from ampddp import lazy_names

_NAMES_BY_MODULE = {
    "assemble": ("RunSetup",),
    "batches": ("BatchAdapter", "accuracy", "cross_entropy"),
    "callbacks": ("Callback", "Callbacks", "ObserverCallback"),
    "checkpoint_settings": ("CheckpointSettings",),
    "checkpointer": ("Checkpointer", "Stateful", "TrainingState"),
    "device": ("DeviceSettings",),
    "evaluator": ("Evaluator",),
    "loading": ("DataLoading", "LoaderSettings"),
    "loop": ("TrainingLoop",),
    "nonfinite": ("NonFiniteGuard",),
    "progress": ("Progress",),
    "settings": ("LoopSettings",),
}
_HOMES = {name: f"{__name__}.{module}" for module, names in _NAMES_BY_MODULE.items() for name in names}

__all__ = sorted(_HOMES)

__getattr__, __dir__ = lazy_names(__name__, _HOMES)
