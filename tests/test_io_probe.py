"""Direct or buffered, per device and operation, from what the device measured (issue 22):
the choice rule (spreads, hysteresis, the default), the cache document as untrusted input,
the probe on a real directory (nothing left behind, one measurement per device for the
processes of a node, never a hang), and saves and loads following the choice."""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import json
import multiprocessing
import os
import re
import threading
import time

import pytest
import torch

import shardfmt
from shardfmt.cli import main as shardfmt_main
from shardfmt.io import aligned, choice, local, modes, probe

FAST = [0.10, 0.10, 0.11, 0.11, 0.12]
SLOW = [0.20, 0.21, 0.21, 0.22, 0.23]
NEAR = [0.115, 0.12, 0.12, 0.125, 0.13]  # separates from FAST, by less than the margin beyond it


@pytest.fixture
def measured(tmp_path, monkeypatch):
    """Measure for real, small, with a cache document of this test's own."""
    monkeypatch.delenv(choice.FORCE_ENV, raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    cache = tmp_path / "cache" / "io-modes.json"
    monkeypatch.setenv(choice.CACHE_ENV, str(cache))
    monkeypatch.setattr(choice, "lock_path", lambda: str(tmp_path / "probe.lock"))
    monkeypatch.setattr(probe, "PROBE_BYTES", 2 << 20)
    monkeypatch.setattr(probe, "MIN_PART", 1 << 20)
    monkeypatch.setattr(probe, "ROUNDS", 3)
    choice.forget()
    yield cache
    choice.forget()


def _device_of(path, processes: int = 1) -> modes.Device:
    return choice.describe(str(path), os.stat(path).st_dev, processes)


def _kept(device: modes.Device, write: str, read: str, *, age: float = 0.0) -> modes.DeviceModes:
    return modes.DeviceModes(device, {"write": modes.Choice(write, "given", tuple(FAST), tuple(SLOW)),
                                      "read": modes.Choice(read, "given", tuple(FAST), tuple(SLOW))},
                             time.time() - age)


# -- the rule ---------------------------------------------------------------------------------

def test_the_faster_way_is_chosen_only_when_the_spreads_separate():
    assert modes.choose(FAST, SLOW).mode == modes.DIRECT
    assert modes.choose(SLOW, FAST).mode == modes.BUFFERED
    overlap = modes.choose(FAST, [0.09, 0.105, 0.11, 0.12, 0.3])
    assert overlap.mode == modes.DEFAULT == modes.DIRECT and "overlap" in overlap.why
    assert modes.choose(FAST, [0.09, 0.105, 0.11, 0.12, 0.3], modes.BUFFERED).mode == modes.BUFFERED


def test_leaving_the_mode_in_force_takes_more_than_separating():
    # buffered separates from direct but by less than the margin: the mode in force stays
    kept = modes.choose(NEAR, FAST, modes.DIRECT)
    assert kept.mode == modes.DIRECT and "less than" in kept.why
    assert modes.choose(NEAR, FAST, None).mode == modes.DIRECT  # the default is in force at first
    assert modes.choose(SLOW, FAST, modes.DIRECT).mode == modes.BUFFERED  # clearly faster: switched
    assert modes.choose(FAST, NEAR, modes.BUFFERED).mode == modes.BUFFERED
    assert modes.choose(FAST, SLOW, modes.BUFFERED).mode == modes.DIRECT


def test_a_choice_is_clear_only_where_its_mode_won_with_the_spreads_apart():
    assert modes.choose(FAST, SLOW).clear and modes.choose(SLOW, FAST).clear
    assert not modes.choose(FAST, [0.09, 0.105, 0.11, 0.12, 0.3]).clear  # overlap: kept
    assert not modes.choose(NEAR, FAST, modes.DIRECT).clear  # buffered ahead, by too little to switch
    assert not modes.choose([], FAST).clear  # refused: one way never timed
    assert not modes.Choice(modes.DIRECT, "unmeasured").clear


def test_one_stalled_round_does_not_decide():
    assert modes.choose([0.1, 0.1, 0.1, 0.1, 5.0], [0.2, 0.2, 0.2, 0.2, 0.2]).mode == modes.DIRECT


def test_a_device_refusing_direct_io_is_buffered():
    c = modes.choose([], SLOW, modes.DIRECT)
    assert c.mode == modes.BUFFERED and "O_DIRECT" in c.why


class _Rounds:
    """A probe whose rounds give ``sets`` in turn (read and write alike), counting its runs."""

    def __init__(self, *sets):
        self.sets, self.runs = list(sets), 0

    def __call__(self, directory, processes):
        return self

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None

    def run(self):
        direct_s, buffered_s = self.sets[self.runs]
        self.runs += 1
        return {op: (list(direct_s), list(buffered_s)) for op in modes.OPERATIONS}


@pytest.mark.parametrize("sets,runs,mode", [
    ([(SLOW, FAST), (FAST, SLOW)], 2, modes.DIRECT),  # one slow moment of direct I/O: the sets disagree, kept
    ([(SLOW, FAST), (SLOW, FAST)], 2, modes.BUFFERED),  # buffered ahead in both: switched
    ([(FAST, SLOW)], 1, modes.DIRECT),  # the mode in force wins: nothing more to ask
    ([(FAST, [0.09, 0.105, 0.11, 0.12, 0.3])], 1, modes.DIRECT),  # overlap: kept without more rounds
    ([([], FAST)], 1, modes.BUFFERED),  # no direct I/O here: nothing to confirm
])
def test_a_probe_leaves_the_mode_in_force_only_on_a_second_set_of_rounds(monkeypatch, tmp_path, sets, runs, mode):
    rounds = _Rounds(*sets)
    monkeypatch.setattr(probe, "_Probe", rounds)
    found = probe.measure(str(tmp_path), _device_of(tmp_path))
    assert rounds.runs == runs
    assert {c.mode for c in found.choices.values()} == {mode}
    assert all(len(c.buffered_s) == runs * len(FAST) for c in found.choices.values())


def test_a_second_set_is_judged_against_the_mode_chosen_before(monkeypatch, tmp_path):
    previous = _kept(_device_of(tmp_path), modes.BUFFERED, modes.BUFFERED)
    rounds = _Rounds((SLOW, FAST), (FAST, SLOW))
    monkeypatch.setattr(probe, "_Probe", rounds)
    assert probe.measure(str(tmp_path), previous.device, previous=previous).mode("read") == modes.BUFFERED
    assert rounds.runs == 1  # buffered in force and ahead: not asked again
    rounds = _Rounds((FAST, SLOW), (SLOW, FAST))
    monkeypatch.setattr(probe, "_Probe", rounds)
    found = probe.measure(str(tmp_path), previous.device, previous=previous)
    assert rounds.runs == 2 and found.mode("read") == modes.BUFFERED  # direct ahead once only: kept


# -- the cache document: read as untrusted input ------------------------------------------------

def test_the_cache_document_round_trips_and_keeps_the_most_recent_devices():
    devs = {}
    for k in range(modes.MAX_DEVICES + 5):
        m = _kept(modes.Device("h", f"8:{k}", "ext4", f"/m{k}"), modes.DIRECT, modes.BUFFERED, age=1000 - k)
        devs[m.device.key] = m
    back = modes.decode(modes.encode(devs))
    assert len(back) == modes.MAX_DEVICES
    assert "h|8:0|ext4|/m0|1" not in back  # the oldest went
    assert back["h|8:68|ext4|/m68|1"].mode("read") == modes.BUFFERED
    assert back["h|8:68|ext4|/m68|1"].choices["write"].direct_s == tuple(FAST)
    assert modes.encode(back) == modes.encode(modes.decode(modes.encode(back)))  # deterministic


@pytest.mark.parametrize("text", [
    "", "not json", "[]", "null", '{"kind": "other", "version": 1, "devices": []}',
    '{"kind": "shardfmt-io-modes", "version": 99, "devices": []}',
    '{"kind": "shardfmt-io-modes", "version": 1, "devices": {"a": 1}}',
    "[" * 100000,
])
def test_a_cache_document_that_is_not_one_is_ignored(text):
    assert modes.decode(text) == {}


@pytest.mark.parametrize("change", [
    {"mode": "fast"}, {"mode": None}, {"direct_s": [float("nan")]}, {"direct_s": [-1.0]},
    {"direct_s": [True]}, {"buffered_s": "0.1"}, {"buffered_s": [0.1] * 65}, {"why": 3},
])
def test_an_entry_that_does_not_hold_is_left_out(change):
    good = _kept(modes.Device("h", "8:1", "ext4", "/"), modes.DIRECT, modes.DIRECT)
    doc = json.loads(modes.encode({good.device.key: good}))
    other = json.loads(json.dumps(doc["devices"][0]))
    other["device"] = "8:2"
    other["choices"]["read"].update(change)
    doc["devices"].append(other)
    back = modes.decode(json.dumps(doc, allow_nan=True))
    assert list(back) == [good.device.key]


def test_a_version_that_is_not_a_number_is_not_one():
    good = _kept(modes.Device("h", "8:1", "ext4", "/"), modes.DIRECT, modes.DIRECT)
    doc = json.loads(modes.encode({good.device.key: good}))
    doc["version"] = True
    assert modes.decode(json.dumps(doc)) == {} and len(modes.decode(modes.encode({good.device.key: good}))) == 1


@pytest.mark.parametrize("field, value", [("probed_at", "yesterday"), ("probed_at", -5), ("probes", 0),
                                          ("probes", True), ("host", 7), ("choices", []), ("processes", 0),
                                          ("processes", 10 ** 9), ("processes", "8")])
def test_an_entry_with_a_bad_field_is_left_out(field, value):
    good = _kept(modes.Device("h", "8:1", "ext4", "/"), modes.DIRECT, modes.DIRECT)
    doc = json.loads(modes.encode({good.device.key: good}))
    doc["devices"][0][field] = value
    assert modes.decode(json.dumps(doc)) == {}


# -- the probe on a real directory ----------------------------------------------------------------

def _probe_files_work_in(directory) -> bool:
    """Whether ``directory`` holds O_TMPFILE files and moves bytes through O_DIRECT (not overlayfs, say)."""
    try:
        fd = os.open(str(directory), os.O_TMPFILE | os.O_RDWR)
    except (OSError, AttributeError):
        return False
    try:
        os.close(os.open(f"/proc/self/fd/{fd}", os.O_RDWR | os.O_DIRECT))
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


@pytest.fixture
def work(tmp_path):
    if not _probe_files_work_in(tmp_path):
        pytest.skip("this filesystem has no O_TMPFILE or no O_DIRECT: the probe measures nothing here")
    d = tmp_path / "ckpt"
    d.mkdir()
    return d


def test_a_probe_measures_both_ways_keeps_the_choice_and_leaves_nothing_behind(work, measured, monkeypatch):
    found = choice.device_modes(str(work))
    assert found.probes == 1
    for op in modes.OPERATIONS:
        c = found.choices[op]
        assert c.mode in modes.MODES and len(c.buffered_s) in (probe.ROUNDS, 2 * probe.ROUNDS)
        assert len(c.direct_s) in (0, len(c.buffered_s))
    assert os.listdir(work) == []  # the probe's files had no name there
    kept = modes.decode(measured.read_text())
    assert kept[found.device.key] == found
    # another process of the node (this one, forgotten) reads it and measures nothing
    choice.forget()
    monkeypatch.setattr(choice, "measure", lambda *a, **k: pytest.fail("measured again"))
    assert choice.device_modes(str(work)) == found


def test_a_stale_choice_is_measured_again_against_the_mode_in_force(work, measured, monkeypatch):
    device = _device_of(work)
    choice._write(str(measured), _kept(device, modes.BUFFERED, modes.BUFFERED, age=modes.REPROBE_AFTER_S + 1))
    seen = []
    monkeypatch.setattr(probe.modes, "choose", lambda d, b, previous: (seen.append(previous),
                                                                       modes.Choice(previous, "kept"))[1])
    found = choice.device_modes(str(work))
    assert len(seen) >= 2 and set(seen) == {modes.BUFFERED} and found.probes == 2  # each operation, each look
    assert modes.decode(measured.read_text())[device.key].probes == 2


def test_a_corrupt_cache_document_is_measured_again_and_replaced(work, measured):
    measured.parent.mkdir(parents=True)
    measured.write_bytes(b"\x00garbage{" * 1000)
    found = choice.device_modes(str(work))
    assert found.probes == 1
    assert modes.decode(measured.read_text())[found.device.key] == found


@pytest.mark.parametrize("field, value", [("probed_at", "1" + "0" * 400), ("probes", "9" * 4300),
                                          ("direct_s", "[1" + "0" * 400 + "]")])
def test_hostile_numbers_in_the_cache_never_fail_a_save(work, measured, field, value):
    device = _device_of(work)
    choice._write(str(measured), _kept(device, modes.BUFFERED, modes.BUFFERED))
    text = measured.read_text()
    if field == "direct_s":
        text = text.replace('"direct_s": [', f'"direct_s": {value[:-1]}, ', 1)
    else:
        text = re.sub(f'"{field}": [0-9.e+]+', f'"{field}": {value}', text, count=1)
    measured.write_text(text)
    assert modes.decode(text) == {}  # the entry is not one
    assert choice.use_direct(str(work), "write") in (True, False)
    assert choice.device_modes(str(work)).probes == 1  # measured anew, and kept
    assert modes.decode(measured.read_text())[device.key].probes == 1


def test_choosing_never_fails_a_save_or_a_load(work, measured, monkeypatch, caplog):
    monkeypatch.setattr(choice, "describe", lambda *a: (_ for _ in ()).throw(RuntimeError("boom")))
    assert choice.use_direct(str(work), "read") is (modes.DEFAULT == modes.DIRECT)
    assert "could not be chosen (RuntimeError: boom)" in caplog.text


def test_measured_gives_a_fresh_measurement_and_nothing_forced_stale_or_failed(work, measured, monkeypatch):
    """What a load asks before trying both ways (``loading.trial``): the device's choice with its
    timings, only where it was measured and is fresh."""
    device = _device_of(work)
    choice._write(str(measured), _kept(device, modes.BUFFERED, modes.DIRECT))
    got = choice.measured(str(work), "read")
    assert got is not None and got.mode == modes.DIRECT and got.clear
    monkeypatch.setenv(choice.FORCE_ENV, "1")
    assert choice.measured(str(work), "read") is None  # forced: nothing to try against
    monkeypatch.delenv(choice.FORCE_ENV)
    stale = _kept(device, modes.BUFFERED, modes.DIRECT, age=modes.REPROBE_AFTER_S + 1)
    monkeypatch.setattr(choice, "device_modes", lambda directory: stale)
    assert choice.measured(str(work), "read") is None  # kept for want of a new measurement: doubt
    monkeypatch.setattr(choice, "device_modes", lambda directory: (_ for _ in ()).throw(RuntimeError("boom")))
    assert choice.measured(str(work), "read") is None


def test_an_oversized_cache_document_is_not_read(work, measured):
    device = _device_of(work)
    choice._write(str(measured), _kept(device, modes.BUFFERED, modes.BUFFERED))
    with open(measured, "a") as f:
        f.write(" " * modes.MAX_DOCUMENT)
    assert choice.device_modes(str(work)).probes == 1  # measured, not the document's buffered


def test_a_fifo_at_the_cache_path_never_hangs(work, measured):
    measured.parent.mkdir(parents=True)
    os.mkfifo(measured)
    t = time.monotonic()
    found = choice.device_modes(str(work))
    assert time.monotonic() - t < 30 and found.probes == 1


def test_the_choice_is_measured_and_kept_for_the_processes_of_a_node_that_move_bytes_at_once(
        work, measured, monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    one = choice.device_modes(str(work))
    choice.forget()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    four = choice.device_modes(str(work))
    assert (one.device.processes, four.device.processes) == (1, 4) and four.probes == 1
    assert set(modes.decode(measured.read_text())) == {one.device.key, four.device.key}
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "many")
    assert choice.local_processes() == 1


@pytest.mark.parametrize("processes", [1, 2, 3, 8])
def test_the_probe_runs_each_process_on_the_threads_its_save_and_load_use(monkeypatch, processes):
    from shardfmt.io.local import LocalStorage
    from shardfmt.loading.options import DEFAULT_WORKERS
    from shardfmt.saving.shard_file import default_write_workers

    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(processes))
    write = default_write_workers()
    assert probe.threads(processes, direct=False, write=True) == write
    assert probe.threads(processes, direct=True, write=True) == max(write, aligned.MIN_THREADS)
    read = min(DEFAULT_WORKERS, LocalStorage.read_concurrency)
    assert probe.threads(processes, direct=False, write=False) == read
    assert probe.threads(processes, direct=True, write=False) == min(
        DEFAULT_WORKERS, max(LocalStorage.read_concurrency, aligned.MIN_THREADS))


