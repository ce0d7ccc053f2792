"""Offline conversion: rewrite a checkpoint for a new topology, in one process, in bounded memory.

``convert(src, dst, mesh)`` gives every rank of the new mesh its own data file holding the
slices it will load, so the new job loads on the fast path (each rank reads its own file);
a slice several ranks hold (replicated over dp, or a tensor outside every pp stage) is
written once, by the holder the save-time balancing rule picks
(``shardfmt.saving.plan.assign_writers``). Placements come from the source manifest,
retargeted to the new mesh, or from a rules file (``shardfmt.layout.rules``).

Protocol::

    1) open the source (COMMITTED, manifest)               plan_layouts: fqn -> Layout on the mesh
    2) plan_convert (pure): every rank's boxes -> one writer per distinct box -> each file's slices
    3) plan_windows (pure): the files' slices -> windows of at most half the memory budget
    4) stage the destination (CheckpointWriter), open the files, stream window by window
       (reads verified against the source's chunk hashes; writes hashed as they go)
    5) aliases, views and values are carried over; the staged result is validated (and checked
       against the source: same names, shapes, dtypes) before COMMITTED is written

Every source byte is read once when each tensor fits in a window; larger tensors are read in
row-major runs, still once, except the hash chunks that straddle two windows.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from reshard._shardfmt import (
    Box,
    CheckpointWriter,
    HeldTensor,
    Layout,
    Manifest,
    Mesh,
    Placed,
    Placement,
    RankState,
    Rules,
    ShardSpec,
    Storage,
    Topology,
    ValueRecord,
    assign_writers,
    auto_chunk_size,
    dtype_code,
    file_order,
    get_storage,
    jsonvalue,
    load_rules,
    open_checkpoint,
    placement_record,
    plan_layouts,
    targets_for_rank,
    validate,
    written_by,
)
from reshard.overlap import refuse_overlap
from reshard.parse import out_dtype, parse_dtype, parse_mesh, parse_size
from reshard.stream.memory import (
    DEFAULT_BUDGET,
    MemoryPlan,
    fit_uploads,
    memory_plan,
    window_capacity,
)
from reshard.stream.plan import plan_windows
from reshard.stream.records import Piece
from reshard.stream.run import Buffers, Progress, Source, StreamStats, run_windows, verify_source
from shardfmt.errors import CommitError, IntegrityError, StateDictError

DEFAULT_MAX_OPEN_FILES = 256

@dataclass(frozen=True, slots=True, kw_only=True)
class RankFile:
    """What one new rank's data file holds, in file order (``storages``: storage-buffer names)."""

    rank: int
    shards: tuple[ShardSpec, ...]
    storages: frozenset[str] = frozenset()

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.shards)


@dataclass(frozen=True, slots=True, kw_only=True)
class ConvertReport:
    """What a conversion did."""

    path: str
    manifest: Manifest
    src_world: int
    world: int
    files: int
    source_bytes: int
    bytes_read: int
    bytes_written: int
    windows: int
    seconds: float
    memory_budget: int
    dropped_values: tuple[str, ...] = ()
    unused_rules: tuple[int, ...] = ()

    def to_json(self) -> dict:
        return {"path": self.path, "src_world": self.src_world, "world": self.world, "files": self.files,
                "tensors": len(self.manifest.tensors), "values": len(self.manifest.values),
                "source_bytes": self.source_bytes, "bytes_read": self.bytes_read,
                "bytes_written": self.bytes_written, "windows": self.windows, "seconds": round(self.seconds, 3),
                "memory_budget": self.memory_budget, "dropped_values": list(self.dropped_values),
                "unused_rules": list(self.unused_rules)}


# ----------------------------------------------------------------------------- planning (pure)


def stored_records(m: Manifest) -> dict[str, tuple[tuple[int, ...], Placement | None]]:
    """Every tensor record stored by shards (not an alias or view): name -> (shape, placement)."""
    return {f: (tuple(r.shape), r.placement) for f, r in m.tensors.items() if r.alias_of is None and r.view is None}


