"""``Writer``: DCP's ``StorageWriter`` that writes a committed shardfmt checkpoint (format 2).

DCP's planners decide who writes what (its save planner deduplicates replicated items); this
writer decides how it lands, in DCP's call order::

    1) every rank     set_up_storage_writer, prepare_local_plan (the plan as DCP made it)
    2) coordinator    prepare_global_plan: picks the hash chunk, stages the checkpoint
                      (``CheckpointWriter.stage``) and tells each rank its number and where to write
    3) every rank     write_data: its tensors into one shard file (hashed as written) and its
                      rank index; each non-tensor value as typed JSON, never pickle: the object
                      is taken from the planner (``lookup_object``), or decoded with
                      ``torch.load(weights_only=True)`` from the bytes the planner just made
    4) coordinator    finish: every tensor listed with its boxes and their writers, the values
                      regrouped by shardfmt's names (``dcp.names``), the manifest, COMMITTED

Bytes that are a pickle (``jsonvalue.is_pickle``: torchtitan's dataloader state holds
``pickle.dumps`` output) are refused naming the key, unless ``allow_pickled_bytes=True`` (then
stored as bytes, with a warning). A rank whose write step fails reports it to ``finish`` instead
of raising (DCP would skip ``finish``, leaving the staged save and its lease): the coordinator
aborts and raises that rank's error, so a failed save commits nothing and leaves nothing.
"""

from __future__ import annotations

import dataclasses
import io
import os
import re
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from shardfmt import errors
from shardfmt.dcp.names import name_of, regroup
from shardfmt.errors import EncodingError, ShardfmtError, StateDictError
from shardfmt.format import jsonvalue
from shardfmt.format.dtypes import dtype_code
from shardfmt.format.index import RankEntry
from shardfmt.format.manifest import ListedShard, Manifest, Topology, ValueRecord, rank_file_name
from shardfmt.io.registry import get_storage
from shardfmt.layout.topology import Mesh, TopologyError
from shardfmt.saving.options import SaveOptions
from shardfmt.saving.plan import auto_chunk_size
from shardfmt.saving.rank_index import write_rank_index
from shardfmt.saving.shard_file import (
    ShardData,
    default_write_workers,
    file_order,
    write_shard_file,
)
from shardfmt.saving.writer import CheckpointWriter

PATHS_EXTENSION = "dcp_paths"  # spec section 9: each name's path of keys in the state DCP saved


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class _Assignment:
    """What the coordinator tells one rank (a ``SavePlan``'s ``storage_data``)."""

    rank: int
    staging: str
    save_id: str
    name_tag: str | None
    chunk_size: int


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class _Stored:
    """A tensor item's result: the rank that wrote it, its index and its data file."""

    rank: int
    entry: RankEntry
    file: str


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class _Value:
    """A value item's result: the value as typed JSON (decoded again by the coordinator)."""

    encoded: Any


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class _Failed:
    """A rank's write step failed: the coordinator aborts the save and raises this (DCP skips
    ``finish`` when ``write_data`` raises, which would leave the staged save and its lease)."""

    rank: int | None  # None: a rank that never learnt its number
    kind: str  # the class in ``shardfmt.errors`` to raise
    message: str


def _failure(rank: int | None, e: Exception) -> _Failed:
    """What a failed rank reports: its error's nearest class in ``shardfmt.errors`` (an ``OSError``
    is a ``StorageError``); the message keeps any other exception's type."""
    kind = next((c.__name__ for c in type(e).__mro__ if getattr(errors, c.__name__, None) is c
                 and issubclass(c, ShardfmtError)), None)
    if kind is None:
        kind = "StorageError" if isinstance(e, OSError) else "ShardfmtError"
    message = str(e) if isinstance(e, (ShardfmtError, OSError)) else f"{type(e).__name__}: {e}"
    return _Failed(rank=rank, kind=kind, message=message or type(e).__name__)


