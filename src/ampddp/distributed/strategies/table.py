"""Every strategy by the name a recipe gives, and the one place settings reach their strategy.

``make_strategy`` hands each strategy the settings it takes (``Strategy.takes``) and refuses, in one
line, settings given for another strategy, naming the strategies that take them. A new strategy is a
class in this package and one entry of :data:`STRATEGY_TABLE` (its name in ``ampddp.choices.STRATEGIES``,
where the command line lists it without importing torch).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from ampddp.choices import STRATEGIES
from ampddp.distributed.fsdp2 import FSDPOptions
from ampddp.distributed.pipeline import PPOptions
from ampddp.distributed.strategies.base import Strategy
from ampddp.distributed.strategies.pipelined import Pipelined
from ampddp.distributed.strategies.replicated import ApexDDP, DataParallel, TorchDDP, Unwrapped
from ampddp.distributed.strategies.sharded import FSDP2, HSDP
from ampddp.distributed.tensor_parallel import TPOptions
from ampddp.distributed.wrap import DDPOptions
from ampddp.errors import ConfigError, choice_error

STRATEGY_TABLE: Mapping[str, type[Strategy]] = MappingProxyType(
    {kind.name: kind for kind in (TorchDDP, ApexDDP, FSDP2, HSDP, DataParallel, Unwrapped)}
)
"""Each strategy class by the name a recipe gives (``choices.STRATEGIES`` lists the same names without torch)."""
logger = logging.getLogger("ampddp.distributed")


def strategy_class(name: str) -> type[Strategy]:
    """The strategy called ``name``, or one line naming the valid ones."""
    if name not in STRATEGY_TABLE:
        raise choice_error("distributed strategy", name, STRATEGIES)
    return STRATEGY_TABLE[name]


def takers(setting: str) -> list[str]:
    """The strategies that take ``setting`` (``ddp``, ``fsdp``, ``wrap_options``)."""
    return [name for name, kind in STRATEGY_TABLE.items() if setting in kind.takes]


def make_strategy(name: str, *, ddp: DDPOptions | None = None, fsdp: FSDPOptions | None = None,
                  wrap_options: Mapping[str, Any] | None = None, tp: TPOptions | None = None, pp: PPOptions | None = None,
                  where: str = "") -> Strategy:  # fmt: skip
    """The strategy ``name`` holding the settings it takes; settings given for another strategy are a
    ConfigError naming them and the strategies that take them. ``tp``: tensor parallelism inside it (the
    strategies that compose with it say so: ``Strategy.with_tensor_parallel``). ``where``: the settings'
    prefix in messages (``distributed.`` for a recipe)."""
    tp = tp if tp is not None else TPOptions()
    pp = pp if pp is not None else PPOptions()
    if pp.enabled and name == "ddp":
        name, fsdp = "hsdp", _replicas_for_ddp(ddp, fsdp, pp, where)
    kind = strategy_class(name)
    if tp.enabled:
        kind = kind.with_tensor_parallel(where)
    if pp.enabled and not kind.pipelines:
        raise ConfigError(f"{where}pp_size > 1: pipeline parallelism runs with strategy none, ddp, fsdp2 or hsdp (each with tp_size), "
                          f"not {where}strategy={name}")  # fmt: skip
    given = {"ddp": ddp if ddp is not None else DDPOptions(), "fsdp": fsdp if fsdp is not None else FSDPOptions(),
             "wrap_options": dict(wrap_options or {}), "tp": tp, "pp": pp}  # fmt: skip
    for setting, value in given.items():
        if setting not in kind.takes:
            _refuse_foreign(setting, value, name, where)
    strategy = kind(**{setting: given[setting] for setting in kind.takes})
    strategy.check_settings(where)
    return Pipelined(strategy, pp) if pp.enabled else strategy


def _replicas_for_ddp(ddp: DDPOptions | None, fsdp: FSDPOptions | None, pp: PPOptions, where: str) -> FSDPOptions:
    """DDP's data parallelism over a pipeline's stages, run as HSDP with shards of one rank (each stage whole on every
    data rank, its gradients all-reduced across them): torch's DDP reducer cannot follow a pipeline schedule's
    backwards. DDP's own settings have no meaning there and FSDP2's are another strategy's: refused."""
    for given, words in ((ddp if ddp is not None else DDPOptions()).changed(where), "torch DDP settings"), (
            (fsdp if fsdp is not None else FSDPOptions()).changed(f"{where}fsdp_" if where else ""), "FSDP2 settings"):  # fmt: skip
        if given:
            raise ConfigError(f"{', '.join(given)}: {words}, but {where}strategy=ddp with {where}pp_size={pp.size} runs each stage's "
                              "data parallelism as hsdp with shards of one rank; unset them, or use strategy hsdp or fsdp2")  # fmt: skip
    logger.info(
        "strategy ddp with pp_size=%d: each stage replicated over its data ranks and its gradients all-reduced, by FSDP2's "
        "replicate dimension (hsdp with fsdp_shard_size=1; torch's DDP reducer cannot follow a pipeline's backwards)",
        pp.size,
    )
    return FSDPOptions(shard_size=1)


def _refuse_foreign(setting: str, value: Any, name: str, where: str) -> None:
    """``value`` of ``setting``, given to strategy ``name`` that does not take it: refused unless unset."""
    if setting == "ddp" and value.changed(where):
        raise ConfigError(f"{', '.join(value.changed(where))}: torch DDP settings, but {where}strategy={name}; unset them or use "
                          f"strategy {' or '.join(takers('ddp'))}")  # fmt: skip
    if setting == "fsdp" and value.changed(f"{where}fsdp_" if where else ""):
        raise ConfigError(f"{', '.join(value.changed(f'{where}fsdp_' if where else ''))}: FSDP2 settings, but strategy={name}; "
                          f"unset them or use strategy {' or '.join(takers('fsdp'))}")  # fmt: skip
    if setting in ("tp", "pp"):
        return  # tp_size / pp_size 1 (no tensor or pipeline parallelism): the settings given with it wait for a size
    if setting == "wrap_options" and value:
        raise ConfigError(f"wrap_options {sorted(value)} do not apply to strategy {name}; "
                          + ("its settings are Parallel(fsdp=FSDPOptions(...))" if "fsdp" in STRATEGY_TABLE[name].takes
                             else f"the strategies with a wrapper take them: {', '.join(takers('wrap_options'))}"))  # fmt: skip
