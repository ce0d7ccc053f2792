"""Distributed save under torch.distributed: every rank writes its own file, rank 0 commits.

Protocol (every rank of the group calls ``save`` with its own state dict)::

    1) every rank flattens its state and describes what it holds (JSON): tensor boxes
       (DTensor placements are read off the DTensor), values, per-rank values, aliases
    2) the ranks agree on what they save, with one all-reduce of a fixed-size int64 vector
       (the same shape on every rank, whatever it holds): the step, a digest of the
       destination (``storage.url``), and the digests of the replicated values summed into
       buckets by name. A step or destination that differs across ranks: every rank raises
       before anything is staged. A replicated value that differs (only the lowest rank's
       copy is kept): rank 0 warns, or with ``check_replicas`` every rank raises
    3) all-gather of the descriptions, as bytes on a gloo control group (never pickle)
    4) every rank computes the same write plan: each distinct (tensor, box) is written
       exactly once, by one of its holders, largest boxes first, to the holder with the
       fewest bytes so far (ties: lowest rank)
    5) rank 0 checks the destination and stages the temp dir; broadcasts the outcome
    6) every rank streams its file into the staging dir; all-gather of the outcomes
    7) rank 0 builds the manifest and publishes (the commit protocol); broadcasts it
    8) every rank returns the manifest, or raises the same error naming the failed rank

Any failure at any step — on any rank — means nothing is committed and every rank raises.
Collectives run on a gloo group created with the caller's ``timeout``, so a dead or
frozen rank surfaces as an error within it rather than a hang.
"""

from __future__ import annotations

import datetime as _dt
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import orjson
import torch
import torch.distributed as dist
import xxhash

from shardfmt.errors import CheckpointExistsError, CommitError, ShardfmtError, StateDictError
from shardfmt.format import hashing, jsonvalue
from shardfmt.format.dtypes import dtype_code, torch_dtype
from shardfmt.format.manifest import (
    FileRecord,
    Placement,
    ShardRecord,
    Topology,
    ValueRecord,
    ViewRecord,
    check_step,
    parse_manifest,
    rank_file_name,
)
from shardfmt.format.tensor_bytes import byte_pieces, resolved
from shardfmt.io.registry import get_storage
from shardfmt.layout.dtensor import dtensor_layout, placement_record
from shardfmt.layout.geometry import Box
from shardfmt.layout.state import PerRank, ShardedTensor, _is_dtensor, flatten
from shardfmt.layout.topology import (
    Mesh,
    TopologyError,
    held_boxes,
)
from shardfmt.saving.sharing import check_saveable, plan_sharing
from shardfmt.saving.writer import (
    DEFAULT_PART_SIZE,
    CheckpointWriter,
    ShardData,
    WrittenFile,
    default_write_workers,
    new_save_id,
    write_shard_file,
)

DEFAULT_TIMEOUT = _dt.timedelta(minutes=10)
_GROUPS: dict[tuple, Any] = {}  # (process group, timeout) -> gloo control group; groups are costly


def in_distributed_job(process_group=None) -> bool:
    """Whether a save runs the distributed protocol: a group was given, or the default one has > 1 rank."""
    return process_group is not None or (dist.is_available() and dist.is_initialized()
                                         and dist.get_world_size() > 1)


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
    timeout = timeout or DEFAULT_TIMEOUT
    key = (id(pg), timeout.total_seconds(), dedicated)
    g = _GROUPS.get(key)
    if g is None:
        ranks = dist.get_process_group_ranks(pg) if process_group is not None else None
        g = dist.new_group(ranks=ranks, backend="gloo", timeout=timeout)
        _GROUPS[key] = g
    return g


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


# --------------------------------------------------------------------------- describing state


@dataclass(slots=True)
class _Held:
    fqn: str
    dtype: str
    shape: tuple[int, ...]
    placement: Placement | None
    pieces: list[tuple[Box, torch.Tensor]]  # global box -> local data view


