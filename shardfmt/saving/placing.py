"""Format v2's write plan: which tensors the root records by placement, and who writes what (pure).

A tensor is *placed* when its placement over the job's mesh says exactly which boxes every
rank holds: every holder reports that placement, and each rank's boxes are the ones the
placement derives for its mesh coordinates (spec section 4.3) -- so a rank permutation, a
mesh the topology does not name, or a layout only some ranks follow falls back to *listed*
boxes, each with its writer rank. A tensor held by the ranks of one pipeline stage only,
whose placement names no stage, is placed with that stage.

Of each replica group of a placed tensor (the ranks holding the same boxes), member number
``writer`` mod the group's size writes the group's boxes; ``writer`` counts up over the
placed tensors, largest first, so the writing spreads over the replicas. Listed boxes then go,
largest first, to the holder with the fewest bytes so far (v1's rule).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from shardfmt.format.dtypes import itemsize
from shardfmt.format.manifest import Placed, Placement, Topology
from shardfmt.layout.geometry import Box
from shardfmt.layout.placed import saved_pieces, written_by
from shardfmt.layout.topology import (
    Layout,
    Replicate,
    TopologyError,
    held_boxes,
    layout_from_record,
)
from shardfmt.saving.messages import HeldTensor, RankState
from shardfmt.saving.plan import WriteKey

STAGE_DIM = "pp"


@dataclass(frozen=True, slots=True, kw_only=True)
class PlacedPlan:
    """Who writes every box, and the tensors the root records by placement."""

    writers: Mapping[WriteKey, int]
    placed: Mapping[str, Placed]


def plan_placed(states: Sequence[RankState], topology: Topology) -> PlacedPlan:
    """Return the v2 write plan of the ranks' ``states`` on ``topology`` (deterministic)."""
    holders: dict[str, list[tuple[int, HeldTensor]]] = {}
    for s in states:
        for t in s.tensors:
            holders.setdefault(t.fqn, []).append((s.rank, t))
    placements = {}
    for fqn in sorted(holders):
        p = _placement(holders[fqn], topology)
        if p is not None:
            placements[fqn] = p
    order = sorted(placements, key=lambda f: (-_nbytes(holders[f][0][1]), f))
    placed = {f: Placed(placement=placements[f], writer=k) for k, f in enumerate(order)}
    writers: dict[WriteKey, int] = {}
    load = {s.rank: 0 for s in states}
    for fqn, p in placed.items():
        t = holders[fqn][0][1]
        layout = _layout(p.placement)
        for rank, _ in holders[fqn]:
            for hb in written_by(t.shape, layout, topology.mesh, writer=p.writer, rank=rank):
                writers[(fqn, hb.box.offsets, hb.box.lengths)] = rank
                load[rank] += math.prod(hb.box.lengths) * itemsize(t.dtype)
    _assign_listed(holders, placed, writers, load)
    return PlacedPlan(writers=writers, placed=placed)


def _nbytes(t: HeldTensor) -> int:
    return math.prod(t.shape) * itemsize(t.dtype)


def _layout(p: Placement) -> Layout:
    return layout_from_record(p)


def _placement(held: list[tuple[int, HeldTensor]], topology: Topology) -> Placement | None:
    """The placement that derives exactly what every holder holds, or None (listed)."""
    first = held[0][1].placement
    if first is None or not topology.mesh or any(t.placement != first for _, t in held):
        return None
    names = [n for n, _ in topology.mesh]
    if any(d not in names for d in first.mesh_dims) or len(set(first.mesh_dims)) != len(first.mesh_dims):
        return None
    candidate = first
    if first.stage is None and STAGE_DIM in names and STAGE_DIM not in first.mesh_dims:
        stages = {topology.coords(r)[names.index(STAGE_DIM)] for r, _ in held}
        if len(stages) == 1:
            candidate = replace(first, stage=stages.pop())
    return candidate if _derives(held, candidate, topology) else None


def _derives(held: list[tuple[int, HeldTensor]], p: Placement, topology: Topology) -> bool:
    """Whether ``p`` derives every holder's boxes, and no rank outside the holders holds any:
    each holder's non-empty boxes are the ones derived for its coordinates, and as many ranks
    derive data as hold it (counted from the stored boxes' writers, times the replica groups'
    size: no loop over the ranks)."""
    t = held[0][1]
    try:
        layout = _layout(p)
        pieces = saved_pieces(t.shape, layout, topology.mesh, writer=0, box=Box.full(t.shape))
    except TopologyError:
        return False
    holding = 0
    for rank, h in held:
        got = {b for b in h.boxes if b.numel}
        if got != _derived(t.shape, layout, topology, rank):
            return False
        holding += bool(got)
    sharding = {d for d, pl in zip(layout.mesh_dims, layout.placements) if not isinstance(pl, Replicate)}
    if layout.stage is not None:
        sharding.add(layout.stage_dim)
    group = math.prod(size for name, size in topology.mesh if name not in sharding)
    return holding == len({piece.rank for piece in pieces}) * group


def _derived(shape: tuple[int, ...], layout: Layout, topology: Topology, rank: int) -> set[Box]:
    names = [n for n, _ in topology.mesh]
    coords = dict(zip(names, topology.coords(rank)))
    return {hb.box for hb in held_boxes(shape, layout, coords, dict(topology.mesh)) if hb.box.numel}


def _assign_listed(holders: Mapping[str, list[tuple[int, HeldTensor]]], placed: Mapping[str, Placed],
                   writers: dict[WriteKey, int], load: dict[int, int]) -> None:
    """v1's rule for every box of a listed tensor: largest first, to its least-loaded holder."""
    boxes: dict[WriteKey, list[int]] = {}
    nbytes: dict[WriteKey, int] = {}
    for fqn, held in holders.items():
        if fqn in placed:
            continue
        for rank, t in held:
            for box in t.boxes:
                key = (fqn, tuple(box.offsets), tuple(box.lengths))
                boxes.setdefault(key, []).append(rank)
                nbytes[key] = itemsize(t.dtype) * math.prod(box.lengths)
    for key in sorted(boxes, key=lambda k: (-nbytes[k], k)):
        r = min(boxes[key], key=lambda x: (load[x], x))
        writers[key] = r
        load[r] += nbytes[key]
