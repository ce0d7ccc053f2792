"""The version-2 reader: the root manifest, the rank table's parts and the rank indexes.

Each document is checked field by field (``shardfmt.format.fields``) and by the cross-field
rules of spec/FORMAT.md sections 4-6; each parser sees one document only, so what a reader
pays follows the documents it reads. Digests and sizes that vouch for a part or an index are
checked by the caller that fetched it, against the record that named it.
"""

from __future__ import annotations

import math
import re
from typing import Any

import orjson

from shardfmt.errors import FormatVersionError, ManifestError
from shardfmt.format import jsonscan, refs
from shardfmt.format.dtypes import SUPPORTED_DTYPES, itemsize
from shardfmt.format.fields import (
    RANK_KEY_RE,
    check_keys,
    check_links,
    check_names,
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
from shardfmt.format.index import (
    MAX_INDEX_BYTES,
    MAX_PART_BYTES,
    RANKS_PER_PART,
    IndexedFile,
    RankEntry,
    RankIndex,
    RankTablePart,
    rank_index_name,
    rank_part_name,
)
from shardfmt.format.jsonscan import Budget, plain
from shardfmt.format.manifest import (
    FORMAT_NAME,
    Extension,
    ListedShard,
    Manifest,
    Placed,
    RankPart,
    TensorRecord,
    Topology,
    ValueRecord,
    ViewRecord,
)

ROOT_FIELDS = frozenset({"format", "format_version", "save_id", "step", "created_at", "writer", "hash_algorithm",
                         "chunk_size", "metadata", "topology", "tensors", "storages", "values", "ranks",
                         "extensions"})
KNOWN_EXTENSIONS: frozenset[str] = frozenset({refs.EXTENSION})  # section 4.10
MAX_WRITER = (1 << 24) - 1
_HEX_RE = re.compile(rb"[0-9a-f]*")
_TAG_RE = re.compile(r"[A-Za-z0-9_-]{1,128}")


def root_fields(o: dict, budget: Budget) -> Manifest:
    """Check a v2 root manifest's fields (version, format and nesting already checked)."""
    check_keys(o, "", set(ROOT_FIELDS))
    chunk_size, writer = common_fields(o)
    topology = _topology(o["topology"])
    extensions = _extensions(o["extensions"], budget)
    tensors = {str_field(k, "tensors key"): _tensor(v, f"tensors[{k!r}]", topology)
               for k, v in obj_field(o["tensors"], "tensors").items()}
    storages = {str_field(k, "storages key"): _tensor(v, f"storages[{k!r}]", topology)
                for k, v in obj_field(o["storages"], "storages").items()}
    check_links(tensors, storages)
    values = {str_field(k, "values key"): _value(v, f"values[{k!r}]", budget)
              for k, v in obj_field(o["values"], "values").items()}
    check_names(tensors, storages, values)
    save_id = str_field(o["save_id"], "save_id", max_len=128)
    return Manifest(
        format_version=2, save_id=save_id,
        step=step_field(o["step"]), created_at=str_field(o["created_at"], "created_at", max_len=64),
        writer=writer, chunk_size=chunk_size, metadata=plain(o["metadata"], budget, "metadata", depth=2),
        topology=topology, tensors=tensors, storages=storages, values=values,
        ranks=_rank_parts(o["ranks"], topology.world_size, save_id), extensions=extensions,
    )


def _topology(v: Any) -> Topology:
    o = record_fields(v, "topology", {"world_size", "mesh"})
    ws = int_field(o["world_size"], "topology.world_size", lo=1, hi=1 << 24)
    return Topology(world_size=ws, mesh=parse_mesh(o["mesh"], "topology", ws))


def _tensor(v: Any, where: str, topology: Topology) -> TensorRecord:
    o = record_fields(v, where, {"dtype", "shape"}, {"shards", "placed", "alias_of", "view", "placement"})
    dtype = str_field(o["dtype"], where + ".dtype", max_len=32)
    if dtype not in SUPPORTED_DTYPES:
        raise fail(where + ".dtype", f"unsupported dtype {dtype!r}")
    shape = dims_field(o["shape"], where + ".shape")
    if math.prod(shape) * itemsize(dtype) > 1 << 62:
        raise fail(where + ".shape", f"{list(shape)} is impossibly large")
    kinds = [k for k in ("shards", "placed", "alias_of", "view") if k in o]
    if len(kinds) != 1:
        raise fail(where, f"needs exactly one of shards, placed, alias_of, view (has {kinds})")
    if "placement" in o and "shards" not in o:
        raise fail(where + ".placement", "only a record stored by shards has a descriptive placement")
    placement = parse_placement(o.get("placement"), where + ".placement", len(shape), flat=True)
    if placement is not None and any(p[0] == "flat" for p in placement.placements):
        _flat_order(placement, where + ".placement")
    if "alias_of" in o:
        return TensorRecord(dtype=dtype, shape=shape, alias_of=str_field(o["alias_of"], where + ".alias_of"))
    if "view" in o:
        vo = record_fields(o["view"], where + ".view", {"base", "storage_offset", "stride"})
        stride = dims_field(vo["stride"], where + ".view.stride")
        if len(stride) != len(shape):
            raise fail(where + ".view.stride", f"rank {len(stride)} != shape rank {len(shape)}")
        return TensorRecord(dtype=dtype, shape=shape, view=ViewRecord(
            base=str_field(vo["base"], where + ".view.base"),
            storage_offset=int_field(vo["storage_offset"], where + ".view.storage_offset"), stride=stride))
    if "placed" in o:
        placed = _placed(o["placed"], where + ".placed", shape, topology)  # its placement, for every consumer
        return TensorRecord(dtype=dtype, shape=shape, placed=placed, placement=placed.placement)
    listed = tuple(_listed(s, f"{where}.shards[{i}]", shape, topology.world_size)
                   for i, s in enumerate(list_field(o["shards"], where + ".shards")))
    return TensorRecord(dtype=dtype, shape=shape, placement=placement, listed=listed)


def _placed(v: Any, where: str, shape: tuple[int, ...], topology: Topology) -> Placed:
    """A placement the topology's mesh can derive boxes from: its mesh dims exist, each once,
    and a stage names a coordinate of the mesh's ``pp`` dim (spec section 4.3)."""
    o = record_fields(v, where, {"mesh_dims", "placements", "stage", "writer"})
    writer = int_field(o["writer"], where + ".writer", hi=MAX_WRITER)
    placement = parse_placement({k: o[k] for k in ("mesh_dims", "placements", "stage")}, where, len(shape), flat=True)
    sizes = dict(topology.mesh)
    for name in placement.mesh_dims:
        if name not in sizes:
            raise fail(where + ".mesh_dims", f"{name!r} is not a dim of the topology's mesh {list(sizes)}")
    if len(set(placement.mesh_dims)) != len(placement.mesh_dims):
        raise fail(where + ".mesh_dims", f"a mesh dim is named twice: {list(placement.mesh_dims)}")
    if placement.stage is not None:
        if "pp" not in sizes or "pp" in placement.mesh_dims:
            raise fail(where + ".stage", "a stage needs a 'pp' mesh dim that the placements do not use")
        if placement.stage >= sizes["pp"]:
            raise fail(where + ".stage", f"stage {placement.stage} >= pp size {sizes['pp']}")
    if any(p[0] == "flat" for p in placement.placements):
        _check_flat(placement, shape, sizes, where)
    return Placed(placement=placement, writer=writer)


def _flat_order(placement, where: str) -> list:
    """A flat entry is the only one and the last that is not replicate, after shard entries
    only (any placement); returns the entries that are not replicate."""
    kinds = [(d, p) for d, p in zip(placement.mesh_dims, placement.placements) if p[0] != "replicate"]
    if sum(p[0] == "flat" for _, p in kinds) != 1 or kinds[-1][1][0] != "flat":
        raise fail(where + ".placements", "a flat entry must be the only one and come after every shard entry")
    if any(p[0] == "strided_shard" for _, p in kinds):
        raise fail(where + ".placements", "a flat entry cannot follow a strided shard")
    return kinds


def _check_flat(placement, shape: tuple[int, ...], sizes: dict[str, int], where: str) -> None:
    """A placed record's flat entry, ordered as any (``_flat_order``), whose pieces reach the
    last element of the largest box the shard entries leave."""
    kinds = _flat_order(placement, where)
    largest = list(shape)  # the first torch.chunk piece is the largest
    for d, p in kinds[:-1]:
        largest[p[1]] = -(-largest[p[1]] // sizes[d])
    dim, (_, offset, part) = kinds[-1]
    if offset + math.prod(largest) > part * sizes[dim]:
        raise fail(where + ".placements", f"{sizes[dim]} flat pieces of {part} elements from offset {offset} "
                                          f"do not reach the last of {math.prod(largest)} elements")


def _listed(v: Any, where: str, shape: tuple[int, ...], world_size: int) -> ListedShard:
    o = record_fields(v, where, {"offsets", "lengths", "rank"})
    offsets = dims_field(o["offsets"], where + ".offsets")
    lengths = dims_field(o["lengths"], where + ".lengths")
    if len(offsets) != len(shape) or len(lengths) != len(shape):
        raise fail(where, f"offsets/lengths have rank {len(offsets)}/{len(lengths)}, tensor has {len(shape)}")
    for d, (off, n, s) in enumerate(zip(offsets, lengths, shape)):
        if off + n > s:
            raise fail(where, f"dim {d}: slice [{off}, {off + n}) is outside the shape {list(shape)}")
    rank = int_field(o["rank"], where + ".rank", hi=world_size - 1)
    return ListedShard(offsets=offsets, lengths=lengths, rank=rank)


def _value(v: Any, where: str, budget: Budget) -> ValueRecord:
    o = record_fields(v, where, set(), {"value", "per_rank"})
    if set(o) == {"value"}:
        return ValueRecord(value=plain(o["value"], budget, where, depth=4))
    if set(o) == {"per_rank"} and o["per_rank"] is True:
        return ValueRecord(indexed=True)
    raise fail(where, "expected {'value': ...} or {'per_rank': true}")


def _rank_parts(v: Any, world_size: int, save_id: str) -> tuple[RankPart, ...]:
    """The rank table's parts: consecutive, from rank 0 to the world size, each at most
    RANKS_PER_PART ranks, named after its first rank (spec section 5)."""
    parts = []
    lst = list_field(v, "ranks", max_len=world_size)
    pos = 0
    for i, p in enumerate(lst):
        where = f"ranks[{i}]"
        o = record_fields(p, where, {"first", "end", "name", "size", "digest"})
        first = int_field(o["first"], where + ".first", lo=pos, hi=pos)
        end = int_field(o["end"], where + ".end", lo=first + 1, hi=min(first + RANKS_PER_PART, world_size))
        name = str_field(o["name"], where + ".name", max_len=256)
        if name not in (rank_part_name(first), rank_part_name(first, save_id)):
            raise fail(where + ".name", f"{name!r} is not {rank_part_name(first)!r} (or it with the save id)")
        parts.append(RankPart(first=first, end=end, name=name,
                              size=int_field(o["size"], where + ".size", hi=MAX_PART_BYTES),
                              digest=digest_field(o["digest"], where + ".digest")))
        pos = end
    if pos != world_size:
        raise fail("ranks", f"the rank table covers ranks [0, {pos}), the world size is {world_size}")
    return tuple(parts)


def _extensions(v: Any, budget: Budget) -> dict[str, Extension]:
    out = {}
    for name, e in obj_field(v, "extensions").items():
        where = f"extensions[{name!r}]"
        o = record_fields(e, where, {"required", "value"})
        if not isinstance(o["required"], bool):
            raise fail(where + ".required", f"expected true or false, got {o['required']!r}")
        if o["required"] and name not in KNOWN_EXTENSIONS:
            raise FormatVersionError(f"manifest {where}: the checkpoint requires extension {name!r}, which this "
                                     "reader does not know; upgrade shardfmt to read it", version=2)
        out[str_field(name, "extensions key", max_len=256)] = Extension(
            required=o["required"], value=plain(o["value"], budget, where + ".value", depth=3))
    if refs.EXTENSION in out:
        if not out[refs.EXTENSION].required:
            raise fail(f"extensions[{refs.EXTENSION!r}].required", "must be true (it changes where data is)")
        refs.parse_chain(out[refs.EXTENSION].value)
    return out


# ----------------------------------------------------------------------------- parts and indexes


def _document(raw: bytes, *, source: str, kind: str, save_id: str, limit: int) -> dict:
    """A part or an index as a dict, checked for its size, format, kind and save."""
    if len(raw) > limit:
        raise ManifestError(f"{source}: {len(raw)} bytes exceeds the {limit}-byte limit")
    try:
        o = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise ManifestError(f"{source}: not valid JSON ({e})") from None
    jsonscan.check_depth(o, source=source)
    if not isinstance(o, dict) or o.get("format") != FORMAT_NAME or o.get("kind") != kind:
        raise ManifestError(f"{source}: not a shardfmt {kind} document")
    if o.get("save_id") != save_id:
        raise ManifestError(f"{source}: save_id {str(o.get('save_id'))[:140]!r} != the manifest's {save_id!r}")
    return o


def parse_rank_part(raw: bytes, part: RankPart, *, save_id: str, source: str) -> RankTablePart:
    """Parse the rank-table part ``part`` names (its digest already checked)."""
    o = _document(raw, source=source, kind="ranks", save_id=save_id, limit=MAX_PART_BYTES)
    try:
        check_keys(o, "", {"format", "kind", "save_id", "first", "end", "ranks"})
        int_field(o["first"], "first", lo=part.first, hi=part.first)
        int_field(o["end"], "end", lo=part.end, hi=part.end)
        ranks = {}
        for k, e in obj_field(o["ranks"], "ranks").items():
            if not RANK_KEY_RE.fullmatch(k) or not part.first <= int(k) < part.end:
                raise fail("ranks", f"key {k[:16]!r} is not a rank in [{part.first}, {part.end})")
            ranks[int(k)] = parse_rank_entry(e, rank=int(k), where=f"ranks[{k}]", save_id=save_id)
    except ManifestError as e:
        raise ManifestError(f"{source}: {e}") from None
    return RankTablePart(save_id=save_id, first=part.first, end=part.end, ranks=ranks)


def parse_rank_entry(v: Any, *, rank: int, where: str, save_id: str | None = None) -> RankEntry:
    """A rank-table entry of rank ``rank``: its index's name (``index/rank_<r>.json``, with the
    save id before ``.json`` on object stores: ``save_id`` when known), size and digest."""
    eo = record_fields(v, where, {"name", "size", "digest"})
    name = str_field(eo["name"], where + ".name", max_len=256)
    plain_name = rank_index_name(rank)
    stem = plain_name[:-len(".json")]
    tag = name[len(stem):-len(".json")] if name.startswith(stem) and name.endswith(".json") else None
    ok = name == plain_name or (tag is not None and tag[:1] == "." and
                                (tag[1:] == save_id if save_id is not None else bool(_TAG_RE.fullmatch(tag[1:]))))
    if not ok:
        raise fail(where + ".name", f"{name[:300]!r} is not {plain_name!r} (or it with the save id)")
    return RankEntry(name=name, size=int_field(eo["size"], where + ".size", hi=MAX_INDEX_BYTES),
                     digest=digest_field(eo["digest"], where + ".digest"))


def parse_rank_index(raw: bytes, *, rank: int, save_id: str, source: str,
                     bases: frozenset[str] = frozenset()) -> RankIndex:
    """Parse rank ``rank``'s index (its digest already checked against the rank table);
    ``bases``: the checkpoints whose files it may reference (the root's chain, section 4.10)."""
    o = _document(raw, source=source, kind="rank", save_id=save_id, limit=MAX_INDEX_BYTES)
    budget = Budget.for_document(len(raw), source)
    try:
        check_keys(o, "", {"format", "kind", "save_id", "rank", "files", "values"})
        int_field(o["rank"], "rank", lo=rank, hi=rank)
        files = {_indexed_name(k, f"files[{k!r}]", bases): _indexed_file(v, f"files[{k!r}]", ref=refs.split(k)[0])
                 for k, v in obj_field(o["files"], "files").items()}
        values = {str_field(k, "values key"): plain(v, budget, f"values[{k!r}]", depth=3)
                  for k, v in obj_field(o["values"], "values").items()}
    except ManifestError as e:
        raise ManifestError(f"{source}: {e}") from None
    return RankIndex(save_id=save_id, rank=rank, files=files, values=values)


def _indexed_name(name: Any, where: str, bases: frozenset[str]) -> str:
    """An own file's name, or ``<base>/data/<file>`` of a base the root lists (section 4.10)."""
    base, inner = refs.split(str_field(name, where))
    if base is None and not name.startswith("data/"):
        raise fail(where, f"file path {name!r} is neither data/<name>.safetensors nor <base>/data/<name>.safetensors")
    if base is not None and base not in bases:
        raise fail(where, f"names a file of {base!r}, which is not a base of this checkpoint")
    parse_file_name(inner, where)
    return name


def _keys(v: Any, where: str) -> tuple[str, ...]:
    keys = list_field(v, where, max_len=1 << 24)
    out = tuple(str_field(k, f"{where}[{i}]", max_len=4096) for i, k in enumerate(keys))
    if not out or list(out) != sorted(set(out)):
        raise fail(where, "expected a non-empty list of distinct header keys in sorted order")
    return out


def _indexed_file(v: Any, where: str, *, ref: str | None = None) -> IndexedFile:
    fields = {"size", "header_size", "header_digest", "digest", "chunks"}
    o = record_fields(v, where, fields | {"keys"} if ref is not None else fields)
    size = int_field(o["size"], where + ".size", hi=1 << 62)
    header_size = int_field(o["header_size"], where + ".header_size", lo=8, hi=8 + 100_000_000)
    if header_size > size:
        raise fail(where + ".header_size", f"{header_size} exceeds the file size {size}")
    text = str_field(o["chunks"], where + ".chunks", max_len=MAX_INDEX_BYTES).encode()
    if len(text) % 32 or not _HEX_RE.fullmatch(text):
        raise fail(where + ".chunks", "expected raw chunk digests as lowercase hex, 32 digits each")
    return IndexedFile(size=size, header_size=header_size,
                       header_digest=digest_field(o["header_digest"], where + ".header_digest"),
                       digest=digest_field(o["digest"], where + ".digest"), chunks=bytes.fromhex(text.decode()),
                       keys=None if ref is None else _keys(o["keys"], where + ".keys"))

