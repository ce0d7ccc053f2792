"""Distributed save and resharding load with real processes (gloo on 127.0.0.1)."""

import os
import time

import pytest
import torch
from conftest import as_next_format_version, flip_byte

import shardfmt
from tests.distributed.harness import check_all_ok, launch
from tests.distributed.model import specs, truth

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist")
    paths = {"ckpt3d": str(root / "ck3d"), "fsdp": str(root / "fsdp")}
    save3d = check_all_ok(launch("save3d", 8, {"path": paths["ckpt3d"]}, out_dir=str(root / "o3d")))
    check_all_ok(launch("savefsdp", 4, {"path": paths["fsdp"]}, out_dir=str(root / "ofsdp")))
    return paths, save3d, root


def test_8_rank_pp_dp_tp_save_round_trips_on_the_same_topology(ckpts):
    _, results, _ = ckpts
    for r, res in enumerate(results):
        assert res["bad"] == [], f"rank {r}: slices differ after same-topology load: {res['bad']}"
        assert res["rng"] == {"rank": r, "seed": 1000 + r}, "PerRank value did not come back to its rank"
        assert res["step"] == 100 and res["betas"] == [0.9, 0.95]


def test_manifest_records_topology_placements_and_writes_replicas_once(ckpts):
    paths, _, _ = ckpts
    m = shardfmt.read_manifest(paths["ckpt3d"])
    assert m.topology.world_size == 8
    assert m.topology.mesh == (("pp", 2), ("dp", 2), ("tp", 2))
    assert m.topology.coords(5) == (1, 0, 1)
    wq = m.tensors["model.layers.3.attn.wq.weight"]
    assert wq.placement.mesh_dims == ("tp",) and wq.placement.placements == (("shard", 0),)
    assert wq.placement.stage == 1
    assert len(wq.shards) == 2  # tp=2 slices; the dp replicas were written once
    assert len(m.tensors["model.layers.0.norm.weight"].shards) == 1
    data_bytes = sum(f.size - f.header_size for f in m.files.values())
    assert data_bytes == sum(r.nbytes for r in m.tensors.values() if r.alias_of is None and r.view is None)
    sizes = sorted(f.size for f in m.files.values())
    assert len(sizes) == 8 and sizes[-1] < 1.5 * sizes[0], f"writes not balanced across ranks: {sizes}"
    assert set(m.values["rng"].per_rank) == set(range(8))
    f = shardfmt.read_manifest(paths["fsdp"])
    st = f.tensors["extra.strided"]
    assert st.placement.placements == (("strided_shard", 0, 2),)
    assert len(st.shards) == 8  # 4 ranks x 2 disjoint ranges each
    assert shardfmt.validate(paths["ckpt3d"], deep=True).ok
    assert shardfmt.validate(paths["fsdp"], deep=True).ok


@pytest.mark.parametrize("name", ["ckpt3d", "fsdp"])
def test_load_into_one_process_full_tensors(ckpts, name):
    paths, _, _ = ckpts
    targets = {s.fqn: torch.empty(s.shape, dtype=s.dtype) for s in specs()}
    shardfmt.load(targets, paths[name])
    for s in specs():
        assert torch.equal(targets[s.fqn].view(torch.uint8) if s.shape else targets[s.fqn],
                           truth(s.fqn, s.shape, s.dtype).view(torch.uint8) if s.shape else truth(s.fqn, s.shape, s.dtype)), s.fqn


def _check_jobs(results):
    for r in check_all_ok(results):
        for label, value in r.items():
            if label == "ok":
                continue
            bad, count = value
            assert count > 0 and bad == [], f"{label}: wrong slices {bad}"


def test_load_on_2_ranks_tp2_pp2_and_dtensor(ckpts):
    paths, _, root = ckpts
    _check_jobs(launch("load2", 2, paths, out_dir=str(root / "l2")))


def test_load_on_3_ranks_uneven(ckpts):
    paths, _, root = ckpts
    _check_jobs(launch("load3", 3, paths, out_dir=str(root / "l3")))


def test_load_on_4_ranks_tp4_grid_and_strided(ckpts):
    paths, _, root = ckpts
    _check_jobs(launch("load4", 4, paths, out_dir=str(root / "l4")))


