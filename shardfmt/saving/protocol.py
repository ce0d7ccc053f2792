"""The save protocol: the same steps on every rank of a process group and in one process.

Every rank calls ``save`` with its own state dict; only the ``Coordinator`` differs (a
world of one has no collectives)::

    1) every rank flattens its state and describes what it holds (``describe``): tensor
       boxes (DTensor placements are read off the DTensor), values, per-rank values, aliases
    2) the ranks agree on the step, the destination and the replicated values with one
       all-reduce of a fixed-size vector (``agreement``), before anything is staged
    3) v1: every rank gathers every rank's ``RankState`` (typed records, never pickle);
       v2: every rank claims the tensors its placements derive (``claims``), the ranks
       all-gather a 16-byte digest of their claims, and rank 0 alone receives each distinct
       claim list once and every rank's listed boxes (``Summary``)
    4) v1: every rank computes the same write plan (``plan.assign_writers``); v2: rank 0
       makes it (``placing.plan_groups``) and broadcasts it (``WritePlan``), each rank derives
       its part (``placing.rank_writes``). Each distinct (tensor, box) is written exactly once
    5) rank 0 checks the destination and stages the checkpoint (``CheckpointWriter.stage``);
       broadcasts ``Staged``
    6) every rank streams its file into the staging dir (``shard_file``), v2 then its rank
       index; gather of ``Written`` (v2: to rank 0, which tells every rank of a failure)
    7) rank 0 records every file, builds the manifest and publishes it (the commit protocol);
       broadcasts ``Committed``
    8) every rank returns the manifest, or raises the same error naming the failed rank

Any failure at any step, on any rank, means nothing is committed and every rank raises (in
one process: the error itself). A dead or frozen rank surfaces within the coordinator's
timeout rather than as a hang.
"""

from __future__ import annotations

import dataclasses
import logging
import posixpath
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import xxhash

from shardfmt.errors import ShardfmtError, StateDictError
from shardfmt.format import hashing
from shardfmt.format.index import IndexedFile
from shardfmt.format.manifest import (
    ListedShard,
    Manifest,
    TensorRecord,
    Topology,
    ValueRecord,
    rank_file_name,
)
from shardfmt.format.parse import check_step
from shardfmt.format.refs import Chain
from shardfmt.format.stats import add, box_stats
from shardfmt.format.tensor_bytes import byte_pieces
from shardfmt.io.registry import get_storage
from shardfmt.layout.topology import Mesh, TopologyError
from shardfmt.saving.agreement import (
    Agreement,
    agree,
    agreement_vector,
    check_agreement,
    value_bucket,
)
from shardfmt.saving.base import Digests, base_name, read_root, try_read_base
from shardfmt.saving.claims import Group, claims_digest, first_of_groups, split_claims
from shardfmt.saving.coordinator import Coordinator
from shardfmt.saving.describe import Prepared
from shardfmt.saving.messages import (
    Claim,
    Committed,
    Failures,
    HeldTensor,
    RankError,
    RankState,
    Staged,
    Summary,
    WriteKey,
    WritePlan,
    Written,
    WrittenFile,
)
from shardfmt.saving.nodes import abort_node, commit_nodes, stage_nodes, tables_of
from shardfmt.saving.options import SaveOptions
from shardfmt.saving.placing import PlacedPlan, plan_groups, rank_writes
from shardfmt.saving.plan import WriteItem, assign_writers, auto_chunk_size, my_items
from shardfmt.saving.rank_index import write_rank_index
from shardfmt.saving.shard_file import (
    ShardData,
    default_write_workers,
    file_order,
    write_shard_file,
)
from shardfmt.saving.writer import CheckpointWriter

Snapshot = Callable[[], Prepared]
log = logging.getLogger("shardfmt")
# One thread computes every save's statistics (``_Run._stats_of``): one for the process, so its
# allocations reuse one malloc arena instead of a new thread's each save.
_STATS_POOL = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardfmt-stats")
# (record name, offsets, shard digest) -> statistics of the boxes this process's last save wrote or
# took: a box with the same digest holds the same bytes, so an incremental save takes its statistics too.
_BOX_STATS: dict[tuple, tuple[float, float, float]] = {}


