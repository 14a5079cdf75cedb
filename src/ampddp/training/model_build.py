"""The one door that builds the model a run trains: as its strategy builds it, starting from the
weights it is given (``init_from``). The Trainer's set-up and the recipe's build (which checks the
model with a forward before the Trainer takes it) both come through here, so a model is never built
one way for the check and another for training."""

from __future__ import annotations

from pathlib import Path

from ampddp.checkpoint.restore import initial_weights, load_model_state
from ampddp.checkpoint.safetensors_weights import SafetensorsWeights, is_safetensors_source, weights_into
from ampddp.distributed.meta_init import ModelBuild, ModelSource, whole_model
from ampddp.distributed.parallel import Parallel


def built_model(model: ModelSource, parallel: Parallel, init_from: str | Path | SafetensorsWeights | None) -> ModelBuild:
    """``model`` as ``parallel``'s strategy builds it (FSDP2: a function's model on the meta device),
    starting from ``init_from``'s weights: safetensors are checked against it and read into a meta
    build's shards as they are made (a whole model loads them now); any other checkpoint is loaded into
    the model built whole; None: as built."""
    if init_from is None:
        return parallel.build(model)
    if isinstance(init_from, SafetensorsWeights) or is_safetensors_source(init_from):
        weights = init_from if isinstance(init_from, SafetensorsWeights) else SafetensorsWeights(init_from)
        return weights_into(parallel.build(model), weights)
    built = ModelBuild(whole_model(model))
    load_model_state(initial_weights(init_from), built.module, str(init_from))
    return built
