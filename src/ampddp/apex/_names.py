"""Errors for apex names ampddp does not provide: each names what was asked for and what to use.

A module's ``__getattr__`` calls :func:`unknown_name`. ``from apex.x import Name`` then fails with an
``ImportError`` that keeps this message (Python would otherwise replace it with a generic "cannot
import name"), while ``getattr``/``hasattr`` probes still get an ``AttributeError``, so code that
feature-detects apex (``hasattr(amp, "state_dict")``) keeps working.
"""

from __future__ import annotations

import dis
import sys
from collections.abc import Mapping

_IMPORT_FROM = dis.opmap["IMPORT_FROM"]


class ApexNameImportError(ImportError):
    """``from apex.x import Name`` for a name ampddp.apex does not provide."""


def _called_by_import_from() -> bool:
    frame = sys._getframe(3)  # unknown_name <- module __getattr__ <- the importing frame
    code = frame.f_code.co_code
    return 0 <= frame.f_lasti < len(code) and code[frame.f_lasti] == _IMPORT_FROM


def unknown_name(module: str, name: str, replacements: Mapping[str, str], provided: list[str]) -> Exception:
    """The error for ``module.name``: its replacement when known, else the names that do exist."""
    shown = module.replace("ampddp.apex", "apex", 1)
    if name in replacements:
        message = f"{shown}.{name} is not provided by ampddp.apex; use {replacements[name]}"
    else:
        message = f"{shown}.{name} is not provided by ampddp.apex; {shown} here provides: {', '.join(sorted(provided))}"
    if _called_by_import_from():
        return ApexNameImportError(message, name=module)
    return AttributeError(message)
