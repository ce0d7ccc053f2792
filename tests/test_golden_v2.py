"""The writer reproduces spec/golden/v2 byte for byte (clock, save id, versions pinned); it loads
bit for bit, validates deep, and reads correctly at another topology.

spec/golden/v2 is four ranks on the mesh dp=2 x tp=2, written from one process, holding both
kinds of stored tensor (spec/FORMAT.md section 4.3):

- placed records, whose files hold exactly the boxes the writer rule gives
  (``layout.placed.written_by``): ``model.layers.0.wq`` (strided_shard over dp, shard over tp:
  one box per rank), ``model.layers.0.w1`` (strided_shard over dp alone: two boxes on each
  writer, keys ``fqn@offsets``; tp is its replica dim, member 0 writes), ``model.layers.0.wo``
  (replicated over dp, columns over tp; writer 1: the dp=1 ranks write), ``model.norm``
  (replicated everywhere: writer 5 is member 5 mod 4 = rank 1), the 0-d ``model.scale``
  (writer 3: rank 3), and two flat ones (ZeRO): ``optim.avg`` (``flat`` over dp, offset 0,
  pieces of 3: ZeRO-3's chunks; tp is its replica dim, writer 1: the tp=1 ranks write) and
  ``optim.w2`` (columns over tp, then each rank's 3 x 3 or 3 x 2 box flat over dp from offset 2
  in pieces of 6, as a ZeRO-1/2 group window: a run of whole rows is one box, a run that starts
  or ends inside a row two);
- listed boxes: ``model.emb`` (rows [0, 18) on rank 0, whose 4608 bytes are two 4096-byte
  chunks, and [18, 24) on rank 1), the 0-d ``optim.step`` and the storage
  ``.storage.model.rope.cos`` that the views ``model.rope.cos`` and ``model.rope.sin`` read;
- an alias (``model.head`` of ``model.emb``), a replicated value and a per-rank value (in each
  rank's index).

Regenerate (only with a format change and a spec diff): ``python tests/test_golden_v2.py --write``.
"""

from __future__ import annotations

import datetime as dt
import os
import shutil
import sys

import pytest
import torch

import shardfmt
from shardfmt import PerRank, ShardedTensor, errors
from shardfmt.format.manifest import Placed, Placement, Topology, ViewRecord
from shardfmt.layout.placed import written_by
from shardfmt.layout.topology import layout_from_record
from shardfmt.saving.options import SaveOptions, Seams
from shardfmt.saving.shard_file import ShardData
from shardfmt.saving.writer import CheckpointWriter

HERE = os.path.dirname(os.path.abspath(__file__))
GOLDEN = os.path.normpath(os.path.join(HERE, "..", "spec", "golden", "v2"))
MESH = (("dp", 2), ("tp", 2))
WORLD = 4
FILES = ("COMMITTED", "manifest.json", "index/ranks_00000000.json",
         *(f"index/rank_{r:05d}.json" for r in range(WORLD)),
         *(f"data/rank_{r:05d}.safetensors" for r in range(WORLD)))


def tensors() -> dict[str, torch.Tensor]:
    """The stored tensors of spec/golden/v2, whole (storage buffers included)."""
    return {
        "model.emb": torch.arange(24 * 64, dtype=torch.float32).reshape(24, 64) / 16,
        "model.layers.0.wq": torch.arange(32, dtype=torch.float32).reshape(8, 4) / 4 - 3,
        "model.layers.0.w1": (torch.arange(32, dtype=torch.float32).reshape(8, 4) / 8).to(torch.float16),
        "model.layers.0.wo": torch.arange(24, dtype=torch.float32).reshape(4, 6) * -2,
        "model.norm": torch.linspace(-1, 1, 5).to(torch.bfloat16),
        "model.scale": torch.tensor(0.5),
        "optim.step": torch.tensor(7, dtype=torch.int64),
        "optim.w2": torch.arange(15, dtype=torch.float32).reshape(3, 5) + 100,
        "optim.avg": torch.arange(5, dtype=torch.float32) - 2,
        ".storage.model.rope.cos": torch.arange(10, dtype=torch.float32) / 10,
    }