def plan_convert(m: Manifest, mesh: Mesh, layouts: Mapping[str, Layout],
                 dtypes: Mapping[str, torch.dtype], *, record_placements: bool = True) -> list[RankFile]:
    """Return every new rank's file: the boxes each rank holds on ``mesh``, each distinct box
    written by one holder (``assign_writers``: largest first, to the least-loaded holder), in
    file order. ``dtypes`` is the output dtype of every stored record and storage."""
    descs = []
    held: dict[int, list[tuple[str, Box]]] = {}
    for rank in range(mesh.world_size):
        boxes = [(t.fqn, t.box) for t in targets_for_rank(m, mesh, rank, layouts=layouts)]
        boxes += [(name, Box.full(rec.shape)) for name, rec in m.storages.items()]  # views load whole
        held[rank] = boxes
        by_fqn: dict[str, list[Box]] = {}
        for fqn, box in boxes:
            by_fqn.setdefault(fqn, []).append(box)
        descs.append(RankState(rank=rank, tensors=tuple(
            HeldTensor(fqn=f, dtype=dtype_code(dtypes[f], what=f), shape=tuple(m.tensor(f).shape), boxes=tuple(b))
            for f, b in by_fqn.items())))
    writers = assign_writers(descs)
    mine: dict[int, list[ShardSpec]] = {}
    for (fqn, offsets, lengths), rank in writers.items():
        rec = m.tensor(fqn)
        storage = fqn in m.storages
        mine.setdefault(rank, []).append(ShardSpec(
            fqn=fqn, dtype=dtypes[fqn], shape=tuple(lengths), global_shape=tuple(rec.shape), offsets=tuple(offsets),
            placement=None if storage or not record_placements else placement_record(layouts.get(fqn))))
    return [RankFile(rank=r, shards=tuple(file_order(mine[r])),
                     storages=frozenset(s.fqn for s in mine[r] if s.fqn in m.storages))
            for r in sorted(mine)]


@dataclass(frozen=True, slots=True, kw_only=True)
class PlacedFiles:
    """Format 2's plan of a convert: each record's ``Placed`` and layout; the ranks' files are
    derived a batch of ranks at a time (``files``), so its memory follows a batch, not the
    job (4.7 M shards at 4096 ranks of the 8B layout)."""

    m: Manifest
    mesh: Mesh
    layouts: Mapping[str, Layout]
    dtypes: Mapping[str, torch.dtype]
    placed: Mapping[str, Placed]

    def files(self, ranks: range) -> list[RankFile]:
        """The files of ``ranks`` (a rank that writes nothing has none), in rank order."""
        out = []
        for rank in ranks:
            mine = [ShardSpec(fqn=fqn, dtype=self.dtypes[fqn], shape=tuple(hb.box.lengths), global_shape=shape,
                              offsets=tuple(hb.box.offsets), placement=None if storage else p.placement)
                    for fqn, p, shape, storage in self._records()
                    for hb in written_by(shape, self.layouts[fqn], self.mesh.dims, writer=p.writer, rank=rank)]
            if mine:
                out.append(RankFile(rank=rank, shards=tuple(file_order(mine)),
                                    storages=frozenset(s.fqn for s in mine if s.fqn in self.m.storages)))
        return out

    def shard_bytes(self) -> Iterator[int]:
        """The bytes of every shard of every rank (what picks the hash chunk), none kept."""
        for rank in range(self.mesh.world_size):
            for fqn, p, shape, _ in self._records():
                isz = self.dtypes[fqn].itemsize
                for hb in written_by(shape, self.layouts[fqn], self.mesh.dims, writer=p.writer, rank=rank):
                    yield math.prod(hb.box.lengths) * isz

    def _records(self):
        return ((fqn, p, tuple(self.m.tensor(fqn).shape), fqn in self.m.storages) for fqn, p in self.placed.items())


def plan_placed_files(m: Manifest, mesh: Mesh, layouts: Mapping[str, Layout],
                      dtypes: Mapping[str, torch.dtype]) -> PlacedFiles:
    """Format 2's plan: every stored record is placed on ``mesh`` by its layout (storages, which
    views load whole, replicated), and each replica group's member ``writer mod G`` writes its
    boxes (spec section 4.3), ``writer`` counting up over the records, largest first. The root
    lists no box; the files are derived by batch (``PlacedFiles.files``)."""
    records = {name: rec for name, rec in list(m.tensors.items()) + list(m.storages.items())
               if rec.alias_of is None and rec.view is None}
    lay = {name: (Layout((), ()) if name in m.storages else layouts[name]) for name in records}
    order = sorted(records, key=lambda f: (-math.prod(records[f].shape) * dtypes[f].itemsize, f))
    placed = {f: Placed(placement=placement_record(lay[f]), writer=k) for k, f in enumerate(order)}
    return PlacedFiles(m=m, mesh=mesh, layouts=lay, dtypes=dtypes, placed=placed)


