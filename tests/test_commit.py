"""Crash points of the commit protocol: a save interrupted at any step never loses data."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import shardfmt
import shardfmt.saving.writer
from shardfmt.commit.protocol import STEPS
from shardfmt.io.local import LocalStorage
from shardfmt.saving.options import SaveOptions, Seams
from shardfmt.training.roots import list_checkpoints


class Crash(Exception):
    pass


def _crash_at(step):
    def hook(name):
        if name == step:
            raise Crash(step)
    return hook


def _value(path):
    out = {"w": torch.empty(64, 64)}
    shardfmt.load(out, path)
    return out["w"]


OLD = torch.full((64, 64), 1.0)


def _hooked(hook) -> SaveOptions:
    return SaveOptions(_seams=Seams(on_step=hook))
NEW = torch.full((64, 64), 2.0)


@pytest.mark.parametrize("step", [s for s in STEPS if s != "set_aside"])
def test_crash_on_first_save_leaves_nothing_or_a_committed_checkpoint(step, tmp_path):
    path = str(tmp_path / "ck")
    with pytest.raises(Crash):
        shardfmt.save({"w": NEW}, path, options=_hooked(_crash_at(step)))
    rows = list_checkpoints(str(tmp_path))
    committed = [r for r in rows if r["status"] == "committed"]
    if os.path.exists(path):
        assert committed and committed[0]["path"] == path
        assert shardfmt.validate(path, deep=True).ok
        assert torch.equal(_value(path), NEW)
    else:
        assert not committed
        with pytest.raises(shardfmt.errors.CheckpointNotFoundError):
            _value(path)
    # a later save of the same path works
    shardfmt.save({"w": NEW}, path, overwrite=True)
    assert torch.equal(_value(path), NEW)


OVERWRITE_CASES = [(s, True) for s in STEPS if s != "set_aside"] + [(s, False) for s in STEPS]


@pytest.mark.parametrize(("step", "exchange"), OVERWRITE_CASES,
                         ids=[f"{s}-{'renameat2' if e else 'rename-aside'}" for s, e in OVERWRITE_CASES])
def test_crash_during_overwrite_keeps_old_or_new(step, exchange, tmp_path, monkeypatch):
    if not exchange:
        def no_exchange(self, a, b):
            raise shardfmt.errors.StorageError("no renameat2 here")
        monkeypatch.setattr(LocalStorage, "exchange", no_exchange)
    path = str(tmp_path / "ck")
    shardfmt.save({"w": OLD}, path)
    with pytest.raises(Crash):
        shardfmt.save({"w": NEW}, path, overwrite=True, options=_hooked(_crash_at(step)))
    got = _value(path)  # never "nothing there"
    assert torch.equal(got, OLD) or torch.equal(got, NEW)
    published = STEPS.index(step) >= STEPS.index("published")
    assert torch.equal(got, NEW if published else OLD)
    committed = [r for r in list_checkpoints(str(tmp_path)) if r["status"] == "committed"]
    assert len(committed) >= 1


def test_refuses_to_overwrite_without_flag(tmp_path):
    path = str(tmp_path / "ck")
    shardfmt.save({"w": OLD}, path)
    with pytest.raises(shardfmt.errors.CheckpointExistsError, match="overwrite=True"):
        shardfmt.save({"w": NEW}, path)
    assert torch.equal(_value(path), OLD)
    assert sorted(os.listdir(tmp_path)) == ["ck"], "a refused save left files behind"


def test_refuses_non_empty_foreign_directory(tmp_path):
    path = tmp_path / "ck"
    path.mkdir()
    (path / "precious.txt").write_text("user data")
    with pytest.raises(shardfmt.errors.CheckpointExistsError):
        shardfmt.save({"w": OLD}, str(path))
    assert (path / "precious.txt").read_text() == "user data"


def test_empty_directory_is_replaced(tmp_path):
    path = tmp_path / "ck"
    path.mkdir()
    shardfmt.save({"w": OLD}, str(path))
    assert torch.equal(_value(str(path)), OLD)


def test_uncommitted_checkpoint_is_refused(tmp_path):
    path = str(tmp_path / "ck")
    shardfmt.save({"w": OLD}, path)
    os.remove(os.path.join(path, "COMMITTED"))
    with pytest.raises(shardfmt.errors.CommitError, match="not committed"):
        _value(path)
    assert not shardfmt.validate(path).ok
    assert [r["status"] for r in list_checkpoints(str(tmp_path))] == ["incomplete"]


def test_manifest_edited_after_commit_is_detected(tmp_path):
    path = str(tmp_path / "ck")
    shardfmt.save({"w": OLD}, path, step=3)
    mpath = os.path.join(path, "manifest.json")
    with open(mpath, "rb") as f:
        raw = f.read()
    with open(mpath, "wb") as f:
        f.write(raw.replace(b'"step":3', b'"step":4'))
    with pytest.raises(shardfmt.errors.IntegrityError, match="changed after the commit"):
        _value(path)
    rep = shardfmt.validate(path)
    assert any(p.code == "manifest_digest" for p in rep.problems)
    assert [r["status"] for r in list_checkpoints(str(tmp_path))] == ["corrupt"]


@pytest.mark.slow
@pytest.mark.parametrize("step", ["files_written", "committed_written"])
def test_process_killed_mid_save_leaves_previous_state(step, tmp_path):
    """A real crash (os._exit inside the save) leaves the staging dir behind; it is ignored."""
    path = str(tmp_path / "ck")
    shardfmt.save({"w": OLD}, path)
    code = textwrap.dedent(f"""
        import os, torch, shardfmt
        from shardfmt.saving.options import SaveOptions, Seams
        def hook(name):
            if name == {step!r}:
                os._exit(9)
        shardfmt.save({{"w": torch.full((64, 64), 2.0)}}, {path!r}, overwrite=True,
                      options=SaveOptions(_seams=Seams(on_step=hook)))
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120)
    assert proc.returncode == 9, proc.stderr.decode()
    assert torch.equal(_value(path), OLD)
    rows = {r["name"]: r["status"] for r in list_checkpoints(str(tmp_path))}
    assert rows["ck"] == "committed"
    leftovers = [n for n in rows if n != "ck"]
    assert leftovers and all(rows[n] == "incomplete" for n in leftovers)


def test_two_saves_of_one_path_race_safely(tmp_path):
    """Both stage; the first to publish wins, the second gets a clear error and removes its files."""
    path = str(tmp_path / "ck")
    first = shardfmt.saving.writer.CheckpointWriter(path)
    second = shardfmt.saving.writer.CheckpointWriter(path)
    first.write_rank(0, [shardfmt.saving.writer.ShardData(fqn="w", data=OLD, global_shape=(64, 64), offsets=(0, 0))])
    second.write_rank(0, [shardfmt.saving.writer.ShardData(fqn="w", data=NEW, global_shape=(64, 64), offsets=(0, 0))])
    first.commit()
    with pytest.raises(shardfmt.errors.CheckpointExistsError, match="first"):
        second.commit()
    assert torch.equal(_value(path), OLD)
    assert sorted(os.listdir(tmp_path)) == ["ck"]


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_save_onto_a_regular_file_leaves_the_file(tmp_path, overwrite):
    f = tmp_path / "notes.txt"
    f.write_text("my notes\n")
    with pytest.raises(shardfmt.errors.CheckpointExistsError, match="notes.txt: is a file, not a checkpoint directory"):
        shardfmt.save({"w": torch.ones(2)}, str(f), overwrite=overwrite)
    assert f.read_text() == "my notes\n"
    assert sorted(os.listdir(tmp_path)) == ["notes.txt"]
