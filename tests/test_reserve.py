"""A save allocates each data file's bytes before writing them (``fallocate``): the file is laid
out in a few long runs however its parts are written, and a disk without the room fails the
save before a byte of the file is written, with an error naming it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import shardfmt
from shardfmt.io import local as local_io
from shardfmt.io import posix

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fallocate is Linux's")


def _state(n: int = 4) -> dict:
    g = torch.Generator().manual_seed(3)
    return {f"w{i}": torch.randn(512, 1024, generator=g) for i in range(n)}  # 2 MiB each


def _name(fd: int) -> str:
    return os.readlink(f"/proc/self/fd/{fd}")


def _allocates(directory) -> bool:
    """Whether the filesystem under ``directory`` allocates ahead (``fallocate``)."""
    fd = os.open(os.path.join(directory, "probe"), os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        return posix.fallocate(fd, 1 << 20)
    finally:
        os.close(fd)
        os.remove(os.path.join(directory, "probe"))


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
def test_every_data_file_is_allocated_whole_before_its_first_byte(tmp_path, monkeypatch, direct):
    events: list[tuple[str, str, int, bool]] = []  # (what, file, bytes, grow)
    real_fallocate, real_write, real_pwrite = posix.fallocate, os.write, os.pwrite

    def fallocate(fd, size, *, grow=False):
        events.append(("reserve", _name(fd), size, grow))
        return real_fallocate(fd, size, grow=grow)

    def write(fd, data):
        events.append(("write", _name(fd), memoryview(data).nbytes, False))
        return real_write(fd, data)

    def pwrite(fd, data, offset):
        events.append(("write", _name(fd), memoryview(data).nbytes, False))
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(local_io, "fallocate", fallocate)
    monkeypatch.setattr(os, "write", write)
    monkeypatch.setattr(os, "pwrite", pwrite)
    monkeypatch.setenv("SHARDFMT_DIRECT_IO", "1" if direct else "0")
    shardfmt.save(_state(), str(tmp_path / "ck"), write_workers=3, part_size=1 << 20)

    final = {os.path.basename(p): os.path.getsize(p) for p in (tmp_path / "ck" / "data").iterdir()}
    reserved = [(os.path.basename(f), size, grow) for what, f, size, grow in events if what == "reserve"]
    assert sorted((f, size) for f, size, _ in reserved) == sorted(final.items())  # each file, at its final size
    # direct parts land inside the file's size; buffered writes keep the size the bytes written
    assert all(grow is direct for _, _, grow in reserved)
    for name, _, _ in reserved:
        mine = [what for what, f, _, _ in events if os.path.basename(f.split(" (deleted)")[0]) == name]
        assert mine[0] == "reserve" and "write" in mine  # before the file's first write


def test_an_allocated_file_holds_its_blocks_and_keeps_its_size_unless_it_grows(tmp_path):
    if not _allocates(tmp_path):
        pytest.skip("this filesystem does not allocate ahead")
    for grow in (False, True):
        path = tmp_path / f"f{grow}"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            os.write(fd, b"x" * 4096)
            assert posix.fallocate(fd, 8 << 20, grow=grow) is True
            st = os.fstat(fd)
        finally:
            os.close(fd)
        assert st.st_blocks * 512 >= 8 << 20  # the blocks are there
        assert st.st_size == (8 << 20 if grow else 4096)  # a file cut short still looks short
        assert path.read_bytes()[:4096] == b"x" * 4096


def _convert(src: str, dst: str) -> None:
    from reshard.convert import convert

    convert(src, dst, "tp=2", memory_budget="4MiB")  # streams each output file in order


def _archive(src: str, dst: str) -> None:
    from shardfmt.io.local import LocalStorage
    from shardfmt.training.archive import copy_checkpoint

    copy_checkpoint(LocalStorage(), src, LocalStorage(), dst)


@pytest.mark.parametrize("write", [_convert, _archive], ids=["convert", "archive"])
def test_the_offline_writers_files_are_allocated_whole_too(tmp_path, monkeypatch, write):
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    shardfmt.save(_state(), src)
    reserved: list[tuple[int, bool]] = []
    real = posix.fallocate

    def fallocate(fd, size, *, grow=False):
        reserved.append((size, grow))
        return real(fd, size, grow=grow)

    monkeypatch.setattr(local_io, "fallocate", fallocate)
    write(src, dst)
    sizes = sorted(os.path.getsize(os.path.join(dst, "data", f)) for f in os.listdir(os.path.join(dst, "data")))
    assert sizes and sorted(reserved) == [(n, False) for n in sizes]  # in order: each keeps its written size


def test_where_the_filesystem_cannot_allocate_nothing_happens():
    fd = os.open(os.devnull, os.O_WRONLY)  # a character device: fallocate says ENODEV
    try:
        assert posix.fallocate(fd, 1 << 20) is False
    finally:
        os.close(fd)


_FULL_DISK = r"""
import json, os, resource, signal, sys
import torch
import shardfmt
from shardfmt.errors import StorageError

# past the limit, a file that takes its size at once fails as on a full disk (EFBIG, not ENOSPC)
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
written = {"data": 0}
real_write, real_pwrite = os.write, os.pwrite

def _data(fd):
    try:
        return os.readlink(f"/proc/self/fd/{fd}").endswith(".safetensors")
    except OSError:
        return False

def write(fd, data):
    if _data(fd):
        written["data"] += memoryview(data).nbytes
    return real_write(fd, data)

def pwrite(fd, data, offset):
    if _data(fd):
        written["data"] += memoryview(data).nbytes
    return real_pwrite(fd, data, offset)

os.write, os.pwrite = write, pwrite
state = {f"w{i}": torch.ones(512, 1024) for i in range(4)}  # 8 MiB, in one data file
resource.setrlimit(resource.RLIMIT_FSIZE, (4 << 20, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
try:
    shardfmt.save(state, sys.argv[1], write_workers=3, part_size=1 << 20)  # direct parts: the file grows at once
    out = {"error": None}
except StorageError as e:
    out = {"error": str(e), "type": type(e).__name__}
out["written"] = written["data"]
print(json.dumps(out))
"""


def test_a_disk_without_room_fails_the_save_before_the_file_is_written(tmp_path):
    if not _allocates(tmp_path):
        pytest.skip("this filesystem does not allocate ahead: the write fails instead")
    target = tmp_path / "ck"
    env = {**os.environ, "SHARDFMT_DIRECT_IO": "1", "PYTHONPATH": ROOT}
    r = subprocess.run([sys.executable, "-c", _FULL_DISK, str(target)], capture_output=True, text=True,
                       env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert "rank_00000.safetensors" in out["error"] and "allocating" in out["error"]
    assert "File too large" in out["error"]
    assert out["written"] == 0  # not a byte of the file: the failure came first
    assert not target.exists() and list(tmp_path.iterdir()) == []  # nothing half-written left behind