def placement(mesh_dims: tuple[str, ...], *placements: tuple) -> Placement:
    return Placement(mesh_dims=mesh_dims, placements=tuple(placements), stage=None)


# fqn -> its placement and writer number (spec section 4.3, writer rule)
PLACED = {
    "model.layers.0.wq": Placed(placement=placement(("dp", "tp"), ("strided_shard", 0, 2), ("shard", 0)), writer=0),
    "model.layers.0.w1": Placed(placement=placement(("dp",), ("strided_shard", 0, 2)), writer=0),
    "model.layers.0.wo": Placed(placement=placement(("dp", "tp"), ("replicate",), ("shard", 1)), writer=1),
    "model.norm": Placed(placement=placement(()), writer=5),
    "model.scale": Placed(placement=placement(("tp",), ("replicate",)), writer=3),
    "optim.w2": Placed(placement=placement(("tp", "dp"), ("shard", 1), ("flat", 2, 6)), writer=0),
    "optim.avg": Placed(placement=placement(("dp",), ("flat", 0, 3)), writer=1),
}
# listed boxes: fqn -> [(rank, offsets, lengths)]
LISTED = {
    "model.emb": [(0, (0, 0), (18, 64)), (1, (18, 0), (6, 64))],
    "optim.step": [(1, (), ())],
}
STORAGE = ".storage.model.rope.cos"  # written by rank 0, whole
VIEWS = {"model.rope.cos": ((2, 3), ViewRecord(base=STORAGE, storage_offset=0, stride=(3, 1))),
         "model.rope.sin": ((4,), ViewRecord(base=STORAGE, storage_offset=6, stride=(1,)))}
PARAM_GROUPS = [{"lr": 0.001, "betas": (0.9, 0.999), "params": ["model.emb"]}]
RNG = {0: b"\x00\x01", 1: (float("nan"), 1 << 70), 2: {"seed": 2}, 3: [3, None]}


def _piece(t: torch.Tensor, offsets, lengths) -> torch.Tensor:
    return t[tuple(slice(o, o + n) for o, n in zip(offsets, lengths))]


def rank_shards(rank: int) -> list[ShardData]:
    """What ``rank`` writes: its boxes of each placed tensor (the writer rule) and its listed boxes."""
    full = tensors()
    out = []
    for fqn, placed in PLACED.items():
        t = full[fqn]
        for hb in written_by(tuple(t.shape), layout_from_record(placed.placement), MESH, writer=placed.writer,
                             rank=rank):
            out.append(ShardData(fqn=fqn, data=_piece(t, hb.box.offsets, hb.box.lengths).clone(),
                                 global_shape=tuple(t.shape), offsets=hb.box.offsets))
    for fqn, boxes in LISTED.items():
        t = full[fqn]
        out += [ShardData(fqn=fqn, data=_piece(t, o, n).clone(), global_shape=tuple(t.shape), offsets=o)
                for r, o, n in boxes if r == rank]
    return out


def write_golden(path: str) -> None:
    seams = Seams(
        save_id="0123456789abcdef",
        clock=lambda: dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.timezone.utc),
        writer_versions={"python": "3.x", "shardfmt": "golden", "torch": "2.x"},
    )
    writer = CheckpointWriter(path, options=SaveOptions(chunk_size=4096, format_version=2, _seams=seams))
    full = tensors()
    for rank in range(WORLD):
        storages = [ShardData(fqn=STORAGE, data=full[STORAGE], global_shape=(10,), offsets=(0,))] if rank == 0 else []
        writer.write_rank(rank, rank_shards(rank), storages=storages)
    for fqn, placed in PLACED.items():
        writer.place(fqn, placed_dtype(fqn), tuple(full[fqn].shape), placed)
    writer.add_alias("model.head", "model.emb")
    for fqn, (shape, view) in VIEWS.items():
        writer.add_view(fqn, "F32", shape, view)
    writer.add_value("optim.param_groups", PARAM_GROUPS)
    writer.add_value("rng", per_rank=RNG)
    writer.commit(step=7, metadata={"config": {"layers": 1}}, topology=Topology(world_size=WORLD, mesh=MESH))


