"""``SavePlanner``: DCP's default save planner, naming the state as shardfmt does.

DCP's own flattening walks every mapping, so an empty dict is no leaf and is never saved, and a
dict's int keys become strings (``dcp.names``). This planner flattens as ``shardfmt.save`` does
(a dict, list or tuple is walked only while it holds a tensor; every other subtree is one value,
kept whole), so a checkpoint written through ``Writer`` with it holds exactly what
``shardfmt.save`` of the same state would, empty dicts and int keys included. DCP's planning
(deduplication, DTensor chunks) is the default planner's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan

from shardfmt.dcp.names import Path, name_of
from shardfmt.errors import StateDictError
from shardfmt.layout.state import MAX_FQN, holds_tensor


class SavePlanner(DefaultSavePlanner):
    """``dcp.save(state, storage_writer=Writer(path), planner=SavePlanner())``: values kept whole."""

    def __init__(self, *, dedup_save_to_lowest_rank: bool = False) -> None:
        # DCP's flattening of nested ShardedTensors rebuilds the state through its own traversal,
        # which drops empty dicts again: left off (DTensors, and ShardedTensors at the top, need none)
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False,
                         dedup_save_to_lowest_rank=dedup_save_to_lowest_rank)
        self.paths: dict[str, Path] = {}

    def set_up_planner(self, state_dict: dict, storage_meta: Any = None, is_coordinator: bool = False) -> None:
        flat: dict[str, Any] = {}
        self.paths = {}
        for path, value in _leaves(state_dict):
            name = name_of(path)
            if name in flat:
                raise StateDictError(f"{name}: two entries of the state have this name")
            if len(name) > MAX_FQN:
                raise StateDictError(f"{name[:80]}...: name of {len(name)} characters exceeds {MAX_FQN}")
            flat[name] = value
            self.paths[name] = path
        super().set_up_planner(flat, storage_meta, is_coordinator)

    def create_local_plan(self) -> SavePlan:
        self.plan = dataclasses.replace(super().create_local_plan(), planner_data=self.paths)
        return self.plan

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        plans, metadata = super().create_global_plan(all_plans)
        paths: dict[str, Path] = {}
        for p in all_plans:
            paths.update(p.planner_data or {})
        return plans, dataclasses.replace(metadata, planner_data=paths)


def _leaves(state: dict) -> Iterator[tuple[Path, Any]]:
    """(path, leaf) of shardfmt's flattening: containers walked only while they hold a tensor; a
    path records a mapping's key as ``str`` and a list's or tuple's index as ``int``, as DCP does."""
    pending: list[tuple[Path, Any]] = [((str(k),), v) for k, v in reversed(list(state.items()))]
    while pending:
        path, value = pending.pop()
        if isinstance(value, (dict, list, tuple)) and holds_tensor(value):
            items = [(str(k), v) for k, v in value.items()] if isinstance(value, dict) else list(enumerate(value))
            pending.extend((path + (k,), v) for k, v in reversed(items))
        else:
            yield path, value
