"""Format v2 "placed" tensors: who wrote which box, found without visiting every rank. Pure.

A placed tensor's record gives its placement over the topology's mesh and a writer number
``k`` instead of listing its shards (V2 design brief; the boxes follow spec section 4.3):

- The SHARDING mesh dims are those with a ``shard``/``strided_shard`` entry; every other
  mesh dim is a REPLICA dim, except the stage dim (``layout.stage_dim``, ``pp``) when
  ``stage`` is set: only ranks at that coordinate hold the tensor.
- A rank's replica group is the ranks equal to it on every non-replica dim, sorted by rank
  (row-major over the replica dims). Member number ``k mod group size`` writes the group's
  boxes; a box without elements is not stored (a 0-d tensor's one box has an element).

``saved_pieces`` answers a reader: which stored boxes overlap the box it wants, and which
rank wrote each. Its cost follows the answer, not the world size: along each tensor dim the
placement entries on that dim (in order) form a tree over the coordinates of the mesh dims
that shard it; the search descends only into children holding a wanted position (each
wanted child leads to at least one wanted leaf), and a piece is one wanted leaf per dim.
The rank then follows from those coordinates plus the writer's position on the replica
dims. Two bounded caches serve the thousands of tensors that share a few shapes: the checks
and rank strides per (shape, layout, mesh), and the wanted leaves per (tensor dim, range).
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from shardfmt.layout.flat import flat_boxes
from shardfmt.layout.geometry import Box, intersect
from shardfmt.layout.topology import (
    Flat,
    HeldBox,
    Layout,
    Mesh,
    Replicate,
    Shard,
    StridedShard,
    TopologyError,
    chunk_range,
    held_boxes,
    narrow,
)

MeshLike = Mesh | Sequence[tuple[str, int]] | Mapping[str, int]


@dataclass(frozen=True, slots=True, kw_only=True)
class SavedPiece:
    """A stored box that overlaps a requested one: the writer's file header has the key
    ``(fqn, box.offsets)``; ``overlap`` is the part of ``box`` inside the requested box."""

    rank: int
    box: Box
    overlap: Box


@dataclass(frozen=True, slots=True, kw_only=True)
class _Entry:
    """A shard/strided_shard entry on one tensor dim, with its mesh dim's size and rank stride."""

    placement: Shard | StridedShard
    size: int
    stride: int


@dataclass(frozen=True, slots=True, kw_only=True)
class _Dim:
    """One tensor dim: its length and the entries on it, in layout order."""

    length: int
    entries: tuple[_Entry, ...]


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)  # one per cached key: compared by identity
class _Plan:
    """What every query on one (shape, layout, mesh) needs, derived once."""

    shape: tuple[int, ...]
    layout: Layout
    mesh: Mesh
    holds: bool  # False: the stage is one no rank is at
    stage: tuple[int, int] | None  # (mesh dim index, coordinate) a holding rank must have
    stage_offset: int  # the stage coordinate's share of the rank
    replica: tuple[tuple[int, int], ...]  # (size, rank stride) of each replica dim, in mesh order
    sharding: tuple[int, ...]  # mesh dim indexes that shard the tensor
    dims: tuple[_Dim, ...]
    flat: tuple[Flat, int, int] | None = None  # a flat entry: (entry, its mesh dim's size, rank stride)

    @property
    def group_size(self) -> int:
        return math.prod(s for s, _ in self.replica)

    def writer_offset(self, writer: int) -> int:
        """The rank share of the writer's coordinates on the replica dims (row-major)."""
        m = writer % self.group_size
        off = 0
        for size, stride in reversed(self.replica):
            off += (m % size) * stride
            m //= size
        return off


def writer_rank(shape: Sequence[int], layout: Layout, mesh: MeshLike, *, writer: int,
                coords_or_rank: int | Mapping[str, int]) -> int | None:
    """Return the rank that writes the boxes of the replica group of ``coords_or_rank``
    (a rank, or its coordinate on every mesh dim); None when that rank does not hold the
    tensor (another pipeline stage). The writer writes nothing when the boxes are empty."""
    plan = _plan_of(shape, layout, mesh)
    _check_writer(writer)
    coords = _coords(plan.mesh, coords_or_rank)
    if not plan.holds or (plan.stage is not None and coords[plan.stage[0]] != plan.stage[1]):
        return None
    strides = _strides(plan.mesh)
    return plan.stage_offset + plan.writer_offset(writer) + sum(coords[i] * strides[i] for i in plan.sharding)


