"""v2: find exactly the shards a load reads, reading only what describes them.

A v2 root manifest says how each tensor is laid out (a placement, or listed boxes with their
writer ranks) but not where any byte is. ``resolve`` takes the slices one rank loads and:

1. derives the saved boxes each slice overlaps and the rank that wrote each
   (``layout.placed.saved_pieces``; a sweep over listed boxes), in time proportional to them;
2. reads the rank-table parts that cover those ranks, and those ranks' indexes, each checked
   against the digest that vouches for it (root -> part -> index);
3. reads the header of each of their data files (exactly ``header_size`` bytes, checked
   against the index's ``header_digest`` when verifying) and finds each box's key by its
   ``__metadata__["shards"]`` entry, checking dtype, shape, offsets and the tensor's shape;
4. returns the root manifest with those shards and files filled in: what ``plan_load`` and
   the executor take, with each file's hash chunks aligned to its shards (spec section 7).

So the metadata a rank reads and checks follows the slices it loads, not the job's size.
``with_rank_values`` reads the one index that holds a rank's per-rank values.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from shardfmt.errors import CheckpointNotFoundError, HeaderError, IntegrityError, ManifestError
from shardfmt.format import hashing
from shardfmt.format.index import IndexedFile, RankEntry, RankIndex
from shardfmt.format.manifest import FileRecord, Manifest, ShardRecord, TensorRecord, ValueRecord
from shardfmt.format.parse_v2 import parse_rank_index, parse_rank_part
from shardfmt.format.safetensors import (
    PREFIX_BYTES,
    DecodedHeader,
    decode_header,
    decode_origins,
    header_length,
)
from shardfmt.io.store import Storage
from shardfmt.layout.geometry import Box, intersect
from shardfmt.layout.placed import saved_pieces
from shardfmt.layout.topology import layout_from_record
from shardfmt.loading.planner import ShardIndex, TargetSlice

T = TypeVar("T")
R = TypeVar("R")
Piece = tuple[int, Box]  # (writer rank, saved box)


def resolve(storage: Storage, path: str, manifest: Manifest, slices: Sequence[TargetSlice], *,
            verify: bool) -> Manifest:
    """Return ``manifest`` with the shards and files ``slices`` read (a v1 manifest as it is)."""
    if manifest.format_version < 2:
        return manifest
    wanted: dict[str, dict[Box, int]] = {}
    for s in slices:
        rec = manifest.tensor(s.fqn)
        if not rec.stored:
            continue  # the planner names the problem
        got = wanted.setdefault(s.fqn, {})
        for rank, box in pieces(manifest, rec, s.box):
            got[box] = rank
    ranks = sorted({r for boxes in wanted.values() for r in boxes.values()})
    indexes = read_indexes(storage, path, manifest, ranks)
    found = _headers(storage, path, manifest, indexes, verify=verify)
    shards: dict[str, list[ShardRecord]] = {}
    files: dict[str, FileRecord] = {}
    for fqn in sorted(wanted):
        rec = manifest.tensor(fqn)
        for box, rank in sorted(wanted[fqn].items(), key=lambda kv: kv[0].offsets):
            shard, frec = _locate(found, manifest, fqn, rec, box, rank)
            shards.setdefault(fqn, []).append(shard)
            files[shard.file] = frec
    return dataclasses.replace(
        manifest, files=dict(sorted(files.items())),
        tensors={f: _with(r, shards.get(f)) for f, r in manifest.tensors.items()},
        storages={f: _with(r, shards.get(f)) for f, r in manifest.storages.items()})


def _with(rec: TensorRecord, shards: list[ShardRecord] | None) -> TensorRecord:
    return rec if shards is None else dataclasses.replace(rec, shards=tuple(shards))


def pieces(manifest: Manifest, rec: TensorRecord, box: Box) -> list[Piece]:
    """The saved boxes of ``rec`` that overlap ``box``, each with the rank that wrote it."""
    if box.is_empty():
        return []
    if rec.placed is not None:
        layout = layout_from_record(rec.placed.placement)
        return [(p.rank, p.box) for p in saved_pieces(rec.shape, layout, manifest.topology.mesh,
                                                        writer=rec.placed.writer, box=box)]
    listed = rec.listed or ()
    if len(listed) == 1:  # one writer held it whole (plain and replicated tensors): no index to build
        (s,) = listed
        saved = Box(s.offsets, s.lengths)
        hit = intersect(saved, box)
        return [] if hit is None or hit.is_empty() else [(s.rank, saved)]
    return [(s.rank, Box(s.offsets, s.lengths)) for s, _ in ShardIndex(listed).overlapping(box)]


# ----------------------------------------------------------------------------- parts and indexes


def _fetch(storage: Storage, fn: Callable[[T], R], items: Sequence[T]) -> list[R]:
    """``fn`` over ``items``, concurrently on a remote store (each is a round trip)."""
    if storage.remote and len(items) > 1:
        with ThreadPoolExecutor(max_workers=min(len(items), storage.read_concurrency)) as ex:
            return list(ex.map(fn, items))
    return [fn(x) for x in items]


def read_vouched(storage: Storage, path: str, name: str, size: int, digest: str) -> bytes:
    """Read ``name``, which a parent document says has ``size`` bytes hashing to ``digest``."""
    try:
        raw = storage.read_bytes(storage.join(path, name), limit=size, within=path)
    except CheckpointNotFoundError:  # the checkpoint is there, damaged: not a missing checkpoint
        raise IntegrityError(f"{name}: missing; the checkpoint names it ({size} bytes hashing to {digest}), so it "
                             "was removed after the commit") from None
    got = hashing.digest_bytes(raw)
    if len(raw) != size or got != digest:
        raise IntegrityError(f"{name}: {len(raw)} bytes hashing to {got}; expected {size} bytes hashing to "
                             f"{digest} (changed after the commit)")
    return raw


def rank_entries(storage: Storage, path: str, manifest: Manifest, ranks: Iterable[int], *,
                 required: bool = True) -> dict[int, RankEntry]:
    """The rank-table entries of ``ranks``, from the parts that cover them (each read once).
    A rank without one is an error when ``required`` (it wrote data a load needs), else left out."""
    firsts = [p.first for p in manifest.ranks]
    need: dict[int, list[int]] = {}
    for r in ranks:
        need.setdefault(bisect.bisect_right(firsts, r) - 1, []).append(r)

    def part(i: int):
        p = manifest.ranks[i]
        raw = read_vouched(storage, path, p.name, p.size, p.digest)
        return parse_rank_part(raw, p, save_id=manifest.save_id, source=p.name)

    out: dict[int, RankEntry] = {}
    for i, table in zip(sorted(need), _fetch(storage, part, sorted(need))):
        for r in need[i]:
            if r not in table.ranks and not required:
                continue
            if r not in table.ranks:
                raise ManifestError(f"{manifest.ranks[i].name}: rank {r} wrote data this checkpoint uses, but has "
                                    "no index in the rank table")
            out[r] = table.ranks[r]
    return out


def read_indexes(storage: Storage, path: str, manifest: Manifest, ranks: Sequence[int], *,
                 required: bool = True) -> dict[int, RankIndex]:
    """The indexes of ``ranks``, each checked against its rank-table entry (``required``: as
    ``rank_entries``)."""
    entries = rank_entries(storage, path, manifest, ranks, required=required)
    ranks = [r for r in ranks if r in entries]

    def index(r: int) -> RankIndex:
        e = entries[r]
        raw = read_vouched(storage, path, e.name, e.size, e.digest)
        return parse_rank_index(raw, rank=r, save_id=manifest.save_id, source=e.name)

    return dict(zip(ranks, _fetch(storage, index, list(ranks))))


def with_rank_values(storage: Storage, path: str, manifest: Manifest, rank: int) -> Manifest:
    """``manifest`` with rank ``rank``'s per-rank values, read from its index (v2; a v1
    manifest, or one without per-rank values, as it is). A rank outside the saved job, or
    one without values, gets none: ``per_rank`` is then empty."""
    indexed = [f for f, v in manifest.values.items() if v.indexed]
    if not indexed:
        return manifest
    index = None
    if 0 <= rank < manifest.topology.world_size:
        index = read_indexes(storage, path, manifest, [rank], required=False).get(rank)
    got: Mapping[str, Any] = {} if index is None else index.values
    values = dict(manifest.values)
    for f in indexed:
        values[f] = ValueRecord(indexed=True, per_rank={rank: got[f]} if f in got else {})
    return dataclasses.replace(manifest, values=values)


# ----------------------------------------------------------------------------- headers


class _File:
    """One data file of a writer rank: its index record, decoded header and chunk layout."""

    __slots__ = ("name", "rank", "record", "header", "origins", "by_place", "segments", "grid", "_digests",
                 "_file_record")

    def __init__(self, name: str, rank: int, record: IndexedFile, header: DecodedHeader, chunk_size: int) -> None:
        self.name, self.rank, self.record, self.header = name, rank, record, header
        self.origins = decode_origins(header.metadata, source=name)
        self.by_place: dict[tuple[str, tuple[int, ...]], str] = {}
        for k, o in self.origins.items():
            if self.by_place.setdefault((o.fqn, tuple(o.offsets)), k) != k:
                raise HeaderError(f"{name}: keys {self.by_place[(o.fqn, tuple(o.offsets))]!r} and {k!r} both place a "
                                  f"box of {o.fqn!r} at offsets {list(o.offsets)}")
        entries = sorted(header.entries.values(), key=lambda e: (e.start, e.end))
        self.segments = tuple((e.start, e.end) for e in entries if e.end > e.start)
        try:
            self.grid = hashing.ChunkGrid.segmented(size=record.size, chunk_size=chunk_size,
                                                    header_size=record.header_size, entries=self.segments)
        except ManifestError as e:
            raise HeaderError(f"{name}: {e}") from None
        if self.grid.count != record.chunk_count:
            raise IntegrityError(f"{name}: its index lists {record.chunk_count} chunk digests, its header's "
                                 f"{len(self.segments)} tensors cut into {self.grid.count} chunks of {chunk_size} bytes")
        self._digests: tuple[str, ...] | None = None
        self._file_record: FileRecord | None = None

    def digests(self) -> tuple[str, ...]:
        if self._digests is None:
            self._digests = self.record.chunk_digests()
        return self._digests

    def file_record(self) -> FileRecord:
        if self._file_record is None:
            r = self.record
            self._file_record = FileRecord(rank=self.rank, size=r.size, header_size=r.header_size,
                                           header_digest=r.header_digest, chunks=self.digests(), digest=r.digest,
                                           segments=self.segments)
        return self._file_record


def _headers(storage: Storage, path: str, manifest: Manifest, indexes: Mapping[int, RankIndex], *,
             verify: bool) -> dict[int, list[_File]]:
    """Every data file of the ``indexes``' ranks, its header read and (``verify``) checked."""
    jobs = [(r, name, rec) for r, idx in sorted(indexes.items()) for name, rec in sorted(idx.files.items())]

    def one(job) -> _File:
        r, name, rec = job
        return _File(name, r, rec, read_header(storage, path, name, rec, verify=verify), manifest.chunk_size)

    out: dict[int, list[_File]] = {r: [] for r in indexes}
    for (r, _, _), f in zip(jobs, _fetch(storage, one, jobs)):
        out[r].append(f)
    return out


