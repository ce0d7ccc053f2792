"""The manifest's records: immutable, with their deterministic JSON form. No I/O, no parsing.

``Manifest.to_json()`` is deterministic (sorted keys, no whitespace), so the same state and
pinned clock give the same bytes. Reading them back is ``shardfmt.format.parse``: every
field checked by its own parser. Limits guard against hostile input (see spec/FORMAT.md).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from shardfmt.errors import ManifestError
from shardfmt.format import hashing
from shardfmt.format.dtypes import itemsize

FORMAT_NAME = "shardfmt"
FORMAT_VERSION = 2  # the newest version this package reads and writes (spec/FORMAT.md section 9)
READ_VERSIONS = (1, 2)  # one reader per version: every version ever written stays readable
INDEX_DIR = "index"  # v2: rank table parts and rank indexes (spec/FORMAT.md section 5)
MANIFEST_NAME = "manifest.json"
COMMITTED_NAME = "COMMITTED"
LEASE_NAME = "LEASE"  # object stores: a save in progress holds its lease here (spec/ROOTS.md section 1)
BASES_NAME = "BASES"  # an incremental save's base, named while it runs (spec/ROOTS.md section 1)
QUARANTINED_NAME = "QUARANTINED"
ROLLED_BACK_NAME = "ROLLED_BACK"  # object stores: a checkpoint set aside by a rollback, in place (spec/ROOTS.md)  # object stores cannot rename a bad checkpoint aside; they mark it
DATA_DIR = "data"

MAX_MANIFEST_BYTES = 1 << 30  # 1 GiB; real manifests are far smaller
MAX_COMMITTED_BYTES = 1 << 16
MAX_NDIM = 64
MAX_STEP = 1 << 62  # the manifest's "step" (spec section 4)
MAX_DIM = 1 << 53  # JSON-safe integer range



def rank_file_name(rank: int, part: int | None = None, save_id: str | None = None) -> str:
    """Return the data file name of ``rank`` (and of its ``part`` when a rank writes several).

    ``save_id`` (object stores) goes into the name, so two saves of one prefix never write the
    same object: one that outlived its lease cannot overwrite or delete the other's data."""
    stem = f"rank_{rank:05d}" if part is None else f"rank_{rank:05d}_part_{part:03d}"
    return f"{DATA_DIR}/{stem}.{save_id}.safetensors" if save_id else f"{DATA_DIR}/{stem}.safetensors"


# --------------------------------------------------------------------------- records


