"""Stop signals in the first seconds of ``ampddp train`` (imports, recipe parsing, checks, the build, worker start-up),
and Ctrl-C.

A signal that comes before the interpreter has run ampddp's first line (about 0.1-0.2 s after
the process starts, more on a loaded machine) kills the process as it would any program; the
tests wait for the handler (SigCgt in /proc) when their delay is shorter than that.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import time
from pathlib import Path

import pytest
from test_preemption import train_command

from ampddp.checkpoint.inspect import summarize
from ampddp.cli import main
from ampddp.errors import CheckpointError
from ampddp.preemption import EXIT_INTERRUPTED, EXIT_PREEMPTED, EarlySignals, Interrupted, StopRequested, StopSignals

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


def one_line(log: Path) -> str:
    """The command's own words: its last line, which must not be the end of a traceback."""
    text = log.read_text()
    assert "Traceback" not in text, text[-3000:]
    return text.strip().splitlines()[-1]


@pytest.mark.timeout(900)
def test_a_stop_signal_before_training_ends_the_command_at_once_and_a_later_start_trains(tmp_path):
    """Parsing, checks, imports, the build: nothing new to save, so each signal ends the command in
    seconds with its status (75, or 130 for Ctrl-C) and one line; the run then starts (or resumes) as if
    never stopped. A signal that lands once training began ends in a checkpoint instead."""
    run_dir = tmp_path / "run"
    command = train_command(run_dir, *STEPS)
    for delay, sig in [(0.1, signal.SIGTERM), (0.4, signal.SIGINT), (1.0, signal.SIGUSR1), (2.0, signal.SIGINT)]:
        log = tmp_path / f"{delay}.log"
        with log.open("w") as output:
            started = time.monotonic()
            process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT)
            signal_after(process, started, delay, sig)
            sent = time.monotonic()
            code = process.wait(timeout=240)
        took = time.monotonic() - sent
        expected = EXIT_INTERRUPTED if sig == signal.SIGINT else EXIT_PREEMPTED
        assert code == expected, f"{sig.name} at {delay}s: exit status {code}\n{log.read_text()[-2000:]}"
        said = one_line(log)
        assert f"stopped by {sig.name}" in said, said
        assert took < 60, f"{sig.name} at {delay}s: {took:.0f} s to stop"  # seconds on an idle machine; a loaded one is slower
        with contextlib.suppress(CheckpointError):  # a signal after training began: its checkpoint verifies
            assert summarize(run_dir)["step"] < 200
    finished = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert finished.returncode == 0, finished.stderr[-2000:]
    assert summarize(run_dir)["step"] == 200


@pytest.mark.timeout(400)
def test_a_signal_to_a_spawning_parent_before_training_ends_it_and_its_workers(tmp_path):
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
    assert "stopped by SIGTERM" in one_line(log)
    deadline = time.monotonic() + 30  # multiprocessing's resource tracker leaves once it sees the parent gone
    while any(alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in workers if alive(pid)], "orphaned worker processes"


SIGNAL_WHILE_READING = """
import os, signal, sys
import ampddp.recipe.reading as reading
read = reading.load_config
def read_after_a_sigterm(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGTERM)  # arrives while the recipe is read: it is not known yet which signals stop the run
    return read(*args, **kwargs)
reading.load_config = read_after_a_sigterm
from ampddp.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.timeout(300)
def test_a_signal_while_the_recipe_is_read_ends_the_command_even_one_the_recipe_does_not_stop_on(tmp_path):
    run_dir = tmp_path / "run"
    command = train_command(run_dir, *STEPS, "trainer.stop_signals=[SIGUSR2]")
    command = [command[0], "-c", SIGNAL_WHILE_READING, *command[3:]]  # python -m ampddp ARGS -> python -c PROGRAM ARGS
    process = subprocess.run(command, capture_output=True, text=True, timeout=240)
    assert process.returncode == EXIT_PREEMPTED, process.stderr[-2000:]
    assert process.stderr.strip().splitlines() == [
        "ampddp train: stopped by SIGTERM before training began: nothing new to save; the same command starts (or resumes) the run again"
    ]
    assert not run_dir.exists()


SIGNAL_WHILE_IMPORTING_TORCH = """
import importlib.abc, os, signal, sys
class SignalOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch.nn.modules.linear":  # deep inside torch's own import, below its C extension's start-up
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signal.SIGTERM)
        return None
