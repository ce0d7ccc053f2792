"""Writing checkpoints: a streaming shard-file writer and the low-level CheckpointWriter.

``write_shard_file`` streams tensors into one safetensors file: the header is computed
up front from shapes and dtypes, then each tensor's memory is hashed and written piece by
piece (no file image in memory, no second pass). ``CheckpointWriter`` lets one process
write the files of any number of ranks, then ``commit`` builds the manifest and runs the
commit protocol; ``shardfmt.save`` and the offline tools are built on it.
"""

from __future__ import annotations

import bisect
import datetime as _dt
import os
import platform
import threading
import uuid
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from . import commit as _commit
from . import hashing, jsonvalue
from .dtypes import dtype_code
from .errors import CommitError, ShapeError, ShardfmtError, StateDictError
from .manifest import (
    FileRecord,
    Manifest,
    Placement,
    ShardRecord,
    TensorRecord,
    Topology,
    ValueRecord,
    ViewRecord,
    rank_file_name,
)
from .retention import DEFAULT_LEASE_SECONDS
from .safetensors_io import ShardOrigin, encode_header, encode_origins
from .storage import Storage, get_storage
from .tensor_bytes import byte_pieces, byte_view, is_direct

Clock = Callable[[], _dt.datetime]
_OVERLAP_MIN = 1 << 20  # pieces at least this large are hashed on a helper thread during the write
DEFAULT_PART_SIZE = 64 << 20  # bytes one writer thread writes and hashes at a time (a multiple of chunks)


def default_writer_versions() -> dict[str, str]:
    from . import __version__

    return {"shardfmt": __version__, "torch": torch.__version__.split("+")[0],
            "python": platform.python_version()}


def format_time(t: _dt.datetime) -> str:
    if t.tzinfo is None:
        t = t.replace(tzinfo=_dt.timezone.utc)
    return t.astimezone(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def new_save_id() -> str:
    return uuid.uuid4().hex[:16]


@dataclass(frozen=True, slots=True, kw_only=True)
class ShardData:
    """One slice of a global tensor to write: its data and where it sits globally."""

    fqn: str
    data: torch.Tensor
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    placement: Placement | None = None

    def __post_init__(self) -> None:
        shape = tuple(self.data.shape)
        if len(shape) != len(self.global_shape) or len(self.offsets) != len(shape):
            raise ShapeError(f"{self.fqn}: local shape {list(shape)}, offsets {list(self.offsets)} and "
                             f"global shape {list(self.global_shape)} differ in rank")
        for d, (o, n, g) in enumerate(zip(self.offsets, shape, self.global_shape)):
            if o < 0 or o + n > g:
                raise ShapeError(f"{self.fqn}: dim {d}: slice [{o}, {o + n}) is outside the global size {g}")


@dataclass(frozen=True, slots=True, kw_only=True)
class WrittenFile:
    """What writing one file produced: its record and the shard records inside it."""

    name: str
    record: FileRecord
    shards: tuple[tuple[str, ShardRecord], ...]  # (fqn, shard)


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
) -> WrittenFile:
    """Write ``shards`` (in the given order) into ``directory/name``, hashing chunks as they are written.

    With ``workers > 1`` on a storage with positional writes, and every shard's memory
    contiguous on the CPU, the file is cut into ``part_size`` parts (whole hash chunks) that
    threads write and hash independently, straight from tensor memory. Otherwise the file is
    streamed in order, hashing each piece on a helper thread while the OS writes it.
    """
    if part_size % chunk_size or part_size <= 0:
        raise CommitError(f"part_size {part_size} must be a positive multiple of chunk_size {chunk_size}")
    keys = _file_keys(shards)
    if len(set(keys)) != len(keys):
        dup = sorted({k for k in keys if keys.count(k) > 1})
        raise StateDictError(f"{name}: safetensors key(s) {dup[:3]} would name two entries (two shards of one "
                             "tensor at the same offsets, or a tensor whose name looks like 'fqn@offsets')")
    header = encode_header(
        [(k, dtype_code(s.data.dtype, what=s.fqn), tuple(s.data.shape)) for k, s in zip(keys, shards)],
        metadata={"format": "shardfmt", "rank": str(rank),
                  "shards": encode_origins({k: ShardOrigin(fqn=s.fqn, offsets=tuple(s.offsets),
                                                           global_shape=tuple(s.global_shape))
                                            for k, s in zip(keys, shards)})},
    )
    path = storage.join(directory, name)
    w = storage.open_writer(path)
    try:
        segments = _direct_segments(header, shards)
        if workers > 1 and segments is not None and hasattr(w, "pwrite") and header.file_size > part_size:
            chunks, total = _write_parts(w, segments, header.file_size, chunk_size=chunk_size,
                                         part_size=part_size, workers=workers)
        else:
            chunks, total = _write_stream(w, header.data, shards, chunk_size)
    except BaseException:
        w.abort()
        raise
    w.close(sync=sync)
    chunks = tuple(chunks)
    if total != header.file_size:
        raise CommitError(f"{path}: wrote {total} bytes, header promised {header.file_size}")
    record = FileRecord(rank=rank, size=total, header_size=len(header.data),
                        header_digest=hashing.digest_bytes(header.data), chunks=chunks,
                        digest=hashing.combine(chunks))
    shard_records = []
    for entry, s in zip(header.entries, shards):
        span = hashing.chunk_span(entry.start, entry.end, chunk_size)
        shard_records.append((s.fqn, ShardRecord(
            offsets=tuple(s.offsets), lengths=tuple(s.data.shape), file=name, key=entry.key,
            byte_range=(entry.start, entry.end), digest=hashing.combine(chunks[span.start:span.stop]),
        )))
    return WrittenFile(name=name, record=record, shards=tuple(shard_records))


