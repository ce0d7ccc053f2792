"""The validator: every finding about a checkpoint, as data (it never logs-and-returns).

Quick checks (default): COMMITTED present and parseable; manifest.json hashes to the digest
COMMITTED records; format version supported (a later version's checkpoint gets the one finding
"format_version": this reader cannot judge it); every field well-formed (the field parser, which
rejects first); then the JSON Schema on a bounded sample of the manifest (``schema_sample``);
every listed file present with its recorded size; each safetensors header agrees with the
manifest (names, dtypes, shapes, byte ranges); derived digests agree with the chunk digests;
each tensor's shards tile its shape (``shardfmt.layout.tiling``: linear in the shards).
``deep=True`` additionally re-hashes every chunk of every file and reports each mismatch
with its file and byte range.
"""

from __future__ import annotations

import functools
import itertools
import json
from dataclasses import dataclass
from importlib import resources

from shardfmt.errors import (
    CheckpointNotFoundError,
    FormatVersionError,
    ShardfmtError,
    SpecialFileError,
    StorageError,
)
from shardfmt.format import hashing, jsonvalue
from shardfmt.format.jsonscan import Lazy
from shardfmt.format.manifest import COMMITTED_NAME, FORMAT_VERSION, MANIFEST_NAME, Manifest
from shardfmt.format.parse import load_json, manifest_from_obj, migrate
from shardfmt.format.safetensors import PREFIX_BYTES, decode_header, decode_origins, header_length
from shardfmt.io.registry import get_storage
from shardfmt.io.store import Storage
from shardfmt.layout.geometry import Box
from shardfmt.layout.tiling import tiling_problems
from shardfmt.loading.reader import read_commit, read_manifest_bytes, resolve_path, shard_key_ok

READ_PIECE = 16 << 20


@dataclass(frozen=True, slots=True, kw_only=True)
class Problem:
    """One finding: what is wrong and where (file, tensor, byte range when known)."""

    code: str
    message: str
    file: str | None = None
    tensor: str | None = None
    byte_range: tuple[int, int] | None = None

    def to_json(self) -> dict:
        out = {"code": self.code, "message": self.message}
        if self.file is not None:
            out["file"] = self.file
        if self.tensor is not None:
            out["tensor"] = self.tensor
        if self.byte_range is not None:
            out["byte_range"] = list(self.byte_range)
        return out

    def __str__(self) -> str:
        where = " ".join(x for x in (self.file, f"tensor {self.tensor!r}" if self.tensor else None,
                                     f"bytes [{self.byte_range[0]}, {self.byte_range[1]})" if self.byte_range else None)
                         if x)
        return f"[{self.code}] {where + ': ' if where else ''}{self.message}"


@dataclass(frozen=True, slots=True, kw_only=True)
class ValidationReport:
    """The validator's verdict: ``ok`` when ``problems`` is empty."""

    path: str
    deep: bool
    problems: tuple[Problem, ...]
    manifest: Manifest | None = None

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def unsupported(self) -> bool:
        """Whether the one finding is a format version this reader cannot read: not a verdict."""
        return bool(self.problems) and all(p.code == "format_version" for p in self.problems)

    def to_json(self) -> dict:
        return {"path": self.path, "deep": self.deep, "ok": self.ok,
                "problems": [p.to_json() for p in self.problems]}


@functools.lru_cache(maxsize=1)
def manifest_schema() -> dict:
    """Return the manifest JSON Schema shipped with the package (spec/manifest.schema.json)."""
    text = resources.files("shardfmt").joinpath("manifest.schema.json").read_text(encoding="utf-8")
    return json.loads(text)


SCHEMA_SAMPLE = 32  # entries of each map (files, tensors, ...) and of each list the schema pass sees
SCHEMA_VALUE_NODES = 1000  # JSON nodes of one typed-JSON value (metadata, a value) the schema pass sees


def schema_sample(obj) -> dict:
    """A bounded sample of a manifest object (parsed, or Lazy) for the JSON Schema pass: the top
    level, the first ``SCHEMA_SAMPLE`` entries of ``files``, ``tensors``, ``storages`` and
    ``values``, of every record's ``shards`` and ``chunks`` and of ``topology.ranks``, and
    typed-JSON values of at most ``SCHEMA_VALUE_NODES`` nodes (a larger one is sampled as null).
    The schema has no minimum sizes above 3, so a sample of a conforming manifest conforms.
    jsonschema spends ~0.1 ms per node: run over a 490 MB manifest it took hours, and every entry
    is checked by the field parser and the typed-JSON decoder anyway."""
    out = dict(obj.items())
    for key in ("files", "tensors", "storages", "values"):
        if _is_obj(out.get(key)):
            out[key] = {k: _sample_record(v) for k, v in itertools.islice(out[key].items(), SCHEMA_SAMPLE)}
    if "metadata" in out:
        out["metadata"] = _small_or_null(out["metadata"])
    topo = out.get("topology")
    if _is_obj(topo):
        topo = dict(topo.items())
        if _is_list(topo.get("ranks")):
            topo["ranks"] = list(itertools.islice(topo["ranks"], SCHEMA_SAMPLE))
        out["topology"] = topo
    return out


def _is_obj(v) -> bool:
    return isinstance(v, dict) or isinstance(v, Lazy) and v.kind == "object"


