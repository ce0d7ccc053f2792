"""Who a save talks to: one interface, a local world of one and a process group.

``run_save`` runs the same steps on every rank and in one process; only the coordinator
differs. ``LocalCoordinator`` has no collectives: a gather returns this rank's own message
and a failure is raised as the exception itself. ``GroupCoordinator`` runs the collectives
on a gloo control group created with the caller's timeout, so a dead or frozen rank
surfaces as a ``CommitError`` within it rather than a hang; messages go as JSON bytes
(never pickle) and come back through their typed decoders.

Control groups are costly to create and creating one is a collective: ``ControlGroups``
keeps them for the life of the default process group they were made under (a new
``init_process_group`` starts a fresh set), keyed by the ranks they span.
"""

from __future__ import annotations

import datetime as _dt
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import orjson
import torch
import torch.distributed as dist

from shardfmt.errors import CheckpointExistsError, CommitError, ShardfmtError, StateDictError
from shardfmt.format.manifest import Topology
from shardfmt.saving.messages import RankError, envelope, open_envelope
from shardfmt.saving.options import DEFAULT_TIMEOUT

Decoder = Callable[..., Any]  # decode(body, rank=...) -> message


class Coordinator(Protocol):
    """The collectives of a save; every rank calls them in the same order.

    ``gather`` gives every rank every rank's message (or ``RankError``), in rank order;
    ``gather_to_root`` gives them to rank 0 only (the others get None: what they send is all
    they pay); ``broadcast`` gives every rank rank 0's; ``all_reduce_max`` reduces an int64
    vector; ``all_gather_ints`` gives every rank every rank's row of ints (a fixed width);
    ``raise_failures`` raises on every rank when any message is a ``RankError``.
    """

    rank: int
    world: int

    def default_topology(self) -> Topology: ...
    def gather(self, msg: Any, decode: Decoder, what: str) -> list[Any]: ...
    def gather_to_root(self, msg: Any, decode: Decoder, what: str) -> list[Any] | None: ...
    def all_gather_ints(self, row: Sequence[int], what: str) -> list[tuple[int, ...]]: ...
    def broadcast(self, msg: Any | None, decode: Decoder, what: str) -> Any: ...
    def all_reduce_max(self, vector: torch.Tensor, what: str) -> torch.Tensor: ...
    def raise_failures(self, msgs: Sequence[Any], what: str) -> None: ...


class LocalCoordinator:
    """A world of one, no collectives: messages stay objects, a failure is its own exception."""

    rank = 0
    world = 1

    def default_topology(self) -> Topology:
        return Topology(world_size=1)

    def gather(self, msg: Any, decode: Decoder, what: str) -> list[Any]:
        return [msg]

    def gather_to_root(self, msg: Any, decode: Decoder, what: str) -> list[Any] | None:
        return [msg]

    def all_gather_ints(self, row: Sequence[int], what: str) -> list[tuple[int, ...]]:
        return [tuple(row)]

    def broadcast(self, msg: Any | None, decode: Decoder, what: str) -> Any:
        return msg

    def all_reduce_max(self, vector: torch.Tensor, what: str) -> torch.Tensor:
        return vector

    def raise_failures(self, msgs: Sequence[Any], what: str) -> None:
        for m in msgs:
            if isinstance(m, RankError):
                raise m.error if m.error is not None else CommitError(f"{what} failed: {m.message}")


class GroupCoordinator:
    """The ranks of a gloo control group (see ``control_group``)."""

    def __init__(self, group) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)

    def default_topology(self) -> Topology:
        return Topology(world_size=self.world, mesh=(("world", self.world),))

    def gather(self, msg: Any, decode: Decoder, what: str) -> list[Any]:
        blobs = self._run(lambda: all_gather_bytes(orjson.dumps(envelope(self.rank, msg)), self.group), what)
        return [open_envelope(orjson.loads(b), decode) for b in blobs]

    def gather_to_root(self, msg: Any, decode: Decoder, what: str) -> list[Any] | None:
        blobs = self._run(lambda: gather_bytes_to_root(orjson.dumps(envelope(self.rank, msg)), self.group), what)
        return None if blobs is None else [_decoded(b, decode, r) for r, b in enumerate(blobs)]

    def all_gather_ints(self, row: Sequence[int], what: str) -> list[tuple[int, ...]]:
        mine = torch.tensor(list(row), dtype=torch.int64)
        rows = [torch.zeros_like(mine) for _ in range(self.world)]
        self._run(lambda: dist.all_gather(rows, mine, group=self.group), what)
        return [tuple(r.tolist()) for r in rows]

    def broadcast(self, msg: Any | None, decode: Decoder, what: str) -> Any:
        blob = orjson.dumps(envelope(0, msg)) if self.rank == 0 else None
        got = self._run(lambda: broadcast_bytes(blob, 0, self.group), what)
        return open_envelope(orjson.loads(got), decode)

    def all_reduce_max(self, vector: torch.Tensor, what: str) -> torch.Tensor:
        self._run(lambda: dist.all_reduce(vector, op=dist.ReduceOp.MAX, group=self.group), what)
        return vector

    def raise_failures(self, msgs: Sequence[Any], what: str) -> None:
        bad = [m for m in msgs if isinstance(m, RankError)]
        if not bad:
            return
        msg = "; ".join(f"rank {b.rank}: {b.kind}: {b.message}" for b in bad[:4])
        if len(bad) > 4:
            msg += f"; and {len(bad) - 4} more ranks"
        cls = CheckpointExistsError if bad[0].kind == "CheckpointExistsError" else CommitError
        if bad[0].kind in ("StateDictError", "EncodingError", "DTypeError", "ShapeError"):
            cls = StateDictError
        raise cls(f"{what} failed, nothing was committed: {msg}")

    def _run(self, fn: Callable[[], Any], what: str) -> Any:
        try:
            return fn()
        except ShardfmtError:
            raise
        except Exception as e:  # gloo raises RuntimeError/DistBackendError on a dead or frozen peer
            raise CommitError(f"rank {self.rank}: {what} failed (a rank died, froze or timed out): {e}; "
                              "nothing was committed") from None


