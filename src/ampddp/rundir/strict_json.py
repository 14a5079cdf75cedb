"""The run dir's JSON (metrics.jsonl, summary.json) as strict JSON, non-finite numbers included.

Python's ``json`` writes a NaN or infinite float as a bare ``NaN`` / ``Infinity``, which is no JSON:
``jq``, JavaScript, Go, Rust's serde and pandas' strict readers refuse the whole file over one diverged
evaluation loss. So a record is written with each non-finite number as ``null``, and a field
``nonfinite`` naming each such field and what it was: ``{"loss": null, "nonfinite": {"loss": "nan"}}``
(``"inf"``, ``"-inf"``; a field inside a list or mapping is named by its path, ``"layers.3.amax"``).
Reading gives the numbers back, and still reads the bare ``NaN`` of files written before.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

NONFINITE_FIELD = "nonfinite"
"""The field of a record that names its non-finite numbers (written as null) and what each was."""
_SPELLED = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def dumps(record: Mapping[str, Any], **options: Any) -> str:
    """``record`` as strict JSON (``json.dumps``'s ``options``): non-finite numbers written as null and
    named in its ``nonfinite`` field."""
    found: dict[str, str] = {}
    finite = _finite(dict(record), "", found)
    if found:
        finite[NONFINITE_FIELD] = found
    return json.dumps(finite, allow_nan=False, **options)


def loads(text: str | bytes) -> Any:
    """A value ``dumps`` wrote (or plain JSON, bare ``NaN`` included), its non-finite numbers restored."""
    value = json.loads(text)
    if isinstance(value, dict) and isinstance(value.get(NONFINITE_FIELD), dict):
        for path, spelled in value.pop(NONFINITE_FIELD).items():
            _restore(value, str(path).split("."), spelled)
    return value


def _finite(value: Any, path: str, found: dict[str, str]) -> Any:
    """``value`` with each non-finite float (at any depth) replaced by None and named in ``found``."""
    if isinstance(value, float) and not math.isfinite(value):
        found[path] = "nan" if math.isnan(value) else "inf" if value > 0 else "-inf"
        return None
    if isinstance(value, Mapping):
        return {key: _finite(item, f"{path}.{key}" if path else str(key), found) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item, f"{path}.{index}" if path else str(index), found) for index, item in enumerate(value)]
    return value


def _restore(record: dict[str, Any], path: list[str], spelled: Any) -> None:
    """Put the non-finite number ``spelled`` back at ``path``; a flag naming no null there (a file
    edited by hand) is passed over."""
    if spelled not in _SPELLED:
        return
    holder: Any = record
    for part in path[:-1]:
        key = _key(holder, part)
        holder = None if key is None else holder[key]
    key = _key(holder, path[-1])
    if key is not None and holder[key] is None:
        holder[key] = _SPELLED[spelled]


def _key(holder: Any, part: str) -> str | int | None:
    """Where ``part`` names a value of ``holder``: its key in a dict, its index in a list; else None."""
    if isinstance(holder, dict):
        return part if part in holder else None
    if isinstance(holder, list) and part.isdecimal() and int(part) < len(holder):
        return int(part)
    return None
