"""State dicts <-> flat FQN leaves: what save writes and what load fills.

Nested dicts (str or int keys) and lists/tuples holding tensors flatten to dotted FQNs
(``model.layers.0.weight``). A subtree with no tensor in it is one leaf: a non-tensor
value stored as typed JSON. Keys may themselves hold dots (``model.state_dict()`` keys
do), so ``{"a.b": x}`` and ``{"a": {"b": y}}`` name the same FQN: two paths that flatten
to the same FQN raise ``StateDictError``, as do empty keys and keys with an empty dotted
part (``"a..b"``, ``".a"``). Load walks the caller's own structure, so no information is
lost by flattening.

``ShardedTensor(local, global_shape, offsets)`` declares that a tensor is one slice of a
larger global tensor; ``FlatShard(local, global_shape, start)`` that a 1-D tensor holds a run
of a global tensor's row-major elements (ZeRO/FSDP1 flat partitions; ``flat_group`` cuts a
group buffer into them); ``PerRank(value)`` marks a value that differs per rank.

``IfSaved(subtree)`` (a dict's value) marks state that exists only to be loaded into, not
real state: what ``shardfmt.get_state_dict`` makes for a fresh optimizer's parameters.
``save`` never writes an IfSaved subtree (a never-stepped optimizer saves no per-parameter
state). ``load`` fills each of its leaves that the checkpoint holds, removes the others (and
then the dicts left empty; a list or tuple stays only whole, its saved entries then count as
unexpected) without ever calling them missing, and puts the plain subtree in the marker's
place, or removes the key when nothing is left: a parameter that had no state at save gets
none. A leaf the checkpoint holds in another shape (entries under its name, one entry above
it) is never missing either: ``load`` raises ``StateDictError``, with or without ``strict``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from shardfmt.errors import ShapeError, StateDictError
from shardfmt.layout.flat import flat_boxes
from shardfmt.layout.geometry import Box
from shardfmt.layout.topology import Flat, Layout

MAX_FQN = 4096  # the manifest's limit on a name


@dataclass(frozen=True, slots=True)
class ShardedTensor:
    """``local`` is the slice ``[offsets, offsets + local.shape)`` of a global tensor.

    ``layout`` (a ``shardfmt.layout.topology.Layout``), when given, is recorded in the manifest as
    the tensor's symbolic placement, so tools can re-derive every rank's slice.
    """

    local: torch.Tensor
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    layout: Any = None

    def __init__(self, local: torch.Tensor, global_shape: Sequence[int], offsets: Sequence[int],
                 *, layout: Any = None) -> None:
        if not isinstance(local, torch.Tensor):
            raise StateDictError(f"ShardedTensor needs a torch.Tensor, got {type(local).__name__}")
        gs = tuple(int(x) for x in global_shape)
        offs = tuple(int(x) for x in offsets)
        if len(gs) != local.dim() or len(offs) != local.dim():
            raise ShapeError(f"ShardedTensor: local rank {local.dim()}, global_shape {list(gs)}, offsets {list(offs)}")
        for d, (o, n, g) in enumerate(zip(offs, local.shape, gs)):
            if o < 0 or o + n > g:
                raise ShapeError(f"ShardedTensor: dim {d}: [{o}, {o + n}) outside global size {g}")
        object.__setattr__(self, "local", local)
        object.__setattr__(self, "global_shape", gs)
        object.__setattr__(self, "offsets", offs)
        object.__setattr__(self, "layout", layout)


@dataclass(frozen=True, slots=True)
class FlatShard:
    """``local`` (1-D, contiguous) holds elements ``[start, start + local.numel())`` of a global
    tensor's row-major flattening: a ZeRO-3 partition of a parameter, or the part of one
    parameter inside a ZeRO-1/2 or FSDP1 rank's window of a group buffer (``flat_group``).
    Elements past the tensor's end are padding: never saved, never written by a load. Stored
    as the boxes the range cuts into (``layout.flat``), so it reshards to and from any layout.

    ``layout`` (a ``Layout`` ending in a ``Flat`` entry, e.g. ``Layout(("dp",), (Flat(0,
    part),))`` for ZeRO-3), when given, is recorded as the tensor's placement: when every rank
    holds what it derives, the checkpoint stores the placement instead of every rank's boxes.
    """

    local: torch.Tensor
    global_shape: tuple[int, ...]
    start: int
    layout: Any = None

    def __init__(self, local: torch.Tensor, global_shape: Sequence[int], start: int, *,
                 layout: Any = None) -> None:
        if not isinstance(local, torch.Tensor):
            raise StateDictError(f"FlatShard needs a torch.Tensor, got {type(local).__name__}")
        if local.dim() != 1 or (local.numel() > 1 and local.stride(0) != 1):
            raise ShapeError(f"FlatShard: local must be a contiguous 1-D tensor, got shape {list(local.shape)} "
                             f"stride {list(local.stride())}")
        gs = tuple(int(x) for x in global_shape)
        if any(n < 0 for n in gs) or int(start) < 0:
            raise ShapeError(f"FlatShard: global_shape {list(gs)} and start {start} must not be negative")
        object.__setattr__(self, "local", local)
        object.__setattr__(self, "global_shape", gs)
        object.__setattr__(self, "start", int(start))
        object.__setattr__(self, "layout", layout)

    @classmethod
    def chunk(cls, local: torch.Tensor, global_shape: Sequence[int], *, coord: int, count: int,
              mesh_dim: str | None = None) -> FlatShard:
        """ZeRO-3's partition ``coord`` of ``count``: the flattened tensor cut into pieces of
        ``ceil(numel / count)`` elements (``local`` holds one, padding included); ``mesh_dim``
        names the mesh dim the pieces are laid over, recorded as ``Flat(0, part)``."""
        part = max(1, -(-math.prod(int(x) for x in global_shape) // count))
        layout = None if mesh_dim is None or not len(global_shape) else Layout((mesh_dim,), (Flat(0, part),))
        return cls(local, global_shape, coord * part, layout=layout)

    def pieces(self) -> list[tuple[torch.Tensor, Box]]:
        """(view of ``local``, global box) for every box the range cuts into, in order."""
        out = []
        for fb in flat_boxes(self.global_shape, self.start, self.start + self.local.numel()):
            lo = fb.start - self.start
            out.append((self.local[lo:lo + fb.box.numel].view(fb.box.lengths), fb.box))
        return out


def flat_group(buffer: torch.Tensor, members: Sequence[tuple[str, Sequence[int], int]], *,
               start: int, mesh_dim: str | None = None) -> dict[str, FlatShard]:
    """The ``FlatShard``s of a rank's window of a group buffer (ZeRO-1/2, FSDP1).

    ``members`` are the group's tensors as ``(name, shape, offset)``: each occupies elements
    ``[offset, offset + numel)`` of the group's flat buffer (offsets carry any alignment
    padding between members); ``buffer`` (1-D) holds the group's elements ``[start, start +
    buffer.numel())``. Returns name -> the part of that tensor in the window, for the members
    the window touches; padding between or after members is left out (never saved, never
    loaded into).

    ``mesh_dim``: the mesh dim the group's windows are laid over (equal windows, rank at
    coordinate ``c`` holding ``[c * buffer.numel(), ...)``): every member is returned, empty
    where the window misses it, with its ``Flat(offset, buffer.numel())`` layout (a 0-d member:
    none), so the checkpoint records each tensor's placement instead of every rank's boxes."""
    if not isinstance(buffer, torch.Tensor) or buffer.dim() != 1:
        raise ShapeError("flat_group: buffer must be a 1-D tensor")
    out = {}
    hi = start + buffer.numel()
    for name, shape, offset in members:
        n = math.prod(int(x) for x in shape)
        lo_m, hi_m = max(start, offset), min(hi, offset + n)
        layout = None if mesh_dim is None or not len(shape) else Layout((mesh_dim,), (Flat(int(offset), buffer.numel()),))
        if lo_m < hi_m:
            out[name] = FlatShard(buffer[lo_m - start:hi_m - start], shape, lo_m - offset, layout=layout)
        elif layout is not None:
            out[name] = FlatShard(buffer[:0], shape, 0, layout=layout)
    return out


@dataclass(frozen=True, slots=True)
class PerRank:
    """A value that differs per rank (RNG state, per-rank counters, a data loader's state):
    stored per rank, as typed JSON; the small CPU tensors it may hold (a sampler generator's
    state) as numpy arrays (``per_rank_arrays``), given back as tensors where the value loaded
    into holds a tensor (``per_rank_tensors``)."""

    value: Any


def per_rank_arrays(value: Any, *, where: str, _depth: int = 0) -> Any:
    """``value`` with every tensor replaced by a numpy array of its bytes (a copy): what typed
    JSON stores (spec section 8). A tensor numpy cannot hold (bfloat16, float8, a GPU tensor
    that does not fit) is refused, naming it."""
    if _depth > 200:
        raise StateDictError(f"{where}: nested more than 200 levels deep")
    if isinstance(value, torch.Tensor):
        if _is_dtensor(value) or value.is_meta or value.is_sparse:
            raise StateDictError(f"{where}: a per-rank value holds a {type(value).__name__} that is not a plain "
                                 "tensor; store it as a state-dict tensor instead")
        t = value.detach().to("cpu")
        try:
            return t.numpy().copy()
        except (TypeError, RuntimeError) as e:
            raise StateDictError(f"{where}: a per-rank value holds a {t.dtype} tensor, which typed JSON cannot "
                                 f"store ({e}); make it a state-dict tensor") from None
    if isinstance(value, dict):
        return {k: per_rank_arrays(v, where=f"{where}.{k}", _depth=_depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        out = [per_rank_arrays(v, where=f"{where}[{i}]", _depth=_depth + 1) for i, v in enumerate(value)]
        return out if isinstance(value, list) else tuple(out)
    return value


def per_rank_tensors(value: Any, template: Any, *, _depth: int = 0) -> Any:
    """``value`` (a loaded per-rank value) with every numpy array that stands where ``template``
    (the value it is loaded into) holds a tensor turned back into a tensor of that dtype."""
    import numpy as np

    if _depth > 200:
        return value
    if isinstance(template, torch.Tensor) and isinstance(value, np.ndarray):
        return torch.from_numpy(np.array(value, copy=True)).to(dtype=template.dtype, device=template.device)
    if isinstance(template, dict) and isinstance(value, dict):
        return {k: per_rank_tensors(v, template.get(k), _depth=_depth + 1) for k, v in value.items()}
    if isinstance(template, (list, tuple)) and isinstance(value, (list, tuple)):
        out = [per_rank_tensors(v, template[i] if i < len(template) else None, _depth=_depth + 1)
               for i, v in enumerate(value)]
        return out if isinstance(value, list) else tuple(out)
    return value


@dataclass(frozen=True, slots=True)
class IfSaved:
    """State to load into only if the checkpoint holds it; never saved (see the module docstring)."""

    value: Any


@dataclass(frozen=True, slots=True)
class Leaf:
    """One flattened leaf and where it lives in the caller's structure.

    ``within`` is the leaf of the ``IfSaved`` marker this leaf lies in (None: real state).
    """

    fqn: str
    value: Any
    container: Any
    key: Any
    within: Leaf | None = None


def _is_tensor_like(v: Any) -> bool:
    return isinstance(v, (torch.Tensor, ShardedTensor, FlatShard)) or _is_dtensor(v)


def _is_dtensor(v: Any) -> bool:
    cls = type(v)
    return cls.__name__ == "DTensor" and cls.__module__.startswith("torch.distributed")


def holds_tensor(v: Any, depth: int = 0) -> bool:
    """Whether ``v`` is or holds (within dicts, lists, tuples) a tensor leaf: shardfmt walks it."""
    if depth > 200:
        raise StateDictError("state dict is nested more than 200 levels deep")
    if _is_tensor_like(v):
        return True
    if isinstance(v, (PerRank, IfSaved)):
        return True  # a leaf or subtree of its own: the containers above it are walked
    if isinstance(v, dict):
        return any(holds_tensor(x, depth + 1) for x in v.values())
    if isinstance(v, (list, tuple)):
        return any(holds_tensor(x, depth + 1) for x in v)
    return False


def _segment(key: Any, prefix: str) -> str:
    if isinstance(key, bool) or not isinstance(key, (str, int)):
        raise StateDictError(f"{prefix or '<root>'}: key {key!r} of type {type(key).__name__} cannot name a "
                             "tensor (keys on the path to a tensor must be str or int)")
    seg = str(key)
    if not seg:
        raise StateDictError(f"{prefix or '<root>'}: empty key on the path to a tensor")
    if seg.startswith(".") or seg.endswith(".") or ".." in seg:
        raise StateDictError(f"{prefix or '<root>'}: key {seg!r} has an empty dotted part")
    return seg


def flatten(state_dict: Any) -> list[Leaf]:
    """Return the leaves of ``state_dict`` in a deterministic (sorted by FQN) order."""
    if not isinstance(state_dict, dict):
        raise StateDictError(f"state dict must be a dict, got {type(state_dict).__name__}")
    leaves: dict[str, Leaf] = {}

    def visit(container: Any, key: Any, value: Any, fqn: str, within: Leaf | None) -> None:
        if isinstance(value, IfSaved):
            if within is not None or not isinstance(container, dict):
                raise StateDictError(f"{fqn}: IfSaved must be a dict's value, outside any other IfSaved")
            within = Leaf(fqn, value, container, key)
            container, key, value = value, "value", value.value
        if isinstance(value, (dict, list, tuple)) and holds_tensor(value):
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for k, v in items:
                seg = _segment(k, fqn)
                visit(value, k, v, f"{fqn}.{seg}" if fqn else seg, within)
            return
        if fqn in leaves:
            raise StateDictError(f"{fqn}: two entries flatten to the same name")
        leaves[fqn] = Leaf(fqn, value, container, key, within)

    for k, v in state_dict.items():
        visit(state_dict, k, v, _segment(k, ""), None)
    for fqn in leaves:
        if len(fqn) > MAX_FQN:
            raise StateDictError(f"{fqn[:80]}...: name of {len(fqn)} characters exceeds {MAX_FQN}")
    return [leaves[k] for k in sorted(leaves)]


def check_settable(leaf: Leaf) -> None:
    """Raise unless ``set_leaf`` can replace this leaf (asked before a load reads anything)."""
    if not hasattr(type(leaf.container), "__setitem__"):
        raise StateDictError(f"{leaf.fqn}: cannot replace a value inside an immutable "
                             f"{type(leaf.container).__name__}; hold it in a list or dict")


def set_leaf(leaf: Leaf, value: Any) -> None:
    """Replace a non-tensor leaf in the caller's structure."""
    check_settable(leaf)
    leaf.container[leaf.key] = value


_GONE = object()


def settle_if_saved(leaves: list[Leaf], kept: dict[str, Any]) -> set[str]:
    """Put each ``IfSaved`` marker's subtree, holding only the leaves in ``kept`` (fqn -> the
    loaded value), in the marker's place in the caller's structure; drop the marker's key when
    nothing is left. Return the kept leaves that were dropped all the same (in a list or tuple
    that is not whole)."""
    markers: dict[str, tuple[Leaf, set[str]]] = {}
    for leaf in leaves:
        if leaf.within is not None:
            markers.setdefault(leaf.within.fqn, (leaf.within, set()))[1].add(leaf.fqn)
    placed: set[str] = set()
    for fqn, (marker, names) in markers.items():
        plain = _kept_subtree(marker.value.value, fqn, names, kept, placed)
        if plain is _GONE:
            del marker.container[marker.key]
        else:
            marker.container[marker.key] = plain
    return set(kept) - placed


def _kept_subtree(value: Any, fqn: str, leaf_names: set[str], kept: dict[str, Any], placed: set[str]) -> Any:
    """``value`` (the subtree at ``fqn``, walked as ``flatten`` walks it) with only its kept leaves
    (their names added to ``placed``): dicts keep what is left, lists and tuples stay only whole;
    ``_GONE`` if nothing is left."""
    if fqn in leaf_names:
        if fqn not in kept:
            return _GONE
        placed.add(fqn)
        return kept[fqn]
    if isinstance(value, dict):
        out = {k: sub for k, v in value.items()
               if (sub := _kept_subtree(v, f"{fqn}.{k}", leaf_names, kept, placed)) is not _GONE}
        return out or _GONE
    mark = set()
    items = [_kept_subtree(v, f"{fqn}.{i}", leaf_names, kept, mark) for i, v in enumerate(value)]
    if any(x is _GONE for x in items):
        return _GONE
    placed |= mark
    return value._make(items) if hasattr(value, "_make") else type(value)(items)  # namedtuples too