def written_by(shape: Sequence[int], layout: Layout, mesh: MeshLike, *, writer: int,
               rank: int) -> tuple[HeldBox, ...]:
    """Return the boxes ``rank`` stores for the tensor: its non-empty held boxes when it is
    its replica group's writer, else none."""
    return plan_writes(placed_plan(shape, layout, mesh), writer=writer, rank=rank)


def placed_plan(shape: Sequence[int], layout: Layout, mesh: MeshLike) -> _Plan:
    """The checked plan of a placement on a mesh, for ``plan_writes`` (a caller asking about
    many ranks of one tensor builds it once)."""
    return _plan_of(shape, layout, mesh)


def plan_writes(plan: _Plan, *, writer: int, rank: int) -> tuple[HeldBox, ...]:
    """``written_by`` of ``placed_plan``'s tensor. The answer depends on ``writer`` only modulo
    the replica group's size, so the thousands of tensors a rank writes that share a shape and
    a layout are worked out once (a bounded cache)."""
    _check_writer(writer)
    if not _is_index(rank):
        raise TopologyError(f"rank {rank!r} is not a non-negative integer")
    return _written_cached(plan, writer % plan.group_size, rank)


def _written(plan: _Plan, member: int, rank: int) -> tuple[HeldBox, ...]:
    coords = _coords(plan.mesh, rank)
    if not plan.holds or (plan.stage is not None and coords[plan.stage[0]] != plan.stage[1]):
        return ()
    strides = _strides(plan.mesh)
    if plan.stage_offset + plan.writer_offset(member) + sum(coords[i] * strides[i] for i in plan.sharding) != rank:
        return ()
    held = held_boxes(plan.shape, plan.layout, dict(zip(plan.mesh.names, coords)), dict(plan.mesh.dims))
    return tuple(hb for hb in held if not hb.box.is_empty())


_written_cached = functools.lru_cache(maxsize=1 << 14)(_written)


def saved_pieces(shape: Sequence[int], layout: Layout, mesh: MeshLike, *, writer: int,
                 box: Box) -> tuple[SavedPiece, ...]:
    """Return every stored box that overlaps ``box`` (global coordinates, inside the shape),
    with its writer rank, sorted by offsets. Cost: the pieces returned times the tensor's
    dims and placement entries; no loop over ranks."""
    plan = _plan_of(shape, layout, mesh)
    _check_writer(writer)
    _check_box(plan.shape, box)
    if not plan.holds:
        return ()
    base = plan.stage_offset + plan.writer_offset(writer)
    if plan.flat is not None:
        return _flat_pieces(plan, base, box)
    per_dim = _per_dim_hits(plan, box)
    if per_dim is None:
        return ()
    if not per_dim:  # a 0-d tensor: its one box
        return (SavedPiece(rank=base, box=box, overlap=box),)
    out = []
    for combo in itertools.product(*per_dim):  # each dim sorted by start: offsets come out sorted
        shares, starts, lengths, overlap_starts, overlap_lengths = zip(*combo)
        out.append(SavedPiece(rank=base + sum(shares), box=Box(starts, lengths),
                              overlap=Box(overlap_starts, overlap_lengths)))
    return tuple(out)


def _per_dim_hits(plan: _Plan, box: Box) -> list | None:
    """Per tensor dim, the held intervals that overlap ``box`` (``_dim_hits``); None when a dim has none."""
    per_dim = []
    for dim, lo, n in zip(plan.dims, box.offsets, box.lengths):
        hits = _dim_hits(dim, lo, lo + n)
        if not hits:
            return None
        per_dim.append(hits)
    return per_dim


