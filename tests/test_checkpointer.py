"""Checkpointer in one process: exact resume, retention, fallback, compatibility, leases."""

import logging
import os
import re
import time
import warnings

import pytest
import torch
from conftest import as_next_format_version, flip_byte

import shardfmt
import shardfmt.saving.async_save
import shardfmt.training.archiving
from shardfmt.errors import CompatibilityError
from shardfmt.training.checkpointer import Checkpointer
from shardfmt.training.retention import to_delete
from shardfmt.training.sampler import ResumableSampler


def make(hidden=16):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, hidden), torch.nn.Dropout(0.1), torch.nn.Linear(hidden, 1))
    o = torch.optim.AdamW(m.parameters(), lr=1e-2)
    s = torch.optim.lr_scheduler.LambdaLR(o, lambda st: min(1.0, (st + 1) / 5))
    return {"model": m, "optim": o, "sched": s, "sampler": ResumableSampler(64, seed=3)}


def run(state, first, last, ck=None, save_at=()):
    losses = []
    m, o, s, samp = state["model"], state["optim"], state["sched"], state["sampler"]
    for step in range(first, last + 1):
        x = torch.randn(4, 8)  # draws from the global RNG, as dropout does
        loss = m(x).pow(2).mean()
        o.zero_grad()
        loss.backward()
        o.step()
        s.step()
        samp.advance(4)
        losses.append(loss.item())
        if step in save_at:
            ck.save(step, state)
    return losses


def test_resume_is_bit_exact(tmp_path):
    ref = run(make(), 1, 10)
    ck = Checkpointer(str(tmp_path))
    run(make(), 1, 7, ck, save_at=(6,))
    fresh = make()
    step = Checkpointer(str(tmp_path)).restore(fresh)
    assert step == 6
    assert fresh["sampler"].consumed == 24
    assert fresh["sched"].last_epoch == 6
    assert run(fresh, 7, 10) == ref[6:]


def test_nothing_to_restore_returns_none(tmp_path):
    assert Checkpointer(str(tmp_path / "empty")).restore(make()) is None


def test_retention_keeps_last_and_every(tmp_path):
    assert to_delete(range(1, 13), keep_last=2, keep_every=5) == [2, 3, 4, 6, 7, 8, 9]
    ck = Checkpointer(str(tmp_path), keep_last=2, keep_every=5)
    state = make()
    for step in range(1, 13):
        ck.save(step, state)
    kept = [i.step for i in ck.list()]
    assert kept == [1, 5, 10, 11, 12]
    assert ck.latest().endswith("step_000000012")


def test_corrupt_newest_falls_back_and_is_quarantined(tmp_path):
    ck = Checkpointer(str(tmp_path))
    state = make()
    run(state, 1, 3, ck, save_at=(2, 3))
    newest = ck.latest()
    f = os.path.join(newest, "data", "rank_00000.safetensors")
    flip_byte(f, os.path.getsize(f) - 10)
    with pytest.warns(UserWarning, match=r"step_000000003.*rank_00000.safetensors"):
        step = Checkpointer(str(tmp_path)).restore(make())
    assert step == 2
    names = os.listdir(tmp_path)
    assert any(n.startswith("step_000000003.corrupt-") for n in names)
    ck.save(3, state)  # the quarantined step can be saved again


def test_no_valid_checkpoint_raises_unless_fresh_start_allowed(tmp_path):
    ck = Checkpointer(str(tmp_path))
    ck.save(1, make())
    os.remove(os.path.join(ck.latest(), "COMMITTED"))
    with pytest.raises(shardfmt.errors.CheckpointNotFoundError, match="none is valid"):
        Checkpointer(str(tmp_path)).restore(make())
    assert Checkpointer(str(tmp_path), allow_fresh_start=True).restore(make()) is None


def test_omitted_entries_are_named(tmp_path):
    Checkpointer(str(tmp_path)).save(1, make())
    state = make()
    with pytest.warns(UserWarning, match="saved but not restored: optim, sampler, sched"):
        Checkpointer(str(tmp_path)).restore({"model": state["model"]})


def test_compatibility_checks(tmp_path):
    Checkpointer(str(tmp_path), config={"hidden": 16}).save(1, make())
    with pytest.raises(CompatibilityError, match="different config"):
        Checkpointer(str(tmp_path), config={"hidden": 32}).restore(make())
    with pytest.raises(CompatibilityError, match=r"0.weight \['torch.float32', \[16, 8\]\] -> .*\[32, 8\]"):
        Checkpointer(str(tmp_path)).restore(make(hidden=32))
    other = make()
    assert Checkpointer(str(tmp_path), config={"hidden": 32}).restore(other, allow_mismatch=True) == 1


