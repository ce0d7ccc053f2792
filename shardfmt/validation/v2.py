"""Version 2: the whole checkpoint, walked part by part in memory bounded by one document.

Rank-table parts, then each rank index they vouch for, then each data file that index lists:
size, header (length, digest, rules), chunk count and file digest, and every header entry
against the root (a box the root says this rank wrote: a placed record's derived box, or a
listed box). What is kept across files is per tensor (elements found of each placed record)
and per listed box (found or not), never per rank or per shard of a placed record: a placed
record is complete when the boxes found, each a distinct box its writer derives, add up to
its elements. ``deep`` re-hashes every chunk, each aligned to its shard (spec section 6).
"""

from __future__ import annotations

import math
from collections.abc import Callable

from shardfmt.errors import CheckpointNotFoundError, ShardfmtError, SpecialFileError
from shardfmt.format import hashing, jsonvalue, refs
from shardfmt.format.index import IndexedFile, RankIndex
from shardfmt.format.manifest import Manifest, TensorRecord
from shardfmt.format.parse_v2 import parse_rank_index, parse_rank_part
from shardfmt.format.safetensors import (
    PREFIX_BYTES,
    DecodedHeader,
    decode_header,
    decode_origins,
    header_length,
)
from shardfmt.io.documents import check_bases, read_vouched
from shardfmt.io.store import Storage
from shardfmt.layout.geometry import Box
from shardfmt.layout.placed import placed_plan, plan_writes
from shardfmt.layout.tiling import tiling_problems
from shardfmt.layout.topology import layout_from_record
from shardfmt.validation.report import Problem
from shardfmt.validation.v1 import READ_PIECE, check_values

Progress = Callable[[int], None]  # called with the bytes of each data file once it is checked


class _Tally:
    """What the walk has found so far, per tensor and per listed box."""

    def __init__(self, m: Manifest) -> None:
        self.m = m
        self.placed_found: dict[str, int] = {}
        self.listed: dict[tuple[str, tuple[int, ...]], tuple[tuple[int, ...], int]] = {}
        self.listed_found: set[tuple[str, tuple[int, ...]]] = set()
        self.per_rank = {f for f, v in m.values.items() if v.indexed}
        self.plans: dict[str, object] = {}  # placed records' (layout.placed.placed_plan), built once, not per file
        for table in (m.tensors, m.storages):
            for fqn, rec in table.items():
                for s in rec.listed or ():
                    self.listed[(fqn, s.offsets)] = (s.lengths, s.rank)

    def record(self, fqn: str) -> TensorRecord | None:
        rec = self.m.tensors.get(fqn) or self.m.storages.get(fqn)
        return rec if rec is not None and rec.stored else None

    def plan(self, fqn: str, rec: TensorRecord):
        plan = self.plans.get(fqn)
        if plan is None:
            plan = self.plans[fqn] = placed_plan(rec.shape, layout_from_record(rec.placed.placement), self.m.topology.mesh)
        return plan


def check_v2(storage: Storage, path: str, m: Manifest, problems: list[Problem], *, deep: bool,
             progress: Progress | None = None) -> None:
    """Every check of a version-2 checkpoint past its root manifest's fields."""
    check_values(m, problems)
    for table in (m.tensors, m.storages):
        for fqn, rec in table.items():
            if rec.listed is not None:
                for msg in tiling_problems([Box(s.offsets, s.lengths) for s in rec.listed], Box.full(rec.shape)):
                    problems.append(Problem(code="tiling", tensor=fqn, message=msg))
    bases = _check_chain(storage, path, m, problems)
    tally = _Tally(m)
    for part in m.ranks:
        try:
            table = parse_rank_part(read_vouched(storage, path, part.name, part.size, part.digest), part,
                                    save_id=m.save_id, source=part.name)
        except ShardfmtError as e:
            problems.append(Problem(code=_read_code(e, "rank_table"), file=part.name, message=str(e)))
            continue
        for r, entry in sorted(table.ranks.items()):
            try:
                index = parse_rank_index(read_vouched(storage, path, entry.name, entry.size, entry.digest),
                                         rank=r, save_id=m.save_id, source=entry.name, bases=bases)
            except ShardfmtError as e:
                problems.append(Problem(code=_read_code(e, "rank_index"), file=entry.name, message=str(e)))
                continue
            _check_index(storage, path, index, entry.name, tally, problems, deep=deep, progress=progress)
    _check_complete(tally, problems)