@pytest.mark.parametrize("n", [1, 3, 5])
def test_every_thread_of_every_stream_moves_bytes(work, monkeypatch, n):
    monkeypatch.setattr(probe, "PROBE_BYTES", (6 << 20) + 3 * 4096)  # parts that are no multiple of a block
    monkeypatch.setattr(probe, "MIN_PART", 1 << 20)
    by_thread: dict[str, int] = {}
    real = os.pwrite

    def pwrite(fd, v, o):
        got = real(fd, v, o)
        by_thread[threading.current_thread().name] = by_thread.get(threading.current_thread().name, 0) + got
        return got

    monkeypatch.setattr(probe.os, "pwrite", pwrite)
    with probe._Probe(str(work), 3) as p:
        fds = [p._file() for _ in range(3)]
        assert p._run(fds, n, "write", lambda h, v, o: os.pwrite(h, v, o), False) == []
        sizes = [os.fstat(fd).st_size for fd in fds]
    assert sizes == [p._part] * 3 and p._part % 4096 == 0  # every stream's whole part, the tail block too
    assert len(by_thread) == 3 * n and sum(by_thread.values()) == 3 * p._part  # every thread moved bytes


def test_a_cache_that_cannot_be_written_keeps_the_choice_in_the_process(work, tmp_path, monkeypatch, measured):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    monkeypatch.setenv(choice.CACHE_ENV, str(blocker / "io-modes.json"))  # under a file: no directory
    found = choice.device_modes(str(work))
    assert found.probes == 1 and choice.device_modes(str(work)) is found


