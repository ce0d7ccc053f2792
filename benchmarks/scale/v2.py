"""The format v2 adapter: the v2 save protocol's steps and the v2 load path, one rank at a time.

prepare: every rank's ``RankState`` (``sim_v1.rank_state``: the same DTensor descriptions), its
claims and their digest (``claims.split_claims``, ``claims_digest``: the all-gather's rows), its
``Summary`` (``protocol.summary_of``), rank 0's plan (``protocol.plan_at_root``) and its
``WritePlan`` broadcast, every rank's data file (header + a hole; shard-aligned chunk digests of
its zeros) and rank index (``rank_index.write_rank_index``), its ``Written`` message, and rank
0's commit (``protocol.commit_v2``: the rank table, the root manifest, ``COMMITTED``) and its
``Committed`` broadcast.

The sides run what ``shardfmt.saving.protocol.run_save`` and ``shardfmt.api.load`` run:

    save_other   3) claim its tensors, digest them; read the N all-gathered digests (16 bytes a
                 rank) into groups; encode its ``Summary``  4) decode the ``WritePlan``
                 broadcast; ``rank_writes`` + ``my_items``  6) encode its ``Written``
                 8) decode the ``Committed`` broadcast (the root manifest)
    save_commit  the same on rank 0, then decode the N gathered summaries, ``plan_at_root``,
                 encode the plan; decode the N gathered ``Written``; ``commit_v2`` (rank table,
                 root, COMMITTED, renamed into place), the broadcast's encoding
    load_side    ``open_checkpoint(whole=False)`` (COMMITTED, the root); its per-rank values
                 (``with_rank_values``: its own rank index); the rank's targets; ``resolve``
                 (the parts, rank indexes and headers of the ranks whose boxes it needs);
                 ``plan_reads``. Metadata bytes are counted at the storage layer.

Not simulated: the transport, writing and hashing the data, and the load's data reads.
"""

from __future__ import annotations

import os
import shutil
from functools import cache
from pathlib import Path

import orjson
import torch

from benchmarks.scale import sim_v1
from benchmarks.scale.adapter import Adapter, read_blobs, write_blobs
from benchmarks.scale.layouts import Job
from benchmarks.scale.measure import Meter
from benchmarks.scale.v1 import load_layouts
from shardfmt.format import hashing
from shardfmt.format.manifest import COMMITTED_NAME, MANIFEST_NAME, rank_file_name
from shardfmt.loading.options import LoadOptions
from shardfmt.loading.planner import plan_load
from shardfmt.loading.reader import open_checkpoint
from shardfmt.loading.resolve import resolve, with_rank_values
from shardfmt.loading.targets import ReadTarget, plan_reads, targets_for_rank
from shardfmt.saving.claims import claims_digest, first_of_groups, split_claims
from shardfmt.saving.messages import (
    Committed,
    RankState,
    Summary,
    WritePlan,
    Written,
    envelope,
    open_envelope,
)
from shardfmt.saving.options import SaveOptions, Seams
from shardfmt.saving.placing import rank_writes
from shardfmt.saving.plan import my_items
from shardfmt.saving.protocol import commit_v2, plan_at_root, summary_of
from shardfmt.saving.rank_index import write_rank_index
from shardfmt.saving.shard_file import _shard_header, _written_file, file_grid
from shardfmt.saving.writer import CheckpointWriter

STATES, DIGESTS, SUMMARIES, PLAN = "states.bin", "digests.bin", "summaries.bin", "plan.bin"
WRITTEN, COMMITTED_BLOB, CKPT = "written.bin", "committed.bin", "ckpt"


CHUNK_SIZE = int(os.environ.get("SHARDFMT_SCALE_CHUNK", 0)) or None  # None: the save picks (auto_chunk_size)


def chunk_size(plan: WritePlan) -> int:
    """The hash chunk ``run_save`` picks for this plan (or ``SHARDFMT_SCALE_CHUNK``)."""
    return CHUNK_SIZE or plan.chunk_size


def save_options(job: Job, chunk: int) -> SaveOptions:
    return SaveOptions(mesh=dict(job.save.mesh.dims), format_version=2, chunk_size=chunk,
                       _seams=Seams(save_id=sim_v1.SAVE_ID, clock=lambda: sim_v1.CREATED))


def new_writer(job: Job, path: Path, chunk: int) -> CheckpointWriter:
    w = CheckpointWriter(str(path), options=save_options(job, chunk))
    w.stage()
    os.makedirs(os.path.join(w.staging, "data"), exist_ok=True)
    return w