def _check_chain(storage: Storage, path: str, m: Manifest, problems: list[Problem]) -> frozenset[str]:
    """An incremental checkpoint's bases (spec section 4.10): each a committed sibling holding
    the save its chain records. Return the bases (what its rank indexes may name)."""
    try:
        chain = refs.chain_of(m)
    except ShardfmtError as e:
        problems.append(Problem(code="manifest", message=str(e)))
        return frozenset()
    if chain is None:
        return frozenset()
    try:
        refs.check_chain_of(path, m)
    except ShardfmtError as e:
        problems.append(Problem(code="broken_chain", message=str(e)))
    for base, save_id in sorted(chain.bases.items()):  # each reported on its own
        try:
            check_bases(storage, path, refs.Chain(bases={base: save_id}, depth=chain.depth))
        except ShardfmtError as e:
            problems.append(Problem(code="broken_chain", file=base, message=str(e)))
    return frozenset(chain.bases)


def _read_code(e: ShardfmtError, code: str) -> str:
    """A part or an index that is a FIFO, a device or a link is a special file (spec section 2)."""
    return "special_file" if isinstance(e, SpecialFileError) else code


def _check_index(storage: Storage, path: str, index: RankIndex, name: str, tally: _Tally, problems: list[Problem],
                 *, deep: bool, progress: Progress | None) -> None:
    for value_name, v in index.values.items():
        if value_name not in tally.per_rank:
            problems.append(Problem(code="value", file=name, tensor=value_name,
                                    message="a per-rank value the root manifest does not record as per-rank"))
            continue
        try:
            jsonvalue.decode(v, where=f"{value_name}[rank {index.rank}]")
        except ShardfmtError as e:
            problems.append(Problem(code="value", file=name, tensor=value_name, message=str(e)))
    seen: set[tuple[str, tuple[int, ...]]] = set()  # boxes of this rank's files: each once
    for fname, frec in sorted(index.files.items()):
        _check_file(storage, path, fname, frec, index.rank, tally, seen, problems, deep=deep)
        if progress is not None:
            progress(frec.size)


def _check_file(storage: Storage, path: str, name: str, frec: IndexedFile, rank: int, tally: _Tally,
                seen: set, problems: list[Problem], *, deep: bool) -> None:
    full, within = refs.location(storage.join, path, name)
    try:
        reader = storage.open_reader(full, within=within)
    except SpecialFileError as e:  # a FIFO, a device, a link (spec section 2)
        problems.append(Problem(code="special_file", file=name, message=str(e)))
        return
    except CheckpointNotFoundError:
        code = "file_missing" if refs.split(name)[0] is None else "broken_chain"
        problems.append(Problem(code=code, file=name, message=refs.missing_file(name)))
        return
    except ShardfmtError as e:
        problems.append(Problem(code="file_missing", file=name, message=str(e)))
        return
    try:
        if reader.size != frec.size:
            problems.append(Problem(code="file_size", file=name, message=f"is {reader.size} bytes, its index says {frec.size}"))
            return
        header = _header(reader, name, frec, problems)
        if header is None:
            return
        segments = sorted((e.start, e.end) for e in header.entries.values() if e.end > e.start)
        if not _chunks_agree(name, frec, segments, tally.m.chunk_size, problems):
            return
        _check_entries(name, header, frec.keys, rank, tally, seen, problems)
        if deep:
            _rehash(reader, name, frec, segments, tally.m.chunk_size, problems)
    except ShardfmtError as e:
        problems.append(Problem(code="file_read", file=name, message=str(e)))
    finally:
        reader.close()


def _read(reader, offset: int, n: int) -> bytearray:
    buf = bytearray(n)
    reader.readinto(offset, [memoryview(buf)])
    return buf


def _header(reader, name: str, frec: IndexedFile, problems: list[Problem]) -> DecodedHeader | None:
    """The file's header, read through its length prefix and checked against the index."""
    size = reader.size
    try:
        prefix = _read(reader, 0, min(PREFIX_BYTES, size))
        n = header_length(bytes(prefix), source=name, file_size=size)
        raw = bytes(prefix) + bytes(_read(reader, PREFIX_BYTES, n))
        header = decode_header(raw, source=name, file_size=size)
    except ShardfmtError as e:
        problems.append(Problem(code="header", file=name, message=str(e)))
        return None
    if len(raw) != frec.header_size or hashing.digest_bytes(raw) != frec.header_digest:
        problems.append(Problem(code="header", file=name, byte_range=(0, len(raw)),
                                message=f"header ({len(raw)} bytes) does not match its index's header_size "
                                        f"{frec.header_size} / header_digest"))
    return header