def run_save(prepared: Prepared, path: str, *, coord: Coordinator, options: SaveOptions,
             step: int | None = None, metadata: Any = None, storage=None,
             snapshot: Snapshot | None = None) -> Manifest:
    """Steps 2-8 of the protocol for this rank's ``prepared`` state (step 1).

    ``snapshot`` (async saves) returns the tensors to write, as ``prepared`` over other
    tensors; it is called only once the plan is agreed and the checkpoint staged, so that
    work needs no data and overlaps the copy. A failure it raises fails the save on every rank.
    """
    topology = _topology(options.mesh, coord)
    if storage is None:
        storage, path = get_storage(path, options.storage_options)
    run = _Run(prepared=prepared, snapshot=snapshot, coord=coord, options=options, storage=storage, path=path,
               topology=topology, base=None if options.base is None else get_storage(options.base, options.storage_options)[1])
    state = run.agree(step)
    if options.format_version >= 2:
        return _save_v2(run, state, topology, step=step, metadata=metadata)
    states = [_without_flat(s) for s in run.gather(state)]
    writers = assign_writers(states)
    if options.chunk_size is None:
        run.options = dataclasses.replace(options, chunk_size=auto_chunk_size((), format_version=1))
    writer = run.stage()
    try:
        written = run.write(states[coord.rank], writers, Written.decoder(_records(states)), coord.gather)
        return run.commit(writer, lambda: _commit(writer, states, [w.file for w in written if w.file is not None],
                                                  step=step, metadata=metadata, topology=topology))
    except BaseException:
        if writer is not None:
            writer.abort()
        raise


def _save_v2(run: _Run, state: RankState | RankError, topology: Topology, *, step: int | None,
             metadata: Any) -> Manifest:
    """Format v2 at any N: no rank but 0 receives another rank's description, and rank 0
    receives each distinct claim list once (``claims``); every rank derives what it writes
    from the plan rank 0 broadcasts, whose size follows the tensors, not the ranks."""
    coord = run.coord
    summaries = coord.gather_to_root(run.summarize(state, topology), Summary.from_json, "gathering save plans")
    full, msg = None, None
    if coord.rank == 0:
        full, msg = plan_at_root(summaries, run.groups, topology, world=coord.world,
                                 check_replicas=run.options.check_replicas)
        msg = run.with_base_chunk(msg)
    plan = coord.broadcast(msg, WritePlan.from_json, "planning the save")
    coord.raise_failures(plan.failures, "describing the state")
    if run.options.chunk_size is None:  # the same on every rank: rank 0 picked it
        run.options = dataclasses.replace(run.options, chunk_size=plan.chunk_size)
    writer = run.stage()
    try:
        mine = rank_writes(plan.placed, plan.listed, state, topology)
        written = run.write(state, mine, Written.decoder({}), coord.gather_to_root)
        return run.commit(writer, lambda: commit_v2(writer, full, summaries, written, step=step, metadata=metadata,
                                                     topology=topology))
    except BaseException:
        if writer is not None:
            writer.abort()
        run.abort_node()
        raise


def summary_of(state: RankState, claims: tuple[Claim, ...], listed: tuple[HeldTensor, ...], *,
               groups: Mapping[int, tuple[int, ...]], differing: frozenset[int]) -> Summary:
    """What ``state.rank`` sends rank 0 (pure): its claims if it is the first of its group,
    its listed tensors, and, past rank 0, only the values in buckets the ranks disagree on."""
    rank = state.rank
    values = state.values if rank == 0 else {f: v for f, v in state.values.items() if value_bucket(f) in differing}
    return Summary(rank=rank, claims=claims if rank in groups else None, listed=listed, aliases=state.aliases,
                   views=state.views, values=values, per_rank=tuple(state.per_rank),
                   replica_digests=state.replica_digests)


def plan_at_root(summaries: Sequence[Summary | RankError], groups: Mapping[int, tuple[int, ...]],
                 topology: Topology, *, world: int, check_replicas: bool) -> tuple[PlacedPlan | None, WritePlan]:
    """Rank 0 (pure): the plan of every rank's summary, or the failures that stop the save."""
    failures = tuple(s for s in summaries if isinstance(s, RankError))
    if failures:
        return None, WritePlan(failures=failures)
    try:
        if check_replicas:
            _check_replicas(summaries)
        claimed = [Group(ranks=groups[s.rank], claims=s.claims) for s in summaries if s.claims is not None]
        listed = [(s.rank, t) for s in summaries for t in s.listed]
        plan = plan_groups(claimed, listed, topology, world=world)
    except Exception as e:  # noqa: BLE001 - any failure here must reach every rank, not leave them waiting
        return None, WritePlan(failures=(RankError.of(0, e),))
    return plan, WritePlan(placed=plan.placed, listed=plan.listed, chunk_size=plan.chunk_size)


