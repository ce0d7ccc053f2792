"""The rest of the training loop (issue 20): logs that continue without a duplicated segment
(item 4) and saves made in the middle of a step (item 5)."""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch

import shardfmt
from shardfmt.training.logs import rewind_jsonl


def test_rewind_jsonl_drops_the_lost_runs_steps_and_keeps_the_rest(tmp_path):
    path = tmp_path / "log.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in
                            [{"step": 1}, {"note": "x"}, {"step": 2}, {"step": 3}, {"step": 4}]))
    assert rewind_jsonl(str(path), 2) == [3, 4]
    assert [json.loads(x) for x in path.read_text().splitlines()] == [{"step": 1}, {"note": "x"}, {"step": 2}]
    assert rewind_jsonl(str(path), 2) == [] and rewind_jsonl(str(tmp_path / "none.jsonl"), 5) == []
    assert [p.name for p in tmp_path.iterdir()] == ["log.jsonl"]  # nothing left aside


def test_restore_tells_loggers_the_step_it_resumed_from(tmp_path):
    m = torch.nn.Linear(4, 4)
    shardfmt.Checkpointer(str(tmp_path / "root")).save(7, {"model": m})
    ck = shardfmt.Checkpointer(str(tmp_path / "root"))
    assert ck.restored_step is None
    assert ck.restore({"model": torch.nn.Linear(4, 4)}) == 7 and ck.restored_step == 7


def _step(model, opt, *, micro: int = 1, zero: str = "none"):
    for _ in range(micro):
        model(torch.randn(2, 8)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=zero == "none")


