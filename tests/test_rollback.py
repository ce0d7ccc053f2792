"""Rollback (issue 20, item 2; spec/ROOTS.md section 1): ``restore(step=N)`` goes back to an
earlier checkpoint after a loss spike and sets every later one aside, not deleted: no lister
picks the abandoned future, saving its steps again works, chains and archives follow."""

from __future__ import annotations

import os

import pytest
import torch

import shardfmt
from shardfmt.errors import CheckpointNotFoundError
from shardfmt.training.roots import list_checkpoints


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.frozen = torch.nn.Parameter(torch.randn(256, 256, generator=g), requires_grad=False)
        self.head = torch.nn.Parameter(torch.zeros(8, 256))


def _set(model: Model, value: float) -> Model:
    with torch.no_grad():
        model.head.fill_(value)
    return model


def _train(ck, steps, model):
    for s in steps:
        ck.save(s, {"model": _set(model, float(s))})


def _restore(root, **kw) -> tuple[int | None, Model]:
    got = _set(Model(), -1.0)
    return shardfmt.Checkpointer(str(root), **kw).restore({"model": got}), got


def _names(root) -> list[str]:
    return sorted(n.split(".rolledback-")[0] + (".rolledback" if ".rolledback-" in n else "") for n in os.listdir(root))


def test_a_rollback_restores_that_step_and_sets_the_later_ones_aside(tmp_path):
    root = tmp_path / "root"
    with shardfmt.Checkpointer(str(root), keep_last=10) as ck:
        _train(ck, [1, 2, 3, 4, 5], Model())
    got = _set(Model(), -1.0)
    ck = shardfmt.Checkpointer(str(root))
    with pytest.warns(UserWarning, match=r"rolled back to step 3: set aside \(not deleted\) the 2 later"):
        assert ck.restore({"model": got}, step=3) == 3
    assert torch.equal(got.head, torch.full((8, 256), 3.0))
    assert _names(root) == ["step_000000001", "step_000000002", "step_000000003",
                            "step_000000004.rolledback", "step_000000005.rolledback"]
    assert ck.latest().endswith("step_000000003") and [i.step for i in ck.list()] == [1, 2, 3]
    statuses = {r["name"].split(".")[0]: r["status"] for r in list_checkpoints(str(root))}
    assert statuses == {f"step_00000000{s}": "committed" for s in (1, 2, 3)} | \
        {"step_000000004": "rolled_back", "step_000000005": "rolled_back"}
    ck.save(4, {"model": _set(got, 40.0)})  # training goes on from step 3: step 4 is saved again
    step, again = _restore(root)
    assert step == 4 and torch.equal(again.head, torch.full((8, 256), 40.0))
    aside = next(n for n in os.listdir(root) if n.startswith("step_000000005.rolledback-"))
    old = {"model": {"frozen": torch.zeros(256, 256), "head": torch.zeros(8, 256)}}
    shardfmt.load(old, str(root / aside), strict=False)  # kept as it was: it still loads
    assert torch.equal(old["model"]["head"], torch.full((8, 256), 5.0))


def test_a_rollback_to_a_step_there_is_not_or_that_does_not_load_sets_nothing_aside(tmp_path):
    root = tmp_path / "root"
    with shardfmt.Checkpointer(str(root), keep_last=10) as ck:
        _train(ck, [1, 2, 3], Model())
    with pytest.raises(CheckpointNotFoundError, match=r"no committed checkpoint of step 7.*committed steps: 1, 2, 3"):
        shardfmt.Checkpointer(str(root)).restore({"model": Model()}, step=7)
    f = root / "step_000000002" / "data" / "rank_00000.safetensors"
    raw = bytearray(f.read_bytes())
    raw[-100] ^= 0xFF
    f.write_bytes(bytes(raw))
    with pytest.warns(UserWarning, match="unusable"), pytest.raises(CheckpointNotFoundError,
                                                                     match="cannot roll back to step 2"):
        shardfmt.Checkpointer(str(root), allow_fresh_start=True).restore({"model": Model()}, step=2)
    names = _names(root)
    assert "step_000000003" in names and not any("rolledback" in n for n in names)  # nothing set aside
    with pytest.raises(shardfmt.errors.StateDictError, match="step must be"):
        shardfmt.Checkpointer(str(root)).restore({"model": Model()}, step=-1)