@dataclasses.dataclass(slots=True, kw_only=True)
class _Run:
    """One rank's side of one save: the steps, in call order."""

    prepared: Prepared
    snapshot: Snapshot | None
    coord: Coordinator
    options: SaveOptions
    storage: Any
    path: str
    topology: Topology
    staged: Staged | None = None
    agreement: Agreement | None = None
    groups: dict[int, tuple[int, ...]] = dataclasses.field(default_factory=dict)  # v2: first rank -> its group
    base: str | None = None  # an incremental save's base (``saving.base``), as the storage resolves it
    base_root: Manifest | None = None  # rank 0: the base's root manifest, read once
    node_lease: Any = None  # the node-local tier: another node's leader's heartbeat on its staging dir

    def agree(self, step: int | None) -> RankState | RankError:
        """2) Agree on the step, the destination and the replicated values; return this rank's message."""
        state, rank = self.prepared.state, self.coord.rank
        try:
            check_step(step)  # before any data moves
            if self.base is not None:
                base_name(self.path, self.base)
        except StateDictError as e:
            if not isinstance(state, RankError):
                state = RankError.of(rank, e)
        part = self.options.node_part  # on the node-local tier each node's path is its own disk's
        url = self.storage.url(self.path) if part is None else f"{part.tier} {posixpath.basename(self.path)}"
        values = state.values if isinstance(state, RankState) else {}
        vector = agreement_vector(failed=isinstance(state, RankError), step=step, url=url, values=values,
                                  mesh=repr(self.topology.mesh))
        self.agreement = agree(vector, self.coord)
        check_agreement(self.agreement, rank=rank, step=step, url=url, values=values,
                        check_replicas=self.options.check_replicas)
        return state

    def gather(self, state: RankState | RankError) -> list[RankState]:
        """3) Gather every rank's description (with replica digests under ``check_replicas``)."""
        if self.options.check_replicas and isinstance(state, RankState):
            state = self._with_replica_digests(state)
        states = self.coord.gather(state, RankState.from_json, "gathering save plans")
        self.coord.raise_failures(states, "describing the state")
        if self.options.check_replicas:
            _check_replicas(states)
        return states

    def summarize(self, state: RankState | RankError, topology: Topology) -> Summary | RankError:
        """v2's 3): claim what this rank can, learn the groups (one all-gather of 16 bytes a rank);
        the first rank of each group sends its claims, every rank its listed tensors."""
        claims, listed = split_claims(state, topology) if isinstance(state, RankState) else ((), ())
        digests = self.coord.all_gather_ints(claims_digest(claims), "grouping the ranks by what they hold")
        self.groups = first_of_groups(digests)
        if isinstance(state, RankError):
            return state
        if self.options.check_replicas:
            state = self._with_replica_digests(state)
            if isinstance(state, RankError):
                return state
        return summary_of(state, claims, listed, groups=self.groups, differing=self.agreement.differing)

    def _with_replica_digests(self, state: RankState) -> RankState | RankError:
        if self.snapshot is not None:  # the digests need the data
            try:
                self.prepared, self.snapshot = self.snapshot(), None
                self.prepared.wait_ready()
            except ShardfmtError as e:  # told to every rank by the gather
                return RankError.of(self.coord.rank, e)
        digests = {f"{fqn} {list(box.offsets)}+{list(box.lengths)}": _digest_tensor(data)
                   for fqn, ps in self.prepared.pieces.items() for box, data in ps}
        return dataclasses.replace(state, replica_digests=digests)

    def with_base_chunk(self, plan: WritePlan) -> WritePlan:
        """Rank 0, an incremental save: the base's hash chunk, unless the caller chose one (``saving.base``)."""
        if self.base is None or self.options.chunk_size is not None or plan.failures:
            return plan
        try:
            self.base_root = read_root(self.storage, self.base)
            return dataclasses.replace(plan, chunk_size=self.base_root.chunk_size)
        except (ShardfmtError, OSError):
            return plan  # every rank then finds the base unusable or its chunks unlike: a full save

    def stage(self) -> CheckpointWriter | None:
        """5) Rank 0 checks the destination and stages; every rank learns where (or why not)."""
        writer, msg = None, None
        if self.coord.rank == 0:
            try:
                writer = CheckpointWriter(self.path, storage=self.storage, options=self.options)
                writer.stage()
                msg = Staged(save_id=writer.save_id, staging=writer.staging, name_tag=writer.name_tag)
            except ShardfmtError as e:
                msg = RankError.of(0, e)
        staged = self.coord.broadcast(msg, Staged.from_json, "staging")
        self.coord.raise_failures([staged], "staging the checkpoint")
        if self.options.node_part is not None:
            try:
                staged, self.node_lease = stage_nodes(self.coord, self.storage, self.path, staged,
                                                      self.options.node_part)
            except BaseException:
                if writer is not None:
                    writer.abort()
                raise
        self.staged = staged
        return writer

    def abort_node(self) -> None:
        """A failed save on the node-local tier: this node's staging dir goes too (``saving.nodes``)."""
        if self.options.node_part is not None and self.staged is not None:
            abort_node(self.coord, self.storage, self.staged.staging, self.options.node_part, self.node_lease)

    def write(self, state: RankState, writers: Mapping[WriteKey, int], decode, gather) -> list[Written] | None:
        """6) Write this rank's file into the staging dir; ``gather`` what every rank wrote
        (v1: to every rank; v2: to rank 0, the others get None)."""
        rank, opts = self.coord.rank, self.options
        try:
            if self.snapshot is not None:
                self.prepared = self.snapshot()
            items = my_items(state, self.prepared.pieces, writers, rank=rank, ready=self.prepared.ready)
            items, taken, chain, kept = self._take_from_base(items)
            stats = self._stats_of(items, kept)  # of every box this rank writes or takes: beside the writing
            file = None
            if items:
                name = rank_file_name(rank, None, self.staged.name_tag)
                file = write_shard_file(self.storage, self.staged.staging, name, rank, _shard_data(items),
                                        chunk_size=opts.chunk_size, sync=opts.sync,
                                        workers=opts.write_workers or default_write_workers(),
                                        part_size=opts.part_size, aligned=opts.format_version >= 2)
            # A snapshot counts only whole: pieces other ranks write must have been copied here too.
            self.prepared.wait_ready()
            msg: Written | RankError = self._written(file, state, taken, chain)
            if stats is not None and isinstance(msg, Written):
                msg = dataclasses.replace(msg, stats=_stats_or_none(stats, file, kept))
        except (ShardfmtError, OSError) as e:
            msg = RankError.of(rank, e)
        results = gather(msg, decode, "gathering write results")
        failed = [] if results is None else [r for r in results if isinstance(r, RankError)]
        if self.options.format_version >= 2:
            failed = self.coord.broadcast(Failures(errors=tuple(failed)) if rank == 0 else None, Failures.from_json,
                                          "gathering write results").errors
        self.coord.raise_failures(failed, "writing shard files")
        return results

    def _stats_of(self, items: list[WriteItem], kept: list[tuple[WriteItem, str]]):
        """v2: a future of the statistics (``format.stats``) of each box written (``items``) or
        taken from a base (``kept``, with its shard digest), computed in a thread of its own while
        the file is written (torch lets go of the GIL): ``(box key, stats)`` pairs. A taken box's
        come from the save that wrote its bytes, in this process (``_BOX_STATS``, by content
        digest), when there is one: an incremental save then computes only what it writes."""
        if self.options.format_version < 2 or not (items or kept):
            return None

        def compute() -> list[tuple[tuple, tuple[float, float, float]]]:
            out = []
            for it, digest in [(it, None) for it in items] + kept:
                known = _BOX_STATS.get((it.fqn, it.box.offsets, digest)) if digest is not None else None
                if known is None:
                    if it.ready is not None:
                        it.ready()
                    known = box_stats(it.data, it.box.offsets)
                out.append(((it.fqn, it.box.offsets, digest), known))
            return out
        return _STATS_POOL.submit(compute)

    def _take_from_base(self, items: list[WriteItem]) -> tuple[list[WriteItem], dict[str, IndexedFile], Chain | None,
                                                                list[tuple[WriteItem, str]]]:
        """An incremental save: the items still to write, the base's files holding the others, the
        chain, and the items taken with their digests."""
        if self.base is None or not items:
            return items, {}, None, []
        chunk = self.options.chunk_size
        with Digests(items, chunk, workers=self.options.write_workers or default_write_workers()) as digests:
            base = try_read_base(self.storage, self.path, self.base, self.coord.rank, root=self.base_root)
            if base is None:
                return items, {}, None, []
            items, taken, kept = base.take(items, chunk, digests.of)
        return items, taken, base.chain_for(list(taken)), kept

    def _written(self, file: WrittenFile | None, state: RankState, taken: Mapping[str, IndexedFile],
                 chain: Chain | None) -> Written:
        """What this rank reports of its writing: v1, the file; v2, the index it then writes."""
        if self.options.format_version < 2:
            return Written(file=file)
        if file is None and not state.per_rank and not taken:
            return Written()
        files = {} if file is None else {file.name: IndexedFile.of(file.record)}
        entry = write_rank_index(self.storage, self.staged.staging, rank=self.coord.rank, save_id=self.staged.save_id,
                                 name_tag=self.staged.name_tag, files={**files, **taken}, values=dict(state.per_rank))
        return Written(index=entry, names=tuple(sorted(files)) + tuple(taken), chain=chain)

    def commit(self, writer: CheckpointWriter | None, build: Callable[[], Manifest]) -> Manifest:
        """7) Rank 0 records every file and commits (``build``); every rank gets the manifest (or the error)."""
        msg = None
        part = self.options.node_part
        if self.coord.rank == 0:
            try:
                m = build()
                msg = Committed(manifest=m) if part is None else Committed(
                    manifest=m, raw=m.to_json(), tables=tables_of(self.storage, self.path, m))
            except BaseException as e:  # noqa: BLE001 - reported to every rank, then raised here too
                writer.abort()
                msg = RankError.of(0, e)
        outcome = self.coord.broadcast(msg, Committed.from_json, "committing")
        self.coord.raise_failures([outcome], "committing")
        if part is not None:
            commit_nodes(self.coord, self.storage, self.path, self.staged, part, outcome, self.node_lease)
        return outcome.manifest


