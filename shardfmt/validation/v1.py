"""Version 1: the checks of a whole manifest's files, headers, shard digests and tilings.

Every listed file present with its recorded size; each safetensors header agrees with the
manifest (names, dtypes, shapes, byte ranges); derived digests agree with the chunk digests;
each tensor's shards tile its shape (linear in the shards). ``deep`` re-hashes every chunk.
"""

from __future__ import annotations

from collections.abc import Callable

from shardfmt.errors import ShardfmtError, SpecialFileError
from shardfmt.format import hashing, jsonvalue
from shardfmt.format.manifest import Manifest
from shardfmt.format.safetensors import PREFIX_BYTES, decode_header, decode_origins, header_length
from shardfmt.io.store import Storage
from shardfmt.layout.geometry import Box
from shardfmt.layout.tiling import tiling_problems
from shardfmt.loading.reader import shard_key_ok
from shardfmt.validation.report import Problem

READ_PIECE = 16 << 20


def check_v1(storage: Storage, path: str, m: Manifest, problems: list[Problem], *, deep: bool,
             progress: Callable[[int], None] | None = None) -> None:
    """Every check of a version-1 checkpoint past its manifest's fields (``progress``: called
    with each data file's size once it is checked)."""
    check_values(m, problems)
    _check_files(storage, path, m, problems, deep=deep, progress=progress)
    _check_tensors(m, problems)


def check_values(m: Manifest, problems: list[Problem]) -> None:
    """Every typed-JSON value (and the metadata) must decode."""
    items = [("metadata", m.metadata)]
    for fqn, rec in m.values.items():
        if rec.per_rank is None:
            items.append((fqn, rec.value))
        else:
            items.extend((f"{fqn}[rank {r}]", v) for r, v in rec.per_rank.items())
    for where, v in items:
        try:
            jsonvalue.decode(v, where=where)
        except ShardfmtError as e:
            problems.append(Problem(code="value", tensor=where, message=str(e)))


def _check_tensors(m: Manifest, problems: list[Problem]) -> None:
    for table in (m.tensors, m.storages):
        for fqn, rec in table.items():
            if rec.alias_of is not None or rec.view is not None:
                continue
            for msg in tiling_problems([Box(s.offsets, s.lengths) for s in rec.shards], Box.full(rec.shape)):
                problems.append(Problem(code="tiling", tensor=fqn, message=msg))
            for s in rec.shards:
                span = hashing.chunk_span(s.byte_range[0], s.byte_range[1], m.chunk_size)
                chunks = m.files[s.file].chunks
                if span.stop > len(chunks) or hashing.combine(chunks[span.start:span.stop]) != s.digest:
                    problems.append(Problem(code="shard_digest", tensor=fqn, file=s.file, byte_range=s.byte_range,
                                            message="shard digest does not derive from the file's chunk digests"))


def _check_files(storage: Storage, path: str, m: Manifest, problems: list[Problem], *, deep: bool,
                 progress: Callable[[int], None] | None = None) -> None:
    by_file: dict[str, list[tuple[str, object]]] = {}
    for table in (m.tensors, m.storages):
        for fqn, rec in table.items():
            for s in rec.shards:
                by_file.setdefault(s.file, []).append((fqn, rec.dtype, tuple(rec.shape), s))
    for name, frec in m.files.items():
        if hashing.combine(frec.chunks) != frec.digest:
            problems.append(Problem(code="file_digest", file=name,
                                    message="file digest does not derive from its chunk digests"))
        full = storage.join(path, name)
        try:
            reader = storage.open_reader(full, within=path)
        except SpecialFileError as e:  # a FIFO, a device, a link (spec section 2)
            problems.append(Problem(code="special_file", file=name, message=str(e)))
            continue
        except ShardfmtError as e:
            problems.append(Problem(code="file_missing", file=name, message=str(e)))
            continue
        try:
            if reader.size != frec.size:
                problems.append(Problem(code="file_size", file=name,
                                        message=f"is {reader.size} bytes, manifest says {frec.size}"))
                continue
            _check_header(reader, name, frec, by_file.get(name, []), problems)
            if deep:
                _rehash(reader, name, frec, m.chunk_size, problems)
        except ShardfmtError as e:
            problems.append(Problem(code="file_read", file=name, message=str(e)))
        finally:
            reader.close()
            if progress is not None:
                progress(frec.size)


