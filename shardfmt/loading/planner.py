"""The load planner: target slices x saved shards -> coalesced ranged reads. Pure, no I/O.

``plan_load(manifest, targets)`` takes each target (a tensor name and the box of it the
caller wants, in global coordinates), finds the saved shards that overlap it with a sort
and a sweep per tensor (no all-pairs loop), turns every overlap into byte spans inside the
shard's row-major data (``geometry.box_spans``), and groups spans per file into physical
reads: adjacent spans merge when the gap is at most ``max_gap``; a read never grows past
``max_read`` bytes by merging. With ``verify=True`` each read is rounded out to whole hash
chunks so every chunk it touches can be checked; where the next read would start inside the
last chunk of the previous one, the previous one ends at that chunk's start instead (copies
straddling it are split with ``geometry.split_block``), so no chunk is read twice; unverified
reads are cut the same way at the next copy's first byte. Where a file's chunks lie is its
``hashing.ChunkGrid`` (``FileRecord.grid``): fixed-size from byte 0 (v1) or cut from each
tensor entry's start (v2), so a verified read of one shard never reaches into its neighbour.

A file's spans come in two kinds: those that land in place (a contiguous run into a
contiguous region) and those gathered through a bounce buffer (strided, cast or device
targets), whose reads are kept to ``max_bounce_read`` bytes. The bounced reads are grouped
first; the in-place spans are then cut at their edges: what lies inside a bounced read is
copied out of its buffer (the bytes, or the hash chunk, it shares with the bounced read are
not read again), the rest is grouped between the bounced reads. So no byte of a file is read
twice in one plan, and only bytes a bounced read holds anyway are copied. The one exception:
a copy cannot be cut inside an element, so where a chunk boundary falls inside one (a tensor
not aligned to its element size, in a file from another writer) that chunk is read twice.

The result names, for every copy, the source bytes (``src_start``/``src_end`` in the
file, with the source box's ``src_lengths`` and row-major ``src_strides``) and where they
land (``dst_offsets`` inside the target box).
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from shardfmt.errors import ManifestError, PlanError, ShapeError
from shardfmt.format import refs
from shardfmt.format.hashing import ChunkGrid
from shardfmt.format.manifest import FileRecord, Manifest, ShardRecord
from shardfmt.layout.geometry import (
    Box,
    ByteRange,
    block_end,
    box_spans,
    intersect,
    is_run,
    row_major_strides,
    split_block,
)
from shardfmt.layout.tiling import tiling_problems
from shardfmt.loading.options import DEFAULT_MAX_BOUNCE_READ, DEFAULT_MAX_GAP, DEFAULT_MAX_READ


@dataclass(frozen=True, slots=True, kw_only=True)
class TargetSlice:
    """The source end of a read target: the caller wants ``box`` (global coordinates) of the
    checkpoint's tensor ``fqn``; ``index`` names the destination (``targets.ReadTarget``)."""

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
    """Every read a rank issues, per file in offset order, and the bytes it actually needs;
    with what the executor checks them against (the files' records and where their chunks lie)."""

    reads: tuple[PhysicalRead, ...]
    needed_bytes: int
    verify: bool
    shards: tuple[tuple[str, ShardRecord], ...] = ()  # (fqn, shard) of every shard read from
    files: Mapping[str, FileRecord] = field(default_factory=dict)  # every file read from
    grids: Mapping[str, ChunkGrid] = field(default_factory=dict)  # the chunk grid of every file read from

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


