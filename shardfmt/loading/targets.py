"""Read targets: which bytes of the checkpoint land in which memory, one record per slice.

A ``ReadTarget`` names both ends of one destination slice, as DCP's ``ReadItem`` does: the
source (the checkpoint's tensor record, the box of it in global coordinates, its stored
dtype) and the destination (the caller's memory, shaped like that box), with how it is
filled (through a bounce buffer or in place; whether any other process reads the same
bytes). Two sources of targets:

- a caller's tensors (``TargetBuilder``): plain tensors want the whole tensor, ShardedTensors
  their slice, FlatShards the boxes of their flat range, DTensors every box their rank holds; tensors saved as views of one shared
  buffer are read once into a buffer target and copied into each view afterwards (``ViewCopy``);
- a mesh and a rank, offline (``targets_for_rank``): the source ends only (``TargetSlice``),
  for the planner and the plan CLI, with no memory behind them.

``plan_reads`` hands the targets to the pure planner with a load's options. Building targets
touches no file; only ``allocate_view_buffers`` asks the storage for file sizes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from shardfmt.errors import (
    CheckpointNotFoundError,
    DTypeError,
    IntegrityError,
    ManifestError,
    ShapeError,
    StateDictError,
)
from shardfmt.format import refs
from shardfmt.format.dtypes import torch_dtype
from shardfmt.format.manifest import Manifest, TensorRecord, view_reach
from shardfmt.format.tensor_bytes import is_direct
from shardfmt.io.store import Storage
from shardfmt.layout.dtensor import dtensor_layout
from shardfmt.layout.geometry import Box
from shardfmt.layout.state import FlatShard, Leaf, ShardedTensor, _is_dtensor
from shardfmt.layout.topology import Mesh, count_layers, held_boxes, layout_from_record, retarget
from shardfmt.loading.options import LoadOptions
from shardfmt.loading.planner import LoadPlan, TargetSlice, plan_load


@dataclass(frozen=True, slots=True, kw_only=True)
class ViewCopy:
    """After the reads, copy the view ``fqn`` (``shape``/``stride`` from ``storage_offset``
    elements into its buffer target) into the caller's tensor ``dst``."""

    fqn: str
    dst: torch.Tensor
    storage_offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class ReadTarget:
    """Fill ``dst`` with the box ``src.box`` of the checkpoint's tensor ``src.fqn``, stored as
    ``src_dtype``.

    ``dst`` is the caller's memory for exactly that box (a view; the plan's ``dst_offsets``
    are relative to it), detached: filled in place, outside autograd. ``bounce``: gather it
    through a bounce buffer (a cast, a strided or non-CPU target, or memory another target
    shares). ``sole``: no other process reads these bytes, so large reads may go around the
    page cache. ``views``: this target is a shared buffer; copy these views out of it once
    it is read. ``first_copy``: this rank answers for these elements in a sum over the job's
    ranks (``loading.tally``): True for a plain tensor on rank 0 and a DTensor's first replica,
    False for the other copies, None where the rank cannot tell (ShardedTensor, FlatShard).
    """

    src: TargetSlice
    src_dtype: torch.dtype
    dst: torch.Tensor
    bounce: bool = False
    sole: bool = False
    views: tuple[ViewCopy, ...] = ()
    first_copy: bool | None = None

    @property
    def index(self) -> int:
        return self.src.index


def _pieces(leaf: Leaf) -> tuple[torch.Tensor, list[tuple[torch.Tensor, Box]], tuple[int, ...]]:
    """Return (local tensor, [(destination view, global box)], global shape) for a tensor leaf."""
    v = leaf.value
    if isinstance(v, ShardedTensor):
        return v.local, [(v.local, Box(v.offsets, tuple(v.local.shape)))], v.global_shape
    if isinstance(v, FlatShard):
        return v.local, v.pieces(), v.global_shape
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