def read_header(storage: Storage, path: str, name: str, rec: IndexedFile | FileRecord, *, verify: bool) -> DecodedHeader:
    """Read exactly ``rec.header_size`` bytes of ``name``: its size on storage must be
    ``rec.size``; with ``verify`` the bytes must hash to ``rec.header_digest`` and the length
    prefix give ``header_size`` (spec section 11, items 14-16)."""
    reader = storage.open_reader(storage.join(path, name), size=rec.size if storage.remote else None, within=path)
    try:
        if reader.size != rec.size:
            raise IntegrityError(f"{name}: file is {reader.size} bytes, its index says {rec.size}")
        buf = bytearray(rec.header_size)
        reader.readinto(0, [memoryview(buf)])
    finally:
        reader.close()
    if verify:
        got = hashing.digest_bytes(buf)
        if got != rec.header_digest:
            raise IntegrityError(f"{name}: header (bytes [0, {rec.header_size})) hashes to {got}, "
                                 f"its index says {rec.header_digest}")
    if header_length(bytes(buf[:PREFIX_BYTES]), source=name) + PREFIX_BYTES != rec.header_size:
        raise HeaderError(f"{name}: header length disagrees with the index's header_size {rec.header_size}")
    return decode_header(bytes(buf), source=name, file_size=rec.size)


