"""Typed messages between the ranks of a save, encoded with the manifest's own record codecs.

Every message is a frozen record with ``to_json()`` and a ``from_json(obj, ...)`` decoder.
The records inside (tensor, view, file and shard records) go on the wire as the manifest
writes them and come back through the manifest's parsers, with the same validation a
manifest gets: a rank never accepts a record from another rank that a reader would refuse.

    RankState   step 1/3: what a rank holds (tensor boxes, aliases, views, values)
    Summary     v2 step 3: what rank 0 needs of a rank (its group's claims once, its listed boxes)
    WritePlan   v2 step 4: rank 0's plan (placed tensors, listed boxes' writers, hash chunk)
    Failures    v2 step 6: the failures rank 0 gathered, told to every rank
    Staged      step 5:   rank 0 staged the checkpoint (save id, staging dir, file name tag)
    Written     step 6:   the file a rank wrote (its file record and shard records), or none
    Committed   step 7:   the manifest rank 0 committed
    RankError   any step: a rank's failure (type and message; the exception itself locally)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from shardfmt.errors import ShardfmtError
from shardfmt.format.fields import int_field, parse_placement
from shardfmt.format.index import RankEntry
from shardfmt.format.manifest import (
    FileRecord,
    Manifest,
    Placed,
    Placement,
    ShardRecord,
    TensorRecord,
)
from shardfmt.format.parse import (
    parse_file_name,
    parse_file_record,
    parse_manifest,
    parse_shard_record,
    parse_tensor_record,
)
from shardfmt.format.parse_v2 import parse_rank_entry
from shardfmt.format.refs import Chain, check_base, parse_chain, split
from shardfmt.format.stats import decode_sums, encode_sums
from shardfmt.layout.geometry import Box

MAX_WORLD = 1 << 24  # the manifest's limit on ranks
WriteKey = tuple[str, tuple[int, ...], tuple[int, ...]]  # (fqn, offsets, lengths)


def _where(rank: int, what: str) -> str:
    return f"(rank {rank}'s {what})"


@dataclass(frozen=True, slots=True, kw_only=True)
class HeldTensor:
    """What one rank holds of one tensor (or storage buffer): its record and its global boxes."""

    fqn: str
    dtype: str
    shape: tuple[int, ...]
    placement: Placement | None = None
    storage: bool = False  # a shared buffer (``.storage.*``) that views point into
    boxes: tuple[Box, ...] = ()

    def record(self) -> TensorRecord:
        return TensorRecord(dtype=self.dtype, shape=self.shape, placement=self.placement)

    def to_json(self) -> dict:
        return {"fqn": self.fqn, "record": self.record().to_json(), "storage": self.storage,
                "boxes": [[list(b.offsets), list(b.lengths)] for b in self.boxes]}

    @classmethod
    def from_json(cls, o: Mapping, *, rank: int) -> HeldTensor:
        fqn = o["fqn"]
        rec = parse_tensor_record(fqn, o["record"], _where(rank, fqn), {}, flat=True)
        boxes = tuple(_box(b, rec.shape, f"{_where(rank, fqn)}.boxes[{i}]") for i, b in enumerate(o["boxes"]))
        return cls(fqn=fqn, dtype=rec.dtype, shape=rec.shape, placement=rec.placement, storage=bool(o["storage"]),
                   boxes=boxes)


def _box(v: Any, shape: tuple[int, ...], where: str) -> Box:
    offsets, lengths = (tuple(int(x) for x in part) for part in v)
    if len(offsets) != len(shape) or len(lengths) != len(shape) or any(
            o < 0 or n < 0 or o + n > s for o, n, s in zip(offsets, lengths, shape)):
        raise ShardfmtError(f"{where}: box {list(offsets)}+{list(lengths)} is outside the shape {list(shape)}")
    return Box(offsets, lengths)


@dataclass(frozen=True, slots=True, kw_only=True)
class RankState:
    """Step 1: what a rank saves. Values are typed JSON already (a snapshot of the caller's)."""

    rank: int
    tensors: tuple[HeldTensor, ...] = ()
    aliases: Mapping[str, str] = field(default_factory=dict)
    views: Mapping[str, TensorRecord] = field(default_factory=dict)  # records with ``view`` set
    values: Mapping[str, Any] = field(default_factory=dict)
    per_rank: Mapping[str, Any] = field(default_factory=dict)
    replica_digests: Mapping[str, str] = field(default_factory=dict)  # "fqn [offsets]+[lengths]" -> digest

    def to_json(self) -> dict:
        return {"rank": self.rank, "tensors": [t.to_json() for t in self.tensors], "aliases": dict(self.aliases),
                "views": {f: r.to_json() for f, r in self.views.items()}, "values": dict(self.values),
                "per_rank": dict(self.per_rank), "replica_digests": dict(self.replica_digests)}

    @classmethod
    def from_json(cls, o: Mapping, *, rank: int) -> RankState:
        views = _views(o["views"], rank)
        return cls(rank=rank, tensors=tuple(HeldTensor.from_json(t, rank=rank) for t in o["tensors"]),
                   aliases={str(k): str(v) for k, v in o["aliases"].items()}, views=views,
                   values=o["values"], per_rank=o["per_rank"], replica_digests=o["replica_digests"])


@dataclass(frozen=True, slots=True, kw_only=True)
class Claim:
    """v2: a tensor a rank holds exactly as its placement derives for the rank's mesh
    coordinates (spec 4.3), so its boxes need not travel. A plain tensor held whole claims
    the empty placement (a replica on every rank)."""

    fqn: str
    dtype: str
    shape: tuple[int, ...]
    placement: Placement
    storage: bool = False

    def held(self) -> HeldTensor:
        """The tensor's record without boxes (what rank 0 records)."""
        placement = None if self.placement == Placement() else self.placement  # a plain tensor has none
        return HeldTensor(fqn=self.fqn, dtype=self.dtype, shape=self.shape, placement=placement, storage=self.storage)

    def to_json(self) -> list:
        return [self.fqn, TensorRecord(dtype=self.dtype, shape=self.shape, placement=self.placement).to_json(),
                self.storage]

    @classmethod
    def from_json(cls, o: Any, *, rank: int) -> Claim:
        fqn, record, storage = o
        rec = parse_tensor_record(fqn, record, _where(rank, fqn), {}, flat=True)
        if rec.placement is None:
            raise ShardfmtError(f"{_where(rank, fqn)}: a claim without a placement")
        return cls(fqn=fqn, dtype=rec.dtype, shape=rec.shape, placement=rec.placement, storage=bool(storage))


@dataclass(frozen=True, slots=True, kw_only=True)
class Summary:
    """v2 step 3, one rank to rank 0: its claims (sent by the first rank of each group of ranks
    with the same claims, None from the others), the tensors it cannot claim with their boxes,
    aliases and views, the names of its per-rank values (it writes them into its own index),
    the replicated values in buckets the ranks disagree on (rank 0 has the rest), and replica
    digests (``check_replicas``)."""

    rank: int
    claims: tuple[Claim, ...] | None = None
    listed: tuple[HeldTensor, ...] = ()
    aliases: Mapping[str, str] = field(default_factory=dict)
    views: Mapping[str, TensorRecord] = field(default_factory=dict)
    values: Mapping[str, Any] = field(default_factory=dict)
    per_rank: tuple[str, ...] = ()
    replica_digests: Mapping[str, str] = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"claims": None if self.claims is None else [c.to_json() for c in self.claims],
                "listed": [t.to_json() for t in self.listed], "aliases": dict(self.aliases),
                "views": {f: r.to_json() for f, r in self.views.items()}, "values": dict(self.values),
                "per_rank": list(self.per_rank), "replica_digests": dict(self.replica_digests)}

    @classmethod
    def from_json(cls, o: Mapping, *, rank: int) -> Summary:
        claims = o["claims"]
        return cls(rank=rank, claims=None if claims is None else tuple(Claim.from_json(c, rank=rank) for c in claims),
                   listed=tuple(HeldTensor.from_json(t, rank=rank) for t in o["listed"]),
                   aliases={str(k): str(v) for k, v in o["aliases"].items()}, views=_views(o["views"], rank),
                   values=o["values"], per_rank=tuple(str(f) for f in o["per_rank"]),
                   replica_digests=o["replica_digests"])


