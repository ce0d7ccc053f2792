"""The benchmark harness: its verdicts, its plans and floors, and one scenario end to end.

The verdict tests use synthetic numbers: a target gets "pass" or "fail" only when the
spreads separate, and no verdict when they overlap or when too few rounds were judged.
The smoke test runs ``benchmarks/run.py save-load`` at 2 MiB, 3 rounds (the driver in this
process, the rank in a process of its own: ~10 s on a 2-core machine, more when it is busy)
and reads its JSON report.
"""

from __future__ import annotations

import functools
import json
import mmap
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks import floors, states  # noqa: E402
from benchmarks.harness import compare, plan, verdict  # noqa: E402
from benchmarks.harness.model import Phase, Ref, Scenario, StateSpec, ratio, throughput  # noqa: E402
from tests.pagecache import drops_pages, resident_fraction  # noqa: E402

CAND, FLOOR = Ref(phase="save", candidate="shardfmt.save"), Ref(phase="save", candidate="floor.write")


def spreads(cand: list[float], floor: list[float]) -> dict:
    return {CAND: verdict.summarize(cand), FLOOR: verdict.summarize(floor)}


# ----------------------------------------------------------------------------- verdicts


def test_summarize_gives_median_quartiles_and_range():
    s = verdict.summarize([5.0, 1.0, 4.0, 2.0, 3.0])
    assert (s.n, s.median, s.min, s.max, s.q1, s.q3) == (5, 3.0, 1.0, 5.0, 2.0, 4.0)
    assert s.interval("iqr") == (2.0, 4.0) and s.interval("range") == (1.0, 5.0)
    with pytest.raises(ValueError):
        verdict.summarize([])


def test_throughput_target_passes_only_when_the_spreads_separate():
    t = throughput("save", "shardfmt.save", 0.9, "floor.write")
    # candidate 1.0-1.1 s, floor 1.0-1.1 s: floor/candidate lies in 0.91..1.1, all >= 0.9
    v = verdict.judge(t, spreads([1.0, 1.02, 1.05, 1.08, 1.1], [1.0, 1.02, 1.05, 1.08, 1.1]))
    assert v.verdict == "pass" and v.value == pytest.approx(1.0)
    assert v.lo == pytest.approx(1.02 / 1.08) and v.hi == pytest.approx(1.08 / 1.02)


def test_throughput_target_fails_only_when_the_spreads_separate():
    t = throughput("save", "shardfmt.save", 0.9, "floor.write")
    v = verdict.judge(t, spreads([2.0, 2.1, 2.2, 2.3, 2.4], [1.0, 1.02, 1.05, 1.08, 1.1]))
    assert v.verdict == "fail" and v.hi < 0.9


def test_overlapping_spreads_give_no_verdict_even_when_the_medians_pass():
    t = throughput("save", "shardfmt.save", 0.9, "floor.write")
    v = verdict.judge(t, spreads([0.8, 0.9, 1.0, 1.3, 1.6], [0.9, 1.0, 1.0, 1.1, 1.2]))
    assert v.value == pytest.approx(1.0)  # the medians alone would say pass
    assert v.verdict == verdict.OVERLAP and v.lo < 0.9 <= v.hi


def test_one_outlier_round_moves_the_range_but_not_the_iqr():
    t = throughput("save", "shardfmt.save", 0.9, "floor.write")
    sp = spreads([1.0, 1.0, 1.0, 1.0, 3.0], [1.0, 1.0, 1.0, 1.0, 1.0])
    assert verdict.judge(t, sp, spread="iqr").verdict == "pass"
    assert verdict.judge(t, sp, spread="range").verdict == verdict.OVERLAP