def pieces_of(files: Sequence[RankFile]) -> tuple[list[Piece], list[list[int]]]:
    """The streaming pieces of ``files`` (file index = position) and their units: one per
    record, in the files' common order (element size descending, then name)."""
    pieces: list[Piece] = []
    units: dict[str, list[int]] = {}
    for f, rf in enumerate(files):
        for s in rf.shards:
            units.setdefault(s.fqn, []).append(len(pieces))
            pieces.append(Piece(file=f, src=s.fqn, box=Box(tuple(s.offsets), tuple(s.shape)), dtype=s.dtype))
    order = sorted(units, key=lambda n: (-pieces[units[n][0]].dtype.itemsize, n))
    return pieces, [units[n] for n in order]


# ----------------------------------------------------------------------------- the run


def _staged_check(source: Manifest, cast: torch.dtype | None, *, deep: bool, extra_aliases: set[str],
                  expect_values: set[str]) -> Callable[[Storage, str], None]:
    """Validate the staged result (everything but the commit marker) and compare it with the
    source: the same tensors (plus ``extra_aliases``) with the same shapes, kinds and (cast)
    dtypes, and the values expected."""
    def check(storage: Storage, path: str) -> None:
        report = validate(path, deep=deep, storage=storage)
        problems = [p for p in report.problems if p.code != "not_committed"]
        if problems:
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            raise IntegrityError(f"the written checkpoint failed validation before its commit: {problems[0]}{more}")
        new = report.manifest
        if set(new.tensors) != set(source.tensors) | extra_aliases:
            diff = sorted(set(new.tensors) ^ (set(source.tensors) | extra_aliases))
            raise IntegrityError(f"internal: the written checkpoint's tensors differ from the source's: {diff[:5]}")
        for name, rec in source.tensors.items():
            got = new.tensors[name]
            want_dtype = dtype_code(out_dtype(rec.dtype, cast), what=name)
            if got.shape != rec.shape or got.dtype != want_dtype or (got.alias_of is None) != (rec.alias_of is None) \
                    or (got.view is None) != (rec.view is None):
                raise IntegrityError(f"internal: tensor {name!r} was written as {got.dtype} {list(got.shape)}, "
                                     f"expected {want_dtype} {list(rec.shape)}")
        if set(new.values) != expect_values:
            raise IntegrityError(f"internal: values written {sorted(new.values)[:5]} != expected "
                                 f"{sorted(expect_values)[:5]}")

    return check


