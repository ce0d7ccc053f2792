"""The DCP adapter: torch.distributed.checkpoint's own planner and storage functions on the same jobs.

Every rank's ``SavePlan`` is what ``DefaultSavePlanner.create_local_plan`` makes for its
state dict: one ``WriteItem`` per DTensor, its chunk from DCP's own layout math
(``tensor._utils._compute_local_shape_and_global_offset``, what
``compute_local_shape_and_global_offset`` runs for the rank's mesh coordinate), one per plain
tensor (AdamW's ``step``) and one per non-tensor leaf on every rank (deduplicated by the
coordinator), with the flatten mappings as ``planner_data``. ``tests/test_scale_sim.py``
checks these plans against ``create_local_plan`` on real DTensors (a fake process group).

prepare: every rank's plan, pickled as ``gather_object`` sends it; the coordinator's global
plan (``DefaultSavePlanner.create_global_plan``: ``dedup_save_plans``,
``create_default_global_save_plan``, ``_validate_global_plan``); every rank's write results
as ``FileSystemWriter`` returns them (one ``__<rank>_0.distcp`` file, byte items first, each
tensor item ``torch.save``'s size: its bytes + the container's overhead for its ndim); and
``FileSystemWriter.finish`` writing ``.metadata`` (a pickle of ``Metadata``).

    save_commit  the coordinator: unpickle N plans, ``create_global_plan``, pickle the N
                 global plans (the scatter), unpickle N result lists, ``finish``
    save_other   another rank: ``create_local_plan`` on its DTensors (fake process group),
                 pickle it; unpickle its global plan; pickle its results
    load_side    ``FileSystemReader.read_metadata`` (unpickle), ``DefaultLoadPlanner``
                 ``set_up_planner`` + ``create_local_plan`` on the rank's DTensors of the load
                 mesh, the reader's ``prepare_local_plan``, pickling the plan for the coordinator

Not simulated: the coordinator's side of the load (it gathers and scatters every rank's
load plan too), and the data. DCP reads each saved chunk a read item touches whole, so the
bytes a load reads are the lengths of those chunks' storage records.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import pickle
import shutil
from functools import cache
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Replicate as TReplicate
from torch.distributed.tensor import Shard as TShard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

from benchmarks.scale.adapter import Adapter, read_blob, read_blobs, write_blobs
from benchmarks.scale.layouts import Job, Param, Topo, placements
from benchmarks.scale.measure import Meter
from benchmarks.scale.sim_v1 import param_groups
from shardfmt.layout.topology import Replicate, Shard, StridedShard

PLANS, GLOBALS, RESULTS, CKPT = "plans.bin", "globals.bin", "results.bin", "dcp"
_PROPS = TensorProperties.create_from_tensor(torch.empty(0, dtype=torch.float32))


def torch_placements(style: str, tp: int) -> tuple:
    out = []
    for p in placements(style, tp):
        if isinstance(p, StridedShard):
            out.append(_StridedShard(p.dim, split_factor=p.split_factor))
        elif isinstance(p, Shard):
            out.append(TShard(p.dim))
        else:
            assert isinstance(p, Replicate)
            out.append(TReplicate())
    return tuple(out)


@cache
def _chunk(shape: tuple[int, ...], style: str, dp: int, tp: int, c_dp: int, c_tp: int) -> tuple[torch.Size, torch.Size]:
    sizes, offsets = _compute_local_shape_and_global_offset(shape, (dp, tp), [c_dp, c_tp], torch_placements(style, tp))
    return torch.Size(sizes), torch.Size(offsets)


def nested_state(job: Job, topo: Topo, stage: int | None, leaf) -> dict:
    """The state dict DCP sees: ``{"model": {...}, "optim": {"state": {...}, "param_groups": [...]}}``,
    ``leaf(param, key)`` giving each tensor (key None: the parameter itself)."""
    model, state = {}, {}
    for p in job.params:
        if stage is not None and job.stage(p, topo.pp) != stage:
            continue
        model[p.name] = leaf(p, None)
        state[p.name] = {"exp_avg": leaf(p, "exp_avg"), "exp_avg_sq": leaf(p, "exp_avg_sq"), "step": leaf(p, "step")}
    return {"model": model, "optim": {"state": state, "param_groups": param_groups(job, topo, stage)}}


@cache
def _flat_keys(job: Job, stage: int | None) -> tuple[dict, dict]:
    """DCP's flattened names of a stage's state and the non-tensor values: (mappings, values)."""
    flat, mappings = flatten_state_dict(nested_state(job, job.save, stage, lambda p, k: torch.empty(0)))
    values = {k: v for k, v in flat.items() if not isinstance(v, torch.Tensor)}
    return mappings, values


def _fqn(p: Param, key: str | None) -> str:
    return f"model.{p.name}" if key is None else f"optim.state.{p.name}.{key}"


def save_plan(job: Job, rank: int) -> SavePlan:
    """What ``DefaultSavePlanner.create_local_plan`` returns on ``rank`` of ``job.save``."""
    topo = job.save
    coords = topo.mesh.coords(rank)
    stage = coords.get("pp") if topo.pp > 1 else None
    mappings, values = _flat_keys(job, stage)
    items = []
    flat_order = list(mappings)  # create_local_plan walks the flattened dict in insertion order
    by_fqn = {}
    for p in job.params:
        if stage is not None and job.stage(p, topo.pp) != stage:
            continue
        sizes, offsets = _chunk(p.shape, p.style, topo.dp, topo.tp, coords["dp"], coords["tp"])
        for key in (None, "exp_avg", "exp_avg_sq"):
            fqn = _fqn(p, key)
            by_fqn[fqn] = WriteItem(index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD,
                                    tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
                                                                properties=_PROPS, size=torch.Size(p.shape)))
        fqn = _fqn(p, "step")
        by_fqn[fqn] = WriteItem(index=MetadataIndex(fqn, torch.Size([])), type=WriteItemType.TENSOR,
                                tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=torch.Size([]),
                                                                                       sizes=torch.Size([])),
                                                            properties=_PROPS, size=torch.Size([])))
    for fqn in values:
        by_fqn[fqn] = WriteItem(index=MetadataIndex(fqn), type=WriteItemType.BYTE_IO)
    items = [by_fqn[f] for f in flat_order]
    return SavePlan(items, planner_data=mappings)


@cache
def _save_overhead(ndim: int) -> int:
    """Bytes ``torch.save`` adds around a tensor's data (the zip container), for ``ndim`` dims."""
    b = io.BytesIO()
    torch.save(torch.zeros([1] * ndim), b)
    return len(b.getvalue()) - 4


