"""Recipes and overrides are bounded before they are read: size, nesting depth and alias expansion
each refused in one line naming the bound, a special file refused unread, and control characters
in anything echoed written as escapes (a key with ESC in it must not drive the terminal)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ampddp.cli import EXIT_USAGE, main
from ampddp.recipe.reading import MAX_DEPTH, MAX_NODES, MAX_RECIPE_BYTES

LAUGHS = "\n".join(
    ["a: &a [x, x, x, x, x, x, x, x, x, x]"] + [f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 10)}]" for i in range(8)]
)
"""A billion laughs: under 1 KiB that stands for 10**9 values once its aliases are expanded."""


def refused(tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str | None = None, *overrides: str) -> str:
    recipe = tmp_path / "recipe.yaml"
    if text is not None:
        recipe.write_text(text)
    assert main(["train", str(recipe), f"trainer.run_dir={tmp_path / 'run'}", *overrides]) == EXIT_USAGE
    said = capsys.readouterr().err.strip().splitlines()
    assert len(said) == 1, said
    assert not (tmp_path / "run").exists()
    return said[0]


@pytest.mark.timeout(60)
def test_nested_aliases_are_refused_unexpanded(tmp_path, capsys):
    assert len(LAUGHS) < 1024
    said = refused(tmp_path, capsys, LAUGHS)
    assert f"stands for more than {MAX_NODES} values once its aliases are expanded" in said


@pytest.mark.timeout(60)
def test_nesting_past_the_bound_is_refused_not_a_recursion_error(tmp_path, capsys):
    said = refused(tmp_path, capsys, "model: " + "[" * 20_000 + "]" * 20_000 + "\n")
    assert f"nested more than {MAX_DEPTH} levels deep" in said
    said = refused(tmp_path, capsys, "", "model.name=" + "[" * 5_000 + "]" * 5_000)
    assert said.startswith("ampddp train: error: override 'model.name=[[[[") and f"more than {MAX_DEPTH} levels deep" in said


@pytest.mark.timeout(60)
def test_an_oversized_recipe_is_refused_unread(tmp_path, capsys):
    said = refused(tmp_path, capsys, "# padding\n" * (MAX_RECIPE_BYTES // 10 + 1))
    assert f"a recipe is at most {MAX_RECIPE_BYTES} bytes here (refused unread)" in said
    said = refused(tmp_path, capsys, "", "model.name=" + "x" * (MAX_RECIPE_BYTES + 1))
    assert f"a recipe or an override is at most {MAX_RECIPE_BYTES} bytes" in said and len(said) < 400


@pytest.mark.timeout(60)
def test_a_recipe_that_is_a_fifo_is_refused_without_blocking(tmp_path, capsys):
    os.mkfifo(tmp_path / "recipe.yaml")
    said = refused(tmp_path, capsys)
    assert "recipe.yaml is a FIFO (named pipe), not a regular file" in said


@pytest.mark.timeout(60)
def test_control_characters_in_an_echoed_key_are_escaped(tmp_path, capsys):
    said = refused(tmp_path, capsys, 'trainer:\n  "max\\e[2J\\a\\0steps": 3\n')
    assert not any(character in said for character in "\x1b\x07\x00"), ascii(said)
    assert "\\x1b[2J\\x07\\x00" in said