def test_equal_configs_are_compatible_whatever_their_order_or_number_type(tmp_path):
    Checkpointer(str(tmp_path), config={0: 64, 1: 128, "steps": 1000}).save(1, make())
    assert Checkpointer(str(tmp_path), config={1: 128, 0: 64, "steps": 1000.0}).restore(make()) == 1


def test_dead_staging_dirs_expire_live_ones_stay(tmp_path):
    ck = Checkpointer(str(tmp_path), lease_seconds=60)
    ck.save(1, make())
    dead = tmp_path / "step_000000002.tmp-0123456789abcdef"
    live = tmp_path / "step_000000003.tmp-fedcba9876543210"
    dead.mkdir()
    live.mkdir()
    (dead / "data").mkdir()
    (dead / "data" / "rank_00000.safetensors").write_bytes(b"x")
    # a user's things whose names merely contain ".tmp-": never a save's to collect
    (tmp_path / "notes.tmp-2024.txt").write_text("mine")
    (tmp_path / "photos.tmp-backup").mkdir()
    (tmp_path / "photos.tmp-backup" / "a.jpg").write_bytes(b"jpg")
    odd = tmp_path / "step_000000004.tmp-0123456789abcdef"  # a save's name, other contents
    odd.mkdir()
    (odd / "thesis.pdf").write_bytes(b"pdf")
    old = time.time() - 3600
    for p in (dead, dead / "data", tmp_path / "notes.tmp-2024.txt", tmp_path / "photos.tmp-backup", odd):
        os.utime(p, (old, old))
    assert ck.latest().endswith("step_000000001")
    removed = ck.collect_garbage()
    assert removed == [str(dead)] and live.exists()
    assert {"notes.tmp-2024.txt", "photos.tmp-backup", odd.name} <= set(os.listdir(tmp_path))


@pytest.mark.slow
def test_two_jobs_saving_into_one_root_keep_every_checkpoint_valid(tmp_path):
    """Drill f: two processes save into the same root at once; all their checkpoints are valid."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import sys, torch, shardfmt
        root, first = sys.argv[1], int(sys.argv[2])
        ck = shardfmt.Checkpointer(root, keep_last=100, lease_seconds=2)
        class Big:
            def state_dict(self):
                return {"w": torch.full((1024, 1024), float(first))}
            def load_state_dict(self, sd):
                pass
        for step in range(first, first + 12, 2):
            ck.save(step, {"big": Big()})
    """)
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path), str(first)]) for first in (1, 2)]
    assert [p.wait(timeout=300) for p in procs] == [0, 0]
    ck = Checkpointer(str(tmp_path))
    infos = ck.list()
    assert [i.step for i in infos] == list(range(1, 13)) and all(i.status == "committed" for i in infos)
    for i in infos:
        assert shardfmt.validate(i.path, deep=True).ok
    assert not [n for n in os.listdir(tmp_path) if ".tmp-" in n]


def test_optimizer_without_a_step_and_meta_model(tmp_path):
    state = make()
    Checkpointer(str(tmp_path)).save(0, state)  # the optimizer has no state yet: created lazily
    with torch.device("meta"):
        meta_model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.1), torch.nn.Linear(16, 1))
    assert Checkpointer(str(tmp_path)).restore({"model": meta_model}) == 0
    for a, b in zip(meta_model.state_dict().values(), state["model"].state_dict().values()):
        assert not a.is_meta and torch.equal(a, b)
    fresh = make()
    assert Checkpointer(str(tmp_path)).restore(fresh) == 0
    assert fresh["sched"].last_epoch == 0 and fresh["sampler"].consumed == 0


def test_a_torn_newest_checkpoint_is_quarantined_and_its_step_can_be_saved_again(tmp_path):
    root = str(tmp_path / "run")
    m = torch.nn.Linear(2, 2)
    ck = Checkpointer(root)
    ck.save(100, {"model": m})
    ck.save(200, {"model": m})
    data = os.path.join(root, "step_000000200", "data")
    f = os.path.join(data, os.listdir(data)[0])
    os.truncate(f, os.path.getsize(f) - 8)
    with pytest.warns(UserWarning, match="step_000000200 is unusable, quarantined"):
        assert ck.restore({"model": m}) == 100
    assert [n for n in sorted(os.listdir(root)) if not n.startswith("step_000000200.corrupt-")] == ["step_000000100"]
    ck.save(200, {"model": m})  # training reaches step 200 again
    assert ck.latest().endswith("step_000000200")