def _faulty(root, name, env, timeout=20, wait_for=None):
    path = f"faulty://{root}/{name}"
    results = launch("faulty_save", 2, {"path": path, "timeout": timeout}, out_dir=str(root / f"o_{name}"),
                     env=env, timeout=90, wait_for=wait_for)
    return results, str(root / name)


def _previous_loads(root):
    out = {"w": torch.empty(128, 64), "b": torch.empty(8)}
    shardfmt.load(out, str(root / "good"))
    assert torch.equal(out["w"][64:], torch.full((64, 64), 1.0))


@pytest.fixture(scope="module")
def fault_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    results, _ = _faulty(root, "good", {})
    assert all(r.result and r.result["raised"] is None for r in results), [r.result for r in results]
    return root


def test_enospc_on_one_rank_fails_every_rank_and_commits_nothing(fault_root):
    results, path = _faulty(fault_root, "enospc", {"FAULTY_RANK": "1", "FAULTY_AFTER": "2", "FAULTY_MODE": "enospc"})
    for r in results:
        assert r.result and r.result["raised"] == "CommitError", r
        assert "rank 1" in r.result["message"] and "No space left" in r.result["message"]
    assert not os.path.exists(os.path.join(path, "COMMITTED"))
    assert not os.path.exists(path), "the failed save left files behind"
    _previous_loads(fault_root)


@pytest.mark.parametrize("mode", ["kill", "stop"])
def test_rank_killed_or_frozen_mid_save(fault_root, mode):
    results, path = _faulty(fault_root, f"dead_{mode}", {"FAULTY_RANK": "1", "FAULTY_AFTER": "1",
                                                         "FAULTY_MODE": mode}, timeout=8, wait_for=[0])
    r0 = results[0]
    assert r0.result and r0.result["raised"] == "CommitError", r0
    assert results[1].result is None  # the dead/frozen rank never reported
    assert r0.result["seconds"] < 8 + 15, f"survivor took {r0.result['seconds']:.0f}s to give up (timeout 8s)"
    assert not os.path.exists(os.path.join(path, "COMMITTED"))
    from shardfmt.training.roots import list_checkpoints

    rows = {r["name"]: r["status"] for r in list_checkpoints(str(fault_root))}
    assert rows["good"] == "committed"
    assert all(v != "committed" for k, v in rows.items() if k != "good")
    _previous_loads(fault_root)


def test_reshard_plan_follows_saved_placements(ckpts, capsys):
    import orjson

    from reshard.cli import main

    paths, _, _ = ckpts
    assert main(["plan", paths["ckpt3d"], "--mesh", "tp=4", "--rank", "1", "--json", "--no-verify",
                 "--max-gap", "0"]) == 0
    out = orjson.loads(capsys.readouterr().out)
    wq = [t for t in out["targets"] if t["tensor"] == "model.layers.0.attn.wq.weight"]
    assert wq == [{"index": wq[0]["index"], "tensor": "model.layers.0.attn.wq.weight",
                   "offsets": [8, 0], "lengths": [8, 32]}]  # column-parallel: rows 8..15 of 32
    wo = [t for t in out["targets"] if t["tensor"] == "model.layers.0.attn.wo.weight"]
    assert wo[0]["offsets"] == [0, 8] and wo[0]["lengths"] == [32, 8]  # row-parallel: columns
    assert out["bytes_to_read"] == out["needed_bytes"]