def write_checkpoint(source: Source, dst: str, *, mesh: Mesh, topology: Topology, layouts: Mapping[str, Layout],
                     cast: torch.dtype | None, memory_budget: int, metadata: Any, step: int | None,
                     values: Mapping[str, ValueRecord], aliases: Mapping[str, str] | None = None,
                     storage_options: dict | None = None, overwrite: bool = False, progress: bool = False,
                     deep_validate: bool = False, chunk_size: int | None = None,
                     max_open_files: int | None = None, record_placements: bool = True,
                     desc: str = "convert", format_version: int = 2) -> tuple[Manifest, StreamStats, int]:
    """Write ``source``'s tensors (and ``values``, ``aliases``) as a checkpoint laid out on
    ``mesh``: the engine behind convert and import-hf. Returns (manifest, stream stats, files).

    1) plan every new rank's file (``plan_convert``) and its pieces; 2) group the files by
    ``max_open_files`` (one at a time on an object store) and plan each group's windows;
    3) check the source headers; 4) stream group after group into a ``CheckpointWriter``;
    5) add aliases, views and values, and commit (the staged result is checked first).
    """
    t0 = time.perf_counter()
    before = source.storage.stats.snapshot()
    m = source.manifest
    aliases = dict(aliases or {})
    dtypes = {name: out_dtype(rec.dtype, cast) for name, rec in list(m.tensors.items()) + list(m.storages.items())
              if rec.alias_of is None and rec.view is None}
    dst_storage, dst_path = get_storage(dst, storage_options)
    if max_open_files is None:
        max_open_files = 1 if dst_storage.remote else DEFAULT_MAX_OPEN_FILES
    placed: Mapping[str, Placed] = {}
    if format_version >= 2 and record_placements:
        plan = plan_placed_files(m, mesh, layouts, dtypes)
        placed = plan.placed
        batches = (plan.files(range(i, min(i + max_open_files, mesh.world_size)))
                   for i in range(0, mesh.world_size, max_open_files))
        shard_bytes = plan.shard_bytes()
    else:
        files = plan_convert(m, mesh, layouts, dtypes, record_placements=record_placements)
        batches = (files[i:i + max_open_files] for i in range(0, len(files), max_open_files))
        shard_bytes = (s.nbytes for f in files for s in f.shards)
    data_budget = fit_uploads(dst_storage, memory_budget) if max_open_files == 1 else memory_budget
    mem = memory_plan(data_budget, chunk_size=m.chunk_size, verify=source.verify,
                      workers=min(4, source.storage.read_concurrency))
    verify_source(source, dtypes)

    check = _staged_check(m, cast, deep=deep_validate, extra_aliases=set(aliases), expect_values=set(values))
    if chunk_size is None:  # v2: fitted to the new shards (the source's may be far larger or smaller)
        chunk_size = auto_chunk_size(shard_bytes, format_version=format_version) \
            if format_version >= 2 else m.chunk_size
    writer = CheckpointWriter(dst_path, storage=dst_storage, overwrite=overwrite,
                              chunk_size=chunk_size, check_staged=check, format_version=format_version,
                              topology=topology)  # placed boxes are checked as each file closes
    for fqn, p in placed.items():
        rec = m.tensor(fqn)
        writer.place(fqn, dtype_code(dtypes[fqn], what=fqn), tuple(rec.shape), p, storage=fqn in m.storages)
    shapes = {name: m.tensor(name).shape for name in dtypes}
    bar = Progress(sum(math.prod(shapes[n]) * dt.itemsize for n, dt in dtypes.items()), desc, progress)
    try:
        written, windows, nfiles = _stream_batches(source, writer, batches, shapes, mem, bar)
        _add_records(writer, m, cast, aliases, values)
        manifest = writer.commit(step=step, metadata=metadata, topology=topology)
    except BaseException:
        writer.abort()
        raise
    finally:
        bar.close()
    after = source.storage.stats.snapshot()  # header checks included
    return manifest, StreamStats(windows=windows, bytes_written=written,
                                 bytes_read=after["bytes_read"] - before["bytes_read"],
                                 read_requests=after["read_requests"] - before["read_requests"],
                                 seconds=time.perf_counter() - t0), nfiles


def _stream_batches(source: Source, writer: CheckpointWriter, batches: Iterable[Sequence[RankFile]],
                    shapes: Mapping[str, Sequence[int]], mem: MemoryPlan, bar: Progress) -> tuple[int, int, int]:
    """Open each batch's files on ``writer`` (the files open at once), plan and stream its
    windows into them, close them; return (bytes written, windows, files). On failure, the open
    files are aborted. One batch's plan is held at a time."""
    streams: dict[int, Any] = {}
    written = windows = nfiles = 0
    try:
        buffers = Buffers(mem, need=mem.window)
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="reshard-hash") as hash_pool:
            for files in batches:
                pieces, units = pieces_of(files)
                capacity = window_capacity(mem, sum(p.buffer_bytes for p in pieces))
                ws = plan_windows(pieces, [u for u in units if u], shapes, capacity=capacity)
                for f, rf in enumerate(files):
                    tensors = [s for s in rf.shards if s.fqn not in rf.storages]
                    stores = [s for s in rf.shards if s.fqn in rf.storages]
                    streams[f] = writer.stream_rank(rf.rank, tensors, storages=stores, hash_pool=hash_pool)
                    if streams[f].specs != rf.shards:
                        raise CommitError(f"internal: rank {rf.rank}'s file order differs from the plan")
                stats = run_windows(source, pieces, ws, streams, buffers, progress=bar)
                for f in range(len(files)):
                    streams.pop(f).close()
                written += stats.bytes_written
                windows += stats.windows
                nfiles += len(files)
    except BaseException:
        for s in streams.values():
            s.abort()
        raise
    return written, windows, nfiles


def _add_records(writer: CheckpointWriter, m: Manifest, cast: torch.dtype | None, aliases: Mapping[str, str],
                 values: Mapping[str, ValueRecord]) -> None:
    """Add the new aliases, the source's aliases and views (views in the cast dtype), and the values."""
    for name, target in sorted(aliases.items()):
        writer.add_alias(name, target)
    for name, rec in sorted(m.tensors.items()):
        if rec.alias_of is not None:
            writer.add_alias(name, rec.alias_of)
        elif rec.view is not None:
            writer.add_view(name, dtype_code(out_dtype(rec.dtype, cast), what=name), tuple(rec.shape), rec.view)
    for name, rec in sorted(values.items()):
        writer.add_encoded_value(name, rec)