def test_at_most_targets_sums_and_constants():
    mem, sync, total = (Ref(phase="save", candidate=c) for c in ("memcpy", "shardfmt.save", "async"))
    t = ratio("total <= sync + memcpy", total, "<=", 1.0, (sync, mem))
    sp = {mem: verdict.summarize([0.2] * 5), sync: verdict.summarize([1.0] * 5),
          total: verdict.summarize([1.1, 1.1, 1.15, 1.15, 1.18])}
    assert verdict.judge(t, sp).verdict == "pass"
    sp[total] = verdict.summarize([1.3, 1.4, 1.5, 1.6, 1.7])
    assert verdict.judge(t, sp).verdict == "fail"
    rss = Ref(phase="save", candidate="x", metric="rss_growth")
    cap = ratio("rss <= 100 MiB", rss, "<=", 1.0, 100 << 20)
    assert verdict.judge(cap, {rss: verdict.summarize([90 << 20] * 3)}).verdict == "pass"


def test_no_verdict_from_too_few_rounds_or_a_missing_measurement():
    t = throughput("save", "shardfmt.save", 0.9, "floor.write")
    assert verdict.judge(t, spreads([1.0, 1.0], [5.0, 5.0])).verdict == verdict.FEW
    v = verdict.judge(t, {CAND: verdict.summarize([1.0] * 5)})
    assert v.verdict == "n/a" and "floor.write" in v.note


def test_paired_ratios_are_computed_within_each_round():
    t = throughput("save", "shardfmt.save", 0.9, "floor.write")
    per = {CAND: {1: 2.0, 2: 1.0, 3: 4.0}, FLOOR: {1: 1.0, 2: 1.0, 4: 9.0}}
    v = verdict.judge(t, spreads([2.0, 1.0, 4.0], [1.0, 1.0, 9.0]), per)
    assert v.paired == (0.5, 1.0)


def _report(floor: list[float], cand: list[float]) -> dict:
    def row(name, secs):
        return {"phase": "save", "candidate": name, "primary": "seconds",
                "metrics": {"seconds": {"rounds": {str(k + 1): v for k, v in enumerate(secs)}}}}
    return {"rows": [row("floor.write", floor), row("shardfmt.save", cand)]}


def test_compare_judges_two_runs_on_their_ratios_to_the_same_rounds_floor():
    before = _report([1.0, 2.0, 1.5, 1.2, 3.0], [1.0, 2.0, 1.5, 1.2, 3.0])  # 1.0x the floor, slow disk
    faster_disk = _report([0.5] * 5, [0.5, 0.55, 0.5, 0.52, 0.5])            # seconds halve: still ~1.0x
    assert compare.compare(before, faster_disk)[0]["outcome"] == "same within the spread"
    worse = _report([0.5] * 5, [1.1, 1.1, 1.2, 1.15, 1.2])
    assert [r["outcome"] for r in compare.compare(before, worse)] == ["worse"]
    assert compare.compare(worse, before)[0]["outcome"] == "better"


# ----------------------------------------------------------------------------- plans


def test_schedule_moves_every_candidate_through_positions_and_predecessors():
    steps = plan.schedule(["a", "b", "c"], rounds=3, warmup=1)
    assert [r for r, _ in steps] == [0] * 3 + [1] * 3 + [2] * 3 + [3] * 3
    firsts = [steps[k][1] for k in range(3, 12, 3)]
    assert sorted(firsts) == ["a", "b", "c"]
    assert plan.orders(["x", "y"], 3) == [["x", "y"], ["y", "x"], ["x", "y"]]
    for n, rounds, least in ((4, 5, 2), (5, 5, 3), (7, 6, 4)):
        names = [f"c{k}" for k in range(n)]
        orders = plan.orders(names, rounds)
        assert all(sorted(o) == sorted(names) for o in orders)  # each candidate once a round
        for name in names:
            before = {o[o.index(name) - 1] for o in orders if o.index(name) > 0}
            assert len(before) >= least, (name, orders)  # not always after the same candidate
            assert len({o.index(name) for o in orders}) >= min(3, n - 1)


