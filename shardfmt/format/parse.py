"""Parse a manifest (and COMMITTED) from bytes: every field by its own parser, budgeted.

``parse_manifest(raw)`` checks every field and raises ``ManifestError`` naming the field
path; large documents are walked in pieces (``jsonscan``) so memory stays bounded by the
document's size; older format versions are migrated first. The JSON Schema check lives in
the validator.
"""

from __future__ import annotations

import math
import re
import sys
from collections.abc import Callable, Mapping
from typing import Any

import orjson

from shardfmt.errors import FormatVersionError, ManifestError, StateDictError
from shardfmt.format import hashing, jsonscan
from shardfmt.format.dtypes import SUPPORTED_DTYPES, itemsize
from shardfmt.format.jsonscan import Budget, Lazy, check_depth, plain
from shardfmt.format.manifest import (
    FORMAT_NAME,
    FORMAT_VERSION,
    MAX_COMMITTED_BYTES,
    MAX_DIM,
    MAX_MANIFEST_BYTES,
    MAX_NDIM,
    MAX_STEP,
    CommitRecord,
    FileRecord,
    Manifest,
    Placement,
    ShardRecord,
    TensorRecord,
    Topology,
    ValueRecord,
    ViewRecord,
    view_reach,
)

# --------------------------------------------------------------------------- parsing

Migration = Callable[[dict], dict]
_MIGRATIONS: dict[int, Migration] = {}

_FILE_RE = re.compile(r"^data/[A-Za-z0-9_][A-Za-z0-9._-]{0,200}\.safetensors$")
_MESH_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
_RANK_KEY_RE = re.compile(r"0|[1-9][0-9]{0,7}")



def register_migration(from_version: int) -> Callable[[Migration], Migration]:
    """Register a function that upgrades a manifest object of ``from_version`` by one version."""

    def deco(fn: Migration) -> Migration:
        _MIGRATIONS[from_version] = fn
        return fn

    return deco


def _fail(where: str, msg: str) -> ManifestError:
    return ManifestError(f"manifest {where}: {msg}")


def check_step(step: Any) -> None:
    """Refuse a step the manifest cannot record (None, or an int in [0, 2^62]) before any I/O."""
    if step is not None and (not isinstance(step, int) or isinstance(step, bool) or not 0 <= step <= MAX_STEP):
        raise StateDictError(f"step must be None or an integer in [0, 2^62], got {step!r}")


def _int(v: Any, where: str, *, lo: int = 0, hi: int = MAX_DIM) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise _fail(where, f"expected an integer in [{lo}, {hi}], got {v!r}")
    return v


def _str(v: Any, where: str, *, max_len: int = 4096) -> str:
    if not isinstance(v, str) or len(v) > max_len:
        raise _fail(where, f"expected a string of at most {max_len} characters, got {type(v).__name__}")
    return v


def _obj(v: Any, where: str) -> dict:
    """A map (files, tensors, ...): parsed, or Lazy (large: walked once with ``items()``)."""
    if not (isinstance(v, dict) or isinstance(v, Lazy) and v.kind == "object"):
        raise _fail(where, f"expected an object, got {_type_name(v)}")
    return v


def _record(v: Any, where: str, required: set[str], optional: set[str] = frozenset()) -> dict:
    """A record's fields as a dict. A Lazy (large) record is walked once: a field given twice is
    refused (the earlier one would go unparsed) and so is an unknown one, as soon as it is met."""
    if isinstance(v, Lazy) and v.kind == "object":
        out: dict = {}
        for k, x in v.items():
            if k in out:
                raise _fail(where, f"field {k!r} given twice")
            if k not in required and k not in optional:
                raise _fail(where, f"unknown field(s) [{k!r}]")
            out[k] = x
        v = out
    _keys(_obj(v, where), where, required, optional)
    return v


def _list(v: Any, where: str, *, max_len: int = 1 << 31) -> list:
    """A list: parsed, or Lazy (large: iterated once); a short one (a shape, a byte range) is
    always a plain list, whitespace-padded past one piece or not."""
    if not (isinstance(v, list) or isinstance(v, Lazy) and v.kind == "array"):
        raise _fail(where, f"expected a list, got {_type_name(v)}")
    if len(v) > max_len:
        raise _fail(where, f"a list of {len(v)} entries, at most {max_len} allowed")
    return list(v) if isinstance(v, Lazy) and max_len <= MAX_NDIM else v


