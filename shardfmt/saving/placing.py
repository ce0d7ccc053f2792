"""Format v2's write plan, made by rank 0 from the ranks' claims (pure).

A tensor is *placed* when its placement over the job's mesh says exactly which boxes every
rank holds: every rank that holds it claims it (``claims``: the placement derives that rank's
boxes) with the same placement, and every rank that the placement gives data holds it. A
tensor claimed by the ranks of one pipeline stage only, whose placement names no stage, is
placed with that stage. The check costs O(groups) per tensor, not O(ranks): the ranks of a
group made the same claims, and each rank checked its own boxes. Anything else is *listed*:
its boxes with their writer ranks.

Of each replica group of a placed tensor (the ranks holding the same boxes), member number
``writer`` mod the group's size writes the group's boxes; ``writer`` counts up over the
placed tensors, largest first, so the writing spreads over the replicas, except that small
tensors share one per bin of up to 1 MiB (``_writers``), so that the small replicated state
every rank loads (AdamW's ``step`` of every parameter, norms) sits in few files and a loading
rank opens few. Every rank derives what it writes from the plan alone (``rank_writes``). Listed boxes then go, largest
first, to the holder with the fewest listed bytes so far.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from shardfmt.errors import StateDictError
from shardfmt.format.dtypes import itemsize
from shardfmt.format.manifest import ListedShard, Placed, Placement, Topology
from shardfmt.layout.placed import check_placed, written_by
from shardfmt.layout.topology import Replicate, TopologyError, layout_from_record
from shardfmt.saving.claims import (
    Group,
    claims_digest,
    derived_boxes,
    first_of_groups,
    split_claims,
)
from shardfmt.saving.messages import Claim, HeldTensor, RankState, WriteKey
from shardfmt.saving.plan import chunk_for_median, least_loaded

STAGE_DIM = "pp"
SPREAD_FROM = 1 << 20  # bytes of small tensors that share a writer offset (at most)


@dataclass(frozen=True, slots=True, kw_only=True)
class PlacedPlan:
    """Rank 0's plan: the placed tensors, the writer of every listed box, every tensor's record
    (dtype, shape, storage; a listed tensor's reported placement), the hash chunk."""

    placed: Mapping[str, Placed]
    listed: Mapping[WriteKey, int]
    records: Mapping[str, HeldTensor]
    chunk_size: int

    def listed_shards(self, fqn: str) -> list[ListedShard]:
        return [ListedShard(offsets=o, lengths=n, rank=r) for (f, o, n), r in self.listed.items() if f == fqn]


def plan_groups(groups: Sequence[Group], listed: Sequence[tuple[int, HeldTensor]], topology: Topology,
                *, world: int) -> PlacedPlan:
    """Return the v2 write plan of the ranks' claim ``groups`` and ``listed`` tensors (deterministic)."""
    records = _records(groups, listed)
    claimed: dict[str, list[tuple[Claim, Group]]] = {}
    for g in groups:
        for c in g.claims:
            claimed.setdefault(c.fqn, []).append((c, g))
    listed_names = {t.fqn for _, t in listed}
    stages = [_stages(g, topology) for g in groups]
    stage_of = {id(g): s for g, s in zip(groups, stages)}
    placements = {}
    for fqn in sorted(claimed):
        if fqn not in listed_names:
            p = _placement(claimed[fqn], stage_of, topology, world)
            if p is not None:
                placements[fqn] = p
    writer = _writers(placements, records, world)
    placed = {f: Placed(placement=placements[f], writer=writer[f]) for f in sorted(placements)}
    for f, t in records.items():  # a listed tensor keeps only a placement a reader takes
        if f not in placed and t.placement is not None and not _describable(t, topology):
            records[f] = replace(t, placement=None)
    holders = _listed_holders(claimed, placed, listed, topology)
    writers = _assign(holders, records)
    return PlacedPlan(placed=placed, listed=writers, records=records,
                      chunk_size=chunk_for_median(_median_box(placed, writers, records, topology)))


def _writers(placements: Mapping[str, Placement], records: Mapping[str, HeldTensor], world: int) -> dict[str, int]:
    """Writer offsets, largest tensor first: the next offset once the tensors given the current
    one hold ``min(1 MiB, placed bytes / world)``: a large tensor gets one of its own (the writing
    spreads over the replicas), small ones share one per bin (a loading rank opens few files
    for them, e.g. AdamW's ``step`` of every parameter)."""
    order = sorted(placements, key=lambda f: (-_nbytes(records[f]), f))
    spread = max(1, min(SPREAD_FROM, sum(_nbytes(records[f]) for f in order) // max(1, world)))
    out, k, acc = {}, 0, 0
    for f in order:
        out[f] = k
        acc += _nbytes(records[f])
        if acc >= spread:
            k, acc = k + 1, 0
    return out


def plan_placed(states: Sequence[RankState], topology: Topology) -> PlacedPlan:
    """The plan of every rank's ``states`` at once (what rank 0 makes of their claims)."""
    claims = {}
    listed = []
    for s in states:
        c, ls = split_claims(s, topology)
        claims[s.rank] = c
        listed.extend((s.rank, t) for t in ls)
    digests = [claims_digest(claims[r]) for r in sorted(claims)]
    groups = [Group(ranks=ranks, claims=claims[first]) for first, ranks in first_of_groups(digests).items()]
    return plan_groups(groups, listed, topology, world=len(states))


def rank_writes(placed: Mapping[str, Placed], listed: Mapping[WriteKey, int], state: RankState,
                topology: Topology) -> dict[WriteKey, int]:
    """What ``state.rank`` writes of what it holds: the placed boxes the writer rule gives it and
    its listed boxes (O(what the rank holds))."""
    out: dict[WriteKey, int] = {}
    rank = state.rank
    for t in state.tensors:
        p = placed.get(t.fqn)
        if p is not None:
            for hb in written_by(t.shape, layout_from_record(p.placement), topology.mesh, writer=p.writer, rank=rank):
                out[(t.fqn, hb.box.offsets, hb.box.lengths)] = rank
            continue
        for b in t.boxes:
            key = (t.fqn, tuple(b.offsets), tuple(b.lengths))
            if listed.get(key) == rank:
                out[key] = rank
    return out


def _records(groups: Sequence[Group], listed: Sequence[tuple[int, HeldTensor]]) -> dict[str, HeldTensor]:
    """fqn -> its record (the first group's, then the lowest listing rank's); ranks that
    disagree on a tensor's dtype or shape fail the save."""
    out: dict[str, tuple[HeldTensor, int]] = {}
    pairs = [(c.held(), g.ranks[0]) for g in groups for c in g.claims] + [(t, r) for r, t in listed]
    for t, rank in sorted(pairs, key=lambda p: p[1]):
        have = out.setdefault(t.fqn, (HeldTensor(fqn=t.fqn, dtype=t.dtype, shape=t.shape, placement=t.placement,
                                                 storage=t.storage), rank))[0]
        if (have.dtype, have.shape) != (t.dtype, t.shape):
            raise StateDictError(f"{t.fqn}: ranks disagree on dtype/shape ({have.dtype}, {list(have.shape)} on rank "
                                 f"{out[t.fqn][1]} vs {t.dtype}, {list(t.shape)} on rank {rank})")
    return {f: t for f, (t, _) in out.items()}


def _nbytes(t: HeldTensor) -> int:
    return math.prod(t.shape) * itemsize(t.dtype)


def _stages(g: Group, topology: Topology) -> Counter:
    """How many of the group's ranks sit on each pipeline stage (all on 0 without a ``pp`` dim)."""
    names = [n for n, _ in topology.mesh]
    if STAGE_DIM not in names:
        return Counter({0: len(g.ranks)})
    i = names.index(STAGE_DIM)
    return Counter(topology.coords(r)[i] for r in g.ranks)


def _placement(claims: list[tuple[Claim, Group]], stage_of: Mapping[int, Counter], topology: Topology,
               world: int) -> Placement | None:
    """The placement every claimer made, with its stage inferred, when every rank it gives data claims it."""
    first = claims[0][0].placement
    if any(c.placement != first for c, _ in claims):
        return None
    names = [n for n, _ in topology.mesh]
    on_stage: Counter = Counter()
    for _, g in claims:
        on_stage.update(stage_of[id(g)])
    candidate = first
    if first.stage is None and STAGE_DIM in names and STAGE_DIM not in first.mesh_dims and len(on_stage) == 1:
        candidate = replace(first, stage=next(iter(on_stage)))
    if not _recordable(candidate, claims[0][0].shape, topology):
        return None
    if candidate.stage is None:
        return candidate if sum(on_stage.values()) == world else None
    return candidate if on_stage[candidate.stage] == world // dict(topology.mesh)[STAGE_DIM] else None


def _describable(t: HeldTensor, topology: Topology) -> bool:
    try:
        layout = layout_from_record(t.placement)
    except TopologyError:
        return False
    return layout.flat is None or _recordable(replace(t.placement, stage=None), t.shape, topology)


def _recordable(p: Placement, shape: tuple[int, ...], topology: Topology) -> bool:
    """Whether a reader takes ``p`` as a placed record (spec 4.3): a stage only with a ``pp``
    dim the placements do not name, and a layout the writer rule can derive (a flat entry last,
    reaching the last element, ...); otherwise the tensor is listed."""
    names = [n for n, _ in topology.mesh]
    if p.stage is not None and (STAGE_DIM not in names or STAGE_DIM in p.mesh_dims):
        return False
    try:
        check_placed(shape, layout_from_record(p), topology.mesh, writer=0)
    except TopologyError:
        return False
    return True


def _listed_holders(claimed: Mapping[str, list[tuple[Claim, Group]]], placed: Mapping[str, Placed],
                    listed: Sequence[tuple[int, HeldTensor]], topology: Topology) -> dict[WriteKey, list[int]]:
    """Every listed box and the ranks holding it: the listing ranks' boxes, and the boxes a
    claim derives for each rank of its group when the tensor could not be placed."""
    holders: dict[WriteKey, list[int]] = {}
    for rank, t in listed:
        for b in t.boxes:
            holders.setdefault((t.fqn, tuple(b.offsets), tuple(b.lengths)), []).append(rank)
    for fqn, cs in claimed.items():
        if fqn in placed:
            continue
        for c, g in cs:
            for rank in g.ranks:
                for b in derived_boxes(c.shape, c.placement, topology, rank) or ():
                    holders.setdefault((fqn, tuple(b.offsets), tuple(b.lengths)), []).append(rank)
    return holders


def _assign(holders: Mapping[WriteKey, list[int]], records: Mapping[str, HeldTensor]) -> dict[WriteKey, int]:
    """Largest listed box first, to its holder with the fewest listed bytes so far (ties: lowest rank)."""
    return least_loaded(holders, {k: math.prod(k[2]) * itemsize(records[k[0]].dtype) for k in holders})


def _median_box(placed: Mapping[str, Placed], listed: Mapping[WriteKey, int], records: Mapping[str, HeldTensor],
                topology: Topology) -> int:
    """The bytes of the stored box that holds the median byte (half the state's bytes lie in
    boxes at most this large), each placed tensor counted as as many boxes of its mean size as
    it has distinct holders (O(tensors), not O(boxes)). By bytes, not by boxes: many small
    boxes (LoRA pairs, norms, biases) are read whole anyway (chunks never cross a shard), and
    would otherwise make the large ones, which hold the bytes, hash in small chunks."""
    weighted: list[tuple[int, int]] = [(math.prod(k[2]) * itemsize(records[k[0]].dtype), 1) for k in listed]
    for fqn, p in placed.items():
        weighted.append(_typical_box(records[fqn], p.placement, topology))
    return weighted_median((v, v * n) for v, n in weighted)


def _typical_box(t: HeldTensor, p: Placement, topology: Topology) -> tuple[int, int]:
    sizes = dict(topology.mesh)
    try:
        layout = layout_from_record(p)
    except TopologyError:
        return _nbytes(t), 1
    pieces = math.prod(sizes[d] for d, pl in zip(layout.mesh_dims, layout.placements) if not isinstance(pl, Replicate))
    pieces = max(1, min(pieces, math.prod(t.shape) or 1))
    return _nbytes(t) // pieces, pieces


def weighted_median(weighted: Iterable[tuple[int, int]]) -> int:
    """The median of a multiset given as (value, count) pairs; values of 0 do not count (0: none)."""
    items = sorted((v, n) for v, n in weighted if v and n)
    total = sum(n for _, n in items)
    seen = 0
    for v, n in items:
        seen += n
        if seen > total // 2:
            return v
    return 0
