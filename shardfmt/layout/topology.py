"""Named meshes and placements -> the slices each rank holds. Pure: no process group.

A ``Mesh`` lists named dims outermost -> innermost (``pp=2,dp=2,tp=2``); a rank's
coordinates are its row-major index over that order (last dim fastest, as DeviceMesh).

A ``Layout`` says how one tensor sits on (a sub-mesh of) the mesh, in DTensor's terms:
one placement per named mesh dim, applied left to right — ``Shard(d)`` (torch.chunk
semantics: chunks of ceil(n / k), trailing ones short or empty), ``StridedShard(d, k)``
(FSDP2-over-TP: the current extent is cut into ``k`` chunks first, then each chunk is
split over the mesh dim and the rank keeps its piece of every chunk: several disjoint
ranges), ``Flat(offset, part)`` (ZeRO/FSDP1: a run of the flattened elements, last), or
``Replicate()``; plus an optional pipeline ``stage`` that owns it. Along each
tensor dim a rank holds a list of global intervals; the product of those lists is its set
of boxes, each paired with where it sits in the rank's local tensor.
"""

from __future__ import annotations

import functools
import math
import operator
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

from shardfmt.errors import ShardfmtError
from shardfmt.layout.flat import flat_boxes
from shardfmt.layout.geometry import Box

MAX_WORLD = 1 << 24  # ranks (and mesh dim sizes) the manifest can record (spec sections 4.1, 12)
MAX_MESH_DIMS = 16
_MESH_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}", re.ASCII)


class TopologyError(ShardfmtError):
    """A mesh or layout is malformed or does not fit the tensor."""


def _mesh_size(mesh: Mapping, name, size) -> int:
    """A mapping's size for ``name``: an integer (not a bool, a float or a string)."""
    if isinstance(size, bool):
        raise TopologyError(f"mesh {dict(mesh)!r}: size of {name!r} is a bool ({size}), not an integer")
    try:
        return operator.index(size)
    except TypeError:
        raise TopologyError(f"mesh {dict(mesh)!r}: size of {name!r} is {size!r}, not an integer") from None


@dataclass(frozen=True, slots=True)
class Mesh:
    """Named mesh dims, outermost first."""

    dims: tuple[tuple[str, int], ...]

    @classmethod
    def parse(cls, text: str | Mapping[str, int]) -> Mesh:
        """Parse ``"pp=2,dp=2,tp=2"`` (or a mapping, in its order); spaces around names, sizes
        and commas are ignored. Refuses what the format cannot record (spec sections 4.1, 12):
        more than 16 dims, a name longer than 64 characters, a size or a world size outside
        [1, 2^24] — before anything is sized by it."""
        if isinstance(text, Mapping):
            pairs = [(str(k), _mesh_size(text, k, v)) for k, v in text.items()]
        else:
            pairs = []
            for part in filter(None, (p.strip() for p in str(text).split(","))):
                m = re.fullmatch(r"([A-Za-z_][A-Za-z0-9_]*)\s*=\s*0*([0-9]+)", part, re.ASCII)
                if not m:
                    raise TopologyError(f"mesh {text!r}: {part!r} is not NAME=SIZE")
                if len(m.group(2)) > 8:  # more than 2^24 whatever the digits: never convert a huge string
                    raise TopologyError(f"mesh dim {m.group(1)!r}: a {len(m.group(2))}-digit size exceeds the "
                                        f"format's maximum of {MAX_WORLD} (2^24) ranks")
                pairs.append((m.group(1), int(m.group(2))))
        if not pairs:
            raise TopologyError(f"mesh {text!r} has no dims")
        names = [n for n, _ in pairs]
        if len(set(names)) != len(names):
            raise TopologyError(f"mesh {text!r} repeats a dim name")
        if len(pairs) > MAX_MESH_DIMS:
            raise TopologyError(f"mesh {text!r} has {len(pairs)} dims; the format records at most {MAX_MESH_DIMS}")
        bad = [n for n in names if not _MESH_NAME.fullmatch(n)]
        if bad:
            raise TopologyError(f"mesh {text!r}: dim name {bad[0][:80]!r} is not a name of at most 64 characters "
                                "(letters, digits, _; not starting with a digit)")
        if any(s < 1 for _, s in pairs):
            raise TopologyError(f"mesh {text!r}: every size must be >= 1")
        big = [(n, s) for n, s in pairs if s > MAX_WORLD]
        if big:
            raise TopologyError(f"mesh {text!r}: {big[0][0]}={big[0][1]} exceeds the format's maximum of "
                                f"{MAX_WORLD} (2^24) ranks")
        world = math.prod(s for _, s in pairs)
        if world > MAX_WORLD:
            raise TopologyError(f"mesh {text!r}: world size {world} exceeds the format's maximum of "
                                f"{MAX_WORLD} (2^24) ranks")
        return cls(tuple(pairs))

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self.dims)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(s for _, s in self.dims)

    @property
    def world_size(self) -> int:
        return math.prod(self.shape)

    def size(self, name: str) -> int:
        for n, s in self.dims:
            if n == name:
                return s
        raise TopologyError(f"mesh {self} has no dim {name!r}")

    def coords(self, rank: int) -> dict[str, int]:
        """Return the rank's coordinate on every named dim (row-major, last dim fastest)."""
        if not 0 <= rank < self.world_size:
            raise TopologyError(f"rank {rank} is outside a mesh of {self.world_size} ranks")
        out = {}
        for name, size in reversed(self.dims):
            out[name] = rank % size
            rank //= size
        return {n: out[n] for n in self.names}

    def rank_of(self, coords: Mapping[str, int]) -> int:
        r = 0
        for name, size in self.dims:
            r = r * size + coords[name]
        return r

    def __str__(self) -> str:
        return ",".join(f"{n}={s}" for n, s in self.dims)


