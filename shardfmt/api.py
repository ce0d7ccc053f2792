"""``save`` and ``load``: state dicts to checkpoints and back, in one process.

save: flatten -> group tensors that share storage (tied weights become ``alias_of``,
distinct views of one buffer become views of one stored 1-D ``storages`` entry named
``.storage.N`` — the leading dot keeps it apart from every user FQN) -> one data file
-> manifest -> commit. load: flatten the caller's dict -> one target per tensor leaf
(a plain tensor wants the whole tensor, a ShardedTensor its slice) -> plan -> execute
(verified reads straight into the caller's tensors) -> only then replace non-tensor
leaves, so a failed load never leaves half-applied non-tensor state.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from reshard.executor import DEFAULT_WORKERS, Executor
from reshard.geometry import Box
from reshard.planner import DEFAULT_MAX_GAP, DEFAULT_MAX_READ, TargetSlice, plan_load

from . import hashing, jsonvalue
from .dtypes import dtype_code, torch_dtype
from .errors import DTypeError, MissingKeyError, ShapeError, StateDictError
from .manifest import Manifest, ViewRecord
from .reader import check_headers, open_checkpoint
from .state import Leaf, PerRank, ShardedTensor, _is_dtensor, flatten, set_leaf
from .writer import CheckpointWriter, ShardData


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadReport:
    """What a load did: what was missing, what was left unread, and what it cost."""

    loaded: tuple[str, ...]
    missing: tuple[str, ...]
    unexpected: tuple[str, ...]
    bytes_read: int
    read_requests: int
    bytes_needed: int
    stats: Mapping[str, int] = field(default_factory=dict)


# ----------------------------------------------------------------------------- save


def _check_saveable(fqn: str, t: torch.Tensor) -> None:
    if t.device.type == "meta":
        raise StateDictError(f"{fqn}: a meta tensor has no data to save")
    if t.is_sparse or t.layout != torch.strided:
        raise StateDictError(f"{fqn}: only dense (strided) tensors can be saved, got layout {t.layout}")
    dtype_code(t.dtype, what=fqn)


def _storage_key(t: torch.Tensor) -> tuple | None:
    if t.numel() == 0:
        return None
    ptr = t.untyped_storage().data_ptr()
    return None if ptr == 0 else (t.device.type, t.device.index, ptr)


def _extent(t: torch.Tensor) -> int:
    """Elements from the storage offset to one past the last element the view reaches."""
    return 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))


def _plan_sharing(plain: dict[str, torch.Tensor]):
    """Split plain tensors into stored ones, aliases and views of shared storages."""
    groups: dict[tuple, list[str]] = {}
    for fqn, t in plain.items():
        key = _storage_key(t)
        if key is not None:
            groups.setdefault(key, []).append(fqn)
    stored = dict(plain)
    aliases: dict[str, str] = {}
    views: dict[str, tuple[str, ViewRecord]] = {}
    storages: dict[str, torch.Tensor] = {}
    for names in sorted((sorted(v) for v in groups.values() if len(v) > 1), key=lambda v: v[0]):
        ts = [plain[n] for n in names]
        sig = {(t.dtype, t.storage_offset(), tuple(t.shape), t.stride()) for t in ts}
        if len(sig) == 1:
            for n in names[1:]:
                aliases[n] = names[0]
                del stored[n]
            continue
        if len({t.dtype for t in ts}) != 1:
            continue  # reinterpreted bytes of different dtypes: store each on its own
        lo = min(t.storage_offset() for t in ts)
        hi = max(t.storage_offset() + _extent(t) for t in ts)
        base_name = f".storage.{len(storages)}"  # a leading dot: never a user FQN
        storages[base_name] = torch.as_strided(ts[0], (hi - lo,), (1,), lo)
        for n, t in zip(names, ts):
            views[n] = (base_name, ViewRecord(base=base_name, storage_offset=t.storage_offset() - lo,
                                              stride=tuple(t.stride())))
            del stored[n]
    return stored, aliases, views, storages


def save(
    state_dict: dict,
    path: str,
    *,
    step: int | None = None,
    metadata: Any = None,
    overwrite: bool = False,
    storage_options: dict | None = None,
    chunk_size: int = hashing.DEFAULT_CHUNK_SIZE,
    sync: bool = True,
    _save_id: str | None = None,
    _clock=None,
    _writer_versions: Mapping[str, str] | None = None,
    _on_step=None,
) -> Manifest:
    """Save ``state_dict`` as a committed checkpoint at ``path`` (a directory or fsspec URL).

    ``path`` is used exactly as given. An existing committed checkpoint there is replaced
    only with ``overwrite=True``, atomically. Returns the manifest that was committed.
    """
    if torch.distributed.is_available() and torch.distributed.is_initialized() \
            and torch.distributed.get_world_size() > 1:
        from .distributed import save_distributed  # noqa: F401  (arrives with distributed save)

    leaves = flatten(state_dict)
    plain: dict[str, torch.Tensor] = {}
    sharded: list[ShardData] = []
    values: list[tuple[str, Any]] = []
    for leaf in leaves:
        v = leaf.value
        if isinstance(v, ShardedTensor):
            _check_saveable(leaf.fqn, v.local)
            sharded.append(ShardData(fqn=leaf.fqn, data=v.local.detach(), global_shape=v.global_shape,
                                     offsets=v.offsets))
        elif _is_dtensor(v):
            local = v.to_local()
            if tuple(local.shape) != tuple(v.shape):
                raise StateDictError(f"{leaf.fqn}: a sharded DTensor needs a distributed save")
            _check_saveable(leaf.fqn, local)
            plain[leaf.fqn] = local.detach()
        elif isinstance(v, torch.Tensor):
            _check_saveable(leaf.fqn, v)
            plain[leaf.fqn] = v.detach()
        else:
            values.append((leaf.fqn, v))
    stored, aliases, views, storages = _plan_sharing(plain)
    shards = sharded + [ShardData(fqn=f, data=t, global_shape=tuple(t.shape), offsets=(0,) * t.dim())
                        for f, t in stored.items()]
    base_shards = [ShardData(fqn=n, data=t, global_shape=tuple(t.shape), offsets=(0,)) for n, t in storages.items()]
    with CheckpointWriter(path, storage_options=storage_options, overwrite=overwrite, save_id=_save_id,
                          clock=_clock, writer_versions=_writer_versions, chunk_size=chunk_size,
                          sync=sync, on_step=_on_step) as w:
        w.write_rank(0, shards, storages=base_shards)
        for fqn, target in aliases.items():
            w.add_alias(fqn, target)
        for fqn, (_, view) in views.items():
            t = plain[fqn]
            w.add_view(fqn, dtype_code(t.dtype, what=fqn), tuple(t.shape), view)
        for fqn, v in values:
            if isinstance(v, PerRank):
                w.add_value(fqn, per_rank={0: v.value})
            else:
                w.add_value(fqn, v)
        return w.commit(step=step, metadata=metadata)


# ----------------------------------------------------------------------------- load


@dataclass(slots=True)
class _Post:
    """A copy that runs after the reads: a view target filled from its storage's span."""

    leaf: str
    dst: torch.Tensor
    buf_index: int
    lo: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]