def convert(
    src: str,
    dst: str,
    mesh: str | Mapping[str, int] | Mesh,
    *,
    rules: str | Rules | None = None,
    memory_budget: int | str = DEFAULT_BUDGET,
    dtype: str | torch.dtype | None = None,
    verify: bool = True,
    overwrite: bool = False,
    per_rank: str = "drop",
    deep_validate: bool = False,
    storage_options: dict | None = None,
    progress: bool = False,
    max_open_files: int | None = None,
    format_version: int = 2,
) -> ConvertReport:
    """Rewrite the checkpoint at ``src`` for ``mesh`` (outermost dim first, e.g.
    ``"pp=1,dp=2,tp=4"``) as a new checkpoint at ``dst``; return what was done.

    Each new rank's slices go into its own file, replicated slices are written once. Tensors
    keep their recorded placements (retargeted to the new mesh) unless ``rules`` (a rules file
    path or ``Rules``) says otherwise. At most ``memory_budget`` bytes of tensor data are held
    at once (plus small fixed read buffers); a slice larger than that is streamed in pieces.
    ``dtype`` (``"bf16"``...) casts floating tensors. Aliases, views and values are carried
    over; per-rank values only when the world size is unchanged (``per_rank="drop"`` drops
    them otherwise and reports them, ``"error"`` refuses). The result is validated (``deep``:
    every chunk re-hashed) before it is committed; ``verify`` checks every source chunk read.
    ``format_version`` 2 (default) records every tensor by its placement on ``mesh``; 1 writes
    a version-1 checkpoint for readers released before version 2.
    """
    if per_rank not in ("drop", "error"):
        raise ValueError(f"per_rank must be 'drop' or 'error', got {per_rank!r}")
    mesh = parse_mesh(mesh)
    budget = parse_size(memory_budget, what="memory budget")
    cast = parse_dtype(dtype)
    if isinstance(rules, (str, os.PathLike)):
        rules = load_rules(os.fspath(rules))
    refuse_overlap(*get_storage(src, storage_options), dst, storage_options)
    ckpt = open_checkpoint(src, storage_options=storage_options)
    m = ckpt.manifest
    layouts, unused = plan_layouts(stored_records(m), mesh, rules)
    values, dropped = _carried_values(m, mesh, per_rank)
    source = Source(storage=ckpt.storage, path=ckpt.path, manifest=m, verify=verify)
    manifest, stats, nfiles = write_checkpoint(
        source, dst, mesh=mesh, topology=Topology(world_size=mesh.world_size, mesh=mesh.dims), layouts=layouts,
        cast=cast, memory_budget=budget, metadata=jsonvalue.decode(m.metadata, where="metadata"), step=m.step,
        values=values, storage_options=storage_options, overwrite=overwrite, progress=progress,
        deep_validate=deep_validate, max_open_files=max_open_files, desc="convert", format_version=format_version)
    return ConvertReport(path=dst, manifest=manifest, src_world=m.topology.world_size, world=mesh.world_size,
                         files=nfiles, source_bytes=sum(f.size for f in m.files.values()),
                         bytes_read=stats.bytes_read, bytes_written=stats.bytes_written, windows=stats.windows,
                         seconds=stats.seconds, memory_budget=budget, dropped_values=tuple(sorted(dropped)),
                         unused_rules=unused)


def _carried_values(m: Manifest, mesh: Mesh, per_rank: str) -> tuple[dict[str, ValueRecord], list[str]]:
    """The values the new checkpoint keeps, and the per-rank ones it drops (the world size changed)."""
    values: dict[str, ValueRecord] = {}
    dropped = []
    for name, rec in m.values.items():
        if rec.per_rank is not None and mesh.world_size != m.topology.world_size:
            if per_rank == "error":
                raise StateDictError(f"value {name!r} is per rank (saved by {m.topology.world_size} ranks); the new "
                                     f"mesh has {mesh.world_size} ranks (per_rank='drop', on the command line --per-rank drop, "
                                     "leaves it out)")
            dropped.append(name)
            continue
        values[name] = rec
    return values, dropped


__all__ = ["ConvertReport", "PlacedFiles", "RankFile", "convert", "plan_convert", "plan_placed_files", "stored_records",
           "write_checkpoint"]
