"""Every rank of a run must train with the same settings.

Under torchrun or SLURM each rank reads the recipe and its overrides itself; a per-rank environment
or a wrapper script can hand one rank ``optimizer.lr=0.05`` and another ``0.5``. DDP then averages
gradients that were meant for different runs, and only rank 0's weights are saved: a silently wrong
result. At start the ranks compare their resolved settings with rank 0's, and a difference stops
every rank with one line naming the differing keys and ranks.
"""

from __future__ import annotations

from typing import Any

from ampddp.config import RunConfig
from ampddp.distributed.data import broadcast_from_main, gather_objects
from ampddp.distributed.env import DistEnv
from ampddp.errors import ConfigError

__all__ = ["check_ranks_agree", "flatten_settings"]


def flatten_settings(settings: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"optimizer": {"lr": 0.1}}`` -> ``{"optimizer.lr": 0.1}``: recipe keys as overrides spell them."""
    flat: dict[str, Any] = {}
    for key, value in settings.items():
        if isinstance(value, dict):
            flat.update(flatten_settings(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def check_ranks_agree(config: RunConfig, env: DistEnv) -> None:
    """Collective: raise ConfigError on every rank unless every rank's settings equal rank 0's."""
    if not env.distributed:
        return
    mine = flatten_settings(config.to_dict())
    main = broadcast_from_main(mine if env.is_main else None, env)
    differing = sorted(key for key in main.keys() | mine.keys() if main.get(key, _MISSING) != mine.get(key, _MISSING))
    reports = gather_objects({key: mine.get(key) for key in differing}, env)
    if not any(reports):
        return
    rank, keys = next((rank, report) for rank, report in enumerate(reports) if report)
    shown = ", ".join(f"{key}={value!r} (rank 0: {main.get(key)!r})" for key, value in list(keys.items())[:4])
    others = [r for r, report in enumerate(reports) if report and r != rank]
    also = f"; rank(s) {', '.join(map(str, others))} differ too" if others else ""
    raise ConfigError(
        f"the ranks were started with different settings: rank {rank} has {shown}{also}; every rank must get the same recipe and overrides"
    )


_MISSING = object()
