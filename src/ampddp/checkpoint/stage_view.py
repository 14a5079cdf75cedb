"""A pipeline stage's part of a whole model's checkpoint.

Each stage of a pipeline holds some of the model's parameters (under the whole model's names) and an optimizer over
them alone, numbered from 0 as torch numbers any optimizer's parameters. A checkpoint of the pipeline is written as
the whole model's would be: the model's tensors under their names, the optimizer's per-parameter entries under the
index a whole-model optimizer gives them (group by group, each group's parameters stage after stage, as a function
grouping the whole model's parameters in their order would make them). So it resumes under another split, on one
process or under FSDP2, and exports whole; and a whole-model checkpoint resumes under a pipeline. ``StageView`` holds
the numbering (agreed by every stage when it is made) and translates the state both ways.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn
from torch.optim import Optimizer

from ampddp.checkpoint import keys
from ampddp.distributed.data import gather_objects
from ampddp.distributed.env import DistEnv
from ampddp.errors import CheckpointError

MODEL_PREFIX, OPTIMIZER_PREFIX = "model/", "optimizer/"


@dataclass(frozen=True)
class StageView:
    """``whole_index[i]``: the whole-model optimizer index of this stage's optimizer parameter ``i``; ``names``: the model
    state keys this stage holds."""

    whole_index: tuple[int, ...]
    names: frozenset[str]

    @classmethod
    def agreed(cls, module: nn.Module, optimizer: Optimizer, stage_of: Sequence[int], env: DistEnv) -> StageView:
        """The view of this rank's stages (one, or several under a looped schedule, ``module`` holding them all; ``stage_of``:
        the stage of each of the optimizer's parameters, in param-group order), every stage's group sizes gathered once
        (collective)."""
        groups = len(optimizer.param_groups)
        sizes = {index: [0] * groups for index in stage_of}
        places = []  # (stage, group, position in that stage's share of the group) of each optimizer parameter, in order
        owners = iter(stage_of)
        for group, found in enumerate(optimizer.param_groups):
            for _ in found["params"]:
                index = next(owners)
                places.append((index, group, sizes[index][group]))
                sizes[index][group] += 1
        every = dict(pair for pairs in gather_objects(sorted(sizes.items()), env) for pair in pairs)
        if len({len(found) for found in every.values()}) != 1:
            raise CheckpointError(f"the pipeline's stages made optimizers of different numbers of parameter groups "
                                  f"({', '.join(f'stage {at}: {len(found)}' for at, found in sorted(every.items()))}); give every "
                                  "stage the same groups (a group may be empty) so their checkpoint reads as one model's")  # fmt: skip
        offsets = [sum(found[earlier] for found in every.values() for earlier in range(group)) for group in range(groups)]
        whole = [offsets[group] + sum(found[group] for at, found in every.items() if at < index) + position
                 for index, group, position in places]  # fmt: skip
        return cls(tuple(whole), frozenset(module.state_dict()))

    @property
    def local_index(self) -> dict[int, int]:
        """Whole-model optimizer index -> this stage's."""
        return {whole: local for local, whole in enumerate(self.whole_index)}

    # ---- writing ------------------------------------------------------------------------------------
    def to_whole(self, tensors: Mapping[str, Any], optimizer: Mapping[str, Any], record: Mapping[str, Any],
                 env: DistEnv) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:  # fmt: skip
        """``split_state``'s three parts in the whole model's numbering: this stage's tensors renamed, and the optimizer's
        other state and the record of every stage merged (collective: each rank gets the whole)."""
        renamed = {self._whole_name(name): value for name, value in tensors.items()}
        mine = self._renumbered(optimizer, self.whole_index.__getitem__)
        every = gather_objects((mine, {self._whole_name(name): entry for name, entry in record.items()}), env)
        merged_record: dict[str, Any] = {}
        state: dict[int, Any] = {}
        groups = [dict(group, params=[]) for group in mine["param_groups"]]
        for theirs, their_record in every:
            merged_record.update(their_record)
            state.update(theirs["state"])
            for group, their_group in zip(groups, theirs["param_groups"]):
                group["params"] = sorted([*group["params"], *their_group["params"]])
        return renamed, {**mine, "state": state, "param_groups": groups}, merged_record

    def _whole_name(self, name: str) -> str:
        if not name.startswith(OPTIMIZER_PREFIX):
            return name
        index, entry = name.removeprefix(OPTIMIZER_PREFIX).split("/", 1)
        return f"{OPTIMIZER_PREFIX}{self.whole_index[int(index)]}/{entry}"

    @staticmethod
    def _renumbered(optimizer: Mapping[str, Any], number: Any) -> dict[str, Any]:
        groups = [dict(group, params=[number(index) for index in group["params"]]) for group in optimizer["param_groups"]]
        return {**optimizer, "state": {number(index): entries for index, entries in optimizer["state"].items()}, "param_groups": groups}

    # ---- reading ------------------------------------------------------------------------------------
    def restrict(self, shared: Mapping[str, Any], where: str) -> dict[str, Any]:
        """A whole model's checkpoint entries (``shared`` with its model and optimizer entries, and a sharded one's
        record) cut to this stage's: its model tensors, its parameters' optimizer state renumbered as its optimizer
        numbers them. A checkpoint that lacks one of them is refused naming it."""
        local = self.local_index
        model = shared[keys.MODEL]
        missing = sorted(self.names - set(model))
        if missing:
            raise CheckpointError(f"{where}: holds no {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''} of this pipeline "
                                  "stage's model; it was written by another model")  # fmt: skip
        optimizer = shared[keys.OPTIMIZER]
        groups = [dict(group, params=[local[index] for index in group["params"] if index in local])
                  for group in optimizer["param_groups"]]  # fmt: skip
        state = {local[index]: entries for index, entries in optimizer["state"].items() if index in local}
        restricted = {**shared, keys.MODEL: {name: model[name] for name in self.names},
                      keys.OPTIMIZER: {**optimizer, "state": state, "param_groups": groups}}  # fmt: skip
        if shared.get(keys.SHARDS) is not None:
            restricted[keys.SHARDS] = {name: entry for name, entry in shared[keys.SHARDS].items() if self._holds(name, local)}
        return restricted

    def _holds(self, name: str, local: Mapping[int, int]) -> bool:
        if name.startswith(MODEL_PREFIX):
            return name.removeprefix(MODEL_PREFIX) in self.names
        index = name.removeprefix(OPTIMIZER_PREFIX).split("/", 1)[0]
        return index.isdigit() and int(index) in local
