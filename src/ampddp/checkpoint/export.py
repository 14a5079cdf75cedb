"""``ampddp export``: a checkpoint's model weights as one safetensors file, for serving and the long term.

A checkpoint is for resuming: a torch zip with the optimizer, the RNG and the run's settings, read
back by this ampddp and a compatible torch. Weights meant to outlive the run go into safetensors,
which any framework reads without executing code. The file holds whole tensors whatever strategy and
world size trained them (FSDP2 runs included), and its metadata says where they came from and the
precision policy they were trained under, so a reader can load them in the dtypes they were meant for.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from ampddp.checkpoint import keys
from ampddp.checkpoint.files import write_bytes_atomic
from ampddp.checkpoint.safetensors_weights import DIGESTS_KEY, tensor_digest
from ampddp.checkpoint.store import CheckpointStore, read_newest
from ampddp.choices import EXPORT_DTYPE_NAMES
from ampddp.errors import CheckpointError, ConfigError
from ampddp.rundir.paths import refuse_long_names

EXPORT_FORMAT = "ampddp-export/1"
EXPORT_DTYPES: dict[str, torch.dtype | None] = dict(zip(EXPORT_DTYPE_NAMES, (None, torch.float32, torch.bfloat16, torch.float16)))
"""``--dtype``: the floating tensors as saved (fp32 masters for O2/O5), or cast to one dtype."""


def export_weights(location: str | Path, out: str | Path, dtype: str = "saved", force: bool = False) -> dict[str, Any]:
    """Write the model weights of the checkpoint at ``location`` (a checkpoint folder or file, or a
    run dir for its latest complete checkpoint) to the safetensors file ``out``; returns a summary.

    The checkpoint is verified against its manifest first. ``out`` is written atomically and never
    replaces an existing file unless ``force``.
    """
    from safetensors.torch import save

    if dtype not in EXPORT_DTYPES:
        raise ConfigError(f"--dtype {dtype!r} is not valid; valid: {', '.join(EXPORT_DTYPES)}")
    out = Path(out)
    _check_output(out, force)
    ref, shared = read_newest(location, lambda ref: (ref, CheckpointStore.load_whole(ref, ref.manifest())))
    tensors = _exported_tensors(shared, EXPORT_DTYPES[dtype], ref.shared_file)
    precision = shared.get(keys.PRECISION) or {}
    progress = shared.get(keys.PROGRESS) or {}
    metadata = {
        "format": EXPORT_FORMAT,
        "source": str(ref.path),
        "step": str(progress.get("global_step", ref.step)),
        "mode": str(precision.get("mode")),
        "policy": json.dumps(precision.get("policy"), sort_keys=True),
        "dtype": dtype,
        "world_size": str(shared.get(keys.WORLD_SIZE)),
        "versions": json.dumps(shared.get(keys.VERSIONS), sort_keys=True),
        DIGESTS_KEY: json.dumps({name: tensor_digest(value) for name, value in tensors.items()}, sort_keys=True),
    }
    write_bytes_atomic(out, save(tensors, metadata=metadata))
    return {
        "path": str(out),
        "source": str(ref.path),
        "step": int(metadata["step"]),
        "mode": metadata["mode"],
        "tensors": len(tensors),
        "parameters": sum(value.numel() for value in tensors.values() if value.is_floating_point()),
        "dtypes": dict(Counter(str(value.dtype).removeprefix("torch.") for value in tensors.values())),
        "bytes": out.stat().st_size,
    }


def _check_output(out: Path, force: bool) -> None:
    """``--to``: a new *.safetensors file (an existing file only with ``force``; never a directory) in an existing folder,
    its name within the file system's limits."""
    refuse_long_names(out, "--to")
    if out.suffix != ".safetensors":
        raise ConfigError(f"--to {out}: name the output file *.safetensors")
    if out.is_dir():
        raise ConfigError(f"--to {out} is a directory; name a file to write, e.g. {out / 'model.safetensors'}")
    if out.exists() and not force:
        raise ConfigError(f"--to {out} exists; choose another name or pass --force to replace it")
    if not out.parent.is_dir():
        raise ConfigError(f"--to {out}: no such directory {out.parent}")


def _exported_tensors(shared: dict[str, Any], cast: torch.dtype | None, where: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's model tensors on the CPU, floating ones cast to ``cast`` (None: as saved), each
    with storage of its own: safetensors refuses tensors sharing memory (tied weights are written twice)."""
    model = shared.get(keys.MODEL)
    if not isinstance(model, dict) or not all(isinstance(value, torch.Tensor) for value in model.values()):
        raise CheckpointError(f"{where}: no model state of tensors in this checkpoint (keys: {sorted(shared)})")
    return {
        name: (value.to(cast) if cast is not None and value.is_floating_point() else value).detach().cpu().contiguous().clone()
        for name, value in model.items()
    }


def format_export(summary: dict[str, Any]) -> str:
    dtypes = ", ".join(f"{name} x{count}" for name, count in sorted(summary["dtypes"].items()))
    return (
        f"wrote {summary['path']} ({summary['bytes']:,} bytes): {summary['tensors']} tensors, {summary['parameters']:,} parameters "
        f"({dtypes}) from {summary['source']} (step {summary['step']}, {summary['mode']})"
    )