def _stats_or_none(stats, file: WrittenFile | None, kept) -> dict | None:
    """The per-tensor statistics, or None when computing them failed (the save then records
    none, on any rank: a partial sum would fail the restore's check): a check, never a reason a
    save fails. Each box's are kept by its content digest for the next save (``_BOX_STATS``)."""
    try:
        boxes = stats.result()
    except Exception as e:  # noqa: BLE001 - any failure of the diagnostic
        log.warning("shardfmt: this save records no tensor statistics (computing them failed: %s)", e)
        return None
    written = {} if file is None else {(f, s.offsets): s.digest for f, s in file.shards}
    out: dict[str, list[float]] = {}
    keep = {}
    for (fqn, offsets, digest), vals in boxes:
        add(out, fqn, vals)
        digest = digest if digest is not None else written.get((fqn, offsets))
        if digest is not None:
            keep[(fqn, offsets, digest)] = vals
    _BOX_STATS.clear()
    _BOX_STATS.update(keep)  # what this rank's next (incremental) save may take unchanged
    return out


def _without_flat(state: RankState) -> RankState:
    """Format v1 has no flat placement entry: such tensors are stored by their boxes alone."""
    if not any(t.placement is not None and any(p[0] == "flat" for p in t.placement.placements) for t in state.tensors):
        return state
    return dataclasses.replace(state, tensors=tuple(
        dataclasses.replace(t, placement=None) if t.placement is not None and any(
            p[0] == "flat" for p in t.placement.placements) else t for t in state.tensors))


