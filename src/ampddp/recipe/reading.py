"""Reading a recipe: YAML plus dotted ``key=value`` overrides into a checked RunConfig.

Every key is checked before any work starts: an unknown key names the closest valid one, a wrong
type names the expected type, a bad choice lists the valid ones, a number out of range says the
range. Duplicate keys are refused (YAML would keep the last silently) and floats are read in every
notation Python writes them.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from ampddp.choices import INT64_MAX
from ampddp.config import IMPORT_PATH_FORM, KEY_ALIASES, SECTIONS, Bounds, RunConfig, is_import_path
from ampddp.errors import ConfigError, choice_error, closest, shown
from ampddp.rundir.files import read_regular_file
from ampddp.rundir.paths import expand_path

# PyYAML implements YAML 1.1, whose float pattern wants a dot and a signed exponent: `1e-3` and `1E6`
# would stay strings. Recipes and overrides read floats in every notation Python writes them. No key
# takes a date, so YAML 1.1's dates stay text: `trainer.run_dir=2024-05-01` is a folder's name, and
# `2024-13-45` no ValueError.
_FLOAT_TAG = "tag:yaml.org,2002:float"
_DATE_TAG = "tag:yaml.org,2002:timestamp"
_FLOAT = re.compile(
    r"""^(?:[-+]?(?:[0-9][0-9_]*\.[0-9_]*(?:[eE][-+]?[0-9]+)?|\.[0-9][0-9_]*(?:[eE][-+]?[0-9]+)?|[0-9][0-9_]*[eE][-+]?[0-9]+)"""
    r"""|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"""
)


MAX_RECIPE_BYTES = 1024 * 1024
"""The largest recipe read (the bundled ones are under 2 KiB): a bigger file is refused unread."""
MAX_DEPTH = 32
"""The deepest nesting of lists and mappings a recipe or an override may have."""
MAX_NODES = 100_000
"""The most values a recipe may stand for once every alias is expanded (a "billion laughs" of
nested aliases is a few hundred bytes that expand beyond any memory)."""


class _TooBig(Exception):
    """A recipe past one of the bounds above, refused as it is composed."""


class _Unreadable(Exception):
    """A value YAML parsed but Python cannot make (an integer past Python's digit limit, ``!!float x``)."""


class _RecipeLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` with Python's float notations (``1e-3``, ``1E6``, ``.5``, ``-2.5e-4``)
    that refuses nesting deeper than ``MAX_DEPTH`` as it composes (PyYAML's composer recurses, so a
    value nested 20 000 deep would end in a RecursionError)."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self._depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                mark = self.peek_event().start_mark
                raise _TooBig(
                    f"line {mark.line + 1}: nested more than {MAX_DEPTH} levels deep; a recipe's values are at most {MAX_DEPTH} deep"
                )
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


_RecipeLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag not in (_FLOAT_TAG, _DATE_TAG)]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_RecipeLoader.add_implicit_resolver(_FLOAT_TAG, _FLOAT, list("-+0123456789."))


class _DuplicateKey(Exception):
    def __init__(self, key: str, first: int, second: int) -> None:
        super().__init__(
            f"duplicate key {key!r} on lines {first} and {second}; each key may appear once (YAML would silently keep the last)"
        )


def _refuse_duplicates(node: yaml.Node, where: str = "") -> None:
    if isinstance(node, yaml.MappingNode):
        seen: dict[str, int] = {}
        for key_node, value_node in node.value:
            if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
                name = f"{where}.{key_node.value}" if where else key_node.value
                line = key_node.start_mark.line + 1
                if name in seen:
                    raise _DuplicateKey(name, seen[name], line)
                seen[name] = line
                _refuse_duplicates(value_node, name)
    elif isinstance(node, yaml.SequenceNode):
        for item in node.value:
            _refuse_duplicates(item, where)


def _expanded_size(node: yaml.Node, sizes: dict[int, int]) -> int:
    """How many values ``node`` stands for with its aliases expanded, each shared node counted once
    per use but measured once (linear in the composed document, however far it would expand)."""
    known = sizes.get(id(node))
    if known is not None:
        return known
    children: list[yaml.Node] = []
    if isinstance(node, yaml.SequenceNode):
        children = node.value
    elif isinstance(node, yaml.MappingNode):
        children = [part for pair in node.value for part in pair]
    size = 1
    for child in children:
        size += _expanded_size(child, sizes)
        if size > MAX_NODES:
            raise _TooBig(
                f"line {node.start_mark.line + 1}: stands for more than {MAX_NODES} values once its aliases are expanded; "
                "a recipe is at most that large (nested aliases that multiply are refused unexpanded)"
            )
    sizes[id(node)] = size
    return size


def parse_yaml(text: str) -> Any:
    """One YAML document with Python float notations; raises yaml.YAMLError, _DuplicateKey, _Unreadable
    or _TooBig (more than ``MAX_RECIPE_BYTES``, ``MAX_DEPTH`` or ``MAX_NODES``)."""
    if len(text) > MAX_RECIPE_BYTES:
        raise _TooBig(f"{len(text)} characters; a recipe or an override is at most {MAX_RECIPE_BYTES} bytes")
    loader = _RecipeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _expanded_size(node, {})
        _refuse_duplicates(node)
        return _constructed(loader, node)
    finally:
        loader.dispose()


def _constructed(loader: _RecipeLoader, node: yaml.Node) -> Any:
    """The document's values; a ValueError of Python's in making one is _Unreadable."""
    try:
        return loader.construct_document(node)
    except ValueError as error:
        reason = str(error).split(";")[0][:200]  # Python's advice after it (sys.set_int_max_str_digits) is not the user's
        raise _Unreadable(f"a value cannot be read: {reason}") from None


def _drops_a_comment(text: str) -> bool:
    """Whether YAML reads part of ``text`` as a comment: a ``#`` outside every token it scans (``runs/exp #3``
    is the scalar ``runs/exp`` and the comment ``#3``; in ``'exp #3'`` the ``#`` is in the scalar)."""
    loader = _RecipeLoader(text)
    gaps, position = [], 0
    try:
        while loader.check_token():
            token = loader.get_token()
            gaps.append(text[position : token.start_mark.index])
            position = max(position, token.end_mark.index)
    finally:
        loader.dispose()
    return any("#" in gap for gap in [*gaps, text[position:]])


def _yaml_problem(error: yaml.YAMLError) -> str:
    mark, problem = getattr(error, "problem_mark", None), getattr(error, "problem", None)
    if mark is not None and problem:
        return f"line {mark.line + 1}, column {mark.column + 1}: {problem}"
    return str(error).splitlines()[0] if str(error) else type(error).__name__


def _allowed_types(annotation: Any) -> tuple[Any, ...]:
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return tuple(arg for member in typing.get_args(annotation) for arg in _allowed_types(member))
    return (annotation,)


INT64 = Bounds(-INT64_MAX - 1, INT64_MAX)
"""The range of every integer key, within its own: torch and the C library read counts as int64."""


def _check_number(key: str, value: float, bounds: Bounds | None) -> float:
    if isinstance(value, float) and not math.isfinite(value):
        rule = f" {bounds.describe()}" if bounds else ""
        raise ConfigError(f"{key}={value!r} is not valid; it must be a finite number{rule}")
    if isinstance(value, int) and not INT64.admits(value):
        bounds = _int64(bounds)  # the key's own range, within int64's
    if bounds is not None and not bounds.admits(value):
        kind = "a finite number" if isinstance(value, float) else "an integer"
        raise ConfigError(f"{key}={shown(value)} is out of range; it must be {kind} {bounds.describe()}")
    return value


def _int64(bounds: Bounds | None) -> Bounds:
    """An integer key's range, within int64's."""
    if bounds is None:
        return INT64
    low = INT64.low if bounds.low is None else max(bounds.low, INT64.low)
    high = INT64.high if bounds.high is None else min(bounds.high, INT64.high)
    return dataclasses.replace(bounds, low=low, high=high)


def _as_kind(key: str, kind: type, value: Any, bounds: Bounds | None) -> float:
    """``value`` as the key's ``kind`` (int or float); an integer too large for a float is out of range."""
    try:
        return kind(value)
    except OverflowError:
        rule = f" {bounds.describe()}" if bounds else ""
        raise ConfigError(f"{key}={shown(value)} is out of range; it must be a finite number{rule}") from None


def _as_float(value: str) -> float | None:
    """A quoted number or a bare inf / nan in a float setting: read as the float it spells."""
    try:
        return float(value.replace("_", ""))
    except ValueError:
        return None


def _coerce(key: str, value: Any, annotation: Any, metadata: typing.Mapping[str, Any]) -> Any:
    allowed = _allowed_types(annotation)
    choices = metadata.get("choices")
    value = _as_meant(value, allowed, choices)
    if value is None and type(None) in allowed:
        return None
    kind = next((kind for kind in allowed if _is_of(kind, value)), None)
    if kind is None:
        raise ConfigError(f"{key}={value!r} has the wrong type; expected {' or '.join(map(_type_name, allowed))}")
    if kind in (int, float):
        return _check_number(key, _as_kind(key, kind, value, metadata.get("bounds")), metadata.get("bounds"))
    if typing.get_origin(kind) is list:
        return _listed_choices(key, value, choices)
    if typing.get_origin(kind) is dict:
        return value
    if choices and value not in choices:
        return _user_import_path(key, value, choices, metadata)
    if metadata.get("path") and isinstance(value, str):
        return expand_path(value, key)
    return value


def _as_meant(value: Any, allowed: tuple[Any, ...], choices: typing.Sequence[Any] | None) -> Any:
    """What YAML's reading changed, as the user meant it: a bare ``off`` (read as false) where the key
    takes "off", a quoted number or a bare inf / nan in a float setting."""
    if value is False and choices and "off" in choices:
        return "off"
    if float in allowed and isinstance(value, str) and _as_float(value) is not None:
        return _as_float(value)
    return value


def _is_of(kind: Any, value: Any) -> bool:
    """Whether ``value`` is a setting of type ``kind`` (an int is a float setting's value; a bool is no number)."""
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind in (str, bool):
        return isinstance(value, kind)
    if typing.get_origin(kind) is list:
        item = typing.get_args(kind)[0] if typing.get_args(kind) else str
        return isinstance(value, list) and all(_is_of(item, entry) for entry in value)
    if typing.get_origin(kind) is dict:
        return isinstance(value, dict) and all(isinstance(name, str) for name in value)
    return False


def _listed_choices(key: str, values: list[str], choices: typing.Sequence[Any] | None) -> list[str]:
    """A list setting whose items come from ``choices``, each at most once."""
    for index, value in enumerate(values):
        if choices and value not in choices:
            raise choice_error(f"{key}[{index}]", value, choices)
        if choices and value in values[:index]:
            raise ConfigError(f"{key}={values!r} lists {value!r} twice; give each once")
    return values


def _user_import_path(key: str, value: Any, choices: typing.Sequence[Any], metadata: typing.Mapping[str, Any]) -> Any:
    """A value outside ``choices``: valid only as a user's ``package.module:function`` where the key takes one."""
    if metadata.get("import_path") and is_import_path(value):
        return value
    error = choice_error(key, value, choices)
    raise ConfigError(f"{error}, or {IMPORT_PATH_FORM}") if metadata.get("import_path") else error


def _type_name(kind: Any) -> str:
    if kind is type(None):
        return "null"
    if typing.get_origin(kind) is list:
        item = typing.get_args(kind)[0] if typing.get_args(kind) else str
        return "a list of lists of strings" if typing.get_origin(item) is list else "a list of strings"
    if typing.get_origin(kind) is dict:
        return "a mapping of names to values"
    return kind.__name__


def _build(section: str, cls: type, values: dict[str, Any], origin: typing.Callable[[str], str] = lambda key: "") -> Any:
    """The section's dataclass from its values; ``origin(key)`` starts the message of a bad key (the file it came from)."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in values.items():
        if key not in fields:
            hint = _suggest(section, str(key), fields)
            raise ConfigError(f"{origin(key)}unknown key {section}.{key}{hint}; valid keys in {section}: {', '.join(fields)}")
        try:
            kwargs[key] = _coerce(f"{section}.{key}", value, hints[key], fields[key].metadata)
        except ConfigError as error:
            raise ConfigError(f"{origin(key)}{error}") from None
    return cls(**kwargs)


def _suggest(section: str, key: str, fields: typing.Iterable[str]) -> str:
    """`` (did you mean 'lr'?)``: the nearest key, or ampddp's name for what another trainer calls it."""
    aliases = KEY_ALIASES.get(section, {})
    if key in aliases:
        return f" (did you mean {aliases[key]!r}?)"
    near = closest(key, fields)
    if near:
        return near
    alias = difflib.get_close_matches(key, list(aliases), n=1, cutoff=0.75)
    return f" (did you mean {aliases[alias[0]]!r}?)" if alias else ""


def parse_overrides(overrides: list[str]) -> dict[str, dict[str, Any]]:
    """``["precision.mode=O2", "trainer.max_steps=5"]`` -> nested dict (values parsed as YAML)."""
    nested: dict[str, dict[str, Any]] = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        section, dot, name = key.strip().partition(".")
        if not sep or not dot or not name:
            raise ConfigError(f"override {item!r} is not of the form section.key=value (e.g. precision.mode=O2)")
        nested.setdefault(section, {})[name] = _override_value(item, raw)
    return nested


def _override_value(item: str, raw: str) -> Any:
    """An override's value parsed as YAML, keeping all of its text: where YAML would read a comment
    (``trainer.run_dir=runs/exp #3``: the shell passed it quoted, so the `` #3`` is the user's) the value
    is the whole text; text that is no YAML stays text."""
    try:
        value = parse_yaml(raw) if raw.strip() else None
    except yaml.YAMLError:
        return raw
    except (_DuplicateKey, _TooBig, _Unreadable) as error:
        raise ConfigError(f"override {item[:80]!r}: {error}") from None
    return raw.strip() if "#" in raw and _drops_a_comment(raw) else value


def read_recipe(path: str | Path) -> dict[str, Any]:
    """The recipe's sections as plain dicts; ConfigError names the file and what is wrong with it."""
    path = Path(path)
    try:
        raw = parse_yaml(_recipe_text(path))
    except yaml.YAMLError as error:
        raise ConfigError(f"{path}: not valid YAML ({_yaml_problem(error)})") from None
    except (_DuplicateKey, _TooBig, _Unreadable) as error:
        raise ConfigError(f"{path}: {error}") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: a recipe is a mapping of sections (precision, model, data, ...), found {type(raw).__name__}")
    for section, values in raw.items():
        _check_section(path, section, values)
    return {section: dict(values or {}) for section, values in raw.items()}


def _recipe_text(path: Path) -> str:
    try:
        data = read_regular_file(path, MAX_RECIPE_BYTES, "a recipe")
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such recipe file") from None
    except OSError as error:
        raise ConfigError(f"{path}: cannot read the recipe ({error.strerror or error})") from None
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        raise ConfigError(
            f"{path}: not UTF-8 text (byte 0x{data[error.start]:02x} at offset {error.start}); save the recipe as UTF-8"
        ) from None


def _check_section(path: Path, section: Any, values: Any) -> None:
    """A known section holding a mapping of keys (or nothing)."""
    if section not in SECTIONS:
        raise ConfigError(f"{path}: unknown section {section!r}{closest(str(section), SECTIONS)}; valid sections: {', '.join(SECTIONS)}")
    if values is not None and not isinstance(values, dict):
        keys = ", ".join(f.name for f in dataclasses.fields(SECTIONS[section]))
        raise ConfigError(
            f"{path}: section {section!r} must be a mapping of key: value lines, found {type(values).__name__} {values!r}; "
            f"valid keys in {section}: {keys}"
        )


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Read a recipe (YAML) and apply overrides; raise ConfigError on the first bad key or value."""
    raw = read_recipe(path) if path is not None else {}
    overridden: set[tuple[str, str]] = set()
    for section, values in parse_overrides(overrides or []).items():
        if section not in SECTIONS:
            raise ConfigError(f"unknown section {section!r}{closest(str(section), SECTIONS)}; valid sections: {', '.join(SECTIONS)}")
        raw[section] = {**raw.get(section, {}), **values}
        overridden.update((section, key) for key in values)

    def origin(section: str) -> typing.Callable[[str], str]:
        return lambda key: "" if path is None or (section, key) in overridden else f"{path}: "

    return RunConfig(**{section: _build(section, SECTIONS[section], values, origin(section)) for section, values in raw.items()})


def check_config(config: RunConfig) -> None:
    """Check every value of a RunConfig again, for one built in code (``load_config`` checks as it reads)."""
    for section, cls in SECTIONS.items():
        values = getattr(config, section)
        if not isinstance(values, cls):
            raise ConfigError(f"section {section!r} must be a {cls.__name__}, found {type(values).__name__}")
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            checked = _coerce(f"{section}.{f.name}", getattr(values, f.name), hints[f.name], f.metadata)
            if f.metadata.get("path"):
                setattr(values, f.name, checked)