class ShardIndex:
    """Shards (anything with offsets and lengths) of one tensor sorted by their dim-0 start, for sweep lookups."""

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
) -> LoadPlan:
    """Return the reads and copies that fill every target from the manifest's shards.

    Targets whose index is in ``bounce`` will be filled through a bounce buffer (strided,
    cast or device targets), and so are strided pieces of any target: their reads are kept
    to ``max_bounce_read`` bytes so the buffers stay small; the others land in place and
    may use ``max_read``. (``LoadOptions`` owns the defaults; ``targets.plan_reads`` plans
    a load's ``ReadTarget``s with them.)

    No byte of a file is read twice in one plan (``_file_reads``): where an in-place copy
    shares bytes, or a hash chunk, with a bounced read, that part of it is copied out of
    the bounced read's buffer instead of being read again. The one exception is a chunk
    boundary inside an element (a tensor not aligned to its element size, in a file from
    another writer): a copy cannot be split there, and the chunk is read by both reads.
    """
    max_bounce_read = min(max_bounce_read, max_read)
    indexes: dict[str, ShardIndex] = {}
    per_file: dict[tuple[str, bool], list[CopyItem]] = {}
    used: dict[tuple[str, str], tuple[str, ShardRecord]] = {}
    needed = 0
    for t in targets:
        rec = _checked_record(manifest, t)
        if t.box.is_empty():
            continue
        idx = indexes.get(t.fqn)
        if idx is None:
            idx = indexes[t.fqn] = ShardIndex(rec.shards)
        hits = idx.overlapping(t.box)
        problems = tiling_problems([inter for _, inter in hits], t.box, limit=1)
        if problems:
            raise PlanError(f"tensor {t.fqn!r}: the saved shards do not cover the requested slice "
                            f"{list(t.box.offsets)}+{list(t.box.lengths)} exactly ({problems[0]})")
        needed += t.box.numel * rec.itemsize
        for shard, inter in hits:
            used[(shard.file, shard.key)] = (t.fqn, shard)
            local = inter.relative_to(Box(shard.offsets, shard.lengths))
            # strided pieces (a column slice of the shard, or landing in a column slice of the
            # target) are gathered through a buffer too: keep those reads small
            is_bounce = (t.index in bounce or not is_run(shard.lengths, local)
                         or not is_run(t.box.lengths, inter.relative_to(t.box)))
            per_file.setdefault((shard.file, is_bounce), []).extend(_copies(
                t, shard, local, rec.itemsize, max_gap=max_gap, max_span=max_bounce_read if is_bounce else max_read))
    reads: list[PhysicalRead] = []
    names = sorted({f for f, _ in per_file})
    grids = {f: manifest.files[f].grid(manifest.chunk_size) for f in names}
    for fname in names:
        try:
            # A base's file (an incremental checkpoint's, spec section 4.10) holds shards this
            # checkpoint replaced: a read never spans one (its shards are packed, so no gap is lost).
            gap = 0 if refs.split(fname)[0] is not None else max_gap
            reads.extend(_file_reads(fname, per_file.get((fname, False), []), per_file.get((fname, True), []),
                                     grids[fname], verify=verify, max_gap=gap, max_read=max_read,
                                     max_bounce_read=max_bounce_read))
        except ManifestError as e:  # the shard records and the file's chunk grid disagree
            raise ManifestError(f"{fname}: {e}") from None
    return LoadPlan(reads=tuple(reads), needed_bytes=needed, verify=verify,
                    shards=tuple(used[k] for k in sorted(used)),
                    files={f: manifest.files[f] for f in names}, grids=grids)


def _checked_record(manifest: Manifest, t: TargetSlice):
    """The record of ``t``'s tensor, which must be stored (no alias or view) and hold ``t.box``."""
    try:
        rec = manifest.tensor(t.fqn)
    except KeyError:
        raise PlanError(f"tensor {t.fqn!r} is not in the checkpoint") from None
    if rec.alias_of is not None or rec.view is not None:
        raise PlanError(f"tensor {t.fqn!r} is an alias/view; resolve it before planning")
    if t.box.ndim != len(rec.shape) or not Box.full(rec.shape).contains(t.box):
        raise ShapeError(f"tensor {t.fqn!r}: requested slice {list(t.box.offsets)}+{list(t.box.lengths)} "
                         f"is outside its shape {list(rec.shape)}")
    return rec


def _copies(t: TargetSlice, shard: ShardRecord, local: Box, isz: int, *, max_gap: int,
            max_span: int) -> list[CopyItem]:
    """The copies that move ``local`` (a box of ``shard``) into its place in target ``t``."""
    strides = row_major_strides(shard.lengths)
    base = shard.byte_range[0]
    return [CopyItem(
        target=t.index,
        src_start=base + span.start,
        src_end=base + span.end,
        src_lengths=span.box.lengths,
        src_strides=strides,
        dst_offsets=tuple(shard.offsets[d] + span.box.offsets[d] - t.box.offsets[d] for d in range(t.box.ndim)),
        itemsize=isz,
    ) for span in box_spans(shard.lengths, local, isz, max_gap=max_gap, max_span=max_span)]


