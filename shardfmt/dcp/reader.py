"""``Reader``: DCP's ``StorageReader`` over any committed shardfmt checkpoint (v1 or v2,
written by ``shardfmt.save``, the Checkpointer, ``reshard`` or the DCP ``Writer``).

``read_metadata`` builds DCP's ``Metadata`` from the JSON manifest (the root alone in format
2): every tensor (aliases and views too) as one chunk spanning it, every value split into
DCP's leaves (``dcp.names``). DCP's load planner then asks for global boxes of tensors, and
``read_data`` answers them all through ``shardfmt.load``: reads coalesced per file, every
chunk verified against its hash, bytes straight into the planner's tensors. A value leaf
reaches DCP as bytes this reader makes (``torch.save`` of the value decoded from typed JSON):
nothing read from the checkpoint is ever unpickled. Bytes that look pickled inside a value are
refused naming the key, unless ``allow_pickled_bytes=True``.
"""

from __future__ import annotations

import dataclasses
import io
import os
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from shardfmt.api import load
from shardfmt.dcp.names import Leaf, Path, dcp_leaves, leaf_at, name_of
from shardfmt.dcp.writer import PATHS_EXTENSION
from shardfmt.errors import EncodingError, StateDictError
from shardfmt.format import jsonvalue
from shardfmt.format.dtypes import torch_dtype
from shardfmt.format.manifest import Manifest
from shardfmt.io.registry import get_storage
from shardfmt.io.store import Storage
from shardfmt.layout.state import ShardedTensor
from shardfmt.loading.options import LoadOptions
from shardfmt.loading.reader import open_checkpoint
from shardfmt.loading.resolve import with_rank_values


@dataclasses.dataclass(frozen=True, slots=True)
class _Opened:
    """The checkpoint ``read_metadata`` opened: where, its root manifest (with this rank's
    per-rank values), each stored value decoded once, and each DCP value leaf's (stored value's
    name, keys within it)."""

    storage: Storage
    path: str
    manifest: Manifest
    rank: int
    decoded: Mapping[str, Any]
    leaves: Mapping[str, tuple[str, Path]]