@dataclass(frozen=True, slots=True)
class Shard:
    dim: int

    def to_json(self) -> list:
        return ["shard", self.dim]


@dataclass(frozen=True, slots=True)
class StridedShard:
    dim: int
    split_factor: int

    def to_json(self) -> list:
        return ["strided_shard", self.dim, self.split_factor]


@dataclass(frozen=True, slots=True)
class Replicate:
    def to_json(self) -> list:
        return ["replicate"]


@dataclass(frozen=True, slots=True)
class Flat:
    """The tensor's row-major elements (of what the entries before leave the rank: one box)
    sit at ``[offset, offset + numel)`` of a flat buffer cut into pieces of ``part`` elements
    over the mesh dim; the rank at coordinate ``c`` holds piece ``c`` (ZeRO-3: offset 0, part
    ceil(numel / k); ZeRO-1/2, FSDP1: the tensor's offset in its group buffer, the partition
    size). Its boxes are the run cut by ``layout.flat`` (spec section 4.3)."""

    offset: int
    part: int

    def to_json(self) -> list:
        return ["flat", self.offset, self.part]

    def run(self, numel: int, coord: int) -> tuple[int, int]:
        """The elements ``[lo, hi)`` (of ``numel``) the rank at ``coord`` holds (lo == hi: none)."""
        lo = max(0, coord * self.part - self.offset)
        hi = min(numel, (coord + 1) * self.part - self.offset)
        return (lo, hi) if lo < hi else (0, 0)


PlacementKind = Shard | StridedShard | Replicate | Flat


def _is_index(v, lo: int) -> bool:
    """``v`` is an integer >= ``lo``; JSON's true/false are not integers here."""
    return isinstance(v, int) and not isinstance(v, bool) and v >= lo


def placement_from_json(v) -> PlacementKind:
    if v == ["replicate"]:
        return Replicate()
    if isinstance(v, list) and len(v) == 2 and v[0] == "shard" and _is_index(v[1], 0):
        return Shard(v[1])
    if isinstance(v, list) and len(v) == 3 and v[0] == "strided_shard" and _is_index(v[1], 0) and _is_index(v[2], 1):
        return StridedShard(v[1], v[2])
    if isinstance(v, list) and len(v) == 3 and v[0] == "flat" and _is_index(v[1], 0) and _is_index(v[2], 1):
        return Flat(v[1], v[2])
    raise TopologyError(f"unknown placement {v!r}")


@dataclass(frozen=True, slots=True)
class Layout:
    """How one tensor is laid out: a placement per named mesh dim, and its PP stage."""

    mesh_dims: tuple[str, ...]
    placements: tuple[PlacementKind, ...]
    stage: int | None = None
    stage_dim: str = "pp"

    def __post_init__(self) -> None:
        if len(self.mesh_dims) != len(self.placements):
            raise TopologyError(f"layout names {len(self.mesh_dims)} mesh dims but has "
                                f"{len(self.placements)} placements")

    @property
    def flat(self) -> tuple[str, Flat] | None:
        """(mesh dim, entry) of the layout's ``Flat`` entry, if it has one."""
        for name, p in zip(self.mesh_dims, self.placements):
            if isinstance(p, Flat):
                return name, p
        return None

    def to_json(self) -> dict:
        return {"mesh_dims": list(self.mesh_dims), "placements": [p.to_json() for p in self.placements],
                "stage": self.stage}


