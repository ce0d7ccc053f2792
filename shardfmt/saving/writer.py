"""The low-level CheckpointWriter: the files of any number of ranks from one process, one commit.

``shardfmt.save`` (rank 0 of every save), the offline tools (convert, DCP import) and the
tests build checkpoints with it. Constructing one does no I/O; staging happens in ``stage``
(called by the first write if not before), so a writer can be made, passed around and
configured before it touches the destination.
"""

from __future__ import annotations

import datetime as _dt
import platform
import uuid
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import orjson
import torch

from shardfmt._version import __version__
from shardfmt.commit import protocol as _commit
from shardfmt.commit.nodepart import PartRecord, commit_record, publish_part
from shardfmt.errors import (
    CheckpointNotFoundError,
    CommitError,
    IntegrityError,
    ShapeError,
    StateDictError,
)
from shardfmt.format import hashing, jsonvalue, refs
from shardfmt.format.dtypes import dtype_code
from shardfmt.format.index import RankEntry, rank_table
from shardfmt.format.manifest import (
    BASES_NAME,
    INDEX_DIR,
    Extension,
    FileRecord,
    ListedShard,
    Manifest,
    Placed,
    Placement,
    RankPart,
    ShardRecord,
    TensorRecord,
    Topology,
    ValueRecord,
    ViewRecord,
    rank_file_name,
)
from shardfmt.format.parse import check_step
from shardfmt.format.stats import EXTENSION as STATS_EXTENSION
from shardfmt.format.stats import add, as_extension_value
from shardfmt.io.documents import check_bases
from shardfmt.io.registry import get_storage
from shardfmt.io.store import Storage
from shardfmt.layout.geometry import Box
from shardfmt.layout.tiling import tiling_problems
from shardfmt.saving.messages import WrittenFile
from shardfmt.saving.options import SaveOptions
from shardfmt.saving.rank_index import write_rank_index
from shardfmt.saving.root import PlacedCheck, listed_record, merge_records, placed_record
from shardfmt.saving.shard_file import (
    ShardData,
    ShardSpec,
    ShardStream,
    default_write_workers,
    file_order,
    write_shard_file,
)


def default_writer_versions() -> dict[str, str]:
    return {"shardfmt": __version__, "torch": torch.__version__.split("+")[0],
            "python": platform.python_version()}