def placed_dtype(fqn: str) -> str:
    return {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}[tensors()[fqn].dtype]


# ----------------------------------------------------------------------------- what a load sees


def whole_targets() -> dict:
    """The state dict spec/golden/v2 was saved from, empty (one process, whole tensors)."""
    full = tensors()
    model = {name[len("model."):]: torch.empty_like(t) for name, t in full.items() if name.startswith("model.")}
    layers = {k.split(".")[-1]: model.pop(k) for k in list(model) if k.startswith("layers.")}
    return {"model": {**model, "layers": {"0": layers}, "head": torch.empty(24, 64),
                      "rope": {"cos": torch.empty(2, 3), "sin": torch.empty(4)}},
            "optim": {"step": torch.empty((), dtype=torch.int64), "w2": torch.empty(3, 5), "avg": torch.empty(5),
                      "param_groups": None}, "rng": PerRank(None)}


def want(fqn: str) -> torch.Tensor:
    """What ``fqn`` holds, aliases and views included."""
    full = tensors()
    if fqn == "model.head":
        return full["model.emb"]
    if fqn in VIEWS:
        shape, view = VIEWS[fqn]
        return torch.as_strided(full[STORAGE], shape, view.stride, view.storage_offset)
    return full[fqn]


def test_writer_reproduces_golden_bytes(tmp_path):
    out = str(tmp_path / "golden")
    write_golden(out)
    for name in FILES:
        with open(os.path.join(GOLDEN, name), "rb") as f:
            golden = f.read()
        with open(os.path.join(out, name), "rb") as f:
            got = f.read()
        assert got == golden, f"{name} differs from spec/golden/v2"
    got = sorted(os.path.relpath(os.path.join(d, f), out) for d, _, fs in os.walk(out) for f in fs)
    assert got == sorted(FILES)


def test_golden_v2_holds_both_kinds_and_several_chunks_in_a_shard():
    m = shardfmt.read_manifest(GOLDEN)
    assert m.format_version == 2 and m.topology.mesh == MESH
    assert {f for f, r in m.tensors.items() if r.placed is not None} == set(PLACED)
    assert {f for f, r in {**m.tensors, **m.storages}.items() if r.listed is not None} == {*LISTED, STORAGE}
    # the files hold exactly the boxes the writer rule gives, each of their writer
    for fqn, placed in PLACED.items():
        for rank in range(WORLD):
            derived = {hb.box.offsets for hb in written_by(m.tensors[fqn].shape, layout_from_record(placed.placement),
                                                           MESH, writer=placed.writer, rank=rank)}
            stored = {s.offsets for s in m.tensors[fqn].shards if m.files[s.file].rank == rank}
            assert stored == derived, (fqn, rank)
    assert {s.key for s in m.tensors["model.layers.0.w1"].shards} == {
        "model.layers.0.w1@0,0", "model.layers.0.w1@2,0", "model.layers.0.w1@4,0", "model.layers.0.w1@6,0"}
    # the flat records: a rank's run of its box, cut in row-major boxes (spec 4.3 and 4.4)
    assert sorted((m.files[s.file].rank, s.offsets, s.lengths) for s in m.tensors["optim.w2"].shards) == [
        (0, (0, 0), (1, 3)), (0, (1, 0), (1, 1)), (1, (0, 3), (2, 2)),
        (2, (1, 1), (1, 2)), (2, (2, 0), (1, 3)), (3, (2, 3), (1, 2))]
    assert sorted((m.files[s.file].rank, s.offsets, s.lengths) for s in m.tensors["optim.avg"].shards) == [
        (1, (0,), (3,)), (3, (3,), (2,))]
    (emb0,) = [s for s in m.tensors["model.emb"].shards if s.offsets == (0, 0)]
    assert emb0.byte_range[1] - emb0.byte_range[0] == 4608 and m.chunk_size == 4096
    assert m.values["rng"].per_rank.keys() == {0, 1, 2, 3}


