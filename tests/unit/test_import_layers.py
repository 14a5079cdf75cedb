"""The package's import structure: every module imports only its own layer and the layers below.

Lowest first: foundations (errors, preemption, the zoo, the run dir, loggers) -> precision ->
distributed (with observe) -> prepare -> checkpoint -> training (the loop and its parts, progress,
trainer) -> application (config, recipe and its finished-run check, cli, amp facade, apex).
The set-up data flows config -> precision -> distributed -> prepare -> loop -> checkpoint; no lower
layer reaches back into one above it, neither by an import statement nor by a module name imported at
run time (``importlib.import_module("ampddp...")``), and no two modules import each other in a circle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import ampddp

LAYERS = [
    (
        "foundations",
        (
            "ampddp.errors",
            "ampddp.preemption",
            "ampddp.torch_compat",
            "ampddp.choices",
            "ampddp.zoo",
            "ampddp.models",
            "ampddp.text",
            "ampddp.rundir",
            "ampddp.observe.loggers",
            "ampddp.loggers",
        ),
    ),
    ("precision", ("ampddp.precision",)),
    ("distributed", ("ampddp.distributed", "ampddp.observe")),
    ("prepare", ("ampddp.prepare",)),
    ("checkpoint", ("ampddp.checkpoint",)),
    ("training", ("ampddp.training", "ampddp.trainer")),
    (
        "application",
        (
            "ampddp.config",
            "ampddp.recipe",
            "ampddp.cli",
            "ampddp.__main__",
            "ampddp.amp",
            "ampddp.apex",
        ),
    ),
]
"""Each module's layer is that of the longest name here it falls under."""
PACKAGE = Path(ampddp.__file__).parent


def layer_of(module: str) -> int | None:
    matches = [
        (len(prefix), index)
        for index, (_, prefixes) in enumerate(LAYERS)
        for prefix in prefixes
        if module == prefix or module.startswith(prefix + ".")
    ]
    return max(matches)[1] if matches else None


def modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def imports_of(path: Path) -> set[str]:
    """The ampddp names ``path`` imports (``from m import x`` gives ``m.x``: a submodule or a name in
    ``m``): by import statements, and by a string literal passed to ``importlib.import_module`` /
    ``__import__`` (an import the statements do not show)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.update(f"{node.module}.{alias.name}" for alias in node.names)  # a submodule, or a name in the module
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.Call) and _imports_by_name(node.func) and node.args and isinstance(node.args[0], ast.Constant):
            names.add(str(node.args[0].value))
    return {name for name in names if name.startswith("ampddp.")}


def _imports_by_name(func: ast.expr) -> bool:
    called = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
    return called in ("import_module", "__import__")


def test_the_layer_check_sees_imports_by_name(tmp_path):
    source = tmp_path / "probe.py"
    source.write_text('import importlib\nimportlib.import_module("ampddp.apex.parallel")\n__import__("ampddp.cli")\n')
    assert imports_of(source) == {"ampddp.apex.parallel", "ampddp.cli"}


def test_every_module_belongs_to_a_layer():
    unplaced = sorted(name for name in modules() if name != "ampddp" and layer_of(name) is None)
    assert not unplaced, f"modules outside every layer (add them to LAYERS): {unplaced}"


def test_no_module_imports_a_layer_above_its_own():
    upward = []
    for name, path in modules().items():
        own = layer_of(name)
        if own is None:
            continue
        for imported in imports_of(path):
            target = layer_of(imported)
            if target is not None and target > own:
                upward.append(f"{name} ({LAYERS[own][0]}) imports {imported} ({LAYERS[target][0]})")
    assert not upward, "imports reaching up a layer:\n" + "\n".join(sorted(upward))


def test_the_loop_names_no_precision_mode():
    """The loop calls the engine's interface; it never branches on a mode."""
    source = (PACKAGE / "training" / "loop.py").read_text(encoding="utf-8")
    for mode in ("O1", "O2", "O3", "O4", "O5", "native-fp16", "native-bf16", "float16", "bfloat16"):
        assert f'"{mode}"' not in source and f"torch.{mode}" not in source, mode