def _locate(found: Mapping[int, list[_File]], manifest: Manifest, fqn: str, rec: TensorRecord, box: Box,
            rank: int) -> tuple[ShardRecord, FileRecord]:
    """The shard record of the saved ``box`` of ``fqn`` that ``rank`` wrote, and its file's record."""
    holders = [f.name for f in found[rank] if (fqn, box.offsets) in f.by_place]
    if len(holders) > 1:
        raise HeaderError(f"tensor {fqn!r}: rank {rank}'s files {holders} all hold its box at {list(box.offsets)} "
                          "(spec section 4.4)")
    for f in found[rank]:
        key = f.by_place.get((fqn, box.offsets))
        if key is None:
            continue
        e, o = f.header.entries[key], f.origins[key]
        if key not in (fqn, f"{fqn}@{','.join(map(str, box.offsets))}"):
            raise HeaderError(f"{f.name}: tensor {fqn!r}: key {key!r} is not one this tensor's shard may have")
        if (e.dtype, tuple(e.shape), tuple(o.global_shape)) != (rec.dtype, box.lengths, rec.shape):
            raise HeaderError(f"{f.name}: tensor {fqn!r} at {list(box.offsets)}: the file holds {e.dtype} "
                              f"{list(e.shape)} of a {list(o.global_shape)} tensor, the manifest says {rec.dtype} "
                              f"{list(box.lengths)} of {list(rec.shape)}")
        span = f.grid.span(e.start, e.end)
        shard = ShardRecord(offsets=box.offsets, lengths=box.lengths, file=f.name, key=key,
                            byte_range=(e.start, e.end), digest=hashing.combine(f.digests()[span.start:span.stop]))
        return shard, f.file_record()
    raise ManifestError(f"tensor {fqn!r}: rank {rank} should have written its box {list(box.offsets)}+"
                        f"{list(box.lengths)}, but none of its files ({[f.name for f in found[rank]]}) holds it")


