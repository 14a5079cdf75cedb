"""The precision modes as one table: what each computes in, how its engine is built, what FSDP2 does
with it, what the hardware must have, and whether NVIDIA apex's own amp can run it.

Everything that asks a question about a mode asks its :class:`ModeSpec` here; the torch-free names
(``ampddp.choices``, for the command line) are tested against this table. A new mode is one row
below and its name in ``choices.py``; its engine class, where it needs a new one, implements
``PrecisionEngine``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ampddp.choices import AUTO_PRECISION, IMPLS, PRECISION_MODES
from ampddp.errors import ConfigError, choice_error, closest
from ampddp.precision.apex_backend import ApexEngine
from ampddp.precision.casting.registry import OpRegistry
from ampddp.precision.dtypes import dtype_name
from ampddp.precision.engine import PrecisionEngine
from ampddp.precision.hardware import unsupported
from ampddp.precision.native import NATIVE_SETTINGS, NativeAmpEngine
from ampddp.precision.opt_level import OptLevelEngine
from ampddp.precision.policy import DYNAMIC, FP8_SETTINGS, OVERRIDE_KEYS, PrecisionPolicy, check_scale_bounds, parse_overrides

LEVEL_SETTINGS = tuple(key for key in OVERRIDE_KEYS if key not in FP8_SETTINGS)
"""What apex's ``amp.initialize`` takes, the settings of every opt level (O6 takes its fp8 ones too)."""


