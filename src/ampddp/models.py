"""The bundled models' old path, kept for recipes that say ``model.name: ampddp.models:gpt`` and code
that imports from here; they live in ``ampddp.zoo.models``."""

from ampddp.zoo.models import BUILTINS, GPT, NORMS, Block, CausalSelfAttention, build_model, classification_models, gpt

__all__ = ["BUILTINS", "GPT", "NORMS", "Block", "CausalSelfAttention", "build_model", "classification_models", "gpt"]
