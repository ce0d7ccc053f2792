"""The statistics of the values a load puts in its targets, summed in the read pass.

A checkpoint records per-tensor sums that add up over boxes (``format.stats``); a restore
compares them with the same sums over what it loaded, to catch a load that puts intact bytes in
the wrong place or the wrong form (a wrong cast, a wrong target: every digest passes). The
executor hands each copy to ``Tally.filled`` as soon as its bytes are in the target — on the
worker thread that read them, while the reads of the other workers wait on the storage, and
for a bounced read while its destination is still in cache — so the check costs no pass of its
own over the state. The sums are taken on the target's memory, after any cast, on its device.

A rank sums only the elements it answers for (``ReadTarget.first_copy``), so that the ranks'
sums add up to each tensor once (``training.sanity`` all-reduces them); a tensor some target of
which cannot tell (None) gets a count of -inf, which marks it unchecked on every rank.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterable, Sequence

import torch

from shardfmt.format.stats import NSTATS, box_stats, run_stats
from shardfmt.loading.planner import CopyItem
from shardfmt.loading.targets import ReadTarget


class Tally:
    """Per-tensor (sum, sumsq, rows, count) of the values this rank answers for, as filled.

    ``names``: the tensors the checkpoint holds statistics for (the others are not summed)."""

    def __init__(self, targets: Sequence[ReadTarget], names: Iterable[str]) -> None:
        wanted = frozenset(names)
        self._sums: dict[str, list[float]] = {}
        self._counted: set[int] = set()
        seen: set[tuple] = set()  # (fqn, box): the same slice under two names (tied weights) counts once
        for t in targets:
            if t.src.fqn not in wanted or t.first_copy is False:
                continue
            slice_ = (t.src.fqn, t.src.box.offsets, t.src.box.lengths)
            if slice_ in seen:
                continue
            seen.add(slice_)
            acc = self._sums.setdefault(t.src.fqn, [0.0] * (NSTATS + 1))
            if t.first_copy is None or not _exact_cast(t.src_dtype, t.dst.dtype):
                # a slice whose copies this rank cannot tell apart, or values a cast rounds: unchecked
                acc[NSTATS] = -math.inf
            else:
                self._counted.add(t.index)
        self._lock = threading.Lock()

    def counts(self, target: int) -> bool:
        """Whether the copies into ``target`` are summed."""
        return target in self._counted

    def filled(self, target: ReadTarget, item: CopyItem, dst: torch.Tensor) -> None:
        """``dst`` (``item``'s part of ``target``, shaped like its box) holds its values now."""
        self._add(target.src.fqn, lambda: box_stats(dst, self._offsets(target, item)), item.numel)

    def landed(self, target: ReadTarget, item: CopyItem, run: torch.Tensor, start: int) -> None:
        """``run`` (1-D: ``item``'s elements ``start, start + 1, ...`` in row-major order) holds
        its values now: a direct read's piece, added while it is in cache."""
        self._add(target.src.fqn, lambda: run_stats(run, start, item.src_lengths, self._offsets(target, item)),
                  run.numel())

    @staticmethod
    def _offsets(target: ReadTarget, item: CopyItem) -> tuple[int, ...]:
        return tuple(a + b for a, b in zip(target.src.box.offsets, item.dst_offsets))

    def _add(self, fqn: str, stats: Callable[[], tuple[float, float, float]], n: int) -> None:
        try:
            got = stats()
        except Exception:  # noqa: BLE001 - a check, never a reason a load fails: the tensor goes unchecked
            got, n = (0.0,) * NSTATS, -math.inf
        with self._lock:
            acc = self._sums[fqn]
            for k, v in enumerate(got):
                acc[k] += v
            acc[NSTATS] += n

    def result(self) -> dict[str, tuple[float, ...]]:
        """fqn -> (sum, sumsq, rows, elements summed), this rank's part."""
        with self._lock:
            return {f: tuple(v) for f, v in sorted(self._sums.items())}


def _exact_cast(src: torch.dtype, dst: torch.dtype) -> bool:
    """Whether every value of ``src`` is one of ``dst`` (a widening cast or none: the loaded
    values' sums are the saved ones')."""
    if src == dst:
        return True
    if src.is_floating_point and dst.is_floating_point:
        a, b = torch.finfo(src), torch.finfo(dst)
        return b.bits >= a.bits and b.eps <= a.eps and b.max >= a.max and b.tiny <= a.tiny
    if src in _INTS and dst in _INTS:
        a, b = torch.iinfo(src), torch.iinfo(dst)
        return b.min <= a.min and b.max >= a.max
    return False


_INTS = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)

__all__ = ["Tally"]
