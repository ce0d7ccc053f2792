"""One data file: a streaming shard-file writer (header up front, hash as it writes).

``write_shard_file`` streams tensors into one safetensors file: the header is computed
up front from shapes and dtypes, then each tensor's memory is hashed and written piece by
piece (no file image in memory, no second pass): in ``part_size`` parts on threads with
positional writes (``O_DIRECT`` where a durable write allows), else in order with hashing
overlapped on a helper thread. ``FileStream`` / ``ShardStream`` take bytes that arrive in
pieces (offline tools). ``WrittenFile`` (``messages``) is what a file's writing produced.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
import xxhash

from shardfmt.errors import CommitError, ShapeError, StateDictError
from shardfmt.format import hashing
from shardfmt.format.dtypes import dtype_code
from shardfmt.format.manifest import FileRecord, Placement, ShardRecord
from shardfmt.format.safetensors import EncodedHeader, ShardOrigin, encode_header, encode_origins
from shardfmt.format.tensor_bytes import DEFAULT_PIECE_BYTES, byte_pieces, byte_view, is_direct
from shardfmt.io import aligned as aligned_io
from shardfmt.io import probe
from shardfmt.io.aligned import DIRECT_ALIGN, address
from shardfmt.io.store import Storage, reserve
from shardfmt.saving.messages import WrittenFile
from shardfmt.saving.options import DEFAULT_PART_SIZE

_OVERLAP_MIN = 1 << 20  # pieces at least this large are hashed on a helper thread during the write


def _check_slice(fqn: str, shape: tuple[int, ...], offsets: tuple[int, ...], global_shape: tuple[int, ...]) -> None:
    if len(shape) != len(global_shape) or len(offsets) != len(shape):
        raise ShapeError(f"{fqn}: local shape {list(shape)}, offsets {list(offsets)} and "
                         f"global shape {list(global_shape)} differ in rank")
    for d, (o, n, g) in enumerate(zip(offsets, shape, global_shape)):
        if o < 0 or o + n > g:
            raise ShapeError(f"{fqn}: dim {d}: slice [{o}, {o + n}) is outside the global size {g}")


@dataclass(frozen=True, slots=True, kw_only=True)
class ShardSpec:
    """One slice a data file will hold, without its data: what a streaming writer lays out
    up front (``shape`` is the slice's local shape, ``dtype`` the dtype it is written in)."""

    fqn: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    placement: Placement | None = None

    def __post_init__(self) -> None:
        _check_slice(self.fqn, tuple(self.shape), tuple(self.offsets), tuple(self.global_shape))

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True, slots=True, kw_only=True)
class ShardData:
    """One slice of a global tensor to write: its data and where it sits globally."""

    fqn: str
    data: torch.Tensor
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    placement: Placement | None = None
    # Called before ``data`` is read (async saves: waits until the snapshot's copy of this piece landed).
    ready: Callable[[], None] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        _check_slice(self.fqn, tuple(self.data.shape), tuple(self.offsets), tuple(self.global_shape))

    def spec(self) -> ShardSpec:
        return ShardSpec(fqn=self.fqn, dtype=self.data.dtype, shape=tuple(self.data.shape),
                         global_shape=tuple(self.global_shape), offsets=tuple(self.offsets),
                         placement=self.placement)


def file_order(shards: Sequence) -> list:
    """Return ``shards`` (ShardData or ShardSpec) in data-file order: element size descending,
    then record name, then offsets (spec section 3), so every tensor starts aligned."""

    def key(s):
        isz = s.data.element_size() if isinstance(s, ShardData) else s.dtype.itemsize
        return (-isz, s.fqn, tuple(s.offsets))

    return sorted(shards, key=key)



def _file_keys(shards: Sequence[ShardData]) -> list[str]:
    counts: dict[str, int] = {}
    for s in shards:
        counts[s.fqn] = counts.get(s.fqn, 0) + 1
    return [s.fqn if counts[s.fqn] == 1 else f"{s.fqn}@{','.join(map(str, s.offsets))}" for s in shards]


