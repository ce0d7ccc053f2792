"""Format v2, step 3 of a save at scale: what a rank vouches for alone, and the ranks that vouch alike (pure).

A rank *claims* a tensor when the placement it reports derives, for its own mesh
coordinates, exactly the boxes with elements it holds (spec section 4.3); a plain tensor
held whole claims the empty placement (a replica on every rank). A claimed tensor's boxes
never travel: each rank checks its own, here, in O(what it holds).

Ranks with the same claims form a *group*: every rank of a data- and tensor-parallel job,
or the ranks of one pipeline stage. The ranks all-gather a 128-bit digest of their claims
(16 bytes a rank), and only the first rank of each group sends its claims to rank 0, so rank
0 receives each distinct claim list once, however many ranks share it. What a rank cannot
claim (a ShardedTensor without a layout, a permuted mesh, a placement over dims the job's
mesh does not name) is *listed*: its boxes go to rank 0 as they are.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import orjson
import xxhash

from shardfmt.format.manifest import Placement, Topology
from shardfmt.layout.geometry import Box
from shardfmt.layout.topology import TopologyError, held_boxes, layout_from_record
from shardfmt.saving.messages import Claim, HeldTensor, RankState

REPLICATED = Placement()  # no mesh dim named: every rank holds the whole tensor


@dataclass(frozen=True, slots=True, kw_only=True)
class Group:
    """Ranks that made the same claims, in increasing order."""

    ranks: tuple[int, ...]
    claims: tuple[Claim, ...]


def split_claims(state: RankState, topology: Topology) -> tuple[tuple[Claim, ...], tuple[HeldTensor, ...]]:
    """This rank's claims (sorted by name) and the tensors it lists with their boxes."""
    claims, listed = [], []
    for t in state.tensors:
        placement = _claimable(t, topology, state.rank)
        if placement is None:
            listed.append(t)
        else:
            claims.append(Claim(fqn=t.fqn, dtype=t.dtype, shape=t.shape, placement=placement, storage=t.storage))
    return tuple(sorted(claims, key=lambda c: c.fqn)), tuple(listed)


def _claimable(t: HeldTensor, topology: Topology, rank: int) -> Placement | None:
    """The placement ``t`` claims on ``rank``, or None when it derives other boxes than ``t`` holds."""
    if not topology.mesh:
        return None
    p = t.placement
    if p is None:
        return REPLICATED if t.boxes == (Box.full(t.shape),) else None
    names = [n for n, _ in topology.mesh]
    if any(d not in names for d in p.mesh_dims) or len(set(p.mesh_dims)) != len(p.mesh_dims):
        return None
    return p if derived_boxes(t.shape, p, topology, rank) == {b for b in t.boxes if b.numel} else None


def derived_boxes(shape: tuple[int, ...], p: Placement, topology: Topology, rank: int) -> set[Box] | None:
    """The boxes with elements that ``p`` gives ``rank`` (None: ``p`` cannot lay out ``shape``)."""
    coords = dict(zip((n for n, _ in topology.mesh), topology.coords(rank)))
    try:
        held = held_boxes(shape, layout_from_record(p), coords, dict(topology.mesh))
    except TopologyError:
        return None
    return {hb.box for hb in held if hb.box.numel}


def claims_digest(claims: Sequence[Claim]) -> tuple[int, int]:
    """128 bits naming the claim list, as two int64s (what the ranks all-gather)."""
    d = xxhash.xxh3_128_intdigest(orjson.dumps([c.to_json() for c in claims]))
    return _signed(d >> 64), _signed(d & ((1 << 64) - 1))


def _signed(v: int) -> int:
    return v - (1 << 64) if v >= 1 << 63 else v


def first_of_groups(digests: Sequence[tuple[int, int]]) -> dict[int, tuple[int, ...]]:
    """rank -> the ranks of its group, for the first rank of each group (from the all-gathered digests)."""
    groups: dict[tuple[int, int], list[int]] = {}
    for rank, d in enumerate(digests):
        groups.setdefault(tuple(d), []).append(rank)
    return {ranks[0]: tuple(ranks) for ranks in groups.values()}