def test_a_save_with_pending_gradients_warns_once_naming_them(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    model.temperature = torch.nn.Parameter(torch.tensor(1.0))  # a 0-d parameter
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ck = shardfmt.Checkpointer(str(tmp_path / "root"))
    ck.restore({"model": model, "optim": opt})  # a first run: the optimizer is watched from here
    for zero_first in (True, False):  # zero_grad() at the top of the step, or after step()
        if zero_first:
            opt.zero_grad()
        (model(torch.randn(2, 8)) * model.temperature).pow(2).mean().backward()
        opt.step()
        if not zero_first:
            opt.zero_grad()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the gradients were applied: nothing pending, no warning
            ck.save(1 + zero_first, {"model": model, "optim": opt})
    (model(torch.randn(2, 8)) * model.temperature).pow(2).mean().backward()  # one micro-step of an accumulation
    with pytest.warns(UserWarning, match=r"gradients are pending \(model\.temperature, model\.0\.weight"):
        ck.save(3, {"model": model, "optim": opt})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ck.save(4, {"model": model, "optim": opt})  # once per Checkpointer


def test_a_loop_that_zeroes_gradients_in_place_is_not_warned_between_steps(tmp_path):
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _step(model, opt, micro=2, zero="in_place")
    assert model.weight.grad is not None  # a zero tensor, not None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        shardfmt.Checkpointer(str(tmp_path / "root")).save(1, {"model": model, "optim": opt})


def _accumulating_run(root: str, *, save_at: int | None, save_grads: bool = True, restore: bool = False):
    """Two optimizer steps of 4 micro-steps each (Adam, a fixed batch per micro-step); save after
    micro-step ``save_at`` of the second step; ``restore``: start from the checkpoint instead, at
    the micro-step its metadata names. Returns the model's final parameters."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    batches = torch.randn(2, 4, 3, 8, generator=torch.Generator().manual_seed(1))
    ck = shardfmt.Checkpointer(root, save_grads=save_grads)
    start_step, start_micro = 0, 0
    if restore:
        start_step = ck.restore({"model": model, "optim": opt})
        start_micro = ck.restored_metadata["micro_step"]
    for step in range(start_step, 2):
        for micro in range(start_micro if step == start_step else 0, 4):
            model(batches[step, micro]).pow(2).mean().backward()
            if step == 1 and micro + 1 == save_at:
                ck.save(step, {"model": model, "optim": opt}, metadata={"micro_step": micro + 1})
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def test_a_save_in_the_middle_of_a_gradient_accumulation_resumes_exactly_with_save_grads(tmp_path):
    """``save_grads=True``: the pending gradients are saved (no warning) and restored, the micro-step
    counter rides in the metadata: the resumed run ends bit for bit where the uninterrupted one
    does. Without them it does not, and a restore without ``save_grads`` of a checkpoint holding
    gradients says what it leaves out."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        whole = _accumulating_run(str(tmp_path / "a"), save_at=2)
    resumed = _accumulating_run(str(tmp_path / "a"), save_at=None, restore=True)
    assert all(torch.equal(a, b) for a, b in zip(whole, resumed))
    m = shardfmt.read_manifest(str(tmp_path / "a" / "step_000000001"))
    assert sorted(k for k in m.tensors if k.startswith("_shardfmt_grads.")) == [
        "_shardfmt_grads.model.0.bias", "_shardfmt_grads.model.0.weight", "_shardfmt_grads.model.1.bias",
        "_shardfmt_grads.model.1.weight"]
    with pytest.warns(UserWarning, match=r"saved with the gradients of a step not yet applied"):
        lost = _accumulating_run(str(tmp_path / "a"), save_at=None, save_grads=False, restore=True)
    assert not all(torch.equal(a, b) for a, b in zip(whole, lost))  # the first two micro-steps' gradients


def test_save_grads_restores_no_gradient_where_the_checkpoint_holds_none(tmp_path):
    model = torch.nn.Linear(4, 4)
    ck = shardfmt.Checkpointer(str(tmp_path / "root"), save_grads=True)
    ck.save(1, {"model": model})  # no gradient set: none saved
    assert not [k for k in shardfmt.read_manifest(str(tmp_path / "root" / "step_000000001")).tensors
                if k.startswith("_shardfmt")]
    back = torch.nn.Linear(4, 4)
    back(torch.randn(2, 4)).sum().backward()  # a stale gradient in the state restored into
    assert ck.restore({"model": back}) == 1 and back.weight.grad is None and back.bias.grad is None


@pytest.mark.slow
def test_saved_gradients_reshard_like_the_weights(tmp_path):
    """Saved on 2 ranks (a DTensor weight split by rows, its gradient too), restored in 1 process
    into a plain model: the gradient comes back whole."""
    from tests.distributed.harness import check_all_ok, launch

    root = str(tmp_path / "root")
    saved = check_all_ok(launch("grads_save", 2, {"root": root}, out_dir=str(tmp_path / "o"),
                                module="tests.distributed.loop_jobs"))
    m = torch.nn.Module()
    m.register_parameter("w", torch.nn.Parameter(torch.zeros(64, 6)))
    m.register_parameter("r", torch.nn.Parameter(torch.zeros(6)))
    ck = shardfmt.Checkpointer(root, save_grads=True)
    assert ck.restore({"model": m}) == 3 and ck.restored_metadata == {"micro_step": 1}
    assert torch.equal(m.w.grad, torch.tensor(saved[0]["grad"])) and m.w.grad.abs().sum() > 0
    # a gradient still Partial (a replicated weight times sharded inputs) is saved reduced
    assert saved[0]["r_placements"] == ["P(sum)"]
    assert torch.equal(m.r.grad, torch.tensor(saved[0]["r_grad"]))
    assert torch.equal(m.r.grad, torch.arange(64 * 6, dtype=torch.float32).reshape(64, 6).sum(0))


def test_save_grads_leaves_sparse_gradients_out_and_makes_no_memory_for_gradients_not_saved(tmp_path):
    """A sparse gradient is not saved (a warning names it; the save goes on); a restore makes
    tensors only for the gradients the checkpoint holds (a frozen base gets none)."""
    from shardfmt.training.grads import grad_slots

    model = torch.nn.Module()
    model.emb = torch.nn.Embedding(10, 3, sparse=True)
    model.frozen = torch.nn.Parameter(torch.randn(256, 256), requires_grad=False)
    model.head = torch.nn.Linear(3, 2)
    model.head(model.emb(torch.tensor([1, 2]))).sum().backward()
    ck = shardfmt.Checkpointer(str(tmp_path / "root"), save_grads=True)
    with pytest.warns(UserWarning, match=r"sparse gradients are not saved \(model\.emb\.weight\)"):
        ck.save(1, {"model": model})
    m = shardfmt.read_manifest(str(tmp_path / "root" / "step_000000001"))
    assert sorted(k for k in m.tensors if k.startswith("_shardfmt_grads")) == [
        "_shardfmt_grads.model.head.bias", "_shardfmt_grads.model.head.weight"]
    slots = grad_slots({"model": model}, m.tensors).value
    assert sorted(slots["model"]) == ["head.bias", "head.weight"]  # no 256 KiB slot for the frozen base


# ----------------------------------------------------------------------------- how often to save (item 3)


def test_young_and_daly_give_the_textbook_optimum_and_never_an_interval_under_a_save():
    from shardfmt.training.interval import daly, suggest, young

    assert young(10, 3600) == pytest.approx(268.33, abs=0.01)  # sqrt(2 * 10 * 3600)
    # Daly 2006: sqrt(2CM) (1 + sqrt(C/2M)/3 + C/(18M)) - C
    assert daly(10, 3600) == pytest.approx(72000 ** 0.5 * (1 + (10 / 7200) ** 0.5 / 3 + 10 / 64800) - 10, rel=1e-9)
    assert daly(9000, 3600) == 3600  # C >= 2M: T = M
    it = suggest(cost=0.5, mtbf=3600, restart=60, total=40.0)
    assert it.seconds == pytest.approx(daly(0.5, 3600)) and it.seconds > 40.0 and it.formula == "daly"
    assert it.lost_fraction == pytest.approx(0.5 / it.seconds + (it.seconds / 2 + 60) / 3600)
    assert suggest(cost=0.5, mtbf=3600, total=120.0).seconds == 120.0  # never shorter than one save
    with pytest.raises(ValueError):
        suggest(cost=1, mtbf=0)


def test_the_checkpointer_measures_its_saves_and_restores_and_suggests_an_interval(tmp_path):
    from shardfmt.training.interval import suggest

    m = torch.nn.Linear(256, 256)
    ck = shardfmt.Checkpointer(str(tmp_path / "root"), mtbf=3600.0, restart_cost=30.0)
    with pytest.raises(shardfmt.errors.StateDictError, match="no save measured"):
        ck.suggest_interval()
    ck.save(1, {"model": m})
    ck.save(2, {"model": m}, async_=True).wait()
    ck.wait()
    sync, asyn = ck.stats.saves
    assert sync.blocked == sync.total and sync.bytes >= 256 * 256 * 4
    assert asyn.blocked < asyn.total and asyn.bytes >= 256 * 256 * 4
    it = ck.suggest_interval()
    assert it == suggest(cost=ck.stats.blocked, mtbf=3600.0, restart=30.0, total=ck.stats.total)
    assert it.seconds >= ck.stats.total
    fresh = shardfmt.Checkpointer(str(tmp_path / "root"))
    fresh.restore({"model": torch.nn.Linear(256, 256)})
    assert len(fresh.stats.restores) == 1 and fresh.stats.restore > 0


def test_a_restore_reports_where_its_time_went_phase_by_phase(tmp_path, monkeypatch, caplog):
    """``stats.restores[-1].phases``: discover, open, plan, read, verify, apply; a phase made slow
    shows in its own line and nowhere else, and the phases add up to at most the whole."""
    import logging
    import time

    from shardfmt.loading import executor
    from shardfmt.training import entries

    root = str(tmp_path / "root")
    shardfmt.Checkpointer(root).save(1, {"model": torch.nn.Linear(256, 256)})
    slow = {"read": (executor.Executor, "run"), "apply": (entries, "_load_entries")}
    for phase, (owner, name) in slow.items():
        real = getattr(owner, name)
        monkeypatch.setattr(owner, name, lambda *a, real=real, **k: time.sleep(0.3) or real(*a, **k))
        ck = shardfmt.Checkpointer(root)
        with caplog.at_level(logging.INFO, logger="shardfmt"):
            assert ck.restore({"model": torch.nn.Linear(256, 256)}) == 1
        cost = ck.stats.restores[-1]
        assert list(cost.phases) == ["discover", "open", "plan", "read", "verify", "apply"]
        assert cost.phases[phase] >= 0.3 and all(v < 0.3 for p, v in cost.phases.items() if p != phase), cost
        assert sum(cost.phases.values()) <= cost.seconds
        assert f"{phase} {cost.phases[phase]:.3f} s" in caplog.text
        monkeypatch.undo()


def test_maybe_save_every_n_steps_and_every_auto(tmp_path, monkeypatch):
    from shardfmt.training import checkpointer as ckmod
    from shardfmt.training.interval import Interval

    m = torch.nn.Linear(4, 4)
    ck = shardfmt.Checkpointer(str(tmp_path / "a"), every=3, keep_last=100)
    saved = [s for s in range(1, 11) if ck.maybe_save(s, {"model": m}) is not None]
    assert saved == [3, 6, 9]
    with pytest.raises(ValueError, match="mtbf"):
        shardfmt.Checkpointer(str(tmp_path / "b"), every="auto")
    auto = shardfmt.Checkpointer(str(tmp_path / "b"), every="auto", mtbf=100.0, keep_last=100)
    monkeypatch.setattr(ckmod.Checkpointer, "suggest_interval",
                        lambda self, *a, **k: Interval(seconds=0.05, formula="daly", cost=0, mtbf=100, restart=0,
                                                       floor=0, lost_fraction=0))
    monkeypatch.setattr(ckmod, "steps_for", lambda seconds, times: 4)  # 0.05 s at the measured step time
    saved = [s for s in range(1, 15) if auto.maybe_save(s, {"model": m}) is not None]
    assert saved == [1, 5, 9, 13]  # the first call measures a save; then every 4 steps


# ----------------------------------------------------------------------------- data-loader state (item 1)


def _loader(seed: int, workers: int = 2, sampler=None):
    from torchdata.stateful_dataloader import StatefulDataLoader

    ds = torch.arange(200)
    kw = dict(sampler=sampler) if sampler is not None else dict(shuffle=True)
    return StatefulDataLoader(ds, batch_size=4, num_workers=workers, in_order=True,
                              generator=torch.Generator().manual_seed(seed), **kw)


def test_a_stateful_data_loader_with_workers_resumes_with_exactly_the_batches_it_would_have_given(tmp_path):
    pytest.importorskip("torchdata")
    dl = _loader(0)
    it = iter(dl)
    seen = [next(it).tolist() for _ in range(5)]
    ck = shardfmt.Checkpointer(str(tmp_path / "root"))
    ck.save(5, {"loader": dl})
    rest = [b.tolist() for b in it]  # the uninterrupted run
    fresh = _loader(seed=99)  # another generator: only the checkpoint can make it agree
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        assert shardfmt.Checkpointer(str(tmp_path / "root")).restore({"loader": fresh}) == 5
    assert [b.tolist() for b in fresh] == rest and len(rest) == 45 and seen


def test_per_rank_values_keep_their_tensors_per_rank_and_pickles_are_refused(tmp_path):
    from shardfmt.errors import EncodingError, StateDictError

    g = torch.Generator().manual_seed(3)
    state = {"gen": shardfmt.PerRank({"state": g.get_state(), "n": 4})}
    shardfmt.save(state, str(tmp_path / "a"))
    back = {"gen": shardfmt.PerRank({"state": torch.zeros_like(g.get_state()), "n": 0})}
    shardfmt.load(back, str(tmp_path / "a"))
    got = back["gen"].value
    assert torch.equal(got["state"], g.get_state()) and got["state"].dtype == torch.uint8 and got["n"] == 4
    with pytest.raises(StateDictError, match=r"gen\.x: a per-rank value holds a torch.bfloat16"):
        shardfmt.save({"gen": shardfmt.PerRank({"x": torch.ones(2, dtype=torch.bfloat16)})}, str(tmp_path / "b"))
    import pickle

    with pytest.raises(EncodingError, match=r"loader\.dp_rank_0: holds pickled bytes"):
        shardfmt.save({"loader": shardfmt.PerRank({"dp_rank_0": pickle.dumps({"pos": 3})})}, str(tmp_path / "c"))
    assert not (tmp_path / "c").exists()


@pytest.mark.slow
def test_each_rank_resumes_its_own_data_loader_and_another_world_size_is_told_loudly(tmp_path):
    """2 ranks, a StatefulDataLoader with 2 workers over a DistributedSampler each: every rank's
    state is its own (per rank), the resumed ranks see exactly the batches the uninterrupted
    ones did; resumed on 1 rank the state cannot be resharded: a warning says so, and why."""
    pytest.importorskip("torchdata")
    from tests.distributed.harness import check_all_ok, launch

    root = str(tmp_path / "root")
    saved = check_all_ok(launch("loader_save", 2, {"root": root}, out_dir=str(tmp_path / "o1"),
                                module="tests.distributed.loop_jobs", timeout=180))
    assert saved[0]["rest"] != saved[1]["rest"]  # the ranks read different samples
    back = check_all_ok(launch("loader_restore", 2, {"root": root}, out_dir=str(tmp_path / "o2"),
                               module="tests.distributed.loop_jobs", timeout=180))
    assert [r["rest"] for r in back] == [s["rest"] for s in saved] and all(r["step"] == 7 for r in back)
    one = check_all_ok(launch("loader_restore", 1, {"root": root}, out_dir=str(tmp_path / "o3"),
                              module="tests.distributed.loop_jobs", timeout=180))
    assert one[0]["step"] == 7 and len(one[0]["warnings"]) == 1 and "ResumableSampler" in one[0]["warnings"][0]


def test_a_resume_over_other_data_is_refused_unless_allowed(tmp_path):
    from shardfmt.errors import CompatibilityError

    root = str(tmp_path / "root")
    shardfmt.Checkpointer(root, data_fingerprint="files-v1").save(
        3, {"sampler": shardfmt.ResumableSampler(100, seed=1)})
    with pytest.raises(CompatibilityError, match=r"data of entry 'sampler' differs.*length 100 -> 120"):
        shardfmt.Checkpointer(root, data_fingerprint="files-v1").restore({"sampler": shardfmt.ResumableSampler(120, seed=1)})
    with pytest.raises(CompatibilityError, match=r"data fingerprint differs.*'files-v1' -> 'files-v2'"):
        shardfmt.Checkpointer(root, data_fingerprint="files-v2").restore({"sampler": shardfmt.ResumableSampler(100, seed=1)})
    assert shardfmt.Checkpointer(root, data_fingerprint="files-v2").restore(
        {"sampler": shardfmt.ResumableSampler(100, seed=1)}, allow_mismatch=True) == 3
    assert shardfmt.Checkpointer(root, data_fingerprint="files-v1").restore(
        {"sampler": shardfmt.ResumableSampler(100, seed=1)}) == 3
    assert sorted(os.listdir(root)) == ["step_000000003"]  # a mismatch quarantines nothing


def test_rewind_jsonl_drops_a_last_line_the_crash_cut_off(tmp_path):
    path = tmp_path / "log.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n{"step": 3, "lo')
    assert rewind_jsonl(str(path), 5) == []
    assert path.read_text() == '{"step": 1}\n{"step": 2}\n'
    path.write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    with pytest.raises(ValueError, match="line 2 is not JSON"):
        rewind_jsonl(str(path), 1)


def test_inspect_shows_what_the_runs_earlier_saves_cost(tmp_path, capsys):
    from shardfmt.cli import main as shardfmt_main

    ck = shardfmt.Checkpointer(str(tmp_path / "root"))
    m = torch.nn.Linear(64, 64)
    ck.save(1, {"model": m})
    ck.save(2, {"model": m})
    assert shardfmt_main(["inspect", str(tmp_path / "root"), "--step", "2", "--json"]) == 0
    costs = json.loads(capsys.readouterr().out)["save_costs"]
    assert costs["saves"] == 1 and costs["last"]["step"] == 1 and costs["last"]["bytes"] >= 64 * 64 * 4
    assert shardfmt_main(["inspect", str(tmp_path / "root"), "--step", "2"]) == 0
    assert "save costs  this run's 1 earlier save(s)" in capsys.readouterr().out


# ----------------------------------------------------------------------------- post-restore sanity (item 6)


def test_a_restore_whose_loaded_values_do_not_match_the_saved_statistics_fails_loudly(tmp_path, monkeypatch):
    """A load that puts intact bytes in the wrong place or the wrong form (a loader bug: the
    digests all pass) is caught by the sums saved with the tensors, taken in the read pass on
    what landed in the targets; nothing is quarantined."""
    import dataclasses

    from shardfmt import api
    from shardfmt.errors import IntegrityError
    from shardfmt.loading import executor

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    root = str(tmp_path / "root")
    shardfmt.Checkpointer(root).save(1, {"model": model})
    m = shardfmt.read_manifest(root + "/step_000000001")
    assert set(m.extensions["tensor_stats"].value["tensors"]) == {"model.0.weight", "model.0.bias", "model.1.weight",
                                                       "model.1.bias"}

    def fresh():
        return {"model": torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))}
    back = fresh()
    assert shardfmt.Checkpointer(root).restore(back) == 1  # the honest load passes
    assert torch.equal(back["model"][0].weight, model[0].weight)
    real_src, real_plan = executor._src_view, api.plan_reads

    def swapped_targets(manifest, targets, *a, **k):  # the two weights' bytes land in each other
        plan = real_plan(manifest, targets, *a, **k)
        which = {t.src.fqn: t.index for t in targets}
        a_, b_ = which["model.0.weight"], which["model.1.weight"]
        swap = {a_: b_, b_: a_}
        reads = tuple(dataclasses.replace(r, items=tuple(dataclasses.replace(it, target=swap.get(it.target, it.target))
                                                        for it in r.items)) for r in plan.reads)
        return dataclasses.replace(plan, reads=reads)

    def through_bounce(bug):
        def src_view(buf, offset, item, dtype):
            v = real_src(buf, offset, item, dtype)
            return bug(v) if tuple(v.shape) == (64, 64) and item.dst_offsets == (0, 0) else v
        return src_view
    bugs = {
        "a wrong target": lambda: monkeypatch.setattr(api, "plan_reads", swapped_targets),
        "a transpose": lambda: monkeypatch.setattr(executor, "_src_view", through_bounce(lambda v: v.t())),
        "a wrong cast": lambda: monkeypatch.setattr(executor, "_src_view",
                                                    through_bounce(lambda v: v.to(torch.bfloat16) * 0.5)),
    }
    for name, inject in bugs.items():
        monkeypatch.undo()
        if name != "a wrong target":  # copies through a bounce buffer: the per-copy path
            monkeypatch.setattr(executor.Executor, "_direct_ok", lambda self, read: False)
        inject()
        with pytest.raises(IntegrityError, match=r"do not match the statistics saved.*model\.[01]\.weight"):
            shardfmt.Checkpointer(root).restore(fresh())
        assert shardfmt.Checkpointer(root).restore(fresh(), allow_mismatch=True) == 1, name  # the check is off
    assert os.listdir(root) == ["step_000000001"]  # nothing quarantined


