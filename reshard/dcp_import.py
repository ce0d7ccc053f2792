"""Import a torch.distributed.checkpoint (DCP) directory as a shardfmt checkpoint.

A DCP directory holds ``.metadata`` (a pickle: every tensor's dtype, global shape and saved
chunks, and where each item's bytes are) and ``__<rank>_<n>.distcp`` files, each a
concatenation of items: a tensor chunk or a non-tensor value, each ``torch.save``d, possibly
through a stream transform (compression). Protocol of ``import_dcp``:

1) refuse unless the caller states ``trust_pickle=True``, and a DST that is SRC, holds it or
   lies inside it; read ``.metadata`` through the allowlist unpickler of ``dcp_metadata`` (a
   file that names any other global is refused);
2) stat every ``.distcp`` file the metadata names, then ``plan_import`` (pure): check every
   chunk has a stored item inside its file, the chunks of every tensor tile it, the dtypes
   are storable; map each file to its writer's rank (``__1_0.distcp`` -> rank 1); cut each
   rank's chunks into parts of at most ``memory_budget`` decoded bytes;
3) read and decode every non-tensor item (``torch.load(weights_only=True)``), regroup the
   items DCP flattened out of one tensor-free dict or list into that one value, as
   ``shardfmt.save`` names it (``group_values``), and encode it as typed JSON: a value that
   cannot be (a custom class, a set) is refused, naming the key, unless
   ``skip_unsupported_values`` (then the whole value is skipped with a warning and reported);
4) open a ``CheckpointWriter`` on DST; per part: read each chunk's byte range, check the
   CRC-32s of its ``torch.save`` zip container (DCP keeps no checksum of its own), decode it
   with ``torch.load(weights_only=True)``, check dtype and shape against the metadata, and
   ``write_rank(rank, shards, part=k)``; add the values; commit. Any failure aborts the
   staging directory: DST is never left half-written.

Each DCP chunk becomes one shard with the same box; DCP writes each replicated chunk once,
so nothing is duplicated. Placement is not recorded (DCP's metadata does not say how chunks
map to a mesh); the topology is ``world_size`` = highest rank found + 1, with no named mesh.

Trade-offs: a chunk is decoded whole (``torch.load`` reads a whole ``torch.save`` item), so
peak memory is about ``max(memory_budget, largest chunk)`` plus one encoded item; a chunk
larger than the budget is written as a part of its own rather than split. Only the
``.metadata`` of a collective save is read (not per-rank ``__<r>.metadata`` files of
``no-collectives`` saves), and only DCP's default ``torch.save`` item serialization.
"""

from __future__ import annotations

import io
import math
import pickle
import re
import struct
import warnings
import zipfile
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from reshard.convert import refuse_overlap
from reshard.dcp_metadata import DcpLocation, DcpMetadata, parse_metadata
from shardfmt.errors import CheckpointNotFoundError, DcpImportError, EncodingError
from shardfmt.format import hashing, jsonvalue
from shardfmt.format.dtypes import dtype_code
from shardfmt.format.manifest import Manifest, Topology, check_step
from shardfmt.format.tensor_bytes import BufferFile
from shardfmt.io.registry import get_storage
from shardfmt.io.storage import Storage
from shardfmt.layout.geometry import Box
from shardfmt.layout.tiling import tiling_problems
from shardfmt.layout.topology import MAX_WORLD
from shardfmt.saving.shard_file import ShardData
from shardfmt.saving.writer import CheckpointWriter

DEFAULT_MEMORY_BUDGET = 1 << 30  # decoded tensor bytes held at once (one part of a rank's file)
METADATA_LIMIT = 1 << 31  # largest .metadata read
_CRC_READ = 16 << 20  # bytes per read while checking a zip member's CRC
_RANK_FILE = re.compile(r"__(0|[1-9][0-9]{0,7})_(0|[1-9][0-9]*)\.distcp")

TRUST_PICKLE_HELP = (
    "DCP's .metadata is a Python pickle, and loading a pickle can run code. shardfmt reads it "
    "with a restricted unpickler that admits only DCP's metadata classes, torch.Size, torch "
    "dtypes and plain containers (anything else is refused), and reads tensors with "
    "torch.load(weights_only=True); still, import only checkpoints whose origin you trust, and "
    "say so with trust_pickle=True (CLI: --trust-pickle).")


# ----------------------------------------------------------------------------- plan (pure)


@dataclass(frozen=True, slots=True, kw_only=True)
class ChunkItem:
    """One DCP tensor chunk to copy: its box in the global tensor and where its bytes are."""

    fqn: str
    dtype: torch.dtype
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    location: DcpLocation

    @property
    def nbytes(self) -> int:
        return math.prod(self.sizes) * self.dtype.itemsize


