"""What every recipe key means, from one place: the docstring under its field in ``ampddp.config``.

``ampddp train --help`` prints it (every key, or one section), and the key table in docs/recipes.md
is this module's output (a docs test compares them), so the help and the docs cannot drift from the
schema. Torch-free: ``--help`` answers without importing torch.
"""

from __future__ import annotations

import ast
import dataclasses
import textwrap
from dataclasses import dataclass
from pathlib import Path

import ampddp.config as config
from ampddp.config import SECTIONS
from ampddp.errors import choice_error, spelled


@dataclass(frozen=True)
class KeyDoc:
    """One recipe key: its dotted name, default, valid values (in words) and what it does."""

    key: str
    default: object
    valid: str
    text: str


def _field_texts() -> dict[str, dict[str, str]]:
    """Each section class's field docstrings (the string right under the field), by class name."""
    tree = ast.parse(Path(config.__file__).read_text(encoding="utf-8"))
    texts: dict[str, dict[str, str]] = {}
    for node in tree.body:
        if not isinstance(node, ast.ClassDef):
            continue
        found = texts.setdefault(node.name, {})
        for field, doc in zip(node.body, node.body[1:]):
            if isinstance(field, ast.AnnAssign) and isinstance(field.target, ast.Name) and _is_text(doc):
                found[field.target.id] = doc.value.value  # type: ignore[attr-defined]
    return texts


def _is_text(node: ast.stmt) -> bool:
    return isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)


def _valid(metadata: dict) -> str:
    choices = metadata.get("choices")
    if choices:
        return ", ".join(map(spelled, choices)) + (", or package.module:function" if metadata.get("import_path") else "")
    bounds = metadata.get("bounds")
    return bounds.describe() if bounds is not None else ""


def key_docs(section: str | None = None) -> list[KeyDoc]:
    """Every key of the recipe (or of ``section``), in the schema's order; a section that does not
    exist is a ConfigError naming the valid ones."""
    if section is not None and section not in SECTIONS:
        raise choice_error("section", section, SECTIONS)
    texts = _field_texts()
    docs = []
    for name, cls in SECTIONS.items():
        if section not in (None, name):
            continue
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
            docs.append(KeyDoc(f"{name}.{f.name}", default, _valid(dict(f.metadata)), texts.get(cls.__name__, {}).get(f.name, "")))
    return docs


def as_yaml(value: object) -> str:
    """A default as a recipe writes it: null, true, [a, b], {k: v}, plain words."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return spelled(value)
    if isinstance(value, (list, tuple)):
        return f"[{', '.join(map(as_yaml, value))}]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{key}: {as_yaml(item)}" for key, item in value.items()) + "}"
    return str(value)


HELP_WIDTH = 110
"""Columns of ``--help``'s descriptions (wrapped whole: a first sentence cut at "e.g." said too little)."""


def describe_keys(section: str | None = None) -> str:
    """``--help``'s list: each key with its default and valid values, then all it does, wrapped."""
    lines = []
    for doc in key_docs(section):
        valid = f"  {{{doc.valid}}}" if doc.valid else ""
        lines.append(f"  {doc.key} = {as_yaml(doc.default)}{valid}")
        lines += textwrap.wrap(" ".join(doc.text.split()), HELP_WIDTH, initial_indent=" " * 6, subsequent_indent=" " * 6,
                               break_long_words=False, break_on_hyphens=False)  # fmt: skip
    return "\n".join(lines)


def keys_markdown() -> str:
    """The docs' key table: every key, its default, valid values and what it does."""
    rows = ["| key | default | valid | what it does |", "|---|---|---|---|"]
    for doc in key_docs():
        text = " ".join(doc.text.split()).replace("|", "\\|")
        rows.append(f"| `{doc.key}` | `{as_yaml(doc.default)}` | {doc.valid.replace('|', '/')} | {text} |")
    return "\n".join(rows) + "\n"