def write_shard_file(
    storage: Storage,
    directory: str,
    name: str,
    rank: int,
    shards: Sequence[ShardData],
    *,
    chunk_size: int = hashing.DEFAULT_CHUNK_SIZE,
    sync: bool = True,
    workers: int = 1,
    part_size: int = DEFAULT_PART_SIZE,
    aligned: bool = False,
) -> WrittenFile:
    """Write ``shards`` (in the given order) into ``directory/name``, hashing chunks as they are written.

    ``aligned`` (format v2): chunks are cut from each tensor entry's start and the header is
    not chunked (spec section 6); else (v1) chunks run from byte 0, header included.

    With ``workers > 1`` on a storage with positional writes, and every shard's memory
    contiguous on the CPU, the file is cut into ``part_size`` parts (whole hash chunks) that
    threads write and hash independently, straight from tensor memory. A durable write
    (``sync``) of a file larger than a part goes around the page cache where the storage can
    (``O_DIRECT``, on ``aligned.MIN_THREADS`` threads at least). Otherwise the file is
    streamed in order, hashing each piece on a helper thread while the OS writes it.
    """
    if part_size % chunk_size or part_size <= 0:
        raise CommitError(f"part_size {part_size} must be a positive multiple of chunk_size {chunk_size}")
    header = _shard_header(name, rank, [s.spec() for s in shards])
    grid = file_grid(header, chunk_size, aligned=aligned)
    path = storage.join(directory, name)
    w = storage.open_writer(path)
    try:
        segments = _direct_segments(header, shards)
        parts = segments is not None and hasattr(w, "pwrite") and header.file_size > part_size
        # durable writes of a large file bypass the page cache where the filesystem allows, on
        # MIN_THREADS at least: they mostly wait on the device, and keep its queue full
        direct = parts and sync and part_size % DIRECT_ALIGN == 0 and hasattr(w, "open_direct") and w.open_direct()
        reserve(w, header.file_size, grow=direct)  # before its first byte; direct parts: inside its size
        if direct or (parts and workers > 1):
            chunks, total = _write_parts(w, segments, grid, part_size=part_size,
                                         workers=max(workers, aligned_io.MIN_THREADS) if direct else workers,
                                         direct=direct)
        else:
            chunks, total = _write_stream(w, header.data, shards, grid)
    except BaseException:
        w.abort()
        raise
    w.close(sync=sync)
    if total != header.file_size:
        raise CommitError(f"{path}: wrote {total} bytes, header promised {header.file_size}")
    return _written_file(name, rank, header, shards, chunks, grid)


def file_grid(header: EncodedHeader, chunk_size: int, *, aligned: bool) -> hashing.ChunkGrid:
    """Where the chunks of the file ``header`` lays out lie: cut from each entry's start
    (``aligned``, v2) or from byte 0 (v1)."""
    if not aligned:
        return hashing.ChunkGrid.regular(size=header.file_size, chunk_size=chunk_size)
    return hashing.ChunkGrid.segmented(size=header.file_size, chunk_size=chunk_size, header_size=len(header.data),
                                       entries=[(e.start, e.end) for e in header.entries])


def _shard_header(name: str, rank: int, specs: Sequence[ShardSpec]) -> EncodedHeader:
    """Lay out a shardfmt data file holding ``specs`` in the given order (keys, header, origins)."""
    keys = _file_keys(specs)
    if len(set(keys)) != len(keys):
        dup = sorted({k for k in keys if keys.count(k) > 1})
        raise StateDictError(f"{name}: safetensors key(s) {dup[:3]} would name two entries (two shards of one "
                             "tensor at the same offsets, or a tensor whose name looks like 'fqn@offsets')")
    return encode_header(
        [(k, dtype_code(s.dtype, what=s.fqn), tuple(s.shape)) for k, s in zip(keys, specs)],
        metadata={"format": "shardfmt", "rank": str(rank),
                  "shards": encode_origins({k: ShardOrigin(fqn=s.fqn, offsets=tuple(s.offsets),
                                                           global_shape=tuple(s.global_shape))
                                            for k, s in zip(keys, specs)})},
    )


