"""Special files and links in a checkpoint (spec sections 2 and 11): a `COMMITTED`,
`manifest.json` or data file that is a FIFO or a device, or that is reached through a symbolic
link (to a FIFO, to a device, to a copy outside the checkpoint, or through a linked `data/`),
is refused unread with SpecialFileError by every reader and tool, at once: never a hang, never
an outside file's bytes in the caller's tensors. A checkpoint dir or root that is itself a link
still works; gc keeps what it cannot vouch for and never removes through a link."""

from __future__ import annotations

import contextlib
import glob
import json
import mmap
import os
import re
import shutil
import stat
import subprocess
import sys
import threading
import warnings
from dataclasses import dataclass

import pytest
import torch
from deadline import deadline

import shardfmt
from reshard.cli import main as reshard_main
from shardfmt.cli import main as shardfmt_main
from shardfmt.io.local import LocalStorage
from shardfmt.training.archive import copy_checkpoint
from shardfmt.training.roots import collect_garbage, list_checkpoints

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
DATA = "data/rank_00000.safetensors"
STEP1, STEP2 = "step_000000001", "step_000000002"
KIND_SAYS = {"fifo": "a FIFO", "link to a fifo": "a symbolic link", "char device": "a character device",
             "link to /dev/zero": "a symbolic link", "link to an outside copy": "a symbolic link",
             "data dir link": "a symbolic link"}


@contextlib.contextmanager
def never_waits(fifos: list[str], what: str, *, after: float = 5.0):
    """Turn a wait on a FIFO into a test failure, not a hung run: from ``after`` seconds on,
    every FIFO in ``fifos`` is opened for writing and closed again (a reader blocked on it, in
    any thread or process, then goes on and reads end of file) and named in the list this
    yields, which the test asserts empty. ``deadline`` backs it up."""
    waited: list[str] = []
    stop = threading.Event()

    def release() -> None:
        if stop.wait(after):
            return
        while not stop.is_set():
            for f in fifos:
                try:
                    os.close(os.open(f, os.O_WRONLY | os.O_NONBLOCK))  # ENXIO: nobody waits on it
                    waited.append(f)
                except OSError:
                    pass
            stop.wait(0.2)

    t = threading.Thread(target=release, daemon=True)
    t.start()
    try:
        with deadline(60, what):
            yield waited
    finally:
        stop.set()
        t.join()


def _state(seed: int) -> dict:
    torch.manual_seed(seed)
    return {"model": torch.nn.Linear(64, 32)}


@pytest.fixture(scope="module")
def _root_template(tmp_path_factory) -> str:
    """Steps 1 and 2 saved once for the module (two saves for each of ~100 tests were half its time)."""
    path = str(tmp_path_factory.mktemp("special") / "root")
    ck = shardfmt.Checkpointer(path)
    ck.save(1, _state(1))
    ck.save(2, _state(2))
    return path


@pytest.fixture
def root(_root_template, tmp_path) -> str:
    """A Checkpointer root with steps 1 and 2 (different weights): a fresh copy for each test."""
    path = str(tmp_path / "root")
    shutil.copytree(_root_template, path)
    return path


@dataclass(frozen=True)
class Broken:
    ckpt: str  # the checkpoint with the bad member (step 2 of the root)
    member: str  # the name refused: COMMITTED, manifest.json, data/..., or data
    says: str  # what the error calls it
    fifos: list[str]

    @property
    def match(self) -> str:
        return f"{re.escape(self.member)}: is {self.says}"


