"""Step 4 of a save: the write plan, identical on every rank (pure).

Each distinct (tensor, box) is written exactly once, by one of its holders: largest boxes
first, to the holder with the fewest bytes so far (ties: lowest rank). ``WriteItem`` names
both ends of one write: the global slice and the local data it comes from.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from shardfmt.errors import StateDictError
from shardfmt.format.dtypes import itemsize
from shardfmt.format.manifest import Placement
from shardfmt.layout.geometry import Box
from shardfmt.saving.messages import RankState

WriteKey = tuple[str, tuple[int, ...], tuple[int, ...]]  # (fqn, offsets, lengths)


def assign_writers(states: Sequence[RankState]) -> dict[WriteKey, int]:
    """Choose, for every distinct (fqn, box) the ranks hold, the rank that writes it (deterministic)."""
    holders: dict[WriteKey, list[int]] = {}
    nbytes: dict[WriteKey, int] = {}
    meta: dict[str, tuple[str, tuple]] = {}
    for s in states:
        for t in s.tensors:
            sig = (t.dtype, tuple(t.shape))
            if meta.setdefault(t.fqn, sig) != sig:
                raise StateDictError(f"{t.fqn}: ranks disagree on dtype/shape ({meta[t.fqn]} vs {sig} "
                                     f"on rank {s.rank})")
            isz = itemsize(t.dtype)
            for box in t.boxes:
                key = (t.fqn, tuple(box.offsets), tuple(box.lengths))
                holders.setdefault(key, []).append(s.rank)
                nbytes[key] = isz * math.prod(box.lengths)
    load: dict[int, int] = {s.rank: 0 for s in states}
    out = {}
    for key in sorted(holders, key=lambda k: (-nbytes[k], k)):
        r = min(holders[key], key=lambda x: (load[x], x))
        out[key] = r
        load[r] += nbytes[key]
    return out


@dataclass(frozen=True, slots=True, kw_only=True)
class WriteItem:
    """One slice this rank writes: the global box of ``fqn`` and the local tensor holding it."""

    fqn: str
    box: Box
    global_shape: tuple[int, ...]
    placement: Placement | None
    storage: bool  # a shared buffer that views point into
    data: torch.Tensor
    ready: Callable[[], None] | None = field(default=None, compare=False, repr=False)


def my_items(state: RankState, pieces, writers: dict[WriteKey, int], *, rank: int,
             ready=None) -> list[WriteItem]:
    """The slices of ``pieces`` (fqn -> [(box, data)]) that the plan gives ``rank`` to write."""
    gates = ready or {}
    held = {t.fqn: t for t in state.tensors}
    return [WriteItem(fqn=f, box=box, global_shape=held[f].shape, placement=held[f].placement,
                      storage=held[f].storage, data=data, ready=gates.get((f, box)))
            for f, ps in pieces.items() for box, data in ps
            if writers[(f, box.offsets, box.lengths)] == rank]