def _first_copy(v, rank: int) -> bool | None:
    """Whether ``rank`` holds the first copy of the leaf value ``v``'s elements in the job: a
    plain tensor (every rank loads it whole) on rank 0; a DTensor on the first replica of every
    mesh dim it is replicated on (a ``Partial`` one holds no copy of the values); None for
    ShardedTensor and FlatShard slices, whose replicas the ranks cannot tell apart alone."""
    if isinstance(v, (ShardedTensor, FlatShard)):
        return None
    if not _is_dtensor(v):
        return rank == 0
    coords = v.device_mesh.get_coordinate()
    if coords is None:
        return False
    return all(p.is_shard() or (p.is_replicate() and c == 0) for c, p in zip(coords, v.placements))


def _sharded_on_every_dim(v, world_size: int | None) -> bool:
    """A DTensor split on every mesh dim of size > 1, on a mesh of every rank of the job: no
    other rank holds its bytes (a mesh of fewer ranks may have replicas outside it: DDP over TP)."""
    return (_is_dtensor(v) and v.device_mesh.size() == world_size
            and all(p.is_shard() or v.device_mesh.size(i) == 1 for i, p in enumerate(v.placements)))


def _check_writable(fqn: str, t: torch.Tensor) -> None:
    """Refuse a target in which two elements are one memory location (``expand``-ed views)."""
    overlap = getattr(torch, "_debug_has_internal_overlap", None)
    if overlap is not None and t.numel() > 1 and overlap(t) == 1:
        raise StateDictError(f"{fqn}: the target tensor has elements that share memory (an expanded or "
                             "overlapping view); load into a tensor with its own memory")


def _check_dtype(fqn: str, rec: TensorRecord, dst: torch.Tensor, *, cast: bool) -> torch.dtype:
    """The checkpoint's dtype for ``fqn``, if ``dst`` may take it (``cast``: another dtype)."""
    src_dtype = torch_dtype(rec.dtype, what=fqn)
    if dst.dtype != src_dtype and not cast:
        raise DTypeError(f"{fqn}: target dtype {dst.dtype} != checkpoint dtype {src_dtype} "
                         "(pass cast=True to convert)")
    if src_dtype.is_complex and not dst.dtype.is_complex:
        raise DTypeError(f"{fqn}: casting the checkpoint's {src_dtype} to {dst.dtype} would drop "
                         "the imaginary part")
    return src_dtype


class TargetBuilder:
    """Collect a load's read targets, one tensor leaf at a time (``add``), then ``build``.

    ``world_size`` is the job's (None: ``rank=`` outside torch.distributed); with one
    process every target is ``sole``. ``rank``: this process's rank in it."""

    def __init__(self, manifest: Manifest, *, cast: bool, world_size: int | None, rank: int = 0) -> None:
        self._m = manifest
        self._cast = cast
        self._world = world_size
        self._rank = rank
        self._targets: list[ReadTarget] = []
        self._views: dict[str, list[tuple[ViewCopy, int]]] = {}  # storage -> (view, extent in elements)

    def add(self, leaf: Leaf) -> None:
        """Check the tensor leaf against its record (shape, dtype, memory) and note its targets."""
        v = leaf.value
        dst, pieces, gshape = _pieces(leaf)
        name, rec = self._m.resolve(leaf.fqn)
        if tuple(gshape) != rec.shape:
            raise ShapeError(f"{leaf.fqn}: target shape {list(gshape)} != checkpoint shape {list(rec.shape)}")
        src_dtype = _check_dtype(leaf.fqn, rec, dst, cast=self._cast)
        if dst.device.type == "meta":
            raise StateDictError(f"{leaf.fqn}: cannot load into a meta tensor; materialise it first")
        if rec.view is not None:
            if len(pieces) != 1 or pieces[0][1] != Box.full(rec.shape):
                raise StateDictError(f"{leaf.fqn}: a tensor stored as a view of a shared buffer loads only whole")
            self._add_view(leaf.fqn, rec, pieces[0][0])
            return
        sole = self._world == 1 or _sharded_on_every_dim(v, self._world)
        first = _first_copy(v, self._rank)
        for view, box in pieces:
            _check_writable(leaf.fqn, view)
            self._targets.append(ReadTarget(src=TargetSlice(index=len(self._targets), fqn=name, box=box),
                                            src_dtype=src_dtype, dst=view.detach(), sole=sole, first_copy=first))

    def _add_view(self, fqn: str, rec: TensorRecord, dst: torch.Tensor) -> None:
        view = rec.view
        n = view_reach(rec.shape, view.stride) if dst.numel() else 0
        copy = ViewCopy(fqn=fqn, dst=dst, storage_offset=view.storage_offset, shape=rec.shape, stride=view.stride)
        self._views.setdefault(view.base, []).append((copy, n))

    def build(self) -> list[ReadTarget]:
        """Every target: the leaves', then one buffer per shared storage, spanning what its views
        reach (read once, whatever the number of views; a meta placeholder until
        ``allocate_view_buffers``), each marked ``bounce`` where it must be."""
        targets = list(self._targets)
        for base, members in self._views.items():
            copies = [c for c, n in members if n]
            if not copies:
                continue
            lo = min(c.storage_offset for c in copies)
            hi = max(c.storage_offset + n for c, n in members if n)
            src_dtype = torch_dtype(self._m.storages[base].dtype, what=base)
            targets.append(ReadTarget(
                src=TargetSlice(index=len(targets), fqn=base, box=Box((lo,), (hi - lo,))), src_dtype=src_dtype,
                dst=torch.empty(hi - lo, dtype=src_dtype, device="meta"), first_copy=self._rank == 0,
                sole=self._world == 1,
                views=tuple(replace(c, storage_offset=c.storage_offset - lo) for c in copies)))
        return _mark_bounce(targets)