def _type_name(v: Any) -> str:
    return ("object" if v.kind == "object" else "list") if isinstance(v, Lazy) else type(v).__name__


def _keys(obj: dict, where: str, required: set[str], optional: set[str] = frozenset()) -> None:
    missing = required - obj.keys()
    if missing:
        raise _fail(where, f"missing field(s) {sorted(missing)}")
    extra = obj.keys() - required - optional
    if extra:
        raise _fail(where, f"unknown field(s) {sorted(extra)[:5]}{' ...' if len(extra) > 5 else ''}")


def _digest(v: Any, where: str) -> str:
    try:
        hashing.parse_digest(v)
    except ValueError as e:
        raise _fail(where, str(e)) from None
    return v


def _dims(v: Any, where: str) -> tuple[int, ...]:
    lst = _list(v, where, max_len=MAX_NDIM)
    return tuple(_int(x, f"{where}[{i}]") for i, x in enumerate(lst))


def parse_file_name(v: Any, where: str) -> str:
    """Accept only ``data/<name>.safetensors``: no absolute paths, no ``..``, no odd bytes."""
    s = _str(v, where)
    if not _FILE_RE.fullmatch(s) or ".." in s:
        raise _fail(where, f"file path {s!r} is not of the form data/<name>.safetensors")
    return s


def parse_shard_record(v: Any, where: str, *, name: str, ndim: int, shape: tuple[int, ...], isz: int,
                 files: Mapping[str, FileRecord]) -> ShardRecord:
    o = _record(v, where, {"offsets", "lengths", "file", "key", "byte_range", "digest"})
    offsets = _dims(o["offsets"], where + ".offsets")
    lengths = _dims(o["lengths"], where + ".lengths")
    if len(offsets) != ndim or len(lengths) != ndim:
        raise _fail(where, f"offsets/lengths have rank {len(offsets)}/{len(lengths)}, tensor has {ndim}")
    for d, (off, n, s) in enumerate(zip(offsets, lengths, shape)):
        if off + n > s:
            raise _fail(where, f"dim {d}: slice [{off}, {off + n}) is outside the shape {list(shape)}")
    fname = parse_file_name(o["file"], where + ".file")
    if fname not in files:
        raise _fail(where + ".file", f"{fname!r} is not listed in files")
    br = _list(o["byte_range"], where + ".byte_range", max_len=2)
    if len(br) != 2:
        raise _fail(where + ".byte_range", "expected [start, end]")
    start = _int(br[0], where + ".byte_range[0]", hi=1 << 62)
    end = _int(br[1], where + ".byte_range[1]", hi=1 << 62)
    want = math.prod(lengths) * isz
    if end - start != want:
        raise _fail(where + ".byte_range", f"[{start}, {end}) holds {end - start} bytes, the slice needs {want}")
    if start < files[fname].header_size:
        raise _fail(where + ".byte_range", f"[{start}, {end}) overlaps the {files[fname].header_size}-byte "
                    f"header of {fname}")
    if end > files[fname].size:
        raise _fail(where + ".byte_range", f"[{start}, {end}) is past the end of {fname} ({files[fname].size} bytes)")
    key = _str(o["key"], where + ".key")
    return ShardRecord(  # a file's name and a tensor's name are one string object each, not one per shard
        offsets=offsets, lengths=lengths, file=sys.intern(fname), key=name if key == name else key,
        byte_range=(start, end), digest=_digest(o["digest"], where + ".digest"),
    )