def _file_reads(fname: str, straight: list[CopyItem], bounced: list[CopyItem], grid: ChunkGrid, *,
                verify: bool, max_gap: int, max_read: int, max_bounce_read: int) -> list[PhysicalRead]:
    """The reads of one file, in offset order, no two of them reading the same byte.

    The bounced copies are grouped first (reads of at most ``max_bounce_read``). Each in-place
    copy is then cut at those reads' edges (``_cut_items``): a part inside a bounced read
    joins it (copied out of its buffer; the read does not grow), the parts between bounced
    reads are grouped gap by gap, so an in-place read never spans a bounced one. Verified
    bounced reads start and end on chunk boundaries, so the in-place reads' rounding to whole
    chunks stays between them too.
    """
    shared = sorted(_group(fname, bounced, grid, verify=verify, max_gap=max_gap, max_read=max_bounce_read),
                    key=lambda r: r.byte_range.start)
    starts = [r.byte_range.start for r in shared]
    joined: list[list[CopyItem]] = [list(r.items) for r in shared]
    free: list[CopyItem] = []  # in-place pieces outside every bounced read
    for it in straight:
        rest = [it]
        k = max(bisect.bisect_right(starts, it.src_start) - 1, 0)
        while rest and k < len(shared) and starts[k] < max(p.src_end for p in rest):
            r = shared[k].byte_range
            before = _cut_items(rest, r.start)
            inside = _cut_items(before[1], r.end) if before is not None else None
            if inside is None:  # the edge falls inside an element (an unaligned tensor): read it twice
                break
            free.extend(before[0])
            joined[k].extend(inside[0])
            rest = inside[1]
            k += 1
        free.extend(rest)
    between: list[list[CopyItem]] = [[] for _ in range(len(shared) + 1)]  # [k]: the pieces before shared[k]
    for piece in free:
        between[bisect.bisect_right(starts, piece.src_start)].append(piece)
    out = [PhysicalRead(file=fname, byte_range=r.byte_range,
                        items=tuple(sorted(items, key=lambda i: (i.src_start, i.src_end))))
           for r, items in zip(shared, joined)]
    for items in between:
        out.extend(_group(fname, items, grid, verify=verify, max_gap=max_gap, max_read=max_read))
    out.sort(key=lambda r: (r.byte_range.start, r.byte_range.end))
    return out


def _group(fname: str, items: list[CopyItem], grid: ChunkGrid, *, verify: bool,
           max_gap: int, max_read: int) -> list[PhysicalRead]:
    """Group copies (of one kind) into reads of at most ``max_read`` bytes, merging across gaps
    of at most ``max_gap``; verified reads are whole chunks of ``grid``, no chunk in two reads."""
    widen = grid.widen
    floor = grid.floor if verify else (lambda pos: pos)  # where reads may be cut: chunk starts when verified

    def outer(i: CopyItem) -> tuple[int, int]:
        if not verify:
            return i.src_start, i.src_end
        return widen(i.src_start, i.src_end)

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
        if cur and s < cur_end:
            # ``it`` shares bytes (verified: a hash chunk) with the read being closed. Cut there
            # instead, so no byte is read (and hashed) twice: end the read at the chunk before
            # ``it`` (what lies past it moves to the next read), or, when ``it`` starts in the
            # read's first chunk, keep the part of ``it`` inside the read and carry the rest.
            cut = floor(it.src_start)
            if cut > cur_start:
                kept = _cut_items(cur, cut)
                if kept is not None:
                    cur, carried = kept
                    close(upto=max(outer(i)[1] for i in cur))
                    cur, nxt = [], carried + [it]
            else:
                carried = _carry_past(items, k, cur, cur_end)
                if carried is None:  # all of ``it`` lies inside the read
                    continue
                nxt, k = carried
        if cur:
            close()
        cur = nxt
        bounds = [outer(i) for i in cur]
        cur_start = min(b[0] for b in bounds)
        cur_end = max(b[1] for b in bounds)
    if cur:
        close()
    return out


def _carry_past(items: list[CopyItem], k: int, cur: list[CopyItem], end: int) -> tuple[list[CopyItem], int] | None:
    """Cut ``items[k - 1]`` at ``end``, the end of the read ``cur`` is becoming: its part before
    ``end`` joins ``cur``. Return None when all of it lies before ``end``; else the parts to carry
    to the next read and the index of the next copy to group. The copies after it that start
    before ``end`` are cut there too, so every copy carried starts at or after the next read's
    start; one whose element ``end`` falls inside is carried whole (the next read then starts in
    its chunk, which is read twice), never left behind to start before the read it joins."""
    it = items[k - 1]
    parts = _cut_items([it], end)
    if parts is None:
        return [it], k
    head, nxt = parts
    cur.extend(head)
    if not nxt:
        return None
    while k < len(items) and items[k].src_start < end:
        more = _cut_items([items[k]], end)
        if more is None:  # ``end`` falls inside one of its elements: it goes whole to the next read,
            nxt.append(items[k])  # which then starts before ``end`` (that chunk is read twice)
        else:
            cur.extend(more[0])
            nxt.extend(more[1])
        k += 1
    return nxt, k


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
