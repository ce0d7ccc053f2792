"""Durable writes of large files bypass the page cache (O_DIRECT) where the filesystem allows,
and give exactly the bytes a page-cache write gives; where it does not, they fall back."""

import errno
import mmap
import os

import pytest
import torch

import shardfmt
import shardfmt.saving.writer
from shardfmt.errors import StorageError
from shardfmt.io import aligned
from shardfmt.io.local import LocalStorage
from shardfmt.saving.shard_file import ShardData, _gather, write_shard_file

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
    """Record the fds opened with O_DIRECT (``read_fds``: those for reading only); optionally
    refuse such opens as a filesystem would."""

    def __init__(self, monkeypatch, *, refuse: bool = False) -> None:
        self.direct_fds: list[int] = []
        self.read_fds: list[int] = []
        real = os.open

        def spy(path, flags, *a, **k):
            if flags & os.O_DIRECT:
                if refuse:
                    raise OSError(errno.EINVAL, "Invalid argument", path)
                fd = real(path, flags, *a, **k)
                self.direct_fds.append(fd)
                if not flags & (os.O_WRONLY | os.O_RDWR):
                    self.read_fds.append(fd)
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


# ---------------------------------------------------------------- reads


def _saved(tmp_path):
    g = torch.Generator().manual_seed(3)
    state = {"w": torch.randn(700_001, generator=g), "h": torch.randn(333, 777, generator=g, dtype=torch.float64)}
    path = str(tmp_path / "ck")
    shardfmt.save(state, path, chunk_size=1 << 20)
    return state, path


class _DirectReads:
    """Count the O_DIRECT read handles opened and the bytes read through them."""

    def __init__(self, monkeypatch, *, refuse_open: bool = False, refuse_read: bool = False) -> None:
        self.fds = _Opens(monkeypatch, refuse=refuse_open).read_fds
        self.bytes = 0
        real_preadv = os.preadv

        def spy_preadv(fd, bufs, offset, *a):
            if fd in self.fds:
                if refuse_read:
                    raise OSError(errno.EINVAL, "Invalid argument")
                n = real_preadv(fd, bufs, offset, *a)
                self.bytes += n
                return n
            return real_preadv(fd, bufs, offset, *a)

        monkeypatch.setattr(os, "preadv", spy_preadv)


def test_a_single_process_load_reads_around_the_page_cache(tmp_path, monkeypatch):
    state, path = _saved(tmp_path)
    reads = _DirectReads(monkeypatch)
    out = {k: torch.full_like(v, float("nan")) for k, v in state.items()}
    shardfmt.load(out, path)
    assert reads.fds and reads.bytes >= 700_001 * 4  # the large reads went O_DIRECT
    assert all(torch.equal(out[k], state[k]) for k in state)


@pytest.mark.parametrize("refuse", ["open", "read"])
def test_a_filesystem_refusing_direct_reads_still_loads(tmp_path, monkeypatch, refuse):
    state, path = _saved(tmp_path)
    _DirectReads(monkeypatch, refuse_open=refuse == "open", refuse_read=refuse == "read")
    out = {k: torch.full_like(v, float("nan")) for k, v in state.items()}
    shardfmt.load(out, path)
    assert all(torch.equal(out[k], state[k]) for k in state)


def test_a_slice_starting_off_a_block_boundary_reads_exactly_its_bytes(tmp_path, monkeypatch):
    from shardfmt.loading import executor

    state, path = _saved(tmp_path)
    reads = _DirectReads(monkeypatch)
    monkeypatch.setattr(executor, "DIRECT_MIN_SHARE", 0.0)  # part of the file: direct all the same
    lo, n = 12_345, 600_000  # starts mid-block; without verification the read is not chunk-rounded
    backing = torch.full((n + 2,), 7.0)
    part = shardfmt.ShardedTensor(backing[1:-1], global_shape=(700_001,), offsets=(lo,))
    shardfmt.load({"w": part}, path, strict=False, verify=False)
    assert reads.fds
    assert torch.equal(backing[1:-1], state["w"][lo:lo + n])
    assert backing[0] == 7.0 and backing[-1] == 7.0  # its neighbours untouched


