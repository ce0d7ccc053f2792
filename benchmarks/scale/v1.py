"""The format v1 adapter: shardfmt's own save protocol steps and load path, one rank at a time.

prepare: every rank's ``RankState`` (``sim_v1.rank_state``) and its wire bytes; the write plan
(``plan.assign_writers``); every rank's ``Written`` message and its data file (header + a
hole); rank 0's commit of the real manifest, ``COMMITTED`` and the ``Committed`` broadcast.

The sides run what ``shardfmt.saving.protocol.run_save`` and ``shardfmt.api.load`` run:

    save_other   3) decode the N gathered ``RankState`` messages  4) ``assign_writers``
                 6) ``my_items``; decode the N gathered ``Written`` messages
                 8) decode the ``Committed`` broadcast (the whole manifest)
    save_commit  the same 3-6 on rank 0, then 7) ``protocol._commit`` (file and shard records,
                 ``build_manifest`` with its tiling check, publish: manifest.json + COMMITTED
                 written and renamed into place) and the broadcast's encoding: its headline
    load_side    ``open_checkpoint`` (COMMITTED, manifest bytes, digest, ``parse_manifest``);
                 the rank's targets (``targets_for_rank`` with the load mesh's layouts: the
                 boxes ``TargetBuilder`` gets from DTensors on it); ``plan_reads`` with the
                 default ``LoadOptions``; ``check_headers`` of every file it reads from

Not simulated: the transport (``all_gather_bytes`` also holds N padded copies of the
longest message), writing and hashing the data, and the load's data reads.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import orjson
import torch

from benchmarks.scale import sim_v1
from benchmarks.scale.adapter import Adapter, read_blobs, write_blobs
from benchmarks.scale.layouts import Job, placements
from benchmarks.scale.measure import Meter
from shardfmt.format.manifest import COMMITTED_NAME, MANIFEST_NAME
from shardfmt.layout.topology import Layout
from shardfmt.loading.options import LoadOptions
from shardfmt.loading.planner import plan_load
from shardfmt.loading.reader import check_headers, open_checkpoint
from shardfmt.loading.targets import ReadTarget, plan_reads, targets_for_rank
from shardfmt.saving.messages import Committed, RankState, Written, envelope, open_envelope
from shardfmt.saving.plan import assign_writers, my_items
from shardfmt.saving.protocol import _records

STATES, WRITTEN, COMMITTED_BLOB, CKPT = "states.bin", "written.bin", "committed.bin", "ckpt"


def load_layouts(job: Job) -> dict[str, Layout]:
    """fqn -> the Layout of the loading job's DTensor (with its stage, so other stages hold nothing)."""
    out = {}
    for t in job.tensors:
        stage = job.stage(t.param, job.load.pp)
        if t.plain:
            out[t.fqn] = Layout((), (), stage=stage)
        else:
            out[t.fqn] = Layout(("dp", "tp"), placements(t.param.style, job.load.tp), stage=stage)
    return out