def test_golden_v2_loads_bit_for_bit_and_validates_deep():
    rep = shardfmt.validate(GOLDEN, deep=True)
    assert rep.ok, rep.problems
    for rank in range(WORLD):
        out = whole_targets()
        shardfmt.load(out, GOLDEN, rank=rank)
        flat = {"model.emb": out["model"]["emb"], "model.head": out["model"]["head"],
                "model.norm": out["model"]["norm"], "model.scale": out["model"]["scale"],
                "model.rope.cos": out["model"]["rope"]["cos"], "model.rope.sin": out["model"]["rope"]["sin"],
                "optim.step": out["optim"]["step"], "optim.w2": out["optim"]["w2"], "optim.avg": out["optim"]["avg"],
                **{f"model.layers.0.{k}": v for k, v in out["model"]["layers"]["0"].items()}}
        for fqn, got in flat.items():
            assert got.dtype == want(fqn).dtype and torch.equal(got, want(fqn)), (rank, fqn)
        assert out["optim"]["param_groups"][0]["betas"] == (0.9, 0.999)
        got_rng = out["rng"].value
        if rank == 1:
            assert got_rng[0] != got_rng[0] and got_rng[1] == 1 << 70  # nan, a big int
        else:
            assert got_rng == RNG[rank]


def test_golden_v2_loads_at_another_topology():
    """Three ranks, each a ShardedTensor slice of every tensor cut along its dim 0 (the alias
    too; whole: a 0-d tensor, the views): the slices cross the saved boxes."""
    names = [f for f in tensors() if f != STORAGE] + ["model.head", *VIEWS]
    for rank in range(3):
        targets, wanted = {}, {}
        for fqn in names:
            t = want(fqn)
            if t.dim() == 0 or fqn in VIEWS:  # a view loads only whole
                targets[fqn], wanted[fqn] = torch.empty_like(t), t
                continue
            lo, hi = rank * t.shape[0] // 3, (rank + 1) * t.shape[0] // 3
            local = torch.empty((hi - lo, *t.shape[1:]), dtype=t.dtype)
            targets[fqn] = ShardedTensor(local, tuple(t.shape), (lo, *(0,) * (t.dim() - 1)))
            wanted[fqn] = t[lo:hi]
        rep = shardfmt.load(targets, GOLDEN, strict=False)
        assert sorted(rep.loaded) == sorted(targets)
        for fqn, w in wanted.items():
            got = targets[fqn].local if isinstance(targets[fqn], ShardedTensor) else targets[fqn]
            assert torch.equal(got, w), (rank, fqn)


@pytest.mark.parametrize("rank,offsets,match", [(1, (0, 0), "does not have it write"), (0, (2, 0), "does not have it write"),
                                               (0, (0, 0), "wrote 8 of its 32 elements")])
def test_the_writer_refuses_a_placed_tensor_whose_files_hold_other_boxes(tmp_path, rank, offsets, match):
    """Rank 0 writes wq's rows [0, 2), rank 1 [4, 6), ...: a box on the wrong rank, one not
    derived, or only one of the four boxes."""
    writer = CheckpointWriter(str(tmp_path / "ck"), chunk_size=4096)
    wq = tensors()["model.layers.0.wq"]
    writer.write_rank(rank, [ShardData(fqn="model.layers.0.wq", data=wq[offsets[0]:offsets[0] + 2].clone(),
                                       global_shape=(8, 4), offsets=offsets)])
    writer.place("model.layers.0.wq", "F32", (8, 4), PLACED["model.layers.0.wq"])
    with pytest.raises(errors.CommitError, match=match):
        writer.commit(topology=Topology(world_size=WORLD, mesh=MESH))
    assert not os.path.exists(tmp_path / "ck")


