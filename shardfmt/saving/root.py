"""v2: the root manifest's tensor records, from what a save placed and listed (pure).

A placed tensor is recorded by its placement and writer offset alone; a listed one by its
boxes, each with the rank that wrote it, which must tile its shape (spec section 10, checked
here in time linear in the boxes). Every record of a tensor agrees on dtype and shape.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Mapping

from shardfmt.errors import CommitError, ShapeError
from shardfmt.format.manifest import ListedShard, Placed, Placement, TensorRecord, Topology
from shardfmt.layout.geometry import Box
from shardfmt.layout.placed import placed_plan, plan_writes
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


class PlacedCheck:
    """The check of one placed tensor's boxes that this process wrote, one file at a time, in
    memory that does not grow with the boxes (spec section 4.3): each box must be one its rank
    writes (``add``, as each file closes); at the end (``finish``) the boxes must be the
    writer rule's, each once: the elements sum to the tensor's, and so does a sum of the
    boxes' hashes (a box written twice in place of another of its size changes it)."""

    def __init__(self, fqn: str, placed: tuple[str, tuple[int, ...], Placed], topology: Topology) -> None:
        dtype, shape, p = placed
        self.fqn, self.dtype, self.shape, self.writer = fqn, dtype, tuple(shape), p.writer
        self.plan = placed_plan(self.shape, layout_from_record(p.placement), topology.mesh)
        self.elements = 0
        self.hashes = 0

    def add(self, rank: int, boxes: Iterable[Box]) -> None:
        """Count ``boxes`` (one file's, written by ``rank``); refuse one the rule does not give ``rank``."""
        derived = {hb.box for hb in plan_writes(self.plan, writer=self.writer, rank=rank)}
        for box in boxes:
            if box not in derived:
                raise CommitError(f"tensor {self.fqn!r}: rank {rank} wrote the box {list(box.offsets)}+"
                                  f"{list(box.lengths)}, which its placement does not have it write")
            self.elements += box.numel
            self.hashes = (self.hashes + _box_hash(box)) & _MASK

    def finish(self, written: tuple[str, tuple[int, ...]]) -> None:
        """Refuse the tensor unless its boxes (``written``: their dtype and shape) are the rule's, each once."""
        if written != (self.dtype, self.shape):
            raise CommitError(f"tensor {self.fqn!r}: placed as {self.dtype} {list(self.shape)}, written as "
                              f"{written[0]} {list(written[1])}")
        numel = math.prod(self.shape)
        if self.elements != numel:
            raise CommitError(f"tensor {self.fqn!r}: its writers wrote {self.elements} of its {numel} elements")
        if self.hashes != _rule_hashes(self.plan):
            raise CommitError(f"tensor {self.fqn!r}: a box was written twice and another of its size not at all")


_MASK = (1 << 64) - 1


def _box_hash(box: Box) -> int:
    return hash((box.offsets, box.lengths)) & _MASK  # ints only: the same in every process


@functools.lru_cache(maxsize=256)
def _rule_hashes(plan) -> int:
    """The sum of the hashes of every box the rule has written: one writer per replica group,
    so member 0 of every group (the boxes do not depend on which member writes)."""
    total = 0
    for rank in range(plan.mesh.world_size):
        for hb in plan_writes(plan, writer=0, rank=rank):
            total = (total + _box_hash(hb.box)) & _MASK
    return total


def merge_records(*tables: Mapping[str, TensorRecord]) -> dict[str, TensorRecord]:
    """One table from several (placed and listed), sorted by name; a name in two is an error."""
    out: dict[str, TensorRecord] = {}
    for table in tables:
        for fqn, rec in table.items():
            if fqn in out:
                raise ShapeError(f"tensor {fqn!r}: recorded both by placement and by listed boxes")
            out[fqn] = rec
    return dict(sorted(out.items()))