def _shard_data(items: list[WriteItem]) -> list[ShardData]:
    """The items as the shard-file writer takes them, in data-file order."""
    return file_order([ShardData(fqn=it.fqn, data=it.data, global_shape=it.global_shape, offsets=it.box.offsets,
                                 placement=it.placement, ready=it.ready) for it in items])


def _records(states: list[RankState]) -> dict[str, TensorRecord]:
    """fqn -> (dtype, shape) record of every tensor a rank holds: what a shard record is checked against."""
    return {t.fqn: t.record() for s in states for t in s.tensors}


def _commit(writer: CheckpointWriter, states: list[RankState], files: list[WrittenFile], *,
            step: int | None, metadata: Any, topology: Topology) -> Manifest:
    """Record every rank's file and the non-shard records, then publish."""
    meta: dict[str, tuple] = {}
    for s in states:  # ranks in order: the lowest holder's record of a tensor is kept
        for t in s.tensors:
            meta.setdefault(t.fqn, (t.dtype, t.shape, t.placement))
    storage_names = frozenset(t.fqn for s in states for t in s.tensors if t.storage)
    for f in files:
        writer.add_file(f, meta, storage_names)
    _add_records(writer, states)
    return writer.commit(step=step, metadata=metadata, topology=topology)


def commit_v2(writer: CheckpointWriter, plan: PlacedPlan, summaries: list[Summary], written: list[Written], *,
               step: int | None, metadata: Any, topology: Topology) -> Manifest:
    """v2: record each tensor by its placement or by its listed boxes with their writers (the
    plan every rank followed), each rank's index, the other records; then publish."""
    listed: dict[str, list[ListedShard]] = {}
    for (fqn, offsets, lengths), rank in plan.listed.items():
        listed.setdefault(fqn, []).append(ListedShard(offsets=offsets, lengths=lengths, rank=rank))
    for fqn, t in sorted(plan.records.items()):
        if fqn in plan.placed:
            writer.place(fqn, t.dtype, t.shape, plan.placed[fqn], storage=t.storage)
        else:
            writer.add_listed(fqn, t.dtype, t.shape, t.placement, listed.get(fqn, []), storage=t.storage)
    for rank, w in enumerate(written):
        if w.index is not None:
            writer.add_rank_entry(rank, w.index, files=w.names)
        if w.chain is not None:
            writer.add_chain(w.chain)
        if w.stats is None:
            writer.drop_stats()  # a rank could not compute its part: no total would be right
        elif w.stats:
            writer.add_stats(w.stats)
    _add_records(writer, summaries)
    return writer.commit(step=step, metadata=metadata, topology=topology)