def _break(path: str, member: str, kind: str, outside: str) -> list[str]:
    """Replace ``path/member`` with ``kind``; return the FIFOs made (to release a hung reader)."""
    target = os.path.join(path, member)
    os.makedirs(outside, exist_ok=True)
    if kind == "data dir link":
        shutil.copytree(os.path.join(path, "data"), os.path.join(outside, "data"))
        shutil.rmtree(os.path.join(path, "data"))
        os.symlink(os.path.join(outside, "data"), os.path.join(path, "data"))
        return []
    if kind == "link to an outside copy":
        copy = os.path.join(outside, os.path.basename(member))
        shutil.copyfile(target, copy)  # the same bytes: only the link gives it away
        os.remove(target)
        os.symlink(copy, target)
        return []
    os.remove(target)
    if kind == "fifo":
        os.mkfifo(target)
        return [target]
    if kind == "link to a fifo":
        fifo = os.path.join(outside, "fifo")
        os.mkfifo(fifo)
        os.symlink(fifo, target)
        return [fifo]
    if kind == "char device":
        try:
            os.mknod(target, stat.S_IFCHR | 0o644, os.makedev(1, 5))  # what /dev/zero is
        except PermissionError:
            pytest.skip("mknod is not permitted here")
        return []
    assert kind == "link to /dev/zero"
    os.symlink("/dev/zero", target)
    return []


CASES = [(m, k) for m in ("COMMITTED", "manifest.json", DATA) for k in KIND_SAYS if k != "data dir link"]
CASES.append((DATA, "data dir link"))


@pytest.fixture(params=CASES, ids=[f"{m}-{k}" for m, k in CASES])
def broken(request, root, tmp_path) -> Broken:
    member, kind = request.param
    ckpt = os.path.join(root, STEP2)
    fifos = _break(ckpt, member, kind, str(tmp_path / "outside"))
    return Broken(ckpt=ckpt, member="data" if kind == "data dir link" else member, says=KIND_SAYS[kind],
                  fifos=fifos)


def _target() -> dict:
    return {"model.weight": torch.full((32, 64), -1.0), "model.bias": torch.full((32,), -1.0)}


# ----------------------------------------------------------------------------- readers


@pytest.mark.parametrize("verify", [True, False])
def test_load_refuses_it_unread(broken, verify):
    out = _target()
    with never_waits(broken.fifos, "load") as waited:
        with pytest.raises(shardfmt.errors.SpecialFileError, match=broken.match):
            shardfmt.load(out, broken.ckpt, verify=verify, strict=False)
    assert not waited
    if broken.member.startswith("data"):
        assert (out["model.weight"] == -1).all()  # not a byte of anything outside the checkpoint


def test_validate_reports_it_as_a_problem(broken, capsys):
    with never_waits(broken.fifos, "validate") as waited:
        report = shardfmt.validate(broken.ckpt)
        assert shardfmt_main(["validate", broken.ckpt]) == 1  # invalid, not "unreachable" (2)
    assert not waited
    assert not report.ok and any(re.search(broken.match, str(p)) for p in report.problems), report.problems
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.slow
def test_ls_lists_each_as_corrupt(tmp_path):
    """One ``shardfmt ls`` (a process of its own) over a root holding every case."""
    root = str(tmp_path / "root")
    shardfmt.Checkpointer(root).save(1, _state(1))
    fifos, want = [], {}
    for k, (member, kind) in enumerate(CASES):
        name = f"step_{k + 2:09d}"
        shutil.copytree(os.path.join(root, STEP1), os.path.join(root, name))
        fifos += _break(os.path.join(root, name), member, kind, str(tmp_path / f"outside-{k}"))
        want[name] = f"{re.escape('data' if kind == 'data dir link' else member)}: is {KIND_SAYS[kind]}"
    with never_waits(fifos, "shardfmt ls") as waited:
        r = subprocess.run([sys.executable, "-m", "shardfmt.cli", "ls", root, "--json"], capture_output=True,
                           text=True, timeout=120, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT))
    assert not waited
    assert r.returncode == 0, r.stderr
    rows = {row["name"]: row for row in json.loads(r.stdout)}
    assert rows.pop(STEP1)["status"] == "committed"
    assert sorted(rows) == sorted(want)
    for name, row in rows.items():
        assert row["status"] == "corrupt" and re.search(want[name], row["reason"]), row


