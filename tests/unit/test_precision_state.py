"""The typed precision state: round trips per mode, every saved form loads, clear errors, conversion."""

from __future__ import annotations

import ast
import logging
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import make_batches, make_mlp, small_model_settings

from ampddp import PRECISION_MODES, ConfigError, build_engine
from ampddp.amp import Amp
from ampddp.checkpoint.restore import apply_precision, precision_conversion, restore_precision
from ampddp.errors import CheckpointError
from ampddp.precision.state import STATE_VERSION, PrecisionState, ScalerState, convert

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "ampddp"


def trained(mode, steps=3, overflow_at=1, **overrides):
    """An engine after a few steps, one of them with non-finite grads (skipped where the scale is dynamic)."""
    model = make_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = build_engine(mode, **{**small_model_settings(mode), **overrides})
    engine.setup([model], [optimizer])
    for index, (x, y) in enumerate(make_batches(steps)):
        optimizer.zero_grad()
        with engine.forward_context():
            loss = F.cross_entropy(model(x), y)
        engine.backward(loss * float("inf") if index == overflow_at else loss)
        engine.step(optimizer)
    return engine


def fresh(mode, **overrides):
    model = make_mlp()
    engine = build_engine(mode, **{**small_model_settings(mode), **overrides})
    engine.setup([model], [torch.optim.SGD(model.parameters(), lr=0.1)])
    return engine


# ---- round trips ----------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", PRECISION_MODES)
def test_every_mode_round_trips_through_dict_and_into_a_fresh_engine(mode):
    engine = trained(mode)
    state = engine.precision_state()
    assert state.mode == mode and state.impl == "builtin"
    saved = state.to_dict()
    assert saved["version"] == (STATE_VERSION if saved.get("fp8_layers") else 1) and saved == engine.state_dict()  # 2: O6's fp8 layers
    assert PrecisionState.from_dict(saved) == state
    target = fresh(mode)
    target.load_precision_state(state)
    assert target.precision_state() == state and target.skipped_steps == engine.skipped_steps


@pytest.mark.parametrize(("mode", "skipped"), [("O1", 1), ("O2", 1), ("native-fp16", 1), ("O0", 0), ("native-bf16", 0)])
def test_skipped_steps_and_scales_are_in_the_state(mode, skipped):
    state = trained(mode).precision_state()
    assert state.skipped_steps == skipped
    if state.scalers:
        assert state.scalers[0].skipped_steps == skipped
        assert state.scalers[0].dynamic is (skipped == 1)


@pytest.mark.parametrize(
    ("mode", "dtype"),
    [
        ("O0", None),
        ("O1", torch.float16),
        ("O2", torch.float16),
        ("O3", torch.float16),
        ("O4", torch.bfloat16),
        ("O5", torch.bfloat16),
        ("native-fp16", torch.float16),
        ("native-bf16", torch.bfloat16),
    ],
)
def test_compute_dtype_names_the_low_precision_dtype(mode, dtype):
    assert build_engine(mode).compute_dtype == dtype
    assert build_engine(mode, enabled=False).compute_dtype is None


# ---- every saved form loads -----------------------------------------------------------------------


def legacy(saved: dict) -> dict:
    """The form engines wrote before the state had a version (O-levels: no top-level skipped_steps)."""
    old = {key: value for key, value in saved.items() if key != "version"}
    if saved["mode"] in ("O0", "O1", "O2", "O3", "O4", "O5"):
        del old["skipped_steps"]
    return old


@pytest.mark.parametrize("mode", PRECISION_MODES)
def test_states_written_before_versioning_load_to_the_same_state(mode):
    engine = trained(mode)
    old = legacy(engine.state_dict())
    assert PrecisionState.from_dict(old) == engine.precision_state()
    target = fresh(mode)
    target.load_state_dict(old)
    assert target.state_dict() == engine.state_dict()


