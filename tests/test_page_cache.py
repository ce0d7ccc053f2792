"""A checkpoint leaves the training job's page cache as it found it (issue 22): saves drop what they
wrote once it is durable, loads drop what they read once no process of the node needs it, and a
canary file the job had cached stays cached. Residency is read with ``mincore``."""

from __future__ import annotations

import glob
import os

import pytest
import torch

import shardfmt
from tests.pagecache import drops_pages, resident, resident_fraction, warm

EDGE = 0.02  # pages a range's edges keep (dropping rounds inward) and the files' headers, at most


@pytest.fixture
def dropping(tmp_path):
    if not hasattr(os, "posix_fadvise") or not drops_pages(str(tmp_path)):
        pytest.skip("this filesystem keeps clean pages in the page cache when told to drop them (tmpfs)")
    return tmp_path


def _state(n: int = 8) -> dict:
    g = torch.Generator().manual_seed(0)
    sd = {f"w{i}": torch.randn(512, 1024, generator=g) for i in range(n)}  # 2 MiB each
    sd.update({f"small{i}": torch.randn(100, generator=g) for i in range(20)})  # reads under 1 MiB
    return sd


def _data_files(path: str) -> list[str]:
    return sorted(glob.glob(os.path.join(path, "**", "data", "*"), recursive=True))


@pytest.mark.parametrize("mode", ["direct", "buffered"])
def test_a_save_and_a_load_leave_the_page_cache_as_they_found_it(dropping, monkeypatch, mode):
    monkeypatch.setenv("SHARDFMT_DIRECT_IO", "1" if mode == "direct" else "0")
    canary = str(dropping / "canary.bin")
    with open(canary, "wb") as f:
        f.write(os.urandom(8 << 20))
    warm(canary)
    assert resident(canary)[0] == resident(canary)[1]
    sd = _state()
    path = str(dropping / "ckpt")
    shardfmt.save(sd, path)
    files = _data_files(path)
    assert files and resident_fraction(files) <= EDGE  # durable, then out of the cache
    back = {k: torch.full_like(v, float("nan")) for k, v in sd.items()}
    warm_before = resident_fraction(files)
    rep = shardfmt.load(back, path)
    assert all(torch.equal(back[k], sd[k]) for k in sd)
    assert rep.cached == ()  # one process: nothing is kept for another
    assert resident_fraction(files) <= max(EDGE, warm_before)
    assert resident(canary)[0] == resident(canary)[1]  # the job's own cached file is untouched


@pytest.mark.slow
def test_bytes_the_ranks_of_a_node_share_stay_cached_until_every_rank_has_read_them(dropping):
    """2 ranks load the same plain tensors (each whole): a plain load keeps what it read in the
    page cache for the other rank (``LoadReport.cached``), ``release_cached`` drops it, and
    ``Checkpointer.restore`` drops it itself once both ranks have loaded."""
    from tests.distributed.harness import check_all_ok, launch

    root = str(dropping / "root")
    shardfmt.Checkpointer(root).save(1, {"model": _Model()})
    got = check_all_ok(launch("shared_cache", 2, {"root": root}, out_dir=str(dropping / "o"),
                              module="tests.distributed.loop_jobs", env={"SHARDFMT_DIRECT_IO": "0"}))
    for r in got:
        assert r["cached_ranges"] > 0 and r["after_load"] >= 0.5  # kept for the other rank
        assert r["after_release"] <= EDGE and r["after_restore"] <= EDGE
    assert resident_fraction(_data_files(root)) <= EDGE


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(1)
        for i in range(4):
            self.register_buffer(f"w{i}", torch.randn(512, 1024, generator=g))


def test_views_of_one_storage_and_a_copy_left_by_a_crashed_replace_are_not_left_cached(dropping, monkeypatch):
    """One process reading tensors saved as views of one storage keeps nothing for anyone; a
    load that found only the committed copy a crashed overwrite left (``<path>.old-<id>``) names
    it as its ``source``, so what it left cached can be dropped there."""
    monkeypatch.setenv("SHARDFMT_DIRECT_IO", "0")
    base = torch.randn(1 << 21, generator=torch.Generator().manual_seed(2))
    path = str(dropping / "ck")
    shardfmt.save({"a": base[: 1 << 20], "b": base[1 << 20:]}, path)
    back = {"a": torch.zeros(1 << 20), "b": torch.zeros(1 << 20)}
    rep = shardfmt.load(back, path)
    assert torch.equal(torch.cat([back["a"], back["b"]]), base)
    assert rep.cached == () and resident_fraction(_data_files(path)) <= EDGE
    os.rename(path, path + ".old-deadbeef")
    rep = shardfmt.load({"a": torch.zeros(1 << 20), "b": torch.zeros(1 << 20)}, path)
    assert rep.source == path + ".old-deadbeef"


