"""Flat partitions (``shardfmt.FlatShard``, ``shardfmt.flat_group``): ZeRO-3's per-parameter
chunks and ZeRO-1/2's windows of a group buffer, saved and loaded bit for bit, to and from
other layouts; their padding is never saved and never written.

One process here; ``test_flat_partitions_saved_by_two_ranks_load_into_any_layout`` saves
them from two gloo ranks and loads them into DTensors on two ranks."""

from __future__ import annotations

import math

import pytest
import torch

import shardfmt
from shardfmt.errors import CommitError, ShapeError, StateDictError

SHAPES = {"embed": (10, 6), "wq": (6, 6), "norm": (6,), "scale": ()}
PAD = -7.0  # what padding holds: a load must leave it so


def truth() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {k: torch.randn(s, generator=g) for k, s in SHAPES.items()}


def zero3(full: dict[str, torch.Tensor], rank: int, world: int, *, fill: bool = True,
          mesh_dim: str | None = None) -> dict:
    """ZeRO-3: each tensor flattened, padded to a multiple of ``world``, rank r holds chunk r."""
    out = {}
    for k, t in full.items():
        n = t.numel()
        part = math.ceil(n / world)
        buf = torch.full((part,), PAD)
        if fill:
            got = t.reshape(-1)[rank * part:(rank + 1) * part]
            buf[:got.numel()] = got
        out[k] = shardfmt.FlatShard.chunk(buf, t.shape, coord=rank, count=world, mesh_dim=mesh_dim)
        assert out[k].start == rank * part
    return out


def group_members(full, align: int = 4):
    """ZeRO-1/2: the tensors laid one after another in one group buffer, each aligned to ``align`` elements."""
    members, off = [], 0
    for k, t in full.items():
        members.append((k, tuple(t.shape), off))
        off += math.ceil(t.numel() / align) * align
    return members, off


def zero12(full: dict[str, torch.Tensor], rank: int, world: int, *, fill: bool = True,
           mesh_dim: str | None = None) -> dict:
    members, total = group_members(full)
    part = math.ceil(total / world)
    flat = torch.full((part * world,), PAD)
    if fill:
        for k, _, off in members:
            flat[off:off + full[k].numel()] = full[k].reshape(-1)
    window = flat[rank * part:(rank + 1) * part].clone()
    return shardfmt.flat_group(window, members, start=rank * part, mesh_dim=mesh_dim)


def _flat_of(full, part: shardfmt.FlatShard) -> torch.Tensor:
    return full.reshape(-1)[part.start:part.start + part.local.numel()]


@pytest.mark.parametrize("world", [1, 3, 4])
@pytest.mark.parametrize("kind", [zero3, zero12])
def test_a_whole_checkpoint_loads_into_flat_partitions_and_leaves_their_padding(tmp_path, kind, world):
    full = truth()
    shardfmt.save(full, str(tmp_path / "c"))
    for rank in range(world):
        parts = kind(full, rank, world, fill=False)
        shardfmt.load(parts, str(tmp_path / "c"), strict=False)
        for k, p in parts.items():
            want = _flat_of(full[k], p)
            assert torch.equal(p.local[:want.numel()], want), (k, rank)
            assert (p.local[want.numel():] == PAD).all(), (k, rank)


def test_a_flat_partition_that_is_the_whole_tensor_round_trips(tmp_path):
    full = truth()
    shardfmt.save(zero3(full, 0, 1), str(tmp_path / "c"))
    back = {k: torch.zeros(s) for k, s in SHAPES.items()}
    shardfmt.load(back, str(tmp_path / "c"))
    assert all(torch.equal(back[k], full[k]) for k in full)


def test_a_group_window_skips_the_members_it_does_not_touch():
    members = [("a", (2, 3), 0), ("b", (5,), 8), ("c", (4,), 13)]
    parts = shardfmt.flat_group(torch.arange(10.0), members, start=5)
    assert {k: (p.start, p.local.tolist()) for k, p in parts.items()} == {
        "a": (5, [0.0]), "b": (0, [3.0, 4.0, 5.0, 6.0, 7.0]), "c": (0, [8.0, 9.0])}
    assert set(shardfmt.flat_group(torch.arange(3.0), members, start=5)) == {"a"}  # [5, 8): the pad after a


