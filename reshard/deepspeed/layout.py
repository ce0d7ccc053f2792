"""Where each parameter's elements lie in DeepSpeed's flat partitions (pure: no I/O).

The arithmetic is zero_to_fp32's (``get_fp32_state_dict_from_zero_checkpoint``, DeepSpeed
0.19.8), written as pieces to read instead of tensors to concatenate:

- ZeRO-1/2 (``plan_zero12``): for flat group ``g``, the ranks' saved partitions concatenated in
  rank order; ``param_shapes[g]`` walked from offset 0 (plus ``param_alignment_paddings[g][i]``
  after parameter ``i``). The walk must end within ``2 * world_size`` (rounded up) of the
  concatenation's length, as zero_to_fp32 checks. The fp32 partitions are saved with their tail
  padding stripped, the optimizer state (``exp_avg``...) with it (elastic checkpoints strip it
  too): the same offsets, cut over each one's own lengths.
- ZeRO-3 (``plan_zero3``): every rank's flats (one per sub-group) concatenated; parameter ``i``
  of the merged ``param_shapes`` takes ``pn = ceil(n / W)`` elements at the same running offset
  on every rank; its first ``n`` elements, rank by rank, are the parameter. The walk must use
  every element exactly (``offset == sum of rank 0's flats``). Every rank's flats, and the
  optimizer state, must have rank 0's lengths (zero_to_fp32 assumes it; here it is checked).

Each plan is checked to stay inside the lengths it is given, so a reader that checked those
lengths against the files never allocates for a number it did not check.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from reshard.deepspeed.records import Shapes
from reshard.errors import DeepSpeedImportError


@dataclass(frozen=True, slots=True, kw_only=True)
class Piece:
    """Elements ``[start, start + length)`` of rank ``rank``'s flat tensor ``flat``."""

    rank: int
    flat: int
    start: int
    length: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ParamPlan:
    """One trainable parameter: its fp32 pieces (``master``) and optimizer-state pieces, in order."""

    name: str
    shape: tuple[int, ...]
    flat_group: int  # the flat group holding it (its ``step`` and param group)
    master: tuple[Piece, ...]
    state: tuple[Piece, ...] | None


def numel(shape: Sequence[int], where: str) -> int:
    if any(d < 0 for d in shape):
        raise DeepSpeedImportError(f"{where}: negative dimension in shape {list(shape)}")
    return math.prod(shape)


def cut(lengths: Sequence[int], start: int, count: int) -> list[tuple[int, int, int]]:
    """Elements ``[start, start + count)`` of the concatenation of parts of ``lengths``, as
    ``(part, start in part, length)``; raises ValueError when they run past the end."""
    out, pos = [], 0
    end = start + count
    for i, n in enumerate(lengths):
        lo, hi = max(start, pos), min(end, pos + n)
        if lo < hi:
            out.append((i, lo - pos, hi - lo))
        pos += n
        if pos >= end:
            break
    if end > pos:
        raise ValueError(f"elements [{start}, {end}) run past the {pos} available")
    return out


def group_members(shapes: Shapes, paddings: Sequence[int] | None,
                  where: str) -> tuple[list[tuple[str, tuple[int, ...], int]], int]:
    """ZeRO-1/2: a flat group's parameters as ``(name, shape, offset in the group buffer)``, each
    followed by its alignment gap ``paddings[i]`` (None: no gaps), and the group's length ``N``
    (through the last gap, before the tail padding)."""
    if paddings is not None and len(paddings) != len(shapes):
        raise DeepSpeedImportError(f"{where}: {len(paddings)} alignment paddings for {len(shapes)} params")
    out, offset = [], 0
    for i, (name, shape) in enumerate(shapes):
        out.append((name, tuple(shape), offset))
        offset += numel(shape, f"{where}: {name}") + (paddings[i] if paddings is not None else 0)
    return out, offset


def zero12_partition(group_numel: int, world_size: int) -> int:
    """ZeRO-1/2: elements per rank, ``P = T / W`` with ``T`` the group padded to a multiple of ``2 * W``."""
    align = 2 * world_size
    return math.ceil(group_numel / align) * align // world_size


def zero3_partition(n: int, world_size: int) -> int:
    """ZeRO-3: elements per rank of an ``n``-element parameter, ``ceil(n / W)`` (padding included)."""
    return math.ceil(n / world_size)