@pytest.mark.slow
def test_the_post_restore_check_sums_each_tensor_once_across_ranks_and_any_placement(tmp_path):
    """2 ranks: saved with rows sharded, loaded as column shards, replicated or plain, every
    tensor is checked (the ranks' sums cover each element once); a loader bug on one rank only
    (rows reversed in its copies) fails the restore on both ranks."""
    from tests.distributed.harness import check_all_ok, launch

    root = str(tmp_path / "root")
    for k, into in enumerate(("shard0", "shard1", "replicate")):
        got = check_all_ok(launch("values_check", 2, {"root": root, "save": k == 0, "into": into},
                                  out_dir=str(tmp_path / f"o{k}"), module="tests.distributed.loop_jobs"))
        for r in got:
            assert r["checked"] == ["m.b", "m.v", "m.w"] and r["unchecked"] == [] and r["bad"] == [], into
            assert r["restore_error"] is None, into
    got = check_all_ok(launch("values_check", 2, {"root": root, "save": False, "into": "shard1", "flip_on": 1},
                              out_dir=str(tmp_path / "bug"), module="tests.distributed.loop_jobs"))
    for r in got:
        assert len(r["bad"]) == 1 and r["bad"][0].startswith("m.w: saved")
        assert "do not match the statistics saved with them" in r["restore_error"] and "m.w" in r["restore_error"]


