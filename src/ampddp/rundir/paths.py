"""User paths as a shell would have given them: ``~`` and ``$VARS`` expanded, and within the file
system's limits on names.

A shell expands ``~`` only at the start of a word, so ``trainer.run_dir=~/runs/q`` reached ampddp
with the ``~`` intact, and a folder named ``~`` appeared in the working directory (which a later
``rm -rf ~/...`` typed to clean up would miss, deleting the home folder instead). Every path
setting goes through ``expand_path``; a run dir with a folder named ``~`` in it is refused.

A name longer than the file system takes (NAME_MAX, 255 bytes on most) or a path longer than PATH_MAX
(4096) was an ``ENAMETOOLONG`` traceback at the first touch; ``refuse_long_names`` refuses it in one
line before anything is written.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from ampddp.errors import ConfigError, escape_controls

_VARIABLE = re.compile(r"\$(?:\{([^}]*)\}|(\w+))")
NAME_MAX = 255
"""The longest name (one path component) in bytes where the file system does not say (``os.pathconf``)."""
PATH_MAX = 4096
"""The longest path in bytes, its closing NUL included, where the file system does not say."""
PATH_HEADROOM = 256
"""Bytes a user's path leaves below PATH_MAX for what ampddp reaches beneath it (a run dir's
``checkpoints/step-000000012/rank-00003.pt``, a logger's folders)."""


def expand_path(value: str | Path, setting: str) -> str:
    """``value`` with ``~``, ``~user``, ``$VAR`` and ``${VAR}`` expanded; ConfigError naming ``setting``
    for a variable that is not set or a ``~user`` that does not exist (nothing is guessed), and for a
    name past the file system's limits (``refuse_long_names``)."""
    text = os.fspath(value)
    for braced, bare in _VARIABLE.findall(text):
        name = braced or bare
        if name not in os.environ:
            raise ConfigError(f"{setting}={text!r} names ${name}, which is not set in the environment; set it, or write the path out")
    expanded = os.path.expanduser(os.path.expandvars(text))
    if expanded.startswith("~"):
        head = expanded.split(os.sep, 1)[0]
        raise ConfigError(f"{setting}={text!r}: {head} is not a home folder here (no such user, or HOME is not set); write the path out")
    refuse_long_names(expanded, setting)
    return expanded


def refuse_long_names(path: str | os.PathLike[str], setting: str) -> None:
    """ConfigError in one line, naming ``setting``, for a path with a name (a component) longer than its
    file system's NAME_MAX bytes, or longer as an absolute path than PATH_MAX less ``PATH_HEADROOM``."""
    text = os.fspath(path)
    name_max, path_max = name_limits(text)
    for part in Path(text).parts:
        size = len(os.fsencode(part))
        if size > name_max:
            raise ConfigError(
                f"{setting}={_cut(text)}: the name {_cut(part)} is {size} bytes; the file system takes names of at most {name_max} bytes"
            )
    size, most = len(os.fsencode(os.path.abspath(text))), path_max - 1 - PATH_HEADROOM
    if size > most:
        raise ConfigError(
            f"{setting}={_cut(text)}: {size} bytes as an absolute path; at most {most} here (the file system's PATH_MAX, "
            f"{path_max}, less room for the names ampddp adds beneath it)"
        )


def name_limits(path: str | os.PathLike[str]) -> tuple[int, int]:
    """The NAME_MAX and PATH_MAX of the file system ``path`` is (or would be) on, asked of its nearest
    existing folder; ``NAME_MAX`` and ``PATH_MAX`` above where the file system does not say."""
    folder = os.path.abspath(os.fspath(path))
    while not os.path.isdir(folder) and os.path.dirname(folder) != folder:
        folder = os.path.dirname(folder)
    return _pathconf(folder, "PC_NAME_MAX", NAME_MAX), _pathconf(folder, "PC_PATH_MAX", PATH_MAX)


def _pathconf(folder: str, name: str, fallback: int) -> int:
    try:
        value = os.pathconf(folder, name)
    except (OSError, ValueError, AttributeError):  # no such variable here, or a platform without pathconf
        return fallback
    return value if value > 0 else fallback


def _cut(text: str) -> str:
    """A long path or name shown by its ends, escaped (the message stays one short line)."""
    shown = text if len(text) <= 80 else f"{text[:40]}...{text[-20:]}"
    return repr(escape_controls(shown))


def refuse_tilde_folder(path: str | Path, setting: str) -> None:
    """A folder literally named ``~`` is refused where ampddp would create it (see the module doc)."""
    if "~" in Path(path).parts:
        raise ConfigError(
            f"{setting}={os.fspath(path)!r} has a folder named '~', which would be created as such (not your home folder); "
            "start the path with ~/ to mean your home folder, or name the folder otherwise"
        )