def test_a_directory_that_cannot_hold_a_probe_file_gets_the_default_for_a_while(work, measured, monkeypatch):
    monkeypatch.setattr(probe, "PROBE_BYTES", 1 << 50)  # more than any disk has free
    found = choice.device_modes(str(work))
    assert found.probes == 0 and found.mode("read") == found.mode("write") == modes.DEFAULT
    assert "not measured" in found.choices["read"].why
    assert not measured.exists()  # an unmeasured default is never kept for other processes
    assert choice.device_modes(str(work)) is found  # not asked again at every file ...
    for key, (m, _) in list(choice._known.items()):
        choice._known[key] = (m, 0.0)  # ... but once UNMEASURED_TTL_S has passed
    monkeypatch.setattr(probe, "PROBE_BYTES", 2 << 20)
    assert choice.device_modes(str(work)).probes == 1
    assert choice.use_direct(str(work / "missing"), "read") is (modes.DEFAULT == modes.DIRECT)


def test_a_failed_probe_closes_every_file_it_opened(work, measured, monkeypatch):
    before = set(os.listdir("/proc/self/fd"))
    calls = []
    real = os.fsync

    def fsync(fd):
        calls.append(fd)
        if len(calls) == 2:
            raise OSError(errno.EDQUOT, "Disk quota exceeded")
        return real(fd)

    monkeypatch.setattr(probe.os, "fsync", fsync)
    found = choice.device_modes(str(work))
    assert found.probes == 0 and "quota" in found.choices["read"].why
    assert set(os.listdir("/proc/self/fd")) <= before and not probe._open