def test_save_errors_raise_on_every_rank_and_commit_nothing(tmp_path):
    results = check_all_ok(launch("save_errors", 2, {"root": str(tmp_path)}, out_dir=str(tmp_path / "o")))
    for r in results:
        assert r["partial"][0] == "StateDictError" and "Partial" in r["partial"][1]
        assert r["replicas"][0] == "StateDictError" and "rank 0 and rank 1" in r["replicas"][1]
        assert r["values"][0] == "StateDictError" and "lr" in r["values"][1]
        assert r["one_rank_bad_value"][0] == "StateDictError" and "rank 1" in r["one_rank_bad_value"][1]
        assert r["bad_mesh"][0] == "StateDictError" and "world size" in r["bad_mesh"][1]
    for label in ("partial", "replicas", "values", "one_rank_bad_value", "bad_mesh"):
        assert not os.path.exists(tmp_path / label / "COMMITTED"), label
    # PerRank values come back only on the same world size, unless the caller says otherwise
    with pytest.raises(shardfmt.errors.StateDictError, match="saved by 2 rank"):
        shardfmt.load({"rng": shardfmt.PerRank(None)}, str(tmp_path / "perrank"))
    keep = {"rng": shardfmt.PerRank("mine")}
    shardfmt.load(keep, str(tmp_path / "perrank"), per_rank="skip")
    assert keep["rng"].value == "mine"
    got = {"rng": shardfmt.PerRank(None)}
    shardfmt.load(got, str(tmp_path / "perrank"), rank=1)
    assert got["rng"].value == 1


@pytest.mark.parametrize("new_world", [1, 4])
def test_checkpointer_resumes_on_another_world_size(tmp_path, new_world):
    """Drill b: saved on 2 ranks, resumed on 1 and 4: every sample once, same LR and optimizer."""
    root = str(tmp_path / "root")
    saved = check_all_ok(launch("ckpt_save", 2, {"root": root}, out_dir=str(tmp_path / "s")))
    restored = check_all_ok(launch("ckpt_restore", new_world, {"root": root}, out_dir=str(tmp_path / "r")))
    before = [i for r in saved for i in r["ids"]]
    after = [i for r in restored for i in r["ids"]]
    assert len(before) == 40
    assert sorted(before + after) == list(range(100)), "samples repeated or skipped across the resize"
    for rank, r in enumerate(restored):
        assert r["step"] == 5
        assert r["lr"] == saved[0]["lr"] == 0.1 / 6
        assert r["exp_avg"] == saved[0]["exp_avg"]
        rng = [w for w in r["warnings"] if "RNG states were saved by 2 ranks" in w]
        assert len(rng) == (1 if rank == 0 else 0), r["warnings"]  # once for the job, not once per rank


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_torn_save_is_ignored_and_collected_after_its_lease(tmp_path, mode):
    """Drill c: every rank SIGKILLed mid-save (async: in the background); restore uses the previous one."""
    root = str(tmp_path / "root")
    results = launch("ckpt_torn", 2, {"root": root, "async": mode == "async"}, out_dir=str(tmp_path / "o"),
                     timeout=120)
    assert all(r.returncode == -9 for r in results), [(r.returncode, r.stderr[-500:]) for r in results]
    torn = [n for n in os.listdir(root) if ".tmp-" in n]
    assert len(torn) == 1 and os.listdir(os.path.join(root, torn[0], "data"))
    restored = check_all_ok(launch("ckpt_restore_rows", 2, {"root": root}, out_dir=str(tmp_path / "r")))
    assert [r["step"] for r in restored] == [1, 1] and [r["value"] for r in restored] == [1.0, 1.0]
    ck = shardfmt.Checkpointer(root)
    assert ck.collect_garbage() == []  # the lease is still fresh: could be a live save
    assert ck.collect_garbage(now=time.time() + 3600) == [os.path.join(root, torn[0])]
    assert [i.step for i in ck.list()] == [1]


def test_corruption_one_rank_sees_makes_every_rank_fall_back(tmp_path):
    """Drill d: a flipped byte in rank 1's rows; both ranks restore step 1 together."""
    root = str(tmp_path / "root")
    check_all_ok(launch("ckpt_two_steps", 2, {"root": root}, out_dir=str(tmp_path / "o")))
    newest = os.path.join(root, "step_000000002")
    m = shardfmt.read_manifest(newest)
    shard = next(s for s in m.tensors["rows.w"].shards if s.offsets[0] == 64)  # rank 1's rows
    f = os.path.join(newest, shard.file)
    flip_byte(f, shard.byte_range[0] + 100, 0x10)
    restored = check_all_ok(launch("ckpt_restore_rows", 2, {"root": root}, out_dir=str(tmp_path / "r")))
    assert [r["step"] for r in restored] == [1, 1]
    assert [r["value"] for r in restored] == [1.0, 1.0]
    said = [[w for w in r["warnings"] if "step_000000002" in w and shard.file in w and "rank 1" in w]
            for r in restored]
    assert [len(s) for s in said] == [1, 0], said  # rank 0 says it, once for the job
    assert any(n.startswith("step_000000002.corrupt-") for n in os.listdir(root))


