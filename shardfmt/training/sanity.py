"""After a restore: the loaded values against the statistics saved with them (issue 20, item 6).

A save records, per tensor, sums that add up over its boxes (``saving.stats``). Once every rank
has loaded its part, each rank sums the statistics of the elements it alone is responsible for
(a DTensor's local boxes on the first replica of every replicated mesh dimension; a plain tensor,
which every rank loads whole, on rank 0), the ranks add them up (one all-reduce of four numbers
a tensor), and a tensor covered exactly once whose sums differ beyond the stated tolerance
fails the restore on every rank: a wrong cast or a wrong target the digests cannot see. Tensors
loaded as ``ShardedTensor`` or ``FlatShard`` targets (whose replicas the ranks cannot tell
apart alone) and aliases or views are not checked. It costs one pass over the loaded tensors,
in float32 (about 14 ms per 256 MiB on one core here), after the reads.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from shardfmt.format.manifest import Manifest
from shardfmt.layout.geometry import Box
from shardfmt.layout.state import _is_dtensor, flatten
from shardfmt.saving.describe import dtensor_pieces
from shardfmt.saving.stats import EXTENSION, NSTATS, add, box_stats, close, from_extension_value
from shardfmt.training.ranks import Ranks


def _first_replica(v) -> bool:
    """Whether this rank holds the first replica of a DTensor (coordinate 0 on every dim it is replicated on)."""
    from torch.distributed.tensor import Replicate, Shard

    coords = v.device_mesh.get_coordinate()
    if coords is None:
        return False
    for c, p in zip(coords, v.placements):
        if isinstance(p, Shard):
            continue
        if not isinstance(p, Replicate):  # Partial: the local values are not the tensor's
            return False
        if c != 0:
            return False
    return True


def _pieces(v, rank: int) -> list[tuple[Box, torch.Tensor]] | None:
    if _is_dtensor(v):
        return dtensor_pieces(v)[1] if _first_replica(v) else []
    if isinstance(v, torch.Tensor):
        return [(Box.full(tuple(v.shape)), v)] if rank == 0 else []
    return None  # not a tensor this check can place


def _local(sd: Mapping[str, Any], index: Mapping[str, int], rank: int, local: dict, counts: list) -> None:
    jobs: list[tuple[str, Box, torch.Tensor]] = []
    for leaf in flatten(dict(sd)):
        i = index.get(leaf.fqn)
        if i is None:
            continue
        pieces = _pieces(leaf.value, rank)
        if pieces is None:
            counts[i] = float("-inf")  # unplaceable here: the tensor is not checked
            continue
        for box, data in pieces:
            jobs.append((leaf.fqn, box, data))
            counts[i] += data.numel()
    # the cores this process has, a box each: torch lets go of the GIL in the sums
    with ThreadPoolExecutor(max_workers=max(1, min(len(jobs), os.cpu_count() or 1, 8))) as pool:
        for (fqn, _, _), got in zip(jobs, pool.map(lambda j: box_stats(j[2], j[1].offsets), jobs)):
            add(local, fqn, got)


def mismatches(sd: Mapping[str, Any], manifest: Manifest, ranks: Ranks) -> list[str]:
    """The tensors of ``sd`` (loaded from ``manifest``'s checkpoint) whose loaded values do not
    match the saved statistics, each with the numbers; the same list on every rank."""
    ext = manifest.extensions.get(EXTENSION)
    saved = from_extension_value(ext.value) if ext is not None else {}
    if not saved:
        return []
    names = sorted(saved)
    index = {n: i for i, n in enumerate(names)}
    local: dict[str, list[float]] = {}
    counts = [0.0] * len(names)
    try:
        _local(sd, index, ranks.rank(), local, counts)
    except Exception:  # noqa: BLE001 - a check must not leave this rank out of the all-reduce: check nothing
        local, counts = {}, [float("-inf")] * len(names)
    vec = torch.zeros(len(names) * (NSTATS + 1), dtype=torch.float64)
    for n, vals in local.items():
        vec[index[n] * (NSTATS + 1):index[n] * (NSTATS + 1) + NSTATS] = torch.tensor(vals, dtype=torch.float64)
    for i, c in enumerate(counts):
        vec[i * (NSTATS + 1) + NSTATS] = c
    total = ranks.all_reduce_sum(vec).tolist()
    bad = []
    for n, i in index.items():
        rec = manifest.tensors.get(n)
        numel = 1
        for d in (rec.shape if rec is not None else ()):
            numel *= d
        got = total[i * (NSTATS + 1):i * (NSTATS + 1) + NSTATS]
        if rec is None or total[i * (NSTATS + 1) + NSTATS] != numel:
            continue  # not loaded, or not covered exactly once
        if not close(saved[n], got, numel):
            bad.append(f"{n}: saved (sum, sum of squares, row-weighted sum) {tuple(round(x, 6) for x in saved[n])}, "
                       f"loaded {tuple(round(x, 6) for x in got)}")
    return bad


__all__ = ["mismatches"]
