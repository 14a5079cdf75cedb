"""Checkpoint integrity: checksummed manifests, verified loads, resume falling back past bad checkpoints,
resume_from an older checkpoint moving newer ones aside, and old names-only manifests still loading."""

from __future__ import annotations

import json
import logging
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import xxhash
from resume_helpers import assert_identical, final_state, make_trainer, state_of, tree_snapshot

from ampddp.checkpoint import CheckpointStore, find_checkpoint, keys
from ampddp.checkpoint.manifest import UNVERIFIED, VERIFIED
from ampddp.cli import main
from ampddp.errors import CheckpointError

ROOT = Path(__file__).resolve().parents[2]
STEP = "step-{:09d}".format
FLIPS_PER_FILE = 12


@pytest.fixture(scope="module")
def base_run(tmp_path_factory) -> Path:
    """A run with good checkpoints at steps 2 and 4 (copied, never modified, by each test)."""
    run = tmp_path_factory.mktemp("base") / "run"
    make_trainer(run, "O0", max_steps=4, checkpoint_every=2, keep_last=None).fit()
    return run


@pytest.fixture
def run(base_run, tmp_path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(base_run, copy)
    return copy


def folder(run: Path, step: int) -> Path:
    return run / "checkpoints" / STEP(step)


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith("ampddp")]


def resume_auto(run: Path, caplog, max_steps: int, **overrides):
    caplog.clear()
    trainer = make_trainer(run, "O0", max_steps=max_steps, **{"checkpoint_every": 2, "keep_last": None, **overrides})
    trainer.fit()
    return trainer, warnings_of(caplog)


