"""The I/O hot paths: parallel part writes, zero-copy reads, strided targets through a bounded buffer."""

import torch

import shardfmt
from shardfmt.io.local import LocalStorage
from shardfmt.saving.shard_file import ShardData, write_shard_file


def _shards():
    g = torch.Generator().manual_seed(1)
    return [ShardData(fqn="a", data=torch.randn(3000, 7, generator=g), global_shape=(3000, 7), offsets=(0, 0)),
            ShardData(fqn="b", data=torch.randint(0, 100, (5001,), generator=g, dtype=torch.int16),
                      global_shape=(5001,), offsets=(0,)),
            ShardData(fqn="c", data=torch.randn(40000, dtype=torch.float64, generator=g), global_shape=(40000,),
                      offsets=(0,)),
            ShardData(fqn="z", data=torch.empty(0, 4), global_shape=(0, 4), offsets=(0, 0))]


def test_parts_written_by_several_threads_give_the_same_file_and_chunks(tmp_path):
    st = LocalStorage()
    ordered = sorted(_shards(), key=lambda s: (-s.data.element_size(), s.fqn))
    one = write_shard_file(st, str(tmp_path), "seq.safetensors", 0, ordered, chunk_size=4096, workers=1)
    st.stats.reset()
    many = write_shard_file(st, str(tmp_path), "par.safetensors", 0, ordered, chunk_size=4096, workers=3,
                            part_size=3 * 4096)
    assert st.stats.write_requests >= many.record.size // (3 * 4096)  # it did go through the part writer
    assert (tmp_path / "seq.safetensors").read_bytes() == (tmp_path / "par.safetensors").read_bytes()
    assert one.record.chunks == many.record.chunks and one.record.digest == many.record.digest
    assert [(f, s.byte_range, s.digest) for f, s in one.shards] == [(f, s.byte_range, s.digest)
                                                                     for f, s in many.shards]


def test_save_with_write_workers_loads_and_validates(tmp_path):
    state = {s.fqn: s.data for s in _shards()}
    state["strided"] = torch.arange(600.0).reshape(20, 30)[:, ::3]  # not contiguous: streamed path
    shardfmt.save(state, str(tmp_path / "c"), chunk_size=4096, write_workers=4, part_size=8192)
    assert shardfmt.validate(str(tmp_path / "c")).ok
    out = {k: torch.empty_like(v) for k, v in state.items()}
    shardfmt.load(out, str(tmp_path / "c"))
    for k in state:
        assert torch.equal(out[k], state[k]), k


def test_a_strided_target_is_filled_and_its_neighbours_untouched(tmp_path):
    w = torch.randn(64, 48)
    shardfmt.save({"w": w}, str(tmp_path / "c"))
    big = torch.full((64, 100), -7.0)
    target = big[:, 20:68]  # a column window of a wider tensor: rows are strided in memory
    assert not target.is_contiguous()
    shardfmt.load({"w": target}, str(tmp_path / "c"))
    assert torch.equal(target, w)
    assert torch.all(big[:, :20] == -7.0) and torch.all(big[:, 68:] == -7.0)
    t = torch.full((48, 64), -3.0).t()  # a transposed target
    shardfmt.load({"w": t}, str(tmp_path / "c"))
    assert torch.equal(t, w)


def test_contiguous_targets_are_read_in_place(tmp_path):
    w = torch.randn(256, 256)
    shardfmt.save({"w": w}, str(tmp_path / "c"))
    target = torch.empty(256, 256)
    ptr = target.data_ptr()
    shardfmt.load({"w": target}, str(tmp_path / "c"))
    assert target.data_ptr() == ptr and torch.equal(target, w)


def test_read_ahead_hints_every_read_once_and_stays_within_its_window():
    """The executor asks the storage to fetch upcoming reads (POSIX_FADV_WILLNEED locally):
    each read is hinted once, before it starts, never more than the window ahead of it,
    and nearby reads of one file are hinted as one range."""
    from shardfmt.layout.geometry import ByteRange
    from shardfmt.loading.files import ReadAhead
    from shardfmt.loading.planner import PhysicalRead

    MiB = 1 << 20
    reads = [PhysicalRead(file="a" if i < 6 else "b", byte_range=ByteRange(i * 8 * MiB, (i + 1) * 8 * MiB), items=())
             for i in range(10)]
    hinted: list[tuple[str, int, int]] = []

    class Reader:
        def __init__(self, name):
            self.name = name

        def prefetch(self, offset, length):
            hinted.append((self.name, offset, offset + length))

    class Readers:
        from shardfmt.loading.files import Readers as _Readers
        prefetch = _Readers.prefetch

        def get(self, name):
            return Reader(name)

    ahead = ReadAhead(reads, Readers(), window=20 * MiB)
    covered = set()
    for k in range(len(reads)):
        ahead.starting(k)
        for f, s, e in hinted:
            covered |= {i for i, r in enumerate(reads) if r.file == f and s <= r.byte_range.start < e}
        assert k in covered, f"read {k} started before it was hinted"
        assert max(covered) <= k + 2, f"hinted {max(covered)} while starting {k}: beyond the 20 MiB window"
    assert covered == set(range(10))
    spans = [(f, s, e) for f, s, e in hinted]
    for i, (f, s, e) in enumerate(spans):  # no byte hinted twice
        for g, s2, e2 in spans[i + 1:]:
            assert f != g or e <= s2 or e2 <= s
    assert len(hinted) < len(reads)  # adjacent reads of a file went as one hint


def test_a_buffered_load_hints_its_first_window_before_any_read_starts(tmp_path, monkeypatch):
    """A read that overtakes the hint for its bytes fetches them itself (on-demand read-ahead, at
    several times the CPU on the development VM): the first window is asked for before the
    reading threads start, not by the first of them while the others read on."""
    import threading
    import time

    from shardfmt.io import local

    state = {f"w{i}": torch.randn(64, 1024) for i in range(6)}
    shardfmt.save(state, str(tmp_path / "c"))
    monkeypatch.setenv("SHARDFMT_DIRECT_IO", "0")
    events: list[str] = []
    lock = threading.Lock()
    prefetch, readinto = local._LocalReader.prefetch, local._LocalReader.readinto

    def slow_prefetch(self, offset, length):
        time.sleep(0.2)  # a hint over a busy device takes a while to submit
        prefetch(self, offset, length)
        with lock:
            events.append("hinted")

    def logged_readinto(self, offset, buffers):
        with lock:
            events.append("read" if sum(len(b) for b in buffers) >= 64 * 1024 * 4 else "header")
        return readinto(self, offset, buffers)

    monkeypatch.setattr(local._LocalReader, "prefetch", slow_prefetch)
    monkeypatch.setattr(local._LocalReader, "readinto", logged_readinto)
    out = {k: torch.empty_like(v) for k, v in state.items()}
    shardfmt.load(out, str(tmp_path / "c"), workers=4, max_read=64 * 1024 * 4)  # a read a tensor
    assert all(torch.equal(out[k], state[k]) for k in state)
    data = [e for e in events if e != "header"]
    assert data.count("read") == len(state) and data[0] == "hinted", data