def test_a_legacy_o2_state_resumes_bit_exactly():
    source = trained("O2", steps=4, growth_interval=2)
    scaler = source.scalers[0]
    target = fresh("O2", growth_interval=2)
    target.load_state_dict(legacy(source.state_dict()))
    loaded = target.scalers[0]
    fields = ("loss_scale", "unskipped", "skipped_steps", "consecutive_skips", "hysteresis_left")
    assert [getattr(loaded, f) for f in fields] == [getattr(scaler, f) for f in fields]
    for found_inf in (False, False, True, False):
        assert scaler.update(found_inf) == loaded.update(found_inf)
        assert [getattr(loaded, f) for f in fields] == [getattr(scaler, f) for f in fields]


def test_apex_amp_state_dict_form_loads():
    state = PrecisionState.from_dict(
        {"loss_scaler0": {"loss_scale": 512.0, "unskipped": 7}, "loss_scaler1": {"loss_scale": 2.0, "unskipped": 0}}
    )
    assert state.mode is None and state.skipped_steps == 0
    assert state.scalers == (ScalerState(loss_scale=512.0, unskipped=7), ScalerState(loss_scale=2.0, unskipped=0))
    assert state.to_apex_dict() == {
        "loss_scaler0": {"loss_scale": 512.0, "unskipped": 7},
        "loss_scaler1": {"loss_scale": 2.0, "unskipped": 0},
    }
    engine = fresh("O1", num_losses=2)
    engine.load_state_dict(state.to_apex_dict())
    assert [s.loss_scale for s in engine.scalers] == [512.0, 2.0] and engine.scalers[0].unskipped == 7


def test_apex_engine_form_loads():
    state = PrecisionState.from_dict({"mode": "O2", "impl": "apex", "scalers": [{"loss_scale": 8.0, "unskipped": 3}], "skipped_steps": 2})
    assert (state.mode, state.impl, state.skipped_steps) == ("O2", "apex", 2)
    assert state.scalers[0].dynamic is None and state.scalers[0].skipped_steps is None
    assert state.to_dict()["scalers"] == [{"loss_scale": 8.0, "unskipped": 3}], "only the fields apex tracks are written back"


def test_grad_scaler_form_loads_with_tensor_counters():
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaler._lazy_init_scale_growth_tracker(torch.device("cpu"))
    scaler._growth_tracker.fill_(5)
    state = PrecisionState.from_dict(scaler.state_dict())
    assert state.scalers == (ScalerState(dynamic=True, loss_scale=1024.0, unskipped=5),)
    assert PrecisionState.from_dict({"scale": torch.tensor([4.0]), "_growth_tracker": torch.tensor([2])}).scalers[0].unskipped == 2
    native = fresh("native-fp16")
    native.load_state_dict(scaler.state_dict())
    assert native.loss_scale() == 1024.0 and native.scaler.state_dict()["_growth_tracker"] == 5


def test_the_amp_facade_reads_and_writes_through_the_typed_state():
    amp = Amp()
    model = make_mlp()
    amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O2", verbosity=0)
    amp.load_state_dict({"mode": "O2", "scalers": [{"dynamic": True, "loss_scale": 64.0, "unskipped": 1}]})
    assert amp.state_dict() == {"loss_scaler0": {"loss_scale": 64.0, "unskipped": 1}}
    assert amp.grad_scaler_state_dict()["scale"] == 64.0
    assert amp.engine.precision_state().scalers[0].loss_scale == 64.0


# ---- bad states are clear errors ------------------------------------------------------------------