@dataclass(frozen=True)
class ModeSpec:
    """One precision mode. ``compute_dtype``: what its low-precision math runs in (fp32: none; O6: bf16
    around its fp8 matmuls). ``engine``: the engine class that runs it. ``settings``: the names of the settings
    it takes (apex ``initialize`` keywords for an opt level, GradScaler's for a torch.autocast mode): what a
    mode takes is decided here, by :meth:`check_settings`, and nowhere else. ``policy``: an apex opt level's row
    of apex's table (None: a native torch.autocast + GradScaler mode). ``apex_impl``: NVIDIA apex's own amp can
    run it (impl apex). ``sharded_masters``: under FSDP2 its fp32 masters become FSDP2's fp32 shards, and fp32
    islands are a choice (O2/O5); every other mode shards as its single-process self."""

    name: str
    compute_dtype: torch.dtype
    engine: type[OptLevelEngine] | type[NativeAmpEngine]
    settings: tuple[str, ...]
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

    def check_settings(
        self, settings: Mapping[str, Any], impl: str = "builtin", prefix: str = "", offered: Collection[str] = ()
    ) -> dict[str, Any]:
        """The one check of what this mode takes: ``impl``, every setting's name (one that belongs to other modes is
        refused naming them) and, for an opt level, each value and the values apex refused for this level.
        Returns the settings as the engine takes them (an opt level's parsed, None meaning its default).
        ``prefix``: how the caller names a setting ("precision." in a recipe); ``offered``: the names it can give,
        when fewer than the mode takes (a recipe's keys), for the list of valid ones."""
        self._check_impl(impl)
        foreign = [key for key in settings if key not in self.settings]
        if foreign:
            raise _not_taken(self, foreign, prefix, [key for key in self.settings if not offered or key in offered])
        if self.policy is None:
            return dict(settings)
        given = parse_overrides(dict(settings))
        _check_level_settings(self, given)
        return given

    def _check_impl(self, impl: str) -> None:
        if impl not in IMPLS:
            raise choice_error("precision impl", impl, IMPLS)
        if impl == "apex" and self.native:
            raise choice_error(f"precision impl for {self.name}", impl, ["builtin"])
        if impl == "apex" and not self.apex_impl:
            raise ConfigError(
                f"opt level {self.name} is ampddp's own (fp8 matmuls through torchao): NVIDIA apex's amp has no {self.name}; "
                "use impl builtin"
            )

    def resolve_policy(self, **overrides: Any) -> PrecisionPolicy:
        """This opt level's policy with apex ``initialize`` keyword overrides applied (None keeps a default)."""
        return self.policy_with(self.check_settings(overrides))

    def policy_with(self, settings: Mapping[str, Any]) -> PrecisionPolicy:
        """This opt level's policy with ``settings`` as :meth:`check_settings` returned them (parsed once: a
        parsed None replaces the level's value, as apex's ``cast_model_type=False`` does)."""
        if self.policy is None:
            raise ConfigError(f"precision mode {self.name} is torch.autocast's, not an apex opt level; valid: {', '.join(OPT_LEVELS)}")
        policy = dataclasses.replace(self.policy, **settings)
        check_scale_bounds(policy)
        return policy

    def build_engine(
        self, impl: str = "builtin", registry: OpRegistry | None = None, allow_low_precision_models: bool = False, **overrides: Any
    ) -> PrecisionEngine:
        """A fresh engine of this mode (one per set-up: an engine holds its models' state)."""
        settings = self.check_settings(overrides, impl)
        if impl == "apex":
            return ApexEngine(self.name, self.compute_dtype, registry=registry, **overrides)
        return self.engine.for_mode(self, settings, registry, allow_low_precision_models)

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
# (engine, settings) of a row: an opt level's, O6's (with its fp8 settings), a torch.autocast mode's.
_LEVEL, _FP8_LEVEL = (OptLevelEngine, LEVEL_SETTINGS), (OptLevelEngine, (*LEVEL_SETTINGS, *FP8_SETTINGS))
_NATIVE = (NativeAmpEngine, NATIVE_SETTINGS)
MODES: dict[str, ModeSpec] = {spec.name: spec for spec in (
    # apex's opt levels (O0-O3), the ROCm fork's bf16 pair (O4/O5) and ampddp's O6 (O4 with fp8 matmuls, torchao):
    # (cast_model_type, patch_torch_functions, keep_batchnorm_fp32, master_weights, loss_scale) as in apex's table.
    ModeSpec("O0", _F32, *_LEVEL, PrecisionPolicy("O0", _F32, False, None, False, 1.0), apex_impl=True),
    ModeSpec("O1", _F16, *_LEVEL, PrecisionPolicy("O1", None, True, None, None, DYNAMIC, op_cast_dtype=_F16), apex_impl=True),
    ModeSpec("O2", _F16, *_LEVEL, PrecisionPolicy("O2", _F16, False, True, True, DYNAMIC), apex_impl=True, sharded_masters=True),
    ModeSpec("O3", _F16, *_LEVEL, PrecisionPolicy("O3", _F16, False, False, False, 1.0), apex_impl=True),
    ModeSpec("O4", _BF16, *_LEVEL, PrecisionPolicy("O4", None, True, None, None, 1.0, op_cast_dtype=_BF16), apex_impl=True),
    ModeSpec("O5", _BF16, *_LEVEL, PrecisionPolicy("O5", _BF16, False, True, True, 1.0), apex_impl=True, sharded_masters=True),
    ModeSpec("O6", _BF16, *_FP8_LEVEL, PrecisionPolicy("O6", None, True, None, None, 1.0, op_cast_dtype=_BF16, fp8_recipe="rowwise")),
    # torch.autocast + GradScaler (a dynamic scale for fp16, none for bf16):
    ModeSpec("native-fp16", _F16, *_NATIVE),
    ModeSpec("native-bf16", _BF16, *_NATIVE),
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


def check_settings(
    mode: str,
    settings: Mapping[str, Any],
    impl: str = "builtin",
    prefix: str = "",
    extras: Sequence[str] = (),
    offered: Collection[str] = (),
) -> dict[str, Any]:
    """What a precision choice takes, for the API and for recipes alike: ``auto`` picks a mode per device and so takes
    no mode's settings (``extras``: the other things given with it, registered functions or fp32_islands, as the
    caller names them); any other mode what its row names (:meth:`ModeSpec.check_settings`, whose result this is)."""
    if mode != AUTO_PRECISION:
        return mode_spec(mode).check_settings(settings, impl, prefix, offered)
    named = [f"{prefix}{key}" if prefix else f"{key}={value!r}" for key, value in settings.items()]
    given = [*named, *extras, *([f"{prefix}impl" if prefix else f"impl={impl}"] if impl != "builtin" else [])]
    if not given:
        return {}
    modes = "O0-O6, native-fp16, native-bf16"
    if prefix:
        raise ConfigError(
            f"{prefix}mode is auto (the default), which picks a mode per device, so {', '.join(given)} has no mode to apply to: "
            f"set {prefix}mode to the mode it belongs to ({modes})"
        )
    raise ConfigError(
        f"precision mode auto picks a mode per device and takes no mode settings; got {', '.join(given)}: name the mode they "
        f"belong to ({modes})"
    )


def _not_taken(spec: ModeSpec, keys: list[str], prefix: str, valid: list[str]) -> ConfigError:
    """Settings ``spec`` does not take: one no mode takes, as unknown with the closest name; else the first one's, with
    the others the same modes take, named with those modes."""
    valid_here = f"valid for {spec.name}: {', '.join(valid)}"
    unknown = [key for key in keys if not any(key in other.settings for other in MODES.values())]
    if unknown:
        return ConfigError(f"unknown precision setting {prefix + unknown[0]!r}{closest(unknown[0], spec.settings)}; {valid_here}")
    owners = [other for other in MODES.values() if keys[0] in other.settings]
    keys = [key for key in keys if all(key in other.settings for other in owners)]
    verb, instead = ("applies" if len(keys) == 1 else "apply"), (owners[0].name if len(owners) == 1 else "one of them")
    return ConfigError(
        f"{', '.join(prefix + key for key in keys)} {verb} to {_in_words(owners)}, not to {spec.name}: use {instead} or remove "
        f"{'it' if len(keys) == 1 else 'them'}; {valid_here}"
    )


def _in_words(modes: list[ModeSpec]) -> str:
    """'opt level O6 (fp8 matmuls)', 'the O0-O6 opt levels', or the modes' names."""
    names = [mode.name for mode in modes]
    if all(mode.runs_fp8 for mode in modes):
        return f"opt level {' and '.join(names)} (fp8 matmuls)"
    if all(not mode.native for mode in modes):
        return f"the {names[0]}-{names[-1]} opt levels"
    return " and ".join(names)


def _check_level_settings(spec: ModeSpec, given: dict[str, Any]) -> None:
    """The parsed settings apex refused for a level (and the ones it accepted silently and then misbehaved on)."""
    if given.get("patch_torch_functions") and not spec.casts_ops:
        raise ConfigError(
            f"patch_torch_functions=True is not valid with opt_level {spec.name}; op-level casting exists only in "
            f"{' and '.join(OP_CASTING_LEVELS)}. Use opt_level='O1' (float16) or 'O4' (bfloat16)."
        )
    if spec.casts_ops:
        _check_op_casting_level(spec.name, given)


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
