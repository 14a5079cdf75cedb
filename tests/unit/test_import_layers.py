"""The package's import structure: every module imports only its own layer and the layers below.

Lowest first: foundations (errors, progress, preemption, data, models, run_lock) -> precision (with
diagnostics) -> distributed (with console, observe) -> prepare (with compile_model) -> checkpoint ->
training (the loop and its parts, trainer) -> application (config, recipe, run, cli, amp facade, apex).
The set-up data flows config -> precision -> distributed -> prepare -> loop -> checkpoint; no lower
layer reaches back into one above it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import ampddp

LAYERS = [
    (
        "foundations",
        (
            "ampddp.errors",
            "ampddp.progress",
            "ampddp.preemption",
            "ampddp.data",
            "ampddp.models",
            "ampddp.run_lock",
            "ampddp.torch_compat",
            "ampddp.choices",
            "ampddp.run_files",
        ),
    ),
    ("precision", ("ampddp.precision", "ampddp.diagnostics")),
    ("distributed", ("ampddp.distributed", "ampddp.console", "ampddp.observe")),
    ("prepare", ("ampddp.prepare", "ampddp.compile_model")),
    ("checkpoint", ("ampddp.checkpoint",)),
    ("training", ("ampddp.training", "ampddp.trainer")),
    (
        "application",
        (
            "ampddp.config",
            "ampddp.recipe",
            "ampddp.run",
            "ampddp.finished_run",
            "ampddp.cli",
            "ampddp.__main__",
            "ampddp.amp",
            "ampddp.amp_setup",
            "ampddp.amp_stash",
            "ampddp.apex",
        ),
    ),
]
PACKAGE = Path(ampddp.__file__).parent


def layer_of(module: str) -> int | None:
    for index, (_, prefixes) in enumerate(LAYERS):
        if any(module == prefix or module.startswith(prefix + ".") for prefix in prefixes):
            return index
    return None


def modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def imports_of(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return {name for name in names if name.startswith("ampddp.")}


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