def _mark_bounce(targets: list[ReadTarget]) -> list[ReadTarget]:
    """Mark the targets filled through a bounce buffer: cast, strided and non-CPU targets, and
    targets whose memory overlaps another's (bytes read straight into shared memory could be
    overwritten before they are hashed). Of targets that are one memory under several names
    (tied weights), the first is read as if alone and each other one into memory of its own,
    copied in after every read, in order (``_apart``): two names' bytes copied into one memory
    at once would leave a mix of both. A view's buffer, still a placeholder, will be a fresh
    contiguous tensor: read in place."""
    apart, shared = _overlaps(targets)
    out = []
    for t in targets:
        if t.index in apart:
            t = _apart(t)
        if t.index in shared or (not t.dst.is_meta and (t.dst.dtype != t.src_dtype or not is_direct(t.dst))):
            t = replace(t, bounce=True)
        out.append(t)
    return out


def _apart(t: ReadTarget) -> ReadTarget:
    """``t`` read into memory of its own, copied into its caller's memory once every read is done
    (``copy_views``, in target order: where tied targets hold different values the later one's
    are left)."""
    own = torch.empty(t.dst.shape, dtype=t.dst.dtype, device=t.dst.device)
    back = ViewCopy(fqn=t.src.fqn, dst=t.dst, storage_offset=0, shape=tuple(t.dst.shape), stride=own.stride())
    return replace(t, dst=own, views=(back,))


def _overlaps(targets: Sequence[ReadTarget]) -> tuple[frozenset[int], frozenset[int]]:
    """(targets to set apart, targets sharing memory): of each cluster of targets whose memory
    spans overlap (chained; a conservative test, per device), the repeats of one memory (same
    address, shape, strides and dtype) after its first, and, where the cluster holds more than
    one memory, the rest of its members."""
    spans = []
    for t in targets:
        if t.dst.is_meta or t.dst.numel() == 0:
            continue
        lo = t.dst.data_ptr()
        spans.append((str(t.dst.device), lo, lo + view_reach(t.dst.shape, t.dst.stride()) * t.dst.element_size(),
                      t.index))
    spans.sort()
    apart: set[int] = set()
    shared: set[int] = set()
    clusters: list[list[int]] = []
    where, reach = None, -1
    for device, lo, hi, i in spans:
        if not clusters or device != where or lo >= reach:
            clusters.append([])
            where, reach = device, -1
        clusters[-1].append(i)
        reach = max(reach, hi)
    for cluster in clusters:
        if len(cluster) < 2:
            continue
        memories: dict[tuple, list[int]] = {}
        for i in sorted(cluster):
            d = targets[i].dst
            memories.setdefault((d.data_ptr(), tuple(d.shape), d.stride(), d.dtype), []).append(i)
        for same in memories.values():
            apart.update(same[1:])
        if len(memories) > 1:
            shared.update(same[0] for same in memories.values())
    return frozenset(apart), frozenset(shared)