@dataclass(frozen=True, slots=True, kw_only=True)
class WritePlan:
    """v2 step 4, rank 0 to every rank: the placed tensors (each rank derives what it writes of
    them), the writer of every listed box, the hash chunk; or the failures that stop the save."""

    placed: Mapping[str, Placed] = field(default_factory=dict)
    listed: Mapping[WriteKey, int] = field(default_factory=dict)
    chunk_size: int = 0
    failures: tuple[RankError, ...] = ()

    def to_json(self) -> dict:
        return {"placed": [[f, p.to_json()] for f, p in self.placed.items()],
                "listed": [[f, list(o), list(n), r] for (f, o, n), r in self.listed.items()],
                "chunk_size": self.chunk_size, "failures": [e.to_json() for e in self.failures]}

    @classmethod
    def from_json(cls, o: Mapping, *, rank: int = 0) -> WritePlan:
        placed = {}
        for fqn, p in o["placed"]:
            where = f"(the write plan's {fqn})"
            placement = parse_placement({k: p[k] for k in ("mesh_dims", "placements", "stage")}, where, 64, flat=True)
            placed[str(fqn)] = Placed(placement=placement, writer=int_field(p["writer"], where + ".writer"))
        listed = {(str(f), tuple(int(x) for x in off), tuple(int(x) for x in n)): int(r) for f, off, n, r in o["listed"]}
        return cls(placed=placed, listed=listed, chunk_size=int(o["chunk_size"]),
                   failures=tuple(RankError.from_json(e) for e in o["failures"]))