def describe(state_dict: dict, rank: int) -> tuple[dict[str, _Held], dict, dict[str, Any]]:
    """Return what this rank holds: tensors (with local views), a JSON description, values
    (``IfSaved`` subtrees are no real state: they are left out)."""
    held: dict[str, _Held] = {}
    plain: dict[str, torch.Tensor] = {}
    values: dict[str, Any] = {}
    per_rank: dict[str, Any] = {}
    for leaf in flatten(state_dict):
        v = leaf.value
        if leaf.within is not None:
            continue  # IfSaved: made up to load into, never saved
        if _is_dtensor(v):
            try:
                layout, coords, sizes = dtensor_layout(v)
            except StateDictError as e:
                raise StateDictError(f"{leaf.fqn}: {e}") from None
            local = v.to_local().detach()
            check_saveable(leaf.fqn, local)
            pieces = []
            for hb in held_boxes(tuple(v.shape), layout, coords, sizes) if coords else []:
                sl = tuple(slice(o, o + n) for o, n in zip(hb.local_offsets, hb.box.lengths))
                pieces.append((hb.box, local[sl] if local.dim() else local))
            held[leaf.fqn] = _Held(leaf.fqn, dtype_code(local.dtype, what=leaf.fqn), tuple(v.shape),
                                   placement_record(layout), pieces)
        elif isinstance(v, ShardedTensor):
            check_saveable(leaf.fqn, v.local)
            held[leaf.fqn] = _Held(leaf.fqn, dtype_code(v.local.dtype, what=leaf.fqn), v.global_shape,
                                   placement_record(v.layout) if v.layout is not None else None,
                                   [(Box(v.offsets, tuple(v.local.shape)), v.local.detach())])
        elif isinstance(v, torch.Tensor):
            check_saveable(leaf.fqn, v)
            plain[leaf.fqn] = resolved(v)  # a lazy conj/neg is not its storage's bytes: shares nothing
        elif isinstance(v, PerRank):
            per_rank[leaf.fqn] = jsonvalue.encode(v.value, where=leaf.fqn)
        else:
            values[leaf.fqn] = jsonvalue.encode(v, where=leaf.fqn)
    stored, aliases, views, storages = plan_sharing(plain)
    for fqn, t in list(stored.items()) + list(storages.items()):
        held[fqn] = _Held(fqn, dtype_code(t.dtype, what=fqn), tuple(t.shape), None, [(Box.full(t.shape), t)])
    desc = {
        "rank": rank,
        "tensors": [
            {"fqn": h.fqn, "dtype": h.dtype, "shape": list(h.shape),
             "placement": h.placement.to_json() if h.placement else None,
             "storage": h.fqn in storages,
             "boxes": [[list(b.offsets), list(b.lengths)] for b, _ in h.pieces]}
            for h in held.values()
        ],
        "aliases": aliases,
        "views": {f: {"dtype": dtype_code(plain[f].dtype, what=f), "shape": list(plain[f].shape),
                      "view": vr.to_json()} for f, (_, vr) in views.items()},
        "values": values,
        "per_rank": per_rank,
    }
    return held, desc, values


# --------------------------------------------------------------------------- the write plan


def assign_writers(descs: list[dict]) -> dict[tuple[str, tuple, tuple], int]:
    """Choose, for every distinct (fqn, box), the rank that writes it (deterministic)."""
    holders: dict[tuple[str, tuple, tuple], list[int]] = {}
    nbytes: dict[tuple[str, tuple, tuple], int] = {}
    meta: dict[str, tuple[str, tuple]] = {}
    for d in descs:
        for t in d["tensors"]:
            sig = (t["dtype"], tuple(t["shape"]))
            if meta.setdefault(t["fqn"], sig) != sig:
                raise StateDictError(f"{t['fqn']}: ranks disagree on dtype/shape ({meta[t['fqn']]} vs {sig} "
                                     f"on rank {d['rank']})")
            isz = torch.empty(0, dtype=_torch_dtype(t["dtype"])).element_size()
            for offs, lens in t["boxes"]:
                key = (t["fqn"], tuple(offs), tuple(lens))
                holders.setdefault(key, []).append(d["rank"])
                nbytes[key] = isz * _prod(lens)
    load: dict[int, int] = {d["rank"]: 0 for d in descs}
    out = {}
    for key in sorted(holders, key=lambda k: (-nbytes[k], k)):
        r = min(holders[key], key=lambda x: (load[x], x))
        out[key] = r
        load[r] += nbytes[key]
    return out