def _flat_pieces(plan: _Plan, base: int, box: Box) -> tuple[SavedPiece, ...]:
    """``saved_pieces`` of a flat layout: the boxes the other entries leave that overlap ``box``
    (found as for any layout), then the flat pieces whose run of that box reaches into ``box``."""
    entry, size, stride = plan.flat
    per_dim = _per_dim_hits(plan, box)
    if per_dim is None:
        return ()
    out = []
    for combo in itertools.product(*per_dim):
        shares, starts, lengths, w_starts, w_lengths = zip(*combo)
        first = _flat_index(lengths, [w - s for w, s in zip(w_starts, starts)])
        last = _flat_index(lengths, [w + n - 1 - s for w, n, s in zip(w_starts, w_lengths, starts)])
        numel = math.prod(lengths)
        for c in range((first + entry.offset) // entry.part, min(size, (last + entry.offset) // entry.part + 1)):
            lo, hi = entry.run(numel, c)
            for fb in flat_boxes(lengths, lo, hi):
                g = Box(tuple(s + o for s, o in zip(starts, fb.box.offsets)), fb.box.lengths)
                ov = intersect(g, Box(w_starts, w_lengths))
                if ov is not None:
                    out.append(SavedPiece(rank=base + sum(shares) + c * stride, box=g, overlap=ov))
    return tuple(sorted(out, key=lambda p: p.box.offsets))


def _flat_index(lengths: Sequence[int], index: Sequence[int]) -> int:
    """Row-major position of ``index`` in a box of ``lengths``."""
    pos = 0
    for n, i in zip(lengths, index):
        pos = pos * n + i
    return pos


def check_placed(shape: Sequence[int], layout: Layout, mesh: MeshLike, *, writer: int) -> None:
    """Raise TopologyError when the placement cannot describe the tensor on the mesh."""
    _plan_of(shape, layout, mesh)
    _check_writer(writer)


# ---- one tensor dim: the wanted leaves of its placement tree ----

@functools.lru_cache(maxsize=1024)  # the layers of a model repeat the same (shape, layout, wanted range)
def _dim_hits(dim: _Dim, lo: int, hi: int) -> tuple[tuple[int, int, int, int, int], ...]:
    """Return (rank share, start, length, overlap start, overlap length) of every interval a
    leaf of ``dim`` holds that overlaps ``[lo, hi)``, sorted by start; the rank share is the
    leaf's coordinates times their mesh dims' rank strides."""
    if lo >= hi:
        return ()
    nodes: list[tuple[int, tuple[tuple[int, int], ...]]] = [(0, ((0, dim.length),))]
    for entry in dim.entries:
        deeper = []
        for share, intervals in nodes:
            total = sum(b - a for a, b in intervals)
            for c in _children(entry, total, _positions(intervals, lo, hi)):
                deeper.append((share + c * entry.stride, narrow(intervals, entry.placement, size=entry.size, coord=c)))
        nodes = deeper
    hits = [(a, b, share) for share, intervals in nodes for a, b in intervals if a < hi and lo < b]
    hits.sort()
    return tuple((share, a, b - a, max(a, lo), min(b, hi) - max(a, lo)) for a, b, share in hits)


def _positions(intervals: tuple[tuple[int, int], ...], lo: int, hi: int) -> list[tuple[int, int]]:
    """Return the position ranges (along the concatenated ``intervals``) of ``[lo, hi)``."""
    out = []
    pos = 0
    for a, b in intervals:
        s, e = max(a, lo), min(b, hi)
        if s < e:
            out.append((pos + s - a, pos + e - a))
        pos += b - a
    return out


def _chunks_hit(n: int, k: int, q0: int, q1: int) -> range:
    """Return the torch.chunk pieces (``chunk_range(n, k, i)``) that overlap positions ``[q0, q1)``."""
    size = -(-n // k)
    return range(q0 // size, min(k, (q1 - 1) // size + 1))


def _children(entry: _Entry, total: int, ranges: list[tuple[int, int]]) -> list[int]:
    """Return, sorted, the coordinates whose piece of a node of ``total`` positions overlaps ``ranges``."""
    hit: set[int] = set()
    for q0, q1 in ranges:
        if isinstance(entry.placement, Shard):
            hit.update(_chunks_hit(total, entry.size, q0, q1))
            continue
        split = entry.placement.split_factor
        step = -(-total // split)
        for j in _chunks_hit(total, split, q0, q1):
            a, b = j * step, min(j * step + step, total)  # chunk_range(total, split, j): j * step < q1 <= total
            s, e = max(q0, a) - a, min(q1, b) - a
            if s < e:
                hit.update(_chunks_hit(b - a, entry.size, s, e))
    return sorted(hit)


# ---- checks and the cached plan ----

def _plan_of(shape: Sequence[int], layout: Layout, mesh: MeshLike) -> _Plan:
    if not isinstance(layout, Layout):
        raise TopologyError(f"expected a Layout, got {type(layout).__name__}")
    key = (_shape(shape), layout, _mesh_pairs(mesh))
    try:
        hash(key)
    except TypeError:
        return _build_plan(*key)
    return _cached_plan(*key)


def _shape(shape: Sequence[int]) -> tuple[int, ...]:
    try:
        dims = tuple(shape)
    except TypeError:
        raise TopologyError(f"shape {shape!r} is not a sequence of lengths") from None
    if not all(_is_index(n) for n in dims):
        raise TopologyError(f"shape {list(dims)!r}: every length must be a non-negative integer")
    return tuple(int(n) for n in dims)


def _mesh_pairs(mesh: MeshLike) -> tuple[tuple[str, int], ...]:
    if isinstance(mesh, Mesh):
        return mesh.dims
    if isinstance(mesh, Mapping):
        return tuple(mesh.items())
    try:
        return tuple((name, size) for name, size in mesh)
    except (TypeError, ValueError):
        raise TopologyError(f"mesh {mesh!r} is not a sequence of (name, size) pairs") from None


def _build_plan(shape: tuple[int, ...], layout: Layout, pairs: tuple[tuple[str, int], ...]) -> _Plan:
    names = [n for n, _ in pairs]
    if len(set(names)) != len(names):
        raise TopologyError(f"mesh {list(pairs)!r} repeats a dim name")
    mesh = Mesh.parse(dict(pairs))
    _check_layout(shape, layout, mesh)
    strides = _strides(mesh)
    index = {n: i for i, n in enumerate(mesh.names)}
    sharding = {name: p for name, p in zip(layout.mesh_dims, layout.placements) if not isinstance(p, Replicate)}
    stage_dim = layout.stage_dim if layout.stage is not None else None
    holds, stage, stage_offset = True, None, 0
    if stage_dim is not None:
        if stage_dim in index:
            holds = layout.stage < mesh.size(stage_dim)
            stage = (index[stage_dim], layout.stage)
            stage_offset = layout.stage * strides[index[stage_dim]]
        else:
            holds = layout.stage == 0  # no stage dim: every rank is at stage 0 (spec section 4.3)
    replica = tuple((s, strides[i]) for i, (n, s) in enumerate(mesh.dims) if n not in sharding and n != stage_dim)
    dims = []
    for d, length in enumerate(shape):
        on_d = [(name, p) for name, p in sharding.items() if not isinstance(p, Flat) and p.dim == d]
        entries = tuple(_Entry(placement=p, size=mesh.size(name), stride=strides[index[name]]) for name, p in on_d)
        dims.append(_Dim(length=length, entries=entries))
    flat = None
    if layout.flat is not None:
        name, entry = layout.flat
        flat = (entry, mesh.size(name), strides[index[name]])
    return _Plan(shape=shape, layout=layout, mesh=mesh, holds=holds, stage=stage, stage_offset=stage_offset, replica=replica,
                 sharding=tuple(index[n] for n in mesh.names if n in sharding), dims=tuple(dims), flat=flat)


# Thousands of tensors share a few (shape, layout) pairs: each is checked and planned once.
_cached_plan = functools.lru_cache(maxsize=4096)(_build_plan)


def _check_layout(shape: tuple[int, ...], layout: Layout, mesh: Mesh) -> None:
    where = f"placement {layout.to_json()!r} of a tensor of shape {list(shape)} on mesh {mesh}"
    seen: set[str] = set()
    for name, p in zip(layout.mesh_dims, layout.placements):
        if name not in mesh.names:
            raise TopologyError(f"{where}: mesh dim {name!r} is not a dim of the mesh")
        if name in seen:
            raise TopologyError(f"{where}: mesh dim {name!r} is used twice")
        seen.add(name)
        if not isinstance(p, (Shard, StridedShard, Replicate, Flat)):
            raise TopologyError(f"{where}: {p!r} is not Shard, StridedShard, Flat or Replicate")
        if isinstance(p, (Replicate, Flat)):
            continue
        if not _is_index(p.dim) or p.dim >= len(shape):
            raise TopologyError(f"{where}: mesh dim {name!r} shards tensor dim {p.dim!r}, "
                                f"outside a {len(shape)}-d tensor")
        if isinstance(p, StridedShard) and not (_is_index(p.split_factor) and p.split_factor >= 1):
            raise TopologyError(f"{where}: split factor {p.split_factor!r} is not a positive integer")
    if layout.flat is not None:
        _check_flat(shape, layout, mesh, where)
    if layout.stage is not None and not _is_index(layout.stage):
        raise TopologyError(f"{where}: stage {layout.stage!r} is not a non-negative integer")
    if layout.stage is not None and layout.stage_dim in seen and not isinstance(
            layout.placements[layout.mesh_dims.index(layout.stage_dim)], Replicate):
        raise TopologyError(f"{where}: mesh dim {layout.stage_dim!r} picks the stage and also shards the "
                            "tensor: only one of its pieces would be stored")


def _check_flat(shape: tuple[int, ...], layout: Layout, mesh: Mesh, where: str) -> None:
    """A flat entry: one, the last that is not replicate, after shard entries only, on a tensor
    with dims, and its pieces over the mesh dim reach past the tensor's last element."""
    kinds = [p for p in layout.placements if not isinstance(p, Replicate)]
    name, entry = layout.flat
    if sum(isinstance(p, Flat) for p in kinds) != 1 or not isinstance(kinds[-1], Flat):
        raise TopologyError(f"{where}: a flat entry must be the only one and come after every shard entry")
    if any(isinstance(p, StridedShard) for p in kinds):
        raise TopologyError(f"{where}: a flat entry cannot follow a strided shard (a rank would hold several boxes)")
    if not shape:
        raise TopologyError(f"{where}: a 0-d tensor cannot have a flat placement")
    if not (_is_index(entry.offset) and _is_index(entry.part) and entry.part >= 1):
        raise TopologyError(f"{where}: flat offset {entry.offset!r} and part {entry.part!r} must be integers, part >= 1")
    largest = list(shape)  # what the shard entries leave a rank, at most: the first chunks
    for n, p in zip(layout.mesh_dims, layout.placements):
        if isinstance(p, Shard):
            largest[p.dim] = chunk_range(largest[p.dim], mesh.size(n), 0)[1]
    if entry.offset + math.prod(largest) > entry.part * mesh.size(name):
        raise TopologyError(f"{where}: {mesh.size(name)} pieces of {entry.part} elements from offset "
                            f"{entry.offset} do not reach the last of {math.prod(largest)} elements")


def _check_writer(writer: int) -> None:
    if not _is_index(writer):
        raise TopologyError(f"writer {writer!r} is not a non-negative integer")


def _check_box(shape: tuple[int, ...], box: Box) -> None:
    if not isinstance(box, Box) or box.ndim != len(shape):
        raise TopologyError(f"requested box {box!r} is not a {len(shape)}-d Box for shape {list(shape)}")
    for o, n, size in zip(box.offsets, box.lengths, shape):
        if not (_is_index(o) and _is_index(n) and o + n <= size):
            raise TopologyError(f"requested box {list(box.offsets)} + {list(box.lengths)} is not inside "
                                f"shape {list(shape)}")


def _coords(mesh: Mesh, coords_or_rank: int | Mapping[str, int]) -> tuple[int, ...]:
    if isinstance(coords_or_rank, Mapping):
        if set(coords_or_rank) != set(mesh.names) or not all(
                _is_index(coords_or_rank[n]) and coords_or_rank[n] < s for n, s in mesh.dims):
            raise TopologyError(f"coordinates {dict(coords_or_rank)!r} do not name a rank of mesh {mesh}")
        return tuple(coords_or_rank[n] for n in mesh.names)
    if not _is_index(coords_or_rank):
        raise TopologyError(f"rank {coords_or_rank!r} is not a non-negative integer")
    c = mesh.coords(coords_or_rank)
    return tuple(c[n] for n in mesh.names)


@functools.lru_cache(maxsize=256)
def _strides(mesh: Mesh) -> tuple[int, ...]:
    """Rank stride of each mesh dim (row-major, last dim fastest)."""
    out = [1] * len(mesh.dims)
    for i in range(len(mesh.dims) - 2, -1, -1):
        out[i] = out[i + 1] * mesh.dims[i + 1][1]
    return tuple(out)


def _is_index(v) -> bool:
    """``v`` is an integer >= 0 (a bool is not)."""
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0