def _write_stream(w, header_bytes: bytes, shards: Sequence[ShardData], chunk_size: int) -> tuple[list[str], int]:
    """Write the file in order; hash each large piece on a helper thread while the OS writes it."""
    hasher = hashing.ChunkHasher(chunk_size)
    pool = None
    pending = None
    try:
        hasher.update(header_bytes)
        w.write(header_bytes)
        for s in shards:
            for piece in byte_pieces(s.data):
                if len(piece) < _OVERLAP_MIN:
                    if pending is not None:
                        pending.result()
                        pending = None
                    hasher.update(piece)
                    w.write(piece)
                    continue
                # Both drop the GIL: the save then costs ~max(write, hash) instead of their sum.
                if pool is None:
                    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardfmt-hash")
                if pending is not None:
                    pending.result()
                pending = pool.submit(hasher.update, piece)
                w.write(piece)
        if pending is not None:
            pending.result()
    finally:
        if pool is not None:
            pool.shutdown(wait=True)
    return hasher.finish(), hasher.total


def _direct_segments(header, shards: Sequence[ShardData]) -> list[tuple[int, memoryview]] | None:
    """(file offset, bytes) of the header and every shard, when all are zero-copy views; else None."""
    segments = [(0, memoryview(header.data))]
    for entry, s in zip(header.entries, shards):
        if s.data.numel() == 0:
            continue
        if not is_direct(s.data):
            return None
        segments.append((entry.start, byte_view(s.data)))
    return segments


def _write_parts(w, segments: list[tuple[int, memoryview]], file_size: int, *, chunk_size: int,
                 part_size: int, workers: int) -> tuple[list[str], int]:
    """Write and hash ``[k * part_size, (k + 1) * part_size)`` parts of the file on ``workers`` threads."""
    starts = [off for off, _ in segments]

    def part(lo: int) -> tuple[list[str], int]:
        hi = min(lo + part_size, file_size)
        hasher = hashing.ChunkHasher(chunk_size)  # parts start on chunk boundaries: their chunks are the file's
        i = max(0, bisect.bisect_right(starts, lo) - 1)
        pos = lo
        while pos < hi:
            off, mv = segments[i]
            a, b = max(pos - off, 0), min(hi - off, len(mv))
            if off > pos or a >= b:
                raise CommitError(f"internal: no data for byte {pos} of the file")
            piece = mv[a:b]
            w.pwrite(off + a, piece)
            hasher.update(piece)
            pos = off + b
            i += 1
        w.start_writeback(lo, hi - lo)
        return hasher.finish(), hasher.total

    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="shardfmt-write") as pool:
        results = list(pool.map(part, range(0, file_size, part_size)))
    return [d for digests, _ in results for d in digests], sum(n for _, n in results)


