"""The DCP backend under DCP's own multi-process flows (real processes, gloo): an FSDP2 model
and AdamW saved by 2 ranks through ``shardfmt.dcp.Writer`` (``dcp.save`` and ``dcp.async_save``),
resumed through ``Reader`` on 1, 2 and 4 ranks; and ``dcp.load`` of a ``shardfmt.save``
checkpoint. A resumed run's next step equals the uninterrupted run's, bit for bit."""

from __future__ import annotations

import pytest

import shardfmt
import shardfmt.validation
from tests.distributed.harness import check_all_ok, launch

pytestmark = pytest.mark.slow
JOBS = "tests.distributed.dcp_jobs"


def _resume_everywhere(tmp_path, path: str, saved: list[dict], worlds=(1, 2, 4)) -> None:
    for world in worlds:
        resumed = check_all_ok(launch("dcp_titan_resume", world, {"path": path, "saved_world": 2},
                                      out_dir=str(tmp_path / f"r{world}"), module=JOBS))
        for rank, r in enumerate(resumed):
            assert r["params"] == saved[0]["params"], f"{world} rank(s), rank {rank}: step 4 differs"
            assert r["lr"] == saved[0]["lr"] and r["sched_epoch"] == 3
            assert r["train"] == {"step": 3, "global_avg_losses": [0.5] * 3, "log_steps": [0, 1, 2]}
            assert r["loader"] == {"world_size": 2, "dp_rank_0": {"sample_idx": 300}, "dp_rank_1": {"sample_idx": 301}}


def test_fsdp2_saved_through_dcp_resumes_on_1_2_and_4_ranks_bit_for_bit(tmp_path):
    path = str(tmp_path / "ck")
    saved = check_all_ok(launch("dcp_titan_save", 2, {"path": path}, out_dir=str(tmp_path / "s"), module=JOBS))
    assert saved[0]["params"] == saved[1]["params"]
    assert shardfmt.validation.validate(path, deep=True).ok
    m = shardfmt.read_manifest(path)
    assert (m.step, m.topology.world_size, m.topology.mesh) == (3, 2, (("dp", 2),))
    assert sorted(m.values) == ["dataloader", "lr_schedulers", "model_optim.optim.param_groups", "train_state"]
    # each rank wrote its half of every FSDP2-sharded tensor (read_manifest: the whole manifest)
    assert {s.file for s in m.tensors["model_optim.model.0.weight"].shards} == {
        "data/rank_00000.safetensors", "data/rank_00001.safetensors"}
    _resume_everywhere(tmp_path, path, saved)


def test_dcp_async_save_through_the_writer_resumes_bit_for_bit(tmp_path):
    path = str(tmp_path / "ck")
    saved = check_all_ok(launch("dcp_titan_save", 2, {"path": path, "async": True}, out_dir=str(tmp_path / "s"),
                                module=JOBS))
    assert shardfmt.validation.validate(path, deep=True).ok
    _resume_everywhere(tmp_path, path, saved, worlds=(2,))


def test_dcp_load_resumes_a_checkpoint_shardfmt_save_wrote_on_another_world_size(tmp_path):
    path = str(tmp_path / "c")
    saved = check_all_ok(launch("fsdp_helpers_save", 2, {"path": path}, out_dir=str(tmp_path / "s")))
    for world in (4, 1):
        resumed = check_all_ok(launch("dcp_plain_resume", world, {"path": path}, out_dir=str(tmp_path / f"r{world}"),
                                      module=JOBS))
        assert all(r["params"] == saved[0]["params"] for r in resumed), world
