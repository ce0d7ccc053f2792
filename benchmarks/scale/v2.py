"""The format v2 adapter: the v2 save protocol's steps and the v2 load path, one rank at a time.

prepare: every rank's ``RankState`` (``sim_v1.rank_state``: the same DTensor descriptions), the
v2 write plan (``placing.plan_placed``: placed records and their writers), every rank's data
file (header + a hole; shard-aligned chunk digests of its zeros) and rank index
(``rank_index.write_rank_index``), its ``Written`` message, and rank 0's commit (the rank table,
the root manifest, ``COMMITTED``) and its ``Committed`` broadcast.

The sides run what ``shardfmt.saving.protocol.run_save`` and ``shardfmt.api.load`` run:

    save_other   3) decode the N gathered ``RankState`` messages  4) ``plan_placed``
                 6) ``my_items``; decode the N gathered ``Written`` messages (index entries)
                 8) decode the ``Committed`` broadcast (the root manifest)
    save_commit  the same 3-6 on rank 0, then 7) ``protocol._record_v2`` + ``protocol._commit``
                 (rank table, root, COMMITTED, renamed into place), the broadcast's encoding
    load_side    ``open_checkpoint(whole=False)`` (COMMITTED, the root); its per-rank values
                 (``with_rank_values``: its own rank index); the rank's targets; ``resolve``
                 (the parts, rank indexes and headers of the ranks whose boxes it needs);
                 ``plan_reads``. Metadata bytes are counted at the storage layer.

Not simulated: the transport, writing and hashing the data, and the load's data reads.
"""

from __future__ import annotations

import math
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
from shardfmt.saving.messages import Committed, RankState, Written, envelope, open_envelope
from shardfmt.saving.options import SaveOptions, Seams
from shardfmt.saving.placing import plan_placed
from shardfmt.saving.plan import auto_chunk_size, my_items
from shardfmt.saving.protocol import _commit, _record_v2, _records
from shardfmt.saving.rank_index import write_rank_index
from shardfmt.saving.shard_file import _shard_header, _written_file, file_grid
from shardfmt.saving.writer import CheckpointWriter

STATES, WRITTEN, COMMITTED_BLOB, CKPT = "states.bin", "written.bin", "committed.bin", "ckpt"


CHUNK_SIZE = int(os.environ.get("SHARDFMT_SCALE_CHUNK", 0)) or None  # None: the save picks (auto_chunk_size)


def chunk_size(job: Job, writers) -> int:
    """The hash chunk ``run_save`` picks for this plan (or ``SHARDFMT_SCALE_CHUNK``)."""
    sizes = (math.prod(lengths) * 4 for _, _, lengths in writers)  # the simulated state is fp32
    return CHUNK_SIZE or auto_chunk_size(sizes, format_version=2)


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


def write_rank(job: Job, state: RankState, writers, staging: str, storage, *, chunk: int) -> Written:
    """Rank ``state.rank``'s step 6: its data file (zeros, sparse) and its rank index."""
    rank = state.rank
    specs = sim_v1.file_specs(state, writers, rank)
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
    return Written(index=entry, names=names)


class V2(Adapter):
    name = "v2"

    def prepare(self, job: Job, work: Path) -> dict:
        states = [sim_v1.rank_state(job, r) for r in range(job.world)]
        state_bytes = write_blobs(work / STATES, (orjson.dumps(envelope(s.rank, s)) for s in states))
        topology = sim_v1.topology(job)
        plan = plan_placed(states, topology)
        writer = new_writer(job, work / CKPT, chunk_size(job, plan.writers))
        written = [write_rank(job, s, plan.writers, writer.staging, writer.storage, chunk=writer.chunk_size)
                   for s in states]
        written_bytes = write_blobs(work / WRITTEN, (orjson.dumps(envelope(r, w)) for r, w in enumerate(written)))
        _record_v2(writer, states, written, plan)
        root = _commit(writer, states, [], step=sim_v1.STEP, metadata=None, topology=topology)
        committed = write_blobs(work / COMMITTED_BLOB, [orjson.dumps(envelope(0, Committed(manifest=root)))])
        index_dir = work / CKPT / "index"
        indexes = [f for f in os.listdir(index_dir) if f.startswith("rank_")]
        return {"metadata_bytes": os.path.getsize(work / CKPT / MANIFEST_NAME),
                "placed": sum(1 for t in root.tensors.values() if t.placed is not None),
                "listed_boxes": sum(len(t.listed or ()) for t in root.tensors.values()),
                "tensors": len(root.tensors), "rank_indexes": len(indexes),
                "index_bytes_mean": sum(os.path.getsize(index_dir / f) for f in indexes) // max(1, len(indexes)),
                "gather_states_bytes": state_bytes, "gather_written_bytes": written_bytes,
                "broadcast_bytes": committed}

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

    def _gathered(self, job: Job, work: Path, meter: Meter, rank: int):
        """Steps 3-6 of ``run_save`` on ``rank``: decode every description, plan, decode every entry."""
        with meter.phase("gather_states"):
            states = [open_envelope(orjson.loads(b), RankState.from_json) for b in read_blobs(work / STATES)]
        with meter.phase("plan_placed"):
            plan = plan_placed(states, sim_v1.topology(job))
        with meter.phase("my_items"):
            items = my_items(states[rank], sim_v1.pieces_of(states[rank]), plan.writers, rank=rank)
        with meter.phase("gather_written"):
            decode = Written.decoder(_records(states))
            written = [open_envelope(orjson.loads(b), decode) for b in read_blobs(work / WRITTEN)]
        meter.fact("items", len(items))
        return states, written, plan

    def save_other(self, job: Job, work: Path, meter: Meter) -> None:
        rank = min(1, job.world - 1)
        meter.start()
        self._gathered(job, work, meter, rank)
        with meter.phase("committed"):
            blob = read_blobs(work / COMMITTED_BLOB)[0]
            root = open_envelope(orjson.loads(blob), Committed.from_json).manifest
        meter.fact("headline", list(meter.phases))
        meter.fact("tensors", len(root.tensors))

    def save_commit(self, job: Job, work: Path, meter: Meter) -> None:
        dest = work / f"commit-{os.getpid()}"
        meter.start()
        states, written, plan = self._gathered(job, work, meter, 0)
        with meter.phase("stage"):
            writer = new_writer(job, dest / CKPT, chunk_size(job, plan.writers))
        try:
            with meter.phase("commit"):
                _record_v2(writer, states, written, plan)
                root = _commit(writer, states, [], step=sim_v1.STEP, metadata=None, topology=sim_v1.topology(job))
                blob = orjson.dumps(envelope(0, Committed(manifest=root)))
            meter.fact("headline", ["commit"])
            meter.fact("broadcast_bytes", len(blob))
        finally:
            shutil.rmtree(dest, ignore_errors=True)
