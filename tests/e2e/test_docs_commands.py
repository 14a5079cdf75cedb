"""The README's and the docs' command blocks marked runnable run as written.

A block is marked by a line ``<!-- runnable -->`` right before its fence. Each command of it runs
in a scratch folder beside links to the repository's ``recipes/`` and ``examples/`` (so what it
writes, ``runs/...``, stays there); a ``pip install -e ".[extras]"`` is not run again (the test
environment is that install) but its extras must exist in setup.py.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```")
RUNNABLE = "<!-- runnable -->"
PIP_EDITABLE = re.compile(r'^pip install -e "\.(?:\[([\w,-]+)\])?"$')


def runnable_blocks() -> list[tuple[str, str]]:
    """(where, block) of every block marked runnable; a Python block's text starts with PYTHON."""
    blocks = []
    for page in PAGES:
        lines = page.read_text(encoding="utf-8").splitlines()
        for index, line in enumerate(lines):
            if line.strip() == RUNNABLE:
                end = next(i for i in range(index + 2, len(lines)) if FENCE.match(lines[i]))
                text = "\n".join(lines[index + 2 : end])
                blocks.append((f"{page.name}:{index + 1}", PYTHON + text if lines[index + 1].strip() == "```python" else text))
    return blocks


PYTHON = "#!python\n"
"""The mark runnable_blocks puts before a Python block: it runs as a script, not as commands."""


def extras() -> set[str]:
    return set(re.findall(r'^\s+"([\w-]+)": ', (ROOT / "setup.py").read_text(), flags=re.MULTILINE))


def test_the_quickstart_training_command_is_marked_runnable():
    assert any("ampddp train recipes/quickstart.yaml" in block for _, block in runnable_blocks())


@pytest.mark.timeout(900)
@pytest.mark.parametrize(("where", "block"), runnable_blocks(), ids=[where for where, _ in runnable_blocks()])
def test_a_runnable_block_runs_as_written(where, block, tmp_path):
    for name in ("recipes", "examples"):
        (tmp_path / name).symlink_to(ROOT / name)
    bin_dir = Path(sys.executable).parent
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}", "PYTHONPATH": str(ROOT / "src")}
    if block.startswith(PYTHON):  # a script, as a user would save and run it
        (tmp_path / "script.py").write_text(block.removeprefix(PYTHON))
        done = subprocess.run([sys.executable, "script.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=840)
        assert done.returncode == 0, f"{where}: the script exited {done.returncode}:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
        return
    for line in block.splitlines():
        for command in (part.strip() for part in line.split("&&")):
            if not command or command.startswith("#"):
                continue
            editable = PIP_EDITABLE.match(command)
            if editable:
                wanted = set((editable.group(1) or "").split(",")) - {""}
                assert wanted <= extras(), f"{where}: {command}: setup.py has no extra(s) {wanted - extras()}"
                continue
            done = subprocess.run(shlex.split(command), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=840)
            assert done.returncode == 0, f"{where}: `{command}` exited {done.returncode}:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