def _prod(xs) -> int:
    n = 1
    for x in xs:
        n *= int(x)
    return n


def _torch_dtype(code: str) -> torch.dtype:
    return torch_dtype(code)


# --------------------------------------------------------------------------- agreeing on what is saved

AGREE_BUCKETS = 256  # replicated-value digests are summed into this many buckets (collisions widen the list)
_MOD = 1 << 62  # digests and their sums stay in [0, 2^62): negated, they still fit an int64


@dataclass(frozen=True, slots=True, kw_only=True)
class Agreement:
    """What the agreement all-reduce (step 2) tells every rank; identical on every rank.

    Each pair is the (lowest, highest) value the ranks put in that slot."""

    failed: bool  # a rank could not describe its state or step: the gather names it
    steps: tuple[int, int]  # -1 stands for None
    places: tuple[int, int]  # digests of the destinations the storages resolve
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


def agreement_vector(*, failed: bool, step: int | None, url: str, values: Mapping[str, Any]) -> torch.Tensor:
    """This rank's side of step 2 (pure): ``[failed, step, place, bucket sums...]`` followed by
    its negation, so that one MAX all-reduce yields every slot's highest and lowest value.

    ``values`` are the replicated values, already typed JSON; each adds the digest of its
    canonical ``[name, value]`` bytes to its bucket (mod 2^62)."""
    x = [0] * (3 + AGREE_BUCKETS)
    if failed:
        x[0] = 1
    else:
        x[1] = -1 if step is None else step
        x[2] = _digest62(url.encode())
        for fqn, v in values.items():
            i = 3 + value_bucket(fqn)
            x[i] = (x[i] + _digest62(orjson.dumps([fqn, v], option=orjson.OPT_SORT_KEYS))) % _MOD
    t = torch.tensor(x, dtype=torch.int64)
    return torch.cat([t, -t])


def agree(vector: torch.Tensor, group) -> Agreement:
    """All-reduce the ranks' agreement vectors (one collective of a fixed size)."""
    dist.all_reduce(vector, op=dist.ReduceOp.MAX, group=group)
    return Agreement.from_reduced(vector)


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
        problems.append("ranks save to different locations")
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


# --------------------------------------------------------------------------- save


def _err_payload(rank: int, e: BaseException) -> dict:
    return {"ok": False, "rank": rank, "type": type(e).__name__, "error": str(e)}


def _raise_from(payloads: list[dict], what: str) -> None:
    bad = [p for p in payloads if not p.get("ok", True)]
    if not bad:
        return
    first = bad[0]
    msg = "; ".join(f"rank {p['rank']}: {p['type']}: {p['error']}" for p in bad[:4])
    if len(bad) > 4:
        msg += f"; and {len(bad) - 4} more ranks"
    cls = CheckpointExistsError if first["type"] == "CheckpointExistsError" else CommitError
    if first["type"] in ("StateDictError", "EncodingError", "DTypeError", "ShapeError"):
        cls = StateDictError
    raise cls(f"{what} failed, nothing was committed: {msg}")


def _collective(fn, what: str, rank: int):
    try:
        return fn()
    except ShardfmtError:
        raise
    except Exception as e:  # gloo raises RuntimeError/DistBackendError on a dead or frozen peer
        raise CommitError(f"rank {rank}: {what} failed (a rank died, froze or timed out): {e}") from None


def save_distributed(
    state_dict: dict,
    path: str,
    *,
    process_group=None,
    timeout: _dt.timedelta | None = None,
    check_replicas: bool = False,
    **kwargs,
):
    """Save under an initialized process group; see the module docstring for the protocol."""
    group = control_group(process_group, timeout)
    prepared = prepare(state_dict, dist.get_rank(group))
    return run_save(prepared, path, group=group, check_replicas=check_replicas, **kwargs)


