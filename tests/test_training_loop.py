"""The rest of the training loop (issue 20): logs that continue without a duplicated segment
(item 4) and saves made in the middle of a step (item 5)."""

from __future__ import annotations

import json
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
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ck = shardfmt.Checkpointer(str(tmp_path / "root"))
    _step(model, opt)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # after step() and zero_grad(): nothing pending, no warning
        ck.save(1, {"model": model, "optim": opt})
    model(torch.randn(2, 8)).pow(2).mean().backward()  # one micro-step of an accumulation
    with pytest.warns(UserWarning, match=r"gradients are pending \(model\.0\.weight, model\.0\.bias"):
        ck.save(2, {"model": model, "optim": opt})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ck.save(3, {"model": model, "optim": opt})  # once per Checkpointer


def test_a_loop_that_zeroes_gradients_in_place_is_not_warned_between_steps(tmp_path):
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _step(model, opt, micro=2, zero="in_place")
    assert model.weight.grad is not None  # a zero tensor, not None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        shardfmt.Checkpointer(str(tmp_path / "root")).save(1, {"model": model, "optim": opt})


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