def test_running_out_of_descriptors_is_not_a_filesystem_refusing_direct_io(work, measured, monkeypatch):
    def busy(fd, flags):
        raise OSError(errno.EMFILE, "Too many open files")

    monkeypatch.setattr(probe, "reopen_direct", busy)
    found = choice.device_modes(str(work))
    assert found.probes == 0 and "O_DIRECT" not in found.choices["write"].why  # unmeasured, not buffered
    assert not measured.exists()


def test_a_failed_measurement_keeps_the_choice_in_force(work, measured, monkeypatch):
    device = _device_of(work)
    choice._write(str(measured), _kept(device, modes.BUFFERED, modes.BUFFERED, age=modes.REPROBE_AFTER_S + 1))
    monkeypatch.setattr(probe, "PROBE_BYTES", 1 << 50)  # the new measurement fails (no room)
    found = choice.device_modes(str(work))
    assert found.mode("read") == found.mode("write") == modes.BUFFERED  # the stale measured choice, not the default
    assert choice.device_modes(str(work)) is found  # and it is not measured again at every file


def test_a_lock_not_obtained_is_not_waited_for_at_every_file(work, tmp_path, measured, monkeypatch):
    device = _device_of(work)
    choice._write(str(measured), _kept(device, modes.BUFFERED, modes.DIRECT, age=modes.REPROBE_AFTER_S + 1))
    other = os.open(str(tmp_path / "probe.lock"), os.O_RDWR | os.O_CREAT)
    fcntl.flock(other, fcntl.LOCK_EX)
    monkeypatch.setattr(choice, "LOCK_WAIT_S", 0.3)
    waits = []
    real = choice._take
    monkeypatch.setattr(choice, "_take", lambda fd: (waits.append(fd), real(fd))[1])
    try:
        first = choice.device_modes(str(work))
        assert first.mode("write") == modes.BUFFERED  # the stale cached choice, used while the lock is held
        for _ in range(5):
            assert choice.device_modes(str(work)) is first
        assert len(waits) == 1
    finally:
        os.close(other)