def write_results(rank: int, plan: SavePlan, values: dict) -> list[WriteResult]:
    """What ``FileSystemWriter.write_data`` returns for ``plan`` (one file, byte items first)."""
    key = f"__{rank}_0.distcp"
    out, offset = [], 0
    ordered = [i for i in plan.items if i.type == WriteItemType.BYTE_IO] + \
              [i for i in plan.items if i.type != WriteItemType.BYTE_IO]
    for item in ordered:
        if item.type == WriteItemType.BYTE_IO:
            b = io.BytesIO()
            torch.save(values[item.index.fqn], b)
            length = len(b.getvalue())
        else:
            chunk = item.tensor_data.chunk
            length = _save_overhead(len(chunk.sizes)) + 4 * math.prod(chunk.sizes)
        out.append(WriteResult(index=item.index, size_in_bytes=length,
                               storage_data=_StorageInfo(relative_path=key, offset=offset, length=length)))
        offset += length
    return out


@contextlib.contextmanager
def fake_world(rank: int, world: int):
    """A process group of ``world`` ranks in which this process is ``rank`` and no collective
    runs (torch's ``fake`` backend): DTensors and DeviceMeshes work as on that rank."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def dtensor_state(job: Job, topo: Topo, rank: int, *, memory: bool = False) -> dict:
    """The rank's state dict on ``topo`` (inside ``fake_world``): DTensors on the stage's
    (dp, tp) mesh, plain 0-d steps, the param groups. The local tensors are zeros; without
    ``memory`` they take none (one element, expanded: enough for planning, not to load into)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", topo.mesh.shape, mesh_dim_names=topo.mesh.names)
    sub = mesh["dp", "tp"] if topo.pp > 1 else mesh
    coords = topo.mesh.coords(rank)
    stage = coords.get("pp") if topo.pp > 1 else None

    def leaf(p: Param, key: str | None):
        if key == "step":
            return torch.tensor(0.0)
        pl = torch_placements(p.style, topo.tp)
        local, _ = _compute_local_shape_and_global_offset(p.shape, (topo.dp, topo.tp), [coords["dp"], coords["tp"]], pl)
        stride = tuple(math.prod(p.shape[d + 1:]) for d in range(len(p.shape)))
        data = torch.zeros(local) if memory else torch.zeros(1).expand(local)
        return DTensor.from_local(data, sub, pl, shape=torch.Size(p.shape), stride=stride,
                                  run_check=False)

    return nested_state(job, topo, stage, leaf)