def default_write_workers() -> int:
    """Writer threads per rank: the cores this rank may use (``LOCAL_WORLD_SIZE`` share), 1 to 4."""
    local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    return max(1, min(4, (os.cpu_count() or 1) // local))


@dataclass
class _TensorMeta:
    dtype: str
    shape: tuple[int, ...]
    placement: Placement | None = None
    shards: list[ShardRecord] = field(default_factory=list)


class _Lease:
    """Keep a staging dir's mtime fresh while the save runs, so collectors leave it alone."""

    def __init__(self, storage: Storage, path: str, lease_seconds: float) -> None:
        self._stop = threading.Event()
        self._thread = None
        if not storage.atomic_rename:
            return
        interval = max(0.5, lease_seconds / 4)

        def beat() -> None:
            while not self._stop.wait(interval):
                storage.touch(path)

        self._thread = threading.Thread(target=beat, name="shardfmt-lease", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()


class CheckpointWriter:
    """Write the files of any number of ranks from one process, then commit once.

    Protocol::

        1) w = CheckpointWriter(path, ...)        checks the destination, stages a temp dir
        2) w.write_rank(rank, shards) per file    streams + hashes each file
        3) w.add_alias / add_view / add_value     non-shard records
        4) w.commit(step=..., topology=...)       manifest, COMMITTED, atomic publish
        (on any failure: w.abort() removes the staging dir)
    """

    def __init__(
        self,
        path: str,
        *,
        storage: Storage | None = None,
        storage_options: dict | None = None,
        overwrite: bool = False,
        save_id: str | None = None,
        clock: Clock | None = None,
        writer_versions: Mapping[str, str] | None = None,
        chunk_size: int = hashing.DEFAULT_CHUNK_SIZE,
        sync: bool = True,
        on_step: _commit.StepHook | None = None,
        lease_seconds: float = DEFAULT_LEASE_SECONDS,
        write_workers: int | None = None,
        part_size: int = DEFAULT_PART_SIZE,
    ) -> None:
        if not 4096 <= chunk_size <= 1 << 30:
            raise CommitError(f"chunk_size {chunk_size} is outside [4096, 2^30]")
        if storage is None:
            storage, path = get_storage(path, storage_options)
        self.storage = storage
        self.path = path
        self.save_id = save_id or new_save_id()
        self._clock = clock or (lambda: _dt.datetime.now(_dt.timezone.utc))
        self._writer_versions = dict(writer_versions) if writer_versions is not None else default_writer_versions()
        self.chunk_size = chunk_size
        self._sync = sync
        self.write_workers = write_workers or default_write_workers()
        self.part_size = part_size
        self._on_step = on_step
        self._overwrite = overwrite
        self._files: dict[str, FileRecord] = {}
        self._tensors: dict[str, _TensorMeta] = {}
        self._storages: dict[str, _TensorMeta] = {}
        self._aliases: dict[str, str] = {}
        self._views: dict[str, tuple[str, tuple[int, ...], ViewRecord]] = {}
        self._values: dict[str, ValueRecord] = {}
        self._done = False
        self.staging = _commit.prepare(storage, path, self.save_id, overwrite=overwrite)
        self._lease = _Lease(storage, self.staging, lease_seconds)

    # -- 2) data files
    def write_rank(self, rank: int, shards: Sequence[ShardData], *, part: int | None = None,
                   storages: Sequence[ShardData] = ()) -> WrittenFile:
        """Write one data file holding ``shards`` (and storage buffers) for ``rank``."""
        name = rank_file_name(rank, part)
        if name in self._files:
            raise CommitError(f"{name}: written twice in one save")
        # Larger elements first, then by name: every tensor then starts at a multiple of its
        # element size (the header is padded to 8), so readers can view bytes in place.
        ordered = sorted(list(shards) + list(storages),
                         key=lambda s: (-s.data.element_size(), s.fqn, s.offsets))
        storage_names = {s.fqn for s in storages}
        for s in ordered:
            table = self._storages if s.fqn in storage_names else self._tensors
            code = dtype_code(s.data.dtype, what=s.fqn)
            meta = table.get(s.fqn)
            if meta is None:
                table[s.fqn] = _TensorMeta(code, tuple(s.global_shape), s.placement)
            elif (meta.dtype, meta.shape) != (code, tuple(s.global_shape)):
                raise ShapeError(f"{s.fqn}: shards disagree on dtype/shape ({meta.dtype} {list(meta.shape)} vs "
                                 f"{code} {list(s.global_shape)})")
        try:
            written = write_shard_file(self.storage, self.staging, name, rank, ordered,
                                       chunk_size=self.chunk_size, sync=self._sync,
                                       workers=self.write_workers, part_size=self.part_size)
        except BaseException:
            self.abort()
            raise
        self._files[name] = written.record
        for fqn, shard in written.shards:
            (self._storages if fqn in storage_names else self._tensors)[fqn].shards.append(shard)
        return written

    def add_file(self, written: WrittenFile,
                 tensor_meta: Mapping[str, tuple[str, tuple[int, ...], Placement | None]],
                 storage_names: frozenset[str] = frozenset()) -> None:
        """Record a file another process wrote: ``tensor_meta`` maps fqn -> (dtype, shape, placement)."""
        if written.name in self._files:
            raise CommitError(f"{written.name}: recorded twice in one save")
        self._files[written.name] = written.record
        for fqn, shard in written.shards:
            table = self._storages if fqn in storage_names else self._tensors
            t = table.get(fqn)
            if t is None:
                dtype, shape, placement = tensor_meta[fqn]
                t = table[fqn] = _TensorMeta(dtype, tuple(shape), placement)
            t.shards.append(shard)

    # -- 3) other records
    def add_alias(self, fqn: str, target: str) -> None:
        self._aliases[fqn] = target

    def add_view(self, fqn: str, dtype: str, shape: tuple[int, ...], view: ViewRecord) -> None:
        self._views[fqn] = (dtype, tuple(shape), view)

    def add_value(self, fqn: str, value: Any = None, *, per_rank: Mapping[int, Any] | None = None) -> None:
        if per_rank is not None:
            self._values[fqn] = ValueRecord(per_rank={int(r): jsonvalue.encode(v, where=fqn)
                                                      for r, v in per_rank.items()})
        else:
            self._values[fqn] = ValueRecord(value=jsonvalue.encode(value, where=fqn))

    def add_encoded_value(self, fqn: str, record: ValueRecord) -> None:
        self._values[fqn] = record

    # -- 4) commit
    def build_manifest(self, *, step: int | None = None, metadata: Any = None,
                       topology: Topology | None = None) -> Manifest:
        from reshard.geometry import Box, tiling_problems

        tensors: dict[str, TensorRecord] = {}
        storages: dict[str, TensorRecord] = {}
        for table, out in ((self._tensors, tensors), (self._storages, storages)):
            for fqn in sorted(table):
                meta = table[fqn]
                shards = tuple(sorted(meta.shards, key=lambda s: (s.offsets, s.file)))
                problems = tiling_problems([Box(s.offsets, s.lengths) for s in shards], Box.full(meta.shape))
                if problems:
                    raise CommitError(f"tensor {fqn!r}: shards do not tile its shape: {problems[0]}")
                out[fqn] = TensorRecord(dtype=meta.dtype, shape=meta.shape, placement=meta.placement, shards=shards)
        for fqn, target in sorted(self._aliases.items()):
            if fqn in tensors:
                raise StateDictError(f"{fqn}: both stored and aliased")
            t = tensors.get(target)
            if t is None:
                raise StateDictError(f"{fqn}: alias target {target!r} is not stored")
            tensors[fqn] = TensorRecord(dtype=t.dtype, shape=t.shape, alias_of=target)
        for fqn, (dtype, shape, view) in sorted(self._views.items()):
            tensors[fqn] = TensorRecord(dtype=dtype, shape=shape, view=view)
        tensors = dict(sorted(tensors.items()))
        return Manifest(
            save_id=self.save_id,
            created_at=format_time(self._clock()),
            step=step,
            writer=self._writer_versions,
            chunk_size=self.chunk_size,
            metadata=jsonvalue.encode(metadata, where="metadata"),
            topology=topology or Topology(world_size=max([f.rank for f in self._files.values()], default=0) + 1),
            files=dict(sorted(self._files.items())),
            tensors=tensors,
            storages=storages,
            values=dict(sorted(self._values.items())),
        )

    def commit(self, *, step: int | None = None, metadata: Any = None,
               topology: Topology | None = None) -> Manifest:
        """Build the manifest and publish the checkpoint; abort on any failure."""
        if step is not None and (not isinstance(step, int) or isinstance(step, bool) or not 0 <= step <= 1 << 62):
            self.abort()
            raise StateDictError(f"step must be an integer in [0, 2^62], got {step!r}")
        if self._done:
            raise CommitError(f"{self.path}: this writer already finished")
        try:
            manifest = self.build_manifest(step=step, metadata=metadata, topology=topology)
            _commit.publish(self.storage, self.path, self.staging, manifest, overwrite=self._overwrite,
                            on_step=self._on_step)
        except BaseException:
            self.abort()
            raise
        self._done = True
        self._lease.stop()
        return manifest

    def abort(self) -> None:
        """Discard everything staged (never touches a committed checkpoint)."""
        if self._done:
            return
        self._done = True
        self._lease.stop()
        if self.staging != self.path or not _commit.is_committed(self.storage, self.path):
            _commit.abort(self.storage, self.staging)

    def __enter__(self) -> CheckpointWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()


__all__ = ["CheckpointWriter", "ShardData", "WrittenFile", "write_shard_file", "ShardfmtError"]