def _written_file(name: str, rank: int, header: EncodedHeader, shards: Sequence, chunks: Sequence[str],
                  grid: hashing.ChunkGrid) -> WrittenFile:
    """The file record and shard records of a data file written from ``header``."""
    chunks = tuple(chunks)
    header_digest = hashing.digest_bytes(header.data)
    v2 = grid.starts is not None
    segments = tuple((e.start, e.end) for e in header.entries if e.end > e.start) if v2 else None
    record = FileRecord(rank=rank, size=header.file_size, header_size=len(header.data), header_digest=header_digest,
                        chunks=chunks, segments=segments,
                        digest=hashing.v2_file_digest(header_digest, chunks) if v2 else hashing.combine(chunks))
    shard_records = []
    for entry, s in zip(header.entries, shards):
        span = grid.span(entry.start, entry.end)
        shard_records.append((s.fqn, ShardRecord(
            offsets=tuple(s.offsets), lengths=tuple(entry.shape), file=name, key=entry.key,
            byte_range=(entry.start, entry.end), digest=hashing.combine(chunks[span.start:span.stop]),
        )))
    return WrittenFile(name=name, record=record, shards=tuple(shard_records))


class _OrderedHasher:
    """Write a file's bytes in order, hashing chunks in the same pass: a helper thread hashes
    each large piece while the OS writes it (both drop the GIL: ~max(write, hash), not the sum).
    ``write`` returns only when its bytes are written and hashed, so the caller may reuse them."""

    def __init__(self, w, grid: hashing.ChunkGrid, *, hash_pool: ThreadPoolExecutor | None = None) -> None:
        self._w = w
        self.hasher = grid.hasher(grid.chunked_from)
        self._unhashed = grid.chunked_from  # v2: the header is covered by its own digest, not by chunks
        self.total = 0
        self._pool = hash_pool
        self._own_pool = hash_pool is None

    def write(self, data) -> None:
        mv = memoryview(data).cast("B")
        self.total += len(mv)
        if self._unhashed:
            skip = min(self._unhashed, len(mv))
            self._w.write(mv[:skip])
            self._unhashed -= skip
            mv = mv[skip:]
        for pos in range(0, len(mv), DEFAULT_PIECE_BYTES):
            piece = mv[pos : pos + DEFAULT_PIECE_BYTES]
            if len(piece) < _OVERLAP_MIN:
                self.hasher.update(piece)
                self._w.write(piece)
                continue
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardfmt-hash")
            pending = self._pool.submit(self.hasher.update, piece)
            try:
                self._w.write(piece)
            finally:
                pending.result()

    def finish(self) -> tuple[list[str], int]:
        self.shutdown()
        return self.hasher.finish(), self.total

    def shutdown(self) -> None:
        if self._own_pool and self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def _write_stream(w, header_bytes: bytes, shards: Sequence[ShardData], grid: hashing.ChunkGrid) -> tuple[list[str], int]:
    """Write the file in order, hashing as it goes."""
    out = _OrderedHasher(w, grid)
    try:
        out.write(header_bytes)
        for s in shards:
            if s.ready is not None:
                s.ready()
            for piece in byte_pieces(s.data):
                out.write(piece)
    finally:
        out.shutdown()
    return out.finish()


class FileStream:
    """Write one safetensors file whose bytes arrive in order, in pieces of any size.

    Protocol::

        1) f = FileStream(storage, path, header)   opens the file, writes + hashes the header
        2) f.write(bytes) ...                     exactly the data section, in header order
        3) chunks, size = f.close()               checks every promised byte arrived, syncs
        (on any failure: f.abort())

    Chunk digests are computed while writing (no second pass); ``write`` returns once its
    bytes are written and hashed, so a caller can refill the same buffer at once.
    """

    def __init__(self, storage: Storage, path: str, header: EncodedHeader, *,
                 chunk_size: int = hashing.DEFAULT_CHUNK_SIZE, sync: bool = True,
                 hash_pool: ThreadPoolExecutor | None = None, aligned: bool = False) -> None:
        self.path = path
        self.header = header
        self.grid = file_grid(header, chunk_size, aligned=aligned)
        self._sync = sync
        self._w = storage.open_writer(path)
        self._out = _OrderedHasher(self._w, self.grid, hash_pool=hash_pool)
        self._done = False
        try:
            reserve(self._w, header.file_size)
            self._out.write(header.data)
        except BaseException:
            self.abort()
            raise

    @property
    def written(self) -> int:
        return self._out.total

    def write(self, data) -> None:
        n = memoryview(data).nbytes
        if self.written + n > self.header.file_size:
            self.abort()
            raise CommitError(f"{self.path}: {self.written + n} bytes written, the header promised "
                              f"{self.header.file_size}")
        try:
            self._out.write(data)
        except BaseException:
            self.abort()
            raise

    def close(self) -> tuple[tuple[str, ...], int]:
        if self.written != self.header.file_size:
            self.abort()
            raise CommitError(f"{self.path}: closed after {self.written} bytes, the header promised "
                              f"{self.header.file_size}")
        chunks, total = self._out.finish()
        self._done = True
        self._w.close(sync=self._sync)
        return tuple(chunks), total

    def abort(self) -> None:
        if self._done:
            return
        self._done = True
        self._out.shutdown()
        self._w.abort()