def _wq_boxes() -> dict[int, list[tuple[int, ...]]]:
    """Rank -> the offsets of the wq boxes the writer rule has it write."""
    p = PLACED["model.layers.0.wq"]
    out = {}
    for rank in range(WORLD):
        boxes = written_by((8, 4), layout_from_record(p.placement), MESH, writer=p.writer, rank=rank)
        if boxes:
            out[rank] = [tuple(hb.box.offsets) for hb in boxes]
    return out


def _topology_first_writer(path) -> CheckpointWriter:
    """A writer told the topology before any file: it checks each file's placed boxes as it closes."""
    writer = CheckpointWriter(str(path), chunk_size=4096, topology=Topology(world_size=WORLD, mesh=MESH))
    writer.place("model.layers.0.wq", "F32", (8, 4), PLACED["model.layers.0.wq"])
    return writer


def _write_wq(writer: CheckpointWriter, rank: int, offsets: tuple[int, ...], *, part: int | None = None) -> None:
    wq = tensors()["model.layers.0.wq"]
    writer.write_rank(rank, [ShardData(fqn="model.layers.0.wq", data=wq[offsets[0]:offsets[0] + 2].clone(),
                                       global_shape=(8, 4), offsets=offsets)], part=part)


def test_a_writer_told_the_topology_first_refuses_a_wrong_box_as_its_file_closes(tmp_path):
    writers = _wq_boxes()
    first, other = sorted(writers)[:2]
    writer = _topology_first_writer(tmp_path / "ck")
    with pytest.raises(errors.CommitError, match="does not have it write"):
        _write_wq(writer, first, writers[other][0])  # another rank's box
    assert not os.path.exists(tmp_path / "ck")
    assert [p for p in os.listdir(tmp_path) if p != "ck"] == []  # the staging dir is gone too


def test_a_writer_told_the_topology_first_refuses_a_box_written_twice_in_place_of_another(tmp_path):
    """Every element count right: one box in two files of its rank, another box in none."""
    writers = _wq_boxes()
    boxes = [(r, o) for r in sorted(writers) for o in writers[r]]
    writer = _topology_first_writer(tmp_path / "ck")
    (r0, o0), missing = boxes[0], boxes[-1]
    _write_wq(writer, r0, o0, part=0)
    _write_wq(writer, r0, o0, part=1)
    for r, o in boxes[1:-1]:
        _write_wq(writer, r, o, part=0)
    assert missing != boxes[0]
    with pytest.raises(errors.CommitError, match="written twice and another of its size not at all"):
        writer.commit(topology=Topology(world_size=WORLD, mesh=MESH))
    assert not os.path.exists(tmp_path / "ck")


def test_a_writer_told_the_topology_first_commits_the_rule_s_boxes_and_refuses_another_topology(tmp_path):
    writers = _wq_boxes()
    for name, commit_topology in (("ok", None), ("other", Topology(world_size=WORLD, mesh=(("dp", 4), ("tp", 1))))):
        writer = _topology_first_writer(tmp_path / name)
        for r in sorted(writers):
            for o in writers[r]:
                _write_wq(writer, r, o)
        if commit_topology is None:
            m = writer.commit()
            assert m.tensors["model.layers.0.wq"].placed == PLACED["model.layers.0.wq"]
            got = torch.empty(8, 4)
            shardfmt.load({"model.layers.0.wq": got}, str(tmp_path / name))
            assert torch.equal(got, tensors()["model.layers.0.wq"])
        else:
            with pytest.raises(errors.CommitError, match="were checked against"):
                writer.commit(topology=commit_topology)
            assert not os.path.exists(tmp_path / name)


if __name__ == "__main__":
    if "--write" not in sys.argv:
        sys.exit("pass --write to regenerate spec/golden/v2 (a format change needs a spec diff too)")
    shutil.rmtree(GOLDEN, ignore_errors=True)
    write_golden(GOLDEN)
    print("wrote", GOLDEN)
