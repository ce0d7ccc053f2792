"""Step 1 of a save: flatten a rank's state and describe what it holds (no collective, no I/O).

DTensors become the global boxes this rank holds (placements read off the DTensor),
ShardedTensors their one box, FlatShards the boxes their flat range cuts into, plain tensors are grouped by shared memory (``sharing``:
aliases, views of one storage), values are encoded to typed JSON here, so the description
is a snapshot of them. ``Prepared`` pairs the description (``RankState``, what the ranks
exchange) with the local tensor views to write.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from shardfmt.errors import ShardfmtError, StateDictError
from shardfmt.format import jsonvalue
from shardfmt.format.dtypes import dtype_code
from shardfmt.format.manifest import TensorRecord
from shardfmt.format.tensor_bytes import resolved
from shardfmt.layout.dtensor import dtensor_layout, placement_record
from shardfmt.layout.geometry import Box
from shardfmt.layout.state import (
    FlatShard,
    Leaf,
    PerRank,
    ShardedTensor,
    _is_dtensor,
    flatten,
    per_rank_arrays,
)
from shardfmt.layout.topology import Layout, held_boxes
from shardfmt.saving.messages import HeldTensor, RankError, RankState
from shardfmt.saving.sharing import check_saveable, plan_sharing

Piece = tuple[Box, torch.Tensor]  # global box -> local data view


def dtensor_pieces(v) -> tuple[Layout, list[Piece]]:
    """A DTensor's layout and the boxes this rank holds of it, each with its local data."""
    layout, coords, sizes = dtensor_layout(v)
    local = v.to_local().detach()
    pieces = []
    for hb in held_boxes(tuple(v.shape), layout, coords, sizes) if coords else []:
        sl = tuple(slice(o, o + n) for o, n in zip(hb.local_offsets, hb.box.lengths))
        pieces.append((hb.box, local[sl] if local.dim() else local))
    return layout, pieces


def _dtensor_pieces(leaf: Leaf) -> tuple[HeldTensor, list[Piece]]:
    v = leaf.value
    try:
        layout, pieces = dtensor_pieces(v)
    except StateDictError as e:
        raise StateDictError(f"{leaf.fqn}: {e}") from None
    local = v.to_local()
    check_saveable(leaf.fqn, local)
    held = HeldTensor(fqn=leaf.fqn, dtype=dtype_code(local.dtype, what=leaf.fqn), shape=tuple(v.shape),
                      placement=placement_record(layout), boxes=tuple(b for b, _ in pieces))
    return held, pieces


def _sharded_pieces(leaf: Leaf) -> tuple[HeldTensor, list[Piece]]:
    v = leaf.value
    check_saveable(leaf.fqn, v.local)
    box = Box(v.offsets, tuple(v.local.shape))
    held = HeldTensor(fqn=leaf.fqn, dtype=dtype_code(v.local.dtype, what=leaf.fqn), shape=v.global_shape,
                      placement=placement_record(v.layout) if v.layout is not None else None, boxes=(box,))
    return held, [(box, v.local.detach())]


def _flat_pieces(leaf: Leaf) -> tuple[HeldTensor, list[Piece]]:
    v = leaf.value
    check_saveable(leaf.fqn, v.local)
    pieces = [(box, view.detach()) for view, box in v.pieces()]
    held = HeldTensor(fqn=leaf.fqn, dtype=dtype_code(v.local.dtype, what=leaf.fqn), shape=v.global_shape,
                      placement=placement_record(v.layout) if v.layout is not None else None,
                      boxes=tuple(b for b, _ in pieces))
    return held, pieces


def describe(state_dict: dict, rank: int) -> tuple[RankState, dict[str, list[Piece]]]:
    """Return what this rank holds: its ``RankState`` and, per fqn, the local pieces to write
    (``IfSaved`` subtrees are no real state: they are left out)."""
    held: dict[str, HeldTensor] = {}
    pieces: dict[str, list[Piece]] = {}
    plain: dict[str, torch.Tensor] = {}
    values: dict[str, object] = {}
    per_rank: dict[str, object] = {}
    for leaf in flatten(state_dict):
        v = leaf.value
        if leaf.within is not None:
            continue  # IfSaved: made up to load into, never saved
        if _is_dtensor(v):
            held[leaf.fqn], pieces[leaf.fqn] = _dtensor_pieces(leaf)
        elif isinstance(v, ShardedTensor):
            held[leaf.fqn], pieces[leaf.fqn] = _sharded_pieces(leaf)
        elif isinstance(v, FlatShard):
            held[leaf.fqn], pieces[leaf.fqn] = _flat_pieces(leaf)
        elif isinstance(v, torch.Tensor):
            check_saveable(leaf.fqn, v)
            plain[leaf.fqn] = resolved(v)  # a lazy conj/neg is not its storage's bytes: shares nothing
        elif isinstance(v, PerRank):
            per_rank[leaf.fqn] = jsonvalue.encode(per_rank_arrays(v.value, where=leaf.fqn), where=leaf.fqn)
        else:
            values[leaf.fqn] = jsonvalue.encode(v, where=leaf.fqn)
    stored, aliases, views, storages = plan_sharing(plain)
    for fqn, t in list(stored.items()) + list(storages.items()):
        box = Box.full(t.shape)
        held[fqn] = HeldTensor(fqn=fqn, dtype=dtype_code(t.dtype, what=fqn), shape=tuple(t.shape),
                               storage=fqn in storages, boxes=(box,))
        pieces[fqn] = [(box, t)]
    view_records = {f: TensorRecord(dtype=dtype_code(plain[f].dtype, what=f), shape=tuple(plain[f].shape), view=vr)
                    for f, (_, vr) in views.items()}
    state = RankState(rank=rank, tensors=tuple(held.values()), aliases=aliases, views=view_records,
                      values=values, per_rank=per_rank)
    return state, pieces


@dataclass(slots=True)
class Prepared:
    """What a rank holds, described and ready to write: no collective, no I/O has run yet.

    ``state`` is the description the ranks exchange, or a ``RankError`` when describing
    failed (reported to every rank by ``run_save``); ``pieces`` maps fqn -> the rank's
    (global box, local tensor view) pairs; ``ready`` maps (fqn, box) -> a wait for that
    piece's data (async saves: the snapshot's copy).
    """

    rank: int
    state: RankState | RankError
    pieces: dict[str, list[Piece]]
    ready: dict[tuple[str, Box], Callable[[], None]] | None = None

    def tensors(self) -> list[torch.Tensor]:
        return [data for ps in self.pieces.values() for _, data in ps]

    def with_tensors(self, tensors: list[torch.Tensor],
                     ready: list[Callable[[], None]] | None = None) -> Prepared:
        """The same description over other tensors (a snapshot), in ``tensors()`` order;
        ``ready[i]``, when given, blocks until ``tensors[i]`` holds its data."""
        it = iter(tensors)
        pieces = {f: [(box, next(it)) for box, _ in ps] for f, ps in self.pieces.items()}
        gates = None
        if ready is not None:
            keys = [(f, box) for f, ps in self.pieces.items() for box, _ in ps]
            gates = dict(zip(keys, ready))
        return Prepared(self.rank, self.state, pieces, ready=gates)

    def wait_ready(self) -> None:
        for gate in (self.ready or {}).values():
            gate()


def prepare(state_dict: dict, rank: int) -> Prepared:
    """Describe ``state_dict`` on the caller's thread (step 1 of the protocol)."""
    try:
        state, pieces = describe(state_dict, rank)
        return Prepared(rank, state, pieces)
    except ShardfmtError as e:
        return Prepared(rank, RankError.of(rank, e), {})
