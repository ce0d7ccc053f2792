"""The load planner: target slices x saved shards -> coalesced ranged reads. Pure, no I/O.

``plan_load(manifest, targets)`` takes each target (a tensor name and the box of it the
caller wants, in global coordinates), finds the saved shards that overlap it with a sort
and a sweep per tensor (no all-pairs loop), turns every overlap into byte spans inside the
shard's row-major data (``geometry.box_spans``), and groups spans per file into physical
reads: adjacent spans merge when the gap is at most ``max_gap``; a read never grows past
``max_read`` bytes by merging. With ``verify=True`` each read is rounded out to whole hash
chunks so every chunk it touches can be checked; where the next read would start inside the
last chunk of the previous one, the previous one ends at that chunk's start instead (copies
straddling it are split with ``geometry.split_block``), so no chunk is read twice.

The result names, for every copy, the source bytes (``src_start``/``src_end`` in the
file, with the source box's ``src_lengths`` and row-major ``src_strides``) and where they
land (``dst_offsets`` inside the target box).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

from shardfmt.errors import PlanError, ShapeError
from shardfmt.hashing import chunk_span
from shardfmt.manifest import Manifest, ShardRecord

from .geometry import (
    Box,
    ByteRange,
    block_end,
    box_spans,
    intersect,
    is_run,
    row_major_strides,
    split_block,
)
from .tiling import tiling_problems

DEFAULT_MAX_GAP = 1 << 20  # local disk: reading 1 MiB of gap beats a second request
DEFAULT_MAX_READ = 64 << 20
DEFAULT_MAX_BOUNCE_READ = 8 << 20  # reads through a bounce buffer: bounds its memory (x workers)


@dataclass(frozen=True, slots=True, kw_only=True)
class TargetSlice:
    """The caller wants ``box`` (global coordinates) of tensor ``fqn``; ``index`` names its buffer."""

    index: int
    fqn: str
    box: Box


@dataclass(frozen=True, slots=True, kw_only=True)
class CopyItem:
    """Copy the source box at file bytes ``[src_start, src_end)`` into ``dst_offsets`` of target ``target``."""

    target: int
    src_start: int
    src_end: int
    src_lengths: tuple[int, ...]
    src_strides: tuple[int, ...]
    dst_offsets: tuple[int, ...]
    itemsize: int

    @property
    def numel(self) -> int:
        n = 1
        for x in self.src_lengths:
            n *= x
        return n


@dataclass(frozen=True, slots=True, kw_only=True)
class PhysicalRead:
    """One ranged read of ``file`` and the copies it feeds."""

    file: str
    byte_range: ByteRange
    items: tuple[CopyItem, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadPlan:
    """Every read a rank issues, per file in offset order, and the bytes it actually needs."""

    reads: tuple[PhysicalRead, ...]
    needed_bytes: int
    verify: bool
    shards: tuple[tuple[str, ShardRecord], ...] = ()  # (fqn, shard) of every shard read from

    @property
    def bytes_to_read(self) -> int:
        return sum(r.byte_range.length for r in self.reads)

    def describe(self) -> list[dict]:
        """Return a JSON-able description: which file bytes feed which target slice."""
        out = []
        for r in self.reads:
            out.append({
                "file": r.file,
                "byte_range": [r.byte_range.start, r.byte_range.end],
                "copies": [{"target": i.target, "src_bytes": [i.src_start, i.src_end],
                            "dst_offsets": list(i.dst_offsets), "lengths": list(i.src_lengths)}
                           for i in r.items],
            })
        return out


class _ShardIndex:
    """Shards of one tensor sorted by their dim-0 start, for sweep lookups."""

    __slots__ = ("shards", "starts", "max_len0")

    def __init__(self, shards: Sequence[ShardRecord]) -> None:
        self.shards = sorted(shards, key=lambda s: s.offsets[:1])
        self.starts = [s.offsets[0] if s.offsets else 0 for s in self.shards]
        self.max_len0 = max((s.lengths[0] if s.lengths else 1 for s in self.shards), default=0)

    def overlapping(self, box: Box) -> list[tuple[ShardRecord, Box]]:
        if box.ndim == 0:
            return [(s, Box((), ())) for s in self.shards]
        lo = bisect.bisect_right(self.starts, box.offsets[0] - self.max_len0)
        hi = bisect.bisect_left(self.starts, box.offsets[0] + box.lengths[0])
        out = []
        for s in self.shards[lo:hi]:
            inter = intersect(Box(s.offsets, s.lengths), box)
            if inter is not None and not inter.is_empty():
                out.append((s, inter))
        return out


def plan_load(
    manifest: Manifest,
    targets: Sequence[TargetSlice],
    *,
    verify: bool = True,
    max_gap: int = DEFAULT_MAX_GAP,
    max_read: int = DEFAULT_MAX_READ,
    bounce: frozenset[int] = frozenset(),
    max_bounce_read: int = DEFAULT_MAX_BOUNCE_READ,
    one_group_per_file: bool = False,
) -> LoadPlan:
    """Return the reads and copies that fill every target from the manifest's shards.

    Targets whose index is in ``bounce`` will be filled through a bounce buffer (strided,
    cast or device targets): their reads are kept to ``max_bounce_read`` bytes so the
    buffers stay small; the others land in place and may use ``max_read``.

    A file's bounced and in-place reads are grouped separately, so a hash chunk where the
    two meet is read by both. ``one_group_per_file`` reads every span of a file that has a
    bounced one through the bounce buffer too (spans are then cut to ``max_bounce_read``):
    each chunk is read once per plan, at the cost of a copy (offline tools that want every
    source byte read once).
    """
    max_bounce_read = min(max_bounce_read, max_read)
    indexes: dict[str, _ShardIndex] = {}
    per_file: dict[tuple[str, bool], list[CopyItem]] = {}
    used: dict[tuple[str, str], tuple[str, ShardRecord]] = {}
    needed = 0
    for t in targets:
        try:
            rec = manifest.tensor(t.fqn)
        except KeyError:
            raise PlanError(f"tensor {t.fqn!r} is not in the checkpoint") from None
        if rec.alias_of is not None or rec.view is not None:
            raise PlanError(f"tensor {t.fqn!r} is an alias/view; resolve it before planning")
        if t.box.ndim != len(rec.shape) or not Box.full(rec.shape).contains(t.box):
            raise ShapeError(f"tensor {t.fqn!r}: requested slice {list(t.box.offsets)}+{list(t.box.lengths)} "
                             f"is outside its shape {list(rec.shape)}")
        if t.box.is_empty():
            continue
        idx = indexes.get(t.fqn)
        if idx is None:
            idx = indexes[t.fqn] = _ShardIndex(rec.shards)
        hits = idx.overlapping(t.box)
        problems = tiling_problems([inter for _, inter in hits], t.box, limit=1)
        if problems:
            raise PlanError(f"tensor {t.fqn!r}: the saved shards do not cover the requested slice "
                            f"{list(t.box.offsets)}+{list(t.box.lengths)} exactly ({problems[0]})")
        isz = rec.itemsize
        needed += t.box.numel * isz
        for shard, inter in hits:
            used[(shard.file, shard.key)] = (t.fqn, shard)
            local = inter.relative_to(Box(shard.offsets, shard.lengths))
            # strided pieces (a column slice of the shard, or landing in a column slice of the
            # target) are gathered through a buffer too: keep those reads small
            is_bounce = (t.index in bounce or not is_run(shard.lengths, local)
                         or not is_run(t.box.lengths, inter.relative_to(t.box)))
            cap = max_bounce_read if is_bounce or one_group_per_file else max_read
            strides = row_major_strides(shard.lengths)
            base = shard.byte_range[0]
            items = per_file.setdefault((shard.file, is_bounce), [])
            for span in box_spans(shard.lengths, local, isz, max_gap=max_gap, max_span=cap):
                items.append(CopyItem(
                    target=t.index,
                    src_start=base + span.start,
                    src_end=base + span.end,
                    src_lengths=span.box.lengths,
                    src_strides=strides,
                    dst_offsets=tuple(shard.offsets[d] + span.box.offsets[d] - t.box.offsets[d]
                                      for d in range(t.box.ndim)),
                    itemsize=isz,
                ))
    if one_group_per_file:
        for fname, is_bounce in list(per_file):
            if is_bounce and (fname, False) in per_file:
                per_file[(fname, True)].extend(per_file.pop((fname, False)))
    reads: list[PhysicalRead] = []
    for fname, is_bounce in sorted(per_file):
        reads.extend(_group(fname, per_file[(fname, is_bounce)], manifest, verify=verify, max_gap=max_gap,
                            max_read=max_bounce_read if is_bounce else max_read))
    return LoadPlan(reads=tuple(reads), needed_bytes=needed, verify=verify,
                    shards=tuple(used[k] for k in sorted(used)))


def _group(fname: str, items: list[CopyItem], manifest: Manifest, *, verify: bool,
           max_gap: int, max_read: int) -> list[PhysicalRead]:
    size = manifest.files[fname].size
    chunk = manifest.chunk_size

    def outer(i: CopyItem) -> tuple[int, int]:
        if not verify:
            return i.src_start, i.src_end
        span = chunk_span(i.src_start, i.src_end, chunk)
        return span.start * chunk, min(span.stop * chunk, size)

    items.sort(key=lambda i: (i.src_start, i.src_end))
    out: list[PhysicalRead] = []
    cur: list[CopyItem] = []
    cur_start = cur_end = 0

    def close(upto: int | None = None) -> None:
        end = cur_end if upto is None else upto
        out.append(PhysicalRead(file=fname, byte_range=ByteRange(cur_start, end),
                                items=tuple(sorted(cur, key=lambda i: (i.src_start, i.src_end)))))

    k = 0
    while k < len(items):
        it = items[k]
        k += 1
        s, e = outer(it)
        if cur and s - cur_end <= max_gap and max(e, cur_end) - min(s, cur_start) <= max_read:
            cur.append(it)
            cur_start, cur_end = min(s, cur_start), max(cur_end, e)
            continue
        nxt: list[CopyItem] = [it]
        if cur and verify and s < cur_end:
            # ``it`` shares a hash chunk with the read being closed. Cut at a chunk boundary
            # instead, so no chunk is read (and hashed) twice: end the read at the chunk before
            # ``it`` (what lies past it moves to the next read), or, when ``it`` starts in the
            # read's first chunk, keep the part of ``it`` inside the read and carry the rest.
            cut = (it.src_start // chunk) * chunk
            if cut > cur_start:
                kept = _cut_items(cur, cut)
                if kept is not None:
                    cur, carried = kept
                    close(upto=cut)
                    cur, nxt = [], carried + [it]
            else:
                parts = _cut_items([it], cur_end)
                if parts is not None:
                    head, nxt = parts
                    cur.extend(head)
                    if not nxt:  # all of ``it`` lies inside the read
                        continue
                    # the copies after ``it`` that start inside the read are cut there too, so
                    # every copy left starts at or after the next read's start
                    while k < len(items) and items[k].src_start < cur_end:
                        more = _cut_items([items[k]], cur_end)
                        if more is None:
                            break
                        cur.extend(more[0])
                        nxt.extend(more[1])
                        k += 1
        if cur:
            close()
        cur = nxt
        bounds = [outer(i) for i in cur]
        cur_start = min(b[0] for b in bounds)
        cur_end = max(b[1] for b in bounds)
    if cur:
        close()
    return out


def _cut_items(items: list[CopyItem], cut: int) -> tuple[list[CopyItem], list[CopyItem]] | None:
    """Split ``items`` into copies that read only bytes before ``cut`` and copies that read only
    bytes at or after it (an item straddling ``cut`` becomes several). None when a cut falls
    inside an element (an unaligned tensor in a file from another writer)."""
    before: list[CopyItem] = []
    after: list[CopyItem] = []
    for it in items:
        if it.src_end <= cut:
            before.append(it)
            continue
        if it.src_start >= cut:
            after.append(it)
            continue
        isz = it.itemsize
        parts = split_block(it.src_lengths, it.src_strides, isz, it.src_start, cut)
        if parts is None:
            return None
        for boxes, into in zip(parts, (before, after)):
            for b in boxes:
                first = it.src_start + sum(o * st for o, st in zip(b.offsets, it.src_strides)) * isz
                into.append(CopyItem(
                    target=it.target,
                    src_start=first,
                    src_end=block_end(b.lengths, it.src_strides, isz, first),
                    src_lengths=b.lengths,
                    src_strides=it.src_strides,
                    dst_offsets=tuple(d + o for d, o in zip(it.dst_offsets, b.offsets)),
                    itemsize=isz,
                ))
    return before, after