@pytest.mark.parametrize("direct_io", ["1", "0"])
def test_the_loads_statistics_are_the_saved_ones_whatever_pieces_the_reads_land_in(tmp_path, monkeypatch, direct_io):
    """The sums a load takes as its reads land (pieces cutting rows anywhere, around the page
    cache or through it, through a bounce buffer for a cast) equal the save's, tensor by tensor."""
    from shardfmt.format.stats import close, from_extension_value
    from shardfmt.loading import executor
    from shardfmt.loading.options import LoadOptions

    monkeypatch.setenv("SHARDFMT_DIRECT_IO", direct_io)
    g = torch.Generator().manual_seed(5)
    sd = {"big": torch.randn(1200, 1001, generator=g), "vec": torch.randn(300_001, generator=g),
          "ints": torch.arange(5000, dtype=torch.int64).reshape(50, 100) * 7919,
          "half": torch.randn(333, 77, generator=g).to(torch.bfloat16), "scalar": torch.tensor(2.5)}
    path = str(tmp_path / "c")
    shardfmt.save(sd, path)
    saved = from_extension_value(shardfmt.read_manifest(path).extensions["tensor_stats"].value)
    monkeypatch.setattr(executor, "READ_PIECE", 1 << 17)  # 128 KiB pieces: rows cut mid-way
    around = []
    real_direct = executor._read_direct
    monkeypatch.setattr(executor, "_read_direct", lambda *a: around.append(1) or real_direct(*a))
    for cast in (False, True):
        back = {k: torch.zeros_like(v, dtype=torch.float64 if cast and v.is_floating_point() else None)
                for k, v in sd.items()}
        rep = shardfmt.load(back, path, options=LoadOptions(value_stats=True, cast=cast))
        assert sorted(rep.value_stats) == sorted(sd)
        for k, v in sd.items():
            got = rep.value_stats[k]
            assert got[3] == v.numel() and close(saved[k], got[:3], v.numel()), (k, cast, saved[k], got)
    plain = shardfmt.load({k: torch.zeros_like(v) for k, v in sd.items()}, path)
    assert plain.value_stats == {}  # summed only when asked
    assert bool(around) == (direct_io == "1")  # the path around the page cache ran, or did not