def _parse_placement(v: Any, where: str, ndim: int) -> Placement | None:
    if v is None:
        return None
    o = _record(v, where, {"mesh_dims", "placements", "stage"})
    dims = tuple(_str(x, f"{where}.mesh_dims[{i}]", max_len=64)
                 for i, x in enumerate(_list(o["mesh_dims"], where + ".mesh_dims", max_len=16)))
    places = []
    for i, p in enumerate(_list(o["placements"], where + ".placements", max_len=16)):
        w = f"{where}.placements[{i}]"
        p = _list(p, w, max_len=3)
        if p == ["replicate"]:
            places.append(("replicate",))
        elif len(p) == 2 and p[0] == "shard":
            if ndim == 0:
                raise _fail(w, "a 0-d tensor cannot be sharded")
            places.append(("shard", _int(p[1], w + "[1]", hi=ndim - 1)))
        elif len(p) == 3 and p[0] == "strided_shard":
            if ndim == 0:
                raise _fail(w, "a 0-d tensor cannot be sharded")
            places.append(("strided_shard", _int(p[1], w + "[1]", hi=max(ndim - 1, 0)),
                           _int(p[2], w + "[2]", lo=1, hi=1 << 24)))
        else:
            raise _fail(w, f"unknown placement {p!r}")
    if len(places) != len(dims):
        raise _fail(where, f"{len(dims)} mesh dims but {len(places)} placements")
    stage = None if o["stage"] is None else _int(o["stage"], where + ".stage", hi=1 << 20)
    return Placement(mesh_dims=dims, placements=tuple(places), stage=stage)


def parse_tensor_record(name: str, v: Any, where: str, files: Mapping[str, FileRecord]) -> TensorRecord:
    o = _record(v, where, {"dtype", "shape"}, {"shards", "alias_of", "view", "placement"})
    dtype = _str(o["dtype"], where + ".dtype", max_len=32)
    if dtype not in SUPPORTED_DTYPES:
        raise _fail(where + ".dtype", f"unsupported dtype {dtype!r}")
    shape = _dims(o["shape"], where + ".shape")
    if math.prod(shape) * itemsize(dtype) > 1 << 62:
        raise _fail(where + ".shape", f"{list(shape)} is impossibly large")
    kinds = [k for k in ("shards", "alias_of", "view") if k in o]
    if len(kinds) != 1:
        raise _fail(where, f"needs exactly one of shards, alias_of, view (has {kinds})")
    placement = _parse_placement(o.get("placement"), where + ".placement", len(shape))
    if "alias_of" in o:
        return TensorRecord(dtype=dtype, shape=shape, placement=placement,
                            alias_of=_str(o["alias_of"], where + ".alias_of"))
    if "view" in o:
        vo = _record(o["view"], where + ".view", {"base", "storage_offset", "stride"})
        stride = _dims(vo["stride"], where + ".view.stride")
        if len(stride) != len(shape):
            raise _fail(where + ".view.stride", f"rank {len(stride)} != shape rank {len(shape)}")
        view = ViewRecord(base=_str(vo["base"], where + ".view.base"),
                          storage_offset=_int(vo["storage_offset"], where + ".view.storage_offset"),
                          stride=stride)
        return TensorRecord(dtype=dtype, shape=shape, placement=placement, view=view)
    isz = itemsize(dtype)
    shards = tuple(
        parse_shard_record(s, f"{where}.shards[{i}]", name=name, ndim=len(shape), shape=shape, isz=isz, files=files)
        for i, s in enumerate(_list(o["shards"], where + ".shards"))
    )
    return TensorRecord(dtype=dtype, shape=shape, placement=placement, shards=shards)


def parse_file_record(v: Any, where: str, world_size: int) -> FileRecord:
    o = _record(v, where, {"rank", "size", "header_size", "header_digest", "digest", "chunks"})
    chunks = tuple(_digest(c, f"{where}.chunks[{i}]") for i, c in enumerate(_list(o["chunks"], where + ".chunks")))
    size = _int(o["size"], where + ".size", hi=1 << 62)
    header_size = _int(o["header_size"], where + ".header_size", lo=8, hi=8 + 100_000_000)
    if header_size > size:
        raise _fail(where + ".header_size", f"{header_size} exceeds the file size {size}")
    rank = _int(o["rank"], where + ".rank", hi=(1 << 24) - 1)
    if rank >= world_size:
        raise _fail(where + ".rank", f"rank {rank} >= world size {world_size}")
    return FileRecord(rank=rank, size=size,
                      header_size=header_size, header_digest=_digest(o["header_digest"], where + ".header_digest"),
                      chunks=chunks, digest=_digest(o["digest"], where + ".digest"))


