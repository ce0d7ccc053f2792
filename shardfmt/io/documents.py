"""Reading a v2 checkpoint's documents, each checked against the record that vouches for it.

The chain COMMITTED -> root manifest -> rank-table part -> rank index -> data file header
(spec/FORMAT.md section 4.2): ``read_vouched`` reads one document against its size and
digest, ``rank_entries`` / ``read_indexes`` the parts and indexes of some ranks,
``read_headers`` their data files' headers (a base's file of an incremental checkpoint
through its ``<base>/data/...`` name, section 4.10). Loads (``loading.resolve``), incremental
saves (``saving.base``), validation and copies read through these, so what a reader pays
follows the ranks it needs.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from shardfmt.errors import CheckpointNotFoundError, HeaderError, IntegrityError, ManifestError
from shardfmt.format import hashing, refs
from shardfmt.format.index import IndexedFile, RankEntry, RankIndex
from shardfmt.format.manifest import COMMITTED_NAME, MAX_COMMITTED_BYTES, FileRecord, Manifest
from shardfmt.format.parse import parse_commit
from shardfmt.format.parse_v2 import parse_rank_index, parse_rank_part
from shardfmt.format.safetensors import (
    PREFIX_BYTES,
    DecodedHeader,
    decode_header,
    decode_origins,
    header_length,
)
from shardfmt.io.store import Storage

T = TypeVar("T")
R = TypeVar("R")



def fetch_each(storage: Storage, fn: Callable[[T], R], items: Sequence[T]) -> list[R]:
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
    for i, table in zip(sorted(need), fetch_each(storage, part, sorted(need))):
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
        return parse_rank_index(raw, rank=r, save_id=manifest.save_id, source=e.name, bases=bases)

    bases = refs.bases_of(manifest)
    return dict(zip(ranks, fetch_each(storage, index, list(ranks))))


class DataFile:
    """One data file of a writer rank: its index record, decoded header and chunk layout."""

    __slots__ = ("name", "rank", "record", "header", "origins", "by_place", "segments", "grid", "_digests",
                 "_file_record")

    def __init__(self, name: str, rank: int, record: IndexedFile, header: DecodedHeader, chunk_size: int) -> None:
        self.name, self.rank, self.record, self.header = name, rank, record, header
        self.origins = _taken(decode_origins(header.metadata, source=name), record.keys, name)
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


def _taken(origins: dict, keys: tuple[str, ...] | None, name: str) -> dict:
    """A referenced file's entries this checkpoint takes (its record's ``keys``); all of an own file's."""
    if keys is None:
        return origins
    missing = [k for k in keys if k not in origins]
    if missing:
        raise HeaderError(f"{name}: the index takes key(s) {missing[:3]} from it, but its header has no such "
                          "entry (spec section 4.10)")
    return {k: origins[k] for k in keys}


def read_headers(storage: Storage, path: str, manifest: Manifest, indexes: Mapping[int, RankIndex], *,
             verify: bool) -> dict[int, list[DataFile]]:
    """Every data file of the ``indexes``' ranks, its header read and (``verify``) checked."""
    jobs = [(r, name, rec) for r, idx in sorted(indexes.items()) for name, rec in sorted(idx.files.items())]

    def one(job) -> DataFile:
        r, name, rec = job
        return DataFile(name, r, rec, read_header(storage, path, name, rec, verify=verify), manifest.chunk_size)

    out: dict[int, list[DataFile]] = {r: [] for r in indexes}
    for (r, _, _), f in zip(jobs, fetch_each(storage, one, jobs)):
        out[r].append(f)
    return out


def read_header(storage: Storage, path: str, name: str, rec: IndexedFile | FileRecord, *, verify: bool) -> DecodedHeader:
    """Read exactly ``rec.header_size`` bytes of ``name``: its size on storage must be
    ``rec.size``; with ``verify`` the bytes must hash to ``rec.header_digest`` and the length
    prefix give ``header_size`` (spec section 11, items 14-16)."""
    says = "its index says" if isinstance(rec, IndexedFile) else "manifest says"  # v2 / v1: what records it
    full, within = refs.location(storage.join, path, name)
    try:
        reader = storage.open_reader(full, size=rec.size if storage.remote else None, within=within)
    except CheckpointNotFoundError:
        raise IntegrityError(refs.missing_file(name)) from None
    try:
        if reader.size != rec.size:
            raise IntegrityError(f"{name}: file is {reader.size} bytes, {says} {rec.size}")
        buf = bytearray(rec.header_size)
        reader.readinto(0, [memoryview(buf)])
    finally:
        reader.close()
    if verify:
        got = hashing.digest_bytes(buf)
        if got != rec.header_digest:
            raise IntegrityError(f"{name}: header (bytes [0, {rec.header_size})) hashes to {got}, "
                                 f"{says} {rec.header_digest}")
    if header_length(bytes(buf[:PREFIX_BYTES]), source=name) + PREFIX_BYTES != rec.header_size:
        raise HeaderError(f"{name}: header length disagrees with the header_size {rec.header_size} "
                          f"{'its index' if isinstance(rec, IndexedFile) else 'the manifest'} records")
    return decode_header(bytes(buf), source=name, file_size=rec.size)


def check_bases(storage: Storage, path: str, chain: refs.Chain | None, used: Iterable[str] | None = None) -> None:
    """Each base in ``chain`` of the incremental checkpoint at ``path`` (those of ``used`` file
    names, or all) is a committed checkpoint holding the save the chain records (spec section
    4.10): what a load that does not verify the bytes, and a commit, rely on."""
    if chain is None:
        return
    names = chain.bases if used is None else {b for b in (refs.split(n)[0] for n in used) if b is not None}
    for base in sorted(names):
        where = refs.sibling(path, base)
        try:
            raw = storage.read_bytes(storage.join(where, COMMITTED_NAME), limit=MAX_COMMITTED_BYTES, within=where)
        except CheckpointNotFoundError:
            raise IntegrityError(f"{path}: its base {base!r} is not committed there any more (a broken chain)") from None
        got = parse_commit(raw, source=f"{base}/{COMMITTED_NAME}").save_id
        if got != chain.bases.get(base):
            raise IntegrityError(f"{path}: its base {base!r} holds save {got}, the chain records "
                                 f"{chain.bases.get(base)} (the base was replaced: a broken chain)")