def test_a_newer_format_version_as_the_newest_checkpoint_stops_every_rank(tmp_path):
    """Every rank raises FormatVersionError (none resumes step 1 while the others wait), and the
    newer release's checkpoint is not quarantined."""
    root = str(tmp_path / "root")
    check_all_ok(launch("ckpt_two_steps", 2, {"root": root}, out_dir=str(tmp_path / "o")))
    as_next_format_version(os.path.join(root, "step_000000002"), "manifest")
    results = launch("ckpt_restore_rows", 2, {"root": root}, out_dir=str(tmp_path / "r"), timeout=120)
    errors = [(r.returncode, (r.result or {}).get("error", r.stderr[-300:])) for r in results]
    assert all(rc == 1 and e.startswith("FormatVersionError: ") and "step_000000002 (step 2): format version 3" in e
               for rc, e in errors), errors
    assert sorted(os.listdir(root)) == ["step_000000001", "step_000000002"]


def test_fsdp2_model_through_the_checkpointer_reshards(tmp_path):
    """FSDP2 (DTensor Shard(0)) model + optimizer saved on 2 ranks, restored on 2 ranks and as
    a plain model in 1 process."""
    root = str(tmp_path / "root")
    saved = check_all_ok(launch("fsdp_save", 2, {"root": root}, out_dir=str(tmp_path / "s")))
    again = check_all_ok(launch("fsdp_restore", 2, {"root": root}, out_dir=str(tmp_path / "r2")))
    single = check_all_ok(launch("fsdp_restore", 1, {"root": root}, out_dir=str(tmp_path / "r1")))
    for r in again + single:
        assert r["step"] == 3 and r["params"] == saved[0]["params"]
    m = shardfmt.read_manifest(os.path.join(root, "step_000000003"))
    assert m.tensors["model.0.weight"].placement.placements == (("shard", 0),)
    assert len(m.tensors["optim.state.0.weight.exp_avg"].shards) == 2


@pytest.mark.parametrize("check_replicas", [False, True])
def test_a_snapshot_failing_on_one_rank_fails_the_async_save_on_every_rank(tmp_path, check_replicas):
    path = str(tmp_path / "a")
    results = check_all_ok(launch("async_snapshot_fails_on_one_rank", 2,
                                  {"path": path, "check_replicas": check_replicas}, out_dir=str(tmp_path / "o")))
    for r in results:
        assert "rank 1" in r["outcome"] and "snapshot into host memory failed" in r["outcome"], r
        assert r["seconds"] < 30  # told through the plan's collectives, not by a timeout
    assert not os.path.exists(path) and not shardfmt.Checkpointer(str(tmp_path)).latest()


def test_async_save_under_two_ranks_is_isolated_and_uses_its_own_group(tmp_path):
    path = str(tmp_path / "a")
    results = check_all_ok(launch("async_save2", 2, {"path": path}, out_dir=str(tmp_path / "o")))
    assert [r["step"] for r in results] == [1, 1]
    assert [r["skipped"] for r in results] == [[False, True, False]] * 2
    assert shardfmt.validate(path).ok and not os.path.exists(path + "_c")
    out = {"w": torch.empty(64, 16), "s": torch.empty(8, 8), "norm": torch.empty(16), "lr": None}
    shardfmt.load(out, path, per_rank="skip")
    assert torch.equal(out["w"], torch.arange(64 * 16, dtype=torch.float32).reshape(64, 16))  # as at the call
    assert torch.equal(out["norm"], torch.ones(16)) and out["lr"] == 0.5
    assert torch.equal(out["s"][:4], torch.zeros(4, 8)) and torch.equal(out["s"][4:], torch.ones(4, 8))
    assert shardfmt.read_manifest(path).values["rng"].per_rank == {0: 0, 1: 10}
    later = {"w": torch.empty(64, 16)}
    shardfmt.load(later, path + "_d", strict=False)
    assert torch.equal(later["w"], torch.arange(64 * 16, dtype=torch.float32).reshape(64, 16) + 20)


