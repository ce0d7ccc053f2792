"""``save`` and ``load``: state dicts to checkpoints and back, in one process.

save: flatten -> group tensors that share storage (tied weights become ``alias_of``,
distinct views of one buffer become views of one stored 1-D ``storages`` entry named
``.storage.<first view's FQN>`` — the leading dot keeps it apart from every user FQN) -> one data file
-> manifest -> commit. load: flatten the caller's dict -> one target per tensor leaf
(a plain tensor wants the whole tensor, a ShardedTensor its slice) -> plan -> execute
(verified reads straight into the caller's tensors) -> only then replace non-tensor
leaves, so a failed load never leaves half-applied non-tensor state.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from shardfmt.errors import (
    DTypeError,
    IntegrityError,
    ManifestError,
    MissingKeyError,
    ShapeError,
    ShardfmtError,
    StateDictError,
)
from shardfmt.format import jsonvalue
from shardfmt.format.dtypes import torch_dtype
from shardfmt.format.manifest import Manifest, ViewRecord
from shardfmt.format.tensor_bytes import is_direct
from shardfmt.layout.dtensor import dtensor_layout
from shardfmt.layout.geometry import Box
from shardfmt.layout.state import (
    Leaf,
    PerRank,
    ShardedTensor,
    _is_dtensor,
    check_settable,
    flatten,
    set_leaf,
    settle_if_saved,
)
from shardfmt.layout.topology import held_boxes
from shardfmt.loading.executor import DEFAULT_WORKERS, Executor
from shardfmt.loading.planner import (
    DEFAULT_MAX_BOUNCE_READ,
    DEFAULT_MAX_READ,
    TargetSlice,
    plan_load,
)
from shardfmt.loading.reader import check_headers, open_checkpoint
from shardfmt.saving.coordinator import coordinator_for
from shardfmt.saving.describe import prepare
from shardfmt.saving.options import SaveOptions
from shardfmt.saving.protocol import run_save
from shardfmt.saving.sharing import extent


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


def save(
    state_dict: dict,
    path: str,
    *,
    step: int | None = None,
    metadata: Any = None,
    overwrite: bool | None = None,
    storage_options: dict | None = None,
    chunk_size: int | None = None,
    sync: bool | None = None,
    process_group=None,
    timeout=None,
    mesh: Mapping[str, int] | None = None,
    check_replicas: bool | None = None,
    write_workers: int | None = None,
    part_size: int | None = None,
    options: SaveOptions | None = None,
) -> Manifest:
    """Save ``state_dict`` as a committed checkpoint at ``path`` (a directory or fsspec URL).

    ``path`` is used exactly as given. An existing committed checkpoint there is replaced
    only with ``overwrite=True``, atomically. Returns the manifest that was committed.

    Under an initialized process group (world size > 1, or ``process_group`` given) every
    rank calls ``save`` with its own state: DTensors, ShardedTensors, replicated plain
    tensors and values, ``PerRank`` values. Every rank writes its own file in parallel,
    replicated data is written once, and rank 0 commits after every rank succeeded
    (see ``shardfmt.saving.protocol``). ``mesh`` (e.g. ``{"pp": 2, "dp": 2, "tp": 2}``) names
    the job's layout in the manifest; ``timeout`` bounds every collective. Every rank must
    save the same ``step`` to the same place (else every rank raises StateDictError before
    anything is staged). A replicated value that differs across ranks is saved as the lowest
    rank's copy with a warning on rank 0 (wrap per-rank state in ``PerRank``);
    ``check_replicas`` makes that an error, and verifies that replicated tensors agree too.
    ``write_workers`` threads (default: this rank's share of the cores, at most 4) write and
    hash ``part_size`` parts of a file in parallel. Each knob left None takes its value from
    ``options`` (a ``SaveOptions``, which owns the defaults).
    """
    opts = SaveOptions.merged(options, overwrite=overwrite, storage_options=storage_options, chunk_size=chunk_size,
                              sync=sync, timeout=timeout, mesh=mesh, check_replicas=check_replicas,
                              write_workers=write_workers, part_size=part_size)
    coord = coordinator_for(process_group, opts.timeout)
    return run_save(prepare(state_dict, coord.rank), path, coord=coord, options=opts, step=step, metadata=metadata)


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


def _targets_of(leaf: Leaf) -> tuple[torch.Tensor, list[tuple[torch.Tensor, Box]], tuple[int, ...]]:
    """Return (local tensor, [(destination view, global box)], global shape) for a tensor leaf."""
    v = leaf.value
    if isinstance(v, ShardedTensor):
        return v.local, [(v.local, Box(v.offsets, tuple(v.local.shape)))], v.global_shape
    if _is_dtensor(v):
        try:
            layout, coords, sizes = dtensor_layout(v)
        except StateDictError as e:
            raise StateDictError(f"{leaf.fqn}: {e}") from None
        local = v.to_local()
        out = []
        for hb in held_boxes(tuple(v.shape), layout, coords, sizes) if coords else []:
            sl = tuple(slice(o, o + n) for o, n in zip(hb.local_offsets, hb.box.lengths))
            out.append((local[sl] if local.dim() else local, hb.box))
        return local, out, tuple(v.shape)
    return v, [(v, Box.full(v.shape))], tuple(v.shape)


def _sharded_on_every_dim(v, world_size: int | None) -> bool:
    """A DTensor split on every mesh dim of size > 1, on a mesh of every rank of the job: no
    other rank holds its bytes (a mesh of fewer ranks may have replicas outside it: DDP over TP)."""
    return (_is_dtensor(v) and v.device_mesh.size() == world_size
            and all(p.is_shard() or v.device_mesh.size(i) == 1 for i, p in enumerate(v.placements)))


def load(
    state_dict: dict,
    path: str,
    *,
    strict: bool = True,
    verify: bool = True,
    cast: bool = False,
    rank: int | None = None,
    per_rank: str = "error",
    process_group=None,
    storage_options: dict | None = None,
    max_gap: int | None = None,
    max_read: int = DEFAULT_MAX_READ,
    workers: int = DEFAULT_WORKERS,
) -> LoadReport:
    """Fill ``state_dict`` in place from the checkpoint at ``path``.

    Tensors (plain, or ShardedTensor slices) are filled in place, keeping their device;
    non-tensor leaves are replaced with the stored values. ``strict`` raises if a key the
    caller holds is not in the checkpoint; otherwise it is reported in ``missing``. A key the
    checkpoint holds in another shape (entries under it, or one value above it: a fresh
    optimizer's ``state_dict()`` against a stepped one's) raises ``StateDictError`` either way.
    ``IfSaved`` subtrees (``shardfmt.get_state_dict``) get the leaves the checkpoint holds and
    lose the others, which are never missing (see ``shardfmt.layout.state``).

    Works on any topology: every rank (under torch.distributed, or ``rank=`` given) plans
    its own reads from its own targets — DTensors (any mesh and placements), ShardedTensor
    slices, or plain full tensors — and reads only the bytes it needs. ``PerRank`` values
    come back to their own rank; on a different world size ``per_rank="error"`` (default)
    raises, ``"skip"`` leaves the caller's values as they are.
    """
    if per_rank not in ("error", "skip"):
        raise StateDictError(f"per_rank must be 'error' or 'skip', got {per_rank!r}")
    rank, world_size = _rank_and_world(rank, process_group)
    ckpt = open_checkpoint(path, storage_options=storage_options)
    m = ckpt.manifest
    if world_size is None:  # ``rank=`` outside torch.distributed: that rank of the saving job
        world_size = m.topology.world_size
        if not 0 <= rank < world_size:
            raise StateDictError(f"{ckpt.path}: rank={rank} is not a rank of the job that saved it "
                                 f"(world size {world_size})")
    leaves = flatten(state_dict)
    targets: list[TargetSlice] = []
    dsts: list[torch.Tensor] = []
    src_dtypes: list[torch.dtype] = []
    posts: list[_Post] = []
    views: dict[str, list[tuple[str, torch.Tensor, ViewRecord, tuple[int, ...], int]]] = {}  # base -> its views
    pending_values: list[tuple[Leaf, Any]] = []
    absent: list[Leaf] = []
    kept: dict[str, Any] = {}  # IfSaved leaves the checkpoint holds: fqn -> tensor, or value once read
    loaded: list[str] = []
    sole: set[int] = set()  # targets no other process reads the bytes of
    for leaf in leaves:
        v = leaf.value
        if isinstance(v, (torch.Tensor, ShardedTensor)) or _is_dtensor(v):
            if leaf.fqn not in m.tensors:
                if leaf.fqn in m.values:
                    raise StateDictError(f"{leaf.fqn}: the checkpoint holds a value here, not a tensor")
                absent.append(leaf)
                continue
            if leaf.within is not None:
                kept[leaf.fqn] = v
            dst, pieces, gshape = _targets_of(leaf)
            name, rec = m.resolve(leaf.fqn)
            if tuple(gshape) != rec.shape:
                raise ShapeError(f"{leaf.fqn}: target shape {list(gshape)} != checkpoint shape {list(rec.shape)}")
            src_dtype = torch_dtype(rec.dtype, what=leaf.fqn)
            if dst.dtype != src_dtype and not cast:
                raise DTypeError(f"{leaf.fqn}: target dtype {dst.dtype} != checkpoint dtype {src_dtype} "
                                 "(pass cast=True to convert)")
            if src_dtype.is_complex and not dst.dtype.is_complex:
                raise DTypeError(f"{leaf.fqn}: casting the checkpoint's {src_dtype} to {dst.dtype} would drop "
                                 "the imaginary part")
            if dst.device.type == "meta":
                raise StateDictError(f"{leaf.fqn}: cannot load into a meta tensor; materialise it first")
            loaded.append(leaf.fqn)
            if rec.view is not None:
                if len(pieces) != 1:
                    raise StateDictError(f"{leaf.fqn}: a tensor stored as a view of a shared buffer loads only whole")
                _add_view(views, leaf.fqn, rec, pieces[0][0], pieces[0][1])
                continue
            for view, box in pieces:
                _check_writable(leaf.fqn, view)
                if world_size == 1 or _sharded_on_every_dim(v, world_size):
                    sole.add(len(dsts))
                targets.append(TargetSlice(index=len(dsts), fqn=name, box=box))
                dsts.append(view.detach())  # filled in place, outside autograd (Parameters too)
                src_dtypes.append(src_dtype)
        else:
            rec = m.values.get(leaf.fqn)
            if rec is None:
                if leaf.fqn in m.tensors:
                    raise StateDictError(f"{leaf.fqn}: the checkpoint holds a tensor here; pass a tensor to "
                                         f"load it into (got {type(v).__name__})")
                absent.append(leaf)
                continue
            if leaf.within is None:
                check_settable(leaf)  # before any read: a load fails whole or not at all
            if isinstance(v, PerRank) or rec.per_rank is not None:
                got = _value_for_rank(leaf.fqn, rec, rank, world_size, m.topology.world_size, per_rank,
                                      source=ckpt.path)
                if got is _SKIP:
                    continue
                pending_values.append((leaf, PerRank(got) if isinstance(v, PerRank) else got))
            else:
                pending_values.append((leaf, jsonvalue.decode_stored(rec.value, where=leaf.fqn, source=ckpt.path)))
            loaded.append(leaf.fqn)
    _plan_views(views, m, targets, dsts, src_dtypes, posts)
    _check_absent(absent, m, ckpt.path)
    missing = [leaf.fqn for leaf in absent if leaf.within is None]
    if missing and strict:
        shown = ", ".join(missing[:10]) + (f" and {len(missing) - 10} more" if len(missing) > 10 else "")
        raise MissingKeyError(f"{ckpt.path}: not in the checkpoint: {shown} (pass strict=False to skip)")
    # through a bounce buffer: cast and strided targets, and targets sharing memory (tied
    # weights): bytes read straight into shared memory could be overwritten before they are hashed
    # (a view's buffer, still a placeholder, will be a fresh contiguous tensor: read in place)
    bounce = frozenset(t.index for t in targets if not dsts[t.index].is_meta and (
                       dsts[t.index].dtype != src_dtypes[t.index] or not is_direct(dsts[t.index]))) \
        | _sharing_memory([dsts[t.index] for t in targets], [t.index for t in targets])
    if max_gap is None:
        max_gap = ckpt.storage.max_gap  # larger where a request costs a round trip (object stores)
    workers = max(workers, min(ckpt.storage.read_concurrency, 16)) if ckpt.storage.remote else workers
    plan = plan_load(m, targets, verify=verify, max_gap=max_gap, max_read=max_read, bounce=bounce,
                     max_bounce_read=_bounce_read_size(targets, dsts, m.chunk_size, workers=workers,
                                                       object_store=ckpt.storage.remote))
    _allocate_view_buffers(ckpt, plan, targets, dsts)
    before = ckpt.storage.stats.snapshot()
    if verify:
        check_headers(ckpt.storage, ckpt.path, m, plan.shards)
    try:
        Executor(ckpt.storage, ckpt.path, m.files, chunk_size=m.chunk_size, src_dtypes=src_dtypes,
                 targets=dsts, workers=workers, bounce=bounce, sole=frozenset(sole)).run(plan)
    except ShardfmtError as e:
        err = type(e)(f"{e} (the load stopped: the tensors being loaded may hold part of the "
                      "checkpoint's data and must not be used)")
        err.partial_load = True  # the targets were written to (Checkpointer.restore must not start fresh)
        raise err from None
    for p in posts:
        src = dsts[p.buf_index].as_strided(p.shape, p.stride, p.lo)
        with torch.no_grad():
            p.dst.copy_(src)
    for leaf, value in pending_values:
        if leaf.within is None:
            set_leaf(leaf, value)
        else:
            kept[leaf.fqn] = value
    dropped = settle_if_saved(leaves, kept)  # read, but in an IfSaved list that is not whole
    loaded = [f for f in loaded if f not in dropped] if dropped else loaded
    after = ckpt.storage.stats.snapshot()
    requested = set(loaded)
    unexpected = tuple(sorted(k for k in list(m.tensors) + list(m.values) if k not in requested))
    return LoadReport(
        loaded=tuple(loaded), missing=tuple(missing), unexpected=unexpected,
        bytes_read=after["bytes_read"] - before["bytes_read"],
        read_requests=after["read_requests"] - before["read_requests"],
        bytes_needed=plan.needed_bytes, stats=after,
    )


def _check_absent(absent: list[Leaf], m: Manifest, source: str) -> None:
    """Raise ``StateDictError`` for a leaf the checkpoint holds in another shape: entries under
    its name, or one entry above it. Present data is never reported as missing."""
    if not absent:
        return
    names = sorted([*m.tensors, *m.values])  # once per load: manifests can hold millions of names
    for leaf in absent:
        lo = bisect_left(names, leaf.fqn + ".")
        hi = bisect_left(names, leaf.fqn + "/", lo)  # "/" sorts right after ".": [lo, hi) is under it
        if hi > lo:
            shown = ", ".join(names[lo:min(hi, lo + 3)]) + (", ..." if hi - lo > 3 else "")
            raise StateDictError(
                f"{source}: {leaf.fqn}: the checkpoint holds {hi - lo} entries under this name ({shown}); "
                f"the state given to load holds one {_kind(leaf.value)} here{_fresh_optimizer_hint(leaf.value)}")
        parts = leaf.fqn.split(".")
        for above in (".".join(parts[:i]) for i in range(1, len(parts))):
            if above in m.tensors or above in m.values:
                raise StateDictError(
                    f"{source}: {leaf.fqn}: the checkpoint holds {above} as one "
                    f"{'tensor' if above in m.tensors else 'value'}, not the entries under it that the state "
                    f"given to load holds; load it as one value (e.g. {{{above!r}: None}})")


def _kind(v: Any) -> str:
    return "tensor" if isinstance(v, (torch.Tensor, ShardedTensor)) or _is_dtensor(v) else \
        f"value ({type(v).__name__} without tensors)"


def _fresh_optimizer_hint(v: Any) -> str:
    if not isinstance(v, dict) or (v and "param_groups" not in v):
        return ""
    return (". An optimizer that has not stepped yet has no state to load into: build the state with "
            "shardfmt.get_state_dict(model, optimizer), load into it, then apply it with "
            "shardfmt.set_state_dict(model, optimizer, state)")


def _check_writable(fqn: str, t: torch.Tensor) -> None:
    """Refuse a target in which two elements are one memory location (``expand``-ed views)."""
    overlap = getattr(torch, "_debug_has_internal_overlap", None)
    if overlap is not None and t.numel() > 1 and overlap(t) == 1:
        raise StateDictError(f"{fqn}: the target tensor has elements that share memory (an expanded or "
                             "overlapping view); load into a tensor with its own memory")


def _sharing_memory(tensors: list[torch.Tensor], indices: list[int]) -> frozenset[int]:
    """The indices of CPU tensors whose memory spans overlap another's (a conservative test)."""
    spans = []
    for t, i in zip(tensors, indices):
        if t.device.type != "cpu" or t.numel() == 0:
            continue
        lo = t.data_ptr()
        spans.append((lo, lo + extent(t) * t.element_size(), i))
    spans.sort()
    out: set[int] = set()
    cluster: list[int] = []  # spans chained by overlaps: all of them bounce
    reach = -1
    for lo, hi, i in spans:
        if lo >= reach:
            if len(cluster) > 1:
                out.update(cluster)
            cluster = []
        cluster.append(i)
        reach = max(reach, hi)
    if len(cluster) > 1:
        out.update(cluster)
    return frozenset(out)


def _add_view(views: dict, fqn: str, rec, dst: torch.Tensor, box: Box) -> None:
    """Note a target stored as a view of a storage: (name, target, view, shape, extent in elements)."""
    if box != Box.full(rec.shape):
        raise StateDictError(f"{fqn}: a tensor stored as a view of a shared buffer loads only whole")
    extent = 1 + sum((n - 1) * s for n, s in zip(rec.shape, rec.view.stride)) if dst.numel() else 0
    views.setdefault(rec.view.base, []).append((fqn, dst, rec.view, rec.shape, extent))


def _plan_views(views: dict, m: Manifest, targets, dsts, src_dtypes, posts) -> None:
    """One buffer per storage, spanning what its views reach (read once, whatever the number of
    views), filled by the reads and copied into each view target afterwards. The buffer is a
    meta placeholder until ``_allocate_view_buffers`` has seen the plan."""
    for base, members in views.items():
        spans = [(v.storage_offset, v.storage_offset + extent) for _, _, v, _, extent in members if extent]
        if not spans:
            continue
        lo, hi = min(a for a, _ in spans), max(z for _, z in spans)
        src_dtype = torch_dtype(m.storages[base].dtype, what=base)
        targets.append(TargetSlice(index=len(dsts), fqn=base, box=Box((lo,), (hi - lo,))))
        dsts.append(torch.empty(hi - lo, dtype=src_dtype, device="meta"))
        src_dtypes.append(src_dtype)
        posts.extend(_Post(leaf=fqn, dst=dst, buf_index=len(dsts) - 1, lo=v.storage_offset - lo, shape=shape,
                           stride=v.stride) for fqn, dst, v, shape, extent in members if extent)


def _allocate_view_buffers(ckpt, plan, targets: list[TargetSlice], dsts: list[torch.Tensor]) -> None:
    """Give each view's buffer (a meta placeholder until now) its memory, once the manifest is
    shown to hold that many bytes: its span is covered by shards (the plan checked), those shards
    claim no more bytes of a file than its data section has (no two share bytes), and the files hold the sizes
    the manifest records. A view's strides are the checkpoint's numbers: without this a 4-element
    view with a stride of 2^39 allocated terabytes before the load found the span unsaved."""
    deferred = [i for i, t in enumerate(dsts) if t.is_meta]
    if not deferred:
        return
    m = ckpt.manifest
    bases = {t.fqn for t in targets if dsts[t.index].is_meta}
    claimed: dict[str, int] = {}
    for fqn, shard in plan.shards:
        claimed[shard.file] = claimed.get(shard.file, 0) + shard.byte_range[1] - shard.byte_range[0]
        frec = m.files[shard.file]
        if claimed[shard.file] > frec.size - frec.header_size:
            raise ManifestError(f"{ckpt.path}: {shard.file}: the shards read from it claim more bytes than the "
                                f"{frec.size - frec.header_size} after its header (shards share bytes; tensor {fqn!r})")
    for name in sorted({shard.file for fqn, shard in plan.shards if fqn in bases}):
        size = ckpt.storage.size(ckpt.storage.join(ckpt.path, name), within=ckpt.path)
        if size != m.files[name].size:
            raise IntegrityError(f"{name}: file is {size} bytes, manifest says {m.files[name].size}")
    for i in deferred:
        dsts[i] = torch.empty(dsts[i].shape, dtype=dsts[i].dtype)


_SKIP = object()


def _rank_and_world(rank: int | None, process_group) -> tuple[int, int | None]:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        r = dist.get_rank(process_group)
        return (r if rank is None else rank), dist.get_world_size(process_group)
    return (rank or 0), (1 if rank is None else None)  # rank= alone: a rank of the saved job


def _bounce_read_size(targets: list[TargetSlice], dsts: list[torch.Tensor], chunk: int, *,
                      workers: int, object_store: bool = False) -> int:
    """The largest read through a bounce buffer (each worker keeps one that large).

    Local disk: 8 MiB, less for a small share, so that the workers' buffers together stay
    under 1/16 of what the rank loads (the planner cuts verified reads at chunk boundaries,
    so smaller reads re-read nothing). Object stores: 16-64 MiB (1/32 of the share), since
    every read is a round trip."""
    share = sum(t.box.numel * dsts[t.index].element_size() for t in targets)
    if object_store:
        lo = 2 * DEFAULT_MAX_BOUNCE_READ
        size = min(max(share // 32, lo), 4 * lo)
    else:
        size = min(DEFAULT_MAX_BOUNCE_READ, share // (16 * max(1, workers)))
    return max(chunk, size // chunk * chunk)


def _value_for_rank(fqn: str, rec, rank: int, world_size: int, saved_world: int, policy: str, *,
                    source: str) -> Any:
    if rec.per_rank is None:
        raise StateDictError(f"{fqn}: the checkpoint holds one replicated value, the caller expects PerRank")
    if world_size != saved_world and policy == "skip":
        return _SKIP
    if world_size != saved_world or rank not in rec.per_rank:
        raise StateDictError(f"{fqn}: per-rank value was saved by {saved_world} rank(s) "
                             f"(ranks {sorted(rec.per_rank)[:8]}), this job has {world_size} "
                             f"and this is rank {rank}; pass per_rank='skip' to keep the current values")
    return jsonvalue.decode_stored(rec.per_rank[rank], where=fqn, source=source)
