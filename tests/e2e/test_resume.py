"""Bit-exact resume: 2N steps straight == N steps, stop, resume, N more — every mode, 1 and 2 processes."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import RUNNABLE_MODES
from resume_helpers import assert_identical, final_state, make_trainer, straight_and_resumed

from ampddp import PRECISION_MODES
from ampddp.distributed import launch_local


@pytest.mark.parametrize("mode", PRECISION_MODES)
def test_resume_is_bit_exact_in_one_process(mode, tmp_path):
    straight, resumed = straight_and_resumed(tmp_path, mode)
    assert resumed["progress"]["global_step"] == 14
    assert resumed["progress"]["epoch_position"] not in (0, 44), "the stop must fall inside an epoch"
    assert_identical(straight, resumed)


def two_process_worker(env, root, modes):
    for mode in modes:
        straight_and_resumed(Path(root), mode, env=env)
    return True


@pytest.mark.timeout(360)
@pytest.mark.smoke
def test_resume_is_bit_exact_in_two_processes(tmp_path):
    launch_local(two_process_worker, 2, (str(tmp_path), list(RUNNABLE_MODES)), device="cpu", timeout_s=300)
    for mode in RUNNABLE_MODES:
        assert_identical(final_state(tmp_path / f"{mode}-straight"), final_state(tmp_path / f"{mode}-resumed"))


def test_a_finished_run_writes_a_final_checkpoint_and_resume_continues_it(tmp_path):
    trainer = make_trainer(tmp_path, "O0", max_steps=None, max_epochs=2)
    trainer.fit()
    state = final_state(tmp_path)
    assert state["progress"]["epoch"] == 2 and state["progress"]["epoch_position"] == 0
    extended = make_trainer(tmp_path, "O0", max_steps=None, max_epochs=3)
    result = extended.fit()
    assert result["progress"]["epoch"] == 3 and result["eval"]["samples"] == 10
