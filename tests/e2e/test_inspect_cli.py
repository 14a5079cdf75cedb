"""``ampddp inspect``: text and JSON summaries, equal digests for equal weights, clear errors."""

from __future__ import annotations

import json
import subprocess
import sys

from resume_helpers import make_model, make_trainer

from ampddp.checkpoint import keys
from ampddp.checkpoint.files import load_safely
from ampddp.cli import main


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "ampddp", *args], capture_output=True, text=True, timeout=60)


def test_inspect_a_run_dir_as_text_and_json(tmp_path, capsys):
    make_trainer(tmp_path / "run", "O2", max_steps=3).fit()
    assert main(["inspect", str(tmp_path / "run")]) == 0
    text = capsys.readouterr().out
    assert "step 3" in text and "O2 (builtin)" in text and "model_sha256" in text and "world size   1" in text
    result = run_cli("inspect", str(tmp_path / "run" / "checkpoints" / "step-000000003"), "--json")
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["mode"] == "O2" and summary["step"] == 3 and summary["world_size"] == 1
    floating = [t for t in make_model().state_dict().values() if t.is_floating_point()]
    assert summary["dtypes"] == {"float32": 8, "int64": 1} and summary["parameters"] == sum(t.numel() for t in floating)
    # one dynamic scaler at its initial 2**16 (3 steps: no overflow, far from growth_interval), as the checkpoint records
    saved = load_safely(tmp_path / "run" / "checkpoints" / "step-000000003" / keys.SHARED_FILE)[keys.PROGRESS]
    assert summary["loss_scales"] == [2.0**16] and summary["skipped_steps"] == saved["skipped_steps"] == 0
    assert len(summary["model_sha256"]) == 64


def test_digests_match_exactly_when_weights_match(tmp_path, capsys):
    for name in ("a", "b"):
        make_trainer(tmp_path / name, "O1", max_steps=2).fit()
    make_trainer(tmp_path / "c", "O1", max_steps=3).fit()
    digests = {}
    for name in ("a", "b", "c"):
        main(["inspect", str(tmp_path / name), "--json"])
        digests[name] = json.loads(capsys.readouterr().out)["model_sha256"]
    assert digests["a"] == digests["b"] != digests["c"]


def test_bad_paths_exit_non_zero_with_one_line(tmp_path):
    (tmp_path / "broken").mkdir()
    for target in (tmp_path / "missing", tmp_path / "broken"):
        result = run_cli("inspect", str(target))
        assert result.returncode == 2
        assert result.stderr.startswith("ampddp inspect: error:") and result.stderr.count("\n") == 1
    assert run_cli("inspect").returncode == 2
    assert "usage: ampddp" in run_cli("--help").stdout


def test_malformed_checkpoints_are_clear_errors(tmp_path, capsys):
    import torch

    make_trainer(tmp_path / "run", "O0", max_steps=1).fit()
    folder = tmp_path / "run" / "checkpoints" / "step-000000001"
    torch.save({"format_version": 1}, folder / "shared.pt")
    assert main(["inspect", str(folder)]) == 2
    assert "shared.pt: size mismatch" in capsys.readouterr().err, "a replaced file no longer matches the manifest"
    (folder / "COMPLETE").write_text(json.dumps({"step": 1, "world_size": 1, "files": ["rank-00000.pt", "shared.pt"]}))
    assert main(["inspect", str(folder)]) == 2, "an old names-only manifest loads unverified, and the content is checked"
    assert "no model" in capsys.readouterr().err