def format_time(t: _dt.datetime) -> str:
    if t.tzinfo is None:
        t = t.replace(tzinfo=_dt.timezone.utc)
    return t.astimezone(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def new_save_id() -> str:
    return uuid.uuid4().hex[:16]


@dataclass
class _TensorMeta:
    dtype: str
    shape: tuple[int, ...]
    placement: Placement | None = None
    shards: list[ShardRecord] = field(default_factory=list)


_Lease = _commit.Heartbeat  # a save's lease, kept fresh while it writes (commit.protocol)


class CheckpointWriter:
    """Write the files of any number of ranks from one process, then commit once.

    Protocol::

        1) w = CheckpointWriter(path, ...)        no I/O: where and how to write
           w.stage()                              checks the destination, stages a temp dir
                                                  (the first write or the commit does it if not called)
        2) w.write_rank(rank, shards) per file    streams + hashes each file
           (or s = w.stream_rank(rank, specs); s.write(bytes)...; s.close(): data fed in pieces)
        3) w.add_alias / add_view / add_value     non-shard records
        4) w.commit(step=..., topology=...)       manifest, [check_staged], COMMITTED, atomic publish
        (on any failure: w.abort() removes the staging dir)

    ``check_staged(storage, staging_path)``, when given, runs once the staged files and the
    manifest are written and before ``COMMITTED`` is: raising from it aborts the commit (offline
    tools validate what they wrote there).
    """

    def __init__(
        self,
        path: str,
        *,
        storage: Storage | None = None,
        options: SaveOptions | None = None,
        lease_seconds: float | None = None,
        check_staged: Callable[[Storage, str], None] | None = None,
        topology: Topology | None = None,
        **knobs: Any,
    ) -> None:
        """No I/O: ``options`` (with any ``SaveOptions`` field given as a keyword, e.g.
        ``chunk_size=4096``) say how to write; ``stage()`` touches the destination.

        ``topology``, when known before the files are written (v2), lets the writer check a
        placed tensor's boxes as each file closes and keep two counters of them instead of
        every shard record until the commit (at 4096 ranks, millions); ``commit`` then takes
        this topology (or none)."""
        opts = SaveOptions.merged(options, **knobs)
        if opts.chunk_size is not None and not 4096 <= opts.chunk_size <= 1 << 30:
            raise CommitError(f"chunk_size {opts.chunk_size} is outside [4096, 2^30]")
        if storage is None:
            storage, path = get_storage(path, opts.storage_options)
        seams = opts.seams
        self.storage = storage
        self.path = path
        self.save_id = seams.save_id or new_save_id()
        self._clock = seams.clock or (lambda: _dt.datetime.now(_dt.timezone.utc))
        self._writer_versions = dict(seams.writer_versions) if seams.writer_versions is not None \
            else default_writer_versions()
        self._on_step = seams.on_step
        self.chunk_size = opts.chunk_size or hashing.DEFAULT_CHUNK_SIZE
        self._sync = opts.sync
        self.write_workers = opts.write_workers or default_write_workers()
        self.part_size = opts.part_size
        self._check_staged = check_staged
        self._overwrite = opts.overwrite
        self._lease_seconds = storage.lease_seconds if lease_seconds is None else lease_seconds
        self._files: dict[str, FileRecord] = {}
        self._tensors: dict[str, _TensorMeta] = {}
        self._storages: dict[str, _TensorMeta] = {}
        self._aliases: dict[str, str] = {}
        self._views: dict[str, tuple[str, tuple[int, ...], ViewRecord]] = {}
        self._values: dict[str, ValueRecord] = {}
        self._streaming: set[str] = set()
        self.format_version = opts.format_version
        self._placed: dict[str, tuple[str, tuple[int, ...], Placed]] = {}  # v2: fqn -> (dtype, shape, placed)
        self._listed: dict[str, TensorRecord] = {}  # v2: records whose boxes other processes wrote
        self._rank_entries: dict[int, RankEntry] = {}  # v2: indexes other processes wrote
        self._external_storages: set[str] = set()  # v2: placed or listed storage buffers
        self._external_files: set[str] = set()  # v2: data files other processes wrote
        self._topology = topology  # v2: known before the files are written (or given at the commit)
        self._checks: dict[str, PlacedCheck] = {}  # v2: placed tensors checked file by file
        self._chain: refs.Chain | None = None  # v2: an incremental save's bases (spec section 4.10)
        self._base = opts.base
        self._node_part = opts.node_part
        self._stats: dict[str, list[float]] | None = {}  # v2: per-tensor statistics, summed over the ranks
        self._hints: dict[str, Extension] = {}  # v2: extensions that only add information (spec section 9)
        self._done = False
        self._staging: str | None = None
        self._lease: _Lease | None = None

    # -- 1) staging
    def stage(self) -> str:
        """Check the destination and stage this save (once); return the staging path."""
        if self._staging is None:
            if self._done:
                raise CommitError(f"{self.path}: this writer already finished")
            self._staging = _commit.prepare(self.storage, self.path, self.save_id, overwrite=self._overwrite,
                                            lease_seconds=self._lease_seconds)
            self._lease = _Lease(self.storage, self._staging, self._lease_seconds, self.save_id)
            if self._base is not None:
                self._name_base(self._staging)
        return self._staging

    def _name_base(self, staging: str) -> None:
        """An incremental save names its base in its staging location while it runs, so that
        retention elsewhere keeps the base (spec/ROOTS.md section 1)."""
        name = self._base.rstrip("/").rpartition("/")[2]
        try:
            self.storage.write_bytes(self.storage.join(staging, BASES_NAME),
                                     orjson.dumps({"bases": [name]}) + b"\n", sync=self._sync)
        except BaseException:
            self.abort()
            raise

    @property
    def staging(self) -> str:
        """Where the files are staged (stages the save first if needed)."""
        return self.stage()

    @property
    def name_tag(self) -> str | None:
        """What data file names carry (``rank_file_name``): the save id on object stores."""
        return self.save_id if _commit.commit_strategy(self.storage).in_place else None

    # -- 2) data files
    def write_rank(self, rank: int, shards: Sequence[ShardData], *, part: int | None = None,
                   storages: Sequence[ShardData] = ()) -> WrittenFile:
        """Write one data file holding ``shards`` (and storage buffers) for ``rank``."""
        name = rank_file_name(rank, part, self.name_tag)
        if name in self._files:
            raise CommitError(f"{name}: written twice in one save")
        # Larger elements first, then by name: every tensor then starts at a multiple of its
        # element size (the header is padded to 8), so readers can view bytes in place.
        ordered = file_order(list(shards) + list(storages))
        storage_names = {s.fqn for s in storages}
        self._register([s.spec() for s in ordered], storage_names)
        try:
            written = write_shard_file(self.storage, self.stage(), name, rank, ordered,
                                       chunk_size=self.chunk_size, sync=self._sync,
                                       workers=self.write_workers, part_size=self.part_size,
                                       aligned=self.format_version >= 2)
        except BaseException:
            self.abort()
            raise
        self._record(written, storage_names)
        return written

    def stream_rank(self, rank: int, shards: Sequence[ShardSpec], *, part: int | None = None,
                    storages: Sequence[ShardSpec] = (),
                    hash_pool: ThreadPoolExecutor | None = None) -> ShardStream:
        """Open rank ``rank``'s data file for streaming: its slices (``shards`` and storage
        buffers, described without data) are laid out in file order (``stream.specs``); the
        caller writes their bytes in that order and closes the stream, which records the file."""
        name = rank_file_name(rank, part, self.name_tag)
        if name in self._files or name in self._streaming:
            raise CommitError(f"{name}: written twice in one save")
        ordered = file_order(list(shards) + list(storages))
        storage_names = {s.fqn for s in storages}
        self._register(ordered, storage_names)
        self._streaming.add(name)

        def on_close(written: WrittenFile) -> None:
            self._streaming.discard(name)
            self._record(written, storage_names)

        return ShardStream(self.storage, self.stage(), name, rank, ordered, chunk_size=self.chunk_size,
                           sync=self._sync, hash_pool=hash_pool, on_close=on_close, aligned=self.format_version >= 2)

    def _register(self, specs: Sequence[ShardSpec], storage_names: set[str]) -> None:
        for s in specs:
            table = self._storages if s.fqn in storage_names else self._tensors
            code = dtype_code(s.dtype, what=s.fqn)
            meta = table.get(s.fqn)
            if meta is None:
                table[s.fqn] = _TensorMeta(code, tuple(s.global_shape), s.placement)
            elif (meta.dtype, meta.shape) != (code, tuple(s.global_shape)):
                raise ShapeError(f"{s.fqn}: shards disagree on dtype/shape ({meta.dtype} {list(meta.shape)} vs "
                                 f"{code} {list(s.global_shape)})")

    def _record(self, written: WrittenFile, storage_names: set[str]) -> None:
        """Keep a closed file's record and its shards (a placed tensor's checked and counted
        instead, when the topology is known); a refused file aborts the save."""
        try:
            self._keep(written, storage_names)
        except BaseException:
            self.abort()
            raise

    def _keep(self, written: WrittenFile, storage_names: set[str]) -> None:
        self._files[written.name] = written.record
        checked: dict[str, list[Box]] = {}
        for fqn, shard in written.shards:
            if self._topology is not None and fqn in self._placed:
                checked.setdefault(fqn, []).append(Box(shard.offsets, shard.lengths))
            else:
                (self._storages if fqn in storage_names else self._tensors)[fqn].shards.append(shard)
        for fqn, boxes in checked.items():
            self._check(fqn, self._topology).add(written.record.rank, boxes)

    def _check(self, fqn: str, topology: Topology) -> PlacedCheck:
        check = self._checks.get(fqn)
        if check is None:
            check = self._checks[fqn] = PlacedCheck(fqn, self._placed[fqn], topology)
        return check

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

    def place(self, fqn: str, dtype: str, shape: tuple[int, ...], placed: Placed, *, storage: bool = False) -> None:
        """v2: record ``fqn`` (a storage buffer with ``storage``) by its placement: its
        writers wrote the boxes it derives."""
        self._placed[fqn] = (dtype, tuple(shape), placed)
        if storage:
            self._external_storages.add(fqn)

    def add_listed(self, fqn: str, dtype: str, shape: tuple[int, ...], placement: Placement | None,
                   shards: Sequence[ListedShard], *, storage: bool = False) -> None:
        """v2: record ``fqn`` by boxes other processes wrote, each with its writer rank."""
        self._listed[fqn] = listed_record(fqn, dtype, shape, placement, shards)
        if storage:
            self._external_storages.add(fqn)

    def add_rank_entry(self, rank: int, entry: RankEntry, *, files: Sequence[str] = ()) -> None:
        """v2: record the index another process wrote for ``rank``, and its data ``files``
        (which the commit requires still there)."""
        self._rank_entries[rank] = entry
        self._external_files.update(files)

    def add_stats(self, stats: Mapping[str, Sequence[float]]) -> None:
        """v2: add a rank's per-tensor statistics (``format.stats``): the root records the sums."""
        if self._stats is None:
            return
        for fqn, vals in stats.items():
            add(self._stats, fqn, vals)

    def drop_stats(self) -> None:
        """v2: record no statistics (a rank could not compute its part)."""
        self._stats = None

    def add_hint(self, name: str, value: Any) -> None:
        """v2: record the extension ``name`` (one spec section 9 defines) that only adds
        information: ``required`` false, readers that do not know it load the same data."""
        self._hints[name] = Extension(required=False, value=value)

    def add_chain(self, chain: refs.Chain) -> None:
        """v2: record bases a rank's index references (an incremental save): the union is kept.
        A chain past the format's limits (section 4.10) is refused: no reader could open it."""
        if self._chain is not None:
            chain = refs.Chain(bases={**self._chain.bases, **chain.bases}, depth=max(self._chain.depth, chain.depth))
        if len(chain.bases) > refs.MAX_BASES or chain.depth > refs.MAX_DEPTH:
            raise CommitError(f"{self.path}: an incremental chain of {len(chain.bases)} bases and depth {chain.depth} "
                              f"exceeds the format's {refs.MAX_BASES} bases / depth {refs.MAX_DEPTH}: save in full")
        self._chain = chain

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
        if self.format_version >= 2:
            return self._build_root(step=step, metadata=metadata, topology=topology)
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
        tensors = self._links(tensors)
        return Manifest(
            save_id=self.save_id,
            created_at=format_time(self._clock()),
            step=step,
            writer=self._writer_versions,
            chunk_size=self.chunk_size,
            metadata=jsonvalue.encode(metadata, where="metadata"),
            topology=self._topology_of(topology),
            files=dict(sorted(self._files.items())),
            tensors=tensors,
            storages=storages,
            values=dict(sorted(self._values.items())),
        )

    def _topology_of(self, topology: Topology | None) -> Topology:
        """The checkpoint's topology: the commit's, the constructor's (they must agree), or the
        smallest world that holds every rank written."""
        if self._topology is not None and topology is not None and topology != self._topology:
            raise CommitError(f"{self.path}: committed with the topology {topology}, but its files were "
                              f"checked against {self._topology}")
        ranks = [f.rank for f in self._files.values()] + list(self._rank_entries)
        return topology or self._topology or Topology(world_size=max(ranks, default=0) + 1)

    def _links(self, tensors: dict[str, TensorRecord]) -> dict[str, TensorRecord]:
        """Aliases and views added to the stored ``tensors`` (sorted by name)."""
        for fqn, target in sorted(self._aliases.items()):
            if fqn in tensors:
                raise StateDictError(f"{fqn}: both stored and aliased")
            t = tensors.get(target)
            if t is None:
                raise StateDictError(f"{fqn}: alias target {target!r} is not stored")
            tensors[fqn] = TensorRecord(dtype=t.dtype, shape=t.shape, alias_of=target)
        for fqn, (dtype, shape, view) in sorted(self._views.items()):
            tensors[fqn] = TensorRecord(dtype=dtype, shape=shape, view=view)
        return dict(sorted(tensors.items()))

    def _build_root(self, *, step: int | None, metadata: Any, topology: Topology | None) -> Manifest:
        """v2: the root manifest, once every rank index is written and the rank table staged."""
        topology = self._topology_of(topology)
        tables: tuple[dict[str, TensorRecord], dict[str, TensorRecord]] = ({}, {})
        for (table, out) in zip((self._tensors, self._storages), tables):
            for fqn in sorted(table):
                meta = table[fqn]
                shards = [ListedShard(offsets=s.offsets, lengths=s.lengths, rank=self._files[s.file].rank)
                          for s in meta.shards]
                if fqn in self._placed:  # written here and placed: the boxes must be the writer rule's
                    check = self._check(fqn, topology)
                    for rank, boxes in _by_rank(shards).items():
                        check.add(rank, boxes)
                    check.finish((meta.dtype, meta.shape))
                    continue
                out[fqn] = listed_record(fqn, meta.dtype, meta.shape, meta.placement, shards)
        placed = {f: placed_record(f, d, sh, p) for f, (d, sh, p) in self._placed.items()}
        external = {**self._listed, **placed}
        tensors = merge_records(tables[0], {f: r for f, r in external.items() if f not in self._external_storages})
        storages = merge_records(tables[1], {f: r for f, r in external.items() if f in self._external_storages})
        values = {f: (ValueRecord(indexed=True) if v.per_rank is not None else v)
                  for f, v in sorted(self._values.items())}
        return Manifest(
            format_version=2, save_id=self.save_id, created_at=format_time(self._clock()), step=step,
            writer=self._writer_versions, chunk_size=self.chunk_size,
            metadata=jsonvalue.encode(metadata, where="metadata"), topology=topology,
            tensors=self._links(tensors), storages=storages, values=values, ranks=self._stage_rank_table(topology),
            extensions=self._extensions(),
        )

    def _extensions(self) -> dict[str, Extension]:
        out = dict(self._hints)
        if self._chain is not None:
            out[refs.EXTENSION] = self._chain.to_extension()
        if self._stats:  # a statistic: readers that do not know it ignore it (spec section 9)
            out[STATS_EXTENSION] = Extension(required=False, value=as_extension_value(self._stats))
        return out

    def _stage_rank_table(self, topology: Topology) -> tuple[RankPart, ...]:
        """Write this process's rank indexes, then the rank table's parts; return the parts."""
        per_rank: dict[int, dict[str, Any]] = {}
        for fqn, v in self._values.items():
            for r, x in (v.per_rank or {}).items():
                per_rank.setdefault(r, {})[fqn] = x
        files: dict[int, dict[str, FileRecord]] = {}
        for name, f in self._files.items():
            files.setdefault(f.rank, {})[name] = f
        for r in sorted(files.keys() | per_rank.keys()):
            if r in self._rank_entries:
                raise CommitError(f"rank {r}: its index was written by another process and by this one")
            self._rank_entries[r] = write_rank_index(self.storage, self.staging, rank=r, save_id=self.save_id,
                                                     name_tag=self.name_tag, files=files.get(r, {}),
                                                     values=per_rank.get(r, {}))
        bad = [r for r in self._rank_entries if r >= topology.world_size]
        if bad:
            raise CommitError(f"rank(s) {bad[:3]} wrote an index but the world size is {topology.world_size}")
        parts = rank_table(self.save_id, topology.world_size, self._rank_entries, name_tag=self.name_tag)
        self.storage.makedirs(self.storage.join(self.staging, INDEX_DIR))
        for part, raw in parts:
            self.storage.write_bytes(self.storage.join(self.staging, part.name), raw, sync=self._sync)
        return tuple(p for p, _ in parts)

    def commit(self, *, step: int | None = None, metadata: Any = None,
               topology: Topology | None = None) -> Manifest:
        """Build the manifest and publish the checkpoint; abort on any failure."""
        try:
            check_step(step)
        except StateDictError:
            self.abort()
            raise
        if self._done:
            raise CommitError(f"{self.path}: this writer already finished")
        if self._streaming:
            self.abort()
            raise CommitError(f"{self.path}: data file(s) {sorted(self._streaming)[:3]} were opened for "
                              "streaming and never closed")
        try:
            self.stage()
        except BaseException:
            self.abort()
            raise
        if self._lease.lost:
            self.abort()
            raise CommitError(f"{self.storage.url(self.path)}: this save's lease was collected or taken over by "
                              "another save while it ran (it stalled past its lease); nothing was committed")
        try:
            manifest = self.build_manifest(step=step, metadata=metadata, topology=topology)
            if self._node_part is not None:  # the node-local tier: node 0's part (commit.nodepart)
                raw = manifest.to_json()
                publish_part(self.storage, self.path, self.staging, raw, PartRecord(
                    commit=commit_record(raw, self.save_id, manifest.format_version), part=self._node_part,
                    world_size=manifest.topology.world_size), {})
            else:
                _commit.publish(self.storage, self.path, self.staging, manifest, overwrite=self._overwrite,
                                on_step=self._steps, required=self._required(manifest))
        except BaseException:
            self.abort()
            raise
        self._done = True
        self._lease.stop(release=True)
        return manifest

    def _required(self, manifest: Manifest) -> list[str] | None:
        """v2: what the commit requires still staged: every data file, rank index and part
        (v1: None, the manifest's files)."""
        if manifest.format_version < 2:
            return None
        self._check_bases()
        own = {n for n in self._external_files if refs.split(n)[0] is None}
        return sorted({*self._files, *own, *(e.name for e in self._rank_entries.values()),
                       *(p.name for p in manifest.ranks)})

    def _check_bases(self) -> None:
        """An incremental save: every base must still hold the save its chain records, and every
        base file a rank's index references must still be there (spec/ROOTS.md section 1)."""
        used = sorted(n for n in self._external_files if refs.split(n)[0] is not None)
        try:
            check_bases(self.storage, self.path, self._chain, used)
        except IntegrityError as e:
            raise CommitError(f"{e}; nothing was committed") from None
        for name in used:
            full, within = refs.location(self.storage.join, self.path, name)
            try:
                self.storage.size(full, within=within)
            except CheckpointNotFoundError:
                raise CommitError(f"{self.storage.url(self.path)}: {refs.missing_file(name)}; nothing was "
                                  "committed") from None

    def _steps(self, name: str) -> None:
        """The commit protocol's step hook: the staged-result check, then the caller's hook."""
        if name == "manifest_written" and self._check_staged is not None:
            self._check_staged(self.storage, self.staging)
        if self._on_step is not None:
            self._on_step(name)

    def abort(self) -> None:
        """Discard everything staged (never touches a committed checkpoint)."""
        if self._done:
            return
        self._done = True
        if self._staging is None:
            return  # never staged: nothing to discard
        self._lease.stop()
        if self.staging != self.path:
            _commit.abort(self.storage, self.staging)
        elif not _commit.is_committed(self.storage, self.path):
            _commit.abort_own(self.storage, self.path, self.save_id)

    def __enter__(self) -> CheckpointWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()


def _by_rank(shards: Sequence[ListedShard]) -> dict[int, list[Box]]:
    out: dict[int, list[Box]] = {}
    for s in shards:
        out.setdefault(s.rank, []).append(Box(s.offsets, s.lengths))
    return out


# ShardData is shard_file's; named here too for ``shardfmt/__init__`` (which imports it from this module).
__all__ = ["CheckpointWriter", "ShardData", "default_writer_versions", "format_time", "new_save_id"]
