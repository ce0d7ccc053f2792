"""Flat ranges: a run of a tensor's elements in row-major order, as the boxes that tile it (pure).

ZeRO and FSDP1 hold parameters as slices of flat buffers: a rank owns elements ``[start,
stop)`` of a parameter's row-major flattening (ZeRO-3: ``torch.chunk`` of the flattened
parameter; ZeRO-1/2 and FSDP1: the part of the parameter inside the rank's window of a
group buffer), which is in general not a box. ``flat_boxes`` cuts such a range into at most
``2 * ndim - 1`` boxes (spec section 4.6): along dim 0, the partial row it starts in (cut
further along the next dims), the whole rows in between, the partial row it ends in. Each
box's elements are consecutive in the flattening, and the boxes come in flattening order,
so box ``i`` is the run of the range starting at element ``FlatBox.start``: a view of a
contiguous 1-D buffer of the range's elements, with no copy.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from shardfmt.errors import ShapeError
from shardfmt.layout.geometry import Box


@dataclass(frozen=True, slots=True, kw_only=True)
class FlatBox:
    """A box of the tensor whose elements are the range's elements ``[start, start + numel)``
    (``start`` counted in the tensor's flattening)."""

    start: int
    box: Box


def flat_boxes(shape: Sequence[int], start: int, stop: int) -> tuple[FlatBox, ...]:
    """The boxes that tile elements ``[start, stop)`` of ``shape``'s row-major flattening, in order
    (``stop`` is clipped to the tensor's end; an empty range has no box)."""
    shape = tuple(int(n) for n in shape)
    total = math.prod(shape)
    if start < 0:
        raise ShapeError(f"flat range [{start}, {stop}) starts before element 0")
    stop = min(stop, total)
    return tuple(FlatBox(start=s, box=Box(offsets, lengths))
                 for s, offsets, lengths in _cut(shape, start, stop, 0))


def _cut(shape: tuple[int, ...], lo: int, hi: int, base: int) -> Iterator[tuple[int, tuple, tuple]]:
    """(first element, offsets, lengths) of the boxes of ``[lo, hi)`` within ``shape`` (row-major),
    ``base`` the flat index of this sub-shape's element 0 in the whole tensor."""
    if lo >= hi:
        return
    if not shape:
        yield base, (), ()
        return
    rest = shape[1:]
    row = math.prod(rest)
    full = tuple(0 for _ in rest), rest
    i0, r0 = divmod(lo, row)
    i1, r1 = divmod(hi, row)
    if i0 == i1:  # within one row of dim 0
        for s, offs, lens in _cut(rest, r0, r1, base + i0 * row):
            yield s, (i0, *offs), (1, *lens)
        return
    if r0:  # the partial row it starts in
        for s, offs, lens in _cut(rest, r0, row, base + i0 * row):
            yield s, (i0, *offs), (1, *lens)
        i0 += 1
    if i1 > i0:  # whole rows
        yield base + i0 * row, (i0, *full[0]), (i1 - i0, *full[1])
    if r1:  # the partial row it ends in
        for s, offs, lens in _cut(rest, 0, r1, base + i1 * row):
            yield s, (i1, *offs), (1, *lens)
