"""Plan a DCP import (pure): check the chunks against the files, map files to ranks, cut parts,
and put back together the values DCP flattened."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from reshard._shardfmt import MAX_WORLD, Box, dtype_code, tiling_problems
from reshard.dcp.metadata import DcpLocation, DcpMetadata
from reshard.errors import DcpImportError
from reshard.options import DEFAULT_MEMORY_BUDGET

RANK_FILE = re.compile(r"__(0|[1-9][0-9]{0,7})_(0|[1-9][0-9]*)\.distcp")


@dataclass(frozen=True, slots=True, kw_only=True)
class ChunkItem:
    """One DCP tensor chunk to copy: its box in the global tensor and where its bytes are."""

    fqn: str
    dtype: torch.dtype
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    location: DcpLocation

    @property
    def nbytes(self) -> int:
        return math.prod(self.sizes) * self.dtype.itemsize


@dataclass(frozen=True, slots=True, kw_only=True)
class RankPart:
    """The chunks written into one data file: ``rank``'s file, or its part ``part``."""

    rank: int
    part: int | None
    items: tuple[ChunkItem, ...]

    @property
    def nbytes(self) -> int:
        return sum(i.nbytes for i in self.items)


@dataclass(frozen=True, slots=True)
class Slot:
    """The place of DCP's value item ``key`` inside a regrouped value's template."""

    key: str