class ShardStream:
    """Stream one shardfmt data file holding ``specs`` (in file order): the header (with the
    ``shards`` origins of spec section 3) is written up front, the slices' bytes arrive through
    ``write`` in that order, and ``close`` returns the file's records (calling ``on_close``)."""

    def __init__(self, storage: Storage, directory: str, name: str, rank: int, specs: Sequence[ShardSpec], *,
                 chunk_size: int = hashing.DEFAULT_CHUNK_SIZE, sync: bool = True,
                 hash_pool: ThreadPoolExecutor | None = None,
                 on_close: Callable[[WrittenFile], None] | None = None, aligned: bool = False) -> None:
        self.name = name
        self.rank = rank
        self.specs = tuple(specs)
        self._on_close = on_close
        header = _shard_header(name, rank, self.specs)
        self._file = FileStream(storage, storage.join(directory, name), header, chunk_size=chunk_size,
                                sync=sync, hash_pool=hash_pool, aligned=aligned)

    def write(self, data) -> None:
        self._file.write(data)

    def close(self) -> WrittenFile:
        chunks, _ = self._file.close()
        written = _written_file(self.name, self.rank, self._file.header, self.specs, chunks, self._file.grid)
        if self._on_close is not None:
            self._on_close(written)
        return written

    def abort(self) -> None:
        self._file.abort()


def _direct_segments(header, shards: Sequence[ShardData]) -> list[tuple[int, memoryview, Callable | None]] | None:
    """(file offset, bytes, ready) of the header and every shard, when all are zero-copy views; else None."""
    segments = [(0, memoryview(header.data), None)]
    for entry, s in zip(header.entries, shards):
        if s.data.numel() == 0:
            continue
        if not is_direct(s.data):
            return None
        segments.append((entry.start, byte_view(s.data), s.ready))
    return segments


def _write_parts(w, segments: list[tuple[int, memoryview, Callable | None]], grid: hashing.ChunkGrid, *,
                 part_size: int, workers: int, direct: bool = False) -> tuple[list[str], int]:
    """Write ``[k * part_size, (k + 1) * part_size)`` parts of the file on ``workers`` threads,
    each thread then hashing the chunks that start in its part (from memory: every byte of the
    file is in ``segments``, so a chunk may run on into the next part).

    ``direct``: ``w`` has an ``O_DIRECT`` handle and ``part_size`` is a multiple of
    ``DIRECT_ALIGN``. The parts are then written in aligned blocks: straight from the tensors'
    memory where it is aligned alike, else gathered into a reused page-aligned bounce buffer per
    thread (a memcpy at memory speed, instead of the kernel's copy into page-cache pages it must
    first allocate). Only the file's last block is padded; the file is then trimmed to its size.
    """
    file_size = grid.size
    starts = [off for off, _, _ in segments]
    bounce_size = aligned_io.bounce_size(file_size, cap=aligned_io.MAX_BLOCK)

    def part(lo: int) -> tuple[list[str], int]:
        hi = min(lo + part_size, file_size)
        i = max(0, bisect.bisect_right(starts, lo) - 1)
        if direct:
            with aligned_io.POOL.buffer(bounce_size) as bounce:
                pos = lo
                while pos < hi:
                    end = min(pos + len(bounce.mv), hi)
                    i, block = _gather(segments, i, pos, end, bounce)
                    w.pwrite_block(pos, block, end - pos)
                    pos = end
            return _hash_chunks(segments, grid, lo, hi), hi - lo
        pos = lo
        while pos < hi:
            off, mv, ready = segments[i]
            a, b = max(pos - off, 0), min(hi - off, len(mv))
            if off > pos or a >= b:
                raise CommitError(f"internal: no data for byte {pos} of the file")
            if ready is not None:
                ready()
            w.pwrite(off + a, mv[a:b])
            pos = off + b
            i += 1
        w.start_writeback(lo, hi - lo)
        return _hash_chunks(segments, grid, lo, hi), hi - lo

    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="shardfmt-write") as pool:
        results = list(pool.map(part, range(0, file_size, part_size)))
    if direct:
        w.truncate(file_size)  # drop the last block's padding
    return [d for digests, _ in results for d in digests], sum(n for _, n in results)