@pytest.fixture(scope="module")
def disagree(tmp_path_factory):
    root = tmp_path_factory.mktemp("disagree")
    out = {}
    for mode in ("sync", "async"):
        results = check_all_ok(launch("save_disagree", 2, {"root": str(root), "async": mode == "async"},
                                      out_dir=str(root.parent / f"{root.name}_o_{mode}")))
        for r, res in enumerate(results):
            for label, outcome in res.items():
                if label != "ok":
                    out.setdefault(label, {})[r] = outcome
    return root, out


def _leftovers(root, prefix: str) -> list[str]:
    return [n for n in os.listdir(root) if n.startswith(prefix)]


@pytest.mark.parametrize("label,seen", [("steps", ("399", "400")), ("step_none", ("None", "7"))])
def test_ranks_saving_different_steps_all_raise_and_commit_nothing(disagree, label, seen):
    """Rank 0 at step 400 and rank 1 at 399 must not splice into one checkpoint."""
    root, out = disagree
    for r, res in out[label].items():
        assert res["raised"] and res["raised"][0] == "StateDictError", (r, res)
        msg = res["raised"][1]
        assert all(s in msg for s in seen) and "step" in msg and "nothing was committed" in msg, msg
    assert _leftovers(root, label) == [], "a save of disagreeing steps left files behind"


def test_ranks_saving_to_different_paths_all_raise_and_commit_nothing(disagree):
    root, out = disagree
    for r, res in out["paths"].items():
        assert res["raised"] and res["raised"][0] == "StateDictError", (r, res)
        assert str(root / f"paths_{r}") in res["raised"][1] and "nothing was committed" in res["raised"][1]
    assert _leftovers(root, "paths") == []


def test_a_replicated_value_that_differs_across_ranks_warns_on_rank_0(disagree):
    """{"loader": {"pos": rank}} not wrapped in PerRank comes back as rank 0's on every rank: say so."""
    root, out = disagree
    res = out["loader"]
    assert res[0]["raised"] is None and res[1]["raised"] is None
    [msg] = res[0]["warnings"]
    assert "loader" in msg and "PerRank" in msg and "lr" not in msg and "cfg" not in msg, msg
    assert res[1]["warnings"] == []
    back = {"loader": None}
    shardfmt.load(back, str(root / "loader"), strict=False)
    assert back["loader"] == {"pos": 0, "epoch": 0}  # the lowest rank's copy, as the warning says
    # a value only rank 1 holds: rank 0 cannot name it, but it still warns
    assert out["only_rank1"][0]["raised"] is None and len(out["only_rank1"][0]["warnings"]) == 1
    # check_replicas=True: the same difference is an error on every rank
    for r, res in out["strict"].items():
        assert res["raised"] and res["raised"][0] == "StateDictError" and "loader" in res["raised"][1], (r, res)
    assert not os.path.exists(root / "strict")


def test_per_rank_and_equal_replicated_values_save_without_a_warning(disagree):
    root, out = disagree
    for r, res in out["per_rank"].items():
        assert res == {"raised": None, "warnings": []}, (r, res)
    assert shardfmt.read_manifest(str(root / "per_rank")).values["loader"].per_rank == {
        0: {"pos": 0, "epoch": 0}, 1: {"pos": 1, "epoch": 0}}


@pytest.mark.parametrize("label", ["async_steps", "ckpt_async_steps", "ckpt_sync_steps"])
def test_async_and_checkpointer_saves_of_different_steps_all_raise(disagree, label):
    root, out = disagree
    for r, res in out[label].items():
        assert res["raised"] and res["raised"][0] == "StateDictError", (r, res)
        assert "399" in res["raised"][1] and "400" in res["raised"][1], res
    assert _leftovers(root, "async_steps") == []
    for ck in ("ck_async", "ck_sync"):
        assert shardfmt.Checkpointer(str(root / ck)).latest() is None
        assert os.listdir(root / ck) == [], os.listdir(root / ck)