def test_the_manifest_records_size_and_checksum_of_every_file(run, capsys):
    manifest = json.loads((folder(run, 4) / "COMPLETE").read_text())
    assert manifest["checksum"] == "xxh3_128" and manifest["world_size"] == 1 and manifest["step"] == 4
    assert sorted(manifest["files"]) == ["rank-00000.pt", "shared.pt"]
    for name, entry in manifest["files"].items():
        data = (folder(run, 4) / name).read_bytes()
        assert entry == {"size": len(data), "xxh3_128": xxhash.xxh3_128(data).hexdigest()}, name
    assert find_checkpoint(folder(run, 4)).verify() == VERIFIED
    assert main(["inspect", str(run), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["integrity"] == "verified" and summary["files"]["shared.pt"] == manifest["files"]["shared.pt"]["size"]
    assert main(["inspect", str(folder(run, 2))]) == 0
    assert "integrity    verified (2 files)" in capsys.readouterr().out


def check_detected(run: Path, path: Path, what: str, caplog, capsys) -> None:
    """``path`` (in step 4) is damaged: load, inspect and resume=auto must each say so, naming the file."""
    ref = find_checkpoint(path.parent)
    loader = CheckpointStore.load_shared if path.name == keys.SHARED_FILE else lambda r: CheckpointStore.load_rank(r, 0)
    with pytest.raises(CheckpointError, match=what) as error:
        loader(ref)
    assert str(path) in str(error.value) and "\n" not in str(error.value)
    assert main(["inspect", str(path.parent)]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and what.split("|")[0] in err and err.count("\n") == 1
    before = tree_snapshot(path.parent)
    trainer, warned = resume_auto(run, caplog, max_steps=2)
    assert trainer.progress.global_step == 2, "resume=auto must fall back to the previous good checkpoint"
    assert len(warned) == 1 and "step 4 does not verify" in warned[0] and str(path) in warned[0], warned
    assert tree_snapshot(path.parent) == before, "the bad checkpoint is left on disk untouched"


def test_byte_flips_anywhere_in_shared_and_rank_files_are_always_detected(run, caplog, capsys):
    rng = random.Random(1234)
    flips = 0
    for name in (keys.SHARED_FILE, keys.RANK_FILE.format(rank=0)):
        path = folder(run, 4) / name
        original = path.read_bytes()
        for _ in range(FLIPS_PER_FILE):
            offset = rng.randrange(len(original))
            damaged = bytearray(original)
            damaged[offset] ^= rng.randrange(1, 256)
            path.write_bytes(bytes(damaged))
            check_detected(run, path, "checksum mismatch", caplog, capsys)
            flips += 1
        path.write_bytes(original)
    assert flips >= 20
    assert find_checkpoint(folder(run, 4)).verify() == VERIFIED


@pytest.mark.parametrize("name", [keys.SHARED_FILE, keys.RANK_FILE.format(rank=0)])
def test_a_truncated_file_is_detected(run, caplog, capsys, name):
    path = folder(run, 4) / name
    path.write_bytes(path.read_bytes()[:-100])
    check_detected(run, path, "size mismatch", caplog, capsys)


def test_a_missing_rank_file_makes_the_checkpoint_incomplete(run, caplog, capsys):
    path = folder(run, 4) / "rank-00000.pt"
    path.unlink()
    check_detected(run, path, "missing", caplog, capsys)
    legacy = json.loads((folder(run, 4) / "COMPLETE").read_text())
    legacy["files"] = ["shared.pt"]  # an old names-only marker of a 1-rank save without its rank file
    (folder(run, 4) / "COMPLETE").write_text(json.dumps(legacy))
    with pytest.raises(CheckpointError, match=r"incomplete checkpoint: rank-00000\.pt is not listed"):
        find_checkpoint(folder(run, 4)).verify()
    with pytest.raises(CheckpointError, match=r"rank-00000\.pt: missing: incomplete checkpoint"):
        CheckpointStore.load_rank(find_checkpoint(folder(run, 4)), 0)
    trainer, warned = resume_auto(run, caplog, max_steps=2)
    assert trainer.progress.global_step == 2 and len(warned) == 1 and "rank-00000.pt" in warned[0]


def test_fallback_keeps_the_bad_folder_until_a_newer_good_checkpoint_replaces_it(run, tmp_path, caplog):
    bad = folder(run, 4)
    shared = bad / "shared.pt"
    data = bytearray(shared.read_bytes())
    data[len(data) // 2] ^= 0x40
    shared.write_bytes(bytes(data))
    before = tree_snapshot(bad)
    trainer, warned = resume_auto(run, caplog, max_steps=3, keep_last=1)  # saves step 3; retention keeps 1
    assert trainer.progress.global_step == 3 and len(warned) == 1
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.is_dir()) == [STEP(3), STEP(4)]
    assert tree_snapshot(bad) == before, "retention must not touch a bad checkpoint newer than the newest good one"
    trainer, warned = resume_auto(run, caplog, max_steps=6, keep_last=1)  # reaches step 4: the bad one moves aside
    assert trainer.progress.global_step == 6
    assert any("moved it to" in line and "abandoned" in line for line in warned), warned
    assert tree_snapshot(run / "abandoned" / STEP(4)) == before, "the bad checkpoint is moved aside, never deleted"
    assert [ref.step for ref in CheckpointStore(run).complete()] == [6]
    make_trainer(tmp_path / "straight", "O0", max_steps=6).fit()
    assert_identical(final_state(tmp_path / "straight"), final_state(run))


def test_resume_from_an_older_checkpoint_moves_newer_ones_aside_and_continues_exactly(tmp_path, caplog):
    run = tmp_path / "run"
    make_trainer(run, "O1", max_steps=6, checkpoint_every=2, keep_last=None).fit()
    caplog.clear()
    make_trainer(run, "O1", max_steps=6, checkpoint_every=2, keep_last=None, resume=folder(run, 2)).fit()
    warned = warnings_of(caplog)
    assert len(warned) == 1 and "moved the newer checkpoint folders aside" in warned[0] and STEP(4) in warned[0], warned
    assert sorted(p.name for p in (run / "abandoned").iterdir()) == [STEP(4), STEP(6)]
    assert [ref.step for ref in CheckpointStore(run).complete()] == [2, 4, 6]
    assert CheckpointStore(run).latest().step == 6
    assert_identical(state_of(run / "abandoned" / STEP(6)), final_state(run))  # == the uninterrupted run from step 2


def test_a_complete_only_folder_does_not_block_resume(run, caplog):
    lonely, garbled = folder(run, 9), folder(run, 8)
    lonely.mkdir()
    shutil.copy(folder(run, 4) / "COMPLETE", lonely / "COMPLETE")
    garbled.mkdir()
    (garbled / "COMPLETE").write_text("{not json")
    trainer, warned = resume_auto(run, caplog, max_steps=4)
    assert trainer.progress.global_step == 4
    assert len(warned) == 2 and "step 9" in warned[0] and str(lonely / "shared.pt") in warned[0] and "missing" in warned[0]
    assert "step 8" in warned[1] and "unreadable completion marker" in warned[1]
    assert lonely.is_dir() and garbled.is_dir()


def test_an_old_names_only_manifest_still_loads_unverified(run, caplog, capsys):
    marker = folder(run, 4) / "COMPLETE"
    old = json.loads(marker.read_text())
    marker.write_text(json.dumps({"step": 4, "world_size": 1, "time": old["time"], "files": sorted(old["files"])}))
    assert find_checkpoint(folder(run, 4)).verify() == UNVERIFIED
    assert main(["inspect", str(run)]) == 0
    assert "integrity    not verified (written before checksums)" in capsys.readouterr().out
    trainer, warned = resume_auto(run, caplog, max_steps=5)
    assert trainer.progress.global_step == 5 and warned == []


def cli(*args: str, timeout: int = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ampddp", *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)


CLI_FAST = ["data.batch_size=8", "data.eval_fraction=0.05", "trainer.progress=lines", "checkpoint.every_steps=2"]


@pytest.mark.timeout(300)
def test_cli_falls_back_past_a_corrupt_checkpoint_and_resume_from_moves_newer_ones_aside(tmp_path):
    recipe, run = str(ROOT / "recipes" / "quickstart.yaml"), tmp_path / "run"
    train = ["train", recipe, f"trainer.run_dir={run}", "trainer.max_steps=4", *CLI_FAST]
    first = cli(*train)
    assert first.returncode == 0, first.stderr[-2000:]
    rank_file = folder(run, 4) / "rank-00000.pt"
    data = bytearray(rank_file.read_bytes())
    data[7 * len(data) // 10] ^= 0xFF
    rank_file.write_bytes(bytes(data))
    inspected = cli("inspect", str(folder(run, 4)), timeout=60)
    assert inspected.returncode == 2 and inspected.stderr.count("\n") == 1
    assert str(rank_file) in inspected.stderr and "checksum mismatch" in inspected.stderr
    second = cli(*train)
    assert second.returncode == 0, second.stderr[-2000:]
    skipped = [line for line in second.stderr.splitlines() if "does not verify" in line]
    assert len(skipped) == 2 and "skipped and left on disk" in skipped[0] and str(rank_file) in skipped[0], second.stderr[-3000:]
    assert "moved it to" in skipped[1], "reaching step 4 again moves the bad folder aside before writing a good one"
    assert "at step 2" in second.stderr and (run / "abandoned" / STEP(4) / "rank-00000.pt").read_bytes() == bytes(data)
    third = cli(*train, f"checkpoint.resume_from={folder(run, 2)}")
    assert third.returncode == 0, third.stderr[-2000:]
    assert f"{STEP(4)} -> {run / 'abandoned' / (STEP(4) + '.2')}" in third.stderr, third.stderr[-3000:]
    assert find_checkpoint(run).step == 4 and find_checkpoint(run).verify() == VERIFIED
