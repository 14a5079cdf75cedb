"""``trainer.compile``: the Trainer and ``ampddp train`` under torch.compile.

The model is compiled after the precision set-up; checkpoints hold the bare module (no
``_orig_mod.`` keys), so they move between compiled and eager runs unchanged. ``aot_eager`` keeps
these tests fast on CPU (no code generation) and runs the same kernels as eager: at O0 a compiled
run trains bit-exactly like an eager one, so compiled->eager and eager->compiled resumes can be
compared with an uninterrupted eager run bit for bit. In bf16 modes, where the compiled graph may
round differently from eager, a resumed compiled run must equal its own uninterrupted run, and a
checkpoint loads bit-exactly into a trainer of the other kind, which trains on from it.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
import torch._dynamo
from resume_helpers import assert_identical, final_state, make_trainer, state_of
from torch._dynamo.testing import CompileCounterWithBackend

from ampddp.checkpoint import keys
from ampddp.checkpoint.files import load_safely
from ampddp.checkpoint.store import CheckpointStore
from ampddp.cli import main
from ampddp.errors import ConfigError
from ampddp.observe import read_metrics
from ampddp.recipe.factories import model_compiler
from ampddp.recipe.reading import load_config
from ampddp.training.compile_model import ModelCompiler

BACKEND = "aot_eager"
COMPILED = ModelCompiler(backend=BACKEND)
TOTAL, STOP = 8, 4
"""Steps of a full run and of its first part: the stop falls inside epoch 0, the end after epoch 0's evaluation."""

RECIPE = """\
precision:
  mode: {mode}
model:
  name: mlp
data:
  name: digits
  image_size: 8
  channels: 1
  batch_size: 16
  augment: false
  eval_fraction: 0.1
optimizer:
  scheduler: none
trainer:
  max_steps: 3
  run_dir: {run_dir}
  log_every_steps: 1
  progress: off
  eval_every_steps: 2
  compile: true
  compile_backend: aot_eager
checkpoint:
  every_steps: 2
"""


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Compiled code and guards from one test never serve another."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def run(run_dir: Path, mode: str, max_steps: int, compile: Any, **overrides: Any) -> Path:
    """Train the resume set-up (no eval set: evaluation has its own test) and return its run dir."""
    make_trainer(run_dir, mode, max_steps, compile=compile, **{"eval_set": None, **overrides}).fit()
    return run_dir


def assert_same(saved: Any, loaded: Any, where: str = "") -> None:
    """Nested dicts / lists of tensors and plain values, equal bit for bit."""
    if isinstance(saved, torch.Tensor):
        assert isinstance(loaded, torch.Tensor) and saved.dtype == loaded.dtype and torch.equal(saved, loaded), where
    elif isinstance(saved, dict):
        assert isinstance(loaded, dict) and list(saved) == list(loaded), where
        for key in saved:
            assert_same(saved[key], loaded[key], f"{where}.{key}")
    elif isinstance(saved, (list, tuple)):
        assert len(saved) == len(loaded), where
        for index, (a, b) in enumerate(zip(saved, loaded)):
            assert_same(a, b, f"{where}[{index}]")
    else:
        assert saved == loaded, where


@pytest.mark.timeout(90)
def test_o0_checkpoints_move_between_compiled_and_eager_runs_bit_exactly(tmp_path):
    eager = run(tmp_path / "eager", "O0", TOTAL, False, checkpoint_every=STOP)
    eager_at_stop = CheckpointStore(eager).complete()[0]
    compiled_then_eager = run(tmp_path / "compiled-then-eager", "O0", STOP, COMPILED)
    compiled_at_stop = CheckpointStore(compiled_then_eager).latest()
    run(compiled_then_eager, "O0", TOTAL, False)
    eager_then_compiled = run(tmp_path / "eager-then-compiled", "O0", TOTAL, COMPILED, resume=str(eager_at_stop.path))

    assert eager_at_stop.step == compiled_at_stop.step == STOP
    saved = load_safely(compiled_at_stop.shared_file)[keys.MODEL]
    assert saved and not any("_orig_mod" in key for key in saved)
    assert_identical(state_of(eager_at_stop.path), state_of(compiled_at_stop.path))
    straight = final_state(eager)
    assert straight["progress"]["global_step"] == TOTAL and straight["progress"]["epoch"] == 1
    assert_identical(straight, final_state(compiled_then_eager))
    assert_identical(straight, final_state(eager_then_compiled))


@pytest.mark.timeout(90)
def test_a_bf16_compiled_run_resumes_bit_exactly_and_its_checkpoint_trains_on_eagerly(tmp_path):
    compiled = run(tmp_path / "compiled", "native-bf16", TOTAL, COMPILED, checkpoint_every=STOP)
    at_stop = CheckpointStore(compiled).complete()[0]
    assert at_stop.step == STOP and not any("_orig_mod" in key for key in state_of(at_stop.path)["model"])
    resumed = run(tmp_path / "resumed", "native-bf16", TOTAL, COMPILED, resume=str(at_stop.path))
    assert_identical(final_state(compiled), final_state(resumed))
    eager = final_state(run(tmp_path / "eager", "native-bf16", TOTAL, False, resume=str(at_stop.path)))
    assert eager["progress"] == final_state(compiled)["progress"]
    assert list(eager["model"]) == list(final_state(compiled)["model"])