def test_jobs_share_a_process_per_world_and_check_what_loads_read():
    sc = Scenario(name="t", doc="", state=StateSpec(builder="transformer", size_mib=8), ranks=2, phases=(
        Phase(name="save", kind="save", candidates=("floor.write", "shardfmt.save")),
        Phase(name="load", kind="load", candidates=("floor.read", "shardfmt.load")),
        Phase(name="2->4", kind="load", world=4, candidates=("shardfmt.load",)),
    ))
    jobs = plan.plan_jobs(sc, plan.Options(size_mib=8, rounds=2, warmup=0))
    assert [(j.world, [p.name for p in j.phases]) for j in jobs] == [(2, ["save", "load"]), (4, ["2->4"])]
    assert dict(jobs[1].phases[0].src_world) == {"shardfmt.load": 2}
    bad = Scenario(name="t", doc="", state=sc.state, ranks=2, phases=(
        Phase(name="load", kind="load", candidates=("shardfmt.load",)),))
    with pytest.raises(ValueError, match="no earlier phase saves"):
        plan.plan_jobs(bad, plan.Options(size_mib=8))
    torch_only = Scenario(name="t", doc="", state=sc.state, ranks=2, phases=(
        Phase(name="save", kind="save", candidates=("torch.save",)),
        Phase(name="2->4", kind="load", world=4, candidates=("torch.load",))))
    with pytest.raises(ValueError, match="only on the world that saved"):
        plan.plan_jobs(torch_only, plan.Options(size_mib=8))


# ----------------------------------------------------------------------------- states and floors


def test_any_slice_of_the_formula_is_the_slice_of_the_whole():
    spec = states.TensorSpec(fqn="w", shape=(8, 6), dtype="bfloat16")
    whole = states.gen(3, states.box(spec, "full", 1, 0), "bfloat16", "cpu")
    for layout, world, rank in (("rows", 4, 2), ("cols", 2, 1), ("cols", 1, 0)):
        b = states.box(spec, layout, world, rank)
        sl = tuple(slice(o, o + n) for o, n in zip(b.offsets, b.lengths))
        assert torch.equal(states.gen(3, b, "bfloat16", "cpu"), whole[sl])


def _reads_direct(directory) -> bool:
    """Whether files in ``directory`` can be read with ``O_DIRECT`` (not tmpfs before Linux 6.6, say)."""
    path = os.path.join(str(directory), ".direct-probe")
    with open(path, "wb") as f:
        f.write(b"\1" * 8192)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except (OSError, AttributeError):
        return False
    try:
        buf = mmap.mmap(-1, 4096)
        return os.preadv(fd, [buf], 0) == 4096
    except OSError:
        return False
    finally:
        os.close(fd)
        os.remove(path)


@pytest.mark.parametrize("read", [floors.read_floor, functools.partial(floors.read_floor, hinted=True),
                                  floors.read_floor_direct], ids=["buffered", "hinted", "direct"])
@pytest.mark.parametrize("layout,world", [("rows", 2), ("rows", 4), ("full", 1)])
def test_floor_reads_of_a_two_rank_floor_save_are_exact(tmp_path, layout, world, read):
    if read is floors.read_floor_direct and not _reads_direct(tmp_path):
        pytest.skip("this filesystem has no O_DIRECT")
    specs = states.transformer(1, replicated=True)
    for q in range(2):
        built = states.build(specs, "rows", 2, q, device="cpu", values=True)
        floors.write_floor(str(tmp_path / f"rank_{q}.bin"), built.locals, hashed=True, fsync=False)
    for rank in range(world):
        targets = states.build(specs, layout, world, rank, device="cpu", values=False)
        reads, exact = floors.floor_reads(specs, targets.boxes, str(tmp_path), src_world=2, rank=rank)
        assert exact
        read(reads, targets.locals, hashed=True)
        states.check(targets, f"{layout} on {world}, rank {rank}")