def test_a_failed_restore_that_wrote_into_the_model_is_no_fresh_start(tmp_path):
    """Every checkpoint corrupt: the load wrote most of the bad checkpoint's weights before its
    hash check failed. ``allow_fresh_start`` must not hand back that model as a fresh one."""
    root = str(tmp_path / "run")
    m = torch.nn.Linear(64, 64)
    with torch.no_grad():
        m.weight.fill_(7.0)
    Checkpointer(root).save(1, {"model": m})
    data = os.path.join(root, "step_000000001", "data")
    f = os.path.join(data, os.listdir(data)[0])
    flip_byte(f, os.path.getsize(f) - 100)  # the last chunk: every earlier one lands first
    fresh = torch.nn.Linear(64, 64)
    with pytest.warns(UserWarning, match="unusable"), \
            pytest.raises(shardfmt.errors.CheckpointNotFoundError, match="not a fresh start either"):
        Checkpointer(root, allow_fresh_start=True).restore({"model": fresh})
    assert (fresh.weight == 7.0).any()  # what the error is about
    # the bad checkpoint is quarantined: a restarted job (a new model) starts fresh
    assert Checkpointer(root, allow_fresh_start=True).restore({"model": torch.nn.Linear(64, 64)}) is None


def test_a_failed_background_save_is_raised_by_wait_even_after_later_saves(tmp_path, monkeypatch):
    import shardfmt.saving.protocol as P

    real = P.run_save

    def failing(prepared, path, **kw):
        if path.endswith("step_000000001"):
            raise shardfmt.errors.CommitError(f"{path}: injected failure")
        return real(prepared, path, **kw)

    monkeypatch.setattr(shardfmt.saving.async_save, "run_save", failing)  # where async_save looks it up
    root = str(tmp_path / "run")
    m = torch.nn.Linear(2, 2)
    ck = Checkpointer(root)
    h1 = ck.save(1, {"model": m}, async_=True)
    with pytest.raises(shardfmt.errors.CommitError):
        h1.wait()
    with pytest.warns(UserWarning, match="step_000000001 failed"):
        ck.save(2, {"model": m}, async_=True)
    with pytest.raises(shardfmt.errors.CommitError, match="injected failure"):
        ck.wait()
    ck.wait()  # raised once
    assert os.listdir(root) == ["step_000000002"]


def test_saving_before_the_first_optimizer_step_changes_nothing(tmp_path):
    def train(save_first: bool):
        torch.manual_seed(0)
        m = torch.nn.Linear(3, 2)
        o = torch.optim.Adam(m.parameters(), lr=0.1)
        if save_first:
            Checkpointer(str(tmp_path / "run")).save(0, {"model": m, "optim": o})
            assert not o.state
        for _ in range(3):
            o.zero_grad()
            m(torch.ones(4, 3)).sum().backward()
            o.step()
        return m.weight.detach().clone()

    assert torch.equal(train(False), train(True))
    # and the step-0 checkpoint resumes like a fresh optimizer
    torch.manual_seed(0)
    m = torch.nn.Linear(3, 2)
    o = torch.optim.Adam(m.parameters(), lr=0.1)
    assert Checkpointer(str(tmp_path / "run")).restore({"model": m, "optim": o}) == 0
    for _ in range(3):
        o.zero_grad()
        m(torch.ones(4, 3)).sum().backward()
        o.step()
    assert torch.equal(m.weight.detach(), train(False))


@pytest.mark.parametrize("step", ["5", -1, 1.5, True])
def test_a_bad_step_is_a_typed_error(tmp_path, step):
    with pytest.raises(shardfmt.errors.StateDictError, match="step must be an int >= 0"):
        Checkpointer(str(tmp_path / "run")).save(step, {"model": torch.nn.Linear(2, 2)})


def test_restore_names_entries_the_checkpoint_does_not_hold(tmp_path):
    root = str(tmp_path / "run")
    m = torch.nn.Linear(2, 2)
    Checkpointer(root).save(10, {"model": m})
    sampler = ResumableSampler(100, seed=0)
    with pytest.warns(UserWarning, match="not in the checkpoint, left as they are: sampler"):
        assert Checkpointer(root).restore({"model": m, "sampler": sampler}) == 10


class _Ema:
    def __init__(self, n):
        self.shadow = torch.zeros(n)

    def state_dict(self):
        return {"shadow": self.shadow}

    def load_state_dict(self, sd):
        self.shadow.copy_(sd["shadow"])


@pytest.mark.parametrize("allow_fresh_start", [False, True])
def test_a_state_that_does_not_fit_is_the_callers_error_and_quarantines_nothing(tmp_path, allow_fresh_start):
    """A resized entry is the caller's mistake, not a bad checkpoint: restore raises at once,
    every checkpoint stays, and allow_fresh_start does not turn it into a restart from step 0."""
    root = str(tmp_path / "run")
    m = torch.nn.Linear(4, 4)
    ck = Checkpointer(root)
    for s in (1, 2):
        ck.save(s, {"model": m, "ema": _Ema(10)})
    before = sorted(os.listdir(root))
    with pytest.raises(shardfmt.errors.StateDictError, match="does not fit the checkpoint.*nothing was quarantined"):
        Checkpointer(root, allow_fresh_start=allow_fresh_start).restore({"model": torch.nn.Linear(4, 4),
                                                                         "ema": _Ema(12)})
    assert sorted(os.listdir(root)) == before
    assert Checkpointer(root).restore({"model": torch.nn.Linear(4, 4), "ema": _Ema(10)}) == 2