@pytest.mark.timeout(90)
@pytest.mark.parametrize(("saved_by", "loaded_by"), [(COMPILED, False), (False, COMPILED)], ids=["compiled-to-eager", "eager-to-compiled"])
def test_an_o4_checkpoint_loads_bit_exactly_whichever_run_wrote_it(tmp_path, saved_by, loaded_by):
    ref = CheckpointStore(run(tmp_path / "source", "O4", STOP, saved_by)).latest()
    trainer = make_trainer(None, "O4", TOTAL, compile=loaded_by, eval_set=None)
    trainer.load_checkpoint(ref)
    saved, loaded = load_safely(ref.shared_file), trainer.state_dict()
    assert not any("_orig_mod" in key for key in saved[keys.MODEL])
    for key in (keys.MODEL, keys.OPTIMIZER, keys.PRECISION, keys.SCHEDULER, keys.PROGRESS, keys.SAMPLER):
        assert_same(saved[key], loaded[key], key)


@pytest.mark.timeout(60)
def test_evaluation_uses_the_compiled_model_in_eval_mode():
    counter = CompileCounterWithBackend(BACKEND)
    compiled = make_trainer(None, "O0", 3, compile=ModelCompiler(backend=counter))
    compiled_result = compiled.fit()
    eager = make_trainer(None, "O0", 3)
    eager_result = eager.fit()
    # fit ends with an evaluation. Dropout and BatchNorm act differently in eval mode: evaluating
    # with the training graph (or leaving the model in eval mode) would not give eager's numbers.
    assert compiled_result["eval"] == eager_result["eval"] and compiled_result["eval"]["samples"] == 10
    assert counter.frame_count >= 2, "a training graph and an evaluation graph"
    assert compiled.run.model.training and compiled.run.module.training, "training mode is restored after evaluation"
    assert compiled.run.model is not compiled.run.module and eager.run.model is eager.run.module
    frames = counter.frame_count
    torch.manual_seed(1)  # the eval set draws noise from the global generator: the same for both
    compiled_again = compiled.evaluate()
    torch.manual_seed(1)
    assert compiled_again == eager.evaluate()
    assert counter.frame_count == frames, "a second evaluation reuses the evaluation graph"


@pytest.mark.timeout(120)
def test_a_compiled_recipe_trains_logs_its_compile_time_and_resumes_eagerly(tmp_path, capsys, caplog):
    run_dir = tmp_path / "run"
    recipe = tmp_path / "compiled.yaml"
    recipe.write_text(RECIPE.format(mode="native-bf16", run_dir=run_dir))
    with caplog.at_level(logging.INFO, logger="ampddp.compile"):
        assert main(["train", str(recipe)]) == 0, capsys.readouterr().err
    lines = [r.getMessage() for r in caplog.records if r.name == "ampddp.compile"]
    assert len(lines) == 1 and "torch.compile (mode default, backend aot_eager): the first training forward and backward took" in lines[0]
    records = read_metrics(run_dir)
    compiled = [r for r in records if r["kind"] == "compile"]
    assert len(compiled) == 1 and compiled[0]["step"] == 1 and compiled[0]["compile_s"] > 0, compiled
    assert compiled[0]["mode"] == "default" and compiled[0]["backend"] == BACKEND
    assert [r["step"] for r in records if r["kind"] == "train"] == [1, 2, 3]
    assert [r["step"] for r in records if r["kind"] == "eval"] == [2, 3]
    saved = final_state(run_dir)["model"]
    assert saved and not any("_orig_mod" in key for key in saved)

    caplog.clear()
    assert main(["train", str(recipe), "trainer.max_steps=5", "trainer.compile=false"]) == 0, capsys.readouterr().err
    assert not [r for r in caplog.records if r.name == "ampddp.compile"], "an eager run compiles nothing"
    assert final_state(run_dir)["progress"]["global_step"] == 5
    assert [r["step"] for r in read_metrics(run_dir) if r["kind"] == "compile"] == [1]


def test_a_recipe_setting_becomes_the_trainers_compile_part(tmp_path):
    recipe = tmp_path / "compiled.yaml"
    recipe.write_text(RECIPE.format(mode="O0", run_dir=tmp_path / "run"))
    assert model_compiler(load_config(recipe)) == ModelCompiler("default", BACKEND)
    assert model_compiler(load_config(recipe, ["trainer.compile=max-autotune-no-cudagraphs"])) == ModelCompiler(
        "max-autotune-no-cudagraphs", BACKEND
    )
    assert model_compiler(load_config(recipe, ["trainer.compile=false", "trainer.compile_backend=no-such-backend"])) is None
    assert load_config(recipe, ["trainer.compile=off"]).trainer.compile is False  # YAML's off


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ("fast", "compile='fast' is not valid"),
        ("max-autotune-no-cudagraph", "compile='max-autotune-no-cudagraph' is not valid (did you mean 'max-autotune-no-cudagraphs'?)"),
        (1, "compile=1 (int) is not valid"),
    ],
)
def test_the_trainer_refuses_a_bad_compile_setting_before_building_anything(setting, message):
    with pytest.raises(ConfigError) as error:
        make_trainer(None, "O0", 3, compile=setting)
    assert message in str(error.value)
    assert "false, true, default, reduce-overhead, max-autotune, max-autotune-no-cudagraphs" in str(error.value)


def test_compile_settings_map_to_modes():
    assert ModelCompiler.from_setting(False) is None and ModelCompiler.from_setting(None) is None
    assert ModelCompiler.from_setting(True, BACKEND) == ModelCompiler("default", BACKEND)
    assert ModelCompiler.from_setting("reduce-overhead", BACKEND).mode == "reduce-overhead"
    with pytest.raises(ConfigError, match=r"trainer\.compile_backend='inductr' is not a torch.compile backend \(did you mean 'inductor'"):
        ModelCompiler.from_setting(True, "inductr", where="trainer.")