@dataclass(slots=True)
class Prepared:
    """What a rank holds, described and ready to write: no collective, no I/O has run yet.

    ``held`` maps fqn -> the rank's pieces (global box, local tensor view); ``desc`` is the
    JSON description the ranks exchange (values already encoded, so they are a snapshot),
    or an error payload when describing failed (reported to every rank by ``run_save``).
    """

    rank: int
    held: dict[str, _Held]
    desc: dict
    error: ShardfmtError | None = None
    ready: dict[tuple[str, Box], Callable[[], None]] | None = None  # (fqn, box) -> wait for that piece's data

    def tensors(self) -> list[torch.Tensor]:
        return [data for h in self.held.values() for _, data in h.pieces]

    def with_tensors(self, tensors: list[torch.Tensor],
                     ready: list[Callable[[], None]] | None = None) -> Prepared:
        """The same description over other tensors (a snapshot), in ``tensors()`` order;
        ``ready[i]``, when given, blocks until ``tensors[i]`` holds its data."""
        it = iter(tensors)
        held = {f: _Held(h.fqn, h.dtype, h.shape, h.placement, [(box, next(it)) for box, _ in h.pieces])
                for f, h in self.held.items()}
        gates = None
        if ready is not None:
            keys = [(h.fqn, box) for h in self.held.values() for box, _ in h.pieces]
            gates = dict(zip(keys, ready))
        return Prepared(self.rank, held, self.desc, ready=gates)

    def wait_ready(self) -> None:
        for gate in (self.ready or {}).values():
            gate()


def prepare(state_dict: dict, rank: int) -> Prepared:
    """Describe ``state_dict`` on the caller's thread (step 1 of the protocol)."""
    try:
        held, desc, _ = describe(state_dict, rank)
        return Prepared(rank, held, {"ok": True, **desc})
    except ShardfmtError as e:
        return Prepared(rank, {}, _err_payload(rank, e), e)


def _rank_world(group) -> tuple[int, int]:
    return (0, 1) if group is None else (dist.get_rank(group), dist.get_world_size(group))


def _gather(data: bytes, group) -> list[bytes]:
    return [data] if group is None else all_gather_bytes(data, group)


def _bcast(data: bytes | None, group) -> bytes:
    return data if group is None else broadcast_bytes(data, 0, group)


