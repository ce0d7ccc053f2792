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
        for t in targets:
            if t.src.fqn not in wanted or t.first_copy is False:
                continue
            acc = self._sums.setdefault(t.src.fqn, [0.0] * (NSTATS + 1))
            if t.first_copy is None:
                acc[NSTATS] = -math.inf  # a slice whose copies this rank cannot tell apart: unchecked
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


__all__ = ["Tally"]
