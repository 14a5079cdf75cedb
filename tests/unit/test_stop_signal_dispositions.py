"""SIGHUP (a closed terminal) is a stop like SIGTERM, except under nohup, which asked for it to be ignored."""

from __future__ import annotations

import signal

from ampddp.preemption import DEFAULT_STOP_SIGNALS, EarlySignals, StopSignals


def test_sighup_is_caught_as_a_stop_from_the_first_line():
    assert "SIGHUP" in DEFAULT_STOP_SIGNALS
    before = signal.getsignal(signal.SIGHUP)
    with EarlySignals() as early:
        assert signal.getsignal(signal.SIGHUP) == early._stop
        with StopSignals(DEFAULT_STOP_SIGNALS, early=early) as stop:
            assert signal.getsignal(signal.SIGHUP) == stop._handle
    assert signal.getsignal(signal.SIGHUP) == before


def test_sighup_stays_ignored_under_nohup():
    before = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with EarlySignals() as early, StopSignals(DEFAULT_STOP_SIGNALS, early=early) as stop:
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
            assert signal.getsignal(signal.SIGTERM) == stop._handle
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, before)
