"""Element boxes and byte ranges: the one home of the overlap and layout math.

``Box(offsets, lengths)`` is a slice of a tensor in element coordinates (global or
local, the caller says which). ``ByteRange(start, end)`` is half-open, like safetensors'
``data_offsets``. ``box_spans`` turns a sub-box of a row-major array into the byte
spans a reader must fetch (the planner merges nearby spans into reads). Everything here is pure.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ByteRange:
    """Bytes ``[start, end)``."""

    start: int
    end: int

    def __post_init__(self) -> None:
        if self.start < 0 or self.end < self.start:
            raise ValueError(f"invalid byte range [{self.start}, {self.end})")

    @property
    def length(self) -> int:
        return self.end - self.start


@dataclass(frozen=True, slots=True)
class Box:
    """Elements ``offsets[d] <= i[d] < offsets[d] + lengths[d]`` for every dim ``d``."""

    offsets: tuple[int, ...]
    lengths: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.offsets) != len(self.lengths):
            raise ValueError(f"box rank mismatch: offsets {self.offsets}, lengths {self.lengths}")

    @classmethod
    def full(cls, shape: Sequence[int]) -> Box:
        return cls(tuple(0 for _ in shape), tuple(int(s) for s in shape))

    @property
    def ndim(self) -> int:
        return len(self.offsets)

    @property
    def numel(self) -> int:
        return math.prod(self.lengths)

    @property
    def ends(self) -> tuple[int, ...]:
        return tuple(o + n for o, n in zip(self.offsets, self.lengths))

    def is_empty(self) -> bool:
        return any(n == 0 for n in self.lengths)

    def contains(self, other: Box) -> bool:
        return all(
            so <= oo and oo + on <= so + sn
            for so, sn, oo, on in zip(self.offsets, self.lengths, other.offsets, other.lengths)
        )

    def relative_to(self, outer: Box) -> Box:
        """Return this box in the local coordinates of ``outer`` (which must contain it)."""
        return Box(tuple(a - b for a, b in zip(self.offsets, outer.offsets)), self.lengths)

    def slices(self) -> tuple[slice, ...]:
        return tuple(slice(o, o + n) for o, n in zip(self.offsets, self.lengths))


def intersect(a: Box, b: Box) -> Box | None:
    """Return the overlap of two boxes, or None when they share no element."""
    if a.ndim != b.ndim:
        raise ValueError(f"cannot intersect boxes of rank {a.ndim} and {b.ndim}")
    offsets = []
    lengths = []
    for ao, an, bo, bn in zip(a.offsets, a.lengths, b.offsets, b.lengths):
        lo = max(ao, bo)
        hi = min(ao + an, bo + bn)
        if hi <= lo:
            return None
        offsets.append(lo)
        lengths.append(hi - lo)
    return Box(tuple(offsets), tuple(lengths))


def row_major_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """Return element strides of a contiguous row-major array of ``shape``."""
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * max(int(shape[d + 1]), 1)
    return tuple(strides)


def is_run(shape: Sequence[int], sub: Box) -> bool:
    """Whether ``sub`` is one contiguous run of a row-major array of ``shape``."""
    k = next((d for d, n in enumerate(sub.lengths) if n > 1), len(sub.lengths))
    return all(sub.lengths[d] == shape[d] for d in range(k + 1, len(shape)))


@dataclass(frozen=True, slots=True)
class Span:
    """One contiguous read: bytes ``[start, end)`` of an array hold ``box`` (local coords).

    The box's first element sits at ``start``; its elements are found with the array's
    row-major strides. Bytes between them (the gaps) are read and ignored.
    """

    start: int
    end: int
    box: Box


def box_spans(
    shape: Sequence[int],
    sub: Box,
    itemsize: int,
    *,
    max_gap: int = 0,
    max_span: int | None = None,
) -> Iterator[Span]:
    """Yield the byte spans that cover ``sub`` inside a row-major array of ``shape``.

    Spans are relative to the array's first byte, in increasing order. Consecutive
    pieces of ``sub`` are read as one span when the bytes between them are at most
    ``max_gap``; a span never exceeds ``max_span`` bytes unless one element row at the
    innermost level already does (then the row is split into element-aligned pieces).
    """
    ndim = len(shape)
    if sub.is_empty() or ndim == 0:
        if ndim == 0:
            yield Span(0, itemsize, sub)
        return
    strides = row_major_strides(shape)
    cap = max_span if max_span is not None else 1 << 62
    cap = max(cap, itemsize)
    # span_len[d]: bytes from the first to the last needed element when dims >= d are
    # read as one span; mergeable[d]: whether dims >= d are read as one span.
    span_len = [0] * (ndim + 1)
    mergeable = [True] * (ndim + 1)
    span_len[ndim] = itemsize
    for d in range(ndim - 1, -1, -1):
        step = strides[d] * itemsize
        inner = span_len[d + 1]
        gap = step - inner
        mergeable[d] = mergeable[d + 1] and gap <= max_gap
        span_len[d] = (sub.lengths[d] - 1) * step + inner

    def walk(d: int, base: int, prefix: tuple[int, ...]) -> Iterator[Span]:
        step = strides[d] * itemsize
        o, n = sub.offsets[d], sub.lengths[d]
        if not mergeable[d + 1]:
            for i in range(o, o + n):
                yield from walk(d + 1, base + i * step, prefix + (i,))
            return
        tail_off = sub.offsets[d + 1:]
        tail_len = sub.lengths[d + 1:]
        tail_start = sum(t * strides[d + 1 + j] for j, t in enumerate(tail_off)) * itemsize
        inner = span_len[d + 1]
        per = max(1, (cap - inner) // step + 1) if (mergeable[d] and inner <= cap) else 1
        i = o
        while i < o + n:
            k = min(per, o + n - i)
            start = base + i * step + tail_start
            yield Span(
                start,
                start + (k - 1) * step + inner,
                Box(prefix + (i,) + tail_off, (1,) * len(prefix) + (k,) + tail_len),
            )
            i += k

    for span in walk(0, 0, ()):
        yield from _split_large(span, cap, itemsize, strides)


def _split_large(span: Span, cap: int, itemsize: int, strides: tuple[int, ...]) -> Iterator[Span]:
    """Split a span longer than ``cap`` that is a single contiguous run of its last dim."""
    if span.end - span.start <= cap:
        yield span
        return
    box = span.box
    # Find the outermost dim with length > 1; split along it.
    for d in range(box.ndim):
        if box.lengths[d] > 1:
            break
    else:
        yield span
        return
    step = strides[d] * itemsize
    rest = span.end - span.start - (box.lengths[d] - 1) * step
    per = max(1, (cap - rest) // step + 1) if rest <= cap else 1
    i = 0
    while i < box.lengths[d]:
        k = min(per, box.lengths[d] - i)
        offs = box.offsets[:d] + (box.offsets[d] + i,) + box.offsets[d + 1:]
        lens = box.lengths[:d] + (k,) + box.lengths[d + 1:]
        start = span.start + i * step
        piece = Span(start, start + (k - 1) * step + rest, Box(offs, lens))
        yield from _split_large(piece, cap, itemsize, strides)
        i += k


def block_end(lengths: Sequence[int], strides: Sequence[int], itemsize: int, start: int) -> int:
    """Return one past the last byte of a strided block whose first element sits at ``start``."""
    if any(n == 0 for n in lengths):
        return start
    return start + sum((n - 1) * s for n, s in zip(lengths, strides)) * itemsize + itemsize


def split_block(lengths: Sequence[int], strides: Sequence[int], itemsize: int, start: int,
                cut: int) -> tuple[list[Box], list[Box]] | None:
    """Split a strided block at byte ``cut``: the sub-boxes that end at or before it, and those
    that start at or after it.

    The block holds ``lengths`` elements with element ``strides`` (outer strides at least the
    inner extent, as in a row-major array); its first element sits at byte ``start``. Boxes
    are in coordinates relative to the block and together hold each element exactly once
    (at most two per dimension). None when ``cut`` falls inside an element.
    """
    before: list[Box] = []
    after: list[Box] = []
    ndim = len(lengths)
    if any(n == 0 for n in lengths):
        return before, after

    def go(offs: tuple[int, ...], lens: tuple[int, ...], first: int) -> bool:
        end = block_end(lens, strides, itemsize, first)
        if end <= cut:
            before.append(Box(offs, lens))
            return True
        if first >= cut:
            after.append(Box(offs, lens))
            return True
        d = next((k for k in range(ndim) if lens[k] > 1), None)
        if d is None:
            return False  # one element straddles the cut
        step = strides[d] * itemsize
        inner = block_end(lens[d + 1:], strides[d + 1:], itemsize, 0)  # bytes of one slab along d
        n = lens[d]
        done = min(n, max(0, (cut - first - inner) // step + 1))  # slabs ending at or before cut
        later = min(n, max(0, -(-(cut - first) // step)))  # first slab starting at or after cut

        def sub(i: int, k: int) -> tuple[tuple[int, ...], tuple[int, ...], int]:
            return (offs[:d] + (offs[d] + i,) + offs[d + 1:], lens[:d] + (k,) + lens[d + 1:], first + i * step)

        if done:
            o, ln, _ = sub(0, done)
            before.append(Box(o, ln))
        for i in range(done, later):  # at most one slab straddles the cut
            if not go(*sub(i, 1)):
                return False
        if later < n:
            o, ln, _ = sub(later, n - later)
            after.append(Box(o, ln))
        return True

    if not go((0,) * ndim, tuple(lengths), start):
        return None
    return before, after
