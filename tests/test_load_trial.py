"""A large load tries direct and buffered reads on its own first reads and goes on the faster
way (``loading.trial``, issue 22): each way tried alone, the spreads must separate, the
device's choice stays on overlap, a forced mode is never tried, and the bytes are the same."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

import shardfmt
from shardfmt.io import choice, modes
from shardfmt.io import local as local_io
from shardfmt.loading import trial as trial_mod
from shardfmt.loading.trial import MIN_READS, TRIAL_READS, UNIT, ModeTrial
from tests.pagecache import drops_pages, resident, resident_fraction, warm

D, B = modes.DIRECT, modes.BUFFERED


def _run(t: ModeTrial, seconds: dict[str, list[float]]) -> list[str]:
    """Ask for reads one after another (one worker), reporting the tried ones' times; return the ways."""
    ways, left = [], {m: list(v) for m, v in seconds.items()}
    for _ in range(4 * TRIAL_READS):
        mode, timed = t.next_mode()
        ways.append(mode)
        if timed:
            t.timed(mode, UNIT, left[mode].pop(0))
    return ways


def test_each_way_is_tried_alone_then_the_faster_one_reads_the_rest():
    t = ModeTrial.for_load(D, MIN_READS)
    assert t.tried
    ways = _run(t, {D: [0.30, 0.31, 0.32], B: [0.10, 0.11, 0.12]})
    assert ways[:2 * TRIAL_READS] == [D] * TRIAL_READS + [B] * TRIAL_READS  # the device's choice first
    assert ways[2 * TRIAL_READS:] == [B] * (2 * TRIAL_READS)
    assert t.mode == B and t.outcome.mode == B
    assert t.outcome.direct_s == pytest.approx((0.30, 0.31, 0.32)) and "this load's reads" in t.outcome.why


def test_overlapping_or_close_timings_keep_the_devices_choice():
    overlap = ModeTrial.for_load(B, MIN_READS)
    assert _run(overlap, {B: [0.10, 0.20, 0.30], D: [0.12, 0.18, 0.25]})[-1] == B
    assert "overlap" in overlap.outcome.why
    close = ModeTrial.for_load(D, MIN_READS)  # buffered faster, but by less than the margin
    assert _run(close, {D: [0.100, 0.101, 0.102], B: [0.097, 0.098, 0.099]})[-1] == D
    assert "less than" in close.outcome.why


