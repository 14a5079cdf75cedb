"""A symbolic link planted in a run dir, where ampddp writes its lock, metrics, summary or plots,
never makes a run write outside it: appended files refuse the link in one line, whole files replace
the link with a real file."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from ampddp.cli import EXIT_USAGE, main
from ampddp.rundir.files import METRICS_FILE, PLOT_FILES, SUMMARY_FILE, replace_file
from ampddp.rundir.lock import LOCK_FILE

REPO = Path(__file__).resolve().parents[2]
SHORT = ["trainer.max_steps=2", "data.batch_size=8", "data.eval_fraction=0.05", "trainer.progress=lines"]


def train(run_dir: Path) -> int:
    return main(["train", str(REPO / "recipes" / "quickstart.yaml"), f"trainer.run_dir={run_dir}", *SHORT])


def planted(tmp_path: Path, name: str) -> tuple[Path, Path]:
    """A run dir holding a link ``name`` to a file outside it; returns (run dir, outside file)."""
    outside = tmp_path / "precious.txt"
    outside.write_text("keep me\n")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / name).symlink_to(outside)
    return run_dir, outside


@pytest.mark.parametrize("name", [LOCK_FILE, METRICS_FILE])
def test_a_link_where_an_appended_file_belongs_is_refused_in_one_line(tmp_path, capsys, name):
    run_dir, outside = planted(tmp_path, name)
    assert train(run_dir) == EXIT_USAGE
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and f"{run_dir / name} is a symbolic link" in error[0]
    assert outside.read_text() == "keep me\n"


@pytest.mark.parametrize("name", [SUMMARY_FILE, PLOT_FILES[0]])
def test_a_link_where_a_whole_file_belongs_is_replaced_not_followed(tmp_path, name):
    if name in PLOT_FILES:
        pytest.importorskip("matplotlib")
    run_dir, outside = planted(tmp_path, name)
    assert train(run_dir) == 0
    assert outside.read_text() == "keep me\n"
    assert (run_dir / name).is_file() and not (run_dir / name).is_symlink()


def test_whole_files_get_the_usual_mode_and_leave_no_temporary_behind(tmp_path):
    umask = os.umask(0o022)
    os.umask(umask)
    target = tmp_path / "summary.json"
    replace_file(target, b"{}")
    assert target.read_bytes() == b"{}" and [p.name for p in tmp_path.iterdir()] == ["summary.json"]
    assert stat.S_IMODE(target.stat().st_mode) == 0o666 & ~umask  # as open() gives, not tempfile's 0o600


def test_a_linked_abandoned_folder_never_receives_the_checkpoints_a_resume_sets_aside(tmp_path, capsys):
    run_dir = tmp_path / "run"
    common = [*SHORT, "trainer.max_steps=4", "checkpoint.every_steps=2", "checkpoint.keep_last=2", "optimizer.scheduler=none"]
    assert main(["train", str(REPO / "recipes" / "quickstart.yaml"), f"trainer.run_dir={run_dir}", *common]) == 0
    outside = tmp_path / "outside"
    outside.mkdir()
    (run_dir / "abandoned").symlink_to(outside)
    step_2 = sorted((run_dir / "checkpoints").iterdir())[0]
    command = [
        "train",
        str(REPO / "recipes" / "quickstart.yaml"),
        f"trainer.run_dir={run_dir}",
        *common,
        f"checkpoint.resume_from={step_2}",
    ]
    capsys.readouterr()
    assert main(command) == EXIT_USAGE
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and f"{run_dir / 'abandoned'} is a symbolic link" in error[0], error
    assert list(outside.iterdir()) == []
    assert len(list((run_dir / "checkpoints").glob("*/COMPLETE"))) == 2