def _views(o: Mapping, rank: int) -> dict[str, TensorRecord]:
    views = {f: parse_tensor_record(f, r, _where(rank, f), {}) for f, r in o.items()}
    if any(r.view is None for r in views.values()):
        raise ShardfmtError(f"{_where(rank, 'views')}: a view record without a view")
    return views


@dataclass(frozen=True, slots=True, kw_only=True)
class Staged:
    """Step 5: rank 0 staged the checkpoint; every rank names its file as rank 0's writer does."""

    save_id: str
    staging: str
    name_tag: str | None

    def to_json(self) -> dict:
        return {"save_id": self.save_id, "staging": self.staging, "name_tag": self.name_tag}

    @classmethod
    def from_json(cls, o: Mapping, *, rank: int = 0) -> Staged:
        return cls(save_id=str(o["save_id"]), staging=str(o["staging"]),
                   name_tag=None if o["name_tag"] is None else str(o["name_tag"]))


@dataclass(frozen=True, slots=True, kw_only=True)
class WrittenFile:
    """What writing one file produced: its record and the shard records inside it."""

    name: str
    record: FileRecord
    shards: tuple[tuple[str, ShardRecord], ...]  # (fqn, shard)

    def to_json(self) -> dict:
        return {"name": self.name, "record": self.record.to_json(),
                "shards": [[f, s.to_json()] for f, s in self.shards]}

    @classmethod
    def from_json(cls, o: Mapping, *, rank: int, tensors: Mapping[str, TensorRecord]) -> WrittenFile:
        """Decode with the manifest's parsers; ``tensors`` (fqn -> record) give each shard its shape."""
        name = parse_file_name(o["name"], _where(rank, "file"))
        rec = parse_file_record(o["record"], _where(rank, name), MAX_WORLD)
        shards = []
        for i, (fqn, s) in enumerate(o["shards"]):
            t = tensors.get(fqn)
            if t is None:
                raise ShardfmtError(f"{_where(rank, name)}: shard of {fqn!r}, which no rank holds")
            shards.append((fqn, parse_shard_record(s, f"{_where(rank, name)}.shards[{i}]", name=fqn, ndim=len(t.shape),
                                             shape=t.shape, isz=t.itemsize, files={name: rec})))
        return cls(name=name, record=rec, shards=tuple(shards))