def replicated() -> Layout:
    return Layout((), ())


def chunk_range(n: int, k: int, i: int) -> tuple[int, int]:
    """Return chunk ``i`` of ``k`` of ``[0, n)`` with torch.chunk semantics (may be empty)."""
    if n == 0:
        return 0, 0
    cs = -(-n // k)
    lo = min(i * cs, n)
    return lo, min(lo + cs, n)


Intervals = tuple[tuple[int, int], ...]


def _take(intervals: Intervals, lo: int, hi: int) -> Intervals:
    """Return the sub-intervals at positions ``[lo, hi)`` of the concatenation of ``intervals``."""
    out = []
    pos = 0
    for a, b in intervals:
        n = b - a
        s, e = max(lo, pos), min(hi, pos + n)
        if s < e:
            out.append((a + s - pos, a + e - pos))
        pos += n
        if pos >= hi:
            break
    return tuple(out)


def _length(intervals: Intervals) -> int:
    return sum(b - a for a, b in intervals)


def held_intervals(global_shape: Sequence[int], layout: Layout, coords: Mapping[str, int],
                   mesh_sizes: Mapping[str, int]) -> tuple[Intervals, ...] | None:
    """Return per tensor dim the global intervals a rank at ``coords`` holds, in local order.

    None when the rank does not hold the tensor at all (another PP stage).
    """
    if layout.stage is not None and coords.get(layout.stage_dim, 0) != layout.stage:
        return None
    held = [((0, int(n)),) for n in global_shape]
    for name, p in zip(layout.mesh_dims, layout.placements):
        if isinstance(p, (Replicate, Flat)):
            continue  # a flat entry acts on the box the others leave (``_flat_boxes``)
        if name not in mesh_sizes:
            raise TopologyError(f"layout uses mesh dim {name!r}, mesh has {sorted(mesh_sizes)}")
        if p.dim >= len(global_shape):
            raise TopologyError(f"placement shards dim {p.dim} of a {len(global_shape)}-d tensor")
        held[p.dim] = narrow(held[p.dim], p, size=mesh_sizes[name], coord=coords[name])
    return tuple(held)


def narrow(intervals: Intervals, placement: Shard | StridedShard, *, size: int, coord: int) -> Intervals:
    """Return the part of one tensor dim's held ``intervals`` that a rank at ``coord`` of a mesh
    dim of ``size`` keeps under ``placement`` (one step of spec section 4.3, rule 3)."""
    n = _length(intervals)
    if isinstance(placement, Shard):
        lo, hi = chunk_range(n, size, coord)
        return _take(intervals, lo, hi)
    pieces: list[tuple[int, int]] = []
    for j in range(placement.split_factor):
        a, b = chunk_range(n, placement.split_factor, j)
        lo, hi = chunk_range(b - a, size, coord)
        pieces.extend(_take(intervals, a + lo, a + hi))
    return tuple(pieces)


@dataclass(frozen=True, slots=True)
class HeldBox:
    """A global box a rank holds and where it sits in the rank's local tensor (a flat layout:
    ``local_offsets`` is its one start in the rank's 1-D local buffer)."""

    box: Box
    local_offsets: tuple[int, ...]


def held_boxes(global_shape: Sequence[int], layout: Layout, coords: Mapping[str, int],
               mesh_sizes: Mapping[str, int]) -> list[HeldBox]:
    """Return the boxes a rank holds (the product of its per-dim intervals)."""
    key = (tuple(global_shape), layout, tuple(coords.items()), tuple(mesh_sizes.items()))
    try:
        hash(key)
    except TypeError:
        return list(_held_boxes(*key))
    return list(_held_boxes_cached(*key))


def _held_boxes(global_shape: tuple[int, ...], layout: Layout, coords: tuple, mesh_sizes: tuple) -> tuple[HeldBox, ...]:
    held = held_intervals(global_shape, layout, dict(coords), dict(mesh_sizes))
    if held is None:
        return ()
    if layout.flat is not None:
        return _flat_boxes(global_shape, layout.flat, held, dict(coords), dict(mesh_sizes))
    if len(global_shape) == 0:
        return (HeldBox(Box((), ()), ()),)
    per_dim: list[list[tuple[int, int, int]]] = []  # (global lo, length, local lo)
    for intervals in held:
        pos = 0
        row = []
        for a, b in intervals:
            row.append((a, b - a, pos))
            pos += b - a
        if not row:
            row.append((0, 0, 0))
        per_dim.append(row)
    out = []
    for combo in _product(per_dim):
        out.append(HeldBox(Box(tuple(c[0] for c in combo), tuple(c[1] for c in combo)),
                           tuple(c[2] for c in combo)))
    return tuple(out)


def _flat_boxes(global_shape: tuple[int, ...], flat: tuple[str, Flat], held: tuple[Intervals, ...],
                coords: Mapping[str, int], mesh_sizes: Mapping[str, int]) -> tuple[HeldBox, ...]:
    """The boxes of a flat layout: the run of the one box the other entries leave, cut in order."""
    name, entry = flat
    if name not in mesh_sizes:
        raise TopologyError(f"layout uses mesh dim {name!r}, mesh has {sorted(mesh_sizes)}")
    if not global_shape:
        raise TopologyError("a 0-d tensor cannot have a flat placement")
    if any(len(iv) > 1 for iv in held):
        raise TopologyError("a flat placement needs the entries before it to leave each rank one box")
    offsets = tuple(iv[0][0] if iv else 0 for iv in held)
    lengths = tuple(iv[0][1] - iv[0][0] if iv else 0 for iv in held)
    lo, hi = entry.run(math.prod(lengths), coords[name])
    pieces = flat_boxes(lengths, lo, hi)
    if not pieces:
        return (HeldBox(Box(tuple(0 for _ in lengths), tuple(0 for _ in lengths)), (0,)),)
    return tuple(HeldBox(Box(tuple(o + a for o, a in zip(offsets, fb.box.offsets)), fb.box.lengths), (fb.start - lo,))
                 for fb in pieces)


# Thousands of tensors share a few (shape, layout) pairs: each is worked out once.
_held_boxes_cached = functools.lru_cache(maxsize=4096)(_held_boxes)


def local_shape(global_shape: Sequence[int], layout: Layout, coords: Mapping[str, int],
                mesh_sizes: Mapping[str, int]) -> tuple[int, ...] | None:
    held = held_intervals(global_shape, layout, coords, mesh_sizes)
    return None if held is None else tuple(_length(h) for h in held)


def _product(rows: list[list]) -> Iterator[tuple]:
    if not rows:
        yield ()
        return
    for head in rows[0]:
        for tail in _product(rows[1:]):
            yield (head,) + tail


_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def default_stage(fqn: str, num_layers: int, pp: int) -> int | None:
    """Stage owning ``...layers.<i>....`` when ``num_layers`` layers split evenly-ish over ``pp``
    stages in contiguous blocks (torch.chunk semantics); None for tensors outside the layers."""
    m = _LAYER_RE.search(fqn)
    if m is None:
        return None
    i = int(m.group(1))
    if not 0 <= i < num_layers:
        raise TopologyError(f"{fqn}: layer {i} is outside {num_layers} layers")
    for s in range(pp):
        lo, hi = chunk_range(num_layers, pp, s)
        if lo <= i < hi:
            return s
    raise TopologyError(f"{fqn}: no stage holds layer {i}")


def layout_from_record(rec) -> Layout | None:
    """Return the Layout a manifest ``Placement`` record describes (None: none recorded)."""
    if rec is None:
        return None
    return Layout(tuple(rec.mesh_dims), tuple(placement_from_json(list(p)) for p in rec.placements),
                  stage=rec.stage)


def count_layers(fqns) -> int:
    """Return 1 + the highest ``layers.<i>`` index among ``fqns`` (0 when none)."""
    top = -1
    for f in fqns:
        m = _LAYER_RE.search(f)
        if m:
            top = max(top, int(m.group(1)))
    return top + 1


def retarget(fqn: str, saved: Layout | None, mesh: Mesh, *, num_layers: int) -> Layout:
    """Lay a tensor out on a new mesh the way it was laid out before.

    Placements over mesh dims the new mesh also has are kept (their sizes change); those
    over dims it lacks are dropped (the tensor is whole along them); a pipeline stage is
    re-derived from ``layers.<i>`` naming when the new mesh has ``pp``.
    """
    names = set(mesh.names)
    dims: list[str] = []
    places: list[PlacementKind] = []
    if saved is not None:
        for name, p in zip(saved.mesh_dims, saved.placements):
            if name in names and not isinstance(p, Replicate):
                dims.append(name)
                places.append(Shard(0) if isinstance(p, Flat) else p)  # a flat part sized for the old mesh
    stage = None
    if "pp" in names and num_layers:
        stage = default_stage(fqn, num_layers, mesh.size("pp"))
        if stage is None and saved is not None and saved.stage is not None:
            stage = min(saved.stage, mesh.size("pp") - 1)
    return Layout(tuple(dims), tuple(places), stage=stage)