def _is_list(v) -> bool:
    return isinstance(v, list) or isinstance(v, Lazy) and v.kind == "array"


def _sample_record(rec):
    if not _is_obj(rec):
        return rec
    out = dict(rec.items())
    for key in ("shards", "chunks"):
        if _is_list(out.get(key)):
            out[key] = list(itertools.islice(out[key], SCHEMA_SAMPLE))
    if "value" in out:
        out["value"] = _small_or_null(out["value"])
    if _is_obj(out.get("per_rank")):
        out["per_rank"] = {k: _small_or_null(v) for k, v in itertools.islice(out["per_rank"].items(), SCHEMA_SAMPLE)}
    return out


def _small_or_null(value):
    """``value`` if it has at most SCHEMA_VALUE_NODES JSON nodes, else None (counting stops there)."""
    if isinstance(value, Lazy):
        return None
    stack, seen = [value], 0
    while stack:
        v = stack.pop()
        seen += 1
        if seen > SCHEMA_VALUE_NODES:
            return None
        if isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return value


def _schema_problems(obj) -> list[Problem]:
    import jsonschema

    validator = jsonschema.Draft202012Validator(manifest_schema())
    out = []
    for err in sorted(validator.iter_errors(schema_sample(obj)), key=lambda e: list(map(str, e.absolute_path)))[:50]:
        where = "/".join(str(p) for p in err.absolute_path) or "<root>"
        out.append(Problem(code="schema", message=f"{where}: {err.message[:300]}", file=MANIFEST_NAME))
    return out


def validate(path: str, *, deep: bool = False, storage_options: dict | None = None,
             storage: Storage | None = None) -> ValidationReport:
    """Check the checkpoint at ``path`` and return every problem found.

    Raises ``CheckpointNotFoundError``/``StorageError`` only when ``path`` cannot be reached
    at all or names no checkpoint (``reader.not_a_checkpoint``: a Checkpointer root, a Hugging
    Face folder); everything wrong with the checkpoint itself is a Problem in the report.
    """
    if storage is None:
        storage, path = get_storage(path, storage_options)
    path = resolve_path(storage, path)
    problems: list[Problem] = []

    def done(manifest=None) -> ValidationReport:
        return ValidationReport(path=path, deep=deep, problems=tuple(problems), manifest=manifest)

    try:
        commit = read_commit(storage, path)
    except (CheckpointNotFoundError, StorageError):
        raise  # the path cannot be reached or names no checkpoint (a root, a Hugging Face folder; a
        # COMMITTED that is a FIFO, a link or a directory, or none next to a manifest, is a problem)
    except FormatVersionError as e:  # a later version's marker: this reader cannot judge the rest
        problems.append(Problem(code="format_version", message=str(e), file=COMMITTED_NAME))
        return done()
    except ShardfmtError as e:
        problems.append(Problem(code="not_committed", message=str(e), file=COMMITTED_NAME))
        commit = None
    try:
        raw = read_manifest_bytes(storage, path)
    except StorageError:
        raise
    except ShardfmtError as e:
        problems.append(Problem(code="manifest_missing", message=str(e), file=MANIFEST_NAME))
        return done()
    if commit is not None:
        got = hashing.digest_bytes(raw)
        if got != commit.manifest_digest:
            problems.append(Problem(code="manifest_digest", file=MANIFEST_NAME,
                                    message=f"hashes to {got}, COMMITTED records {commit.manifest_digest}"))
    try:
        obj = load_json(raw, source=MANIFEST_NAME)
    except ShardfmtError as e:
        problems.append(Problem(code="manifest_json", message=str(e), file=MANIFEST_NAME))
        return done()
    try:
        manifest = manifest_from_obj(obj, source=MANIFEST_NAME, size=len(raw))
    except FormatVersionError as e:  # a later version's: its digest and fields are not this reader's to judge
        problems[:] = [p for p in problems if p.code == "not_committed"]
        problems.append(Problem(code="format_version", message=str(e), file=MANIFEST_NAME))
        return done()
    except ShardfmtError as e:  # rejected: the schema pass would only repeat it, at a cost
        problems.append(Problem(code="manifest_field", message=str(e), file=MANIFEST_NAME))
        return done()
    if isinstance(obj, dict) and obj.get("format_version") != FORMAT_VERSION:
        obj = migrate(obj)  # the schema describes the current version (the parse above checked the rest)
    problems.extend(_schema_problems(obj))
    if commit is not None and manifest.save_id != commit.save_id:
        problems.append(Problem(code="save_id", file=COMMITTED_NAME,
                                message=f"save_id {commit.save_id!r} != manifest save_id {manifest.save_id!r}"))
    _check_values(manifest, problems)
    _check_files(storage, path, manifest, problems, deep=deep)
    _check_tensors(manifest, problems)
    return done(manifest)


def _check_values(m: Manifest, problems: list[Problem]) -> None:
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


def check_files(storage: Storage, path: str, m: Manifest, *, deep: bool) -> list[Problem]:
    """Check the data files under ``path`` against ``m`` (sizes, headers; with ``deep``, every
    chunk's hash) without requiring a commit marker: how a copy is verified before its commit."""
    problems: list[Problem] = []
    _check_files(storage, path, m, problems, deep=deep)
    return problems


def _check_files(storage: Storage, path: str, m: Manifest, problems: list[Problem], *, deep: bool) -> None:
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