sys.meta_path.insert(0, SignalOnImport())
from ampddp.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.timeout(300)
def test_a_signal_inside_torchs_import_ends_the_command_at_once_in_one_line(tmp_path):
    """An exception raised inside an extension module's import can abort the interpreter (SIGABRT and
    a C++ stack dump), and waiting for the import took half a minute on a loaded machine: nothing is
    written yet, so the process ends there, with its line and status."""
    command = train_command(tmp_path / "run", *STEPS)
    command = [command[0], "-c", SIGNAL_WHILE_IMPORTING_TORCH, *command[3:]]
    process = subprocess.run(command, capture_output=True, text=True, timeout=240)
    assert process.returncode == EXIT_PREEMPTED, process.stderr[-3000:]
    assert process.stderr.strip().splitlines()[-1].startswith("ampddp train: stopped by SIGTERM before training began")
    assert "Traceback" not in process.stderr
    assert not (tmp_path / "run").exists()


def test_the_run_takes_the_early_catcher_over_and_gives_every_signal_back_after():
    """In-process: early, a signal ends the command (StopRequested, Interrupted for Ctrl-C, itself a
    KeyboardInterrupt); the run's StopSignals takes over the ones it names and, before training, ends
    it too; once training began, a signal is a request; leaving restores what was there before."""
    watched = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)
    before = {sig: signal.getsignal(sig) for sig in watched}
    with EarlySignals() as early:
        with pytest.raises(Interrupted) as caught:
            signal.raise_signal(signal.SIGINT)
        assert isinstance(caught.value, KeyboardInterrupt) and caught.value.exit_code == EXIT_INTERRUPTED
        with StopSignals(["SIGTERM", "SIGINT"], early=early) as stop:
            assert signal.getsignal(signal.SIGUSR2) is before[signal.SIGUSR2]  # not named: given back
            with pytest.raises(StopRequested, match="SIGTERM before training began"):
                signal.raise_signal(signal.SIGTERM)
            stop.begin_training()
            signal.raise_signal(signal.SIGINT)
            signal.raise_signal(signal.SIGINT)  # the same press arriving twice (terminal and launcher)
            assert stop.received == "SIGINT" and stop.requests == 1
        assert {sig: signal.getsignal(sig) for sig in watched} == before


def test_a_second_ctrl_c_stops_at_once(monkeypatch):
    with StopSignals(["SIGTERM", "SIGINT"]) as stop:
        stop.begin_training()
        signal.raise_signal(signal.SIGTERM)
        signal.raise_signal(signal.SIGTERM)  # a second SIGTERM changes nothing: the checkpoint is on its way
        signal.raise_signal(signal.SIGINT)  # a first Ctrl-C asks the same
        signal.raise_signal(signal.SIGINT)  # the same press delivered twice (terminal and launcher)
        assert stop.received == "SIGTERM" and stop.requests == 3
        monkeypatch.setattr("ampddp.preemption.SAME_PRESS_S", 0.0)
        with pytest.raises(Interrupted, match="SIGINT again: stopped at once"):
            signal.raise_signal(signal.SIGINT)


def test_other_commands_give_the_signals_back(tmp_path, capsys):
    before = signal.getsignal(signal.SIGTERM)
    assert main(["inspect", str(tmp_path / "nothing")]) == 2
    assert signal.getsignal(signal.SIGTERM) is before
    assert "no such checkpoint" in capsys.readouterr().err