def _chunks_agree(name: str, frec: IndexedFile, segments: list[tuple[int, int]], chunk_size: int,
                  problems: list[Problem]) -> bool:
    want = sum(-(-(e - s) // chunk_size) for s, e in segments)
    if frec.chunk_count != want:
        problems.append(Problem(code="chunks", file=name, message=f"its index lists {frec.chunk_count} chunk "
                                f"digests, its header's tensors cut into {want} chunks of {chunk_size} bytes"))
        return False
    derived = hashing.format_digest(hashing.xxh3_raw(hashing.parse_digest(frec.header_digest) + frec.chunks))
    if derived != frec.digest:
        problems.append(Problem(code="file_digest", file=name,
                                message="file digest does not derive from its header digest and chunk digests"))
    return True


def _check_entries(name: str, header: DecodedHeader, keys: tuple[str, ...] | None, rank: int, tally: _Tally,
                   seen: set, problems: list[Problem]) -> None:
    """Every entry of the header (of a base's file: each entry this checkpoint takes, ``keys``)
    is a box the root says ``rank`` wrote, checked for dtype, tensor shape and key form; each
    counted toward its record's completeness."""
    try:
        origins = decode_origins(header.metadata, source=name)
    except ShardfmtError as e:
        problems.append(Problem(code="header", file=name, message=str(e)))
        return
    entries = header.entries
    if keys is not None:
        absent = [k for k in keys if k not in entries]
        if absent:
            problems.append(Problem(code="header", file=name, message=f"the index takes key(s) {absent[:3]} from "
                                    "this base file, whose header has no such entry"))
        entries = {k: entries[k] for k in keys if k in entries}
    for key, e in sorted(entries.items()):
        o = origins.get(key)
        rec = None if o is None else tally.record(o.fqn)
        if rec is None:
            problems.append(Problem(code="header", file=name, message=f"header key {key!r} is not a box of a stored "
                                    "record of the manifest"))
            continue
        fqn, box = o.fqn, Box(tuple(o.offsets), tuple(e.shape))
        if key not in (fqn, f"{fqn}@{','.join(map(str, box.offsets))}") or (fqn, box.offsets) in seen:
            problems.append(Problem(code="header", file=name, tensor=fqn,
                                    message=f"key {key!r} is not a key this shard may have, or names a box twice"))
            continue
        seen.add((fqn, box.offsets))
        if (e.dtype, tuple(o.global_shape)) != (rec.dtype, rec.shape) or len(box.offsets) != len(rec.shape):
            problems.append(Problem(code="header", file=name, tensor=fqn, byte_range=(e.start, e.end),
                                    message=f"the file holds {e.dtype} of a {list(o.global_shape)} tensor, the "
                                            f"manifest records {rec.dtype} {list(rec.shape)}"))
            continue
        if rec.placed is not None:
            mine = {hb.box for hb in plan_writes(tally.plan(fqn, rec), writer=rec.placed.writer, rank=rank)}
            if box not in mine:
                problems.append(Problem(code="header", file=name, tensor=fqn,
                                        message=f"box {list(box.offsets)}+{list(box.lengths)} is not one rank {rank} "
                                                "writes by the record's placement"))
                continue
            tally.placed_found[fqn] = tally.placed_found.get(fqn, 0) + box.numel
        elif tally.listed.get((fqn, box.offsets)) == (box.lengths, rank):
            tally.listed_found.add((fqn, box.offsets))
        else:
            problems.append(Problem(code="header", file=name, tensor=fqn,
                                    message=f"box {list(box.offsets)}+{list(box.lengths)} is not a listed box rank "
                                            f"{rank} wrote"))


def _check_complete(tally: _Tally, problems: list[Problem]) -> None:
    for table in (tally.m.tensors, tally.m.storages):
        for fqn, rec in table.items():
            if rec.placed is not None:
                found, want = tally.placed_found.get(fqn, 0), math.prod(rec.shape)
                if found != want:
                    problems.append(Problem(code="missing_shards", tensor=fqn,
                                            message=f"its writers' files hold {found} of its {want} elements"))
    for (fqn, offsets), (lengths, rank) in sorted(tally.listed.items()):
        if (fqn, offsets) not in tally.listed_found and math.prod(lengths):
            problems.append(Problem(code="missing_shards", tensor=fqn,
                                    message=f"box {list(offsets)}+{list(lengths)} is not in rank {rank}'s files"))


def _rehash(reader, name: str, frec: IndexedFile, segments: list[tuple[int, int]], chunk_size: int,
            problems: list[Problem]) -> None:
    """Hash every chunk of every entry, each cut from its entry's start, against the index."""
    k = 0
    want = frec.chunks
    piece = max(chunk_size, READ_PIECE // chunk_size * chunk_size)
    for start, end in segments:
        pos = start
        while pos < end:
            n = min(piece, end - pos)
            buf = memoryview(_read(reader, pos, n))
            for off in range(0, n, chunk_size):
                got = hashing.xxh3_raw(buf[off:off + chunk_size])
                if got != want[16 * k:16 * k + 16]:
                    lo = pos + off
                    problems.append(Problem(code="chunk_hash", file=name, byte_range=(lo, min(lo + chunk_size, end)),
                                            message=f"chunk {k} hashes to {hashing.format_digest(got)}, its index "
                                                    f"says {hashing.format_digest(bytes(want[16 * k:16 * k + 16]))}"))
                k += 1
            pos += n

