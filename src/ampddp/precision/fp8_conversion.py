"""O6's model conversion as a part the opt-level engine calls, not branches in its set-up.

An engine converts each model it sets up (``convert``) and installs the conversion's forward hooks
(``hooks``); a level without fp8 gets :class:`NoConversion`, which does neither. The fp8 plan
itself (which layers qualify, torchao's config) is ``ampddp.precision.fp8``'s.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ampddp.precision.compile_support import run_eagerly_as_own_frame
from ampddp.precision.fp8 import (
    EagerFp8Warning,
    LinearVerdict,
    convert_to_fp8,
    float8_config,
    gathers_fp8,
    plan_fp8,
    refresh_fp8_scales,
    report_plan,
    torchao_float8,
)
from ampddp.precision.policy import PrecisionPolicy


class NoConversion:
    """A level whose models keep their modules (every level but O6)."""

    runs_fp8 = False
    verdicts: tuple[LinearVerdict, ...] = ()

    def convert(self, model: nn.Module, prefix: str = "", device: torch.device | None = None) -> None:
        """Nothing to convert."""

    def hooks(self, models: Sequence[nn.Module]) -> list[RemovableHandle]:
        return []


class Fp8Conversion:
    """O6: the eligible linear layers of each model to torchao's fp8, once per model, the verdicts
    logged and kept; the forward hooks fp8 needs (the eager-on-GPU warning; under FSDP2's fp8
    all-gather, the weights' scales taken before the forward)."""

    runs_fp8 = True

    def __init__(self, policy: PrecisionPolicy) -> None:
        torchao_float8()  # missing: refused now, in one line, before any model or run dir is made
        self._policy = policy
        self._models: list[nn.Module] = []
        self.verdicts: list[LinearVerdict] = []
        """Every linear layer of the converted models, whether it runs in fp8 and why not."""

    def convert(self, model: nn.Module, prefix: str = "", device: torch.device | None = None) -> None:
        """``model``'s eligible layers to fp8 (named with ``prefix``: ``models[i].`` when a set-up has several), for
        ``device`` (None: where its parameters are)."""
        policy = self._policy
        if any(model is seen for seen in self._models):
            return
        if device is None:
            device = next((param.device for param in model.parameters()), torch.device("cpu"))
        verdicts = plan_fp8(model, policy.fp8_recipe, policy.fp8_filter, policy.fp8_min_size)
        convert_to_fp8(model, verdicts, float8_config(policy.fp8_recipe, device, policy.fp8_all_gather))
        verdicts = [dataclasses.replace(verdict, name=prefix + verdict.name) for verdict in verdicts] if prefix else verdicts
        self._models.append(model)
        self.verdicts.extend(verdicts)
        if policy.verbosity > 0:
            report_plan(verdicts, policy.fp8_recipe)

    def hooks(self, models: Sequence[nn.Module]) -> list[RemovableHandle]:
        """One eager-fp8 watch over the set-up's models; the scale refresh where FSDP2 gathers fp8
        (first, before FSDP2's own hook gathers the root; plain Python when dynamo meets it as a
        frame of its own, as the engine's other hooks)."""
        eager_warning = EagerFp8Warning()
        handles: list[RemovableHandle] = []
        for model in models:
            handles += eager_warning.install(model)
            if self._policy.fp8_all_gather and gathers_fp8(model):
                run_eagerly_as_own_frame(refresh_fp8_scales)
                handles.append(model.register_forward_pre_hook(refresh_fp8_scales, prepend=True))
        return handles


def model_conversion(policy: PrecisionPolicy) -> NoConversion | Fp8Conversion:
    """The conversion ``policy`` asks for: fp8 where it names an fp8 recipe (and is enabled)."""
    return Fp8Conversion(policy) if policy.enabled and policy.fp8_recipe is not None else NoConversion()