def test_restore_falls_back_and_quarantines_it(broken, root):
    state = _state(0)
    with never_waits(broken.fifos, "restore") as waited:
        with pytest.warns(UserWarning, match=f"{STEP2}.*unusable"):
            step = shardfmt.Checkpointer(root).restore(state)
    assert not waited
    assert step == 1 and torch.equal(state["model"].weight, _state(1)["model"].weight)
    names = os.listdir(root)
    assert STEP2 not in names and any(n.startswith(STEP2 + ".corrupt-") for n in names)


def test_archive_copy_refuses_it(broken, tmp_path):
    dst = str(tmp_path / "archive" / STEP2)
    local = LocalStorage()
    with never_waits(broken.fifos, "archive copy") as waited:
        with pytest.raises(shardfmt.errors.SpecialFileError, match=broken.match):
            copy_checkpoint(local, broken.ckpt, local, dst)
    assert not waited
    assert not os.path.exists(os.path.join(dst, "COMMITTED"))


@pytest.mark.parametrize("tool", [["convert", "--mesh", "dp=1"], ["convert", "--mesh", "dp=1", "--no-verify"],
                                  ["export-hf"]], ids=["convert", "convert-no-verify", "export-hf"])
def test_reshard_tools_refuse_it_in_one_line(broken, tool, tmp_path, capsys):
    dst = str(tmp_path / "out")
    with never_waits(broken.fifos, tool[0]) as waited:
        rc = reshard_main([tool[0], broken.ckpt, dst, *tool[1:], "--no-progress"])
    assert not waited
    err = capsys.readouterr().err
    assert rc == 1 and err.count("\n") == 1 and "error: not a regular file: " in err and re.search(broken.match, err), err
    assert not glob.glob(os.path.join(dst, "**", "COMMITTED"), recursive=True)


def test_a_socket_is_an_invalid_checkpoint_not_a_storage_failure(root, monkeypatch, capsys):
    """Opening a socket fails (ENXIO): that said "storage failure", so restore failed instead of
    falling back, and validate exited 2 (unreachable) instead of 1 (invalid)."""
    import socket

    ckpt = os.path.join(root, STEP2)
    os.remove(os.path.join(ckpt, "COMMITTED"))
    monkeypatch.chdir(ckpt)  # a short name to bind (AF_UNIX paths are short)
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind("COMMITTED")
        with pytest.raises(shardfmt.errors.SpecialFileError, match="COMMITTED: is a socket, not a regular file"):
            shardfmt.load(_target(), ckpt, strict=False)
        assert shardfmt_main(["validate", ckpt]) == 1
        assert "is a socket" in capsys.readouterr().out
        state = _state(0)
        with pytest.warns(UserWarning, match=f"{STEP2}.*unusable"):
            assert shardfmt.Checkpointer(root).restore(state) == 1


def test_verify_false_never_reads_an_outside_file_into_the_tensor(root, tmp_path):
    """The manifest names data/...; a data dir linked to a tampered copy must not be read."""
    ckpt = os.path.join(root, STEP2)
    _break(ckpt, DATA, "data dir link", str(tmp_path / "outside"))
    outside = str(tmp_path / "outside" / DATA)
    size = os.path.getsize(outside)
    with open(outside, "r+b") as f:  # the tensors' bytes sit at the end of the file: make them 0x7f
        f.seek(size - 32 * 64 * 4 - 32 * 4)
        f.write(b"\x7f" * (32 * 64 * 4 + 32 * 4))
    out = _target()
    with pytest.raises(shardfmt.errors.SpecialFileError, match="data: is a symbolic link"):
        shardfmt.load(out, ckpt, verify=False, strict=False)
    assert not (out["model.weight"].view(torch.int32) == 0x7F7F7F7F).any()


