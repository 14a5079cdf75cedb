"""HookCallbacks: a communication hook's chained callbacks run as ``future.then`` would, and
``settle`` waits, with the GIL given up, for the ones that ran until whoever holds them lets go."""

from __future__ import annotations

import threading

import torch

from ampddp.distributed.hook_callbacks import HookCallbacks


class WorkerHeldFuture:
    """A future whose worker runs the callback and keeps holding it, as torch's gloo thread does
    between completing the chained future and releasing the callback."""

    def __init__(self, value):
        self._value = value
        self.held = None

    def value(self):
        return self._value

    def then(self, fn):
        self.held = fn
        return fn(self)

    def release_later(self, delay_s):
        def release():
            threading.Event().wait(delay_s)
            self.held = None

        thread = threading.Thread(target=release)
        thread.start()
        return thread


def test_a_chained_callback_gives_its_result_and_is_released_once_run():
    callbacks = HookCallbacks()
    parent = torch.futures.Future()
    child = callbacks.then(parent, lambda done: done.value() * 2)
    assert callbacks.unreleased == 0  # not run yet
    parent.set_result(torch.tensor(3.0))
    assert child.wait().item() == 6.0
    assert callbacks.unreleased == 0 and callbacks.settle(limit_s=0.0)


def test_settle_waits_until_the_worker_releases_a_callback_that_ran():
    callbacks = HookCallbacks()
    future = WorkerHeldFuture(torch.tensor(1.0))
    assert callbacks.then(future, lambda done: done.value() + 1).item() == 2.0
    assert callbacks.unreleased == 1
    assert callbacks.settle(limit_s=0.05) is False  # still held: settle gives up at its limit and says so
    releaser = future.release_later(0.2)
    assert callbacks.settle(limit_s=60.0) is True  # returns only once released, long before the limit
    releaser.join()
    assert callbacks.unreleased == 0


def test_callbacks_of_collectives_still_running_are_not_waited_for():
    callbacks = HookCallbacks()
    pending = torch.futures.Future()
    callbacks.then(pending, lambda done: done.value())
    assert callbacks.settle(limit_s=60.0) is True and callbacks.unreleased == 0
