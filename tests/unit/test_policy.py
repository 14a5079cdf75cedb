"""Opt levels as data: the property table and every override rule, including the error cases."""

from __future__ import annotations

import pytest
import torch

from ampddp import ConfigError, Precision, build_engine
from ampddp.precision.modes import MODES, OPT_LEVELS, check_settings, resolve_policy
from ampddp.precision.policy import DYNAMIC

EXPECTED = {
    # level: cast_model_type, patch_torch_functions, keep_batchnorm_fp32, master_weights, loss_scale, op dtype
    "O0": (torch.float32, False, None, False, 1.0, None),
    "O1": (None, True, None, None, DYNAMIC, torch.float16),
    "O2": (torch.float16, False, True, True, DYNAMIC, None),
    "O3": (torch.float16, False, False, False, 1.0, None),
    "O4": (None, True, None, None, 1.0, torch.bfloat16),
    "O5": (torch.bfloat16, False, True, True, 1.0, None),
}


@pytest.mark.parametrize("level", list(EXPECTED))
def test_level_properties_match_apex_table(level):
    policy = resolve_policy(level)
    got = (
        policy.cast_model_type,
        policy.patch_torch_functions,
        policy.keep_batchnorm_fp32,
        policy.master_weights,
        policy.loss_scale,
        policy.op_cast_dtype,
    )
    assert got == EXPECTED[level]
    assert policy == OPT_LEVELS[level]
    assert policy.max_loss_scale == 2.0**24 and policy.num_losses == 1 and policy.enabled


def test_dynamic_scale_starts_at_min_of_2_16_and_max():
    assert resolve_policy("O1").first_loss_scale == 2.0**16
    assert resolve_policy("O2", max_loss_scale=1024.0).first_loss_scale == 1024.0
    assert resolve_policy("O2", init_loss_scale=8.0).first_loss_scale == 8.0
    assert resolve_policy("O3", loss_scale=128).first_loss_scale == 128.0


@pytest.mark.parametrize(
    ("overrides", "field", "expected"),
    [
        ({"keep_batchnorm_fp32": "False"}, "keep_batchnorm_fp32", False),
        ({"keep_batchnorm_fp32": "True"}, "keep_batchnorm_fp32", True),
        ({"keep_batchnorm_fp32": False}, "keep_batchnorm_fp32", False),
        ({"loss_scale": "128.0"}, "loss_scale", 128.0),
        ({"loss_scale": 64}, "loss_scale", 64.0),
        ({"loss_scale": "dynamic"}, "loss_scale", DYNAMIC),
        ({"cast_model_type": "bf16"}, "cast_model_type", torch.bfloat16),
        ({"cast_model_type": torch.bfloat16}, "cast_model_type", torch.bfloat16),
        ({"cast_model_outputs": torch.float16}, "cast_model_outputs", torch.float16),
        ({"master_weights": False}, "master_weights", False),
        ({"num_losses": 3}, "num_losses", 3),
        ({"min_loss_scale": 1.0, "max_loss_scale": 2.0**10}, "min_loss_scale", 1.0),
        ({"verbosity": 0}, "verbosity", 0),
        ({"enabled": False}, "enabled", False),
        ({"hysteresis": 3, "growth_interval": 10}, "hysteresis", 3),
        ({"loss_scale": None}, "loss_scale", DYNAMIC),
    ],
)
def test_overrides_on_o2(overrides, field, expected):
    assert getattr(resolve_policy("O2", **overrides), field) == expected


def test_o1_accepts_patch_false_and_fp32_model_type():
    policy = resolve_policy("O1", patch_torch_functions=False, cast_model_type=torch.float32)
    assert policy.patch_torch_functions is False and policy.cast_model_type is torch.float32


def test_o5_can_opt_into_dynamic_scaling():
    assert resolve_policy("O5", loss_scale="dynamic").dynamic_loss_scale