def test_times_count_per_byte():
    t = ModeTrial.for_load(D, MIN_READS)
    for _ in range(TRIAL_READS):
        mode, _ = t.next_mode()
        t.timed(mode, UNIT // 4, 0.05)  # direct: 0.2 s per UNIT
    for _ in range(TRIAL_READS):
        mode, _ = t.next_mode()
        t.timed(mode, 2 * UNIT, 0.2)  # buffered: 0.1 s per UNIT, though each read took longer
    assert t.outcome.mode == B and t.outcome.direct_s == pytest.approx((0.2,) * TRIAL_READS)


def test_a_forced_mode_or_a_small_load_is_not_tried():
    forced = ModeTrial.for_load(D, 100, forced=B)
    assert not forced.tried and forced.next_mode() == (B, False) and "SHARDFMT_DIRECT_IO" in forced.outcome.why
    small = ModeTrial.for_load(D, MIN_READS - 1)
    assert not small.tried and small.next_mode() == (D, False) and "too few" in small.outcome.why


def test_the_second_way_waits_until_the_first_ways_reads_have_reported():
    t = ModeTrial.for_load(D, MIN_READS)
    handed = [t.next_mode() for _ in range(TRIAL_READS)]
    assert handed == [(D, True)] * TRIAL_READS
    got: list[tuple[str, bool]] = []
    waiter = threading.Thread(target=lambda: got.append(t.next_mode()))
    waiter.start()
    time.sleep(0.2)
    assert not got  # a buffered read must not run beside the direct ones being timed
    for _ in range(TRIAL_READS - 1):
        t.timed(D, UNIT, 0.1)
    time.sleep(0.1)
    assert not got
    t.timed(D, UNIT, 0.1)
    waiter.join(5)
    assert got == [(B, True)]


def test_a_failed_tried_read_ends_the_trial_and_frees_the_waiting_workers():
    t = ModeTrial.for_load(B, MIN_READS)
    for _ in range(TRIAL_READS):
        t.next_mode()
    got: list[tuple[str, bool]] = []
    waiter = threading.Thread(target=lambda: got.append(t.next_mode()))
    waiter.start()
    time.sleep(0.1)
    t.failed(B)
    waiter.join(5)
    assert got == [(B, False)] and "failed" in t.outcome.why


# -- through shardfmt.load: local files, the way a slow device would make it

N_TENSORS = MIN_READS + 4
READ = 2 << 20  # max_read: one read per 2 MiB tensor
DOUBTFUL = modes.Choice(D, "direct and buffered overlap: kept direct (the default)", (0.05, 0.06, 0.07), (0.055, 0.06, 0.08))


def _state() -> dict:
    g = torch.Generator().manual_seed(1)
    return {f"w{i:02d}": torch.randn(512, 1024, generator=g) for i in range(N_TENSORS)}  # 2 MiB each


@pytest.fixture
def saved(tmp_path, monkeypatch):
    if not hasattr(os, "O_DIRECT"):
        pytest.skip("no O_DIRECT on this OS")
    sd = _state()
    path = str(tmp_path / "ckpt")
    shardfmt.save(sd, path)
    monkeypatch.setenv("SHARDFMT_DIRECT_IO", "auto")
    monkeypatch.setattr(choice, "use_direct", lambda directory, op: True)  # the device's choice: direct
    monkeypatch.setattr(choice, "measured", lambda directory, op: DOUBTFUL)  # ... measured with doubt: tried
    probe = local_io._LocalReader(os.path.join(path, "COMMITTED"), local_io.IOStats())
    try:
        if not probe.can_direct():
            pytest.skip("this filesystem refuses O_DIRECT")
    finally:
        probe.close()
    return sd, path


def _slowed(monkeypatch, name: str, seconds: float) -> list[int]:
    """Make ``_LocalReader.<name>`` (read_block: direct, readinto: buffered) take ``seconds``
    longer per call; return a list that counts the calls."""
    calls: list[int] = []
    real = getattr(local_io._LocalReader, name)

    def slow(self, *args, **kwargs):
        calls.append(1)
        time.sleep(seconds)
        return real(self, *args, **kwargs)
    monkeypatch.setattr(local_io._LocalReader, name, slow)
    return calls


def _load(path: str, sd: dict):
    back = {k: torch.full_like(v, float("nan")) for k, v in sd.items()}
    rep = shardfmt.load(back, path, max_read=READ, workers=2)
    assert all(torch.equal(back[k], sd[k]) for k in sd)  # bytes equal, whichever way they came
    return rep


def test_a_load_whose_direct_reads_are_slow_goes_buffered_after_its_trial(saved, monkeypatch):
    sd, path = saved
    direct_calls = _slowed(monkeypatch, "read_block", 0.05)
    rep = _load(path, sd)
    assert rep.read_mode.mode == B and "this load's reads" in rep.read_mode.why
    assert len(rep.read_mode.direct_s) == TRIAL_READS == len(rep.read_mode.buffered_s)
    assert TRIAL_READS <= len(direct_calls) <= 2 * TRIAL_READS  # the tried direct reads (a block or two each), no more


def test_a_load_whose_buffered_reads_are_slow_stays_direct(saved, monkeypatch):
    sd, path = saved
    buffered_calls = _slowed(monkeypatch, "readinto", 0.05)
    rep = _load(path, sd)
    assert rep.read_mode.mode == D and "this load's reads" in rep.read_mode.why
    tried = len(buffered_calls)
    assert TRIAL_READS <= tried < N_TENSORS  # the tried buffered reads (and the headers), not the rest


def test_a_device_that_measured_clearly_is_not_tried_again(saved, monkeypatch):
    """Where the device's own probe separated the two ways, a load keeps its choice untried:
    trying would only spend reads on the slower way (benchmarks/README.md, session 20)."""
    sd, path = saved
    clear = modes.Choice(D, "direct faster (spreads separate)", (0.05,) * 5, (0.08,) * 5)
    monkeypatch.setattr(choice, "measured", lambda directory, op: clear)
    large: list[int] = []
    real = local_io._LocalReader.readinto
    monkeypatch.setattr(local_io._LocalReader, "readinto",
                        lambda self, off, bufs: (large.append(1) if sum(map(len, bufs)) >= READ else None,
                                                 real(self, off, bufs))[1])
    rep = _load(path, sd)
    assert rep.read_mode.mode == D and "measured clearly" in rep.read_mode.why
    assert not rep.read_mode.direct_s and not rep.read_mode.buffered_s and not large  # no read went buffered
    for doubt in (DOUBTFUL, modes.Choice(D, "buffered faster by less than 10%: kept direct", (0.10,) * 5, (0.08,) * 5),
                  modes.Choice(D, "unmeasured")):
        monkeypatch.setattr(choice, "measured", lambda directory, op, doubt=doubt: doubt)
        large.clear()
        rep = _load(path, sd)
        assert "this load's reads" in rep.read_mode.why and len(large) >= TRIAL_READS, doubt.why


def test_a_forced_mode_reads_every_large_read_that_way_untried(saved, monkeypatch):
    sd, path = saved
    monkeypatch.setenv("SHARDFMT_DIRECT_IO", "0")
    direct_calls = _slowed(monkeypatch, "read_block", 0.0)
    rep = _load(path, sd)
    assert rep.read_mode.mode == B and "SHARDFMT_DIRECT_IO" in rep.read_mode.why and not direct_calls


def test_a_small_load_takes_the_devices_choice(saved, monkeypatch):
    sd, path = saved
    monkeypatch.setattr(trial_mod, "MIN_READS", N_TENSORS + 1)
    direct_calls = _slowed(monkeypatch, "read_block", 0.0)
    rep = _load(path, sd)
    assert rep.read_mode.mode == D and "too few" in rep.read_mode.why
    assert len(direct_calls) >= N_TENSORS


def test_a_tried_load_leaves_the_page_cache_as_it_found_it(saved, monkeypatch, tmp_path):
    if not hasattr(os, "posix_fadvise") or not drops_pages(str(tmp_path)):
        pytest.skip("this filesystem keeps clean pages in the page cache when told to drop them (tmpfs)")
    sd, path = saved
    _slowed(monkeypatch, "read_block", 0.05)  # so the rest goes buffered, through the cache
    canary = str(tmp_path / "canary.bin")
    with open(canary, "wb") as f:
        f.write(os.urandom(4 << 20))
    warm(canary)
    files = [os.path.join(r, f) for r, _, fs in os.walk(path) for f in fs if "data" in r]
    rep = _load(path, sd)
    assert rep.read_mode.mode == B
    assert resident_fraction(files) <= 0.02  # what the buffered reads brought in is dropped
    assert resident(canary)[0] == resident(canary)[1]


def _in_thread(fn, timeout: float = 60.0):
    """Run ``fn`` on a thread; fail (instead of hanging the suite) if it does not end in ``timeout``."""
    out: dict = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed back to the test
            out["error"] = e
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), "the load hung"
    return out