class V1(Adapter):
    name = "v1"

    def prepare(self, job: Job, work: Path) -> dict:
        states = [sim_v1.rank_state(job, r) for r in range(job.world)]
        state_bytes = write_blobs(work / STATES, (orjson.dumps(envelope(s.rank, s)) for s in states))
        writers = assign_writers(states)
        writer = sim_v1.new_writer(job, work / CKPT)
        files = []
        header_bytes = 0

        def messages():
            nonlocal header_bytes
            for s in states:
                got = sim_v1.written_file(sim_v1.file_specs(s, writers, s.rank), s.rank, chunk=writer.chunk_size)
                wf = None
                if got is not None:
                    wf, header = got
                    files.append(wf)
                    header_bytes += len(header)
                    sim_v1.write_sparse(Path(writer.staging), wf.name, header, wf.record.size)
                yield orjson.dumps(envelope(s.rank, Written(file=wf)))

        written_bytes = write_blobs(work / WRITTEN, messages())
        manifest = sim_v1.commit(job, writer, states, files)
        committed = write_blobs(work / COMMITTED_BLOB, [orjson.dumps(envelope(0, Committed(manifest=manifest)))])
        shards = sum(len(t.shards) for t in manifest.tensors.values())
        return {"metadata_bytes": os.path.getsize(work / CKPT / MANIFEST_NAME), "shard_records": shards,
                "files": len(manifest.files), "tensors": len(manifest.tensors),
                "data_bytes": sum(f.record.size for f in files), "header_bytes": header_bytes,
                "gather_states_bytes": state_bytes, "gather_written_bytes": written_bytes,
                "broadcast_bytes": committed}

    def load_side(self, job: Job, work: Path, meter: Meter) -> None:
        path, mesh, rank = str(work / CKPT), job.load.mesh, job.reader
        layouts = load_layouts(job)  # the caller's DTensors: they exist before the load
        opts = LoadOptions()
        meter.start()
        with meter.phase("open"):
            ckpt = open_checkpoint(path)
        m = ckpt.manifest
        with meter.phase("targets"):
            slices = targets_for_rank(m, mesh, rank, layouts=layouts)
            targets = [ReadTarget(src=s, src_dtype=torch.float32,
                                  dst=torch.empty(s.box.lengths, dtype=torch.float32, device="meta")) for s in slices]
        with meter.phase("plan"):
            opts = opts.for_storage(ckpt.storage)
            plan = plan_reads(m, targets, opts, remote=ckpt.storage.remote)
        with meter.phase("headers"):
            check_headers(ckpt.storage, ckpt.path, m, plan.shards)
        meter.fact("headline", ["open", "targets", "plan", "headers"])
        raw = plan_load(m, slices, verify=False, max_gap=opts.max_gap, max_read=opts.max_read)
        headers = sum(f.header_size for f in plan.files.values())
        meta = os.path.getsize(Path(path) / MANIFEST_NAME) + os.path.getsize(Path(path) / COMMITTED_NAME)
        meter.fact("rank", rank)
        meter.fact("targets", len(slices))
        meter.fact("files_read", len(plan.files))
        meter.fact("metadata_read_bytes", meta + headers)
        meter.fact("header_bytes", headers)
        meter.fact("read_verified_bytes", plan.bytes_to_read)
        meter.fact("read_unverified_bytes", raw.bytes_to_read)
        meter.fact("needed_bytes", plan.needed_bytes)

    def _gathered(self, job: Job, work: Path, meter: Meter, rank: int):
        """Steps 3-6 of ``run_save`` on ``rank``: decode every description, plan, decode every file."""
        with meter.phase("gather_states"):
            states = [open_envelope(orjson.loads(b), RankState.from_json) for b in read_blobs(work / STATES)]
        with meter.phase("assign_writers"):
            writers = assign_writers(states)
        with meter.phase("my_items"):
            items = my_items(states[rank], sim_v1.pieces_of(states[rank]), writers, rank=rank)
        with meter.phase("gather_written"):
            decode = Written.decoder(_records(states))
            written = [open_envelope(orjson.loads(b), decode) for b in read_blobs(work / WRITTEN)]
        meter.fact("items", len(items))
        return states, written

    def save_other(self, job: Job, work: Path, meter: Meter) -> None:
        rank = min(1, job.world - 1)
        meter.start()
        self._gathered(job, work, meter, rank)
        with meter.phase("committed"):
            blob = read_blobs(work / COMMITTED_BLOB)[0]
            manifest = open_envelope(orjson.loads(blob), Committed.from_json).manifest
        meter.fact("headline", list(meter.phases))
        meter.fact("tensors", len(manifest.tensors))

    def save_commit(self, job: Job, work: Path, meter: Meter) -> None:
        dest = work / f"commit-{os.getpid()}"
        meter.start()
        states, written = self._gathered(job, work, meter, 0)
        with meter.phase("stage"):
            writer = sim_v1.new_writer(job, dest / CKPT)
        try:
            with meter.phase("commit"):
                manifest = sim_v1.commit(job, writer, states, [w.file for w in written if w.file is not None])
                blob = orjson.dumps(envelope(0, Committed(manifest=manifest)))
            meter.fact("headline", ["commit"])
            meter.fact("broadcast_bytes", len(blob))
        finally:
            shutil.rmtree(dest, ignore_errors=True)
