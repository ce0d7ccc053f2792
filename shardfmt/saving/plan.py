"""Step 4 of a save: the write plan, identical on every rank (pure).

Each distinct (tensor, box) is written exactly once, by one of its holders: largest boxes
first, to the holder with the fewest bytes so far (ties: lowest rank). ``WriteItem`` names
both ends of one write: the global slice and the local data it comes from.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from shardfmt.errors import CommitError, StateDictError
from shardfmt.format import hashing
from shardfmt.format.dtypes import itemsize
from shardfmt.format.manifest import Placement
from shardfmt.layout.geometry import Box
from shardfmt.saving.messages import RankState, WriteKey


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
    return least_loaded(holders, nbytes)


def least_loaded(holders: Mapping[WriteKey, Sequence[int]], nbytes: Mapping[WriteKey, int]) -> dict[WriteKey, int]:
    """Each box, largest first (ties by key), to its holder with the fewest bytes so far (ties: lowest rank)."""
    load: dict[int, int] = {}
    out = {}
    for key in sorted(holders, key=lambda k: (-nbytes[k], k)):
        r = min(holders[key], key=lambda x: (load.get(x, 0), x))
        out[key] = r
        load[r] = load.get(r, 0) + nbytes[key]
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
    """The slices of ``pieces`` (fqn -> [(box, data)]) that ``writers`` (key -> writer rank) give ``rank``."""
    gates = ready or {}
    held = {t.fqn: t for t in state.tensors}
    out = []
    for f, ps in pieces.items():
        for box, data in ps:
            # v2 plans name only what the rank writes, and store no box without elements
            if writers.get((f, box.offsets, box.lengths)) == rank:
                out.append(WriteItem(fqn=f, box=box, global_shape=held[f].shape, placement=held[f].placement,
                                     storage=held[f].storage, data=data, ready=gates.get((f, box))))
    found = {(it.fqn, it.box.offsets, it.box.lengths) for it in out}
    lost = sorted(k for k, r in writers.items() if r == rank and k not in found)
    if lost:  # the plan and what this rank holds disagree: writing less would commit a hole
        f, offsets, lengths = lost[0]
        raise CommitError(f"{f}: the write plan gives rank {rank} the box {list(offsets)}+{list(lengths)}, "
                          f"which it does not hold ({len(lost)} such boxes); nothing was committed")
    return out


MIN_AUTO_CHUNK = 16 << 10
CHUNKS_PER_SHARD = 8  # a verified read of part of a shard reads at most 2 chunks more: 1/4 of a typical shard


def auto_chunk_size(box_bytes: Iterable[int], *, format_version: int) -> int:
    """The hash chunk of a save that was given none: v1's 1 MiB; v2 (chunks aligned to each
    shard) about 1/8 of the stored box that holds the median byte, a power of two in [16 KiB,
    1 MiB], so a verified read of part of a shard stays near the bytes it needs at fine
    sharding (a job of thousands of ranks) and large shards keep 1 MiB chunks (few digests);
    small boxes are read whole whatever the chunk (chunks never cross a shard). ``box_bytes``:
    the bytes of every stored box (every rank of a save has the same plan, so all pick alike)."""
    if format_version < 2:
        return hashing.DEFAULT_CHUNK_SIZE
    sizes = sorted(n for n in box_bytes if n)
    total, seen = sum(sizes), 0
    for n in sizes:
        seen += n
        if seen > total // 2:
            return chunk_for_median(n)
    return chunk_for_median(0)


def chunk_for_median(median: int) -> int:
    """v2's hash chunk for stored boxes of ``median`` bytes (0: none known, 1 MiB)."""
    big = hashing.DEFAULT_CHUNK_SIZE
    if not median:
        return big
    want = median // CHUNKS_PER_SHARD
    chunk = MIN_AUTO_CHUNK
    while chunk * 2 <= min(want, big):
        chunk *= 2
    return chunk