def test_fsspec_local_urls_take_the_same_checks(root, tmp_path):
    ckpt = os.path.join(root, STEP2)
    fifos = _break(ckpt, "COMMITTED", "fifo", str(tmp_path / "outside"))
    with never_waits(fifos, "load local://") as waited:
        with pytest.raises(shardfmt.errors.SpecialFileError, match="COMMITTED: is a FIFO"):
            shardfmt.load(_target(), "local://" + ckpt, strict=False)
    assert not waited
    other = os.path.join(root, STEP1)
    _break(other, DATA, "link to an outside copy", str(tmp_path / "outside2"))
    with pytest.raises(shardfmt.errors.SpecialFileError, match="rank_00000.safetensors: is a symbolic link"):
        shardfmt.load(_target(), "local://" + other, strict=False, verify=False)


# ----------------------------------------------------------------------------- links that are fine


def test_a_linked_checkpoint_dir_or_root_still_loads_restores_and_lists(root, tmp_path):
    alias_root = str(tmp_path / "alias-root")
    os.symlink(root, alias_root)
    alias_ckpt = str(tmp_path / "alias-ckpt")
    os.symlink(os.path.join(root, STEP2), alias_ckpt)
    want = _state(2)["model"]
    for path in (alias_ckpt, os.path.join(alias_root, STEP2)):
        out = _target()
        shardfmt.load(out, path, strict=False)
        assert torch.equal(out["model.weight"], want.weight)
        assert shardfmt.validate(path).ok
    state = _state(0)
    assert shardfmt.Checkpointer(alias_root).restore(state) == 2
    assert torch.equal(state["model"].weight, want.weight)
    assert [c["status"] for c in list_checkpoints(alias_root)] == ["committed", "committed"]
    shardfmt.Checkpointer(alias_root).save(3, state)  # and saving through it
    assert sorted(os.listdir(root)) == [STEP1, STEP2, "step_000000003"]


# ----------------------------------------------------------------------------- O_DIRECT


def test_the_direct_handle_reads_the_file_that_was_checked_not_a_link_swapped_in(tmp_path):
    ckpt = tmp_path / "ck"
    (ckpt / "data").mkdir(parents=True)
    name = str(ckpt / "data" / "f.safetensors")
    with open(name, "wb") as f:
        f.write(b"A" * 8192)
    with open(tmp_path / "outside", "wb") as f:
        f.write(b"B" * 8192)
    reader = LocalStorage().open_reader(name, within=str(ckpt))
    try:
        os.rename(name, name + ".moved")
        os.symlink(str(tmp_path / "outside"), name)  # swapped in after the checked open
        if not reader.direct:
            pytest.skip("no O_DIRECT on this filesystem")
        buf = mmap.mmap(-1, 8192)  # page-aligned
        reader.read_block(0, memoryview(buf), 8192)
        assert bytes(buf) == b"A" * 8192
    finally:
        reader.close()


# ----------------------------------------------------------------------------- import sources