def test_a_rollback_keeps_the_chains_of_what_it_sets_aside_and_the_archive_follows(tmp_path):
    root, arch = tmp_path / "root", tmp_path / "arch"
    model = Model()
    with shardfmt.Checkpointer(str(root), keep_last=1, incremental=True, archive=str(arch)) as ck:
        _train(ck, [1, 2, 3, 4], model)  # 1 full; 2, 3, 4 take `frozen` from 1
    got = _set(Model(), -1.0)
    with pytest.warns(UserWarning, match="rolled back to step 2|restored it from the archive"):
        with shardfmt.Checkpointer(str(root), keep_last=1, incremental=True, archive=str(arch)) as ck:
            assert ck.restore({"model": got}, step=2) == 2
            _train(ck, [3, 4, 5], got)  # the first save after a restore is full; retention keeps 1 ...
    # keep_last=1 leaves step 1 (the base the others take `frozen` from) and the newest; which other
    # steps are still in the root depends on when the background archive copies ran (retention leaves
    # a checkpoint alone while it is being copied). Whatever the timing: the new steps 3 (full, the
    # first save after a restore), 4 and 5 (on 3); retention keeps 5, the base 3 it needs, and 1,
    # which the set-aside checkpoints need; every later step of the old run is set aside.
    names = _names(root)
    assert {"step_000000001", "step_000000003", "step_000000005", "step_000000004.rolledback"} <= set(names)
    assert set(names) <= {"step_000000001", "step_000000002", "step_000000003", "step_000000003.rolledback",
                          "step_000000004", "step_000000004.rolledback", "step_000000005"}, names
    aside = [n for n in os.listdir(root) if ".rolledback-" in n]
    for n in aside:  # ... because the set-aside steps take `frozen` from step 1: they still load
        out = {"model": {"frozen": torch.zeros(256, 256), "head": torch.zeros(8, 256)}}
        shardfmt.load(out, str(root / n), strict=False)
        assert torch.equal(out["model"]["frozen"], Model().frozen)
    assert _names(arch) == ["step_000000001", "step_000000002", "step_000000003", "step_000000003.rolledback",
                            "step_000000004", "step_000000004.rolledback", "step_000000005"]  # saved again
    step, again = _restore(arch)  # the archive as a root: its newest is the new step 5
    assert step == 5 and torch.equal(again.head, torch.full((8, 256), 5.0))


def test_a_rollback_that_cannot_set_everything_aside_says_what_it_did(tmp_path, monkeypatch):
    from shardfmt.commit.rename import RenameCommit
    from shardfmt.errors import StorageError

    root = tmp_path / "root"
    with shardfmt.Checkpointer(str(root), keep_last=10) as ck:
        _train(ck, [1, 2, 3], Model())
    calls = []

    def flaky(self, path, dest, reason):
        calls.append(path)
        if len(calls) == 2:
            raise StorageError(f"{path}: permission denied")
        os.rename(path, dest)
    monkeypatch.setattr(RenameCommit, "roll_back", flaky)
    with pytest.raises(StorageError, match=r"rolled back to step 1 \(the state holds it\).*step_000000003: "
                                           r"permission denied; set aside so far: \[.*step_000000002"):
        shardfmt.Checkpointer(str(root)).restore({"model": Model()}, step=1)
    assert _names(root) == ["step_000000001", "step_000000002.rolledback", "step_000000003"]


def test_after_a_rollback_the_new_saves_of_the_abandoned_steps_are_archived(tmp_path):
    root, arch = tmp_path / "root", tmp_path / "arch"
    model = Model()
    with shardfmt.Checkpointer(str(root), keep_last=10, archive=str(arch), archive_every=10) as ck:
        _train(ck, [10, 20, 30], model)
        with pytest.warns(UserWarning, match="rolled back to step 10"):
            ck.restore({"model": model}, step=10)
        _train(ck, [20, 30], model)
    assert [n for n in _names(arch) if "rolledback" not in n] == ["step_000000010", "step_000000020",
                                                                  "step_000000030"]


def test_step_chooses_a_checkpoint_of_a_root_in_the_clis(tmp_path, capsys):
    from reshard.cli import main as reshard_main
    from shardfmt.cli import main as shardfmt_main

    root = tmp_path / "root"
    with shardfmt.Checkpointer(str(root), keep_last=10) as ck:
        _train(ck, [1, 2, 3], Model())
    with pytest.warns(UserWarning, match="rolled back"):
        shardfmt.Checkpointer(str(root)).restore({"model": Model()}, step=2)
    assert shardfmt_main(["inspect", str(root), "--step", "2", "--json"]) == 0
    assert '"step": 2' in capsys.readouterr().out.replace('"step":2', '"step": 2')
    assert shardfmt_main(["validate", str(root), "--step", "1"]) == 0
    capsys.readouterr()
    assert shardfmt_main(["validate", str(root), "--step", "3"]) == 2  # rolled back: not a committed step
    assert "no committed checkpoint of step 3 (committed steps: 1, 2)" in capsys.readouterr().err
    assert reshard_main(["export-hf", str(root), str(tmp_path / "hf"), "--step", "2", "--no-progress"]) == 0