@cache
def _zero_digest(n: int) -> str:
    return hashing.digest_bytes(bytes(n))


def write_rank(job: Job, state: RankState, plan: WritePlan, staging: str, storage, *, chunk: int) -> Written:
    """Rank ``state.rank``'s step 6: its data file (zeros, sparse) and its rank index."""
    rank = state.rank
    specs = sim_v1.file_specs(state, rank_writes(plan.placed, plan.listed, state, sim_v1.topology(job)), rank)
    files, names = {}, ()
    if specs:
        name = rank_file_name(rank)
        header = _shard_header(name, rank, specs)
        grid = file_grid(header, chunk, aligned=True)
        chunks = [_zero_digest(hi - lo) for lo, hi in (grid.bounds(k) for k in range(grid.count))]
        wf = _written_file(name, rank, header, specs, chunks, grid)
        sim_v1.write_sparse(Path(staging), name, header.data, header.file_size)
        files, names = {name: wf.record}, (name,)
    if not files and not state.per_rank:
        return Written()
    entry = write_rank_index(storage, staging, rank=rank, save_id=sim_v1.SAVE_ID, name_tag=None, files=files,
                             values=dict(state.per_rank))
    # every tensor is zero: each box it writes adds (0, 0, 0) to its tensor's statistics, as a real save does
    stats = {s.fqn: [0.0, 0.0, 0.0] for s in specs}
    return Written(index=entry, names=names, stats=stats)