BAD = {
    "not a dict": ([1], "precision state must be a dict, got list"),
    "empty": ({}, "precision state is empty; expected ampddp's engine form"),
    "unknown key": ({"mode": "O1", "scalers": [], "scalerz": []}, "key 'scalerz' is not a precision state field; valid: version, mode"),
    "no scalers": ({"mode": "O1"}, "scalers is missing; expected a list"),
    "scalers a dict": ({"mode": "O1", "scalers": {}}, "scalers is a dict; expected a list"),
    "scaler not a dict": ({"mode": "O1", "scalers": [1]}, r"scalers\[0\] must be a dict, got int"),
    "scaler without scale": ({"mode": "O1", "scalers": [{"unskipped": 1}]}, r"scalers\[0\] has keys \['unskipped'\]; expected apex form"),
    "negative scale": (
        {"mode": "O1", "scalers": [{"loss_scale": -1.0}]},
        r"scalers\[0\]: loss scale=-1.0 is not valid; it must be a finite number > 0",
    ),
    "nan scale": ({"mode": "O1", "scalers": [{"loss_scale": float("nan")}]}, "loss scale=nan is not valid"),
    "bad counter": (
        {"mode": "O1", "scalers": [{"loss_scale": 2.0, "unskipped": 1.5}]},
        r"unskipped/_growth_tracker=1.5 is not valid; it must be a whole number",
    ),
    "bad skipped": ({"mode": "O1", "scalers": [{"loss_scale": 2.0, "skipped_steps": -1}]}, "skipped_steps=-1 is not valid"),
    "bad dynamic": ({"mode": "O1", "scalers": [{"loss_scale": 2.0, "dynamic": "yes"}]}, "dynamic='yes' is not valid; valid: True or False"),
    "unknown scaler field": (
        {"mode": "O1", "scalers": [{"loss_scale": 2.0, "scale_window": 5}]},
        "key 'scale_window' is not a loss scaler field; valid: dynamic",
    ),
    "mode not a string": ({"mode": 1, "scalers": []}, "mode=1 is not valid; it must be a string"),
    "policy not a dict": ({"mode": "O1", "scalers": [], "policy": "O1"}, "policy must be a dict"),
    "newer version": (
        {"version": STATE_VERSION + 1, "mode": "O1", "scalers": []},
        f"version={STATE_VERSION + 1} was written by a newer ampddp",
    ),
    "bad top-level skipped": ({"mode": "O1", "scalers": [], "skipped_steps": "3"}, "skipped_steps='3' is not valid"),
    "apex key gap": (
        {"loss_scaler0": {"loss_scale": 2.0}, "loss_scaler2": {"loss_scale": 2.0}},
        "has scalers loss_scaler0, loss_scaler2; apex numbers them",
    ),
    "apex other key": ({"loss_scaler0": {"loss_scale": 2.0}, "optimizer": {}}, "key 'optimizer' is not a loss scaler"),
    "apex bad scaler": ({"loss_scaler0": {"loss_scale": 0}}, "loss_scaler0: loss scale=0 is not valid"),
}


@pytest.mark.parametrize("case", BAD, ids=list(BAD))
def test_bad_states_name_the_bad_entry(case):
    state, message = BAD[case]
    with pytest.raises(ConfigError, match=message):
        PrecisionState.from_dict(state)


def test_a_state_for_another_number_of_scalers_is_refused_and_changes_nothing():
    engine = trained("O1")
    before = engine.state_dict()
    with pytest.raises(ConfigError, match="precision state has 2 loss scalers, this engine has 1"):
        engine.load_state_dict(trained("O1", num_losses=2).state_dict())
    with pytest.raises(ConfigError, match="native-bf16 here expects 0"):
        fresh("native-bf16").load_state_dict(before)
    assert engine.state_dict() == before


def test_restore_names_the_checkpoint_when_its_precision_entry_is_malformed():
    with pytest.raises(CheckpointError, match=r"^ckpt/shared.pt: its 'precision' entry is malformed: scalers\[0\] must be a dict"):
        restore_precision(fresh("O1"), {"mode": "native-fp16", "scalers": [1]}, "ckpt/shared.pt")


def test_a_checkpoints_scaler_count_is_checked_before_anything_is_loaded():
    """What a resume checks first (``precision_conversion``, in ``Checkpointer.plan_resume``) refuses a
    state the engine cannot take, naming the file, and changes nothing; a fitting one applies."""
    engine = trained("O1")
    before = engine.state_dict()
    two = trained("O1", num_losses=2, init_loss_scale=512.0).state_dict()
    with pytest.raises(CheckpointError, match=r"^ckpt/shared.pt: its precision state has 2 loss scaler\(s\); O1 here keeps 1$"):
        precision_conversion(engine, two, "ckpt/shared.pt")
    assert engine.state_dict() == before
    one = trained("O1", init_loss_scale=512.0).state_dict()
    conversion = precision_conversion(engine, one, "ckpt/shared.pt")
    assert engine.state_dict() == before
    assert apply_precision(engine, conversion, "ckpt/shared.pt") == []
    assert engine.precision_state().scalers == PrecisionState.from_dict(one).scalers != PrecisionState.from_dict(before).scalers


