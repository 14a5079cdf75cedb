"""Shared fixtures: deterministic seeds, restored environment, no process group left behind, and a
guard that no test leaves torch patched. Cases of opt level O6 skip, with the reason, without torchao."""

from __future__ import annotations

import os

import pytest
import torch
import torch._dynamo
import torch.distributed as dist
import torch.nn.functional as F
import torch.utils.checkpoint
from helpers import HAS_TORCHAO, NO_TORCHAO

from ampddp.precision.casting.cast_context import end_thread_casts

WATCHED_NAMESPACES = (torch, F, torch.Tensor, torch.utils.checkpoint)
"""torch.utils.checkpoint: its recompute classes are stood in for while ampddp casts (casting/recompute.py)."""


def namespace_snapshot() -> dict[tuple[int, str], object]:
    return {(id(ns), name): getattr(ns, name) for ns in WATCHED_NAMESPACES for name in dir(ns) if not name.startswith("__")}


@pytest.fixture(autouse=True)
def _isolated_torch_state():
    """Each test starts from seed 0 and must leave torch's namespaces, default dtype and autocast as it found them."""
    torch.manual_seed(0)
    dtype = torch.get_default_dtype()
    before = namespace_snapshot()
    yield
    torch.set_default_dtype(dtype)
    end_thread_casts()  # an O1/O4 facade window left open after a forward is documented behaviour
    after = namespace_snapshot()
    changed = [name for key, name in ((k, k[1]) for k in before) if after.get(key) is not before[key]]
    assert not changed, f"test left torch attributes patched: {changed[:10]}"
    assert not torch.overrides._is_torch_function_mode_enabled(), "a torch function mode was left active"
    assert not torch.is_autocast_enabled("cpu"), "autocast was left enabled on this thread (it would cast later tests' ops)"


@pytest.fixture(autouse=True)
def _restored_environment():
    """Environment variables a test (or the code it runs: RANK, MASTER_PORT, ...) sets are undone."""
    saved = dict(os.environ)
    yield
    for name in set(os.environ) - set(saved):
        del os.environ[name]
    os.environ.update(saved)


@pytest.fixture(autouse=True)
def _no_process_group_left():
    """A test that initialises a process group in this process must destroy it; one left behind is
    destroyed here and fails the test (it would pair later tests' collectives with stale peers)."""
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        pytest.fail("the test left a torch.distributed process group initialised")


def pytest_collection_modifyitems(config, items):
    """O6 runs its matmuls in fp8 through torchao, an optional extra (``ampddp[fp8]``) that CI
    installs: without it, every test case parametrized with O6 skips, saying so."""
    if HAS_TORCHAO:
        return
    skip = pytest.mark.skip(reason=NO_TORCHAO)
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if any(value == "O6" or (isinstance(value, (tuple, list)) and "O6" in value) for value in params.values()):
            item.add_marker(skip)