@pytest.mark.parametrize("bad", [lambda: shardfmt.FlatShard(torch.zeros(2, 3), (6,), 0),
                                 lambda: shardfmt.FlatShard(torch.zeros(8)[::2], (8,), 0),
                                 lambda: shardfmt.FlatShard(torch.zeros(3), (6,), -1)])
def test_a_flat_shard_that_is_not_a_contiguous_run_is_refused(bad):
    with pytest.raises(ShapeError, match="FlatShard"):
        bad()


def test_one_process_saving_part_of_a_tensor_as_a_flat_range_commits_nothing(tmp_path):
    with pytest.raises(CommitError, match="'embed'.*tile"):
        shardfmt.save({"embed": shardfmt.FlatShard(torch.zeros(7), (10, 6), 3)}, str(tmp_path / "c"))
    assert not (tmp_path / "c").exists() or not (tmp_path / "c" / "COMMITTED").exists()


def test_a_flat_shard_of_another_shape_than_the_checkpoint_is_refused(tmp_path):
    shardfmt.save(truth(), str(tmp_path / "c"))
    with pytest.raises((ShapeError, StateDictError), match="embed"):
        shardfmt.load({"embed": shardfmt.FlatShard(torch.zeros(60), (6, 10), 0)}, str(tmp_path / "c"), strict=False)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["zero3", "zero12", "zero3_placed", "zero12_placed"])
def test_flat_partitions_saved_by_two_ranks_load_into_any_layout(tmp_path, kind):
    """2 gloo ranks save their partitions (padding holds garbage); one process loads the whole
    tensors and 3-rank partitions of both kinds; 2 ranks load them as DTensors (Shard(1)).
    With their ``Flat`` layouts (``_placed``), the root records each tensor's placement (a 0-d
    one excepted) and no box."""
    from tests.distributed.harness import check_all_ok, launch

    path = str(tmp_path / "c")
    check_all_ok(launch("flat_save", 2, {"path": path, "kind": kind}, out_dir=str(tmp_path / "out")))
    root = shardfmt.read_manifest(path)
    placed = sorted(k for k, t in root.tensors.items() if t.placed is not None)
    assert placed == (sorted(k for k, s in SHAPES.items() if s) if kind.endswith("_placed") else [])
    full = truth()
    back = {k: torch.zeros(s) for k, s in SHAPES.items()}
    shardfmt.load(back, path)
    assert all(torch.equal(back[k], full[k]) for k in full)
    assert shardfmt.validate(path, deep=True).ok
    for other in (zero3, zero12):
        for rank in range(3):
            parts = other(full, rank, 3, fill=False)
            shardfmt.load(parts, path, strict=False)
            assert all(torch.equal(p.local[:_flat_of(full[k], p).numel()], _flat_of(full[k], p))
                       for k, p in parts.items())
    results = check_all_ok(launch("flat_load_dtensor", 2, {"path": path}, out_dir=str(tmp_path / "out2")))
    assert all(r["equal"] == sorted(SHAPES) for r in results)


def test_layouts_a_reader_would_refuse_are_saved_as_listed_boxes_never_as_broken_records(tmp_path):
    """A stage without a pp dim, a flat entry before a shard, a flat part too short to reach the
    end, a flat layout in a v1 save: each checkpoint commits, validates and loads back whole."""
    from shardfmt.layout.topology import Flat, Layout, Replicate, Shard

    full = truth()["embed"]
    cases = {
        "stage-without-pp": (shardfmt.ShardedTensor(full.clone(), full.shape, (0, 0),
                                                    layout=Layout(("dp",), (Replicate(),), stage=0)), 2),
        "flat-before-shard": (shardfmt.FlatShard(full.reshape(-1).clone(), full.shape, 0,
                                                 layout=Layout(("dp", "tp"), (Flat(0, 60), Shard(1)))), 2),
        "flat-short": (shardfmt.FlatShard(full.reshape(-1).clone(), full.shape, 0,
                                          layout=Layout(("dp",), (Flat(0, 30),))), 2),
        "v1-flat": (shardfmt.FlatShard(full.reshape(-1).clone(), full.shape, 0,
                                       layout=Layout(("dp",), (Flat(0, 60),))), 1),
    }
    for name, (value, version) in cases.items():
        path = str(tmp_path / name)
        shardfmt.save({"embed": value}, path, mesh={"dp": 1, "tp": 1}, format_version=version)
        assert shardfmt.validate(path, deep=True).ok, name
        back = {"embed": torch.zeros_like(full)}
        shardfmt.load(back, path)
        assert torch.equal(back["embed"], full), name
