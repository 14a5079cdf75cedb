"""The precision modes as one table: what each computes in, how its engine is built, what FSDP2 does
with it, what the hardware must have, and whether NVIDIA apex's own amp can run it.

Everything that asks a question about a mode asks its :class:`ModeSpec` here; the torch-free names
(``ampddp.choices``, for the command line) are tested against this table. A new mode is one row
below and its name in ``choices.py``; its engine class, where it needs a new one, implements
``PrecisionEngine``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from ampddp.choices import IMPLS, PRECISION_MODES
from ampddp.errors import ConfigError, choice_error, closest
from ampddp.precision.apex_backend import ApexEngine
from ampddp.precision.dtypes import dtype_name
from ampddp.precision.engine import PrecisionEngine
from ampddp.precision.hardware import unsupported
from ampddp.precision.native import NativeAmpEngine
from ampddp.precision.opt_level import OptLevelEngine
from ampddp.precision.policy import DYNAMIC, FP8_SETTINGS, PrecisionPolicy, check_scale_bounds, parse_overrides
from ampddp.precision.registry import OpRegistry


@dataclass(frozen=True)
class ModeSpec:
    """One precision mode. ``compute_dtype``: what its low-precision math runs in (fp32: none; O6: bf16
    around its fp8 matmuls). ``policy``: an apex opt level's row of apex's table (None: a native
    torch.autocast + GradScaler mode). ``apex_impl``: NVIDIA apex's own amp can run it (impl apex).
    ``sharded_masters``: under FSDP2 its fp32 masters become FSDP2's fp32 shards, and fp32 islands
    are a choice (O2/O5); every other mode shards as its single-process self."""

    name: str
    compute_dtype: torch.dtype
    policy: PrecisionPolicy | None = None
    apex_impl: bool = False
    sharded_masters: bool = False

    @property
    def native(self) -> bool:
        """torch.autocast (+ GradScaler for fp16), not an apex opt level."""
        return self.policy is None

    @property
    def runs_fp8(self) -> bool:
        return self.policy is not None and self.policy.fp8_recipe is not None

    @property
    def casts_ops(self) -> bool:
        """Casts per op (apex's O1/O4 lists), leaving the model's weights fp32."""
        return self.policy is not None and self.policy.patch_torch_functions

    def unsupported(self, device: torch.device) -> str | None:
        """Why ``device`` cannot run this mode at its speed, with what works there, or None."""
        return unsupported(self.name, device, bf16=self.compute_dtype == torch.bfloat16, fp8=self.runs_fp8)

    def resolve_policy(self, **overrides: Any) -> PrecisionPolicy:
        """This opt level's policy with apex ``initialize`` keyword overrides applied (None keeps a default)."""
        if self.policy is None:
            raise ConfigError(f"precision mode {self.name} is torch.autocast's, not an apex opt level; valid: {', '.join(OPT_LEVELS)}")
        given = parse_overrides(overrides)
        _check_level_settings(self, given)
        policy = dataclasses.replace(self.policy, **given)
        check_scale_bounds(policy)
        return policy

    def build_engine(
        self, impl: str = "builtin", registry: OpRegistry | None = None, allow_low_precision_models: bool = False, **overrides: Any
    ) -> PrecisionEngine:
        """A fresh engine of this mode (one per set-up: an engine holds its models' state)."""
        if impl not in IMPLS:
            raise choice_error("precision impl", impl, IMPLS)
        if impl == "apex" and self.native:
            raise choice_error(f"precision impl for {self.name}", impl, ["builtin"])
        if impl == "apex" and not self.apex_impl:
            raise ConfigError(
                f"opt level {self.name} is ampddp's own (fp8 matmuls through torchao): NVIDIA apex's amp has no {self.name}; "
                "use impl builtin"
            )
        if self.policy is None:
            return NativeAmpEngine(self.name, self.compute_dtype, **overrides)
        if impl == "apex":
            return ApexEngine(self.name, self.compute_dtype, registry=registry, **overrides)
        return OptLevelEngine(self.resolve_policy(**overrides), registry=registry, allow_low_precision_models=allow_low_precision_models)

    def build_sharded_engine(self, registry: OpRegistry | None, fp32_islands: bool | None, **overrides: Any) -> PrecisionEngine:
        """A fresh engine for a model FSDP2 shards: O2/O5 keep fp32 sharded params (the masters) that
        FSDP2 hands to the forward in the low dtype, with apex's fp32 islands unless ``fp32_islands``
        is False; O6 with tensorwise scaling all-gathers its fp8 weights in fp8; every other mode is
        its single-process self (O3's params are fp16 shards)."""
        if fp32_islands is not None and not self.sharded_masters:
            raise ConfigError(
                f"fp32_islands={fp32_islands} applies to {' and '.join(SHARDED_MASTER_MODES)} under fsdp2, not to {self.name} "
                "(O1/O4 and the native modes always run their fp32 ops in fp32; O3 is pure fp16): remove it"
            )
        if self.policy is None:
            return self.build_engine(registry=registry, **overrides)
        policy = self.resolve_policy(**overrides)
        if self.sharded_masters and policy.keep_batchnorm_fp32 is False:
            raise ConfigError(
                f"keep_batchnorm_fp32=False with {self.name} under fsdp2: BatchNorm layers are FSDP2 units of their own there "
                "and compute in fp32 (a unit's params share one dtype); remove the setting"
            )
        return OptLevelEngine(policy.for_sharded_params(fp32_islands is not False), registry=registry)


_F16, _BF16, _F32 = torch.float16, torch.bfloat16, torch.float32
MODES: dict[str, ModeSpec] = {spec.name: spec for spec in (
    # apex's opt levels (O0-O3), the ROCm fork's bf16 pair (O4/O5) and ampddp's O6 (O4 with fp8 matmuls, torchao):
    # (cast_model_type, patch_torch_functions, keep_batchnorm_fp32, master_weights, loss_scale) as in apex's table.
    ModeSpec("O0", _F32, PrecisionPolicy("O0", _F32, False, None, False, 1.0), apex_impl=True),
    ModeSpec("O1", _F16, PrecisionPolicy("O1", None, True, None, None, DYNAMIC, op_cast_dtype=_F16), apex_impl=True),
    ModeSpec("O2", _F16, PrecisionPolicy("O2", _F16, False, True, True, DYNAMIC), apex_impl=True, sharded_masters=True),
    ModeSpec("O3", _F16, PrecisionPolicy("O3", _F16, False, False, False, 1.0), apex_impl=True),
    ModeSpec("O4", _BF16, PrecisionPolicy("O4", None, True, None, None, 1.0, op_cast_dtype=_BF16), apex_impl=True),
    ModeSpec("O5", _BF16, PrecisionPolicy("O5", _BF16, False, True, True, 1.0), apex_impl=True, sharded_masters=True),
    ModeSpec("O6", _BF16, PrecisionPolicy("O6", None, True, None, None, 1.0, op_cast_dtype=_BF16, fp8_recipe="rowwise")),
    # torch.autocast + GradScaler (a dynamic scale for fp16, none for bf16):
    ModeSpec("native-fp16", _F16),
    ModeSpec("native-bf16", _BF16),
)}  # fmt: skip

OPT_LEVELS: dict[str, PrecisionPolicy] = {name: spec.policy for name, spec in MODES.items() if spec.policy is not None}
"""apex's opt-level table: each level's policy before overrides."""
NATIVE_MODES: dict[str, torch.dtype] = {name: spec.compute_dtype for name, spec in MODES.items() if spec.native}
"""The torch.autocast modes and the dtype each autocasts to."""
OP_CASTING_LEVELS = tuple(name for name, spec in MODES.items() if spec.casts_ops)
SHARDED_MASTER_MODES = tuple(name for name, spec in MODES.items() if spec.sharded_masters)
"""The modes whose fp32 masters become FSDP2's fp32 shards (and where fp32 islands are a choice)."""
FP32_MODE = MODES["O0"]
"""fp32 throughout: what a device gets where no low-precision mode is faster."""


def native_mode(dtype: torch.dtype) -> ModeSpec:
    """The torch.autocast mode that computes in ``dtype``."""
    return next(spec for spec in MODES.values() if spec.native and spec.compute_dtype == dtype)


def mode_spec(name: object) -> ModeSpec:
    """The row of ``name`` (O0-O6, native-fp16, native-bf16), or one line naming the valid modes."""
    if isinstance(name, str) and name in MODES:
        return MODES[name]
    raise choice_error("precision mode", name, PRECISION_MODES)


def check_opt_level(opt_level: object) -> str:
    """Return the level name or raise, stressing the letter O that apex users often mistype."""
    if isinstance(opt_level, str) and opt_level in OPT_LEVELS:
        return opt_level
    raise ConfigError(
        f"opt_level={opt_level!r} is not valid{closest(str(opt_level), OPT_LEVELS)}; valid choices: "
        f"{', '.join(OPT_LEVELS)} (the letter 'O' followed by a digit, not the digit zero)"
    )


def resolve_policy(opt_level: str = "O1", **overrides: Any) -> PrecisionPolicy:
    """Return the policy for ``opt_level`` with apex-style keyword overrides applied.

    An override of None keeps the level's default, as in ``apex.amp.initialize``.
    """
    return MODES[check_opt_level(opt_level)].resolve_policy(**overrides)


def build_engine(
    mode: str = "O1", impl: str = "builtin", registry: OpRegistry | None = None, allow_low_precision_models: bool = False, **overrides: Any
) -> PrecisionEngine:
    """Create the engine for ``mode`` (O0-O6, native-fp16, native-bf16).

    ``overrides`` are apex ``initialize`` keywords for O-levels, GradScaler settings for native modes.
    ``allow_low_precision_models``: the builtin O-level engine accepts models with fp16/bf16 params.
    """
    return mode_spec(mode).build_engine(impl, registry, allow_low_precision_models, **overrides)


def _check_level_settings(spec: ModeSpec, given: dict[str, Any]) -> None:
    """The parsed settings apex refused for a level (and the ones it accepted silently and then misbehaved on)."""
    if given.get("patch_torch_functions") and not spec.casts_ops:
        raise ConfigError(
            f"patch_torch_functions=True is not valid with opt_level {spec.name}; op-level casting exists only in "
            f"{' and '.join(OP_CASTING_LEVELS)}. Use opt_level='O1' (float16) or 'O4' (bfloat16)."
        )
    if spec.casts_ops:
        _check_op_casting_level(spec.name, given)
    fp8 = [key for key in FP8_SETTINGS if key in given]
    if fp8 and not spec.runs_fp8:
        fp8_levels = " and ".join(name for name, other in MODES.items() if other.runs_fp8)
        raise ConfigError(
            f"{', '.join(fp8)} {'applies' if len(fp8) == 1 else 'apply'} to opt level {fp8_levels} (fp8 matmuls), not to "
            f"{spec.name}; use {fp8_levels} or remove it"
        )


def _check_op_casting_level(level: str, given: dict[str, Any]) -> None:
    """O1/O4 cast ops, not the model: apex refused model-level settings there."""
    cast = given.get("cast_model_type")
    if cast not in (None, torch.float32):
        raise ConfigError(
            f"cast_model_type={dtype_name(cast)} is not valid with opt_level {level}: {level} keeps the model "
            "weights fp32 and casts ops instead; valid: None or torch.float32. To cast the model use "
            "O2/O3 (float16) or O5 (bfloat16)."
        )
    for key in ("keep_batchnorm_fp32", "master_weights"):
        if given.get(key) is not None:
            raise ConfigError(
                f"{key}={given[key]!r} is not valid with opt_level {level}: {level} leaves the model fp32, "
                "so there is no batchnorm to keep in fp32 and no master copy; valid: None"
            )
