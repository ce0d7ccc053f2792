"""Replicated bytes read once per job: ranks whose loads read the same byte ranges share them.

When data-parallel replicas load the same tensors from an object store, each would GET the
same bytes: the store serves them N times. Instead, after planning, every rank contributes a
16-byte key of its reads (the checkpoint's save id, each read's file and byte range, whether
it verifies) to one all-gather over the load's process group. Ranks with equal keys form a
*read group* (members sorted by rank); in a group of two or more, each read gets one owner
(``owners``: largest reads first, to the member with the fewest bytes so far, ties to the
lowest), the owner reads and verifies it as usual, and broadcasts the bytes to the group;
every member copies them into its own targets. A rank whose key matches no other rank's reads
on its own, as before. Cost: one all-gather of 3 integers per rank (O(N) bytes), and one gloo
process group per read group, created by its members once and kept for later loads.

Failures never leave a member waiting: a rank that fails before the all-gather still joins it
(``Share.fail``), and then no rank shares; an owner whose read fails broadcasts a failed flag
and its error's text, and every member of the group raises at that read.
"""

from __future__ import annotations

import datetime as _dt
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from shardfmt import errors
from shardfmt.errors import ShardfmtError
from shardfmt.format.hashing import xxh3_raw
from shardfmt.loading.planner import LoadPlan

ERROR_TEXT = 1024  # bytes of an owner's error message sent to its group


def reads_key(plan: LoadPlan, save_id: str) -> bytes:
    """16 bytes that equal another rank's exactly when it reads the same byte ranges."""
    lines = [f"{save_id} {int(plan.verify)}"]
    lines += [f"{r.file} {r.byte_range.start} {r.byte_range.end}" for r in plan.reads]
    return xxh3_raw("\n".join(lines).encode())


def read_groups(keys: Sequence[bytes | None]) -> list[tuple[int, ...]]:
    """Ranks (indexes into ``keys``) with equal keys, in groups of two or more, sorted by their
    first rank; ``None`` (a rank that does not share) is in none. Pure."""
    by_key: dict[bytes, list[int]] = {}
    for rank, key in enumerate(keys):
        if key is not None:
            by_key.setdefault(key, []).append(rank)
    return sorted(tuple(g) for g in by_key.values() if len(g) > 1)


def owners(lengths: Sequence[int], members: int) -> tuple[int, ...]:
    """The member (an index) that reads each read of ``lengths`` bytes: largest first, to the
    member with the fewest bytes so far (ties to the lowest index). Pure and deterministic."""
    load = [0] * members
    out = [0] * len(lengths)
    for k in sorted(range(len(lengths)), key=lambda k: (-lengths[k], k)):
        m = min(range(members), key=lambda i: (load[i], i))
        out[k] = m
        load[m] += lengths[k]
    return tuple(out)


@dataclass(frozen=True, slots=True, kw_only=True)
class Share:
    """This rank's part in a read group: ``group`` (a torch.distributed group of ``members``,
    global ranks, sorted), its index ``me`` among them, and each plan read's owner index."""

    group: object
    members: tuple[int, ...]
    me: int
    owners: tuple[int, ...]

    def broadcast(self, buf: torch.Tensor, owner: int) -> None:
        torch.distributed.broadcast(buf, src=self.members[owner], group=self.group)

    def send_error(self, owner: int, error: BaseException | None) -> ShardfmtError:
        """After a failed flag: the owner's error text to every member; the error to raise here."""
        text = torch.zeros(ERROR_TEXT, dtype=torch.uint8)
        if error is not None:
            raw = f"{type(error).__name__}\0{error}".encode()[:ERROR_TEXT]
            text[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        self.broadcast(text, owner)
        if error is not None:
            return error if isinstance(error, ShardfmtError) else errors.StorageError(str(error))
        name, _, message = bytes(text.numpy()).rstrip(b"\0").decode(errors="replace").partition("\0")
        kind = getattr(errors, name, None)
        kind = kind if isinstance(kind, type) and issubclass(kind, ShardfmtError) else errors.StorageError
        return kind(f"rank {self.members[owner]} read these bytes for its read group and failed: {message}")


class _Groups:
    """The gloo groups of read groups, created once under a default process group and kept for
    later loads. Only a group's members create it (``use_local_synchronization``): a load on a
    sub-group of the job never waits for ranks outside it."""

    def __init__(self) -> None:
        self._world = None
        self._made: dict[tuple[int, ...], object] = {}

    def get(self, members: tuple[int, ...], timeout: _dt.timedelta | None):
        world = torch.distributed.group.WORLD
        if world is not self._world:  # a new init_process_group: the old groups are gone
            self._world, self._made = world, {}
        group = self._made.get(members)
        if group is None:
            kwargs = {} if timeout is None else {"timeout": timeout}
            group = self._made[members] = torch.distributed.new_group(
                list(members), backend="gloo", use_local_synchronization=True, **kwargs)
        return group


GROUPS = _Groups()


def agree(plan: LoadPlan | None, save_id: str | None, group, *,
          timeout: _dt.timedelta | None = None) -> Share | None:
    """Every rank of ``group`` (a gloo group over the load's ranks) calls this once per load,
    with its plan (``None``: this rank failed before planning). Returns this rank's ``Share``,
    or None when it reads alone (its reads match no other rank's, or some rank failed)."""
    dist = torch.distributed
    ranks = dist.get_process_group_ranks(group)
    mine = torch.zeros(3, dtype=torch.int64)
    if plan is not None and save_id is not None:
        mine[0] = 1
        mine[1:] = torch.frombuffer(bytearray(reads_key(plan, save_id)), dtype=torch.int64)
    rows = [torch.zeros(3, dtype=torch.int64) for _ in ranks]
    dist.all_gather(rows, mine, group=group)
    if plan is None or any(int(r[0]) == 0 for r in rows):  # a rank failed: nobody waits on it
        return None
    me = dist.get_rank(group)
    for g in read_groups([r[1:].numpy().tobytes() for r in rows]):
        if me in g:
            members = tuple(ranks[i] for i in g)
            return Share(group=GROUPS.get(members, timeout), members=members, me=g.index(me),
                         owners=owners([r.byte_range.length for r in plan.reads], len(g)))
    return None


__all__ = ["Share", "agree", "owners", "read_groups", "reads_key"]