class V2(Adapter):
    name = "v2"

    def prepare(self, job: Job, work: Path) -> dict:
        topology = sim_v1.topology(job)
        states = [sim_v1.rank_state(job, r) for r in range(job.world)]
        state_bytes = write_blobs(work / STATES, (orjson.dumps(envelope(s.rank, s)) for s in states))
        split = [split_claims(s, topology) for s in states]
        digests = [claims_digest(claims) for claims, _ in split]
        write_blobs(work / DIGESTS, [orjson.dumps(digests)])
        groups = first_of_groups(digests)
        summaries = [summary_of(s, c, ls, groups=groups, differing=frozenset()) for s, (c, ls) in zip(states, split)]
        summary_bytes = write_blobs(work / SUMMARIES, (orjson.dumps(envelope(s.rank, s)) for s in summaries))
        full, plan = plan_at_root(summaries, groups, topology, world=job.world, check_replicas=False)
        plan_bytes = write_blobs(work / PLAN, [orjson.dumps(envelope(0, plan))])
        writer = new_writer(job, work / CKPT, chunk_size(plan))
        written = [write_rank(job, s, plan, writer.staging, writer.storage, chunk=writer.chunk_size) for s in states]
        written_bytes = write_blobs(work / WRITTEN, (orjson.dumps(envelope(r, w)) for r, w in enumerate(written)))
        root = commit_v2(writer, full, summaries, written, step=sim_v1.STEP, metadata=None, topology=topology)
        committed = write_blobs(work / COMMITTED_BLOB, [orjson.dumps(envelope(0, Committed(manifest=root)))])
        index_dir = work / CKPT / "index"
        indexes = [f for f in os.listdir(index_dir) if f.startswith("rank_")]
        return {"metadata_bytes": os.path.getsize(work / CKPT / MANIFEST_NAME),
                "placed": sum(1 for t in root.tensors.values() if t.placed is not None),
                "listed_boxes": sum(len(t.listed or ()) for t in root.tensors.values()),
                "groups": len(groups), "tensors": len(root.tensors), "rank_indexes": len(indexes),
                "index_bytes_mean": sum(os.path.getsize(index_dir / f) for f in indexes) // max(1, len(indexes)),
                "state_bytes": state_bytes, "gather_summaries_bytes": summary_bytes, "plan_bytes": plan_bytes,
                "gather_written_bytes": written_bytes, "broadcast_bytes": committed}

    def load_side(self, job: Job, work: Path, meter: Meter) -> None:
        path, mesh, rank = str(work / CKPT), job.load.mesh, job.reader
        layouts = load_layouts(job)
        opts = LoadOptions()
        meter.start()
        with meter.phase("open"):
            ckpt = open_checkpoint(path, whole=False)
            storage = ckpt.storage
            before = storage.stats.snapshot()
            m = with_rank_values(storage, ckpt.path, ckpt.manifest, rank)
        with meter.phase("targets"):
            slices = targets_for_rank(m, mesh, rank, layouts=layouts)
            targets = [ReadTarget(src=s, src_dtype=torch.float32,
                                  dst=torch.empty(s.box.lengths, dtype=torch.float32, device="meta")) for s in slices]
        with meter.phase("resolve"):
            m = resolve(storage, ckpt.path, m, slices, verify=True)
        with meter.phase("plan"):
            opts = opts.for_storage(storage)
            plan = plan_reads(m, targets, opts, remote=storage.remote)
        meter.fact("headline", ["open", "targets", "resolve", "plan"])
        after = storage.stats.snapshot()
        raw = plan_load(m, slices, verify=False, max_gap=opts.max_gap, max_read=opts.max_read)
        tight = plan_load(m, slices, verify=True, max_gap=0, max_read=opts.max_read)  # no gap merged: the chunks alone
        opened = os.path.getsize(Path(path) / MANIFEST_NAME) + os.path.getsize(Path(path) / COMMITTED_NAME)
        meter.fact("rank", rank)
        meter.fact("targets", len(slices))
        meter.fact("files_read", len(plan.files))
        meter.fact("metadata_read_bytes", opened + after["bytes_read"] - before["bytes_read"])
        meter.fact("header_bytes", sum(f.header_size for f in plan.files.values()))
        meter.fact("read_verified_bytes", plan.bytes_to_read)
        meter.fact("read_verified_nogap_bytes", tight.bytes_to_read)
        meter.fact("chunk_size", m.chunk_size)
        meter.fact("read_unverified_bytes", raw.bytes_to_read)
        meter.fact("needed_bytes", plan.needed_bytes)

    def _own_steps(self, job: Job, work: Path, meter: Meter, rank: int) -> tuple[RankState, WritePlan]:
        """What every rank runs of ``run_save`` on its own: claim, group, summarize, follow the plan."""
        state = sim_v1.rank_state(job, rank)  # describe's output: step 1, not metadata work of the protocol
        topology = sim_v1.topology(job)
        with meter.phase("claims"):
            claims, listed = split_claims(state, topology)
            digest = claims_digest(claims)
        with meter.phase("groups"):
            digests = [tuple(d) for d in orjson.loads(read_blobs(work / DIGESTS)[0])]
            assert digests[rank] == digest
            groups = first_of_groups(digests)
            summary = summary_of(state, claims, listed, groups=groups, differing=frozenset())
            orjson.dumps(envelope(rank, summary))
        with meter.phase("plan"):
            plan = open_envelope(orjson.loads(read_blobs(work / PLAN)[0]), WritePlan.from_json)
            items = my_items(state, sim_v1.pieces_of(state), rank_writes(plan.placed, plan.listed, state, topology),
                             rank=rank)
        meter.fact("items", len(items))
        meter.fact("groups", len(groups))
        return state, plan

    def save_other(self, job: Job, work: Path, meter: Meter) -> None:
        rank = min(1, job.world - 1)
        meter.start()
        self._own_steps(job, work, meter, rank)
        with meter.phase("committed"):
            blob = read_blobs(work / COMMITTED_BLOB)[0]
            root = open_envelope(orjson.loads(blob), Committed.from_json).manifest
        meter.fact("headline", list(meter.phases))
        meter.fact("tensors", len(root.tensors))

    def save_commit(self, job: Job, work: Path, meter: Meter) -> None:
        dest = work / f"commit-{os.getpid()}"
        topology = sim_v1.topology(job)
        meter.start()
        self._own_steps(job, work, meter, 0)
        with meter.phase("gather_summaries"):
            summaries = [open_envelope(orjson.loads(b), Summary.from_json) for b in read_blobs(work / SUMMARIES)]
            groups = first_of_groups([tuple(d) for d in orjson.loads(read_blobs(work / DIGESTS)[0])])
        with meter.phase("plan_at_root"):
            full, plan = plan_at_root(summaries, groups, topology, world=job.world, check_replicas=False)
            orjson.dumps(envelope(0, plan))
        with meter.phase("gather_written"):
            written = [open_envelope(orjson.loads(b), Written.decoder({})) for b in read_blobs(work / WRITTEN)]
        with meter.phase("stage"):
            writer = new_writer(job, dest / CKPT, chunk_size(plan))
        try:
            with meter.phase("commit"):
                root = commit_v2(writer, full, summaries, written, step=sim_v1.STEP, metadata=None, topology=topology)
                blob = orjson.dumps(envelope(0, Committed(manifest=root)))
            meter.fact("headline", [p for p in meter.phases if p != "stage"])
            meter.fact("broadcast_bytes", len(blob))
        finally:
            shutil.rmtree(dest, ignore_errors=True)