@dataclass(frozen=True, slots=True, kw_only=True)
class Written:
    """Step 6: the file this rank wrote (None: it writes nothing); format v2: instead, the
    rank-table entry of the index it wrote (None: it wrote neither data nor per-rank values)
    and its data files' names (what the commit checks are still there)."""

    file: WrittenFile | None = None
    index: RankEntry | None = None
    names: tuple[str, ...] = ()
    chain: Chain | None = None  # an incremental save: the bases this rank's index references
    stats: Mapping[str, Any] | None = field(default_factory=dict)  # per tensor, of its boxes (None: failed)

    def to_json(self) -> dict:
        return {"file": None if self.file is None else self.file.to_json(),
                "index": None if self.index is None else self.index.to_json(), "names": list(self.names),
                "chain": None if self.chain is None else self.chain.to_extension().value,
                "stats": None if self.stats is None else encode_sums(self.stats)}

    @classmethod
    def decoder(cls, tensors: Mapping[str, TensorRecord]):
        def decode(o: Mapping, *, rank: int) -> Written:
            f, i = o["file"], o["index"]
            return cls(file=None if f is None else WrittenFile.from_json(f, rank=rank, tensors=tensors),
                       index=None if i is None else parse_rank_entry(i, rank=rank, where=_where(rank, "index")),
                       names=tuple(_indexed_name(n, _where(rank, "names")) for n in o["names"]),
                       chain=None if o["chain"] is None else parse_chain(o["chain"], _where(rank, "chain")),
                       stats=None if o.get("stats", {}) is None else decode_sums(o.get("stats")))
        return decode


def _indexed_name(name: Any, where: str) -> str:
    """A name a rank index holds: its own ``data/...`` file or a base's ``<base>/data/...`` (section 4.10)."""
    base, inner = split(str(name))
    if base is not None:
        check_base(base, where)
    parse_file_name(inner, where)
    return str(name)


@dataclass(frozen=True, slots=True, kw_only=True)
class Committed:
    """Step 7: the committed manifest; on the node-local tier also its bytes (``raw``) and the
    rank table's parts (name, text), which every node's part holds (``commit.nodepart``)."""

    manifest: Manifest
    raw: bytes | None = field(default=None, compare=False)
    tables: tuple[tuple[str, str], ...] = ()

    def to_json(self) -> dict:
        out: dict = {"manifest": (self.raw if self.raw is not None else self.manifest.to_json()).decode()}
        if self.tables:
            out["tables"] = [list(t) for t in self.tables]
        return out

    @classmethod
    def from_json(cls, o: Mapping, *, rank: int = 0) -> Committed:
        raw = o["manifest"].encode()
        return cls(manifest=parse_manifest(raw), raw=raw,
                   tables=tuple((str(n), str(t)) for n, t in o.get("tables", ())))


@dataclass(frozen=True, slots=True, kw_only=True)
class Done:
    """A step that reports nothing but its success (a node's part staged or committed)."""

    def to_json(self) -> dict:
        return {}

    @classmethod
    def from_json(cls, o: Mapping, *, rank: int = 0) -> Done:
        return cls()


@dataclass(frozen=True, slots=True, kw_only=True)
class RankError:
    """A rank's failure at some step; ``error`` is the exception itself where it was raised."""

    rank: int
    kind: str  # the exception's class name
    message: str
    error: BaseException | None = field(default=None, compare=False, repr=False)

    @classmethod
    def of(cls, rank: int, e: BaseException) -> RankError:
        return cls(rank=rank, kind=type(e).__name__, message=str(e), error=e)

    def to_json(self) -> dict:
        return {"rank": self.rank, "type": self.kind, "error": self.message}

    @classmethod
    def from_json(cls, o: Mapping) -> RankError:
        return cls(rank=int(o["rank"]), kind=str(o["type"]), message=str(o["error"]))


@dataclass(frozen=True, slots=True, kw_only=True)
class Failures:
    """v2, rank 0 to every rank: the failures rank 0 alone gathered (none: go on)."""

    errors: tuple[RankError, ...] = ()

    def to_json(self) -> dict:
        return {"errors": [e.to_json() for e in self.errors]}

    @classmethod
    def from_json(cls, o: Mapping, *, rank: int = 0) -> Failures:
        return cls(errors=tuple(RankError.from_json(e) for e in o["errors"]))


def envelope(rank: int, msg) -> dict:
    """The wire form of a message or a failure."""
    if isinstance(msg, RankError):
        return {"ok": False, **msg.to_json()}
    return {"ok": True, "rank": rank, "body": msg.to_json()}


def open_envelope(o: Mapping, decode):
    """A message (``decode(body, rank=...)``) or a ``RankError``."""
    if not o.get("ok"):
        return RankError.from_json(o)
    return decode(o["body"], rank=int(o["rank"]))


__all__ = ["Claim", "Committed", "Done", "Failures", "HeldTensor", "RankError", "RankState", "Staged", "Summary", "WritePlan",
           "Written", "WrittenFile", "envelope", "open_envelope"]