def _saved(dropping, monkeypatch):
    monkeypatch.setenv("SHARDFMT_DIRECT_IO", "0")  # every read through the page cache
    sd = _state()
    path = str(dropping / "ckpt")
    shardfmt.save(sd, path)
    return sd, path, _data_files(path)


def test_a_load_that_fails_still_drops_what_it_read(dropping, monkeypatch):
    """The reads' pages are dropped when the load's reads end, failed or not. (Pages the kernel
    is still fetching ahead when a load fails early may stay: they arrive after the drop.)"""
    sd, path, files = _saved(dropping, monkeypatch)
    with open(files[0], "r+b") as f:  # the last tensor's last byte: its read fails after the others ran
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))
        f.flush()
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    assert resident_fraction(files) <= EDGE
    back = {k: torch.full_like(v, float("nan")) for k, v in sd.items()}
    with pytest.raises(shardfmt.errors.IntegrityError):
        shardfmt.load(back, path, workers=1, max_read=2 << 20)
    assert any(torch.equal(back[k], sd[k]) for k in sd)  # reads before the bad chunk landed
    assert resident_fraction(files) <= EDGE


def test_a_load_drops_in_batches_of_a_bounded_size(dropping, monkeypatch):
    """What a load read through the page cache waits there for at most ``DROP_BATCH`` bytes."""
    from shardfmt.loading import executor, pagecache

    monkeypatch.setenv("SHARDFMT_DIRECT_IO", "0")
    g = torch.Generator().manual_seed(1)
    sd = {f"w{i:02d}": torch.randn(512, 1024, generator=g) for i in range(32)}  # 64 MiB, one file
    path = str(dropping / "ckpt")
    shardfmt.save(sd, path)
    files = _data_files(path)
    held = []
    drop = pagecache.Drops._drop

    def watched(self, ranges):
        held.append(resident(files[0])[0] * os.sysconf("SC_PAGE_SIZE"))
        drop(self, ranges)

    monkeypatch.setattr(pagecache, "DROP_BATCH", 4 << 20)
    monkeypatch.setattr(executor, "PREFETCH_WINDOW", 2 << 20)
    monkeypatch.setattr(pagecache.Drops, "_drop", watched)
    back = {k: torch.full_like(v, float("nan")) for k, v in sd.items()}
    shardfmt.load(back, path, workers=1, max_read=2 << 20)
    assert all(torch.equal(back[k], sd[k]) for k in sd)
    # each flush found the batch, the window asked ahead and the kernel's own read-ahead: half the 64 MiB at most
    assert len(held) >= 8 and max(held) <= 32 << 20, [h >> 20 for h in held]
    assert resident_fraction(files) <= EDGE


def test_a_read_ahead_hint_brings_the_whole_range_into_the_page_cache(dropping):
    """One ``POSIX_FADV_WILLNEED`` reads only the first read-ahead's worth of a range (Linux caps a
    call at ``read_ahead_kb``: 8 MiB of 256 MiB on the development VM), so a buffered load's
    window arrived mostly by on-demand read-ahead, behind its reads. A reader's hint fetches all of it."""
    import time

    from shardfmt.io.local import LocalStorage
    from shardfmt.io.posix import _hint_piece

    piece = _hint_piece(os.stat(dropping).st_dev)
    if piece > 16 << 20:
        pytest.skip(f"read-ahead of {piece >> 20} MiB: a test file many times that is too large here")
    size = max(4 * piece, 32 << 20)  # beyond the larger cap too (the device's largest I/O)
    path = str(dropping / "hinted.bin")
    with open(path, "wb") as f:
        f.write(os.urandom(size))
        f.flush()
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    assert resident(path)[0] <= 16
    reader = LocalStorage().open_reader(path)
    try:
        reader.prefetch(0, size)
        deadline = time.monotonic() + 20
        while resident(path)[0] < resident(path)[1] and time.monotonic() < deadline:
            time.sleep(0.05)
        got, pages = resident(path)
        assert got == pages, f"{got} of {pages} pages read after the hint"
    finally:
        reader.release(0, size)
        reader.close()


