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