def test_outside_precision_the_casting_mechanism_is_used_through_its_package_only():
    """The facade and the rest ask ``ampddp.precision.casting`` (its ``__init__``: the mechanism's API),
    never a module behind it, so the mechanism can change inside without them."""
    inner = {path.stem for path in (PACKAGE / "precision" / "casting").glob("*.py")} - {"__init__", "op_lists"}
    prefix = "ampddp.precision.casting."
    reaching_in = sorted(
        f"{name} imports {imported}"
        for name, path in modules().items()
        if not name.startswith("ampddp.precision")
        for imported in imports_of(path)
        if imported.startswith(prefix) and imported[len(prefix) :].split(".")[0] in inner
    )
    assert not reaching_in, f"import these names from ampddp.precision.casting instead: {reaching_in}"


def test_the_apex_facade_comes_into_precision_by_its_door_only():
    """``ampddp.amp`` and ``ampddp.apex`` import precision's names from ``ampddp.precision`` (its
    ``__init__``) and the casting mechanism from ``ampddp.precision.casting``, never a module behind
    them: precision's insides can move without the facade."""
    import ampddp.precision

    door = set(ampddp.precision.__all__)
    facade = ("ampddp.amp", "ampddp.apex")
    reaching_in = sorted(
        f"{name} imports {imported}"
        for name, path in modules().items()
        if name.startswith(facade)
        for imported in imports_of(path)
        if imported.startswith("ampddp.precision.")
        and imported.split(".")[2] != "casting"
        and not (imported.count(".") == 2 and imported.split(".")[2] in door)
    )
    assert not reaching_in, f"import these from ampddp.precision (add them to its __all__) instead: {reaching_in}"


def test_no_modules_import_each_other_in_a_circle():
    """Within a layer too: a circle means neither module can be read (or tested) without the other.
    Imports inside functions count (they run at use); the lazy package ``__init__`` maps do not."""
    found = modules()
    graph = {
        name: {target for target in map(_owning_module(found), imports_of(path)) if target and target != name}
        for name, path in found.items()
    }
    circles = sorted({" -> ".join(cycle) for cycle in _cycles(graph)})
    assert not circles, "modules importing each other in a circle:\n" + "\n".join(circles)


def _owning_module(found: dict[str, Path]):
    def owner(imported: str) -> str | None:
        while imported and imported not in found:
            imported = imported.rpartition(".")[0]
        return imported or None

    return owner


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each strongly connected part of ``graph`` with more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    parts: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            part = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                part.append(member)
                if member == node:
                    break
            if len(part) > 1:
                parts.append([*sorted(part), min(part)])

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return parts


def test_the_ground_floor_holds_few_modules_beside_packages_named_for_their_jobs():
    """A new module goes into the package of its job; the flat ones are the doors and the foundations."""
    flat = sorted(path.name for path in PACKAGE.glob("*.py") if not path.name.startswith("__"))
    assert len(flat) <= 10, f"{len(flat)} modules on the ground floor (at most 10; put the new one in its package): {flat}"


def test_no_function_is_more_complex_than_fifteen_by_radon():
    """ruff's mccabe cap (12) does not count boolean operators and comprehensions; radon does: a
    function over 15 by radon is one to split (the project's rule, with the lint's)."""
    complexity = pytest.importorskip("radon.complexity", reason="radon is in the test extra (pip install -e '.[test]')")
    over = []
    for name, path in sorted(modules().items()):
        for block in complexity.cc_visit(path.read_text(encoding="utf-8")):
            for item in [block, *getattr(block, "methods", [])]:
                if item.complexity > 15:
                    over.append(f"{name}.{item.fullname} ({item.complexity})")
    assert not over, "functions above complexity 15 (radon cc): " + ", ".join(sorted(set(over)))