def _read(reader, offset: int, n: int) -> bytearray:
    buf = bytearray(n)
    reader.readinto(offset, [memoryview(buf)])
    return buf


def _check_header(reader, name: str, frec, shards: list, problems: list[Problem]) -> None:
    size = reader.size
    prefix = _read(reader, 0, min(PREFIX_BYTES, size))
    try:
        n = header_length(bytes(prefix), source=name, file_size=size)
        raw = bytes(prefix) + bytes(_read(reader, PREFIX_BYTES, n))
        header = decode_header(raw, source=name, file_size=size)
        entries = header.entries
        origins = decode_origins(header.metadata, source=name)
    except ShardfmtError as e:
        problems.append(Problem(code="header", file=name, message=str(e)))
        return
    if len(raw) != frec.header_size or hashing.digest_bytes(raw) != frec.header_digest:
        problems.append(Problem(code="header", file=name, byte_range=(0, len(raw)),
                                message=f"header ({len(raw)} bytes) does not match the manifest's "
                                        f"header_size {frec.header_size} / header_digest"))
    listed = set()
    for fqn, dtype, shape, s in shards:
        listed.add(s.key)
        e = entries.get(s.key)
        if not shard_key_ok(fqn, s):
            problems.append(Problem(code="header", file=name, tensor=fqn,
                                    message=f"key {s.key!r} is not a key this tensor's shard may have"))
        o = origins.get(s.key)
        if o is None or (o.fqn, o.offsets, o.global_shape) != (fqn, tuple(s.offsets), shape):
            problems.append(Problem(code="header", file=name, tensor=fqn, byte_range=s.byte_range,
                                    message=f"the file places key {s.key!r} at "
                                            f"{None if o is None else (o.fqn, list(o.offsets), list(o.global_shape))}, "
                                            f"the manifest at offsets {list(s.offsets)} of shape {list(shape)}"))
        if e is None:
            problems.append(Problem(code="header", file=name, tensor=fqn,
                                    message=f"key {s.key!r} is not in the safetensors header"))
            continue
        if (e.start, e.end) != tuple(s.byte_range) or e.shape != tuple(s.lengths) or e.dtype != dtype:
            problems.append(Problem(code="header", file=name, tensor=fqn, byte_range=s.byte_range,
                                    message=f"header says {e.dtype} {list(e.shape)} at [{e.start}, {e.end}), "
                                            f"manifest says {dtype} {list(s.lengths)} at {list(s.byte_range)}"))
    for key in sorted(set(entries) - listed):
        problems.append(Problem(code="header", file=name, message=f"header key {key!r} is not in the manifest"))


def _rehash(reader, name: str, frec, chunk_size: int, problems: list[Problem]) -> None:
    pos = 0
    size = frec.size
    piece = max(chunk_size, (READ_PIECE // chunk_size) * chunk_size)
    k = 0
    while pos < size:
        n = min(piece, size - pos)
        buf = memoryview(_read(reader, pos, n))
        for off in range(0, n, chunk_size):
            got = hashing.digest_bytes(buf[off : off + chunk_size])
            lo = pos + off
            if k >= len(frec.chunks) or got != frec.chunks[k]:
                problems.append(Problem(code="chunk_hash", file=name,
                                        byte_range=(lo, min(lo + chunk_size, size)),
                                        message=f"chunk {k} hashes to {got}, manifest says "
                                                f"{frec.chunks[k] if k < len(frec.chunks) else 'nothing'}"))
            k += 1
        pos += n