class Writer(StorageWriter):
    """Write ``dcp.save(state, storage_writer=Writer(path))`` as a shardfmt checkpoint at
    ``path`` (a directory or fsspec URL; ``checkpoint_id=`` replaces it).

    ``step`` and ``metadata`` go into the manifest as ``shardfmt.save``'s do; ``mesh`` names the
    job's layout (its sizes multiply to the world size). The other knobs are ``SaveOptions``'
    (``overwrite``: replace a committed checkpoint there, atomically; ``storage_options``:
    fsspec's, e.g. S3 credentials). ``allow_pickled_bytes``: store values holding pickled bytes
    instead of refusing them (whoever later unpickles them runs code from the checkpoint).
    DCP's plan caching (``DefaultSavePlanner(enable_plan_caching=True)``) and saves without
    collectives on more than one rank are refused: each save stages anew and commits once.
    """

    def __init__(self, path: str | os.PathLike | None = None, *, step: int | None = None, metadata: Any = None,
                 mesh: Mapping[str, int] | None = None, allow_pickled_bytes: bool = False,
                 overwrite: bool | None = None, storage_options: dict | None = None, chunk_size: int | None = None,
                 sync: bool | None = None, write_workers: int | None = None, part_size: int | None = None,
                 options: SaveOptions | None = None) -> None:
        super().__init__()
        self.options = SaveOptions.merged(options, overwrite=overwrite, storage_options=storage_options,
                                          chunk_size=chunk_size, sync=sync, write_workers=write_workers,
                                          part_size=part_size)
        if self.options.format_version != 2 or self.options.base is not None or self.options.node_part is not None:
            raise StateDictError("the DCP writer writes full format-2 checkpoints: leave format_version, base "
                                 "and node_part to shardfmt.save and the Checkpointer")
        self.path = None if path is None else os.fspath(path)
        self.step = step
        self.metadata = metadata
        self.mesh = None if mesh is None else _mesh(mesh)  # a Mesh
        self.allow_pickled_bytes = allow_pickled_bytes
        self.manifest: Manifest | None = None  # the coordinator's, once a save committed
        self._writer: CheckpointWriter | None = None

    # -- DCP's calls, in order
    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.path = os.fspath(checkpoint_id)
        self._abandon()
        self.manifest = None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        d = torch.distributed
        if kwargs.get("use_collectives") is False and d.is_available() and d.is_initialized() \
                and d.get_world_size() > 1:
            raise StateDictError(f"{self.path}: the DCP writer commits once for all ranks, after each wrote: "
                                 "dcp.save(..., use_collectives=False) on more than one rank cannot do that")

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """The coordinator: pick the hash chunk from every stored box, stage, assign the ranks."""
        self._abandon()
        if not all(p.usable for p in plans):
            raise StateDictError(f"{self.path}: DCP's cached save plans (enable_plan_caching=True) would send the "
                                 "ranks the previous save's place: save without plan caching")
        if self.mesh is not None and self.mesh.world_size != len(plans):
            raise StateDictError(f"mesh {dict(self.mesh.dims)} does not multiply to the world size {len(plans)}")
        storage, where = get_storage(self._where(), self.options.storage_options)
        chunk = self.options.chunk_size or auto_chunk_size(
            (_nbytes(it) for p in plans for it in p.items if it.type != WriteItemType.BYTE_IO), format_version=2)
        writer = CheckpointWriter(where, storage=storage, options=dataclasses.replace(self.options, chunk_size=chunk))
        writer.stage()
        self._writer = writer
        return [dataclasses.replace(p, storage_data=_Assignment(rank=i, staging=writer.staging, save_id=writer.save_id,
                                                                 name_tag=writer.name_tag, chunk_size=chunk))
                for i, p in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Every rank: its tensors into one shard file and its index; its values as typed JSON.
        A failure is reported to the coordinator's ``finish`` (which aborts), not raised here."""
        job = plan.storage_data
        try:
            if getattr(planner, "_enable_plan_caching", False) or not isinstance(job, _Assignment):
                raise StateDictError(f"{self.path}: DCP's cached save plans (enable_plan_caching=True) would send "
                                     "this rank to another save's place: save without plan caching")
            results = self._write(job, plan, planner)
        except Exception as e:  # noqa: BLE001 - every failure must reach finish, which aborts the staged save
            rank = job.rank if isinstance(job, _Assignment) else None
            results = [WriteResult(index=MetadataIndex(fqn=""), size_in_bytes=0, storage_data=_failure(rank, e))]
        done: Future[list[WriteResult]] = Future()
        done.set_result(results)
        return done

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """The coordinator: record what every rank wrote, regroup the values, commit; or, when a
        rank failed, abort and raise its error."""
        writer, self._writer = self._writer, None
        if writer is None:
            raise StateDictError(f"{self.path}: finish() without prepare_global_plan(): DCP's save calls both")
        try:
            _raise_failures(results)
            _record(writer, metadata, results, allow_pickled_bytes=self.allow_pickled_bytes)
            world = len(results)
            self.manifest = writer.commit(step=self.step, metadata=self.metadata,
                                          topology=Topology(world_size=world, mesh=self.mesh.dims if self.mesh
                                                            else (("world", world),)))
        except BaseException:
            writer.abort()
            raise

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))

    # -- the parts
    def _where(self) -> str:
        if self.path is None:
            raise StateDictError("the DCP writer has no path: give Writer(path) or dcp.save(checkpoint_id=...)")
        return self.path

    def _abandon(self) -> None:
        """Discard a save this writer staged and never finished."""
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.abort()

    def _write(self, job: _Assignment, plan: SavePlan, planner: SavePlanner) -> list[WriteResult]:
        values = [it for it in plan.items if it.type == WriteItemType.BYTE_IO]
        tensors = [it for it in plan.items if it.type != WriteItemType.BYTE_IO]
        results = [WriteResult(index=it.index, size_in_bytes=0, storage_data=_Value(encoded=self._encode(it, planner)))
                   for it in values]
        if not tensors:
            return results
        storage, _ = get_storage(self._where(), self.options.storage_options)
        name = rank_file_name(job.rank, None, job.name_tag)
        written = write_shard_file(storage, job.staging, name, job.rank, file_order([_shard(it, planner) for it in tensors]),
                                   chunk_size=job.chunk_size, sync=self.options.sync,
                                   workers=self.options.write_workers or default_write_workers(),
                                   part_size=self.options.part_size, aligned=True)
        entry = write_rank_index(storage, job.staging, rank=job.rank, save_id=job.save_id, name_tag=job.name_tag,
                                 files={name: written.record}, values={})
        stored = _Stored(rank=job.rank, entry=entry, file=name)
        return results + [WriteResult(index=it.index, size_in_bytes=_nbytes(it), storage_data=stored) for it in tensors]

    def _encode(self, item: WriteItem, planner: SavePlanner) -> Any:
        fqn = item.index.fqn
        value = _value_of(item, planner)
        pickled = jsonvalue.holds_pickle(value)
        if pickled and not self.allow_pickled_bytes:
            raise EncodingError(f"{fqn}: holds pickled bytes; shardfmt never stores a pickle, which would run code "
                                "when loaded: save the state as tensors and plain values, or give "
                                "Writer(allow_pickled_bytes=True) to store them as bytes, at your risk")
        encoded = jsonvalue.encode(value, where=fqn, pickled=self.allow_pickled_bytes)
        if pickled:
            warnings.warn(f"shardfmt: {fqn} holds pickled bytes, stored as bytes (allow_pickled_bytes=True): whoever "
                          "unpickles them after a load runs code from the checkpoint", stacklevel=2)
        return encoded