def _add_records(writer: CheckpointWriter, states: Sequence[RankState | Summary]) -> None:
    aliases: dict[str, str] = {}
    views: dict[str, TensorRecord] = {}
    values: dict[str, Any] = {}
    per_rank: dict[str, dict[int, Any]] = {}
    for s in states:  # ranks in order: the lowest rank's copy of a replicated value wins
        for f, t in s.aliases.items():
            if aliases.setdefault(f, t) != t:
                raise StateDictError(f"{f}: ranks disagree on what it aliases")
        for f, v in s.views.items():
            views.setdefault(f, v)
        for f, v in s.values.items():
            values.setdefault(f, v)
        for f in s.per_rank:  # v2 summaries name them: each rank wrote its own into its index
            per_rank.setdefault(f, {})[s.rank] = s.per_rank[f] if isinstance(s.per_rank, Mapping) else None
    for f, t in aliases.items():
        writer.add_alias(f, t)
    for f, rec in views.items():
        writer.add_view(f, rec.dtype, rec.shape, rec.view)
    for f, v in values.items():
        writer.add_encoded_value(f, ValueRecord(value=v))
    for f, m in per_rank.items():  # v2: each rank wrote its own into its index
        writer.add_encoded_value(f, ValueRecord(indexed=True) if writer.format_version >= 2 else ValueRecord(per_rank=m))


def _digest_tensor(t) -> str:
    h = xxhash.xxh3_128()
    for piece in byte_pieces(t):
        h.update(piece)
    return hashing.format_digest(h.digest())


def _check_replicas(states: Sequence[RankState | Summary]) -> None:
    """Replicated tensor pieces must hold the same bytes on every rank (values: step 2)."""
    ref: dict[str, tuple[int, str]] = {}
    for s in states:
        for key, digest in s.replica_digests.items():
            if key in ref and ref[key][1] != digest:
                raise StateDictError(f"{key}: replicated data differs between rank {ref[key][0]} and "
                                     f"rank {s.rank} (check_replicas=True)")
            ref.setdefault(key, (s.rank, digest))


def _topology(mesh: Mapping[str, int] | None, coord: Coordinator) -> Topology:
    if not mesh:
        return coord.default_topology()
    try:
        pairs = Mesh.parse(mesh).dims
    except TopologyError as e:
        raise StateDictError(f"mesh=: {e}") from None
    world = coord.world
    size = 1
    for _, s in pairs:
        size *= s
    if size != world:
        raise StateDictError(f"mesh {dict(pairs)} does not multiply to the world size {world}")
    return Topology(world_size=world, mesh=pairs)