def test_a_network_filesystem_is_not_measured(work, measured, monkeypatch):
    real = choice.describe
    monkeypatch.setattr(choice, "describe", lambda *a: dataclasses.replace(real(*a), fstype="nfs4"))
    found = choice.device_modes(str(work))
    assert found.probes == 0 and "network filesystem" in found.choices["write"].why


def test_with_no_shared_cache_the_processes_of_a_node_do_not_each_measure(work, measured, monkeypatch):
    monkeypatch.setenv(choice.CACHE_ENV, "off")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    found = choice.device_modes(str(work))
    assert found.probes == 0 and "could not share" in found.choices["read"].why
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert choice.device_modes(str(work)).probes == 1  # one process alone measures for itself


def test_a_filesystem_refusing_direct_io_is_buffered(measured, work, monkeypatch):
    def refuse(fd, flags):
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(probe, "reopen_direct", refuse)
    found = choice.device_modes(str(work))
    assert found.mode("read") == found.mode("write") == modes.BUFFERED and found.probes == 1
    assert "O_DIRECT" in found.choices["write"].why and found.choices["read"].direct_s == ()
    assert len(found.choices["read"].buffered_s) == probe.ROUNDS and os.listdir(work) == []


def test_direct_writes_refused_after_the_open_leave_direct_reads_measured(measured, work, monkeypatch):
    real = os.pwrite

    def pwrite(fd, data, offset):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, data, offset)

    monkeypatch.setattr(probe.os, "pwrite", pwrite)
    found = choice.device_modes(str(work))
    assert found.mode("write") == modes.BUFFERED and found.choices["write"].direct_s == ()
    assert len(found.choices["read"].direct_s) == probe.ROUNDS  # reads were not refused