def _trajectory(opt_kind, ck=None, save_first=False, steps=6):
    torch.manual_seed(0)
    m = torch.nn.Linear(8, 1)
    o = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, dampening=0.5) if opt_kind == "sgd"
         else torch.optim.Rprop(m.parameters(), lr=0.01))
    if save_first:
        ck.save(0, {"model": m, "optim": o})
        m2 = torch.nn.Linear(8, 1)
        o = (torch.optim.SGD(m2.parameters(), lr=0.1, momentum=0.9, dampening=0.5) if opt_kind == "sgd"
             else torch.optim.Rprop(m2.parameters(), lr=0.01))
        assert ck.restore({"model": m2, "optim": o}) == 0
        m = m2
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        loss = m(torch.randn(4, 8, generator=g)).pow(2).mean()
        o.zero_grad()
        loss.backward()
        o.step()
    return [p.detach().clone() for p in m.parameters()]


@pytest.mark.parametrize("opt_kind", ["sgd", "rprop"])
def test_resuming_an_optimizer_saved_before_its_first_step_is_exact(tmp_path, opt_kind):
    """The state torch makes for a never-stepped optimizer (a zero-gradient step at lr=0) is not
    the fresh optimizer's: SGD with dampening would get a zero momentum buffer, Rprop step
    sizes built from lr=0. Restored, it must be exactly the fresh optimizer again."""
    ref = _trajectory(opt_kind)
    got = _trajectory(opt_kind, ck=Checkpointer(str(tmp_path / "run")), save_first=True)
    assert all(torch.equal(a, b) for a, b in zip(ref, got))


def test_per_rank_values_inside_an_entry_are_saved_per_rank(tmp_path):
    """An entry's state_dict may mark values as per-rank (e.g. each rank's augmentation RNG):
    they are stored per rank, not replaced by one rank's value or refused."""
    class Aug:
        def __init__(self, seed):
            self.seed = seed

        def state_dict(self):
            return {"rng": shardfmt.PerRank({"seed": self.seed}), "p": 0.5}

        def load_state_dict(self, sd):
            self.seed = sd["rng"].value["seed"]

    root = str(tmp_path / "run")
    Checkpointer(root).save(1, {"aug": Aug(41)})
    got = Aug(0)
    assert Checkpointer(root).restore({"aug": got}) == 1 and got.seed == 41


def test_an_optimizer_of_another_class_or_grouping_is_incompatible(tmp_path):
    """Loaded anyway, SGD -> AdamW fails at the first step (KeyError 'betas') and 2 groups -> 1
    silently drops a group's weight decay: both are refused up front, nothing quarantined."""
    def state(kind="adamw", groups=2, swap=False):
        torch.manual_seed(0)
        m = torch.nn.Linear(4, 4)
        gs = [{"params": [m.weight], "weight_decay": 0.1}, {"params": [m.bias], "weight_decay": 0.0}]
        gs = gs[::-1] if swap else gs
        params = gs if groups == 2 else m.parameters()
        o = torch.optim.AdamW(params, lr=0.01) if kind == "adamw" else torch.optim.SGD(params, lr=0.01)
        return {"model": m, "optim": o}

    root = str(tmp_path / "run")
    Checkpointer(root).save(1, state())
    with pytest.raises(CompatibilityError, match="is a torch.optim.sgd.SGD, the checkpoint holds a .*AdamW"):
        Checkpointer(root).restore(state(kind="sgd"))
    with pytest.raises(CompatibilityError, match="groups its parameters differently"):
        Checkpointer(root).restore(state(groups=1))
    assert os.listdir(root) == ["step_000000001"]
    s = state(swap=True)  # the same groups in another order: loaded group by group
    assert Checkpointer(root).restore(s) == 1
    wd = {id(p): g["weight_decay"] for g in s["optim"].param_groups for p in g["params"]}
    assert (wd[id(s["model"].weight)], wd[id(s["model"].bias)]) == (0.1, 0.0)


class _FakeCuda:
    """torch.cuda's RNG calls on a node of ``n`` devices, this rank on ``current``: CPU stand-in."""

    def __init__(self, monkeypatch, n, current):
        self.states = [torch.full((16,), 100 + i, dtype=torch.uint8) for i in range(n)]
        c = torch.cuda
        for name, fn in {"is_available": lambda: True, "is_initialized": lambda: True, "device_count": lambda: n,
                         "current_device": lambda: current,
                         "get_rng_state_all": lambda: [s.clone() for s in self.states],
                         "set_rng_state_all": self._set_all,
                         "get_rng_state": lambda d="cuda": self.states[d].clone(),
                         "set_rng_state": self._set}.items():
            monkeypatch.setattr(c, name, fn)

    def _set_all(self, states):
        for i, s in enumerate(states):
            self.states[i] = s.clone()

    def _set(self, s, d="cuda"):
        self.states[d] = s.clone()