def test_the_direct_read_floor_reads_around_the_page_cache_in_aligned_blocks(tmp_path, monkeypatch):
    """Unaligned ranges (a 2 -> 4 reshard's halves, widened to chunks), each read in several
    blocks, come back exact, and the files' pages stay out of the page cache."""
    if not drops_pages(str(tmp_path)) or not _reads_direct(tmp_path):
        pytest.skip("this filesystem's pages cannot be dropped (tmpfs) or it has no O_DIRECT")
    monkeypatch.setattr(floors, "DIRECT_BLOCK", floors.DIRECT_ALIGN)  # several blocks a read, both buffers in turn
    specs = states.transformer(1, replicated=True)
    paths = []
    for q in range(2):
        built = states.build(specs, "rows", 2, q, device="cpu", values=True)
        paths.append(str(tmp_path / f"rank_{q}.bin"))
        floors.write_floor(paths[-1], built.locals, hashed=True, fsync=True)
        with open(paths[-1], "rb") as f:
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    assert resident_fraction(paths) == 0
    for rank in range(4):
        targets = states.build(specs, "rows", 4, rank, device="cpu", values=False)
        reads, _ = floors.floor_reads(specs, targets.boxes, str(tmp_path), src_world=2, rank=rank)
        assert any(r.src_offset % floors.DIRECT_ALIGN for r in reads)
        assert max(r.length for r in reads) > 2 * floors.DIRECT_BLOCK
        floors.read_floor_direct(reads, targets.locals, hashed=True)
        states.check(targets, f"rows on 4, rank {rank}")
    assert resident_fraction(paths) == 0


def test_floor_reads_are_widened_to_whole_hash_chunks_as_a_verified_reader_reads(tmp_path):
    specs = states.transformer(1, replicated=True)
    pieces = [states.build(specs, "rows", 2, q, device="cpu", values=True) for q in range(2)]
    for q, built in enumerate(pieces):
        floors.write_floor(str(tmp_path / f"rank_{q}.bin"), built.locals, hashed=True, fsync=False)
    widened = 0
    for rank in range(4):
        targets = states.build(specs, "rows", 4, rank, device="cpu", values=False)
        reads, exact = floors.floor_reads(specs, targets.boxes, str(tmp_path), src_world=2, rank=rank)
        assert exact
        for r in reads:
            q = int(r.file.rsplit("_", 1)[1].split(".")[0])
            sizes = [t.numel() * t.element_size() for t in pieces[q].locals]
            base = sum(sizes[:r.index])  # the piece's start in its floor file: chunks are cut from there
            lo, hi = r.src_offset - r.before - base, r.src_offset + r.length + r.after - base
            assert lo % floors.CHUNK == 0 and (hi % floors.CHUNK == 0 or hi == sizes[r.index])
            assert r.before < floors.CHUNK and r.after < floors.CHUNK and 0 <= lo and hi <= sizes[r.index]
            widened += r.before + r.after
        floors.read_floor(reads, targets.locals, hashed=True)
        states.check(targets, f"rows on 4, rank {rank}")  # the widening never lands in a target
    assert widened > 0


def test_floors_through_host_buffers_as_on_a_gpu(tmp_path):
    """The --device cuda path of the floors (bounce through host buffers), run with CPU tensors."""
    specs = states.transformer(1)
    built = states.build(specs, "rows", 1, 0, device="cpu", values=True)
    host = [torch.empty_like(t) for t in built.locals]
    floors.write_floor(str(tmp_path / "rank_0.bin"), built.locals, hashed=True, fsync=True, host=host)
    targets = states.build(specs, "rows", 1, 0, device="cpu", values=False)
    reads, exact = floors.floor_reads(specs, targets.boxes, str(tmp_path), src_world=1, rank=0)
    floors.read_floor(reads, targets.locals, hashed=True, host=[torch.empty_like(t) for t in targets.locals])
    assert exact
    states.check(targets, "through host buffers")


# ----------------------------------------------------------------------------- end to end


