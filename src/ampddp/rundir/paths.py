"""User paths as a shell would have given them: ``~`` and ``$VARS`` expanded.

A shell expands ``~`` only at the start of a word, so ``trainer.run_dir=~/runs/q`` reached ampddp
with the ``~`` intact, and a folder named ``~`` appeared in the working directory (which a later
``rm -rf ~/...`` typed to clean up would miss, deleting the home folder instead). Every path
setting goes through ``expand_path``; a run dir with a folder named ``~`` in it is refused.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from ampddp.errors import ConfigError

_VARIABLE = re.compile(r"\$(?:\{([^}]*)\}|(\w+))")


def expand_path(value: str | Path, setting: str) -> str:
    """``value`` with ``~``, ``~user``, ``$VAR`` and ``${VAR}`` expanded; ConfigError naming ``setting``
    for a variable that is not set or a ``~user`` that does not exist (nothing is guessed)."""
    text = os.fspath(value)
    for braced, bare in _VARIABLE.findall(text):
        name = braced or bare
        if name not in os.environ:
            raise ConfigError(f"{setting}={text!r} names ${name}, which is not set in the environment; set it, or write the path out")
    expanded = os.path.expanduser(os.path.expandvars(text))
    if expanded.startswith("~"):
        head = expanded.split(os.sep, 1)[0]
        raise ConfigError(f"{setting}={text!r}: {head} is not a home folder here (no such user, or HOME is not set); write the path out")
    return expanded


def refuse_tilde_folder(path: str | Path, setting: str) -> None:
    """A folder literally named ``~`` is refused where ampddp would create it (see the module doc)."""
    if "~" in Path(path).parts:
        raise ConfigError(
            f"{setting}={os.fspath(path)!r} has a folder named '~', which would be created as such (not your home folder); "
            "start the path with ~/ to mean your home folder, or name the folder otherwise"
        )
