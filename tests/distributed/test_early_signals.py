"""Stop signals in the first seconds of ``ampddp train``: during imports, recipe parsing, validate, worker start-up.

A signal that comes before the interpreter has run ampddp's first line (about 0.1-0.2 s after
the process starts, more on a loaded machine) kills the process as it would any program; the
tests wait for the handler (SigCgt in /proc) when their delay is shorter than that.
"""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import pytest
from test_preemption import train_command

from ampddp.checkpoint.inspect import summarize
from ampddp.cli import main
from ampddp.errors import CheckpointError
from ampddp.preemption import EXIT_PREEMPTED, EarlySignals, StopSignals

pytestmark = pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="reads signal dispositions from /proc")
STEPS = ["trainer.max_steps=200", "trainer.max_epochs=100"]


def catches(pid: int, sig: signal.Signals) -> bool:
    """Whether process ``pid`` has a handler for ``sig`` (its SigCgt mask in /proc)."""
    status = Path(f"/proc/{pid}/status").read_text()
    mask = next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:"))
    return bool(int(mask, 16) >> (sig - 1) & 1)


def signal_after(process: subprocess.Popen, started: float, delay: float, sig: signal.Signals) -> None:
    """Send ``sig`` ``delay`` seconds after ``started``, or as soon as ampddp's handler is in place if later."""
    time.sleep(max(0.0, started + delay - time.monotonic()))
    deadline = time.monotonic() + 60
    while not catches(process.pid, sig):
        assert process.poll() is None and time.monotonic() < deadline, "ampddp never installed its stop-signal handler"
        time.sleep(0.002)
    process.send_signal(sig)


def children(pid: int) -> set[int]:
    try:
        return {int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()}
    except FileNotFoundError:
        return set()


def alive(pid: int) -> bool:
    """True for a live process; a zombie (exited, not yet reaped) counts as gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


@pytest.mark.timeout(900)
def test_a_stop_signal_in_the_first_seconds_checkpoints_exits_75_and_resumes(tmp_path):
    """Each interrupted run resumes the one before it: a signal during a resume's set-up checkpoints too."""
    run_dir = tmp_path / "run"
    command = train_command(run_dir, *STEPS)
    step = 0
    for delay, sig in [(0.1, signal.SIGTERM), (0.3, signal.SIGTERM), (0.6, signal.SIGUSR1), (1.0, signal.SIGTERM),
                       (1.5, signal.SIGTERM), (2.0, signal.SIGTERM)]:  # fmt: skip
        log = tmp_path / f"{delay}.log"
        with log.open("w") as output:
            started = time.monotonic()
            process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT)
            signal_after(process, started, delay, sig)
            code = process.wait(timeout=240)
        assert code == EXIT_PREEMPTED, f"{sig.name} at {delay}s: exit status {code}\n{log.read_text()[-2000:]}"
        assert summarize(run_dir)["step"] > step, f"{sig.name} at {delay}s: no new checkpoint"
        step = summarize(run_dir)["step"]
        assert step < 200
    finished = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert finished.returncode == 0, finished.stderr[-2000:]
    assert summarize(run_dir)["step"] == 200


@pytest.mark.timeout(400)
def test_spawned_workers_get_the_signal_the_parent_received_before_they_existed(tmp_path):
    run_dir = tmp_path / "run"
    log = tmp_path / "spawn.log"
    workers: set[int] = set()
    with log.open("w") as output:
        started = time.monotonic()
        process = subprocess.Popen(train_command(run_dir, *STEPS, "distributed.nproc_per_node=2"), stdout=output, stderr=subprocess.STDOUT)
        signal_after(process, started, 1.0, signal.SIGTERM)
        deadline = time.monotonic() + 300
        while process.poll() is None and time.monotonic() < deadline:
            workers |= children(process.pid)
            time.sleep(0.05)
        code = process.wait(timeout=10)
    assert code == EXIT_PREEMPTED, f"exit status {code}\n{log.read_text()[-3000:]}"
    assert summarize(run_dir)["step"] >= 1
    assert len(workers) >= 2, "the parent never started its workers"
    deadline = time.monotonic() + 30  # multiprocessing's resource tracker leaves once it sees the parent gone
    while any(alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in workers if alive(pid)], "orphaned worker processes"


SIGNAL_WHILE_READING = """
import os, signal, sys
import ampddp.recipe.reading as reading
read = reading.load_config
def read_after_a_sigterm(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGTERM)  # arrives while ampddp holds it, before the recipe is known
    return read(*args, **kwargs)
reading.load_config = read_after_a_sigterm
from ampddp.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.timeout(300)
def test_a_signal_the_recipe_does_not_stop_on_acts_as_if_never_caught(tmp_path):
    run_dir = tmp_path / "run"
    command = train_command(run_dir, *STEPS, "trainer.stop_signals=[SIGUSR2]")
    command = [command[0], "-c", SIGNAL_WHILE_READING, *command[3:]]  # python -m ampddp ARGS -> python -c PROGRAM ARGS
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _, errors = process.communicate(timeout=240)
    assert process.returncode == -signal.SIGTERM, errors[-2000:]
    with pytest.raises(CheckpointError):
        summarize(run_dir)


def test_stop_signals_inherit_what_the_early_catcher_received_and_release_the_rest():
    """In-process: SIGUSR1 arrives early and is configured; SIGUSR2 arrives early and is not, so it is raised again."""
    seen: list[int] = []

    def usr2_handler(signum: int, frame: object) -> None:
        seen.append(signum)

    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    previous = signal.signal(signal.SIGUSR2, usr2_handler)
    try:
        with EarlySignals() as early:
            signal.raise_signal(signal.SIGUSR1)
            signal.raise_signal(signal.SIGUSR2)
            assert seen == []
            with StopSignals(["SIGTERM", "SIGUSR1"], early=early) as stop:
                assert stop.received == "SIGUSR1"
                assert seen == [signal.SIGUSR2]
                assert signal.getsignal(signal.SIGUSR2) is usr2_handler
            assert {sig: signal.getsignal(sig) for sig in before} == before
    finally:
        signal.signal(signal.SIGUSR2, previous)


def test_other_commands_give_the_signals_back(tmp_path, capsys):
    before = signal.getsignal(signal.SIGTERM)
    assert main(["inspect", str(tmp_path / "nothing")]) == 2
    assert signal.getsignal(signal.SIGTERM) is before
    assert "no such checkpoint" in capsys.readouterr().err
