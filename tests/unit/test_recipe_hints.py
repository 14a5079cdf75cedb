"""A recipe mistake is answered with what was meant and where it was written."""

from __future__ import annotations

import re

import pytest

from ampddp.errors import ConfigError
from ampddp.recipe.reading import load_config


@pytest.mark.parametrize(
    ("override", "meant"),
    [
        ("optimizer.lerning_rate=0.1", "lr"),
        ("optimizer.learning_rate=0.1", "lr"),
        ("trainer.epochs=3", "max_epochs"),
        ("trainer.num_epoch=3", "max_epochs"),
        ("trainer.gradient_accumulation_steps=2", "grad_accum_steps"),
        ("precision.opt_level=O2", "mode"),
        ("checkpoint.save_steps=10", "every_steps"),
        ("trainer.max_step=3", "max_steps"),
    ],
)
def test_an_unknown_key_names_ampddps_key_for_it_whether_misspelt_or_another_trainers_name(override, meant):
    key = override.split("=")[0]
    with pytest.raises(ConfigError, match=re.escape(f"unknown key {key} (did you mean {meant!r}?)")):
        load_config(None, [override])


def test_a_bad_value_in_the_recipe_file_names_the_file_and_one_from_an_override_does_not(tmp_path):
    recipe = tmp_path / "job.yaml"
    recipe.write_text("trainer:\n  epochs: 3\n")
    with pytest.raises(ConfigError, match=re.escape(f"{recipe}: unknown key trainer.epochs (did you mean 'max_epochs'?)")):
        load_config(recipe)
    recipe.write_text("optimizer:\n  lr: abc\n")
    with pytest.raises(ConfigError, match=re.escape(f"{recipe}: optimizer.lr='abc' has the wrong type; expected float")):
        load_config(recipe)
    with pytest.raises(ConfigError, match=r"^optimizer.lr='x' has the wrong type"):
        load_config(recipe, ["optimizer.lr=x"])
    assert load_config(recipe, ["optimizer.lr=0.5"]).optimizer.lr == 0.5