def test_a_tried_read_that_fails_fails_the_load_without_hanging_the_waiting_workers(saved, monkeypatch, tmp_path):
    if not hasattr(os, "posix_fadvise") or not drops_pages(str(tmp_path)):
        pytest.skip("this filesystem keeps clean pages in the page cache when told to drop them (tmpfs)")
    sd, path = saved
    real = local_io._LocalReader.readinto
    calls: list[int] = []

    def failing(self, offset, buffers):  # the second buffered read of a data file fails
        if sum(len(b) for b in buffers) > 64 << 10:
            calls.append(1)
            if len(calls) == 2:
                time.sleep(0.2)  # the other workers are waiting for the direct way by now
                raise shardfmt.errors.StorageError(f"{self._path}: injected read failure")
        return real(self, offset, buffers)
    monkeypatch.setattr(choice, "use_direct", lambda directory, op: False)  # the device's choice: buffered first
    monkeypatch.setattr(local_io._LocalReader, "readinto", failing)
    files = [os.path.join(r, f) for r, _, fs in os.walk(path) for f in fs if "data" in r]
    back = {k: torch.full_like(v, float("nan")) for k, v in sd.items()}
    out = _in_thread(lambda: shardfmt.load(back, path, max_read=READ, workers=4))
    assert isinstance(out.get("error"), shardfmt.errors.StorageError), out
    assert resident_fraction(files) <= 0.02  # what the buffered reads brought in before the failure is dropped


