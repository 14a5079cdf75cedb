"""``ampddp --help`` / ``--version`` and the recipe schema answer without importing torch (6-7 s of
imports on a busy machine), and the light lists of choices agree with the torch code behind them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ampddp import choices
from ampddp.cli import main


@pytest.mark.timeout(180)
def test_help_version_and_the_recipe_schema_do_not_import_torch():
    probe = (
        "import sys, contextlib, io\n"
        "from ampddp.cli import build_parser\n"
        "from ampddp.recipe.key_docs import describe_keys\n"
        "build_parser(); describe_keys()\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    try:\n"
        "        build_parser().parse_args(['--version'])\n"
        "    except SystemExit:\n"
        "        pass\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


@pytest.mark.timeout(180)
def test_a_run_dir_that_is_a_file_or_a_missing_data_root_is_refused_before_torch_loads(tmp_path):
    recipe = str(Path(__file__).resolve().parents[2] / "recipes" / "quickstart.yaml")
    (tmp_path / "file").write_text("")
    refusals = [
        [f"trainer.run_dir={tmp_path / 'file' / 'run'}"],
        [f"trainer.run_dir={tmp_path / 'run'}", "data.name=cifar10", f"data.root={tmp_path / 'none'}"],
        [f"trainer.run_dir={tmp_path / 'run'}", f"checkpoint.resume_from={tmp_path / 'none'}"],
    ]
    for overrides in refusals:
        probe = (
            "import sys\nfrom ampddp.cli import main\n"
            f"code = main(['train', {recipe!r}, *{overrides!r}])\n"
            "print(code, sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
        )
        done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
        assert done.stdout.strip() == "2 []", (overrides, done.stdout, done.stderr)
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert not (tmp_path / "run").exists()


def test_version_names_the_installed_distribution(capsys):
    try:
        main(["--version"])
    except SystemExit as stop:
        assert stop.code == 0
    assert capsys.readouterr().out.startswith("ampddp ")


def test_the_light_choices_match_the_engines_and_wrappers():
    from ampddp.precision.modes import MODES, NATIVE_MODES, OPT_LEVELS

    assert tuple(OPT_LEVELS) == choices.OPT_LEVEL_NAMES
    assert tuple(NATIVE_MODES) == choices.NATIVE_MODE_NAMES
    assert tuple(MODES) == choices.PRECISION_MODES
    assert all(spec.policy is None or spec.policy.opt_level == name for name, spec in MODES.items())


@pytest.mark.timeout(180)
def test_a_checkout_beside_the_working_directory_never_hides_the_installed_package(tmp_path):
    """A clone is a folder named ampddp; with the package at its top level, Python started next to it
    imported the clone as an empty namespace package ahead of an editable install's finder. Under
    src/ the install puts src/ on the path, where the real package wins."""
    import importlib.metadata
    import json
    import os

    records = [dist.read_text("direct_url.json") for dist in importlib.metadata.distributions(name="ampddp")]
    if not any(record and json.loads(record).get("dir_info", {}).get("editable") for record in records):
        import pytest

        pytest.skip("ampddp is not installed editable here (pip install -e .): the case is an editable install beside its clone")
    clone = tmp_path / "ampddp"
    (clone / "recipes").mkdir(parents=True)
    (clone / "setup.py").write_text("")
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    probe = "import ampddp; from ampddp import Trainer, prepare; print(ampddp.__file__)"
    done = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().endswith(os.path.join("src", "ampddp", "__init__.py"))
