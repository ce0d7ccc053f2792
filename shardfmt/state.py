"""State dicts <-> flat FQN leaves: what save writes and what load fills.

Nested dicts (str or int keys) and lists/tuples holding tensors flatten to dotted FQNs
(``model.layers.0.weight``). A subtree with no tensor in it is one leaf: a non-tensor
value stored as typed JSON. Keys may themselves hold dots (``model.state_dict()`` keys
do), so ``{"a.b": x}`` and ``{"a": {"b": y}}`` name the same FQN: two paths that flatten
to the same FQN raise ``StateDictError``, as do empty keys and keys with an empty dotted
part (``"a..b"``, ``".a"``). Load walks the caller's own structure, so no information is
lost by flattening.

``ShardedTensor(local, global_shape, offsets)`` declares that a tensor is one slice of a
larger global tensor; ``PerRank(value)`` marks a value that differs per rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .errors import ShapeError, StateDictError

MAX_FQN = 4096  # the manifest's limit on a name


@dataclass(frozen=True, slots=True)
class ShardedTensor:
    """``local`` is the slice ``[offsets, offsets + local.shape)`` of a global tensor.

    ``layout`` (a ``reshard.topology.Layout``), when given, is recorded in the manifest as
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
class PerRank:
    """A value that differs per rank (RNG state, per-rank counters): stored per rank."""

    value: Any


@dataclass(frozen=True, slots=True)
class Leaf:
    """One flattened leaf and where it lives in the caller's structure."""

    fqn: str
    value: Any
    container: Any
    key: Any


def _is_tensor_like(v: Any) -> bool:
    return isinstance(v, (torch.Tensor, ShardedTensor)) or _is_dtensor(v)


def _is_dtensor(v: Any) -> bool:
    cls = type(v)
    return cls.__name__ == "DTensor" and cls.__module__.startswith("torch.distributed")


def _holds_tensor(v: Any, depth: int = 0) -> bool:
    if depth > 200:
        raise StateDictError("state dict is nested more than 200 levels deep")
    if _is_tensor_like(v):
        return True
    if isinstance(v, PerRank):
        return True  # a leaf of its own (one value per rank): the containers above it are walked
    if isinstance(v, dict):
        return any(_holds_tensor(x, depth + 1) for x in v.values())
    if isinstance(v, (list, tuple)):
        return any(_holds_tensor(x, depth + 1) for x in v)
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

    def visit(container: Any, key: Any, value: Any, fqn: str) -> None:
        if isinstance(value, (dict, list, tuple)) and _holds_tensor(value):
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for k, v in items:
                seg = _segment(k, fqn)
                visit(value, k, v, f"{fqn}.{seg}" if fqn else seg)
            return
        if fqn in leaves:
            raise StateDictError(f"{fqn}: two entries flatten to the same name")
        leaves[fqn] = Leaf(fqn, value, container, key)

    for k, v in state_dict.items():
        visit(state_dict, k, v, _segment(k, ""))
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