@pytest.mark.slow
def test_one_scenario_end_to_end_writes_medians_spreads_and_verdicts(tmp_path, capsys):
    from benchmarks import run as bench

    out = tmp_path / "report.json"
    rc = bench.main(["save-load", "--size-mib", "2", "--rounds", "3", "--warmup", "0", "--settle", "0",
                     "--json", str(out), "--dir", str(tmp_path)])
    text = capsys.readouterr().out
    assert rc in (0, 1), text[-3000:]
    rep = json.loads(out.read_text())
    rows = {(r["phase"], r["candidate"]): r for r in rep["rows"]}
    assert ("load", "shardfmt.load") in rows and ("save", "floor.write") in rows
    s = rows[("save", "shardfmt.save")]["metrics"]["seconds"]
    assert set(s["spread"]) == {"n", "median", "min", "max", "q1", "q3"} and s["spread"]["n"] == 3
    assert s["spread"]["min"] <= s["spread"]["q1"] <= s["spread"]["median"] <= s["spread"]["q3"] <= s["spread"]["max"]
    assert sorted(s["rounds"]) == ["1", "2", "3"]
    assert len(rep["targets"]) == 4
    assert all(t["verdict"] in ("pass", "fail", verdict.OVERLAP) for t in rep["targets"])
    assert all(t["lo"] <= t["value"] <= t["hi"] for t in rep["targets"])
    assert "targets (verdict only when" in text and rep["meta"]["rounds"] == 3
    assert [n for n in os.listdir(tmp_path) if n.startswith("shardfmt-bench-")] == []  # the scratch is removed


@pytest.mark.slow
def test_the_incremental_benchmark_runs_and_its_checkpoints_load_bit_exact(tmp_path):
    """``benchmarks/incremental.py`` at 16 MiB, 2 rounds: every load it times is checked against
    the state (bit-exact), and the bytes targets hold at any size (the time target is a figure)."""
    from benchmarks import incremental

    out = tmp_path / "inc.json"
    incremental.main(["--size-mib", "16", "--rounds", "2", "--warmup", "0", "--dir", str(tmp_path),
                      "--json", str(out)])
    report = json.loads(out.read_text())
    assert report["paired"]["incremental/full bytes"]["max"] <= 0.10
    assert report["targets"]["restore reads no more than a full checkpoint's (beyond block padding of its extra reads)"]


@pytest.mark.slow
def test_the_restore_check_benchmark_runs_and_each_restore_it_times_is_bit_exact(tmp_path):
    """``benchmarks/restore_check.py`` at 32 MiB, 2 rounds: every restore it times, checked or
    not, gives the saved model back bit for bit (it asserts so), and it reports both caches."""
    from benchmarks import restore_check

    out = tmp_path / "check.json"
    restore_check.main(["--size-mib", "32", "--rounds", "2", "--warmup", "0", "--dir", str(tmp_path),
                        "--json", str(out)])
    report = json.loads(out.read_text())
    assert set(report["paired"]) == {"cold checked/unchecked", "warm checked/unchecked", "cold checked/floor.read",
                                     "warm checked/floor.read"}
    assert len(report["records"]) == 2 and report["state_bytes"] == 2 * (2048 * 2048 + 2048) * 4
    assert os.listdir(tmp_path) == ["check.json"]  # the scratch is removed


@pytest.mark.slow
def test_the_restore_timeline_benchmark_times_both_restores_phase_by_phase(tmp_path):
    """``benchmarks/restore_timeline.py`` at 32 MiB, 1 round: both restores are bit-exact (it
    asserts so) and each reports every phase, the read the largest part of its total."""
    from benchmarks import restore_timeline

    out = tmp_path / "timeline.json"
    restore_timeline.main(["--size-mib", "32", "--rounds", "1", "--warmup", "0", "--dir", str(tmp_path),
                           "--json", str(out)])
    med = json.loads(out.read_text())["medians"]
    for name in ("shardfmt", "dcp"):
        assert set(med[name]) == {"discover", "open", "plan", "read", "verify", "apply", "total"}
        assert 0 < med[name]["read"] <= med[name]["total"]
    assert os.listdir(tmp_path) == ["timeline.json"]


