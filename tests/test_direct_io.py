"""Durable writes of large files bypass the page cache (O_DIRECT) where the filesystem allows,
and give exactly the bytes a page-cache write gives; where it does not, they fall back."""

import errno
import mmap
import os

import pytest
import torch

import shardfmt
from shardfmt import aligned
from shardfmt.errors import StorageError
from shardfmt.storage import LocalStorage
from shardfmt.writer import ShardData, _gather, write_shard_file

pytestmark = pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="no O_DIRECT on this OS")


def _shards():
    """~3.3 MiB in three dtypes: the header and the file's end fall off 4096-byte boundaries."""
    g = torch.Generator().manual_seed(7)
    return [ShardData(fqn="c", data=torch.randn(300_001, dtype=torch.float64, generator=g),
                      global_shape=(300_001,), offsets=(0,)),
            ShardData(fqn="a", data=torch.randn(1000, 333, generator=g), global_shape=(1000, 333), offsets=(0, 0)),
            ShardData(fqn="b", data=torch.randint(0, 100, (5001,), generator=g, dtype=torch.int16),
                      global_shape=(5001,), offsets=(0,))]


class _Opens:
    """Record the fds opened with O_DIRECT; optionally refuse such opens as a filesystem would."""

    def __init__(self, monkeypatch, *, refuse: bool = False) -> None:
        self.direct_fds: list[int] = []
        real = os.open

        def spy(path, flags, *a, **k):
            if flags & os.O_DIRECT:
                if refuse:
                    raise OSError(errno.EINVAL, "Invalid argument", path)
                fd = real(path, flags, *a, **k)
                self.direct_fds.append(fd)
                return fd
            return real(path, flags, *a, **k)

        monkeypatch.setattr(os, "open", spy)


def _write(tmp_path, name, **kw):
    st = LocalStorage()
    kw = {"workers": 3, **kw}
    w = write_shard_file(st, str(tmp_path), name, 0, _shards(), chunk_size=4096, part_size=1 << 20, **kw)
    return w, (tmp_path / name).read_bytes()


def _reference(tmp_path, monkeypatch):
    with monkeypatch.context() as m:
        m.setenv("SHARDFMT_DIRECT_IO", "0")
        opens = _Opens(m)
        ref = _write(tmp_path, "ref.safetensors")
    assert opens.direct_fds == []  # the switch turns direct I/O off
    return ref


def test_a_direct_write_gives_the_page_cache_write_s_bytes(tmp_path, monkeypatch):
    ref, ref_bytes = _reference(tmp_path, monkeypatch)
    assert ref.record.size % aligned.DIRECT_ALIGN and ref.record.header_size % aligned.DIRECT_ALIGN
    opens = _Opens(monkeypatch)
    got, got_bytes = _write(tmp_path, "direct.safetensors")
    assert len(opens.direct_fds) == 1  # it did go through O_DIRECT
    assert got_bytes == ref_bytes  # padding trimmed: the exact size and bytes
    assert got.record.chunks == ref.record.chunks and got.record.digest == ref.record.digest


def test_one_writer_thread_writes_direct_too(tmp_path, monkeypatch):
    ref, ref_bytes = _reference(tmp_path, monkeypatch)
    opens = _Opens(monkeypatch)
    got, got_bytes = _write(tmp_path, "one.safetensors", workers=1)
    assert opens.direct_fds and got_bytes == ref_bytes and got.record.chunks == ref.record.chunks


def test_a_filesystem_without_direct_io_gets_the_same_file(tmp_path, monkeypatch):
    ref, ref_bytes = _reference(tmp_path, monkeypatch)
    _Opens(monkeypatch, refuse=True)
    got, got_bytes = _write(tmp_path, "fallback.safetensors")
    assert got_bytes == ref_bytes and got.record.chunks == ref.record.chunks


def test_a_direct_write_refused_part_way_falls_back_for_the_rest(tmp_path, monkeypatch):
    ref, ref_bytes = _reference(tmp_path, monkeypatch)
    opens = _Opens(monkeypatch)
    real, calls = os.pwrite, []

    def pwrite(fd, data, offset):
        if fd in opens.direct_fds:
            calls.append(offset)
            if len(calls) > 2:  # e.g. a filesystem that takes some direct writes, not others
                raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", pwrite)
    got, got_bytes = _write(tmp_path, "mixed.safetensors")
    assert len(calls) >= 3
    assert got_bytes == ref_bytes and got.record.chunks == ref.record.chunks


def test_a_failing_direct_write_is_a_storage_error_and_nothing_is_committed(tmp_path, monkeypatch):
    opens = _Opens(monkeypatch)
    real = os.pwrite

    def pwrite(fd, data, offset):
        if fd in opens.direct_fds:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", pwrite)
    state = {s.fqn: s.data for s in _shards()}
    with pytest.raises(StorageError, match="rank_00000.*No space left"):
        shardfmt.save(state, str(tmp_path / "ck"), chunk_size=4096, write_workers=3, part_size=1 << 20)
    assert opens.direct_fds
    assert not (tmp_path / "ck").exists()
    assert [p.name for p in tmp_path.iterdir()] == []  # the staging dir is gone too


def test_a_save_without_sync_stays_in_the_page_cache(tmp_path, monkeypatch):
    opens = _Opens(monkeypatch)
    _write(tmp_path, "nosync.safetensors", sync=False)
    assert opens.direct_fds == []


def test_a_direct_save_loads_and_validates(tmp_path, monkeypatch):
    opens = _Opens(monkeypatch)
    state = {s.fqn: s.data for s in _shards()}
    shardfmt.save(state, str(tmp_path / "ck"), chunk_size=4096, write_workers=2, part_size=1 << 20)
    assert opens.direct_fds
    assert shardfmt.validate(str(tmp_path / "ck"), deep=True).ok
    out = {k: torch.full_like(v, 3) for k, v in state.items()}
    shardfmt.load(out, str(tmp_path / "ck"))
    assert all(torch.equal(out[k], state[k]) for k in state)


def test_memory_aligned_like_the_file_is_written_without_a_copy(monkeypatch):
    buf = mmap.mmap(-1, 6 * aligned.DIRECT_ALIGN)  # page-aligned memory
    mv = memoryview(buf)
    mv[:] = os.urandom(len(mv))
    header = memoryview(b"h" * 100)
    segments = [(0, header, None), (100, mv[100:], None)]  # file byte 4096 = memory page 1
    copies = []
    real = aligned.copy
    monkeypatch.setattr(aligned, "copy", lambda *a: (copies.append(a), real(*a)))
    with aligned.POOL.buffer(1 << 18) as bounce:
        i, block = _gather(segments, 1, 4096, 3 * 4096, bounce)
        assert copies == [] and i == 1
        assert aligned.address(block, 0) == aligned.address(mv, aligned.DIRECT_ALIGN)  # the tensor's own memory
        i, block = _gather(segments, 0, 0, 4096, bounce)  # header + data: gathered into the bounce buffer
        assert len(copies) == 2 and i == 1  # the header's bytes and the tensor's
        assert bytes(block) == b"h" * 100 + bytes(mv[100:4096])
