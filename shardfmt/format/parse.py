"""Parse a manifest (and COMMITTED) from bytes: every field by its own parser, budgeted.

``parse_manifest(raw)`` checks every field and raises ``ManifestError`` naming the field
path; large documents are walked in pieces (``jsonscan``) so memory stays bounded by the
document's size; older format versions are migrated first. The JSON Schema check lives in
the validator.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping
from typing import Any

import orjson

from shardfmt.errors import FormatVersionError, ManifestError
from shardfmt.format import jsonscan
from shardfmt.format.dtypes import SUPPORTED_DTYPES, itemsize
from shardfmt.format.fields import (
    RANK_KEY_RE,
    check_keys,
    check_links,
    check_names,
    check_step,
    common_fields,
    digest_field,
    dims_field,
    fail,
    int_field,
    list_field,
    obj_field,
    parse_file_name,
    parse_mesh,
    parse_placement,
    record_fields,
    step_field,
    str_field,
)
from shardfmt.format.jsonscan import Budget, Lazy, check_depth, plain
from shardfmt.format.manifest import (
    FORMAT_NAME,
    FORMAT_VERSION,
    MAX_COMMITTED_BYTES,
    MAX_MANIFEST_BYTES,
    READ_VERSIONS,
    CommitRecord,
    FileRecord,
    Manifest,
    ShardRecord,
    TensorRecord,
    Topology,
    ValueRecord,
    ViewRecord,
)
from shardfmt.format.parse_v2 import root_fields

__all__ = ["check_step", "parse_file_name", "parse_commit", "parse_manifest", "parse_file_record",
           "parse_shard_record", "parse_tensor_record", "load_json", "manifest_from_obj", "check_version"]

# --------------------------------------------------------------------------- version 1


def parse_shard_record(v: Any, where: str, *, name: str, ndim: int, shape: tuple[int, ...], isz: int,
                 files: Mapping[str, FileRecord]) -> ShardRecord:
    o = record_fields(v, where, {"offsets", "lengths", "file", "key", "byte_range", "digest"})
    offsets = dims_field(o["offsets"], where + ".offsets")
    lengths = dims_field(o["lengths"], where + ".lengths")
    if len(offsets) != ndim or len(lengths) != ndim:
        raise fail(where, f"offsets/lengths have rank {len(offsets)}/{len(lengths)}, tensor has {ndim}")
    for d, (off, n, s) in enumerate(zip(offsets, lengths, shape)):
        if off + n > s:
            raise fail(where, f"dim {d}: slice [{off}, {off + n}) is outside the shape {list(shape)}")
    fname = parse_file_name(o["file"], where + ".file")
    if fname not in files:
        raise fail(where + ".file", f"{fname!r} is not listed in files")
    br = list_field(o["byte_range"], where + ".byte_range", max_len=2)
    if len(br) != 2:
        raise fail(where + ".byte_range", "expected [start, end]")
    start = int_field(br[0], where + ".byte_range[0]", hi=1 << 62)
    end = int_field(br[1], where + ".byte_range[1]", hi=1 << 62)
    want = math.prod(lengths) * isz
    if end - start != want:
        raise fail(where + ".byte_range", f"[{start}, {end}) holds {end - start} bytes, the slice needs {want}")
    if start < files[fname].header_size:
        raise fail(where + ".byte_range", f"[{start}, {end}) overlaps the {files[fname].header_size}-byte "
                    f"header of {fname}")
    if end > files[fname].size:
        raise fail(where + ".byte_range", f"[{start}, {end}) is past the end of {fname} ({files[fname].size} bytes)")
    key = str_field(o["key"], where + ".key")
    return ShardRecord(  # a file's name and a tensor's name are one string object each, not one per shard
        offsets=offsets, lengths=lengths, file=sys.intern(fname), key=name if key == name else key,
        byte_range=(start, end), digest=digest_field(o["digest"], where + ".digest"),
    )


def parse_tensor_record(name: str, v: Any, where: str, files: Mapping[str, FileRecord], *,
                        flat: bool = False) -> TensorRecord:
    """A v1 tensor record (``flat``: its placement may hold a flat entry, as a v2 save's messages may)."""
    o = record_fields(v, where, {"dtype", "shape"}, {"shards", "alias_of", "view", "placement"})
    dtype = str_field(o["dtype"], where + ".dtype", max_len=32)
    if dtype not in SUPPORTED_DTYPES:
        raise fail(where + ".dtype", f"unsupported dtype {dtype!r}")
    shape = dims_field(o["shape"], where + ".shape")
    if math.prod(shape) * itemsize(dtype) > 1 << 62:
        raise fail(where + ".shape", f"{list(shape)} is impossibly large")
    kinds = [k for k in ("shards", "alias_of", "view") if k in o]
    if len(kinds) != 1:
        raise fail(where, f"needs exactly one of shards, alias_of, view (has {kinds})")
    placement = parse_placement(o.get("placement"), where + ".placement", len(shape), flat=flat)
    if "alias_of" in o:
        return TensorRecord(dtype=dtype, shape=shape, placement=placement,
                            alias_of=str_field(o["alias_of"], where + ".alias_of"))
    if "view" in o:
        vo = record_fields(o["view"], where + ".view", {"base", "storage_offset", "stride"})
        stride = dims_field(vo["stride"], where + ".view.stride")
        if len(stride) != len(shape):
            raise fail(where + ".view.stride", f"rank {len(stride)} != shape rank {len(shape)}")
        view = ViewRecord(base=str_field(vo["base"], where + ".view.base"),
                          storage_offset=int_field(vo["storage_offset"], where + ".view.storage_offset"),
                          stride=stride)
        return TensorRecord(dtype=dtype, shape=shape, placement=placement, view=view)
    isz = itemsize(dtype)
    shards = tuple(
        parse_shard_record(s, f"{where}.shards[{i}]", name=name, ndim=len(shape), shape=shape, isz=isz, files=files)
        for i, s in enumerate(list_field(o["shards"], where + ".shards"))
    )
    return TensorRecord(dtype=dtype, shape=shape, placement=placement, shards=shards)


def parse_file_record(v: Any, where: str, world_size: int) -> FileRecord:
    o = record_fields(v, where, {"rank", "size", "header_size", "header_digest", "digest", "chunks"})
    chunks = tuple(digest_field(c, f"{where}.chunks[{i}]") for i, c in enumerate(list_field(o["chunks"], where + ".chunks")))
    size = int_field(o["size"], where + ".size", hi=1 << 62)
    header_size = int_field(o["header_size"], where + ".header_size", lo=8, hi=8 + 100_000_000)
    if header_size > size:
        raise fail(where + ".header_size", f"{header_size} exceeds the file size {size}")
    rank = int_field(o["rank"], where + ".rank", hi=(1 << 24) - 1)
    if rank >= world_size:
        raise fail(where + ".rank", f"rank {rank} >= world size {world_size}")
    return FileRecord(rank=rank, size=size,
                      header_size=header_size, header_digest=digest_field(o["header_digest"], where + ".header_digest"),
                      chunks=chunks, digest=digest_field(o["digest"], where + ".digest"))


def _parse_topology(v: Any, where: str) -> Topology:
    o = record_fields(v, where, {"world_size", "mesh", "ranks"})
    ws = int_field(o["world_size"], where + ".world_size", lo=1, hi=1 << 24)
    mesh = parse_mesh(o["mesh"], where, ws)
    ranks = list_field(o["ranks"], where + ".ranks", max_len=1 << 24)
    if len(ranks) != (ws if mesh else 0):  # a count first: world_size is only what the manifest claims
        raise fail(where + ".ranks", f"lists {len(ranks)} ranks, the mesh has {ws if mesh else 0} "
                    "(every rank's row-major mesh coordinates, or [] with no mesh)")
    sizes = [s for _, s in mesh]
    coords = [0] * len(sizes)
    for r, got in enumerate(ranks):  # the rank's coordinates, counted up like an odometer
        if isinstance(got, Lazy):  # whitespace-padded past one piece
            got = list_field(got, f"{where}.ranks[{r}]", max_len=16)
        if got != coords:
            raise fail(f"{where}.ranks[{r}]", f"{str(got)[:80]} is not rank {r}'s row-major mesh coordinates {coords}")
        for d in reversed(range(len(sizes))):
            coords[d] += 1
            if coords[d] < sizes[d]:
                break
            coords[d] = 0
    return Topology(world_size=ws, mesh=tuple(mesh))


def _parse_value(v: Any, where: str, budget: Budget, world_size: int) -> ValueRecord:
    o = record_fields(v, where, set(), {"value", "per_rank"})
    if set(o) == {"value"}:
        return ValueRecord(value=plain(o["value"], budget, where, depth=4))
    if set(o) == {"per_rank"}:
        pr = obj_field(o["per_rank"], where + ".per_rank")
        out = {}
        for k, val in pr.items():
            if not RANK_KEY_RE.fullmatch(k) or int(k) >= world_size:
                raise fail(where + ".per_rank", f"rank key {k!r} is not a rank below world size {world_size}")
            budget.charge(_PER_RANK_ENTRY, where)
            out[int(k)] = plain(val, budget, f"{where}.per_rank[{k}]", depth=5)
        return ValueRecord(per_rank=out)
    raise fail(where, "expected {'value': ...} or {'per_rank': {...}}")


_PER_RANK_ENTRY = 128  # bytes a per-rank entry holds besides its value: a dict slot and an int key


def parse_manifest(raw: bytes, *, source: str = "manifest.json") -> Manifest:
    """Parse and check manifest bytes; raise ManifestError/FormatVersionError naming the field.

    Memory stays within 10 bytes per byte of manifest plus 64 MiB (spec section 12): a manifest
    larger than ``jsonscan.PIECE_MAX`` is parsed in pieces, each turned into records as it is
    read, and the typed JSON it keeps (metadata, values) is charged to a budget."""
    return manifest_from_obj(load_json(raw, source=source), source=source, size=len(raw))


def load_json(raw: bytes, *, source: str):
    """The manifest's JSON: parsed, or Lazy when larger than one piece (its members parsed as
    they are walked). Refuses a manifest over the size limit before reading it."""
    if len(raw) > MAX_MANIFEST_BYTES:
        raise ManifestError(f"{source}: {len(raw)} bytes exceeds the {MAX_MANIFEST_BYTES}-byte limit")
    return jsonscan.load(raw, source=source)


def manifest_from_obj(obj: Any, *, source: str = "manifest.json", size: int | None = None) -> Manifest:
    """Check a decoded (or Lazy) manifest object, migrating older versions, and return the record.

    ``size``: the manifest's bytes, which set what its kept typed JSON may cost (default: the
    object serialised)."""
    if size is None:
        size = obj.size if isinstance(obj, Lazy) else len(orjson.dumps(obj))
    budget = Budget.for_document(size, source)
    if isinstance(obj, Lazy):
        obj = _top_level(obj, source)
    version = check_version(obj, source=source)
    try:
        return _manifest_fields(obj, budget) if version == 1 else root_fields(obj, budget)
    except FormatVersionError as e:  # a required extension this reader lacks: keep its type
        raise FormatVersionError(str(e) if str(e).startswith(f"{source}: ") else f"{source}: {e}",
                                 version=e.version) from None
    except ManifestError as e:
        raise ManifestError(str(e) if str(e).startswith(f"{source}: ") else f"{source}: {e}") from None


MAX_TOP_FIELDS = 64  # a manifest's top level has 14 fields; a later version may add some, not thousands


def _top_level(obj: Lazy, source: str) -> dict:
    """A large manifest's top-level members as a dict (the large ones Lazy), each met once: the
    version is checked before unknown fields are, so their names are kept, but only so many."""
    if obj.kind != "object":
        raise ManifestError(f"{source}: top level must be an object")
    if len(obj) > MAX_TOP_FIELDS:
        raise ManifestError(f"{source}: the top level has {len(obj)} members (a manifest has 14)")
    out: dict = {}
    for k, v in obj.items():
        if k in out:
            raise ManifestError(f"{source}: top-level field {k!r} given twice")
        out[k] = v
    return out


def newer_version_error(source: str, version: int) -> FormatVersionError:
    """The error for a checkpoint written in ``version``, newer than this reader's (spec section 9)."""
    return FormatVersionError(f"{source}: written in format version {version}, this reader supports up to "
                              f"{FORMAT_VERSION}; upgrade shardfmt to read it", version=version)


def check_version(obj: Any, *, source: str = "manifest.json") -> int:
    """Return the manifest object's format version, once its nesting, ``format`` and version
    are checked (spec section 9): a version this package has no reader for is refused, a newer
    one naming both versions. One reader per version; there are no migrations.

    The members of a large manifest that are still Lazy are checked for nesting as they are
    parsed (typed JSON) or by type (records)."""
    check_depth(obj, source=source)
    if not isinstance(obj, dict):
        raise ManifestError(f"{source}: top level must be an object")
    if obj.get("format") != FORMAT_NAME:
        raise ManifestError(f"{source}: format is {obj.get('format')!r}, expected {FORMAT_NAME!r}")
    version = obj.get("format_version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 0:
        raise ManifestError(f"{source}: format_version {version!r} is not a version number")
    if version > FORMAT_VERSION:
        raise newer_version_error(source, version)
    if version not in READ_VERSIONS:
        raise FormatVersionError(f"{source}: format version {version} was never written by shardfmt "
                                 f"(this reader reads versions {list(READ_VERSIONS)})", version=version)
    return version


def _manifest_fields(o: dict, budget: Budget) -> Manifest:
    check_keys(o, "", {"format", "format_version", "save_id", "step", "created_at", "writer",
                  "hash_algorithm", "chunk_size", "metadata", "topology", "files", "tensors",
                  "storages", "values"})
    chunk_size, writer = common_fields(o)
    topology = _parse_topology(o["topology"], "topology")  # first: ranks are checked as records stream
    files = {parse_file_name(k, f"files[{k!r}]"): parse_file_record(v, f"files[{k!r}]", topology.world_size)
             for k, v in obj_field(o["files"], "files").items()}
    for name, f in files.items():
        want = max(1, -(-f.size // chunk_size)) if f.size else 0
        if len(f.chunks) != want:
            raise fail(f"files[{name!r}].chunks", f"{len(f.chunks)} chunk digests for {f.size} bytes "
                        f"(chunk size {chunk_size}) where {want} are needed")
    tensors = {str_field(k, "tensors key"): parse_tensor_record(k, v, f"tensors[{k!r}]", files)
               for k, v in obj_field(o["tensors"], "tensors").items()}
    storages = {str_field(k, "storages key"): parse_tensor_record(k, v, f"storages[{k!r}]", files)
                for k, v in obj_field(o["storages"], "storages").items()}
    check_links(tensors, storages)
    seen_keys: dict[tuple[str, str], str] = {}  # (file, key) -> the record that uses it
    for kind, recs in (("tensors", tensors), ("storages", storages)):
        for name, rec in recs.items():
            for i, sh in enumerate(rec.shards):
                where = f"{kind}[{name!r}].shards[{i}]"
                first = seen_keys.setdefault((sh.file, sh.key), where)
                if first != where:
                    raise fail(where + ".key", f"key {sh.key!r} of {sh.file} is used by {first} too "
                                "(a key is unique within its file)")
    values = {str_field(k, "values key"): _parse_value(v, f"values[{k!r}]", budget, topology.world_size)
              for k, v in obj_field(o["values"], "values").items()}
    check_names(tensors, storages, values)
    return Manifest(
        format_version=o["format_version"], save_id=str_field(o["save_id"], "save_id", max_len=128),
        step=step_field(o["step"]), created_at=str_field(o["created_at"], "created_at", max_len=64),
        writer=writer, chunk_size=chunk_size, metadata=plain(o["metadata"], budget, "metadata", depth=2),
        topology=topology, files=files, tensors=tensors,
        storages=storages, values=values,
    )


def parse_commit(raw: bytes, *, source: str = "COMMITTED") -> CommitRecord:
    """Parse a COMMITTED marker.

    A marker that carries a ``format_version`` newer than this reader's is a later version's
    (spec section 9): a FormatVersionError, checked before anything else could call it malformed.
    Version 1 writes exactly three keys; version 2 adds ``format_version`` = 2."""
    if len(raw) > MAX_COMMITTED_BYTES:
        raise ManifestError(f"{source}: {len(raw)} bytes exceeds the {MAX_COMMITTED_BYTES}-byte limit")
    try:
        o = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise ManifestError(f"{source}: not valid JSON ({e})") from None
    if not isinstance(o, dict) or o.get("format") != FORMAT_NAME:
        raise ManifestError(f"{source}: not a shardfmt commit marker")
    version = o.get("format_version")
    if isinstance(version, int) and not isinstance(version, bool) and version > FORMAT_VERSION:
        raise newer_version_error(source, version)
    try:
        if "format_version" in o:  # version 1 writes none; version 2 writes 2 (spec section 4.9)
            int_field(version, "format_version", lo=2, hi=2)
            check_keys(o, "", {"format", "format_version", "save_id", "manifest_digest"})
        else:
            check_keys(o, "", {"format", "save_id", "manifest_digest"})
        return CommitRecord(save_id=str_field(o["save_id"], "save_id", max_len=128),
                            manifest_digest=digest_field(o["manifest_digest"], "manifest_digest"),
                            format_version=version if "format_version" in o else 1)
    except ManifestError as e:
        raise ManifestError(f"{source}: {e}") from None