def plan_reads(manifest: Manifest, targets: Sequence[ReadTarget], options: LoadOptions, *,
               remote: bool = False) -> LoadPlan:
    """Plan the reads that fill ``targets`` (``planner.plan_load``) with ``options``, resolved
    for the storage (``LoadOptions.for_storage``: ``max_gap`` is set)."""
    share = sum(t.src.box.numel * t.dst.element_size() for t in targets)
    return plan_load(manifest, [t.src for t in targets], verify=options.verify, max_gap=options.max_gap,
                     max_read=options.max_read, bounce=frozenset(t.index for t in targets if t.bounce),
                     max_bounce_read=options.bounce_read_size(share, manifest.chunk_size, remote=remote))


def allocate_view_buffers(storage: Storage, path: str, manifest: Manifest, plan: LoadPlan,
                          targets: Sequence[ReadTarget]) -> list[ReadTarget]:
    """Give each view's buffer (a meta placeholder until now) its memory, once the manifest is
    shown to hold that many bytes: its span is covered by shards (the plan checked), those shards
    claim no more bytes of a file than its data section has (no two share bytes), and the files hold the sizes
    the manifest records. A view's strides are the checkpoint's numbers: without this a 4-element
    view with a stride of 2^39 allocated terabytes before the load found the span unsaved."""
    if not any(t.dst.is_meta for t in targets):
        return list(targets)
    bases = {t.src.fqn for t in targets if t.dst.is_meta}
    claimed: dict[str, int] = {}
    for fqn, shard in plan.shards:
        claimed[shard.file] = claimed.get(shard.file, 0) + shard.byte_range[1] - shard.byte_range[0]
        frec = manifest.files[shard.file]
        if claimed[shard.file] > frec.size - frec.header_size:
            raise ManifestError(f"{path}: {shard.file}: the shards read from it claim more bytes than the "
                                f"{frec.size - frec.header_size} after its header (shards share bytes; tensor {fqn!r})")
    for name in sorted({shard.file for fqn, shard in plan.shards if fqn in bases}):
        full, within = refs.location(storage.join, path, name)
        try:
            size = storage.size(full, within=within)
        except CheckpointNotFoundError:
            raise IntegrityError(refs.missing_file(name)) from None
        if size != manifest.files[name].size:
            raise IntegrityError(f"{name}: file is {size} bytes, manifest says {manifest.files[name].size}")
    return [replace(t, dst=torch.empty(t.dst.shape, dtype=t.dst.dtype)) if t.dst.is_meta else t for t in targets]


def copy_views(targets: Sequence[ReadTarget]) -> None:
    """Copy every view out of its buffer target, once the reads have filled it."""
    for t in targets:
        for c in t.views:
            with torch.no_grad():
                c.dst.copy_(t.dst.as_strided(c.shape, c.stride, c.storage_offset))


def targets_for_rank(manifest, mesh: Mesh, rank: int, *, layouts=None) -> list[TargetSlice]:
    """Every slice ``rank`` of ``mesh`` holds, each tensor laid out as it was saved, or as
    ``layouts`` (fqn -> Layout on ``mesh``, e.g. from a rules file) says where it has an entry.
    Pure: a manifest, a mesh and a rank in, source ends out (no files, no process group)."""
    coords = mesh.coords(rank)
    sizes = dict(mesh.dims)
    n_layers = count_layers(manifest.tensors)
    out: list[TargetSlice] = []
    for fqn in sorted(manifest.tensors):
        name, rec = manifest.resolve(fqn)
        if rec.view is not None or name != fqn:
            continue  # aliases and views are filled from what they point at
        lay = layouts.get(fqn) if layouts is not None else None
        if lay is None:
            lay = retarget(fqn, layout_from_record(rec.placement), mesh, num_layers=n_layers)
        for hb in held_boxes(rec.shape, lay, coords, sizes):
            out.append(TargetSlice(index=len(out), fqn=fqn, box=hb.box))
    return out
