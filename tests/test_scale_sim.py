"""benchmarks/scale: the metadata-at-scale simulation builds what the real code paths build.

Fast: the simulation of the narrow ``tiny`` job (the 8B's tensors, 2 layers) at N=8 runs end
to end in this process, each simulated input equals what the real functions make from real
DTensors on that rank (torch's fake process group: one process plays rank r), and its
figures are the ones a reader can check by hand. Slow: 8 real processes (gloo) save the same
state with FSDP2 over TP, and their manifests (format v1 and v2) are byte for byte the simulation's.
"""

from __future__ import annotations

import math

import orjson
import pytest
import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

from benchmarks.scale import sim_v1
from benchmarks.scale.adapter import read_blobs
from benchmarks.scale.dcp import DCP, dtensor_state, fake_world, save_plan, torch_placements
from benchmarks.scale.layouts import LAYOUTS
from benchmarks.scale.measure import Meter
from benchmarks.scale.v1 import CKPT, V1, load_layouts
from benchmarks.scale.v2 import V2
from shardfmt.format.manifest import MANIFEST_NAME
from shardfmt.loading.options import LoadOptions
from shardfmt.loading.reader import read_manifest
from shardfmt.loading.request import request_load
from shardfmt.loading.targets import targets_for_rank
from shardfmt.saving.describe import describe
from shardfmt.validation import validate

N = 8
JOB = LAYOUTS["tiny"](N)


@pytest.fixture(scope="module")
def v1_work(tmp_path_factory):
    work = tmp_path_factory.mktemp("scale-v1")
    facts = V1().prepare(JOB, work)
    return work, facts


def _share(topo, rank: int) -> int:
    """Bytes rank ``rank`` of ``topo`` holds, from torch's own layout math (not shardfmt's)."""
    coords = topo.mesh.coords(rank)
    total = 0
    for t in JOB.tensors:
        if t.plain:
            total += 4
            continue
        pl = torch_placements(t.param.style, topo.tp)
        shape, _ = _compute_local_shape_and_global_offset(t.shape, (topo.dp, topo.tp), [coords["dp"], coords["tp"]], pl)
        total += 4 * math.prod(shape)
    return total


def test_rank_states_are_what_describe_makes_of_real_dtensors():
    for rank in range(N):
        with fake_world(rank, N):
            got, _ = describe(dtensor_state(JOB, JOB.save, rank), rank)
        assert got == sim_v1.rank_state(JOB, rank), f"rank {rank}"


def test_dcp_plans_are_what_its_planner_makes_of_real_dtensors():
    for rank in (0, 3, N - 1):
        with fake_world(rank, N):
            planner = DefaultSavePlanner()
            planner.set_up_planner(dtensor_state(JOB, JOB.save, rank), None, rank == 0)
            real = planner.create_local_plan()
        sim = save_plan(JOB, rank)
        assert real.items == sim.items and real.planner_data == sim.planner_data, f"rank {rank}"


def test_v1_checkpoint_is_complete_and_valid(v1_work):
    work, facts = v1_work
    report = validate(str(work / CKPT), deep=True)  # headers, tiling and every chunk digest (zeros)
    assert report.ok, report
    m = read_manifest(str(work / CKPT))
    assert len(m.tensors) == facts["tensors"] == len(JOB.tensors) == 84
    assert dict(m.topology.mesh) == {"dp": 2, "tp": 4}
    # every byte of the state is written exactly once, each tensor by its shards
    assert sum(f.size - f.header_size for f in m.files.values()) == JOB.total_bytes()


def test_load_targets_are_what_load_makes_of_real_dtensors(v1_work):
    work, _ = v1_work
    m = read_manifest(str(work / CKPT))
    for rank in (0, JOB.reader, N - 1):
        with fake_world(rank, N):
            state = dtensor_state(JOB, JOB.load, rank, memory=True)
            req = request_load(state, m, LoadOptions(), rank=rank, world_size=N, source="sim")
        sim = targets_for_rank(m, JOB.load.mesh, rank, layouts=load_layouts(JOB))
        assert [(t.src.fqn, t.src.box) for t in req.targets] == [(t.fqn, t.box) for t in sim], f"rank {rank}"


def test_v1_sides_run_and_their_figures_add_up(v1_work):
    work, facts = v1_work
    load = Meter()
    V1().load_side(JOB, work, load)
    f = load.facts
    assert f["needed_bytes"] == _share(JOB.load, JOB.reader)
    assert f["needed_bytes"] <= f["read_unverified_bytes"] <= f["read_verified_bytes"]
    assert f["metadata_read_bytes"] > facts["metadata_bytes"]  # + COMMITTED + the headers read
    other, commit = Meter(), Meter()
    V1().save_other(JOB, work, other)
    V1().save_commit(JOB, work, commit)
    for meter in (load, other, commit):
        res = meter.result()
        assert set(res["facts"]["headline"]) <= set(res["phases"])
        assert res["cpu_s"] > 0 and all(p["cpu_s"] >= 0 for p in res["phases"].values())
    # the commit built the same manifest again: the broadcast it encodes is the one prepare wrote
    blob = read_blobs(work / "committed.bin")[0]
    assert commit.facts["broadcast_bytes"] == len(blob)
    assert orjson.loads(blob)["body"]["manifest"].encode() == (work / CKPT / MANIFEST_NAME).read_bytes()