@dataclass(frozen=True, slots=True, kw_only=True)
class ValueGroup:
    """One shardfmt value: its ``name``, and the ``template`` (a Slot, or dicts/lists of Slots)
    that the DCP items in ``items`` (key, where its bytes are) fill."""

    name: str
    template: Any
    items: tuple[tuple[str, DcpLocation], ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class ImportPlan:
    world_size: int
    parts: tuple[RankPart, ...]
    values: tuple[ValueGroup, ...]
    tensors: int


_TENSOR = object()


def _slots(template: Any) -> list[str]:
    if isinstance(template, Slot):
        return [template.key]
    children = template.values() if isinstance(template, dict) else template
    return [k for c in children for k in _slots(c)]


def fill(template: Any, loaded: Mapping[str, Any]) -> Any:
    """Build a value from its template and the loaded DCP items."""
    if isinstance(template, Slot):
        return loaded[template.key]
    if isinstance(template, dict):
        return {k: fill(v, loaded) for k, v in template.items()}
    return [fill(v, loaded) for v in template]

def group_values(values: Sequence[str], tensors: Sequence[str],
                 paths: Mapping[str, tuple[str | int, ...]] | None) -> list[tuple[str, Any]]:
    """Name DCP's non-tensor items as ``shardfmt.save`` would name the state dict they came from.

    DCP flattens every nested dict: ``{"sched": {"lr": 0.1}}`` is saved as the item
    ``sched.lr``. shardfmt keeps a dict or list that holds no tensor as one value (``sched``).
    With the planner's paths (key -> dict keys and list indices), the items of such a
    container are put back together (a dict from string keys, a list from indices 0..n-1), so
    ``shardfmt.load`` of the state dict the job saved works unchanged. Without paths, or where
    a container cannot be rebuilt, each item keeps its DCP key. Returns (name, template).
    """
    flat = [(k, Slot(k)) for k in values]
    tree = None if paths is None else _path_tree(values, tensors, paths)
    if tree is None:
        return flat
    out: list[tuple[str, Any]] = []
    _collect(tree, "", out)
    names = [n for n, _ in out]
    if len(set(names)) != len(names) or set(names) & set(tensors):
        return flat
    return out


def _path_tree(values: Sequence[str], tensors: Sequence[str],
               paths: Mapping[str, tuple[str | int, ...]]) -> dict | None:
    """The saved state dict's nesting: dicts keyed by path items, with a ``_TENSOR`` or a Slot
    at each leaf; None when two keys' paths collide."""
    tree: dict = {}

    def insert(path: tuple, leaf: Any) -> bool:
        node = tree
        for item in path[:-1]:
            node = node.setdefault(item, {})
            if not isinstance(node, dict):
                return False
        if path[-1] in node:
            return False
        node[path[-1]] = leaf
        return True

    if not (all(insert(paths[k], _TENSOR) for k in tensors) and all(insert(paths[k], Slot(k)) for k in values)):
        return None
    return tree


def _holds_tensor(node: Any) -> bool:
    return node is _TENSOR or isinstance(node, dict) and any(_holds_tensor(c) for c in node.values())


def _template(node: Any) -> Any:
    """The value template of a tensor-free subtree: a dict (string keys), a list (keys 0..n-1)
    or a Slot; None when it cannot be rebuilt."""
    if isinstance(node, Slot):
        return node
    children = {k: _template(c) for k, c in node.items()}
    if any(c is None for c in children.values()):
        return None
    if all(isinstance(k, str) for k in children):
        return children
    if all(type(k) is int for k in children) and sorted(children) == list(range(len(children))):
        return [children[i] for i in range(len(children))]
    return None


def _collect(node: dict, prefix: str, out: list[tuple[str, Any]]) -> None:
    """Append (name, template) for each outermost tensor-free container or item under ``node``."""
    for item, child in node.items():
        name = f"{prefix}.{item}" if prefix else str(item)
        if child is _TENSOR:
            continue
        built = None if _holds_tensor(child) else _template(child)
        if built is None:
            _collect(child, name, out)
        else:
            out.append((name, built))


def rank_of_files(names: Sequence[str]) -> dict[str, int]:
    """Map ``.distcp`` file names to writer ranks: ``__<rank>_<n>.distcp``; else one rank per file.

    DCP's FileSystemWriter names rank ``r``'s ``n``-th file ``__r_n.distcp``. When any name
    differs (a custom storage writer), each file, in sorted order, counts as its own rank.
    """
    names = sorted(set(names))
    matches = {n: RANK_FILE.fullmatch(n) for n in names}
    ranks = {n: int(m.group(1)) for n, m in matches.items()} if all(matches.values()) else {
        n: r for r, n in enumerate(names)}
    too_high = [n for n, r in ranks.items() if r >= MAX_WORLD]
    if too_high:
        raise DcpImportError(f"{too_high[0]}: rank {ranks[too_high[0]]} is beyond the format's {MAX_WORLD} ranks")
    return ranks



def plan_import(meta: DcpMetadata, file_sizes: Mapping[str, int], *, where: str = ".metadata",
                memory_budget: int = DEFAULT_MEMORY_BUDGET, extra_files: Sequence[str] = ()) -> ImportPlan:
    """Check ``meta`` against the data files' sizes and cut every rank's chunks into parts.

    ``file_sizes`` gives the size of every file the metadata names; ``extra_files`` names
    further ``.distcp`` files found in the directory (ranks that wrote no item still count
    towards the world size).
    """
    if memory_budget <= 0:
        raise ValueError(f"memory_budget must be positive, got {memory_budget}")

    def located(key: tuple, what: str) -> DcpLocation:
        loc = meta.locations.get(key)
        if loc is None:
            raise DcpImportError(f"{where}: {what} has no storage entry (no bytes were saved for it)")
        size = file_sizes.get(loc.relative_path)
        if size is None:
            raise DcpImportError(f"{where}: {what}: no size known for {loc.relative_path}")
        if loc.offset + loc.length > size:
            raise DcpImportError(f"{loc.relative_path}: truncated: {what} is stored at bytes "
                                 f"[{loc.offset}, {loc.offset + loc.length}) but the file has {size} bytes")
        return loc

    items = _chunk_items(meta, located, where)
    values = tuple(
        ValueGroup(name=name, template=template,
                   items=tuple((k, located((k, None), f"value {k!r}")) for k in _slots(template)))
        for name, template in group_values(meta.values, list(meta.tensors), meta.paths))
    used = {i.location.relative_path for i in items} | {loc.relative_path for g in values for _, loc in g.items}
    ranks = rank_of_files(sorted(used | set(extra_files)))
    return ImportPlan(world_size=max(ranks.values(), default=0) + 1, parts=_rank_parts(items, ranks, memory_budget),
                      values=values, tensors=len(meta.tensors))


def _chunk_items(meta: DcpMetadata, located: Callable[[tuple, str], DcpLocation], where: str) -> list[ChunkItem]:
    """Every tensor's distinct chunks, checked: a storable dtype, one size per offset, a tiling."""
    items: list[ChunkItem] = []
    for fqn, t in meta.tensors.items():
        dtype_code(t.dtype, what=f"{where}: tensor {fqn!r}")
        unique: dict[tuple[int, ...], tuple[int, ...]] = {}
        for c in t.chunks:
            seen = unique.setdefault(c.offsets, c.sizes)
            if seen != c.sizes:
                raise DcpImportError(f"{where}: tensor {fqn!r} has two chunks at offsets {list(c.offsets)} "
                                     f"with sizes {list(seen)} and {list(c.sizes)}")
        problems = tiling_problems([Box(o, s) for o, s in unique.items()], Box.full(t.shape))
        if problems:
            raise DcpImportError(f"{where}: tensor {fqn!r}: its chunks do not tile its shape "
                                 f"{list(t.shape)}: {problems[0]}")
        if not unique:
            raise DcpImportError(f"{where}: tensor {fqn!r} has no chunks")
        for offsets, sizes in unique.items():
            loc = located((fqn, offsets), f"tensor {fqn!r} chunk at offsets {list(offsets)}")
            items.append(ChunkItem(fqn=fqn, dtype=t.dtype, global_shape=t.shape, offsets=offsets, sizes=sizes,
                                   location=loc))
    return items


def _rank_parts(items: Sequence[ChunkItem], ranks: Mapping[str, int], memory_budget: int) -> tuple[RankPart, ...]:
    """Each rank's chunks in file order (each file read front to back), cut into parts of at
    most ``memory_budget`` bytes unless one chunk alone is larger (then it is a part by itself)."""
    by_rank: dict[int, list[ChunkItem]] = {}
    for it in items:
        by_rank.setdefault(ranks[it.location.relative_path], []).append(it)
    parts: list[RankPart] = []
    for rank in sorted(by_rank):
        groups: list[list[ChunkItem]] = [[]]
        held = 0
        for it in sorted(by_rank[rank], key=lambda i: (i.location.relative_path, i.location.offset)):
            if groups[-1] and held + it.nbytes > memory_budget:
                groups.append([])
                held = 0
            groups[-1].append(it)
            held += it.nbytes
        for k, group in enumerate(groups):
            parts.append(RankPart(rank=rank, part=None if len(groups) == 1 else k, items=tuple(group)))
    return tuple(parts)


__all__ = ["DEFAULT_MEMORY_BUDGET", "ChunkItem", "ImportPlan", "RankPart", "Slot", "ValueGroup", "fill",
           "group_values", "plan_import", "rank_of_files"]
