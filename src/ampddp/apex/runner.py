"""The zero-edit runner behind ``python -m ampddp.apex``: parse, alias ``apex``, run the program."""

from __future__ import annotations

import os
import runpy
import sys
from dataclasses import dataclass
from pathlib import Path

from ampddp import amp
from ampddp.apex.aliasing import alias_apex, alias_apex_in_children
from ampddp.distributed.hook_callbacks import let_worker_threads_finish

USAGE = "usage: python -m ampddp.apex [--local-rank N] SCRIPT [ARGS...]  |  python -m ampddp.apex [--local-rank N] -m MODULE [ARGS...]"
LOCAL_RANK_FLAGS = ("--local-rank", "--local_rank")


class RunnerUsageError(ValueError):
    """The runner's own arguments are wrong; the message says what is valid."""


@dataclass(frozen=True)
class Program:
    """What to run: a script path or a module name, its arguments, and a launcher's local rank."""

    target: str
    is_module: bool
    args: list[str]
    local_rank: str | None = None


def parse(argv: list[str]) -> Program:
    """Split the runner's arguments from the program's (everything after SCRIPT / -m MODULE)."""
    local_rank = None
    rest = list(argv)
    while rest and rest[0].split("=", 1)[0] in LOCAL_RANK_FLAGS:
        flag = rest.pop(0)
        if "=" in flag:
            local_rank = flag.split("=", 1)[1]
        elif rest:
            local_rank = rest.pop(0)
        else:
            raise RunnerUsageError(f"{flag} needs a value. {USAGE}")
        if not local_rank.isdigit():
            raise RunnerUsageError(f"{flag}={local_rank!r} is not valid; it must be a whole number >= 0")
    if not rest:
        raise RunnerUsageError(f"no program given. {USAGE}")
    if rest[0] == "-m":
        if len(rest) < 2:
            raise RunnerUsageError(f"-m needs a module name. {USAGE}")
        return Program(rest[1], True, rest[2:], local_rank)
    if rest[0].startswith("-"):
        raise RunnerUsageError(f"unknown runner option {rest[0]!r}; valid: --local-rank N, -m MODULE. {USAGE}")
    if not Path(rest[0]).is_file():
        raise RunnerUsageError(f"script {rest[0]!r} does not exist (or is not a file). {USAGE}")
    return Program(rest[0], False, rest[1:], local_rank)


def local_rank_flag(source: str) -> str:
    """The spelling the program parses: ``--local-rank`` only when it never mentions ``--local_rank``."""
    return "--local-rank" if "--local-rank" in source and "--local_rank" not in source else "--local_rank"


def _source_of(program: Program) -> str:
    try:
        if program.is_module:
            import importlib.util

            spec = importlib.util.find_spec(program.target)
            origin = spec.origin if spec is not None else None
            return Path(origin).read_text(encoding="utf-8", errors="replace") if origin and origin.endswith(".py") else ""
        return Path(program.target).read_text(encoding="utf-8", errors="replace")
    except (OSError, ImportError, ValueError):
        return ""


def run(program: Program) -> None:
    """Run ``program`` as ``__main__`` with apex aliased and apex's process-wide O1/O4 casting (see
    ``Amp.process_wide_casts``); its exceptions and SystemExit propagate."""
    alias_apex()
    alias_apex_in_children()
    args = list(program.args)
    if program.local_rank is not None:
        os.environ.setdefault("LOCAL_RANK", program.local_rank)
        args.insert(0, f"{local_rank_flag(_source_of(program))}={program.local_rank}")
    sys.argv = [program.target, *args]
    try:
        with amp.default.process_wide_casts():
            if program.is_module:
                runpy.run_module(program.target, run_name="__main__", alter_sys=True)
                return
            script = Path(program.target).resolve()  # __main__.__file__ is absolute, as python gives it since 3.9
            sys.path[0] = str(script.parent)
            runpy.run_path(str(script), run_name="__main__")
    finally:
        if _used_a_process_group():
            let_worker_threads_finish()


def _used_a_process_group() -> bool:
    distributed = sys.modules.get("torch.distributed")
    return distributed is not None and (os.environ.get("WORLD_SIZE", "1") not in ("", "0", "1") or distributed.is_initialized())


def main(argv: list[str]) -> int:
    try:
        program = parse(argv)
    except RunnerUsageError as error:
        print(f"ampddp.apex: {error}", file=sys.stderr)
        return 2
    run(program)
    return 0
