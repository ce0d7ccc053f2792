"""After a restore: the loaded values against the statistics saved with them (issue 20, item 6).

A save records, per tensor, sums that add up over its boxes (``format.stats``). The load sums
the same statistics of what it puts in the tensors, in its read pass (``loading.tally``): each
rank over the elements it alone answers for (a DTensor's local boxes on the first replica of
every replicated mesh dimension; a plain tensor, which every rank loads whole, on rank 0). Once
every rank has loaded its part the ranks add them up (one all-reduce of four numbers a tensor),
and a tensor covered exactly once whose sums differ beyond the stated tolerance
(``format.stats.close``) fails the restore on every rank: a wrong cast or a wrong target the
digests cannot see. Tensors loaded as ``ShardedTensor`` or ``FlatShard`` targets (whose
replicas the ranks cannot tell apart alone), aliases, views and tensors the state does not
hold are not checked.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from shardfmt.format.manifest import Manifest
from shardfmt.format.stats import EXTENSION, NSTATS, close, from_extension_value
from shardfmt.training.ranks import Ranks


@dataclass(frozen=True, slots=True, kw_only=True)
class ValueCheck:
    """What ``check_values`` found: ``bad``, a line per tensor whose loaded values do not match
    its saved statistics; ``checked``, the tensors compared; ``unchecked``, those with saved
    statistics that were not (not loaded, or not covered exactly once by the ranks' sums)."""

    bad: tuple[str, ...] = ()
    checked: tuple[str, ...] = ()
    unchecked: tuple[str, ...] = ()


def check_values(loaded: Mapping[str, tuple[float, ...]], manifest: Manifest, ranks: Ranks) -> ValueCheck:
    """Compare the loaded values' statistics (this rank's part: ``LoadReport.value_stats``) with
    those ``manifest``'s checkpoint saved; the same answer on every rank. Every rank calls it
    (an all-reduce)."""
    ext = manifest.extensions.get(EXTENSION)
    saved = from_extension_value(ext.value) if ext is not None else {}
    if not saved:
        return ValueCheck()
    names = sorted(saved)
    width = NSTATS + 1
    vec = torch.zeros(len(names) * width, dtype=torch.float64)
    for i, n in enumerate(names):
        got = loaded.get(n)
        if got is not None and len(got) == width:
            vec[i * width:(i + 1) * width] = torch.tensor(got, dtype=torch.float64)
    total = ranks.all_reduce_sum(vec).tolist()
    bad, checked, unchecked = [], [], []
    for i, n in enumerate(names):
        rec = manifest.tensors.get(n) or manifest.storages.get(n)  # a view's buffer is summed as its storage
        got, count = total[i * width:i * width + NSTATS], total[i * width + NSTATS]
        if rec is None or count != _numel(rec.shape):
            unchecked.append(n)  # not loaded, or not covered exactly once
            continue
        checked.append(n)
        if not close(saved[n], got, count):
            bad.append(f"{n}: saved (sum, sum of squares, row-weighted sum) {tuple(round(x, 6) for x in saved[n])}, "
                       f"loaded {tuple(round(x, 6) for x in got)}")
    return ValueCheck(bad=tuple(bad), checked=tuple(checked), unchecked=tuple(unchecked))


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


__all__ = ["ValueCheck", "check_values"]