def test_a_rank_resumed_on_another_device_index_gets_its_own_cuda_rng_stream(monkeypatch):
    from shardfmt.training import rng

    with monkeypatch.context() as mp:
        old = _FakeCuda(mp, 8, current=5)  # rank 5 of 8 GPUs a node
        old.states[5] = torch.full((16,), 55, dtype=torch.uint8)
        saved = rng.capture()
    with monkeypatch.context() as mp:
        new = _FakeCuda(mp, 4, current=1)  # the same rank on a 4-GPU node
        rng.restore(saved)
    assert int(new.states[1][0]) == 55


def test_a_storage_failure_while_choosing_a_checkpoint_quarantines_nothing(tmp_path, monkeypatch):
    """A read that fails (network, throttling: here injected) says nothing about the checkpoint:
    restore and latest() fail, to be retried, and the good newest checkpoint stays where it is."""
    from shardfmt.io.local import LocalStorage

    root = str(tmp_path / "run")
    m = torch.nn.Linear(2, 2)
    ck = Checkpointer(root)
    ck.save(1, {"model": m})
    ck.save(2, {"model": m})
    real = LocalStorage.read_bytes

    def flaky(self, path, *, limit, **kw):
        if "step_000000002" in path:
            raise shardfmt.errors.StorageError(f"{path}: read failed: Connection reset by peer")
        return real(self, path, limit=limit, **kw)

    monkeypatch.setattr(LocalStorage, "read_bytes", flaky)
    with pytest.raises(shardfmt.errors.StorageError, match="Connection reset"):
        Checkpointer(root).restore({"model": torch.nn.Linear(2, 2)})
    with pytest.raises(shardfmt.errors.StorageError, match="Connection reset"):
        Checkpointer(root).latest()
    monkeypatch.undo()
    assert sorted(os.listdir(root)) == ["step_000000001", "step_000000002"]
    assert Checkpointer(root).restore({"model": torch.nn.Linear(2, 2)}) == 2


def test_latest_and_retention_open_a_bounded_number_of_checkpoints(tmp_path, monkeypatch):
    """With keep_every the kept checkpoints grow without end; latest() and each save's retention
    pass must not open every one of them (on S3, ~6 requests and a HEAD per file each)."""
    import shardfmt.training.roots as R  # where latest() and retention look it up

    root = str(tmp_path / "run")
    ck = Checkpointer(root, keep_last=2, keep_every=1)  # keep everything
    m = torch.nn.Linear(2, 2)
    for s in range(1, 13):
        ck.save(s, {"model": m})
    opened = []
    real = R.open_checkpoint
    monkeypatch.setattr(R, "open_checkpoint", lambda path, **kw: (opened.append(path), real(path, **kw))[1])
    assert ck.latest().endswith("step_000000012") and len(opened) == 1
    opened.clear()
    ck.save(13, {"model": m})
    assert len(opened) <= 3, opened  # the newest keep_last in full, the rest by their markers
    assert len([n for n in os.listdir(root) if n.startswith("step_")]) == 13


