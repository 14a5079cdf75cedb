"""No test waits longer inside than its own pytest timeout allows: an inner subprocess or collective
timeout at or above it would be cut by pytest first, with a stack dump instead of the test's message."""

from __future__ import annotations

import ast
import re
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
DEFAULT_TIMEOUT_S = 120  # pyproject.toml's [tool.pytest.ini_options] timeout
INNER = ("timeout", "timeout_s", "job_timeout_s")


def _mark(decorators: list[ast.expr], default: int) -> int:
    for decorator in decorators:
        if isinstance(decorator, ast.Call) and getattr(decorator.func, "attr", "") == "timeout" and decorator.args:
            return int(decorator.args[0].value)  # type: ignore[attr-defined]
    return default


def _inner_timeouts(call: ast.Call) -> list[float]:
    return [kw.value.value for kw in call.keywords if kw.arg in INNER and isinstance(kw.value, ast.Constant)
            and isinstance(kw.value.value, (int, float))]  # fmt: skip


def test_every_inner_timeout_is_below_its_tests_pytest_timeout():
    over = []
    for path in sorted(TESTS.rglob("test_*.py")):
        text = path.read_text(encoding="utf-8")
        module = re.search(r"pytestmark\s*=.*timeout\((\d+)\)", text)
        default = int(module.group(1)) if module else DEFAULT_TIMEOUT_S
        for node in ast.parse(text).body:
            if not (isinstance(node, ast.FunctionDef) and node.name.startswith("test")):
                continue
            limit = _mark(node.decorator_list, default)
            inner = [value for call in ast.walk(node) if isinstance(call, ast.Call) for value in _inner_timeouts(call)]
            if inner and max(inner) >= limit:
                over.append(f"{path.relative_to(TESTS)}::{node.name}: waits up to {max(inner)} s inside a {limit} s test")
    assert not over, "\n".join(over)