@pytest.fixture(scope="module")
def _hf_template(tmp_path_factory) -> str:
    """A Hugging Face folder (two weight files, an index, a config.json), exported once."""
    tmp = tmp_path_factory.mktemp("special-hf")
    ckpt = str(tmp / "ck")
    shardfmt.save({"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(40)}, ckpt, step=1)
    hf = str(tmp / "hf")
    assert reshard_main(["export-hf", ckpt, hf, "--max-shard-size", "100", "--no-progress"]) == 0
    with open(os.path.join(hf, "config.json"), "w") as f:
        f.write("{}")
    return hf


@pytest.fixture
def hf_dir(_hf_template, tmp_path) -> str:
    """A Hugging Face folder (two weight files, an index, a config.json): a fresh copy for each test."""
    hf = str(tmp_path / "hf")
    shutil.copytree(_hf_template, hf)
    return hf


HF_CASES = [(m, k) for m in ("weights", "index", "config.json")
            for k in ("fifo", "link to a fifo", "char device", "link to /dev/zero")]


@pytest.mark.parametrize(("member", "kind"), HF_CASES, ids=[f"{m}-{k}" for m, k in HF_CASES])
def test_import_hf_refuses_a_source_that_is_not_a_regular_file(hf_dir, member, kind, tmp_path, capsys):
    name = {"weights": sorted(n for n in os.listdir(hf_dir) if n.endswith(".safetensors"))[0],
            "index": "model.safetensors.index.json", "config.json": "config.json"}[member]
    assert os.path.exists(os.path.join(hf_dir, name))
    fifos = _break(hf_dir, name, kind, str(tmp_path / "outside"))
    says = {"fifo": "a FIFO", "link to a fifo": "a FIFO"}.get(kind, "a character device")  # links followed
    dst = str(tmp_path / "imported")
    with never_waits(fifos, "import-hf") as waited:
        rc = reshard_main(["import-hf", hf_dir, dst, "--no-progress"])
    assert not waited
    err = capsys.readouterr().err
    assert rc == 1 and err.count("\n") == 1 and f"{name}: is {says}" in err, err
    assert not os.path.exists(dst)


def test_import_hf_follows_the_hub_caches_links(hf_dir, tmp_path):
    """A hub cache snapshot is links into blobs/: a Hugging Face folder's links are followed."""
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    for n in os.listdir(hf_dir):
        shutil.move(os.path.join(hf_dir, n), blobs / n)
        os.symlink(blobs / n, os.path.join(hf_dir, n))
    dst = str(tmp_path / "imported")
    assert reshard_main(["import-hf", hf_dir, dst, "--no-progress"]) == 0
    out = {"w": torch.zeros(3, 4), "b": torch.zeros(40)}
    shardfmt.load(out, dst)
    assert torch.equal(out["w"], torch.arange(12.0).reshape(3, 4))


@pytest.fixture(scope="module")
def _dcp_template(tmp_path_factory) -> str:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    path = str(tmp_path_factory.mktemp("special-dcp") / "dcp")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.arange(6.0)}, storage_writer=FileSystemWriter(path), no_dist=True)
    return path


@pytest.fixture
def dcp_dir(_dcp_template, tmp_path) -> str:
    """A torch.distributed.checkpoint directory: a fresh copy for each test."""
    path = str(tmp_path / "dcp")
    shutil.copytree(_dcp_template, path)
    return path


DCP_CASES = [(m, k) for m in (".metadata", "__0_0.distcp")
             for k in ("fifo", "link to a fifo", "char device", "link to /dev/zero", "link to an outside copy")]


@pytest.mark.parametrize(("member", "kind"), DCP_CASES, ids=[f"{m}-{k}" for m, k in DCP_CASES])
def test_import_dcp_refuses_a_special_file_or_a_link(dcp_dir, member, kind, tmp_path, capsys):
    assert os.path.exists(os.path.join(dcp_dir, member))
    fifos = _break(dcp_dir, member, kind, str(tmp_path / "outside"))
    dst = str(tmp_path / "imported")
    with never_waits(fifos, "import-dcp") as waited:
        rc = reshard_main(["import-dcp", dcp_dir, dst, "--trust-pickle"])
    assert not waited
    err = capsys.readouterr().err
    assert rc == 1 and err.count("\n") == 1 and f"{member}: is {KIND_SAYS[kind]}" in err, err
    assert not os.path.exists(dst)


# ----------------------------------------------------------------------------- gc


def _staging(root: str, name: str, files: dict[str, bytes]) -> str:
    path = os.path.join(root, name)
    for rel, data in files.items():
        os.makedirs(os.path.dirname(os.path.join(path, rel)), exist_ok=True)
        with open(os.path.join(path, rel), "wb") as f:
            f.write(data)
    return path