def _target_of(leaf: Leaf) -> tuple[torch.Tensor, Box, tuple[int, ...]]:
    v = leaf.value
    if isinstance(v, ShardedTensor):
        return v.local, Box(v.offsets, tuple(v.local.shape)), v.global_shape
    if _is_dtensor(v):
        local = v.to_local()
        if tuple(local.shape) != tuple(v.shape):
            raise StateDictError(f"{leaf.fqn}: a sharded DTensor target needs a distributed load")
        return local, Box.full(local.shape), tuple(v.shape)
    return v, Box.full(v.shape), tuple(v.shape)


def load(
    state_dict: dict,
    path: str,
    *,
    strict: bool = True,
    verify: bool = True,
    cast: bool = False,
    rank: int = 0,
    storage_options: dict | None = None,
    max_gap: int = DEFAULT_MAX_GAP,
    max_read: int = DEFAULT_MAX_READ,
    workers: int = DEFAULT_WORKERS,
) -> LoadReport:
    """Fill ``state_dict`` in place from the checkpoint at ``path``.

    Tensors (plain, or ShardedTensor slices) are filled in place, keeping their device;
    non-tensor leaves are replaced with the stored values. ``strict`` raises if a key the
    caller holds is not in the checkpoint; otherwise it is reported in ``missing``.
    """
    ckpt = open_checkpoint(path, storage_options=storage_options)
    m = ckpt.manifest
    leaves = flatten(state_dict)
    targets: list[TargetSlice] = []
    dsts: list[torch.Tensor] = []
    src_dtypes: list[torch.dtype] = []
    posts: list[_Post] = []
    pending_values: list[tuple[Leaf, Any]] = []
    missing: list[str] = []
    loaded: list[str] = []
    for leaf in leaves:
        v = leaf.value
        if isinstance(v, (torch.Tensor, ShardedTensor)) or _is_dtensor(v):
            if leaf.fqn not in m.tensors:
                missing.append(leaf.fqn)
                continue
            dst, box, gshape = _target_of(leaf)
            name, rec = m.resolve(leaf.fqn)
            if tuple(gshape) != rec.shape:
                raise ShapeError(f"{leaf.fqn}: target shape {list(gshape)} != checkpoint shape {list(rec.shape)}")
            src_dtype = torch_dtype(rec.dtype, what=leaf.fqn)
            if dst.dtype != src_dtype and not cast:
                raise DTypeError(f"{leaf.fqn}: target dtype {dst.dtype} != checkpoint dtype {src_dtype} "
                                 "(pass cast=True to convert)")
            if dst.device.type == "meta":
                raise StateDictError(f"{leaf.fqn}: cannot load into a meta tensor; materialise it first")
            loaded.append(leaf.fqn)
            if rec.view is not None:
                _plan_view(leaf.fqn, rec, m, dst, box, targets, dsts, src_dtypes, posts)
                continue
            targets.append(TargetSlice(index=len(dsts), fqn=name, box=box))
            dsts.append(dst)
            src_dtypes.append(src_dtype)
        else:
            rec = m.values.get(leaf.fqn)
            if rec is None:
                missing.append(leaf.fqn)
                continue
            pending_values.append((leaf, _value_for_rank(leaf.fqn, rec, rank, m.topology.world_size)))
            loaded.append(leaf.fqn)
    if missing and strict:
        shown = ", ".join(missing[:10]) + (f" and {len(missing) - 10} more" if len(missing) > 10 else "")
        raise MissingKeyError(f"{ckpt.path}: not in the checkpoint: {shown} (pass strict=False to skip)")
    plan = plan_load(m, targets, verify=verify, max_gap=max_gap, max_read=max_read)
    before = ckpt.storage.stats.snapshot()
    if verify:
        check_headers(ckpt.storage, ckpt.path, m, plan.shards)
    Executor(ckpt.storage, ckpt.path, m.files, chunk_size=m.chunk_size, src_dtypes=src_dtypes,
             targets=dsts, workers=workers).run(plan)
    for p in posts:
        src = dsts[p.buf_index].as_strided(p.shape, p.stride, p.lo)
        with torch.no_grad():
            p.dst.copy_(src)
    for leaf, value in pending_values:
        set_leaf(leaf, value)
    after = ckpt.storage.stats.snapshot()
    requested = set(loaded)
    unexpected = tuple(sorted(k for k in list(m.tensors) + list(m.values) if k not in requested))
    return LoadReport(
        loaded=tuple(loaded), missing=tuple(missing), unexpected=unexpected,
        bytes_read=after["bytes_read"] - before["bytes_read"],
        read_requests=after["read_requests"] - before["read_requests"],
        bytes_needed=plan.needed_bytes, stats=after,
    )