def test_a_filesystem_that_refuses_direct_reads_midway_ends_the_trial_buffered(saved, monkeypatch):
    sd, path = saved
    monkeypatch.setattr(local_io, "direct_transfer", lambda *a, **k: (0, False))  # EINVAL at the first read
    out = _in_thread(lambda: _load(path, sd))
    assert "error" not in out, out
    rep = out["value"]
    assert rep.read_mode.mode == B and "refused" in rep.read_mode.why


def test_files_on_two_devices_are_not_tried_together(monkeypatch):
    from types import SimpleNamespace

    from shardfmt.loading.executor import Executor
    from shardfmt.loading.options import LoadOptions

    monkeypatch.setenv("SHARDFMT_DIRECT_IO", "auto")
    ex = Executor(SimpleNamespace(remote=False), "/nowhere", [], LoadOptions())

    def trial(devices: dict[str, int]):
        readers = {f: SimpleNamespace(direct=True, device=d, can_direct=lambda: True) for f, d in devices.items()}
        reads = [SimpleNamespace(file=f) for f in sorted(devices) for _ in range(MIN_READS)]
        return ex._trial_for(SimpleNamespace(reads=reads), SimpleNamespace(get=readers.__getitem__), [True] * len(reads),
                             None)
    assert trial({"a": 1, "b": 1}).tried
    two = trial({"a": 1, "b": 2})
    assert not two.tried and "several devices" in two.outcome.why


def test_a_clear_measurement_the_other_way_than_the_load_starts_is_still_tried(monkeypatch):
    """The device measured buffered clearly, yet the load starts direct (say the choice changed
    since its readers asked): the measurement does not vouch for the way the load starts, so it tries."""
    from types import SimpleNamespace

    from shardfmt.loading.executor import Executor
    from shardfmt.loading.options import LoadOptions

    monkeypatch.setenv("SHARDFMT_DIRECT_IO", "auto")
    ex = Executor(SimpleNamespace(remote=False), "/nowhere", [], LoadOptions())

    def trial(known: modes.Choice):
        reader = SimpleNamespace(direct=True, device=1, can_direct=lambda: True, measured=lambda: known)
        reads = [SimpleNamespace(file="a") for _ in range(MIN_READS)]
        return ex._trial_for(SimpleNamespace(reads=reads), SimpleNamespace(get=lambda f: reader), [True] * len(reads),
                             None)
    assert not trial(modes.Choice(D, "direct faster", (0.05,) * 5, (0.08,) * 5)).tried
    assert trial(modes.Choice(B, "buffered faster", (0.08,) * 5, (0.05,) * 5)).tried