# ---- converting between modes ---------------------------------------------------------------------


@pytest.mark.parametrize(("source", "target"), [("O1", "native-fp16"), ("native-fp16", "O2"), ("O2", "O1")])
def test_a_dynamic_scale_carries_over_between_modes(source, target, caplog):
    saved = trained(source, init_loss_scale=512.0)
    engine = fresh(target)
    with caplog.at_level(logging.INFO, logger="ampddp"):
        assert restore_precision(engine, saved.state_dict(), "ckpt") == []
    assert f"ckpt: loss scale 256 carried over from {source} to {target}" in caplog.text
    assert engine.loss_scale() == saved.loss_scale() == 256.0
    assert engine.skipped_steps == saved.skipped_steps == 1
    assert engine.precision_state().mode == target


@pytest.mark.parametrize(
    ("source", "target", "warning"),
    [
        ("O0", "O1", "ckpt: checkpoint precision mode O0 had no dynamic loss scale; O1 starts a fresh scaler at 65536"),
        ("native-bf16", "native-fp16", "mode native-bf16 had no dynamic loss scale; native-fp16 starts a fresh scaler at 65536"),
        ("O2", "native-bf16", "ckpt: dropping the loss scale of O2: native-bf16 does not scale the loss"),
        ("native-fp16", "O5", "dropping the loss scale of native-fp16: O5 does not scale the loss"),
    ],
)
def test_a_scale_only_one_side_has_is_dropped_or_started_fresh_with_a_warning(source, target, warning):
    engine = fresh(target)
    before = engine.state_dict()
    messages = restore_precision(engine, trained(source).state_dict(), "ckpt")
    assert len(messages) == 1 and warning in messages[0]
    assert engine.state_dict() == before


def test_the_same_mode_restores_exactly_and_a_static_target_scaler_keeps_its_own_state():
    saved = trained("O1").precision_state()
    assert convert(saved, fresh("O1").precision_state()).state == saved
    two = fresh("O2", num_losses=2).precision_state()
    static = PrecisionState(mode="O9", scalers=(ScalerState(dynamic=True, loss_scale=8.0), ScalerState(dynamic=False, loss_scale=1.0)))
    carried = convert(saved, static).state
    assert carried.scalers[0].loss_scale == saved.scalers[0].loss_scale and carried.scalers[1] == static.scalers[1]
    both = convert(saved, two).state
    assert [s.loss_scale for s in both.scalers] == [saved.scalers[0].loss_scale] * 2, "each target scaler takes the last saved one"


def test_an_apex_amp_state_without_a_mode_carries_its_scale():
    engine = fresh("native-fp16")
    conversion = convert(PrecisionState.from_dict({"loss_scaler0": {"loss_scale": 32.0, "unskipped": 4}}), engine.precision_state())
    assert "carried over from unnamed" in conversion.note
    engine.load_precision_state(conversion.state)
    assert engine.loss_scale() == 32.0 and engine.scaler.state_dict()["_growth_tracker"] == 4


# ---- structure ------------------------------------------------------------------------------------


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}


def test_native_does_not_import_the_opt_level_engine_and_the_facade_no_concrete_engine():
    assert "ampddp.precision.opt_level" not in imported_modules(PACKAGE / "precision" / "native.py")
    facade = PACKAGE / "amp" / "__init__.py"
    assert not {"ampddp.precision.opt_level", "ampddp.precision.apex_backend", "ampddp.precision.native"} & imported_modules(facade)
    assert not {"OptLevelEngine", "ApexEngine", "NativeAmpEngine"} & {
        n.id for n in ast.walk(ast.parse(facade.read_text())) if isinstance(n, ast.Name)
    }