def _parse_topology(v: Any, where: str) -> Topology:
    o = _record(v, where, {"world_size", "mesh", "ranks"})
    ws = _int(o["world_size"], where + ".world_size", lo=1, hi=1 << 24)
    mesh = []
    for i, d in enumerate(_list(o["mesh"], where + ".mesh", max_len=16)):
        do = _record(d, f"{where}.mesh[{i}]", {"name", "size"})
        name = _str(do["name"], f"{where}.mesh[{i}].name", max_len=64)
        if not _MESH_NAME_RE.fullmatch(name):
            raise _fail(f"{where}.mesh[{i}].name", f"bad mesh dim name {name!r}")
        mesh.append((name, _int(do["size"], f"{where}.mesh[{i}].size", lo=1, hi=1 << 24)))
    if mesh and math.prod(s for _, s in mesh) != ws:
        raise _fail(where, f"mesh {mesh} does not multiply to world_size {ws}")
    if len({n for n, _ in mesh}) != len(mesh):
        raise _fail(where + ".mesh", "duplicate mesh dim names")
    ranks = _list(o["ranks"], where + ".ranks", max_len=1 << 24)
    if len(ranks) != (ws if mesh else 0):  # a count first: world_size is only what the manifest claims
        raise _fail(where + ".ranks", f"lists {len(ranks)} ranks, the mesh has {ws if mesh else 0} "
                    "(every rank's row-major mesh coordinates, or [] with no mesh)")
    sizes = [s for _, s in mesh]
    coords = [0] * len(sizes)
    for r, got in enumerate(ranks):  # the rank's coordinates, counted up like an odometer
        if isinstance(got, Lazy):  # whitespace-padded past one piece
            got = _list(got, f"{where}.ranks[{r}]", max_len=16)
        if got != coords:
            raise _fail(f"{where}.ranks[{r}]", f"{str(got)[:80]} is not rank {r}'s row-major mesh coordinates {coords}")
        for d in reversed(range(len(sizes))):
            coords[d] += 1
            if coords[d] < sizes[d]:
                break
            coords[d] = 0
    return Topology(world_size=ws, mesh=tuple(mesh))


def _parse_value(v: Any, where: str, budget: Budget, world_size: int) -> ValueRecord:
    o = _record(v, where, set(), {"value", "per_rank"})
    if set(o) == {"value"}:
        return ValueRecord(value=plain(o["value"], budget, where, depth=4))
    if set(o) == {"per_rank"}:
        pr = _obj(o["per_rank"], where + ".per_rank")
        out = {}
        for k, val in pr.items():
            if not _RANK_KEY_RE.fullmatch(k) or int(k) >= world_size:
                raise _fail(where + ".per_rank", f"rank key {k!r} is not a rank below world size {world_size}")
            budget.charge(_PER_RANK_ENTRY, where)
            out[int(k)] = plain(val, budget, f"{where}.per_rank[{k}]", depth=5)
        return ValueRecord(per_rank=out)
    raise _fail(where, "expected {'value': ...} or {'per_rank': {...}}")


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
    obj = migrate(obj, source=source)
    try:
        return _manifest_fields(obj, budget)
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