def _plan_view(fqn, rec, m: Manifest, dst, box: Box, targets, dsts, src_dtypes, posts) -> None:
    if box != Box.full(rec.shape):
        raise StateDictError(f"{fqn}: a tensor stored as a view of a shared buffer loads only whole")
    view = rec.view
    lo = view.storage_offset
    extent = 1 + sum((n - 1) * s for n, s in zip(rec.shape, view.stride)) if dst.numel() else 0
    src_dtype = torch_dtype(rec.dtype, what=fqn)
    buf = torch.empty(extent, dtype=src_dtype)
    if extent:
        targets.append(TargetSlice(index=len(dsts), fqn=view.base, box=Box((lo,), (extent,))))
    dsts.append(buf)
    src_dtypes.append(src_dtype)
    posts.append(_Post(leaf=fqn, dst=dst, buf_index=len(dsts) - 1, lo=0, shape=rec.shape, stride=view.stride))


def _value_for_rank(fqn: str, rec, rank: int, world_size: int) -> Any:
    if rec.per_rank is None:
        return jsonvalue.decode(rec.value, where=fqn)
    if rank not in rec.per_rank:
        raise StateDictError(f"{fqn}: per-rank value was saved for ranks {sorted(rec.per_rank)} "
                             f"(world size {world_size}); rank {rank} has none")
    return jsonvalue.decode(rec.per_rank[rank], where=fqn)