def test_a_hint_is_given_in_pieces_that_cover_the_range_once(monkeypatch, tmp_path):
    from shardfmt.io import posix

    calls = []
    monkeypatch.setattr(posix, "fadvise", lambda fd, o, n, advice: calls.append((o, n, advice)))
    monkeypatch.setattr(posix, "_hint_piece", lambda dev: 1000)
    with open(tmp_path / "f", "wb") as f:
        posix.willneed(f.fileno(), 500, 2600)
        posix.willneed(f.fileno(), 7, 0)
    assert calls == [(500, 1000, "WILLNEED"), (1500, 1000, "WILLNEED"), (2500, 600, "WILLNEED")]


def _sysfs(root, dev: str, node: str, read_ahead_kb: str | None, *, partition_of: str | None = None) -> None:
    """A fake ``/sys``: ``dev/block/<dev>`` a link to ``devices/<node>``, the queue's read-ahead
    there (or, for a partition, in the disk's directory above it)."""
    where = root / "devices" / node
    where.mkdir(parents=True, exist_ok=True)
    if partition_of is not None:
        (where / "partition").write_text("1\n")
    if read_ahead_kb is not None:
        queue = (where.parent if partition_of is not None else where) / "queue"
        queue.mkdir(exist_ok=True)
        (queue / "read_ahead_kb").write_text(read_ahead_kb + "\n")
    (root / "dev" / "block").mkdir(parents=True, exist_ok=True)
    os.symlink(os.path.relpath(where, root / "dev" / "block"), root / "dev" / "block" / dev)


@pytest.mark.parametrize("dev,node,kb,partition,want", [
    ((8, 0), "pci/block/sda", "4096", None, 4 << 20),  # a whole disk
    ((8, 1), "pci/block/sda/sda1", "2048", "sda", 2 << 20),  # a partition: its disk's queue
    ((253, 0), "virtual/block/dm-0", "512", None, 512 << 10),  # device-mapper has a queue of its own
    ((259, 0), "pci/block/nvme0n1", "0", None, 128 << 10),  # read-ahead off: the kernel's default
    ((259, 1), "pci/block/nvme0n1", "many", None, 128 << 10),  # not a number
    ((0, 45), None, None, None, 128 << 10),  # no block device (btrfs, overlay, tmpfs, NFS)
])
def test_the_hint_piece_is_the_read_ahead_of_the_files_block_queue(monkeypatch, tmp_path, dev, node, kb,
                                                                    partition, want):
    from shardfmt.io import posix

    if node is not None:
        _sysfs(tmp_path, f"{dev[0]}:{dev[1]}", node, kb, partition_of=partition)
    monkeypatch.setattr(posix, "SYSFS", str(tmp_path))
    assert posix.read_ahead_piece(os.makedev(*dev)) == want


def test_a_changed_read_ahead_is_used_once_the_looked_up_value_is_old(monkeypatch, tmp_path):
    """``blockdev --setra`` on a running job: hints follow it within ``HINT_PIECE_TTL_S``."""
    from shardfmt.io import posix

    _sysfs(tmp_path, "8:0", "pci/block/sda", "4096")
    monkeypatch.setattr(posix, "SYSFS", str(tmp_path))
    monkeypatch.setattr(posix, "_pieces", {})
    now = [1000.0]
    monkeypatch.setattr(posix.time, "monotonic", lambda: now[0])
    dev = os.makedev(8, 0)
    assert posix._hint_piece(dev) == 4 << 20
    (tmp_path / "devices" / "pci/block/sda" / "queue" / "read_ahead_kb").write_text("256\n")
    now[0] += posix.HINT_PIECE_TTL_S / 2
    assert posix._hint_piece(dev) == 4 << 20  # looked up once, not at every hint
    now[0] += posix.HINT_PIECE_TTL_S
    assert posix._hint_piece(dev) == 256 << 10