def test_near_constant_values_loaded_into_strided_memory_pass_the_check(tmp_path):
    """Sums of squares of 2^23 near-equal values, taken in other pieces than the save's (a strided
    target is filled copy by copy): a float32 dot product was off by 4e-4 there, above the 1e-4
    tolerance, and failed a correct restore; cascaded sums agree."""
    m = torch.nn.Module()
    m.register_buffer("b", torch.full((1 << 23,), 1.28) + 1e-4 * torch.rand(1 << 23, generator=torch.Generator().manual_seed(0)))
    root = str(tmp_path / "root")
    shardfmt.Checkpointer(root).save(1, {"m": m})
    back = torch.nn.Module()
    back.register_buffer("b", torch.zeros(1 << 24)[::2])
    assert shardfmt.Checkpointer(root).restore({"m": back}) == 1 and torch.equal(back.b, m.b)


def test_tied_weights_are_checked_once_and_downcasts_and_other_methods_not_at_all(tmp_path):
    from shardfmt.format.stats import from_extension_value
    from shardfmt.loading.options import LoadOptions
    from shardfmt.training.ranks import Ranks
    from shardfmt.training.sanity import check_values

    model = torch.nn.Module()
    model.emb = torch.nn.Embedding(16, 8)
    model.head = torch.nn.Linear(8, 16, bias=False)
    model.head.weight = model.emb.weight
    path = str(tmp_path / "c")
    shardfmt.save({"model": model.state_dict()}, path)
    man = shardfmt.read_manifest(path)
    back = torch.zeros(16, 8)
    rep = shardfmt.load({"model": {"emb.weight": back, "head.weight": back}}, path,
                        options=LoadOptions(value_stats=True))
    check = check_values(rep.value_stats, man, Ranks(None))
    assert "model.emb.weight" in check.checked and not check.bad and rep.value_stats["model.emb.weight"][3] == 128
    low = {"model": {"emb.weight": torch.zeros(16, 8, dtype=torch.bfloat16)}}
    rep = shardfmt.load(low, path, strict=False, options=LoadOptions(value_stats=True, cast=True))
    assert check_values(rep.value_stats, man, Ranks(None)).unchecked == ("model.emb.weight",)  # rounded by the cast
    assert from_extension_value({"model.emb.weight": [1.0, 2.0, 3.0]}) == {}  # the first release's sums