def _raise_failures(results: list[list[WriteResult]]) -> None:
    """Raise the first failed rank's error, as its own shardfmt type, naming the rank."""
    failed = [r.storage_data for rs in results for r in rs if isinstance(r.storage_data, _Failed)]
    if failed:
        f = min(failed, key=lambda x: (x.rank is None, x.rank or 0))
        cls = getattr(errors, f.kind, errors.ShardfmtError)
        more = f" (and {len(failed) - 1} more rank(s))" if len(failed) > 1 else ""
        who = "a rank" if f.rank is None else f"rank {f.rank}"
        raise cls(f"{who}: {f.message}{more}; nothing was committed")


def _record(writer: CheckpointWriter, metadata: Metadata, results: list[list[WriteResult]], *,
            allow_pickled_bytes: bool) -> None:
    """Every tensor with its boxes and writer ranks, each rank's index, the values regrouped by
    shardfmt's names, and every name's path (``dcp_paths``)."""
    listed: dict[str, list[ListedShard]] = {}
    values: dict[str, Any] = {}
    stored: dict[int, _Stored] = {}  # each rank's index and file: the same in every result of the rank
    for rank_results in results:
        for r in rank_results:
            fqn, data = r.index.fqn, r.storage_data
            if isinstance(data, _Value):
                values[fqn] = jsonvalue.decode(data.encoded, where=fqn)
                continue
            stored[data.rank] = data
            chunk = _chunk_at(metadata.state_dict_metadata[fqn], r.index)
            listed.setdefault(fqn, []).append(ListedShard(offsets=tuple(chunk.offsets), lengths=tuple(chunk.sizes),
                                                          rank=data.rank))
    for rank, data in sorted(stored.items()):
        writer.add_rank_entry(rank, data.entry, files=(data.file,))
    tensors = {f: md for f, md in metadata.state_dict_metadata.items() if isinstance(md, TensorStorageMetadata)}
    for fqn, md in sorted(tensors.items()):
        writer.add_listed(fqn, dtype_code(md.properties.dtype, what=fqn), tuple(md.size), None, listed.get(fqn, []))
    paths = metadata.planner_data if isinstance(metadata.planner_data, Mapping) else {}
    path_of = {f: tuple(paths.get(f, (f,))) for f in (*tensors, *values)}
    grouped = regroup([path_of[f] for f in tensors], {path_of[f]: v for f, v in values.items()})
    for fqn, value in grouped.items():
        writer.add_encoded_value(fqn, ValueRecord(value=jsonvalue.encode(value, where=fqn, pickled=allow_pickled_bytes)))
    prefixes = {name_of(p[:i]): p[:i] for p in path_of.values() for i in range(1, len(p) + 1)}
    named = {**{f: path_of[f] for f in tensors}, **{name: prefixes.get(name, (name,)) for name in grouped}}
    writer.add_hint(PATHS_EXTENSION, jsonvalue.encode({n: list(p) for n, p in sorted(named.items())},
                                                      where=PATHS_EXTENSION))