def run_save(
    prepared: Prepared,
    path: str,
    *,
    group,
    step: int | None = None,
    metadata: Any = None,
    overwrite: bool = False,
    storage_options: dict | None = None,
    chunk_size: int = hashing.DEFAULT_CHUNK_SIZE,
    sync: bool = True,
    mesh: Mapping[str, int] | None = None,
    check_replicas: bool = False,
    storage=None,
    write_workers: int | None = None,
    part_size: int = DEFAULT_PART_SIZE,
    _save_id: str | None = None,
    _clock=None,
    _writer_versions: Mapping[str, str] | None = None,
    _on_step=None,
    _snapshot: Callable[[], Prepared] | None = None,
):
    """Steps 2-8 of the protocol on ``group`` (None: a world of one, no collectives).

    ``_snapshot`` (async saves) returns the tensors to write, as ``prepared`` over other
    tensors; it is called only once the plan is agreed and the checkpoint staged, so that
    work needs no data and overlaps the copy. A failure it raises fails the save on every rank.
    """
    rank, world = _rank_world(group)
    topo = _topology(mesh, world) if group is not None or mesh else Topology(world_size=1)
    if storage is None:
        storage, path = get_storage(path, storage_options)

    payload = prepared.desc
    try:
        check_step(step)  # before any data moves
    except StateDictError as e:
        if group is None:
            raise
        if payload.get("ok"):
            payload = _err_payload(rank, e)

    # 2) agree on the step, the destination and the replicated values (before anything is staged)
    if group is not None:
        url = storage.url(path)
        values = payload.get("values", {})
        vector = agreement_vector(failed=not payload.get("ok"), step=step, url=url, values=values)
        agreement = _collective(lambda: agree(vector, group), "agreeing on the step and path", rank)
        check_agreement(agreement, rank=rank, step=step, url=url, values=values, check_replicas=check_replicas)

    # 3) gather the descriptions
    if check_replicas and _snapshot is not None and payload.get("ok"):  # the digests need the data
        try:
            prepared, _snapshot = _snapshot(), None
            prepared.wait_ready()
        except ShardfmtError as e:  # told to every rank by the gather below
            payload = _err_payload(rank, e)
    if check_replicas and payload.get("ok"):
        payload = {**payload, "replica_digests": {
            f"{h.fqn} {list(box.offsets)}+{list(box.lengths)}": _digest_tensor(data)
            for h in prepared.held.values() for box, data in h.pieces}}
    blobs = _collective(lambda: _gather(orjson.dumps(payload), group), "gathering save plans", rank)
    descs = [orjson.loads(b) for b in blobs]
    _raise_from(descs, "describing the state")
    if check_replicas:
        _check_replicas(descs)

    # 4) the write plan, identical on every rank
    writers = assign_writers(descs)
    storage_names = {t["fqn"] for d in descs for t in d["tensors"] if t.get("storage")}

    # 5) rank 0 stages
    writer = None
    if rank == 0:
        try:
            writer = CheckpointWriter(path, storage=storage, overwrite=overwrite, save_id=_save_id or new_save_id(),
                                      clock=_clock, writer_versions=_writer_versions, chunk_size=chunk_size,
                                      sync=sync, on_step=_on_step, write_workers=write_workers,
                                      part_size=part_size)
            status = {"ok": True, "rank": 0, "save_id": writer.save_id, "staging": writer.staging,
                      "name_tag": writer.name_tag}  # every rank names its file as rank 0's writer does
        except ShardfmtError as e:
            if group is None:  # a world of one: the error itself, not a report of it
                raise
            status = _err_payload(0, e)
        blob = orjson.dumps(status)
    else:
        blob = None
    status = orjson.loads(_collective(lambda: _bcast(blob, group), "staging", rank))
    _raise_from([status], "staging the checkpoint")

    # 6) every rank writes its file
    try:
        if _snapshot is not None:
            prepared = _snapshot()
        gates = prepared.ready or {}
        mine = [ShardData(fqn=h.fqn, data=data, global_shape=h.shape, offsets=box.offsets, placement=h.placement,
                          ready=gates.get((h.fqn, box)))
                for h in prepared.held.values() for box, data in h.pieces
                if writers[(h.fqn, box.offsets, box.lengths)] == rank]
        if mine and rank != 0:
            written = write_shard_file(storage, status["staging"], rank_file_name(rank, None, status["name_tag"]), rank,
                                       _ordered(mine), chunk_size=chunk_size, sync=sync,
                                       workers=write_workers or default_write_workers(), part_size=part_size)
            result = {"ok": True, "rank": rank, "file": _written_json(written)}
        elif mine:
            written = writer.write_rank(0, [s for s in mine if s.fqn not in storage_names],
                                        storages=[s for s in mine if s.fqn in storage_names])
            result = {"ok": True, "rank": 0, "file": None}
        else:
            result = {"ok": True, "rank": rank, "file": None}
        # A snapshot counts only whole: pieces other ranks write must have been copied here too.
        prepared.wait_ready()
    except (ShardfmtError, OSError) as e:
        if group is None:
            writer.abort()
            raise
        result = _err_payload(rank, e)
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    try:
        results = [orjson.loads(b) for b in _gather(orjson.dumps(result), group)]
    except Exception as e:  # noqa: BLE001
        if writer is not None:
            writer.abort()
        raise CommitError(f"rank {rank}: gathering write results failed (a rank died, froze or timed out): "
                          f"{e}; nothing was committed") from None
    if any(not r["ok"] for r in results):
        if writer is not None:
            writer.abort()
        _raise_from(results, "writing shard files")

    # 7) rank 0 commits
    if rank == 0:
        try:
            meta = {t["fqn"]: (t["dtype"], tuple(t["shape"]), _placement_from_json(t["placement"]))
                    for d in descs for t in d["tensors"]}
            for r in results:
                if r["file"] is not None:
                    writer.add_file(_written_from_json(r["file"]), meta, frozenset(storage_names))
            _add_records(writer, descs)
            manifest = writer.commit(step=step, metadata=metadata, topology=topo)
            if group is None:
                return manifest
            outcome = {"ok": True, "rank": 0, "manifest": manifest.to_json().decode()}
        except BaseException as e:  # noqa: BLE001 - reported to every rank, then re-raised here
            writer.abort()
            if group is None:
                raise
            outcome = _err_payload(0, e)
        blob = orjson.dumps(outcome)
    else:
        blob = None
    outcome = orjson.loads(_collective(lambda: _bcast(blob, group), "committing", rank))
    _raise_from([outcome], "committing")

    return parse_manifest(outcome["manifest"].encode())