def test_a_failed_archive_copy_is_retried_by_the_next_save_of_its_bucket(tmp_path, monkeypatch):
    """One failed copy marked its archive_every bucket done: nothing else in it was archived, and
    retention then deleted the only copies. The next save of the bucket now tries again."""
    import warnings

    import shardfmt.training.archive as A

    root, arch = str(tmp_path / "root"), str(tmp_path / "arch")
    real, calls = A.copy_checkpoint, []

    def flaky(*a, **k):
        calls.append(1)
        if len(calls) == 1:
            raise shardfmt.errors.StorageError("simulated: the archive is unreachable for a while")
        return real(*a, **k)

    monkeypatch.setattr(shardfmt.training.archiving, "copy_checkpoint", flaky)  # where the archive tier looks it up
    ck = Checkpointer(root, keep_last=2, archive=arch, archive_every=10, archive_attempts=1)
    m = torch.nn.Linear(2, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(10):
            ck.save(step, {"model": m})
            ck.wait()
    assert len(ck.archive_errors) == 1 and os.listdir(arch) == ["step_000000001"]


def test_restore_takes_the_newest_step_whether_on_the_root_or_in_the_archive(tmp_path, monkeypatch):
    root, arch = str(tmp_path / "root"), str(tmp_path / "arch")
    ck = Checkpointer(root, archive=arch, archive_every=10)
    m = torch.nn.Linear(2, 2)
    for step in (10, 20):
        with torch.no_grad():
            m.weight.fill_(float(step))
        ck.save(step, {"model": m})
        ck.wait()
    data = os.path.join(root, "step_000000020", "data")
    f = os.path.join(data, os.listdir(data)[0])
    os.truncate(f, os.path.getsize(f) - 8)  # the local copy of step 20 is torn; the archived one is fine
    got = torch.nn.Linear(2, 2)
    with pytest.warns(UserWarning):
        assert Checkpointer(root, archive=arch).restore({"model": got}) == 20
    assert torch.all(got.weight == 20.0)
    # a root that cannot be listed (a transient failure) fails the restore: the archive's older
    # steps are no answer while the root may hold newer ones
    import shardfmt.training.restore as C  # where restore looks it up

    real = C.list_steps
    monkeypatch.setattr(C, "list_steps", lambda st, r: (_ for _ in ()).throw(shardfmt.errors.StorageError("flaky"))
                        if r == Checkpointer(root).root else real(st, r))
    with pytest.raises(shardfmt.errors.StorageError, match="cannot list"):
        Checkpointer(root, archive=arch).restore({"model": torch.nn.Linear(2, 2)})


@pytest.mark.parametrize("kw", [{"archive_attempts": 0}, {"archive_backoff": -1.0}, {"archive": "SAME"},
                                {"keep_every": 0}])
def test_bad_checkpointer_arguments_are_refused_at_construction(tmp_path, kw):
    kw = {k: (str(tmp_path) if v == "SAME" else v) for k, v in kw.items()}
    kw.setdefault("archive", str(tmp_path / "arch"))
    with pytest.raises(ValueError, match="Checkpointer: "):
        Checkpointer(str(tmp_path), **kw)


def test_keywords_and_an_options_object_make_the_same_checkpointer(tmp_path):
    """Each knob has one home (CheckpointerOptions); the constructor's keywords set its fields,
    over an options object when both are given, and the policies take effect either way."""
    from shardfmt.training.options import ArchivePolicy, CheckpointerOptions, RetentionPolicy

    root, arch = str(tmp_path / "run"), str(tmp_path / "arch")
    opts = CheckpointerOptions(retention=RetentionPolicy(keep_last=2, keep_every=100),
                               archive=ArchivePolicy(url=arch, every=10), lease_seconds=30.0)
    by_keywords = Checkpointer(root, keep_last=2, keep_every=100, archive=arch, archive_every=10, lease_seconds=30.0)
    assert by_keywords.options == opts and by_keywords.lease_seconds == 30.0
    ck = Checkpointer(root, options=opts, keep_last=1)
    assert ck.options.retention == RetentionPolicy(keep_last=1, keep_every=100) and ck.options.archive == opts.archive
    m = torch.nn.Linear(2, 2)
    for step in (1, 2, 3):
        ck.save(step, {"model": m})
        ck.wait()
    assert [i.step for i in ck.list()] == [1, 3]  # keep_last=1, and step 1 as bucket 0's long-term copy
    assert os.listdir(arch) == ["step_000000001"]  # one copy per archive_every=10 steps
    with pytest.raises(TypeError, match="keep_lats"):
        Checkpointer(root, keep_lats=1)
    with pytest.raises(ValueError, match="Checkpointer: archive_every must be an int >= 1"):
        ArchivePolicy(url=arch, every=0)


def test_a_long_lease_still_beats_often_enough_for_another_jobs_collector(tmp_path):
    """Job B saves with a 2 h lease; job A's gc on the same root judges by its own 600 s: B's
    heartbeat must come more often than any default lease expires (it came every 30 min)."""
    from shardfmt.io.local import LocalStorage
    from shardfmt.saving.writer import _Lease

    lease = _Lease(LocalStorage(), str(tmp_path), 7200.0)
    try:
        assert lease.interval <= 30.0
    finally:
        lease.stop()


def test_a_dead_copys_leftover_in_the_archive_does_not_block_archiving_that_step(tmp_path):
    root, arch = str(tmp_path / "root"), str(tmp_path / "arch")
    m = torch.nn.Linear(2, 2)
    Checkpointer(root).save(10, {"model": m})
    save_id = shardfmt.read_manifest(os.path.join(root, "step_000000010")).save_id
    # a copy of step 10 killed part-way long ago left its staging dir in the archive
    leftover = os.path.join(arch, f"step_000000010.tmp-{save_id}")
    os.makedirs(os.path.join(leftover, "data"))
    open(os.path.join(leftover, "data", "rank_00000.safetensors"), "wb").close()
    old = time.time() - 7200
    for p in (os.path.join(leftover, "data"), leftover):
        os.utime(p, (old, old))
    ck = Checkpointer(root, archive=arch, archive_every=10, archive_attempts=1)
    ck._archiver.copy(10, os.path.join(root, "step_000000010"))  # what a save of step 10 queues
    assert ck.archive_errors == [] and os.listdir(arch) == ["step_000000010"]


def test_an_entry_whose_load_state_dict_fails_is_a_typed_error_naming_it(tmp_path):
    """E.g. a GradScaler saved disabled and restored enabled: torch raises a bare RuntimeError."""
    root = str(tmp_path / "run")
    Checkpointer(root).save(1, {"model": torch.nn.Linear(2, 2), "scaler": torch.amp.GradScaler("cpu", enabled=False)})
    with pytest.raises(shardfmt.errors.StateDictError, match=r"'scaler'.load_state_dict failed: RuntimeError.*"
                                                      r"already restored: model"):
        Checkpointer(root).restore({"model": torch.nn.Linear(2, 2),
                                    "scaler": torch.amp.GradScaler("cpu", enabled=True)})
    assert os.listdir(root) == ["step_000000001"]  # the caller's mismatch: nothing quarantined


def test_a_torn_old_checkpoint_is_never_kept_as_its_buckets_long_term_copy(tmp_path):
    """Older steps are judged by their markers; the one that stays as a keep_every bucket's copy
    is checked in full before the rest of the bucket goes, so a torn one never replaces it."""
    root = str(tmp_path / "run")
    ck = Checkpointer(root, keep_last=2, keep_every=100)
    m = torch.nn.Linear(4, 4)
    ck.save(100, {"model": m})
    data = os.path.join(root, "step_000000100", "data")
    f = os.path.join(data, os.listdir(data)[0])
    os.truncate(f, os.path.getsize(f) - 8)
    for s in (150, 200, 250):
        ck.save(s, {"model": m})
    assert [(i.step, i.status) for i in ck.list()] == [(100, "corrupt"), (150, "committed"), (200, "committed"),
                                                        (250, "committed")]


def test_a_stored_value_that_does_not_decode_is_the_checkpoints_fault(tmp_path):
    """A value in a (re-signed) manifest that does not decode is a bad checkpoint, not the caller's
    mistake: restore falls back to the previous one instead of raising StateDictError."""
    import orjson

    from shardfmt.format import hashing
    from shardfmt.format.manifest import CommitRecord

    class Counter:
        def __init__(self):
            self.n = 0

        def state_dict(self):
            return {"n": self.n}

        def load_state_dict(self, sd):
            self.n = sd["n"]

    root = str(tmp_path / "run")
    ck = Checkpointer(root)
    st = {"model": torch.nn.Linear(2, 2), "counter": Counter()}
    ck.save(1, st)
    st["counter"].n = 2
    ck.save(2, st)
    path = os.path.join(root, "step_000000002")
    mp = os.path.join(path, "manifest.json")
    with open(mp, "rb") as fh:
        obj = orjson.loads(fh.read())
    obj["values"]["counter"] = {"value": {"n": {"$int": "02"}}}  # parses; does not decode (leading zero)
    raw = orjson.dumps(obj, option=orjson.OPT_SORT_KEYS) + b"\n"
    save_id = obj["save_id"]
    for name, data in (("manifest.json", raw),
                       ("COMMITTED", CommitRecord(save_id=save_id, manifest_digest=hashing.digest_bytes(raw)).to_json())):
        os.remove(os.path.join(path, name))
        with open(os.path.join(path, name), "wb") as fh:
            fh.write(data)
    back = {"model": torch.nn.Linear(2, 2), "counter": Counter()}
    with pytest.warns(UserWarning, match="step_000000002 is unusable"):
        assert Checkpointer(root).restore(back) == 1


@pytest.mark.parametrize("where", ["manifest", "COMMITTED"])
def test_a_newer_format_version_stops_restore_and_is_never_quarantined(tmp_path, where):
    """A newer release's checkpoint is neither usable nor corrupt (spec/ROOTS.md section 1, spec section 9): newer than every
    readable one, restore fails naming both versions and the path (resuming step 200 would throw
    away step 300's progress) and renames nothing; once it is moved aside, step 200 is resumed."""
    root = str(tmp_path / "run")
    ck = Checkpointer(root)
    m = torch.nn.Linear(2, 2)
    for s in (100, 200, 300):
        ck.save(s, {"model": m})
    newest = os.path.join(root, "step_000000300")
    as_next_format_version(newest, where)
    before = sorted(os.listdir(root))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing "unusable, quarantined"
        with pytest.raises(shardfmt.errors.FormatVersionError,
                           match=rf"{re.escape(newest)} \(step 300\): format version 3; this reader supports up "
                                 r"to 2\..*upgrade shardfmt.*or move it out of"):
            Checkpointer(root).restore({"model": torch.nn.Linear(2, 2)})
    assert sorted(os.listdir(root)) == before
    assert [(i.step, i.status) for i in ck.list()] == [(100, "committed"), (200, "committed"), (300, "unsupported")]
    assert ck.latest().endswith("step_000000200")
    os.rename(newest, tmp_path / "aside")
    assert Checkpointer(root).restore({"model": torch.nn.Linear(2, 2)}) == 200


def test_an_older_checkpoint_of_a_newer_format_version_is_passed_over_and_never_removed(tmp_path):
    """Older than a readable one, it is skipped untouched by restore; retention neither counts
    it (keep_last=2 keeps two readable ones) nor removes it."""
    root = str(tmp_path / "run")
    ck = Checkpointer(root, keep_last=2)
    m = torch.nn.Linear(2, 2)
    ck.save(100, {"model": m})
    as_next_format_version(os.path.join(root, "step_000000100"), "manifest")
    for s in (200, 300, 400):
        ck.save(s, {"model": m})
    assert sorted(os.listdir(root)) == ["step_000000100", "step_000000300", "step_000000400"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert Checkpointer(root).restore({"model": torch.nn.Linear(2, 2)}) == 400
    assert sorted(os.listdir(root)) == ["step_000000100", "step_000000300", "step_000000400"]


def test_a_root_missing_with_its_parent_is_an_error_not_a_fresh_start(tmp_path):
    """A misspelled root would silently train from step 0: restore and a first save refuse it
    (naming the missing parent), unless allow_fresh_start, which warns and creates it."""
    typo = str(tmp_path / "scrach" / "run")
    m = torch.nn.Linear(2, 2)
    missing = rf"{re.escape(typo)}: the Checkpointer root does not exist, nor does its parent {re.escape(str(tmp_path / 'scrach'))}"
    with pytest.raises(shardfmt.errors.CheckpointNotFoundError, match=missing + ".*allow_fresh_start=True"):
        Checkpointer(typo).restore({"model": m})
    with pytest.raises(shardfmt.errors.CheckpointNotFoundError, match=missing):
        Checkpointer(typo).save(1, {"model": m})
    assert os.listdir(tmp_path) == []
    ck = Checkpointer(typo, allow_fresh_start=True)
    with pytest.warns(UserWarning, match=missing + ".*starting from scratch"):
        assert ck.restore({"model": m}) is None
    ck.save(1, {"model": m})
    assert os.listdir(typo) == ["step_000000001"]


def test_a_missing_root_under_an_existing_parent_is_a_first_run_logged_at_info(tmp_path, caplog):
    root = str(tmp_path / "run")
    with caplog.at_level(logging.INFO, logger="shardfmt"):
        assert Checkpointer(root).restore({"model": torch.nn.Linear(2, 2)}) is None
    assert [r.levelno for r in caplog.records if root in r.getMessage() and "first run" in r.getMessage()] \
        == [logging.INFO]


@pytest.mark.parametrize("given", ["a step dir", "a step dir not yet saved", "a plain checkpoint"])
def test_a_checkpoint_given_as_the_root_is_an_error_naming_its_parent(tmp_path, given):
    root = str(tmp_path / "run")
    Checkpointer(root).save(100, {"model": torch.nn.Linear(2, 2)})
    shardfmt.save({"w": torch.ones(2)}, str(tmp_path / "final"))
    path = {"a step dir": os.path.join(root, "step_000000100"),
            "a step dir not yet saved": os.path.join(root, "step_000000200"),
            "a plain checkpoint": str(tmp_path / "final")}[given]
    before = sorted(os.walk(tmp_path))
    match = rf"{re.escape(path)}: is a checkpoint, not a Checkpointer root.*pass its parent {re.escape(os.path.dirname(path))}"
    with pytest.raises(shardfmt.errors.CheckpointNotFoundError, match=match):
        Checkpointer(path).restore({"model": torch.nn.Linear(2, 2)})
    with pytest.raises(shardfmt.errors.CheckpointNotFoundError, match=match):
        Checkpointer(path, allow_fresh_start=True).save(1, {"model": torch.nn.Linear(2, 2)})
    assert sorted(os.walk(tmp_path)) == before  # nothing written inside a checkpoint


def test_a_root_another_rank_creates_between_two_looks_is_a_root_not_a_file(tmp_path, monkeypatch):
    """probe_root looked (no directory), then another rank of the job made the root: the second
    look finds a directory, not "a file" (a race a 2-rank CI run met)."""
    from shardfmt.io.registry import get_storage
    from shardfmt.training.roots import probe_root

    storage, root = get_storage(str(tmp_path / "root"))
    real_isdir, looks = storage.isdir, []

    def isdir(path):
        looks.append(path)
        if len(looks) == 1:
            got = real_isdir(path)
            os.makedirs(tmp_path / "root")  # the other rank, just after this rank's first look
            return got
        return real_isdir(path)

    monkeypatch.setattr(storage, "isdir", isdir)
    assert probe_root(storage, root) == "root"
