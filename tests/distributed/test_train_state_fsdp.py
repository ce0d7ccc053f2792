"""The plain API (shardfmt.get_state_dict / save / load / set_state_dict) under FSDP2, real processes."""

import pytest

import shardfmt
from tests.distributed.harness import check_all_ok, launch

pytestmark = pytest.mark.slow


def test_fsdp2_plain_api_resumes_a_fresh_optimizer_bit_for_bit_on_2_and_1_ranks(tmp_path):
    """Saved by 2 FSDP2 ranks after 3 steps; fresh processes (other weights, a fresh AdamW)
    resume on 2 ranks and on 1: their step 4 equals the uninterrupted run's, bit for bit."""
    path = str(tmp_path / "c")
    saved = check_all_ok(launch("fsdp_helpers_save", 2, {"path": path}, out_dir=str(tmp_path / "s")))
    m = shardfmt.read_manifest(path)
    assert m.tensors["optim.state.0.weight.exp_avg"].placement.placements == (("shard", 0),)
    assert len(m.tensors["optim.state.0.weight.exp_avg"].shards) == 2
    for world in (2, 1):
        resumed = check_all_ok(launch("fsdp_helpers_resume", world, {"path": path}, out_dir=str(tmp_path / f"r{world}")))
        for r in resumed:
            assert r["missing"] == [] and r["unexpected"] == []
            assert r["stepped"] == ["0.bias", "0.weight", "2.bias", "2.weight"]
            assert r["params"] == saved[0]["params"], f"{world} rank(s): step 4 differs from the uninterrupted run"