def _hash_chunks(segments: list[tuple[int, memoryview, Callable | None]], grid: hashing.ChunkGrid,
                 lo: int, hi: int) -> list[str]:
    """The digests of the chunks of ``grid`` that start in ``[lo, hi)``, hashed from ``segments``."""
    lo = max(lo, grid.chunked_from)
    if lo >= hi:
        return []
    first = grid.span(lo, lo + 1).start
    if grid.bounds(first)[0] < lo:
        first += 1
    starts = [off for off, _, _ in segments]
    out = []
    k = first
    while k < grid.count:
        a, b = grid.bounds(k)
        if a >= hi:
            break
        h = xxhash.xxh3_128()
        i = max(0, bisect.bisect_right(starts, a) - 1)
        pos = a
        while pos < b:
            off, mv, ready = segments[i]
            if ready is not None:
                ready()
            x, y = pos - off, min(b - off, len(mv))
            if x < 0 or x >= y:
                raise CommitError(f"internal: no data for byte {pos} of the file")
            h.update(mv[x:y])
            pos = off + y
            i += 1
        out.append(hashing.format_digest(h.digest()))
        k += 1
    return out


def _gather(segments: list[tuple[int, memoryview, Callable | None]], i: int, pos: int, end: int,
            bounce: aligned_io.Bounce) -> tuple[int, memoryview]:
    """The file's bytes ``[pos, end)`` as one aligned block, padded to a whole ``DIRECT_ALIGN``
    multiple, and the index of the segment holding byte ``end``. ``segments[i]`` holds ``pos``.
    A block inside one segment whose memory is aligned alike is that memory (no copy);
    anything else is copied into ``bounce``."""
    off, mv, ready = segments[i]
    n = end - pos
    if off <= pos and end <= off + len(mv) and n % DIRECT_ALIGN == 0 and address(mv, pos - off) % DIRECT_ALIGN == 0:
        if ready is not None:
            ready()
        return (i + 1 if end == off + len(mv) else i), mv[pos - off:end - off]
    p = pos
    while p < end:
        off, mv, ready = segments[i]
        a, b = p - off, min(end - off, len(mv))
        if a < 0 or a >= b:
            raise CommitError(f"internal: no data for byte {p} of the file")
        if ready is not None:
            ready()
        aligned_io.copy(bounce.address + (p - pos), address(mv, a), b - a)
        p = off + b
        if b == len(mv):
            i += 1
    padded = -(-n // DIRECT_ALIGN) * DIRECT_ALIGN
    bounce.mv[n:padded] = bytes(padded - n)
    return i, bounce.mv[:padded]


def default_write_workers() -> int:
    """Writer threads per rank: the cores this rank may use (``LOCAL_WORLD_SIZE`` share), 1 to 4
    (``io.probe.threads``, the rule the I/O probe measures with)."""
    return probe.threads(probe.local_processes(), direct=False, write=True)


__all__ = ["FileStream", "ShardData", "ShardSpec", "ShardStream", "WrittenFile", "default_write_workers", "file_order",
           "write_shard_file"]