def plan_zero12(param_shapes: Sequence[Shapes], flat_lengths: Sequence[Sequence[int]],
                state_lengths: Sequence[Sequence[int]] | None, *, world_size: int,
                paddings: Sequence[Sequence[int]] | None, where: str) -> list[ParamPlan]:
    """ZeRO-1/2: ``flat_lengths[r][g]`` / ``state_lengths[r][g]`` are rank ``r``'s saved lengths."""
    if paddings is not None and len(paddings) != len(param_shapes):
        raise DeepSpeedImportError(f"{where}: param_alignment_paddings for {len(paddings)} groups, "
                                   f"param_shapes for {len(param_shapes)}")
    plans: list[ParamPlan] = []
    align = 2 * world_size
    for g, shapes in enumerate(param_shapes):
        lengths = [ls[g] for ls in flat_lengths]
        slengths = None if state_lengths is None else [ls[g] for ls in state_lengths]
        pad = None if paddings is None else paddings[g]
        members, end = group_members(shapes, pad, f"{where}: group {g}")
        for name, shape, offset in members:
            n = math.prod(shape)
            try:
                master = _pieces(cut(lengths, offset, n), g)
                state = None if slengths is None else _pieces(cut(slengths, offset, n), g)
            except ValueError as e:
                raise DeepSpeedImportError(f"{where}: parameter {name!r} of group {g}: {e} in the ranks' "
                                           f"partitions {lengths} (a partition whose size does not add up)") from None
            plans.append(ParamPlan(name=name, shape=tuple(shape), flat_group=g, master=master, state=state))
        total = sum(lengths)
        if math.ceil(end / align) != math.ceil(total / align):
            raise DeepSpeedImportError(f"{where}: group {g}: the parameters take {end} elements, the ranks' "
                                       f"partitions {lengths} hold {total} (more than {align - 1} apart)")
    return plans


def _pieces(parts: list[tuple[int, int, int]], flat: int) -> tuple[Piece, ...]:
    return tuple(Piece(rank=r, flat=flat, start=s, length=n) for r, s, n in parts)


def plan_zero3(param_shapes: Sequence[Shapes], flat_lengths: Sequence[Sequence[int]],
               state_lengths: Sequence[Sequence[int]] | None, *, world_size: int, where: str) -> list[ParamPlan]:
    """ZeRO-3: ``flat_lengths[r][s]`` is the length of rank ``r``'s flat of sub-group ``s``."""
    first = list(flat_lengths[0])
    for r, ls in enumerate(flat_lengths):
        if list(ls) != first:
            raise DeepSpeedImportError(f"{where}: rank {r}'s fp32 flats have lengths {list(ls)}, rank 0's {first} "
                                       "(ZeRO-3 partitions are equal on every rank)")
    if state_lengths is not None and any(list(ls) != first for ls in state_lengths):
        raise DeepSpeedImportError(f"{where}: optimizer state lengths {[list(ls) for ls in state_lengths]} differ "
                                   f"from the fp32 flats' {first}")
    plans: list[ParamPlan] = []
    offset = 0
    for s, shapes in enumerate(param_shapes):
        for name, shape in shapes:
            n = numel(shape, f"{where}: {name}")
            pn = zero3_partition(n, world_size)
            pieces: list[Piece] = []
            try:
                for r in range(world_size):
                    take = max(0, min(pn, n - r * pn))
                    pieces += [Piece(rank=r, flat=f, start=st, length=k) for f, st, k in cut(first, offset, take)]
            except ValueError as e:
                raise DeepSpeedImportError(f"{where}: parameter {name!r}: {e} in the fp32 flats {first} (a "
                                           "partition whose size does not add up)") from None
            plans.append(ParamPlan(name=name, shape=tuple(shape), flat_group=s, master=tuple(pieces),
                                   state=None if state_lengths is None else tuple(pieces)))
            offset += pn
    if offset != sum(first):
        raise DeepSpeedImportError(f"{where}: the parameters take {offset} elements per rank, the fp32 flats hold "
                                   f"{sum(first)} (a partition whose size does not add up)")
    return plans


__all__ = ["ParamPlan", "Piece", "cut", "group_members", "numel", "plan_zero12", "plan_zero3", "zero12_partition",
           "zero3_partition"]