class DCP(Adapter):
    name = "dcp"

    def prepare(self, job: Job, work: Path) -> dict:
        plans = [save_plan(job, r) for r in range(job.world)]
        plan_bytes = write_blobs(work / PLANS, (pickle.dumps(p) for p in plans))
        global_plan, metadata = DefaultSavePlanner().create_global_plan(plans)
        writer = FileSystemWriter(str(work / CKPT))
        global_plan = writer.prepare_global_plan(global_plan)
        write_blobs(work / GLOBALS, (pickle.dumps(p) for p in global_plan))
        results = []
        for r, plan in enumerate(global_plan):
            stage = job.save.mesh.coords(r).get("pp") if job.save.pp > 1 else None
            results.append(write_results(r, plan, _flat_keys(job, stage)[1]))
        result_bytes = write_blobs(work / RESULTS, (pickle.dumps(r) for r in results))
        os.makedirs(work / CKPT, exist_ok=True)
        writer.finish(metadata, results)
        chunks = sum(len(getattr(md, "chunks", ())) for md in metadata.state_dict_metadata.values())
        return {"metadata_bytes": os.path.getsize(work / CKPT / ".metadata"), "chunks": chunks,
                "entries": len(metadata.state_dict_metadata), "gather_plans_bytes": plan_bytes,
                "gather_results_bytes": result_bytes}

    def load_side(self, job: Job, work: Path, meter: Meter) -> None:
        rank = job.reader
        with fake_world(rank, job.world):
            self._load(job, work, meter, rank, dtensor_state(job, job.load, rank))

    def _load(self, job: Job, work: Path, meter: Meter, rank: int, state: dict) -> None:
        meter.start()
        with meter.phase("unpickle"):
            reader = FileSystemReader(str(work / CKPT))
            metadata = reader.read_metadata()
        with meter.phase("plan"):
            planner = DefaultLoadPlanner()
            planner.set_up_planner(state, metadata, False)
            reader.set_up_storage_reader(metadata, False)
            plan = reader.prepare_local_plan(planner.create_local_plan())
            blob = pickle.dumps(plan)  # gather_object to the coordinator
        meter.fact("headline", ["unpickle", "plan"])
        storage = metadata.storage_data
        chunks = {item.storage_index for item in plan.items}
        meter.fact("rank", rank)
        meter.fact("read_items", len(plan.items))
        meter.fact("plan_bytes", len(blob))
        meter.fact("metadata_read_bytes", os.path.getsize(work / CKPT / ".metadata"))
        meter.fact("read_verified_bytes", None)  # DCP has no verification
        meter.fact("read_unverified_bytes", sum(storage[i].length for i in chunks))
        meter.fact("needed_bytes", sum(4 * math.prod(i.lengths) for i in plan.items if i.lengths is not None))

    def save_other(self, job: Job, work: Path, meter: Meter) -> None:
        rank = min(1, job.world - 1)
        with fake_world(rank, job.world):
            self._other(job, work, meter, rank, dtensor_state(job, job.save, rank))

    def _other(self, job: Job, work: Path, meter: Meter, rank: int, state: dict) -> None:
        dest = work / f"other-{os.getpid()}"
        meter.start()
        with meter.phase("local_plan"):
            planner = DefaultSavePlanner()
            planner.set_up_planner(state, None, False)
            writer = FileSystemWriter(str(dest))
            writer.set_up_storage_writer(False, rank=rank)
            plan = writer.prepare_local_plan(planner.create_local_plan())
            blob = pickle.dumps(plan)  # gather_object to the coordinator
        with meter.phase("global_plan"):
            mine = pickle.loads(read_blob(work / GLOBALS, rank))  # scatter_object from the coordinator
            planner.finish_plan(mine)
        with meter.phase("results"):
            stage = job.save.mesh.coords(rank).get("pp") if job.save.pp > 1 else None
            pickle.dumps(write_results(rank, mine, _flat_keys(job, stage)[1]))
        meter.fact("headline", list(meter.phases))
        meter.fact("plan_bytes", len(blob))
        meter.fact("plan_matches_sim", plan.items == save_plan(job, rank).items)
        shutil.rmtree(dest, ignore_errors=True)

    def save_commit(self, job: Job, work: Path, meter: Meter) -> None:
        dest = work / f"commit-{os.getpid()}"
        os.makedirs(dest)
        meter.start()
        with meter.phase("gather_plans"):
            plans = [pickle.loads(b) for b in read_blobs(work / PLANS)]
        with meter.phase("global_plan"):
            global_plan, metadata = DefaultSavePlanner().create_global_plan(plans)
            writer = FileSystemWriter(str(dest))
            global_plan = writer.prepare_global_plan(global_plan)
            blobs = [pickle.dumps(p) for p in global_plan]  # scatter_object
        with meter.phase("gather_results"):
            results = [pickle.loads(b) for b in read_blobs(work / RESULTS)]
        with meter.phase("finish"):
            writer.finish(metadata, results)
        meter.fact("headline", list(meter.phases))
        meter.fact("scatter_bytes", sum(len(b) for b in blobs))
        shutil.rmtree(dest, ignore_errors=True)


__all__ = ["DCP", "dtensor_state", "fake_world", "save_plan", "torch_placements", "write_results"]