@pytest.mark.parametrize(
    ("level", "overrides", "names"),
    [
        ("O7", {}, ["opt_level", "O0", "O5", "letter 'O'"]),
        ("0O", {}, ["opt_level", "'0O'", "letter 'O'"]),
        ("o1", {}, ["did you mean 'O1'"]),
        (1, {}, ["opt_level=1"]),
        ("O1", {"cast_model_type": torch.float16}, ["cast_model_type=float16", "O1", "None or torch.float32"]),
        ("O4", {"cast_model_type": "bf16"}, ["cast_model_type=bfloat16", "O4"]),
        ("O1", {"keep_batchnorm_fp32": True}, ["keep_batchnorm_fp32", "O1", "valid: None"]),
        ("O1", {"master_weights": True}, ["master_weights", "O1"]),
        ("O4", {"master_weights": False}, ["master_weights", "O4"]),
        ("O2", {"patch_torch_functions": True}, ["patch_torch_functions=True", "O2", "O1", "O4"]),
        ("O0", {"patch_torch_functions": True}, ["patch_torch_functions=True", "O0"]),
        ("O2", {"keep_batchnorm_fp32": "yes"}, ["keep_batchnorm_fp32='yes'", "'True'"]),
        ("O2", {"loss_scale": "big"}, ["loss_scale='big'", "dynamic"]),
        ("O2", {"loss_scale": -1}, ["loss_scale=-1"]),
        ("O2", {"loss_scale": float("inf")}, ["loss_scale=inf"]),
        ("O2", {"loss_scale": True}, ["loss_scale=True"]),
        ("O2", {"cast_model_type": torch.int8}, ["cast_model_type", "torch.float16"]),
        ("O2", {"num_losses": 0}, ["num_losses=0", ">= 1"]),
        ("O2", {"num_losses": 1.5}, ["num_losses=1.5"]),
        ("O2", {"min_loss_scale": 0}, ["min_loss_scale=0"]),
        ("O2", {"min_loss_scale": 8.0, "max_loss_scale": 4.0}, ["min_loss_scale=8.0", "max_loss_scale=4.0"]),
        ("O2", {"init_loss_scale": 2.0**30}, ["init_loss_scale"]),
        ("O2", {"growth_factor": 1.0}, ["growth_factor=1.0", "> 1"]),
        ("O2", {"backoff_factor": 1.5}, ["backoff_factor=1.5", "(0, 1)"]),
        ("O2", {"growth_interval": 0}, ["growth_interval=0"]),
        ("O2", {"verbosity": -1}, ["verbosity=-1"]),
        ("O2", {"enabled": "maybe"}, ["enabled='maybe'"]),
        ("O2", {"keep_bn_fp32": True}, ["keep_bn_fp32", "did you mean 'keep_batchnorm_fp32'"]),
    ],
)
def test_invalid_settings_name_the_argument_and_valid_choices(level, overrides, names):
    with pytest.raises(ConfigError) as error:
        resolve_policy(level, **overrides)
    for name in names:
        assert name in str(error.value)


def test_policy_is_frozen_and_describes_itself_as_plain_data():
    policy = resolve_policy("O2")
    with pytest.raises(AttributeError):
        policy.loss_scale = 1.0
    described = policy.describe()
    assert described["cast_model_type"] == "float16" and described["opt_level"] == "O2"
    assert all(isinstance(v, (str, int, float, bool, type(None))) for v in described.values())


@pytest.mark.parametrize(
    ("level", "line"),
    [
        ("O0", "O0: fp32 throughout"),
        ("O1", "O1: float16 ops per apex's lists, fp32 weights, dynamic loss scale from 65536"),
        ("O2", "O2: float16 model (BatchNorm fp32), fp32 master weights, dynamic loss scale from 65536"),
        ("O3", "O3: float16 model, no master weights"),
        ("O4", "O4: bfloat16 ops per apex's lists, fp32 weights"),
        ("O5", "O5: bfloat16 model (BatchNorm fp32), fp32 master weights"),
    ],
)
def test_a_set_up_is_logged_as_one_line_saying_what_the_level_does(level, line):
    assert resolve_policy(level).summary() == line


def test_a_mode_row_names_its_engine_and_the_settings_that_one_check_takes():
    for name, spec in MODES.items():
        if not spec.runs_fp8:  # O6's engine converts its layers with torchao, an optional package
            assert isinstance(build_engine(name), spec.engine), name
    # One check, for every door: build_engine, Precision (when it is made) and a recipe's keys (their names).
    said = "hysteresis applies to the O0-O6 opt levels, not to native-fp16: use one of them or remove it; valid for native-fp16: "
    valid = "loss_scale, init_loss_scale, growth_factor, backoff_factor, growth_interval, enabled"
    for attempt in (lambda: build_engine("native-fp16", hysteresis=2), lambda: Precision("native-fp16", overrides={"hysteresis": 2})):
        with pytest.raises(ConfigError, match=said + valid):
            attempt()
    with pytest.raises(ConfigError, match=r"precision.hysteresis applies to the O0-O6 opt levels, not to native-fp16: .*growth_interval$"):
        check_settings("native-fp16", {"hysteresis": 2}, prefix="precision.", offered=("loss_scale", "growth_interval", "hysteresis"))
    with pytest.raises(ConfigError, match=r"precision mode auto picks a mode per device and takes no mode settings; got hysteresis=2"):
        check_settings("auto", {"hysteresis": 2})
    with pytest.raises(ConfigError, match=r"unknown precision setting 'bogus'; valid for native-fp16: loss_scale,"):
        build_engine("native-fp16", hysteresis=2, bogus=1)  # an unknown name first: another mode's can wait
    with pytest.raises(ConfigError, match=r"fp8_recipe, hysteresis apply to opt level O6 \(fp8 matmuls\), not to native-fp16: use O6"):
        build_engine("native-fp16", fp8_recipe="rowwise", hysteresis=2)