def _probe_in_child(directory: str, cache: str, lock: str, out) -> None:
    os.environ.pop(choice.FORCE_ENV, None)
    os.environ.pop("LOCAL_WORLD_SIZE", None)
    os.environ[choice.CACHE_ENV] = cache
    choice.lock_path = lambda: lock
    probe.PROBE_BYTES, probe.ROUNDS = 8 << 20, 3
    found = choice.device_modes(directory)
    out.put((found.probed_at, found.probes))


@pytest.mark.slow  # three processes importing torch: about 5 s
def test_the_processes_of_a_node_measure_once(work, tmp_path, measured):
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_probe_in_child, args=(str(work), str(measured), str(tmp_path / "probe.lock"), out))
             for _ in range(3)]
    for p in procs:
        p.start()
    got = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    assert len(set(got)) == 1 and got[0][1] == 1  # one measurement, which all three use


def test_a_probe_lock_held_too_long_is_not_waited_for(work, tmp_path, measured, monkeypatch):
    other = os.open(str(tmp_path / "probe.lock"), os.O_RDWR | os.O_CREAT)  # another open file: as another process
    fcntl.flock(other, fcntl.LOCK_EX)
    monkeypatch.setattr(choice, "LOCK_WAIT_S", 0.3)
    try:
        t = time.monotonic()
        found = choice.device_modes(str(work))
        assert time.monotonic() - t < 5
        assert found.probes == 0 and found.mode("read") == modes.DEFAULT and "held" in found.choices["read"].why
    finally:
        os.close(other)


