"""Step 2 of a save: the ranks agree on what they save, before anything is staged.

One all-reduce of a fixed-size int64 vector (the same shape on every rank, whatever it
holds): the step, a digest of the destination (``storage.url``), and the digests of the
replicated values summed into buckets by name. A step or destination that differs across
ranks: every rank raises. A replicated value that differs (only the lowest rank's copy is
kept): rank 0 warns, or with ``check_replicas`` every rank raises. Pure apart from
``agree``, which runs the one collective.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson
import torch
import xxhash

from shardfmt.errors import StateDictError
from shardfmt.saving.coordinator import Coordinator

AGREE_BUCKETS = 256  # replicated-value digests are summed into this many buckets (collisions widen the list)
_MOD = 1 << 62  # digests and their sums stay in [0, 2^62): negated, they still fit an int64


@dataclass(frozen=True, slots=True, kw_only=True)
class Agreement:
    """What the agreement all-reduce (step 2) tells every rank; identical on every rank.

    Each pair is the (lowest, highest) value the ranks put in that slot."""

    failed: bool  # a rank could not describe its state or step: the gather names it
    steps: tuple[int, int]  # -1 stands for None
    places: tuple[int, int]  # digests of the destinations the storages resolve, with the mesh
    differing: frozenset[int]  # buckets whose replicated values differ across ranks

    @classmethod
    def from_reduced(cls, vector: torch.Tensor) -> Agreement:
        """Read the MAX-reduced ``agreement_vector``s: highest values first, then negated lowest."""
        n = vector.numel() // 2
        hi, lo = vector[:n].tolist(), [-v for v in vector[n:].tolist()]
        return cls(failed=hi[0] > 0, steps=(lo[1], hi[1]), places=(lo[2], hi[2]),
                   differing=frozenset(b for b in range(AGREE_BUCKETS) if lo[3 + b] != hi[3 + b]))


def _digest62(data: bytes) -> int:
    return xxhash.xxh3_64_intdigest(data) % _MOD


def value_bucket(fqn: str) -> int:
    """The bucket of a replicated value: by name only, so it is the same bucket on every rank."""
    return xxhash.xxh3_64_intdigest(fqn.encode()) % AGREE_BUCKETS


def agreement_vector(*, failed: bool, step: int | None, url: str, values: Mapping[str, Any],
                     mesh: str = "") -> torch.Tensor:
    """This rank's side of step 2 (pure): ``[failed, step, place, bucket sums...]`` followed by
    its negation, so that one MAX all-reduce yields every slot's highest and lowest value.

    ``values`` are the replicated values, already typed JSON; each adds the digest of its
    canonical ``[name, value]`` bytes to its bucket (mod 2^62)."""
    x = [0] * (3 + AGREE_BUCKETS)
    if failed:
        x[0] = 1
    else:
        x[1] = -1 if step is None else step
        # the destination (a path of any bytes; refused later) and the mesh the ranks lay out on
        x[2] = _digest62(url.encode("utf-8", "surrogateescape") + b"\0" + mesh.encode())
        for fqn, v in values.items():
            i = 3 + value_bucket(fqn)
            x[i] = (x[i] + _digest62(orjson.dumps([fqn, v], option=orjson.OPT_SORT_KEYS))) % _MOD
    t = torch.tensor(x, dtype=torch.int64)
    return torch.cat([t, -t])


def agree(vector: torch.Tensor, coord: Coordinator) -> Agreement:
    """All-reduce the ranks' agreement vectors (one collective of a fixed size)."""
    return Agreement.from_reduced(coord.all_reduce_max(vector, "agreeing on the step and path"))


def check_agreement(a: Agreement, *, rank: int, step: int | None, url: str, values: Mapping[str, Any],
                    check_replicas: bool) -> None:
    """Raise on every rank when the ranks save different steps or to different places; warn
    on rank 0 (raise everywhere with ``check_replicas``) when replicated values differ."""
    if a.failed:
        return  # a rank's own error is told to every rank by the gather that follows
    problems = []
    if a.steps[0] != a.steps[1]:
        lo, hi = (None if s < 0 else s for s in a.steps)
        problems.append(f"ranks save different steps (lowest {lo}, highest {hi})")
    if a.places[0] != a.places[1]:
        problems.append("ranks save to different locations or with different meshes (mesh=)")
    if problems:
        raise StateDictError(f"this rank saves step {step} to {url}, but {' and '.join(problems)}: every rank "
                             "must save the same step to the same path; nothing was committed")
    if not a.differing:
        return
    named: dict[int, list[str]] = {}  # differing bucket -> this rank's values in it
    for f in values:
        if (b := value_bucket(f)) in a.differing:
            named.setdefault(b, []).append(f)
    parts = [", ".join(sorted(f for fs in named.values() for f in fs))] if named else []
    if len(named) < len(a.differing):
        parts.append(f"a value that rank {rank} does not hold")
    what = f"replicated values differ across ranks: {'; and '.join(parts)}"
    if any(len(fs) > 1 for fs in named.values()):
        what += " (a name may be listed only for sharing a digest bucket with one that differs)"
    if check_replicas:
        raise StateDictError(f"{url}: {what} (check_replicas=True; wrap per-rank values in "
                             "shardfmt.PerRank); nothing was committed")
    if rank == 0:
        warnings.warn(f"{url}: {what}; only the lowest rank's copy of each is saved, and every rank loads "
                      "that copy back. Wrap per-rank state (a data loader's position, ...) in shardfmt.PerRank",
                      stacklevel=2)