def test_a_corrupt_chunk_read_directly_is_caught(tmp_path, monkeypatch):
    state, path = _saved(tmp_path)
    f = next((tmp_path / "ck" / "data").iterdir())
    raw = bytearray(f.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    f.write_bytes(bytes(raw))
    reads = _DirectReads(monkeypatch)
    out = {k: torch.zeros_like(v) for k, v in state.items()}
    with pytest.raises(shardfmt.errors.IntegrityError, match=f"{f.name}: .*chunk"):
        shardfmt.load(out, path)
    assert reads.fds


def test_bytes_other_ranks_may_read_stay_in_the_page_cache(tmp_path, monkeypatch):
    """A rank of a 2-rank job loading a plain (replicated) tensor: its neighbour reads the same
    bytes, so they are read through the page cache (from the device once)."""
    from shardfmt.format.manifest import Topology

    w = torch.randn(700_001)
    path = str(tmp_path / "two")
    cw = shardfmt.saving.writer.CheckpointWriter(path)
    cw.write_rank(0, [ShardData(fqn="w", data=w, global_shape=(700_001,), offsets=(0,))])
    cw.write_rank(1, [])
    cw.commit(step=1, topology=Topology(world_size=2))
    reads = _DirectReads(monkeypatch)
    out = {"w": torch.zeros_like(w)}
    shardfmt.load(out, path, rank=1)
    assert reads.fds == [] and torch.equal(out["w"], w)


def test_parts_not_aligned_to_blocks_write_through_the_page_cache(tmp_path, monkeypatch):
    """A part size that is no multiple of 4096 (chunk_size 5120): padding a part's last block
    would overwrite the next part's first bytes, so such files are written buffered."""
    opens = _Opens(monkeypatch)
    w = torch.randn(900_000, generator=torch.Generator().manual_seed(1))
    path = str(tmp_path / "ck")
    shardfmt.save({"w": w}, path, chunk_size=5120, part_size=5120 * 205, write_workers=2)
    assert opens.direct_fds == []
    assert shardfmt.validate(path, deep=True).ok
    out = {"w": torch.zeros_like(w)}
    shardfmt.load(out, path)
    assert torch.equal(out["w"], w)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork")
def test_a_forked_child_has_bounce_buffers_of_its_own():
    with aligned.POOL.buffer(1 << 18) as b:
        b.mv[:4] = b"PRNT"
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its pool starts empty, and the parent's buffer is a private copy
        ok = aligned.POOL._free == []
        b.mv[:4] = b"CHLD"
        os.write(w, b"1" if ok else b"0")
        os._exit(0)
    os.close(w)
    assert os.read(r, 1) == b"1"
    os.waitpid(pid, 0)
    assert bytes(b.mv[:4]) == b"PRNT"


@pytest.mark.parametrize("direct", ["1", "0"])
def test_only_reads_through_the_page_cache_are_hinted_to_the_kernel(tmp_path, monkeypatch, direct):
    from shardfmt.io import local

    state, path = _saved(tmp_path)
    monkeypatch.setenv("SHARDFMT_DIRECT_IO", direct)
    hints = []
    real = local._LocalReader.prefetch
    monkeypatch.setattr(local._LocalReader, "prefetch", lambda self, o, n: (hints.append(n), real(self, o, n)))
    out = {k: torch.zeros_like(v) for k, v in state.items()}
    shardfmt.load(out, path)
    assert all(torch.equal(out[k], state[k]) for k in state)
    assert (sum(hints) >= 700_001 * 4) == (direct == "0")  # read-ahead for page-cache reads only


@pytest.mark.parametrize("version", [1, 2])
def test_a_direct_load_reads_the_file_once_not_whole_bounce_buffers(tmp_path, monkeypatch, version):
    """A direct read fetches the blocks that hold its bytes, not the rest of its bounce buffer,
    so a load reads the file's data once, plus one block at each read's ends (v2's reads start
    off block boundaries: before the fix a 1 GiB v2 load read 22% more than the file, v1 9%)."""
    g = torch.Generator().manual_seed(5)
    state = {f"t{i}": torch.randn(n, generator=g) for i, n in enumerate((900_001, 1_300_003, 700_001, 2_100_005))}
    path = str(tmp_path / "ck")
    shardfmt.save(state, path, format_version=version)
    (f,) = shardfmt.read_manifest(path).files.values()
    reads = _DirectReads(monkeypatch)
    out = {k: torch.full_like(v, float("nan")) for k, v in state.items()}
    rep = shardfmt.load(out, path, max_read=3 << 20)  # ~7 reads, each ending inside a bounce buffer
    assert all(torch.equal(out[k], state[k]) for k in state)
    assert reads.fds and rep.bytes_read >= f.size - f.header_size
    assert reads.bytes <= f.size - f.header_size + 2 * aligned.DIRECT_ALIGN * rep.read_requests


def test_reads_go_around_the_page_cache_only_from_files_the_process_reads_nearly_whole(tmp_path, monkeypatch):
    """A process reading (nearly) all of a file reads it directly; one reading part of it (the
    rest is another rank's: a 2 -> 4 reshard) reads through the page cache, where the kernel's
    read-ahead makes the ranks' interleaved runs one sequential stream."""
    state, path = _saved(tmp_path)
    reads = _DirectReads(monkeypatch)
    whole = {k: torch.zeros_like(v) for k, v in state.items()}
    shardfmt.load(whole, path)
    assert reads.fds and reads.bytes > 0.9 * (700_001 * 4 + 333 * 777 * 8)
    reads.fds.clear()
    reads.bytes = 0
    half = shardfmt.ShardedTensor(torch.zeros(350_000), global_shape=(700_001,), offsets=(0,))
    shardfmt.load({"w": half}, path, strict=False)  # 1.4 MB of a 4.9 MB file
    assert reads.bytes == 0 and torch.equal(half.local, state["w"][:350_000])