def test_dcp_sides_run_and_their_figures_add_up(tmp_path):
    facts = DCP().prepare(JOB, tmp_path)
    assert facts["entries"] == len(JOB.tensors) + 12  # + param_groups' 12 keys (DCP flattens the list)
    load, other, commit = Meter(), Meter(), Meter()
    DCP().load_side(JOB, tmp_path, load)
    DCP().save_other(JOB, tmp_path, other)
    DCP().save_commit(JOB, tmp_path, commit)
    assert load.facts["needed_bytes"] == _share(JOB.load, JOB.reader)
    assert load.facts["read_unverified_bytes"] >= load.facts["needed_bytes"]  # whole saved chunks
    assert other.facts["plan_matches_sim"]
    assert not torch.distributed.is_initialized()


def _diff(real: dict, sim: dict, path: str = "") -> list[str]:
    """Where two JSON documents differ (the first few paths), for a failing comparison."""
    if isinstance(real, dict) and isinstance(sim, dict):
        out = [f"{path}.{k}: only in {'real' if k in real else 'sim'}" for k in set(real) ^ set(sim)]
        for k in sorted(set(real) & set(sim)):
            out += _diff(real[k], sim[k], f"{path}.{k}")
        return out[:10]
    if isinstance(real, list) and isinstance(sim, list) and len(real) == len(sim):
        return [d for i, (a, b) in enumerate(zip(real, sim)) for d in _diff(a, b, f"{path}[{i}]")][:10]
    return [] if real == sim else [f"{path}: real {str(real)[:200]} != sim {str(sim)[:200]}"]


@pytest.mark.slow
def test_a_real_fsdp2_over_tp_save_is_the_simulation(tmp_path):
    """8 gloo ranks: torchtitan's TP plan + fully_shard, AdamW stepped, shardfmt.save; the
    simulation of the same job writes the same manifest, byte for byte (every tensor is zero,
    so even the chunk digests agree), and every rank described what the simulation says."""
    from tests.distributed.harness import check_all_ok, launch

    real, real_v2 = tmp_path / "real", tmp_path / "real-v2"
    results = check_all_ok(launch("scale_fsdp_tp", N, {"path": str(real), "path_v2": str(real_v2)},
                                  out_dir=str(tmp_path / "out"), timeout=300, module="tests.distributed.scale_workers"))
    assert results[0]["placements"]["layers.0.attention.wq.weight"] == ["_StridedShard(dim=0, sf=4)", "Shard(dim=0)"]
    assert results[0]["placements"]["layers.0.feed_forward.w2.weight"] == ["Shard(dim=0)", "Shard(dim=1)"]
    assert results[0]["placements"]["tok_embeddings.weight"] == ["_StridedShard(dim=0, sf=4)", "Shard(dim=0)"]
    for rank, res in enumerate(results):
        sim = orjson.loads(orjson.dumps(sim_v1.rank_state(JOB, rank).to_json()))
        assert res["state"] == sim, (rank, _diff(res["state"], sim))
    (tmp_path / "sim").mkdir()
    V1().prepare(JOB, tmp_path / "sim")
    got = (real / MANIFEST_NAME).read_bytes()
    want = (tmp_path / "sim" / CKPT / MANIFEST_NAME).read_bytes()
    assert got == want, _diff(orjson.loads(got), orjson.loads(want))
    # v2: the root digests the rank table's parts, which digest every rank index (its files'
    # sizes, header and chunk digests): equal roots mean the same checkpoint, all of it
    (tmp_path / "sim-v2").mkdir()
    facts = V2().prepare(JOB, tmp_path / "sim-v2")
    got = (real_v2 / MANIFEST_NAME).read_bytes()
    want = (tmp_path / "sim-v2" / CKPT / MANIFEST_NAME).read_bytes()
    assert got == want, _diff(orjson.loads(got), orjson.loads(want))
    assert facts["placed"] == len(JOB.tensors) and facts["groups"] == 1
    assert validate(str(real_v2), deep=True).ok


def test_projection_fits_the_growth_of_the_two_largest_points():
    from benchmarks.scale.cli import project

    assert project([], 1024) is None
    t, how = project([(64, 1.0)], 256)
    assert t == pytest.approx(4.0) and "linear" in how
    t, how = project([(64, 1.0), (256, 2.0), (1024, 8.0)], 4096)  # N^1 from the two largest
    assert t == pytest.approx(32.0) and "256,1024" in how
    t, _ = project([(64, 1.0), (256, 16.0)], 1024)  # N^2
    assert t == pytest.approx(256.0)


@pytest.mark.slow
def test_the_command_measures_what_fits_and_projects_what_does_not(tmp_path):
    """One command, fresh processes: N=8 measured, N=16 skipped by a tiny budget, with the
    projection and the reason in the JSON and the table."""
    import json
    import subprocess
    import sys

    from benchmarks.scale.measure import child_env

    out = tmp_path / "out"
    p = subprocess.run([sys.executable, "-m", "benchmarks.scale", "--layouts", "tiny", "--ranks", "8,16",
                        "--repeat", "1", "--budget-s", "0.001", "--work", str(tmp_path / "w"), "--out", str(out)],
                       capture_output=True, text=True, env=child_env(), timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    doc = json.loads((out / "scale.json").read_text())
    by = {(r["n"], r["adapter"]): r for r in doc["results"]}
    for adapter in ("v1", "dcp"):
        small, big = by[(8, adapter)], by[(16, adapter)]
        for side in ("load_side", "save_other", "save_commit"):
            assert small[side]["summary"]["runs"] == 1
            assert "projected" in big[side]["skipped"] and big[side]["projected_cpu_s"] > 0
    assert "skipped (proj." in (out / "scale.md").read_text()