def _age(path: str) -> None:
    os.utime(path, (1, 1), follow_symlinks=False)
    if not os.path.islink(path):
        os.utime(path, (1, 1))


def test_gc_removes_a_dead_staging_dir_but_keeps_one_holding_a_fifo_or_a_link(tmp_path):
    root = str(tmp_path / "root")
    plain = _staging(root, "step_000000003.tmp-" + "a" * 16, {"manifest.json": b"{}", DATA: b"x"})
    fifo = _staging(root, "step_000000004.tmp-" + "b" * 16, {"manifest.json": b"{}"})
    os.makedirs(os.path.join(fifo, "data"))
    os.mkfifo(os.path.join(fifo, DATA))
    outside = _staging(str(tmp_path), "outside", {"rank_00000.safetensors": b"keep me"})
    linked = _staging(root, "step_000000005.tmp-" + "c" * 16, {"manifest.json": b"{}"})
    os.symlink(outside, os.path.join(linked, "data"))
    elsewhere = _staging(str(tmp_path), "elsewhere", {"manifest.json": b"{}", DATA: b"keep me too"})
    link = os.path.join(root, "step_000000006.tmp-" + "d" * 16)
    os.symlink(elsewhere, link)
    for p in (plain, fifo, linked, link, elsewhere):
        _age(p)
    with never_waits([os.path.join(fifo, DATA)], "gc") as waited:
        removed = collect_garbage(LocalStorage(), root, lease_seconds=60)
    assert not waited
    assert removed == [plain]
    assert sorted(os.listdir(root)) == sorted(os.path.basename(p) for p in (fifo, linked, link))
    with open(os.path.join(outside, "rank_00000.safetensors"), "rb") as f:
        assert f.read() == b"keep me"
    with open(os.path.join(elsewhere, DATA), "rb") as f:
        assert f.read() == b"keep me too"


def test_gc_on_fsspecs_local_filesystem_keeps_a_leftover_holding_a_fifo(tmp_path):
    """``local://`` goes through fsspec (no staging dirs): an uncommitted prefix is a dead save's
    leftover only if it holds what a save writes, which is never a FIFO."""
    from shardfmt.io.registry import get_storage

    root = str(tmp_path / "root")
    dead = _staging(root, "step_000000001", {"LEASE": b"{}", "data/rank_00000.0123456789abcdef.safetensors": b"x"})
    fifo = _staging(root, "step_000000002", {"LEASE": b"{}"})
    os.makedirs(os.path.join(fifo, "data"))
    os.mkfifo(os.path.join(fifo, "data", "rank_00000.0123456789abcdef.safetensors"))
    for p in (dead, fifo):
        os.utime(os.path.join(p, "LEASE"), (1, 1))
    storage, path = get_storage("local://" + root)
    with never_waits([os.path.join(fifo, "data", "rank_00000.0123456789abcdef.safetensors")], "gc") as waited:
        removed = collect_garbage(storage, path, lease_seconds=60)
    assert not waited
    assert [os.path.basename(r) for r in removed] == ["step_000000001"]
    assert os.listdir(root) == ["step_000000002"]


def test_remove_tree_removes_links_never_what_they_point_at(tmp_path):
    outside = _staging(str(tmp_path), "outside", {"a": b"1", "sub/b": b"2"})
    tree = _staging(str(tmp_path), "tree", {"x": b"3"})
    os.symlink(outside, os.path.join(tree, "dir-link"))
    os.symlink(os.path.join(outside, "a"), os.path.join(tree, "file-link"))
    alias = str(tmp_path / "alias")
    os.symlink(outside, alias)
    LocalStorage().remove_tree(alias)
    LocalStorage().remove_tree(tree)
    assert not os.path.lexists(alias) and not os.path.lexists(tree)
    assert sorted(os.listdir(outside)) == ["a", "sub"] and os.listdir(os.path.join(outside, "sub")) == ["b"]
