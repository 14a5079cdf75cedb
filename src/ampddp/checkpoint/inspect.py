"""What a checkpoint holds, in a few lines or as JSON, plus a digest of its model tensors.

Every file is first checked against the checkpoint's manifest (sizes and XXH3-128 checksums): a
mismatch is a ``CheckpointError`` naming the file; ``integrity`` reports ``verified``, or ``not
verified (written before checksums)`` for checkpoints whose ``COMPLETE`` lists names only."""

from __future__ import annotations

import hashlib
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from ampddp.checkpoint import keys
from ampddp.checkpoint.store import CheckpointRef, CheckpointStore, read_newest
from ampddp.errors import CheckpointError, ConfigError
from ampddp.precision.state import PrecisionState


def model_digest(state: dict[str, torch.Tensor]) -> str:
    """SHA-256 over every tensor's name, dtype, shape and bytes: equal digests mean identical weights."""
    digest = hashlib.sha256()
    for name in sorted(state):
        tensor = state[name]
        if not isinstance(tensor, torch.Tensor):
            continue
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _precision_state(shared: dict[str, Any], where: str) -> PrecisionState:
    """The checkpoint's typed precision state (an empty one when the entry is absent, as in hand-made files)."""
    if shared.get(keys.PRECISION) is None:
        return PrecisionState(mode=None)
    try:
        return PrecisionState.from_dict(shared[keys.PRECISION], where=f"{where}: its {keys.PRECISION!r} entry is malformed")
    except ConfigError as error:
        raise CheckpointError(str(error)) from None


def summarize(location: str | Path) -> dict[str, Any]:
    """Summary of a checkpoint folder/file, or of a run dir's newest checkpoint that verifies (a live
    run's included: one pruned while it is read is passed over)."""
    return read_newest(location, _summary_of)


def _summary_of(ref: CheckpointRef) -> dict[str, Any]:
    manifest = ref.manifest()
    integrity = ref.verify(manifest)
    shared = CheckpointStore.load_whole(ref, manifest, shards_verified=True)  # every file was just hashed
    model = shared.get(keys.MODEL)
    if not isinstance(model, dict):
        raise CheckpointError(f"{ref.shared_file}: no model state in this checkpoint (keys: {sorted(shared)})")
    progress = shared.get(keys.PROGRESS) or {}
    precision = _precision_state(shared, str(ref.shared_file))
    return {
        "path": str(ref.path),
        "integrity": integrity,
        "files": {name: digest.size for name, digest in (manifest.digests or {}).items()} or list(manifest.names),
        "format_version": shared[keys.FORMAT],
        "layout": "sharded" if shared.get(keys.SHARDS) is not None else "whole",
        "step": progress.get("global_step", ref.step),
        "epoch": progress.get("epoch"),
        "samples_seen": progress.get("samples_seen"),
        "mode": precision.mode,
        "impl": precision.impl,
        "fp8_recipe": (precision.policy or {}).get("fp8_recipe"),
        "fp8_layers": list(precision.fp8_layers),
        "loss_scales": [s.loss_scale for s in precision.scalers],
        "skipped_steps": progress.get("skipped_steps", precision.skipped_steps),
        "world_size": shared.get(keys.WORLD_SIZE),
        "mesh": shared.get(keys.MESH),
        "parameters": sum(t.numel() for t in model.values() if isinstance(t, torch.Tensor) and t.is_floating_point()),
        "dtypes": dict(Counter(str(t.dtype).removeprefix("torch.") for t in model.values() if isinstance(t, torch.Tensor))),
        "versions": shared.get(keys.VERSIONS),
        "model_sha256": model_digest(model),
        "tracked_runs": shared.get(keys.TRACKED_RUNS) or {},
    }


def layout_words(mesh: dict[str, Any] | None) -> str:
    """``strategy fsdp2, dp_shard 2 x tp 2`` for a recorded mesh (its dimensions of more than one rank; a pipeline's
    schedule and stages: ``strategy none, pp 2 (1F1B, 2 stages)``), or nothing."""
    if not isinstance(mesh, dict) or "strategy" not in mesh:
        return ""
    sizes = {name: size for name, size in mesh.items() if name not in ("strategy", "pp_stages") and isinstance(size, int)}
    spread = " x ".join(f"{name} {size}" for name, size in sizes.items() if size > 1)
    pipeline = f" ({mesh['pp_schedule']}, {mesh.get('pp_stages')} stages)" if "pp_schedule" in mesh else ""
    return f"strategy {mesh['strategy']}" + (f", {spread}" if spread else "") + pipeline


def format_summary(summary: dict[str, Any]) -> str:
    scales = ", ".join(f"{s:g}" for s in summary["loss_scales"] if s is not None) or "none"
    dtypes = ", ".join(f"{name} x{count}" for name, count in sorted(summary["dtypes"].items()))
    tracked = ", ".join(f"{name} {run_id}" for name, run_id in summary.get("tracked_runs", {}).items())
    fp8_layers = ", ".join(summary.get("fp8_layers", [])) or "none"
    return "\n".join(
        [
            f"checkpoint   {summary['path']}",
            f"integrity    {summary['integrity']} ({len(summary['files'])} files{', sharded' if summary['layout'] == 'sharded' else ''})",
            f"progress     step {summary['step']}, epoch {summary['epoch']}, {summary['samples_seen']} samples seen",
            f"precision    {summary['mode']} ({summary['impl']}), loss scale {scales}, {summary['skipped_steps']} skipped steps",
            *(
                [f"fp8          {summary['fp8_recipe']} scaling in {len(summary['fp8_layers'])} linear layer(s): {fp8_layers}"]
                if summary.get("fp8_recipe")
                else []
            ),
            f"world size   {summary['world_size']}" + (f"; {layout_words(summary.get('mesh'))}" if summary.get("mesh") else ""),
            f"model        {summary['parameters']:,} parameters; tensors: {dtypes}",
            f"model_sha256 {summary['model_sha256']}",
            f"written by   {', '.join(f'{k} {v}' for k, v in (summary['versions'] or {}).items())}",
            *([f"tracked runs {tracked}"] if tracked else []),
        ]
    )