def test_box_statistics_add_up_across_any_partition_and_see_moved_rows():
    from shardfmt.format.stats import box_stats, close

    t = torch.randn(512, 300, generator=torch.Generator().manual_seed(7)) * 2 + 0.5
    whole = box_stats(t, (0, 0))
    parts = [box_stats(t[i:i + 37, j:j + 100], (i, j)) for i in range(0, 512, 37) for j in range(0, 300, 100)]
    assert close(whole, [sum(p[k] for p in parts) for k in range(3)], t.numel())
    moved = t.clone()
    moved[[3, 4]] = moved[[4, 3]]
    assert not close(whole, box_stats(moved, (0, 0)), t.numel())
    # integers and huge values: float64 sums for integer tensors; a statistic that overflows is not compared
    stamps = torch.arange(3000, dtype=torch.int64) * 1_000_000_007 + 1_700_000_000_000_000_000
    parts = [box_stats(stamps[i:i + 7], (i,)) for i in range(0, 3000, 7)]
    assert close(box_stats(stamps, (0,)), [sum(p[k] for p in parts) for k in range(3)], 3000)
    huge = torch.rand(64, 64, generator=torch.Generator().manual_seed(1)) * 1e19 + 2e19
    parts = [box_stats(huge[i:i + 5], (i, 0)) for i in range(0, 64, 5)]
    assert close(box_stats(huge, (0, 0)), [sum(p[k] for p in parts) for k in range(3)], huge.numel())


def test_a_zero_dim_tensor_in_a_per_rank_value_comes_back_zero_dim(tmp_path):
    shardfmt.save({"pos": shardfmt.PerRank({"n": torch.tensor(5)})}, str(tmp_path / "a"))
    back = {"pos": shardfmt.PerRank({"n": torch.tensor(0)})}
    shardfmt.load(back, str(tmp_path / "a"))
    assert back["pos"].value["n"].shape == () and int(back["pos"].value["n"]) == 5


def test_a_data_loaders_length_is_not_compared_its_data_is_each_ranks_own():
    from shardfmt.training.entries import data_identity

    dl = torch.utils.data.DataLoader(torch.arange(10))
    sampler = shardfmt.ResumableSampler(10)
    got = data_identity({"loader": dl, "sampler": sampler}, "v1")
    assert got == {"loader": {"length": None, "version": None}, "sampler": {"length": 10, "version": None},
                   "": {"fingerprint": "v1"}}
