"""Format v1's save, fed synthetic per-rank inputs: the same functions the distributed path runs.

``rank_state`` builds the ``RankState`` ``saving.describe.describe`` builds for that rank's
DTensors: the Layout the DTensor adapter reads off FSDP2-over-TP placements, the boxes
``layout.topology.held_boxes`` gives at the rank's (dp, tp) coordinates, the placement
record ``layout.dtensor.placement_record`` writes; AdamW's 0-d ``step`` tensors as plain
tensors (one box, no placement); ``optim.param_groups`` as the typed JSON value
``get_optimizer_state_dict`` gives. ``written_file`` lays out the file a rank writes exactly
as ``write_shard_file`` does (``my_items`` -> ``file_order`` -> the shard header) and gives
it the records of a file whose data bytes are all zero (a sparse file): the chunk digests
are the real digests of such a file, so a checkpoint built here passes ``validate``, deep
included, with data files that hold only their headers (``write_sparse``).
"""

from __future__ import annotations

import datetime as dt
import os
from functools import cache
from pathlib import Path

import torch

from benchmarks.scale.layouts import DTYPE, LR, Job, Topo
from shardfmt.format import hashing, jsonvalue
from shardfmt.format.manifest import Manifest, Topology, rank_file_name
from shardfmt.layout.dtensor import placement_record
from shardfmt.layout.geometry import Box
from shardfmt.layout.topology import held_boxes
from shardfmt.saving.messages import HeldTensor, RankState, WrittenFile
from shardfmt.saving.options import SaveOptions, Seams
from shardfmt.saving.plan import WriteKey, my_items
from shardfmt.saving.protocol import _commit
from shardfmt.saving.shard_file import ShardSpec, _shard_header, _written_file, file_order
from shardfmt.saving.writer import CheckpointWriter

SAVE_ID = "5ca1e5ca1e5ca1e0"  # pinned, with the clock: the same job gives the same manifest bytes
CREATED = dt.datetime(2026, 12, 2, tzinfo=dt.timezone.utc)
STEP = 1000
_EMPTY = torch.empty(0)  # the data of a piece: never read by the planning functions


def param_groups(job: Job, topo: Topo, stage: int | None) -> list[dict]:
    """``optim.param_groups`` as ``get_optimizer_state_dict`` gives it for the stage's parameters
    (AdamW's defaults at ``lr=LR``, ``params`` the parameter FQNs in registration order)."""
    group = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=LR).param_groups[0]
    names = [p.name for p in job.params if stage is None or job.stage(p, topo.pp) == stage]
    return [{**{k: v for k, v in group.items() if k != "params"}, "params": names}]


@cache
def _encoded_groups(job: Job, stage: int | None):
    return jsonvalue.encode(param_groups(job, job.save, stage), where="optim.param_groups")


def rank_state(job: Job, rank: int) -> RankState:
    """What ``describe`` gives on ``rank`` of ``job.save`` for the job's state dict."""
    topo = job.save
    coords = topo.mesh.coords(rank)
    sub = {"dp": coords["dp"], "tp": coords["tp"]}  # the DTensor's own mesh: (dp, tp) of the stage
    sizes = {"dp": topo.dp, "tp": topo.tp}
    held, plain = [], []
    for t in job.tensors:
        if not job.held_by(t, topo, coords):
            continue
        if t.plain:
            plain.append(HeldTensor(fqn=t.fqn, dtype=DTYPE, shape=t.shape, boxes=(Box.full(t.shape),)))
            continue
        lay = job.layout(t.param, topo)
        boxes = tuple(hb.box for hb in held_boxes(t.shape, lay, sub, sizes))
        held.append(HeldTensor(fqn=t.fqn, dtype=DTYPE, shape=t.shape, placement=placement_record(lay), boxes=boxes))
    stage = coords.get("pp") if topo.pp > 1 else None
    return RankState(rank=rank, tensors=tuple(held + plain), values={"optim.param_groups": _encoded_groups(job, stage)})


def pieces_of(state: RankState) -> dict[str, list[tuple[Box, torch.Tensor]]]:
    """The (box, local data) pairs ``describe`` pairs with the state; the data is never read here."""
    return {t.fqn: [(b, _EMPTY) for b in t.boxes] for t in state.tensors}


def file_specs(state: RankState, writers: dict[WriteKey, int], rank: int) -> list[ShardSpec]:
    """What ``rank`` writes, in data-file order: the protocol's ``my_items`` -> ``_shard_data``."""
    items = my_items(state, pieces_of(state), writers, rank=rank)
    return file_order([ShardSpec(fqn=it.fqn, dtype=torch.float32, shape=tuple(it.box.lengths),
                                 global_shape=tuple(it.global_shape), offsets=tuple(it.box.offsets),
                                 placement=it.placement) for it in items])


@cache
def _zero_digest(n: int) -> str:
    return hashing.digest_bytes(bytes(n))


def sparse_chunks(header: bytes, size: int, chunk: int) -> list[str]:
    """The chunk digests of a ``size``-byte file holding ``header`` and then zeros."""
    out = []
    for start in range(0, size, chunk):
        end = min(start + chunk, size)
        if start < len(header):
            out.append(hashing.digest_bytes(header[start:end] + bytes(max(0, end - max(start, len(header))))))
        else:
            out.append(_zero_digest(end - start))
    return out


def written_file(specs: list[ShardSpec], rank: int, *, chunk: int) -> tuple[WrittenFile, bytes] | None:
    """The records ``write_shard_file`` returns for ``specs`` (data all zeros), and the header bytes."""
    if not specs:
        return None
    name = rank_file_name(rank)
    header = _shard_header(name, rank, specs)
    chunks = sparse_chunks(header.data, header.file_size, chunk)
    grid = hashing.ChunkGrid.regular(size=header.file_size, chunk_size=chunk)
    return _written_file(name, rank, header, specs, chunks, grid), header.data


def write_sparse(directory: Path, name: str, header: bytes, size: int) -> None:
    """A data file as a real rank leaves it, with zeros for data: the header, then a hole."""
    path = directory / name
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.write(header)
        f.truncate(size)


def save_options(job: Job) -> SaveOptions:
    mesh = dict(job.save.mesh.dims)
    return SaveOptions(mesh=mesh, format_version=1, _seams=Seams(save_id=SAVE_ID, clock=lambda: CREATED))


def topology(job: Job) -> Topology:
    """The manifest's topology: what ``protocol._topology`` makes of ``mesh=``."""
    return Topology(world_size=job.world, mesh=job.save.mesh.dims)


def new_writer(job: Job, path: Path) -> CheckpointWriter:
    """Rank 0's writer, staged (step 5 of the protocol); its staging dir gets an empty ``data``."""
    w = CheckpointWriter(str(path), options=save_options(job))
    w.stage()
    os.makedirs(os.path.join(w.staging, "data"), exist_ok=True)
    return w


def commit(job: Job, writer: CheckpointWriter, states: list[RankState], files: list[WrittenFile]) -> Manifest:
    """Step 7 on rank 0: ``protocol._commit`` (records, manifest with its tiling check, publish)."""
    return _commit(writer, states, files, step=STEP, metadata=None, topology=topology(job))