@dataclass(frozen=True, slots=True, kw_only=True)
class RankPart:
    """The chunks written into one data file: ``rank``'s file, or its part ``part``."""

    rank: int
    part: int | None
    items: tuple[ChunkItem, ...]

    @property
    def nbytes(self) -> int:
        return sum(i.nbytes for i in self.items)


@dataclass(frozen=True, slots=True)
class Slot:
    """The place of DCP's value item ``key`` inside a regrouped value's template."""

    key: str


@dataclass(frozen=True, slots=True, kw_only=True)
class ValueGroup:
    """One shardfmt value: its ``name``, and the ``template`` (a Slot, or dicts/lists of Slots)
    that the DCP items in ``items`` (key, where its bytes are) fill."""

    name: str
    template: Any
    items: tuple[tuple[str, DcpLocation], ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class ImportPlan:
    world_size: int
    parts: tuple[RankPart, ...]
    values: tuple[ValueGroup, ...]
    tensors: int


_TENSOR = object()


def _slots(template: Any) -> list[str]:
    if isinstance(template, Slot):
        return [template.key]
    children = template.values() if isinstance(template, dict) else template
    return [k for c in children for k in _slots(c)]


def fill(template: Any, loaded: Mapping[str, Any]) -> Any:
    """Build a value from its template and the loaded DCP items."""
    if isinstance(template, Slot):
        return loaded[template.key]
    if isinstance(template, dict):
        return {k: fill(v, loaded) for k, v in template.items()}
    return [fill(v, loaded) for v in template]


def group_values(values: Sequence[str], tensors: Sequence[str],
                 paths: Mapping[str, tuple[str | int, ...]] | None) -> list[tuple[str, Any]]:
    """Name DCP's non-tensor items as ``shardfmt.save`` would name the state dict they came from.

    DCP flattens every nested dict: ``{"sched": {"lr": 0.1}}`` is saved as the item
    ``sched.lr``. shardfmt keeps a dict or list that holds no tensor as one value (``sched``).
    With the planner's paths (key -> dict keys and list indices), the items of such a
    container are put back together (a dict from string keys, a list from indices 0..n-1), so
    ``shardfmt.load`` of the state dict the job saved works unchanged. Without paths, or where
    a container cannot be rebuilt, each item keeps its DCP key. Returns (name, template).
    """
    flat = [(k, Slot(k)) for k in values]
    if paths is None:
        return flat
    tree: dict = {}

    def insert(path: tuple, leaf: Any) -> bool:
        node = tree
        for item in path[:-1]:
            node = node.setdefault(item, {})
            if not isinstance(node, dict):
                return False
        if path[-1] in node:
            return False
        node[path[-1]] = leaf
        return True

    if not (all(insert(paths[k], _TENSOR) for k in tensors) and all(insert(paths[k], Slot(k)) for k in values)):
        return flat

    def holds_tensor(node: Any) -> bool:
        return node is _TENSOR or isinstance(node, dict) and any(holds_tensor(c) for c in node.values())

    def template(node: Any) -> Any:
        if isinstance(node, Slot):
            return node
        children = {k: template(c) for k, c in node.items()}
        if any(c is None for c in children.values()):
            return None
        if all(isinstance(k, str) for k in children):
            return children
        if all(type(k) is int for k in children) and sorted(children) == list(range(len(children))):
            return [children[i] for i in range(len(children))]
        return None

    out: list[tuple[str, Any]] = []

    def visit(node: dict, prefix: str) -> None:
        for item, child in node.items():
            name = f"{prefix}.{item}" if prefix else str(item)
            if child is _TENSOR:
                continue
            built = None if holds_tensor(child) else template(child)
            if built is None:
                visit(child, name)
            else:
                out.append((name, built))

    visit(tree, "")
    names = [n for n, _ in out]
    if len(set(names)) != len(names) or set(names) & set(tensors):
        return flat
    return out


def rank_of_files(names: Sequence[str]) -> dict[str, int]:
    """Map ``.distcp`` file names to writer ranks: ``__<rank>_<n>.distcp``; else one rank per file.

    DCP's FileSystemWriter names rank ``r``'s ``n``-th file ``__r_n.distcp``. When any name
    differs (a custom storage writer), each file, in sorted order, counts as its own rank.
    """
    names = sorted(set(names))
    matches = {n: _RANK_FILE.fullmatch(n) for n in names}
    ranks = {n: int(m.group(1)) for n, m in matches.items()} if all(matches.values()) else {
        n: r for r, n in enumerate(names)}
    too_high = [n for n, r in ranks.items() if r >= MAX_WORLD]
    if too_high:
        raise DcpImportError(f"{too_high[0]}: rank {ranks[too_high[0]]} is beyond the format's {MAX_WORLD} ranks")
    return ranks


def plan_import(meta: DcpMetadata, file_sizes: Mapping[str, int], *, where: str = ".metadata",
                memory_budget: int = DEFAULT_MEMORY_BUDGET, extra_files: Sequence[str] = ()) -> ImportPlan:
    """Check ``meta`` against the data files' sizes and cut every rank's chunks into parts.

    ``file_sizes`` gives the size of every file the metadata names; ``extra_files`` names
    further ``.distcp`` files found in the directory (ranks that wrote no item still count
    towards the world size).
    """
    if memory_budget <= 0:
        raise ValueError(f"memory_budget must be positive, got {memory_budget}")

    def located(key: tuple, what: str) -> DcpLocation:
        loc = meta.locations.get(key)
        if loc is None:
            raise DcpImportError(f"{where}: {what} has no storage entry (no bytes were saved for it)")
        size = file_sizes.get(loc.relative_path)
        if size is None:
            raise DcpImportError(f"{where}: {what}: no size known for {loc.relative_path}")
        if loc.offset + loc.length > size:
            raise DcpImportError(f"{loc.relative_path}: truncated: {what} is stored at bytes "
                                 f"[{loc.offset}, {loc.offset + loc.length}) but the file has {size} bytes")
        return loc

    items: list[ChunkItem] = []
    for fqn, t in meta.tensors.items():
        dtype_code(t.dtype, what=f"{where}: tensor {fqn!r}")
        unique: dict[tuple[int, ...], tuple[int, ...]] = {}
        for c in t.chunks:
            seen = unique.setdefault(c.offsets, c.sizes)
            if seen != c.sizes:
                raise DcpImportError(f"{where}: tensor {fqn!r} has two chunks at offsets {list(c.offsets)} "
                                     f"with sizes {list(seen)} and {list(c.sizes)}")
        problems = tiling_problems([Box(o, s) for o, s in unique.items()], Box.full(t.shape))
        if problems:
            raise DcpImportError(f"{where}: tensor {fqn!r}: its chunks do not tile its shape "
                                 f"{list(t.shape)}: {problems[0]}")
        if not unique:
            raise DcpImportError(f"{where}: tensor {fqn!r} has no chunks")
        for offsets, sizes in unique.items():
            loc = located((fqn, offsets), f"tensor {fqn!r} chunk at offsets {list(offsets)}")
            items.append(ChunkItem(fqn=fqn, dtype=t.dtype, global_shape=t.shape, offsets=offsets, sizes=sizes,
                                   location=loc))
    values = tuple(
        ValueGroup(name=name, template=template,
                   items=tuple((k, located((k, None), f"value {k!r}")) for k in _slots(template)))
        for name, template in group_values(meta.values, list(meta.tensors), meta.paths))

    used = {i.location.relative_path for i in items} | {loc.relative_path for g in values for _, loc in g.items}
    ranks = rank_of_files(sorted(used | set(extra_files)))
    by_rank: dict[int, list[ChunkItem]] = {}
    for it in items:
        by_rank.setdefault(ranks[it.location.relative_path], []).append(it)
    parts: list[RankPart] = []
    for rank in sorted(by_rank):
        # file order: each file is read front to back; a part never exceeds the budget
        # unless one chunk alone does (then that chunk is a part by itself)
        groups: list[list[ChunkItem]] = [[]]
        held = 0
        for it in sorted(by_rank[rank], key=lambda i: (i.location.relative_path, i.location.offset)):
            if groups[-1] and held + it.nbytes > memory_budget:
                groups.append([])
                held = 0
            groups[-1].append(it)
            held += it.nbytes
        for k, group in enumerate(groups):
            parts.append(RankPart(rank=rank, part=None if len(groups) == 1 else k, items=tuple(group)))
    return ImportPlan(world_size=max(ranks.values(), default=0) + 1, parts=tuple(parts), values=values,
                      tensors=len(meta.tensors))


# ----------------------------------------------------------------------------- I/O


@dataclass(frozen=True, slots=True, kw_only=True)
class ImportReport:
    """What ``import_dcp`` wrote: the committed manifest and the values it skipped (key, why)."""

    manifest: Manifest
    skipped: tuple[tuple[str, str], ...]
    bytes_read: int


class _Unloadable(DcpImportError):
    """An item's pickle names a global ``weights_only`` refuses (a custom class): intact but unsupported."""


def _check_crc(data, where: str) -> None:
    """Verify the CRC-32 that torch.save's zip container records for each member (torch.load does not).

    DCP keeps no checksums of its own; this catches flipped bits in an item's bytes. A CRC of 0
    means torch.save did not compute one (``compute_crc32=False``) and is not checked; a
    legacy (non-zip) ``torch.save`` item has none.
    """
    if bytes(data[:4]) != b"PK\x03\x04":
        return
    mv = memoryview(data).cast("B")
    try:
        with zipfile.ZipFile(BufferFile(mv)) as zf:
            for info in zf.infolist():
                if info.CRC == 0 or info.file_size == 0:
                    continue
                if info.compress_type != zipfile.ZIP_STORED:
                    with zf.open(info) as member:
                        while member.read(_CRC_READ):
                            pass  # ZipExtFile checks the CRC when it reaches the end
                    continue
                head = bytes(mv[info.header_offset:info.header_offset + 30])
                if len(head) != 30 or head[:4] != b"PK\x03\x04":
                    raise zipfile.BadZipFile(f"no local header for {info.filename!r}")
                name_len, extra_len = struct.unpack("<HH", head[26:30])
                start = info.header_offset + 30 + name_len + extra_len
                body = mv[start:start + info.compress_size]
                if len(body) != info.compress_size or zlib.crc32(body) != info.CRC:
                    raise zipfile.BadZipFile(f"Bad CRC-32 for file {info.filename!r}")
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as e:
        raise DcpImportError(f"{where}: corrupt item: {e}") from None


class _ItemReader:
    """Read DCP items by byte range, undoing their stream transforms (decompression)."""

    def __init__(self, storage: Storage, root: str, extension_registry) -> None:
        self.storage = storage
        self.root = root
        self.bytes_read = 0
        self._registry = extension_registry
        self._readers: dict[str, Any] = {}

    def path(self, loc: DcpLocation) -> str:
        return self.storage.join(self.root, loc.relative_path)

    def raw(self, loc: DcpLocation, what: str) -> bytes | bytearray:
        reader = self._readers.get(loc.relative_path)
        if reader is None:
            reader = self._readers[loc.relative_path] = self.storage.open_reader(self.path(loc), within=self.root)
        buf = bytearray(loc.length)
        if loc.length:
            reader.readinto(loc.offset, [memoryview(buf)])
        self.bytes_read += loc.length
        if not loc.transforms:
            return buf
        if self._registry is None:
            from torch.distributed.checkpoint._extension import ExtensionRegistry

            self._registry = ExtensionRegistry()
        from torch.distributed.checkpoint._extension import StreamTransformExtension

        try:
            stream: Any = io.BytesIO(buf)
            for ext in self._registry.from_descriptor_list(list(loc.transforms)):
                if isinstance(ext, StreamTransformExtension):
                    stream = ext.transform_from(stream)
            return stream.read(-1)
        except Exception as e:  # noqa: BLE001 - unknown transform, missing codec, corrupt stream
            raise DcpImportError(f"{self.path(loc)}: {what}: cannot undo transforms {list(loc.transforms)} "
                                 f"({type(e).__name__}: {e})") from None

    def load(self, loc: DcpLocation, what: str) -> Any:
        data = self.raw(loc, what)
        _check_crc(data, f"{self.path(loc)}: {what}")
        try:
            return torch.load(BufferFile(data), map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - corrupt bytes, or a global weights_only refuses
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            err = _Unloadable if isinstance(e, pickle.UnpicklingError) else DcpImportError
            raise err(f"{self.path(loc)}: {what}: bytes [{loc.offset}, {loc.offset + loc.length}) do not load "
                      f"with torch.load(weights_only=True) ({type(e).__name__}: {first})") from None

    def close(self) -> None:
        for r in self._readers.values():
            r.close()
        self._readers.clear()


def _chunk_tensor(reader: _ItemReader, it: ChunkItem) -> torch.Tensor:
    what = f"tensor {it.fqn!r} chunk at offsets {list(it.offsets)}"
    t = reader.load(it.location, what)
    if not isinstance(t, torch.Tensor):
        raise DcpImportError(f"{reader.path(it.location)}: {what} holds a {type(t).__name__}, not a tensor")
    if t.dtype != it.dtype or tuple(t.shape) != it.sizes:
        raise DcpImportError(f"{reader.path(it.location)}: {what} holds {t.dtype} {list(t.shape)}, the metadata "
                             f"says {it.dtype} {list(it.sizes)}")
    t = t.detach().contiguous()
    if t.untyped_storage().nbytes() != t.nbytes:
        t = t.clone()  # keep only this chunk's bytes alive
    return t


def _read_values(reader: _ItemReader, plan: ImportPlan, *, skip_unsupported: bool
                 ) -> tuple[dict[str, Any], list[tuple[str, str]]]:
    values: dict[str, Any] = {}
    skipped: list[tuple[str, str]] = []
    for group in plan.values:
        try:
            value = fill(group.template, {k: reader.load(loc, f"value {k!r}") for k, loc in group.items})
            jsonvalue.encode(value, where=group.name)
        except (_Unloadable, EncodingError) as e:  # corrupt items are never skipped
            if not skip_unsupported:
                raise DcpImportError(f"{e} (shardfmt stores typed JSON only; pass skip_unsupported_values=True, "
                                     "CLI --skip-unsupported-values, to import without it)") from None
            skipped.append((group.name, str(e)))
            warnings.warn(f"import-dcp: skipped value {group.name!r}: {e}", stacklevel=3)
            continue
        values[group.name] = value
    return values, skipped


def import_dcp(
    src: str,
    dst: str,
    *,
    trust_pickle: bool,
    storage_options: dict | None = None,
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
    step: int | None = None,
    metadata: Any = None,
    overwrite: bool = False,
    skip_unsupported_values: bool = False,
    extension_registry=None,
    chunk_size: int = hashing.DEFAULT_CHUNK_SIZE,
    sync: bool = True,
) -> ImportReport:
    """Import the DCP directory ``src`` as a committed shardfmt checkpoint at ``dst``.

    ``trust_pickle`` must be True (see ``TRUST_PICKLE_HELP``). ``metadata`` is the manifest's
    user metadata; by default it records the source (``{"imported_from": {"format":
    "torch.distributed.checkpoint", "version": ...}}``). ``extension_registry`` is DCP's
    ``ExtensionRegistry`` used to undo stream transforms (torch's default when None).
    ``storage_options`` apply to both ``src`` and ``dst``.
    """
    if trust_pickle is not True:
        raise DcpImportError(f"{src}: refusing to read DCP metadata without trust_pickle=True. {TRUST_PICKLE_HELP}")
    check_step(step)
    storage, root = get_storage(src, storage_options)
    refuse_overlap(storage, root, dst, storage_options)
    meta_path = storage.join(root, ".metadata")
    try:
        data = storage.read_bytes(meta_path, limit=METADATA_LIMIT, within=root)
    except CheckpointNotFoundError:
        raise DcpImportError(f"{src}: no .metadata file: not a torch.distributed.checkpoint directory, or its "
                             "save did not finish (DCP writes .metadata last)") from None
    meta: DcpMetadata = parse_metadata(data, where=meta_path)

    sizes: dict[str, int] = {}
    for (fqn, _), loc in meta.locations.items():
        if loc.relative_path not in sizes:
            try:
                sizes[loc.relative_path] = storage.size(storage.join(root, loc.relative_path), within=root)
            except CheckpointNotFoundError:
                raise DcpImportError(f"{storage.join(root, loc.relative_path)}: missing (.metadata stores "
                                     f"{fqn!r} in it)") from None
    listed = [n for n in storage.listdir(root) if _RANK_FILE.fullmatch(n)]
    plan = plan_import(meta, sizes, where=meta_path, memory_budget=memory_budget, extra_files=listed)

    reader = _ItemReader(storage, root, extension_registry)
    try:
        values, skipped = _read_values(reader, plan, skip_unsupported=skip_unsupported_values)
        if metadata is None:
            metadata = {"imported_from": {"format": "torch.distributed.checkpoint", "version": meta.version}}
        with CheckpointWriter(dst, storage_options=storage_options, overwrite=overwrite, chunk_size=chunk_size,
                              sync=sync) as writer:
            for part in plan.parts:
                shards = [ShardData(fqn=it.fqn, data=_chunk_tensor(reader, it), global_shape=it.global_shape,
                                    offsets=it.offsets) for it in part.items]
                writer.write_rank(part.rank, shards, part=part.part)
                del shards
            for key, value in values.items():
                writer.add_value(key, value)
            manifest = writer.commit(step=step, metadata=metadata, topology=Topology(world_size=plan.world_size))
    finally:
        reader.close()
    return ImportReport(manifest=manifest, skipped=tuple(skipped), bytes_read=reader.bytes_read)


__all__ = [
    "DEFAULT_MEMORY_BUDGET",
    "TRUST_PICKLE_HELP",
    "ChunkItem",
    "ImportPlan",
    "ImportReport",
    "RankPart",
    "Slot",
    "ValueGroup",
    "fill",
    "group_values",
    "import_dcp",
    "plan_import",
    "rank_of_files",
]