# ----------------------------------------------------------------------------- the whole checkpoint


def expand(storage: Storage, path: str, manifest: Manifest, *, verify: bool = True) -> Manifest:
    """Return a v2 ``manifest`` with every file, every shard and every rank's per-rank values
    filled in (a v1 manifest as it is): what offline tools that walk a whole checkpoint (copy,
    convert, export, list) take. It reads every rank index and every header, so its cost grows
    with the job; a load reads only its part (``resolve``)."""
    if manifest.format_version < 2:
        return manifest
    ranks = [r for part in manifest.ranks for r in range(part.first, part.end)]
    indexes = read_indexes(storage, path, manifest, ranks, required=False)
    found = _headers(storage, path, manifest, indexes, verify=verify)
    shards: dict[str, list[ShardRecord]] = {}
    files: dict[str, FileRecord] = {}
    for rank in sorted(found):
        for f in found[rank]:
            files[f.name] = f.file_record()
            for key, o in sorted(f.origins.items()):
                rec = manifest.tensors.get(o.fqn) or manifest.storages.get(o.fqn)
                if rec is None or not rec.stored:
                    raise ManifestError(f"{f.name}: entry {key!r} belongs to {o.fqn!r}, which the manifest does not store")
                box = Box(tuple(o.offsets), tuple(f.header.entries[key].shape))
                shard, _ = _locate(found, manifest, o.fqn, rec, box, rank)
                shards.setdefault(o.fqn, []).append(shard)
    values = dict(manifest.values)
    for name, v in manifest.values.items():
        if v.indexed:
            values[name] = ValueRecord(indexed=True, per_rank={r: idx.values[name] for r, idx in sorted(indexes.items())
                                                                if name in idx.values})
    for got in shards.values():
        got.sort(key=lambda s: (s.offsets, s.file))  # the v1 writer's order
    return dataclasses.replace(
        manifest, files=dict(sorted(files.items())), values=values,
        tensors={f: _with(r, shards.get(f, [])) if r.stored else r for f, r in manifest.tensors.items()},
        storages={f: _with(r, shards.get(f, [])) for f, r in manifest.storages.items()})


def file_sizes(storage: Storage, path: str, manifest: Manifest) -> dict[str, int]:
    """Every data file's name and size, from the manifest (v1) or the rank indexes (v2: no
    header is read)."""
    if manifest.format_version < 2:
        return {name: f.size for name, f in manifest.files.items()}
    ranks = [r for part in manifest.ranks for r in range(part.first, part.end)]
    indexes = read_indexes(storage, path, manifest, ranks, required=False)
    return {name: f.size for idx in indexes.values() for name, f in sorted(idx.files.items())}