class Reader(StorageReader):
    """Read a shardfmt checkpoint with ``dcp.load(state, storage_reader=Reader(path))``.

    ``verify`` (default on) checks every chunk read against its hash; ``cast`` (default on, as
    DCP's own reader copies into whatever dtype the target has) converts dtypes; ``options`` (a
    ``LoadOptions``) shapes the reads. ``allow_pickled_bytes``: hand DCP values that hold
    pickled bytes (a torchtitan dataloader's) instead of refusing them: whoever unpickles them
    runs code from the checkpoint.
    """

    def __init__(self, path: str | os.PathLike | None = None, *, storage_options: dict | None = None,
                 verify: bool | None = None, cast: bool = True, allow_pickled_bytes: bool = False,
                 options: LoadOptions | None = None) -> None:
        super().__init__()
        self.path = None if path is None else os.fspath(path)
        self.storage_options = storage_options
        self.options = dataclasses.replace(LoadOptions.merged(options, verify=verify, cast=cast), share_reads=False,
                                           strict=True, per_rank="skip")
        self.allow_pickled_bytes = allow_pickled_bytes
        self._opened: _Opened | None = None

    # -- DCP's calls, in order
    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.path = os.fspath(checkpoint_id)
        self._opened = None

    def read_metadata(self) -> Metadata:
        """DCP's ``Metadata`` from the manifest: tensors whole, values as DCP's leaves, each
        name's path as the job's state held it (``dcp_paths``, when a DCP save wrote it)."""
        if self.path is None:
            raise StateDictError("the DCP reader has no path: give Reader(path) or dcp.load(checkpoint_id=...)")
        storage, where = get_storage(self.path, self.storage_options)
        ckpt = open_checkpoint(where, storage=storage, whole=False)
        opened = _open(storage, ckpt.path, ckpt.manifest, _default_rank())
        self._opened = opened
        m = opened.manifest
        known = _saved_paths(m)
        entries: dict[str, Any] = {}
        paths: dict[str, Path] = {}
        for fqn, rec in sorted(m.tensors.items()):
            shape = torch.Size(rec.shape)
            entries[fqn] = TensorStorageMetadata(
                properties=TensorProperties(dtype=torch_dtype(rec.dtype, what=fqn)), size=shape,
                chunks=[ChunkStorageMetadata(offsets=torch.Size([0] * len(shape)), sizes=shape)])
            paths[fqn] = known.get(fqn) or tuple(fqn.split("."))
        for leaf, (name, _) in opened.leaves.items():
            entries[leaf] = BytesStorageMetadata()
            paths[leaf] = (known.get(name) or tuple(name.split("."))) + _dcp_path(opened, leaf)
        return Metadata(state_dict_metadata=entries, planner_data=paths)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """DCP's rank (its process group's) replaces the global one ``read_metadata`` assumed; the
        per-rank values DCP already planned from must be the same leaves for it."""
        opened = self._opened
        rank = kwargs.get("rank")
        if opened is None or rank is None or rank == opened.rank:
            return
        again = _open(opened.storage, opened.path, opened.manifest, int(rank))
        if again.leaves.keys() != opened.leaves.keys():
            raise StateDictError(f"{opened.path}: per-rank values differ between rank {opened.rank} (the global rank "
                                 f"the metadata was built for) and rank {rank} (DCP's rank in its process group); "
                                 "load per-rank values with shardfmt.load, which takes rank=")
        self._opened = again

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Every rank: its value leaves, then all its tensor boxes through ``shardfmt.load``."""
        opened = self._opened
        if opened is None:
            raise StateDictError(f"{self.path}: read_data() before read_metadata(): DCP's load calls both")
        for item in plan.items:
            if item.type == LoadItemType.BYTE_IO:
                planner.load_bytes(item, self._value_bytes(opened, item.storage_index.fqn))
        tensors = [it for it in plan.items if it.type != LoadItemType.BYTE_IO]
        for batch in _rounds(tensors):
            targets = [(it, planner.resolve_tensor(it).detach()) for it in batch]
            state = {it.storage_index.fqn: _target(opened.manifest, it, dst) for it, dst in targets}
            load(state, opened.path, storage=opened.storage, rank=opened.rank, options=self.options)
            for it, dst in targets:
                planner.commit_tensor(it, dst)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))

    # -- the parts
    def _value_bytes(self, opened: _Opened, leaf: str) -> io.BytesIO:
        """``torch.save`` bytes of the value leaf ``leaf``, made here from its typed JSON."""
        if leaf not in opened.leaves:
            raise StateDictError(f"{opened.path}: no value {leaf!r} for rank {opened.rank}")
        name, within = opened.leaves[leaf]
        value = opened.decoded[name]
        if value is _ABSENT:
            raise StateDictError(f"{opened.path}: {name} was saved per rank by a job of "
                                 f"{opened.manifest.topology.world_size} ranks; rank {opened.rank} has none")
        value = leaf_at(value, within)
        if jsonvalue.holds_pickle(value):
            if not self.allow_pickled_bytes:
                raise EncodingError(f"{leaf}: holds pickled bytes; loading them would run code from the checkpoint "
                                    "(Reader(allow_pickled_bytes=True) hands them over, at your risk)")
            warnings.warn(f"shardfmt: {leaf} holds pickled bytes, handed over as bytes (allow_pickled_bytes=True): "
                          "unpickling them runs code from the checkpoint", stacklevel=3)
        out = io.BytesIO()
        torch.save(value, out)
        out.seek(0)
        return out


_ABSENT = object()  # a per-rank value this rank has none of


def _open(storage: Storage, path: str, root: Manifest, rank: int) -> _Opened:
    """The checkpoint as ``rank`` reads it: its per-rank values, every value decoded once."""
    m = with_rank_values(storage, path, root, rank)
    decoded = {name: _stored_value(m, name, rank, path) for name in sorted(m.values)}
    leaves: dict[str, tuple[str, Path]] = {}
    for name, value in decoded.items():
        for leaf in ([Leaf(name, (), ())] if value is _ABSENT else dcp_leaves(name, value)):
            leaves[leaf.name] = (name, leaf.within)
    return _Opened(storage=storage, path=path, manifest=m, rank=rank, decoded=decoded, leaves=leaves)


def _dcp_path(opened: _Opened, leaf: str) -> Path:
    """The keys DCP's flattening records from a stored value to ``leaf``: a mapping's as ``str``."""
    name, within = opened.leaves[leaf]
    out, v = [], opened.decoded[name]
    for k in within:
        out.append(str(k) if isinstance(v, Mapping) else k)
        v = v[k]
    return tuple(out)


def _saved_paths(m: Manifest) -> dict[str, Path]:
    """``dcp_paths`` (spec section 9): each name's keys in the state a DCP save held; a hint, so
    anything malformed in it is ignored (names then split at their dots)."""
    ext = m.extensions.get(PATHS_EXTENSION)
    try:
        raw = jsonvalue.decode(ext.value, where=PATHS_EXTENSION) if ext is not None else {}
    except EncodingError:
        return {}
    if not isinstance(raw, dict):
        return {}
    return {n: tuple(p) for n, p in raw.items()
            if isinstance(n, str) and isinstance(p, list) and p and all(
                isinstance(s, str) or (isinstance(s, int) and not isinstance(s, bool)) for s in p)
            and name_of(tuple(p)) == n}


def _stored_value(m: Manifest, name: str, rank: int, source: str) -> Any:
    rec = m.values[name]
    if rec.indexed or rec.per_rank is not None:
        per_rank = rec.per_rank or {}
        if rank not in per_rank:
            return _ABSENT
        raw = per_rank[rank]
    else:
        raw = rec.value
    return jsonvalue.decode_stored(raw, where=name, source=source)


def _default_rank() -> int:
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _rounds(items: Sequence[ReadItem]) -> list[list[ReadItem]]:
    """The items in rounds that name each stored tensor once (a rank seldom reads two boxes of one)."""
    rounds: list[list[ReadItem]] = []
    seen: dict[str, int] = {}
    for it in items:
        k = seen.get(it.storage_index.fqn, 0)
        seen[it.storage_index.fqn] = k + 1
        if k == len(rounds):
            rounds.append([])
        rounds[k].append(it)
    return rounds


def _target(m: Manifest, item: ReadItem, dst: torch.Tensor) -> ShardedTensor:
    """The global box ``item`` reads, filled into ``dst``."""
    fqn = item.storage_index.fqn
    if tuple(dst.shape) != tuple(item.lengths):
        raise StateDictError(f"{fqn}: DCP's planner resolved a tensor of shape {list(dst.shape)} for a box of "
                             f"{list(item.lengths)}")
    offsets = [a + b for a, b in zip(item.storage_index.offset, item.storage_offsets)]
    return ShardedTensor(dst, m.tensors[fqn].shape, offsets)