def _digest_tensor(t: torch.Tensor) -> str:
    import xxhash

    h = xxhash.xxh3_128()
    for piece in byte_pieces(t):
        h.update(piece)
    return hashing.format_digest(h.digest())


def _check_replicas(descs: list[dict]) -> None:
    """Replicated tensor pieces must hold the same bytes on every rank (values: step 2)."""
    ref: dict[str, tuple[int, str]] = {}
    for d in descs:
        for fqn, digest in d.get("replica_digests", {}).items():
            if fqn in ref and ref[fqn][1] != digest:
                raise StateDictError(f"{fqn}: replicated data differs between rank {ref[fqn][0]} and "
                                     f"rank {d['rank']} (check_replicas=True)")
            ref.setdefault(fqn, (d["rank"], digest))


def _ordered(shards: list[ShardData]) -> list[ShardData]:
    return sorted(shards, key=lambda s: (-s.data.element_size(), s.fqn, s.offsets))


def _written_json(w: WrittenFile) -> dict:
    return {"name": w.name, "record": w.record.to_json(), "shards": [[f, s.to_json()] for f, s in w.shards]}


def _written_from_json(o: dict) -> WrittenFile:
    r = o["record"]
    rec = FileRecord(rank=r["rank"], size=r["size"], header_size=r["header_size"],
                     header_digest=r["header_digest"], chunks=tuple(r["chunks"]), digest=r["digest"])
    shards = tuple((f, ShardRecord(offsets=tuple(s["offsets"]), lengths=tuple(s["lengths"]), file=s["file"],
                                   key=s["key"], byte_range=tuple(s["byte_range"]), digest=s["digest"]))
                   for f, s in o["shards"])
    return WrittenFile(name=o["name"], record=rec, shards=shards)


def _placement_from_json(p) -> Placement | None:
    if p is None:
        return None
    return Placement(mesh_dims=tuple(p["mesh_dims"]), placements=tuple(tuple(x) for x in p["placements"]),
                     stage=p["stage"])


def _add_records(writer: CheckpointWriter, descs: list[dict]) -> None:
    aliases: dict[str, str] = {}
    views: dict[str, dict] = {}
    values: dict[str, Any] = {}
    per_rank: dict[str, dict[int, Any]] = {}
    for d in descs:  # ranks in order: the lowest rank's copy of a replicated value wins
        for f, t in d["aliases"].items():
            if aliases.setdefault(f, t) != t:
                raise StateDictError(f"{f}: ranks disagree on what it aliases")
        for f, v in d["views"].items():
            views.setdefault(f, v)
        for f, v in d["values"].items():
            values.setdefault(f, v)
        for f, v in d["per_rank"].items():
            per_rank.setdefault(f, {})[d["rank"]] = v
    for f, t in aliases.items():
        writer.add_alias(f, t)
    for f, v in views.items():
        vr = v["view"]
        writer.add_view(f, v["dtype"], tuple(v["shape"]),
                        ViewRecord(base=vr["base"], storage_offset=vr["storage_offset"], stride=tuple(vr["stride"])))

    for f, v in values.items():
        writer.add_encoded_value(f, ValueRecord(value=v))
    for f, m in per_rank.items():
        writer.add_encoded_value(f, ValueRecord(per_rank=m))


def _topology(mesh: Mapping[str, int] | None, world: int) -> Topology:
    if mesh:
        try:
            pairs = Mesh.parse(mesh).dims
        except TopologyError as e:
            raise StateDictError(f"mesh=: {e}") from None
        if _prod(s for _, s in pairs) != world:
            raise StateDictError(f"mesh {dict(pairs)} does not multiply to the world size {world}")
        return Topology(world_size=world, mesh=pairs)
    return Topology(world_size=world, mesh=(("world", world),))