def _decoded(blob: bytes, decode: Decoder, rank: int) -> Any:
    """Rank ``rank``'s message, or its failure: a message rank 0 alone cannot read fails the
    save on every rank through rank 0 (raising here would leave the others waiting)."""
    try:
        return open_envelope(orjson.loads(blob), decode)
    except Exception as e:  # noqa: BLE001 - whatever a rank sent, the others must hear of it
        return RankError(rank=rank, kind=type(e).__name__, message=f"rank {rank}'s message cannot be read: {e}")


# --------------------------------------------------------------------------- process groups


def in_distributed_job(process_group=None) -> bool:
    """Whether a save runs on a process group: one was given, or the default one has > 1 rank."""
    return process_group is not None or (dist.is_available() and dist.is_initialized()
                                         and dist.get_world_size() > 1)


class ControlGroups:
    """The gloo control groups made under one default process group (its lifetime is theirs)."""

    def __init__(self) -> None:
        self._world = None  # the default process group these groups were made under
        self._groups: dict[tuple, Any] = {}

    def get(self, process_group, timeout: _dt.timedelta, *, dedicated: bool):
        world = dist.group.WORLD
        if world is not self._world:  # a new init_process_group: the old groups are gone
            self._world, self._groups = world, {}
        pg = process_group or world
        ranks = tuple(dist.get_process_group_ranks(pg))
        key = (ranks, timeout.total_seconds(), dedicated)
        g = self._groups.get(key)
        if g is None:
            g = self._groups[key] = dist.new_group(ranks=list(ranks) if process_group is not None else None,
                                                   backend="gloo", timeout=timeout)
        return g


CONTROL_GROUPS = ControlGroups()


def control_group(process_group=None, timeout: _dt.timedelta | None = None, *, dedicated: bool = False):
    """Return a gloo group over ``process_group``'s ranks with ``timeout`` (created once).

    Without ``timeout`` a gloo ``process_group`` is used as it is (its own timeout applies).
    ``dedicated=True`` always returns a group of its own, used by nothing else (background
    saves run their collectives there, never interleaved with the caller's); creating it is a
    collective, so every rank asks for it at the same point.
    """
    pg = process_group or dist.group.WORLD
    if timeout is None and not dedicated and dist.get_backend(pg) == "gloo":
        # Reuse the caller's gloo group: creating groups under a restarted torchrun job can
        # meet store keys left by the previous attempt (a new group's keys are not per attempt).
        return pg
    return CONTROL_GROUPS.get(process_group, timeout or DEFAULT_TIMEOUT, dedicated=dedicated)


def coordinator_for(process_group=None, timeout: _dt.timedelta | None = None, *,
                    dedicated: bool = False) -> Coordinator:
    """The coordinator of a save: the process group's (see ``in_distributed_job``), else local."""
    if not in_distributed_job(process_group):
        return LocalCoordinator()
    return GroupCoordinator(control_group(process_group, timeout, dedicated=dedicated))


def all_gather_bytes(data: bytes, group) -> list[bytes]:
    """All-gather one byte string per rank (sizes first, then padded payloads)."""
    n = dist.get_world_size(group)
    size = torch.tensor([len(data)], dtype=torch.int64)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(n)]
    dist.all_gather(sizes, size, group=group)
    longest = max(int(s.item()) for s in sizes)
    buf = torch.zeros(max(longest, 1), dtype=torch.uint8)
    if data:
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    outs = [torch.zeros(max(longest, 1), dtype=torch.uint8) for _ in range(n)]
    dist.all_gather(outs, buf, group=group)
    return [bytes(o[: int(s.item())].numpy().tobytes()) for o, s in zip(outs, sizes)]


def gather_bytes_to_root(data: bytes, group) -> list[bytes] | None:
    """Gather one byte string per rank on group rank 0 (None elsewhere): the sizes by one
    gather, then each payload point to point at its own size (no rank pays for the longest)."""
    me, n = dist.get_rank(group), dist.get_world_size(group)
    size = torch.tensor([len(data)], dtype=torch.int64)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(n)] if me == 0 else None
    dist.gather(size, gather_list=sizes, group_dst=0, group=group)
    if me != 0:
        if data:
            dist.send(torch.frombuffer(bytearray(data), dtype=torch.uint8), group_dst=0, group=group)
        return None
    out = [data]
    for r in range(1, n):
        buf = torch.empty(int(sizes[r].item()), dtype=torch.uint8)
        if buf.numel():
            dist.recv(buf, group_src=r, group=group)
        out.append(bytes(buf.numpy().tobytes()))
    return out


def broadcast_bytes(data: bytes | None, src: int, group) -> bytes:
    """Broadcast a byte string from group rank ``src``."""
    me = dist.get_rank(group)
    size = torch.tensor([len(data) if me == src else 0], dtype=torch.int64)
    dist.broadcast(size, group_src=src, group=group)
    buf = torch.zeros(max(int(size.item()), 1), dtype=torch.uint8)
    if me == src and data:
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    dist.broadcast(buf, group_src=src, group=group)
    return bytes(buf[: int(size.item())].numpy().tobytes())