def test_a_run_reports_the_io_modes_its_default_measured(tmp_path, monkeypatch):
    from benchmarks.harness import driver
    from shardfmt.io import modes

    choice = modes.Choice(modes.DIRECT, "direct faster (spreads separate)", (0.1, 0.1), (0.2, 0.2))
    found = modes.DeviceModes(modes.Device("h", "8:1", "ext4", "/", 2), {"write": choice, "read": choice}, 1.0)
    monkeypatch.delenv(driver.IO_MODES_ENV, raising=False)
    (tmp_path / "io-modes.json").write_text(modes.encode({found.device.key: found}))
    got = driver._io_modes(str(tmp_path))
    assert got == [{"processes": 2, "fstype": "ext4",
                    "read": {"mode": "direct", "why": choice.why, "direct_s": [0.1, 0.1], "buffered_s": [0.2, 0.2]},
                    "write": {"mode": "direct", "why": choice.why, "direct_s": [0.1, 0.1], "buffered_s": [0.2, 0.2]}}]
    meta = {"scenario": "s", "state_bytes": 1e9, "tensors": 1, "ranks": 2, "device": "cpu", "device_name": "x",
            "cpus": 2, "fsync": True, "scratch_fs": "ext4", "date": "d", "commit": "c", "torch": "t", "io_modes": got}
    assert "2 process(es): write direct, read direct" in driver._headline(meta)
    assert driver._io_modes(str(tmp_path / "none")) == []


def test_every_measured_call_starts_with_nothing_an_earlier_call_left_in_the_page_cache(tmp_path, monkeypatch):
    """A floor keeps what it read and wrote in the page cache; shardfmt drops it. Whatever a
    call leaves is dropped (untimed) before the next, whichever candidate that is."""
    import dataclasses

    from benchmarks import candidates, probes
    from benchmarks.harness import worker
    from benchmarks.harness.calls import Env

    if not drops_pages(str(tmp_path)):
        pytest.skip("this filesystem keeps clean pages in the page cache when told to drop them (tmpfs)")
    sc = Scenario(name="save-load", doc="", state=StateSpec(builder="transformer", size_mib=4), ranks=1, phases=(
        Phase(name="save", kind="save", candidates=("floor.write", "shardfmt.save")),
        Phase(name="load", kind="load", candidates=("floor.read", "shardfmt.load"))))
    base = tmp_path / "ckpt"
    base.mkdir()
    phases = plan.plan_jobs(sc, plan.Options(size_mib=4, rounds=2, warmup=0))[0].phases
    job = {"scenario": "save-load", "size_mib": 4, "device": "cpu", "fsync": True, "settle": 0, "base": str(base),
           "world": 1, "phases": [p.to_json() for p in phases]}
    seen = []
    real_get = candidates.get

    def watched(name):
        c = real_get(name)

        def run(call):
            seen.append((c.name, resident_fraction(probes.files_under(str(base)))))
            return c.run(call)
        return dataclasses.replace(c, run=run)

    monkeypatch.setattr(candidates, "get", watched)
    monkeypatch.setenv("SHARDFMT_IO_MODES", "off")
    runner = worker.Runner(Env(rank=0, world=1, device=torch.device("cpu"), fsync=True), job)
    runner.run()
    assert not runner.failed and len(seen) >= 8
    assert all(frac == 0 for _, frac in seen), seen


def test_dropping_a_directory_a_peer_is_clearing_skips_the_files_already_gone(tmp_path, monkeypatch):
    """Rank 0 clears a save's directory for the next candidate while another rank still drops
    it from the page cache (a 2-rank io-mode run died so, session 25): the drop goes on."""
    from benchmarks import probes

    kept = tmp_path / "kept"
    kept.write_bytes(b"\1" * (64 * mmap.PAGESIZE))
    gone = str(tmp_path / "manifest.json")  # listed, then removed before it is opened
    monkeypatch.setattr(probes, "files_under", lambda path: [gone, str(kept)])
    probes.drop_cache(str(tmp_path))
    if drops_pages(str(tmp_path)):
        assert resident_fraction([str(kept)]) == 0.0  # the files after the missing one were dropped