def _mesh(mesh: Mapping[str, int]) -> Mesh:
    try:
        return Mesh.parse(mesh)
    except TopologyError as e:
        raise StateDictError(f"mesh=: {e}") from None


def _nbytes(item: WriteItem) -> int:
    td = item.tensor_data
    n = 1
    for s in td.chunk.sizes:
        n *= s
    return n * td.properties.dtype.itemsize


def _chunk_at(md: TensorStorageMetadata, index: MetadataIndex):
    """The stored chunk of ``md`` at ``index.offset`` (``index.index`` is DCP's hint of where)."""
    hint = index.index
    if hint is not None and 0 <= hint < len(md.chunks) and tuple(md.chunks[hint].offsets) == tuple(index.offset):
        return md.chunks[hint]
    for c in md.chunks:
        if tuple(c.offsets) == tuple(index.offset):
            return c
    raise StateDictError(f"{index.fqn}: DCP's metadata has no chunk at {list(index.offset)}")


def _shard(item: WriteItem, planner: SavePlanner) -> ShardData:
    """The tensor an item writes, on the CPU, as the box of the global tensor it is."""
    fqn, td = item.index.fqn, item.tensor_data
    data = planner.resolve_data(item)
    if not isinstance(data, torch.Tensor):
        raise StateDictError(f"{fqn}: DCP's planner resolved a tensor item to a {type(data).__name__}")
    data = data.detach()
    if data.device.type != "cpu":
        data = data.cpu()
    if tuple(data.shape) != tuple(td.chunk.sizes):
        raise StateDictError(f"{fqn}: DCP's planner resolved a tensor of shape {list(data.shape)} for a chunk of "
                             f"{list(td.chunk.sizes)}")
    return ShardData(fqn=fqn, data=data, global_shape=tuple(td.size), offsets=tuple(td.chunk.offsets))


def _value_of(item: WriteItem, planner: SavePlanner) -> Any:
    """The object a value item stands for: from the planner, or decoded from the bytes it
    serialized in this process just now, by torch's restricted loader (never full pickle)."""
    lookup = getattr(planner, "lookup_object", None)
    if callable(lookup):
        return lookup(item.index)
    data = planner.resolve_data(item)
    if isinstance(data, io.BytesIO):
        data.seek(0)
        try:
            return torch.load(data, weights_only=True)
        except Exception as e:  # noqa: BLE001 - torch's restricted loader refuses with many types
            first = re.sub(r"\x1b\[[0-9;]*m", "", str(e)).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise EncodingError(f"{item.index.fqn}: the planner serialized this value with torch.save and torch's "
                                f"restricted loader refuses it ({first}); use a planner with lookup_object "
                                "(DCP's DefaultSavePlanner) or plain values") from None
    return data