def test_a_forked_child_does_not_keep_the_probe_lock(work, tmp_path, measured, monkeypatch):
    """A fork while a probe holds the lock (a DataLoader worker started while an async save
    measures): the child's copy must not hold the lock once the parent lets it go."""
    lock = str(tmp_path / "probe.lock")
    with choice._locked(lock) as held:
        assert held
        r, w = os.pipe()
        up_r, up_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child (its fork handlers have run): says so, then waits until told to exit
            try:
                os.close(w)
                os.write(up_w, b"u")
                os.read(r, 1)
            finally:
                os._exit(0)
        try:
            os.close(r)
            os.close(up_w)
            assert os.read(up_r, 1) == b"u"
            os.close(up_r)
        except BaseException:
            os.write(w, b"x")
            raise
    try:
        fd = os.open(lock, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # free while the child lives
        finally:
            os.close(fd)
    finally:
        os.write(w, b"x")
        os.close(w)
        os.waitpid(pid, 0)


@pytest.mark.parametrize("value, mode", [("1", modes.DIRECT), ("on", modes.DIRECT), ("0", modes.BUFFERED),
                                         ("false", modes.BUFFERED), ("auto", None), ("", None)])
def test_the_environment_forces_a_mode_without_measuring(monkeypatch, value, mode):
    monkeypatch.setenv(choice.FORCE_ENV, value)
    assert choice.forced() == mode


def test_a_misspelt_forced_mode_is_said_once_and_measured(monkeypatch, caplog):
    monkeypatch.setenv(choice.FORCE_ENV, "dirct")
    monkeypatch.setattr(choice, "_said", set())
    assert choice.forced() is None and choice.forced() is None
    assert caplog.text.count("SHARDFMT_DIRECT_IO='dirct' is not one of 1, 0 or auto") == 1


# -- saves and loads follow the choice -----------------------------------------------------------

@pytest.mark.parametrize("write, read", [(modes.DIRECT, modes.BUFFERED), (modes.BUFFERED, modes.DIRECT)])
def test_saves_and_loads_go_the_way_the_device_chose(tmp_path, measured, monkeypatch, write, read):
    choice._write(str(measured), _kept(_device_of(tmp_path), write, read))
    transfers = []
    real = local.direct_transfer
    monkeypatch.setattr(local, "direct_transfer", lambda call, mv, off, want, path, what, count:
                        (transfers.append(what), real(call, mv, off, want, path, what, count))[1])
    g = torch.Generator().manual_seed(0)
    state = {f"w{i}": torch.randn(1024, 1024, generator=g) for i in range(6)}  # 4 MiB each
    path = str(tmp_path / "ckpt")
    shardfmt.save(state, path, part_size=4 << 20)  # files larger than a part: the direct path's
    assert ("write" in transfers) is (write == modes.DIRECT)
    transfers.clear()
    out = {k: torch.full_like(v, float("nan")) for k, v in state.items()}
    shardfmt.load(out, path)
    assert ("read" in transfers) is (read == modes.DIRECT)
    assert all(torch.equal(out[k], state[k]) for k in state)


def test_the_command_shows_the_choice_and_measures_again_on_request(tmp_path, measured, capsys):
    assert shardfmt_main(["io-modes", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "read:" in text and "write:" in text and str(measured) in text
    assert shardfmt_main(["io-modes", str(tmp_path), "--again", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["probes"] == 2 and set(doc["choices"]) == {"read", "write"}
    assert shardfmt_main(["io-modes", str(tmp_path / "missing")]) == 2
    assert "not a directory" in capsys.readouterr().err


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
def test_the_probe_writes_into_files_allocated_first_as_a_save_does(work, monkeypatch, direct):
    monkeypatch.setattr(probe, "PROBE_BYTES", 2 << 20)
    events: list[tuple[str, int, bool]] = []
    real_fallocate, real_pwrite = probe.fallocate, os.pwrite

    def fallocate(fd, size, *, grow=False):
        events.append(("reserve", size, grow))
        return real_fallocate(fd, size, grow=grow)

    def pwrite(fd, v, o):
        events.append(("write", 0, False))
        return real_pwrite(fd, v, o)

    monkeypatch.setattr(probe, "fallocate", fallocate)
    monkeypatch.setattr(probe.os, "pwrite", pwrite)
    with probe._Probe(str(work), 2) as p:
        p._write(direct)
    reserves = [e for e in events if e[0] == "reserve"]
    assert reserves == [("reserve", p._part, direct)] * 2  # each stream's file, grown where written direct
    assert events.index(("write", 0, False)) > events.index(reserves[-1])  # before any byte
