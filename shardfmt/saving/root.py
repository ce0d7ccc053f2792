"""v2: the root manifest's tensor records, from what a save placed and listed (pure).

A placed tensor is recorded by its placement and writer offset alone; a listed one by its
boxes, each with the rank that wrote it, which must tile its shape (spec section 10, checked
here in time linear in the boxes). Every record of a tensor agrees on dtype and shape.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

from shardfmt.errors import CommitError, ShapeError
from shardfmt.format.manifest import ListedShard, Placed, Placement, TensorRecord, Topology
from shardfmt.layout.geometry import Box
from shardfmt.layout.placed import written_by
from shardfmt.layout.tiling import tiling_problems
from shardfmt.layout.topology import layout_from_record


def placed_record(fqn: str, dtype: str, shape: tuple[int, ...], placed: Placed) -> TensorRecord:
    return TensorRecord(dtype=dtype, shape=tuple(shape), placed=placed, placement=placed.placement)


def listed_record(fqn: str, dtype: str, shape: tuple[int, ...], placement: Placement | None,
                  shards: Iterable[ListedShard]) -> TensorRecord:
    """The record of a tensor stored by listed boxes, sorted by (offsets, rank); refuses boxes
    that do not tile the shape."""
    ordered = tuple(sorted(shards, key=lambda s: (s.offsets, s.rank)))
    problems = tiling_problems([Box(s.offsets, s.lengths) for s in ordered], Box.full(tuple(shape)))
    if problems:
        raise CommitError(f"tensor {fqn!r}: shards do not tile its shape: {problems[0]}")
    return TensorRecord(dtype=dtype, shape=tuple(shape), placement=placement, listed=ordered)


def check_placed_boxes(fqn: str, written: tuple[str, tuple[int, ...]], placed: tuple[str, tuple[int, ...], Placed],
                       topology: Topology, shards: Iterable[ListedShard]) -> None:
    """Refuse a placed tensor whose boxes this process wrote (``written``: their dtype and
    shape) unless its files hold exactly what the writer rule gives (spec section 4.3): each
    box one its rank writes, none twice, all its elements."""
    dtype, shape, p = placed
    if written != (dtype, tuple(shape)):
        raise CommitError(f"tensor {fqn!r}: placed as {dtype} {list(shape)}, written as {written[0]} {list(written[1])}")
    layout = layout_from_record(p.placement)
    derived: dict[int, set[Box]] = {}
    seen: set[Box] = set()
    for s in shards:
        box = Box(s.offsets, s.lengths)
        if s.rank not in derived:
            derived[s.rank] = {hb.box for hb in written_by(shape, layout, topology.mesh, writer=p.writer, rank=s.rank)}
        if box not in derived[s.rank] or box in seen:
            raise CommitError(f"tensor {fqn!r}: rank {s.rank} wrote the box {list(box.offsets)}+{list(box.lengths)}, "
                              "which its placement does not have it write (or another file holds it too)")
        seen.add(box)
    found = sum(b.numel for b in seen)
    if found != math.prod(shape):
        raise CommitError(f"tensor {fqn!r}: its writers wrote {found} of its {math.prod(shape)} elements")


def merge_records(*tables: Mapping[str, TensorRecord]) -> dict[str, TensorRecord]:
    """One table from several (placed and listed), sorted by name; a name in two is an error."""
    out: dict[str, TensorRecord] = {}
    for table in tables:
        for fqn, rec in table.items():
            if fqn in out:
                raise ShapeError(f"tensor {fqn!r}: recorded both by placement and by listed boxes")
            out[fqn] = rec
    return dict(sorted(out.items()))