@dataclass(frozen=True, slots=True, kw_only=True)
class ShardRecord:
    """One stored slice of a tensor: its box in global coordinates and where its bytes are."""

    offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    file: str
    key: str
    byte_range: tuple[int, int]
    digest: str

    def to_json(self) -> dict:
        return {
            "offsets": list(self.offsets),
            "lengths": list(self.lengths),
            "file": self.file,
            "key": self.key,
            "byte_range": list(self.byte_range),
            "digest": self.digest,
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class Placement:
    """How a tensor was laid out over the mesh, symbolically, so boxes can be derived.

    One placement per named mesh dim, applied left to right as DTensor does:
    ``("shard", d)``, ``("strided_shard", d, split_factor)`` or ``("replicate",)``;
    ``stage`` is the pipeline stage that owns the tensor (None: every stage).
    """

    mesh_dims: tuple[str, ...] = ()
    placements: tuple[tuple, ...] = ()
    stage: int | None = None

    def to_json(self) -> dict:
        return {"mesh_dims": list(self.mesh_dims), "placements": [list(p) for p in self.placements],
                "stage": self.stage}


def view_reach(shape: Sequence[int], stride: Sequence[int]) -> int:
    """Elements from a strided view's storage offset to one past the last element it reaches
    (1 for a view with no elements along some dim: callers that care check ``numel`` first)."""
    return 1 + sum((n - 1) * st for n, st in zip(shape, stride))


@dataclass(frozen=True, slots=True, kw_only=True)
class Placed:
    """v2: a tensor stored by its placement over ``topology.mesh`` alone (no shard list).

    Every rank's boxes follow from the placement (spec section 4.3); of each replica group
    (the ranks holding the same boxes) member ``writer`` mod the group's size wrote them."""

    placement: Placement
    writer: int

    def to_json(self) -> dict:
        return {**self.placement.to_json(), "writer": self.writer}


@dataclass(frozen=True, slots=True, kw_only=True)
class ListedShard:
    """v2: one stored box of a tensor whose layout no placement describes, and the rank that wrote it."""

    offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    rank: int

    def to_json(self) -> dict:
        return {"offsets": list(self.offsets), "lengths": list(self.lengths), "rank": self.rank}


@dataclass(frozen=True, slots=True, kw_only=True)
class ViewRecord:
    """A tensor stored as a strided view of a storage record (views of one buffer)."""

    base: str
    storage_offset: int
    stride: tuple[int, ...]

    def to_json(self) -> dict:
        return {"base": self.base, "storage_offset": self.storage_offset, "stride": list(self.stride)}


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorRecord:
    """A global tensor: dtype, shape, and either shards, an alias, or a view.

    In a v2 root manifest a stored tensor has ``placed`` or ``listed`` instead of ``shards``;
    a load fills ``shards`` for the boxes it reads (``shardfmt.loading.resolve``). A placed
    record's ``placement`` is its ``placed.placement`` (the JSON holds it once)."""

    dtype: str
    shape: tuple[int, ...]
    shards: tuple[ShardRecord, ...] = ()
    placement: Placement | None = None
    alias_of: str | None = None
    view: ViewRecord | None = None
    placed: Placed | None = None
    listed: tuple[ListedShard, ...] | None = None

    @property
    def stored(self) -> bool:
        """Whether the record holds data itself (not an alias, not a view)."""
        return self.alias_of is None and self.view is None

    @property
    def itemsize(self) -> int:
        return itemsize(self.dtype)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize

    def to_json(self) -> dict:
        out: dict[str, Any] = {"dtype": self.dtype, "shape": list(self.shape)}
        if self.alias_of is not None:
            out["alias_of"] = self.alias_of
        elif self.view is not None:
            out["view"] = self.view.to_json()
        else:
            out["shards"] = [s.to_json() for s in self.shards]
        if self.placement is not None:
            out["placement"] = self.placement.to_json()
        return out

    def to_json_v2(self) -> dict:
        out: dict[str, Any] = {"dtype": self.dtype, "shape": list(self.shape)}
        if self.alias_of is not None:
            out["alias_of"] = self.alias_of
        elif self.view is not None:
            out["view"] = self.view.to_json()
        elif self.placed is not None:
            out["placed"] = self.placed.to_json()
        else:
            out["shards"] = [s.to_json() for s in self.listed or ()]
        if self.placement is not None and self.placed is None:
            out["placement"] = self.placement.to_json()
        return out


@dataclass(frozen=True, slots=True, kw_only=True)
class ValueRecord:
    """A non-tensor value in typed JSON: one replicated value, or one per rank.

    In a v2 root manifest a per-rank value is ``indexed``: each rank's value lives in that
    rank's index, and ``per_rank`` holds only the ranks a load has read."""

    value: Any = None
    per_rank: Mapping[int, Any] | None = None
    indexed: bool = False

    def to_json(self) -> dict:
        if self.per_rank is not None:
            return {"per_rank": {str(r): v for r, v in sorted(self.per_rank.items())}}
        return {"value": self.value}

    def to_json_v2(self) -> dict:
        return {"per_rank": True} if self.indexed else {"value": self.value}


@dataclass(frozen=True, slots=True, kw_only=True)
class RankPart:
    """v2: one part of the rank table: which ranks it covers, where it is, and its digest."""

    first: int
    end: int
    name: str
    size: int
    digest: str

    def to_json(self) -> dict:
        return {"first": self.first, "end": self.end, "name": self.name, "size": self.size, "digest": self.digest}


@dataclass(frozen=True, slots=True, kw_only=True)
class Extension:
    """v2: an addition to the format: readers that do not know ``name`` skip it unless ``required``."""

    required: bool
    value: Any = None

    def to_json(self) -> dict:
        return {"required": self.required, "value": self.value}


@dataclass(frozen=True, slots=True, kw_only=True)
class FileRecord:
    """A data file: its writer rank, size, and the digests of its chunks.

    ``segments`` says where the chunks lie: None, chunks of ``chunk_size`` from byte 0 (v1);
    else the byte ranges ``[start, end)`` of the file's tensor entries in file order (from its
    safetensors header), each cut into chunks from its own start (v2: shard-aligned). It is
    read from the header, never written into the manifest (``to_json`` leaves it out)."""

    rank: int
    size: int
    header_size: int
    header_digest: str
    chunks: tuple[str, ...]
    digest: str
    segments: tuple[tuple[int, int], ...] | None = None

    def grid(self, chunk_size: int) -> hashing.ChunkGrid:
        """Return where this file's chunks lie, for hash chunks of ``chunk_size`` bytes."""
        if self.segments is None:
            return hashing.ChunkGrid.regular(size=self.size, chunk_size=chunk_size)
        return hashing.ChunkGrid.segmented(size=self.size, chunk_size=chunk_size, header_size=self.header_size,
                                           entries=self.segments)

    def to_json(self) -> dict:
        return {"rank": self.rank, "size": self.size, "header_size": self.header_size,
                "header_digest": self.header_digest, "digest": self.digest, "chunks": list(self.chunks)}


@dataclass(frozen=True, slots=True, kw_only=True)
class Topology:
    """World size and the named mesh (outermost dim first; rank = row-major index)."""

    world_size: int = 1
    mesh: tuple[tuple[str, int], ...] = ()

    def coords(self, rank: int) -> tuple[int, ...]:
        """Return the rank's mesh coordinates (row-major: last dim fastest)."""
        out = []
        for _, size in reversed(self.mesh):
            out.append(rank % size)
            rank //= size
        return tuple(reversed(out))

    def to_json(self) -> dict:
        return {"world_size": self.world_size, "mesh": [{"name": n, "size": s} for n, s in self.mesh],
                "ranks": [list(self.coords(r)) for r in range(self.world_size)] if self.mesh else []}

    def to_json_v2(self) -> dict:
        return {"world_size": self.world_size, "mesh": [{"name": n, "size": s} for n, s in self.mesh]}


@dataclass(frozen=True, slots=True, kw_only=True)
class Manifest:
    """Everything needed to find and verify every byte of a checkpoint."""

    save_id: str
    created_at: str
    step: int | None = None
    writer: Mapping[str, str] = field(default_factory=dict)
    hash_algorithm: str = hashing.ALGORITHM
    chunk_size: int = hashing.DEFAULT_CHUNK_SIZE
    metadata: Any = None
    topology: Topology = field(default_factory=Topology)
    files: Mapping[str, FileRecord] = field(default_factory=dict)
    tensors: Mapping[str, TensorRecord] = field(default_factory=dict)
    storages: Mapping[str, TensorRecord] = field(default_factory=dict)
    values: Mapping[str, ValueRecord] = field(default_factory=dict)
    format_version: int = 1
    ranks: tuple[RankPart, ...] = ()  # v2: the rank table's parts
    extensions: Mapping[str, Extension] = field(default_factory=dict)  # v2

    def to_json_obj(self) -> dict:
        if self.format_version >= 2:
            return self._root_json_obj()
        return {
            "format": FORMAT_NAME,
            "format_version": self.format_version,
            "save_id": self.save_id,
            "step": self.step,
            "created_at": self.created_at,
            "writer": dict(self.writer),
            "hash_algorithm": self.hash_algorithm,
            "chunk_size": self.chunk_size,
            "metadata": self.metadata,
            "topology": self.topology.to_json(),
            "files": {k: v.to_json() for k, v in self.files.items()},
            "tensors": {k: v.to_json() for k, v in self.tensors.items()},
            "storages": {k: v.to_json() for k, v in self.storages.items()},
            "values": {k: v.to_json() for k, v in self.values.items()},
        }

    def _root_json_obj(self) -> dict:
        """The v2 root manifest: no file list, no shard list, no per-rank value (spec section 4)."""
        return {
            "format": FORMAT_NAME,
            "format_version": self.format_version,
            "save_id": self.save_id,
            "step": self.step,
            "created_at": self.created_at,
            "writer": dict(self.writer),
            "hash_algorithm": self.hash_algorithm,
            "chunk_size": self.chunk_size,
            "metadata": self.metadata,
            "topology": self.topology.to_json_v2(),
            "tensors": {k: v.to_json_v2() for k, v in self.tensors.items()},
            "storages": {k: v.to_json_v2() for k, v in self.storages.items()},
            "values": {k: v.to_json_v2() for k, v in self.values.items()},
            "ranks": [p.to_json() for p in self.ranks],
            "extensions": {k: v.to_json() for k, v in self.extensions.items()},
        }

    def to_json(self) -> bytes:
        """Return the manifest's canonical bytes (sorted keys, compact, trailing newline)."""
        return orjson.dumps(self.to_json_obj(), option=orjson.OPT_SORT_KEYS) + b"\n"

    def tensor(self, fqn: str) -> TensorRecord:
        """Return the record of ``fqn``, or of the storage named so."""
        rec = self.tensors.get(fqn)
        if rec is None:
            rec = self.storages.get(fqn)
        if rec is None:
            raise KeyError(fqn)
        return rec

    def resolve(self, fqn: str) -> tuple[str, TensorRecord]:
        """Follow ``alias_of`` links and return the name and record that hold the data."""
        seen = set()
        rec = self.tensor(fqn)
        while rec.alias_of is not None:
            if fqn in seen:
                raise ManifestError(f"tensors[{fqn!r}]: alias cycle")
            seen.add(fqn)
            fqn = rec.alias_of
            rec = self.tensor(fqn)
        return fqn, rec


@dataclass(frozen=True, slots=True, kw_only=True)
class CommitRecord:
    """The content of ``COMMITTED``: which manifest, by hash, was committed by which save."""

    save_id: str
    manifest_digest: str
    format_version: int = 1  # v1's marker holds no version; v2's does (spec section 4.9)

    def to_json(self) -> bytes:
        obj: dict[str, Any] = {"format": FORMAT_NAME, "save_id": self.save_id, "manifest_digest": self.manifest_digest}
        if self.format_version >= 2:
            obj["format_version"] = self.format_version
        return orjson.dumps(obj, option=orjson.OPT_SORT_KEYS) + b"\n"