def migrate(obj: Any, *, source: str = "manifest.json") -> dict:
    """Return the manifest object upgraded to FORMAT_VERSION (or raise naming both versions).

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
    while version < FORMAT_VERSION:
        mig = _MIGRATIONS.get(version)
        if mig is None:
            raise FormatVersionError(f"{source}: format version {version} has no migration to {FORMAT_VERSION}",
                                     version=version)
        obj = mig(dict(obj))
        new = obj.get("format_version") if isinstance(obj, dict) else None
        if new != version + 1:
            raise FormatVersionError(f"{source}: migration from version {version} produced version {new!r}")
        version = new
    return obj


def _manifest_fields(o: dict, budget: Budget) -> Manifest:
    _keys(o, "", {"format", "format_version", "save_id", "step", "created_at", "writer",
                  "hash_algorithm", "chunk_size", "metadata", "topology", "files", "tensors",
                  "storages", "values"})
    if o["hash_algorithm"] != hashing.ALGORITHM:
        raise _fail("hash_algorithm", f"unsupported {o['hash_algorithm']!r}")
    chunk_size = _int(o["chunk_size"], "chunk_size", lo=4096, hi=1 << 30)
    writer = {k: _str(v, f"writer.{k}", max_len=256) for k, v in _obj(o["writer"], "writer").items()}
    topology = _parse_topology(o["topology"], "topology")  # first: ranks are checked as records stream
    files = {parse_file_name(k, f"files[{k!r}]"): parse_file_record(v, f"files[{k!r}]", topology.world_size)
             for k, v in _obj(o["files"], "files").items()}
    for name, f in files.items():
        want = max(1, -(-f.size // chunk_size)) if f.size else 0
        if len(f.chunks) != want:
            raise _fail(f"files[{name!r}].chunks", f"{len(f.chunks)} chunk digests for {f.size} bytes "
                        f"(chunk size {chunk_size}) where {want} are needed")
    tensors = {_str(k, "tensors key"): parse_tensor_record(k, v, f"tensors[{k!r}]", files)
               for k, v in _obj(o["tensors"], "tensors").items()}
    storages = {_str(k, "storages key"): parse_tensor_record(k, v, f"storages[{k!r}]", files)
                for k, v in _obj(o["storages"], "storages").items()}
    for name, rec in tensors.items():
        if rec.alias_of is not None:
            target = tensors.get(rec.alias_of)
            if target is None or target.alias_of is not None:
                raise _fail(f"tensors[{name!r}].alias_of", f"{rec.alias_of!r} is not a stored tensor")
            if (target.dtype, target.shape) != (rec.dtype, rec.shape):
                raise _fail(f"tensors[{name!r}]", "alias dtype/shape differ from its target")
        if rec.view is not None:
            base = storages.get(rec.view.base)
            if base is None:
                raise _fail(f"tensors[{name!r}].view.base", f"{rec.view.base!r} is not in storages")
            if base.dtype != rec.dtype or len(base.shape) != 1:
                raise _fail(f"tensors[{name!r}].view", "view must share its storage's dtype; storages are 1-D")
            extent = rec.view.storage_offset + view_reach(rec.shape, rec.view.stride)
            if math.prod(rec.shape) and extent > base.shape[0]:
                raise _fail(f"tensors[{name!r}].view", f"reaches element {extent - 1} of a {base.shape[0]}-element storage")
    seen_keys: dict[tuple[str, str], str] = {}  # (file, key) -> the record that uses it
    for kind, recs in (("tensors", tensors), ("storages", storages)):
        for name, rec in recs.items():
            for i, sh in enumerate(rec.shards):
                where = f"{kind}[{name!r}].shards[{i}]"
                first = seen_keys.setdefault((sh.file, sh.key), where)
                if first != where:
                    raise _fail(where + ".key", f"key {sh.key!r} of {sh.file} is used by {first} too "
                                "(a key is unique within its file)")
    for name, rec in storages.items():
        if rec.alias_of is not None or rec.view is not None or len(rec.shape) != 1:
            raise _fail(f"storages[{name!r}]", "a storage must be a 1-D tensor stored in shards")
    values = {_str(k, "values key"): _parse_value(v, f"values[{k!r}]", budget, topology.world_size)
              for k, v in _obj(o["values"], "values").items()}
    clash = (tensors.keys() & storages.keys()) | (tensors.keys() & values.keys()) | (storages.keys() & values.keys())
    if clash:
        raise _fail("tensors/storages/values", f"names used twice: {sorted(clash)[:5]}")
    step = o["step"]
    if step is not None:
        step = _int(step, "step", hi=MAX_STEP)
    return Manifest(
        format_version=o["format_version"], save_id=_str(o["save_id"], "save_id", max_len=128),
        step=step, created_at=_str(o["created_at"], "created_at", max_len=64),
        writer=writer, chunk_size=chunk_size, metadata=plain(o["metadata"], budget, "metadata", depth=2),
        topology=topology, files=files, tensors=tensors,
        storages=storages, values=values,
    )


def parse_commit(raw: bytes, *, source: str = "COMMITTED") -> CommitRecord:
    """Parse a COMMITTED marker.

    A marker that carries a ``format_version`` newer than this reader's is a later version's
    (spec section 9): a FormatVersionError, checked before anything else could call it malformed.
    Version 1 writes exactly three keys, so any other ``format_version`` is an unknown field."""
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
        _keys(o, "", {"format", "save_id", "manifest_digest"})
        return CommitRecord(save_id=_str(o["save_id"], "save_id", max_len=128),
                            manifest_digest=_digest(o["manifest_digest"], "manifest_digest"))
    except ManifestError as e:
        raise ManifestError(f"{source}: {e}") from None
