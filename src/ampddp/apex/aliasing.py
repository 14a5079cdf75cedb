"""Make ``import apex`` (and ``import amp_C``, ``import apex_C``) resolve to ``ampddp.apex`` in this process.

An import hook at the front of ``sys.meta_path`` maps ``apex.X.Y`` to ``ampddp.apex.X.Y``: the same
module objects under both names, so ``apex.amp is ampddp.apex.amp``. A name ampddp.apex does not
provide fails with a ``ModuleNotFoundError`` that names it and what to use instead. The runner
(``python -m ampddp.apex``) installs it, and puts a small shim folder on ``PYTHONPATH`` so that
processes the program starts (``spawn`` workers, subprocesses) alias ``apex`` too; a program can also
call :func:`alias_apex` itself.

Libraries ask whether apex is *installed*, not only importable (transformers reads
``importlib.metadata.version("apex")``, others scan distributions or run ``pip show apex``). The shim
folder holds an ``apex-0.1.dist-info`` (0.1: the version every apex build reports), so wherever the
shim is on the path, under the runner and in the processes it starts, apex is found as installed
by every standard tool; a process that aliases itself gets the same record from the hook. Nothing is
written to the user's environment: outside the runner no apex is found.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.metadata
import importlib.util
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

ALIASES = {"apex": "ampddp.apex", "amp_C": "ampddp.apex.amp_C", "apex_C": "ampddp.apex.apex_C"}


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec: Any) -> ModuleType:
        try:
            return importlib.import_module(self.target)
        except ModuleNotFoundError as error:
            if error.name is None or not self.target.startswith(error.name):
                raise
            raise ModuleNotFoundError(_missing_message(spec.name), name=spec.name) from None

    def exec_module(self, module: ModuleType) -> None:
        """The target module ran when it was imported under its own name."""


def _missing_message(name: str) -> str:
    from ampddp.apex import REPLACEMENTS

    parts = name.split(".")
    hint = REPLACEMENTS.get(parts[1]) if len(parts) > 1 and parts[0] == "apex" else None
    suggestion = f"use {hint}" if hint else "see the table of apex names in ampddp's README (Migrating from apex)"
    return f"{name} is not provided by ampddp.apex (apex's stand-in on native torch); {suggestion}"


class ApexAliasFinder(importlib.abc.MetaPathFinder):
    """Finds ``apex``/``amp_C``/``apex_C`` modules as their ``ampddp.apex`` counterparts."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        root, _, rest = fullname.partition(".")
        if root not in ALIASES:
            return None
        aliased = ALIASES[root] + (f".{rest}" if rest else "")
        # The loader hands back the real ampddp module, which keeps its own __spec__ and __path__.
        return importlib.util.spec_from_loader(fullname, _AliasLoader(aliased))

    def find_distributions(self, context: Any = None) -> Iterator[importlib.metadata.Distribution]:
        """apex's distribution record, unless the shim folder is on the searched path (the path finder
        then finds it there: answering here too would list apex twice)."""
        context = context or importlib.metadata.DistributionFinder.Context()
        if context.name is not None and _normalized(context.name) != "apex":
            return
        if any(_is_shim_dir(entry) for entry in context.path):
            return
        yield importlib.metadata.PathDistribution(APEX_DIST_INFO)


SHIM_DIR = Path(__file__).with_name("_shim")
"""Put on PYTHONPATH by the runner: child processes find ``apex`` there, which aliases itself."""
APEX_DIST_INFO = SHIM_DIR / "apex-0.1.dist-info"
"""The metadata an installed apex 0.1 has, for ``importlib.metadata``, ``pkg_resources`` and pip."""


def _normalized(name: str) -> str:
    return name.lower().replace("-", "_").replace(".", "_")


def _is_shim_dir(entry: Any) -> bool:
    try:
        return isinstance(entry, str) and Path(entry or ".").resolve() == SHIM_DIR.resolve()
    except OSError:
        return False


PROCESS_WIDE_ENV = "AMPDDP_APEX_PROCESS_WIDE"
"""Set to 1 by the runner for the processes it starts: their ``apex.amp`` casts O1/O4 process-wide, as the runner's does."""


def alias_apex() -> None:
    """Install the alias hook (idempotent). A real ``apex`` already imported is replaced by ours."""
    if not any(isinstance(finder, ApexAliasFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, ApexAliasFinder())
    for name in [n for n in sys.modules if n.partition(".")[0] in ALIASES]:
        module = sys.modules[name]
        if not getattr(module, "__name__", "").startswith("ampddp."):
            del sys.modules[name]


def alias_apex_in_children() -> None:
    """Make processes this one starts (``spawn`` workers, subprocesses) alias ``apex`` as well."""
    current = os.environ.get("PYTHONPATH", "")
    parts = current.split(os.pathsep) if current else []
    if str(SHIM_DIR) not in parts:
        os.environ["PYTHONPATH"] = os.pathsep.join([str(SHIM_DIR), *parts])
    if str(SHIM_DIR) not in sys.path:
        sys.path.append(str(SHIM_DIR))  # spawn children take the parent's sys.path over their own
    os.environ[PROCESS_WIDE_ENV] = "1"


def adopt_runner_scope() -> None:
    """In a process the runner started (a ``spawn`` worker), cast O1/O4 process-wide as the runner's own process does."""
    if os.environ.get(PROCESS_WIDE_ENV) == "1":
        from ampddp.amp import default

        default.set_process_wide_casts(True)
