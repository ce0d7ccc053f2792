"""``save`` and ``load``: state dicts to checkpoints and back, in one process.

save: flatten -> group tensors that share storage (tied weights become ``alias_of``,
distinct views of one buffer become views of one stored 1-D ``storages`` entry named
``.storage.<first view's FQN>`` — the leading dot keeps it apart from every user FQN) -> one data file
-> manifest -> commit. load: flatten the caller's dict -> one target per tensor leaf
(a plain tensor wants the whole tensor, a ShardedTensor its slice) -> plan -> execute
(verified reads straight into the caller's tensors) -> only then replace non-tensor
leaves, so a failed load never leaves half-applied non-tensor state.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from shardfmt.errors import ShardfmtError
from shardfmt.format.manifest import Manifest
from shardfmt.format.stats import EXTENSION as STATS_EXTENSION
from shardfmt.format.stats import from_extension_value
from shardfmt.io.modes import Choice
from shardfmt.io.registry import get_storage
from shardfmt.io.store import Storage
from shardfmt.loading.executor import Executor
from shardfmt.loading.options import LoadOptions
from shardfmt.loading.pagecache import release
from shardfmt.loading.phases import PhaseClock
from shardfmt.loading.reader import check_headers, open_checkpoint
from shardfmt.loading.request import finish, rank_and_world, request_load
from shardfmt.loading.resolve import resolve, with_rank_values
from shardfmt.loading.shared import agree
from shardfmt.loading.tally import Tally
from shardfmt.loading.targets import allocate_view_buffers, copy_views, plan_reads
from shardfmt.saving.coordinator import control_group, coordinator_for, in_distributed_job
from shardfmt.saving.describe import prepare
from shardfmt.saving.options import SaveOptions
from shardfmt.saving.protocol import run_save


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadReport:
    """What a load did: what was missing, what was left unread, and what it cost."""

    loaded: tuple[str, ...]
    missing: tuple[str, ...]
    unexpected: tuple[str, ...]
    bytes_read: int
    read_requests: int
    bytes_needed: int
    stats: Mapping[str, int] = field(default_factory=dict)
    metadata_bytes_read: int = 0  # headers (v2: and the rank table and rank indexes) read to find the data
    metadata_reads: int = 0
    # with LoadOptions.value_stats: fqn -> (sum, sumsq, rows, elements) of the values this rank answers for
    value_stats: Mapping[str, tuple[float, ...]] = field(default_factory=dict)
    # seconds: "open" (the manifest, this rank's index, the headers), "plan" (the state sorted, the
    # reads planned and agreed), "read" (the reads, each chunk hashed as it lands, the values set)
    phases: Mapping[str, float] = field(default_factory=dict)
    # (file, start, end): bytes read through the page cache that other ranks of the node may read
    # too, left cached (the rest is dropped as read); ``release_cached(source, cached)`` drops them
    cached: tuple[tuple[str, int, int], ...] = ()
    source: str = ""  # the checkpoint read (the path given, or the committed copy a crashed replace left)
    # how the large reads of files read (nearly) whole went, direct or buffered, and why (``loading.trial``)
    read_mode: Choice | None = None


# ----------------------------------------------------------------------------- save


def save(
    state_dict: dict,
    path: str,
    *,
    step: int | None = None,
    metadata: Any = None,
    overwrite: bool | None = None,
    storage_options: dict | None = None,
    chunk_size: int | None = None,
    sync: bool | None = None,
    process_group=None,
    timeout=None,
    mesh: Mapping[str, int] | None = None,
    check_replicas: bool | None = None,
    write_workers: int | None = None,
    part_size: int | None = None,
    format_version: int | None = None,
    base: str | None = None,
    options: SaveOptions | None = None,
) -> Manifest:
    """Save ``state_dict`` as a committed checkpoint at ``path`` (a directory or fsspec URL).

    ``path`` is used exactly as given. An existing committed checkpoint there is replaced
    only with ``overwrite=True``, atomically. Returns the manifest that was committed.

    Under an initialized process group (world size > 1, or ``process_group`` given) every
    rank calls ``save`` with its own state: DTensors, ShardedTensors, replicated plain
    tensors and values, ``PerRank`` values. Every rank writes its own file in parallel,
    replicated data is written once, and rank 0 commits after every rank succeeded
    (see ``shardfmt.saving.protocol``). ``mesh`` (e.g. ``{"pp": 2, "dp": 2, "tp": 2}``) names
    the job's layout in the manifest; ``timeout`` bounds every collective. Every rank must
    save the same ``step`` to the same place (else every rank raises StateDictError before
    anything is staged). A replicated value that differs across ranks is saved as the lowest
    rank's copy with a warning on rank 0 (wrap per-rank state in ``PerRank``);
    ``check_replicas`` makes that an error, and verifies that replicated tensors agree too.
    ``write_workers`` threads (default: this rank's share of the cores, at most 4) write and
    hash ``part_size`` parts of a file in parallel. ``format_version=1`` writes what readers
    released before format 2 read (default 2: spec/FORMAT.md). ``base``: an earlier committed
    checkpoint in the same directory as ``path``; only shards whose bytes differ from it are
    written, the others are referenced (an incremental checkpoint: it needs its base to load,
    spec/FORMAT.md section 4.10; the Checkpointer's ``incremental=True`` manages the chain).
    Each knob left None takes its
    value from ``options`` (a ``SaveOptions``, which owns the defaults).

    Returns the committed manifest: in format 2 its root, which lists no file and no shard
    (``read_manifest`` reads a checkpoint's whole manifest).
    """
    opts = SaveOptions.merged(options, overwrite=overwrite, storage_options=storage_options, chunk_size=chunk_size,
                              sync=sync, timeout=timeout, mesh=mesh, check_replicas=check_replicas,
                              write_workers=write_workers, part_size=part_size,
                              format_version=format_version, base=base)
    coord = coordinator_for(process_group, opts.timeout)
    return run_save(prepare(state_dict, coord.rank), path, coord=coord, options=opts, step=step, metadata=metadata)


# ----------------------------------------------------------------------------- load


def _share_group(opts: LoadOptions, process_group):
    """The gloo group a load agrees its shared reads on (``loading.shared``), or None."""
    return control_group(process_group) if opts.share_reads and in_distributed_job(process_group) else None


def release_cached(path: str, cached: Sequence[tuple[str, int, int]], *, storage_options: dict | None = None) -> None:
    """Drop from the page cache the bytes a load of the checkpoint at ``path`` left there
    (``LoadReport.cached``: bytes other ranks of the node may read too; ``path``: the report's
    ``source``). Call it once every rank of the node has loaded (``Checkpointer.restore`` does);
    advisory, never raises for a file it cannot open."""
    storage, where = get_storage(path, storage_options)
    release(storage, where, cached)


def skip_load(path: str, *, process_group=None, storage_options: dict | None = None,
              share_reads: bool | None = None, options: LoadOptions | None = None, storage: Storage | None = None) -> None:
    """Stand in for ``load(..., path, ...)`` on a rank that gives it up (it failed before) while
    the other ranks of its process group call it: a load that shares reads is a collective,
    and this joins it as a failed rank, so no rank waits (they all read alone)."""
    opts = LoadOptions.merged(options, share_reads=share_reads)
    storage = storage if storage is not None else get_storage(path, storage_options)[0]
    group = _share_group(opts.for_storage(storage), process_group)
    if group is not None:
        agree(None, None, group)


def load(
    state_dict: dict,
    path: str,
    *,
    rank: int | None = None,
    process_group=None,
    storage_options: dict | None = None,
    strict: bool | None = None,
    verify: bool | None = None,
    cast: bool | None = None,
    per_rank: str | None = None,
    max_gap: int | None = None,
    max_read: int | None = None,
    workers: int | None = None,
    share_reads: bool | None = None,
    options: LoadOptions | None = None,
    storage: Storage | None = None,
) -> LoadReport:
    """Fill ``state_dict`` in place from the checkpoint at ``path``.

    Tensors (plain, or ShardedTensor slices) are filled in place, keeping their device;
    non-tensor leaves are replaced with the stored values. ``strict`` raises if a key the
    caller holds is not in the checkpoint; otherwise it is reported in ``missing``. A key the
    checkpoint holds in another shape (entries under it, or one value above it: a fresh
    optimizer's ``state_dict()`` against a stepped one's) raises ``StateDictError`` either way.
    ``IfSaved`` subtrees (``shardfmt.get_state_dict``) get the leaves the checkpoint holds and
    lose the others, which are never missing (see ``shardfmt.layout.state``).

    Works on any topology: every rank (under torch.distributed, or ``rank=`` given) plans
    its own reads from its own targets — DTensors (any mesh and placements), ShardedTensor
    slices, or plain full tensors — and reads only the bytes it needs. ``PerRank`` values
    come back to their own rank; on a different world size ``per_rank="error"`` (default)
    raises, ``"skip"`` leaves the caller's values as they are.

    ``verify`` checks every chunk read against its hash; ``cast`` converts dtypes; ``max_gap``,
    ``max_read`` and ``workers`` shape the reads. ``share_reads``: ranks that read the same
    bytes (data-parallel replicas) read them once and broadcast them (default: on object
    stores); the load is then a collective: every rank of the process group calls it. Each
    knob left None takes its value from ``options`` (a ``LoadOptions``, which owns the defaults).
    ``storage`` (instead of ``storage_options``): the ``Storage`` to read ``path`` through (the
    Checkpointer's node-local tier reads a node part so: ``io.nodepart``).
    """
    opts = LoadOptions.merged(options, strict=strict, verify=verify, cast=cast, per_rank=per_rank,
                              max_gap=max_gap, max_read=max_read, workers=workers, share_reads=share_reads)
    storage, where = (storage, path) if storage is not None else get_storage(path, storage_options)
    opts = opts.for_storage(storage)
    group = _share_group(opts, process_group)
    clock = PhaseClock()
    try:
        with clock("open"):
            ckpt = open_checkpoint(where, storage=storage, whole=False)
            m = ckpt.manifest
            rank, world_size = rank_and_world(rank, process_group, m, ckpt.path)
            opened = storage.stats.snapshot()
            m = with_rank_values(storage, ckpt.path, m, rank)
        with clock("plan"):
            request = request_load(state_dict, m, opts, rank=rank, world_size=world_size, source=ckpt.path)
        with clock("open"):
            m = resolve(storage, ckpt.path, m, [t.src for t in request.targets], verify=opts.verify)  # v2: what it reads
        with clock("plan"):
            plan = plan_reads(m, request.targets, opts, remote=storage.remote)
        with clock("open"):
            targets = allocate_view_buffers(storage, ckpt.path, m, plan, request.targets)
            if opts.verify and m.format_version == 1:  # v2: resolve checked the headers it read
                check_headers(storage, ckpt.path, m, plan.shards)
    except BaseException:
        if group is not None:  # the other ranks are in the agreement: join it, failed, so none waits
            agree(None, None, group)
        raise
    with clock("plan"):
        share = agree(plan, m.save_id, group) if group is not None else None
    before = storage.stats.snapshot()
    saved_stats = m.extensions.get(STATS_EXTENSION) if opts.value_stats else None
    tally = Tally(targets, from_extension_value(saved_stats.value)) if saved_stats is not None else None
    try:
        with clock("read"):
            executor = Executor(storage, ckpt.path, targets, opts, tally=tally)
            if share is not None:
                executor.run_shared(plan, share)
            else:
                executor.run(plan)
    except ShardfmtError as e:
        err = type(e)(f"{e} (the load stopped: the tensors being loaded may hold part of the "
                      "checkpoint's data and must not be used)")
        err.partial_load = True  # the targets were written to (Checkpointer.restore must not start fresh)
        raise err from None
    with clock("read"):
        copy_views(targets)
        loaded = finish(request)
    after = storage.stats.snapshot()
    requested = set(loaded)
    return LoadReport(
        loaded=loaded, missing=request.missing,
        unexpected=tuple(sorted(k for k in [*m.tensors, *m.values] if k not in requested)),
        bytes_read=after["bytes_read"] - before["bytes_read"],
        read_requests=after["read_requests"] - before["read_requests"],
        bytes_needed=plan.needed_bytes, stats=after,
        metadata_bytes_read=before["bytes_read"] - opened["bytes_read"],
        metadata_reads=before["read_requests"] - opened["read_requests"],
        value_stats=tally.result() if tally is not None else {},
        phases=dict(clock.seconds),
        read_mode=executor.trial.outcome,
        cached=tuple(sorted(executor.cached)),
        source=storage.url(ckpt.path),
    )
