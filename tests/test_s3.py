"""Checkpoints on S3, against a real S3 server on loopback (moto's server, its own process).

The server counts requests and bytes (tests/s3_server.py), so the byte bounds here are what
crossed the wire, not what the client thinks it asked for.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import time
import uuid
import warnings

import orjson
import pytest
import torch

import shardfmt
import shardfmt.io.store
from shardfmt.cli import main as shardfmt_main
from shardfmt.errors import AccessDeniedError, CheckpointExistsError, CommitError, StorageError
from shardfmt.saving.options import SaveOptions, Seams
from tests import s3_server
from tests.conftest import bytes_equal
from tests.distributed.harness import check_all_ok, launch

FAST_FAIL = {"config_kwargs": {"retries": {"max_attempts": 2, "mode": "standard"}, "connect_timeout": 2}}

pytestmark = pytest.mark.slow  # the moto server's start alone was the fast tier's slowest test


@pytest.fixture(scope="module")
def server():
    with s3_server.serving() as srv:
        yield srv


@pytest.fixture
def bucket(server):
    import s3fs  # here, not at collection (1 s of every run)

    name = "b" + uuid.uuid4().hex[:12]
    s3fs.S3FileSystem(endpoint_url=server.endpoint, skip_instance_cache=True).mkdir(name)
    server.clear_faults()
    return f"s3://{name}"


def _fs(server):
    import s3fs

    return s3fs.S3FileSystem(endpoint_url=server.endpoint, skip_instance_cache=True, use_listings_cache=False)


def _state(seed=0, rows=2048):
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(rows, 1024, generator=g), "b": torch.randn(1024, generator=g).bfloat16()},
            "step": 7, "note": "hello"}


def _empty_like(state):
    return {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}, "step": None, "note": None}


def test_save_and_load_round_trip_with_multipart_parts(server, bucket):
    url = f"{bucket}/run/step_1"
    state = _state()
    server.reset_stats()
    before = shardfmt.io.store.io_stats()
    shardfmt.save(state, url, step=1, storage_options={"part_size": 5 << 20})
    after, st = shardfmt.io.store.io_stats(), server.stats()
    assert st["by_method"].get("POST", 0) >= 2, "an 8 MiB file in 5 MiB parts is a multipart upload"
    # what the client counts is what the server saw (PUTs and multipart POSTs; bodies)
    assert after["write_requests"] - before["write_requests"] == st["by_method"]["PUT"] + st["by_method"]["POST"]
    assert 0 <= st["bytes_in"] - (after["bytes_written"] - before["bytes_written"]) < 4096
    back = _empty_like(state)
    rep = shardfmt.load(back, url)
    assert all(bytes_equal(back["model"][k], state["model"][k]) for k in state["model"])
    assert back["step"] == 7 and back["note"] == "hello"
    assert rep.bytes_read >= rep.bytes_needed
    assert shardfmt.validate(url, deep=True).ok
    fs = _fs(server)
    assert fs.exists(url + "/COMMITTED") and not fs.exists(url + "/LEASE"), "the lease goes at commit"
    assert not fs.call_s3("list_multipart_uploads", Bucket=bucket[5:]).get("Uploads")


def test_upload_memory_stays_within_parts_in_flight(server, bucket):
    """A 256 MiB file streams up in 16 MiB parts, 4 at a time (the defaults): RSS grows less than
    2 x part size x concurrency (the issue's bound), far less than the file."""
    code = textwrap.dedent(f"""
        import os, threading, time, torch, shardfmt
        def rss():
            with open("/proc/self/status") as f:
                return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmRSS"))
        state = {{"w": torch.ones(64 << 20)}}  # 256 MiB
        opts = {{"part_size": 16 << 20, "write_concurrency": 4}}
        shardfmt.save({{"w": torch.ones(24 << 20)}}, "{bucket}/warm", storage_options=opts)  # warm-up: imports, client
        base, peak, stop = rss(), [0], threading.Event()
        def sample():
            while not stop.is_set():
                peak[0] = max(peak[0], rss()); time.sleep(0.005)
        t = threading.Thread(target=sample); t.start()
        shardfmt.save(state, "{bucket}/big", storage_options=opts)
        stop.set(); t.join()
        print("GROWTH", peak[0] - base)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stderr[-2000:]
    growth = int(out.stdout.split("GROWTH")[1])
    assert growth < 2 * (16 << 20) * 4, f"peak RSS grew {growth / 2**20:.1f} MiB for 4 x 16 MiB parts in flight"


@pytest.mark.slow
def test_two_rank_save_to_s3_then_resharded_loads_read_what_they_need(server, bucket, tmp_path):
    url = f"{bucket}/dist/step_5"
    check_all_ok(launch("s3_save2", 2, {"path": url}, out_dir=str(tmp_path / "o"), timeout=240))
    m = shardfmt.read_manifest(url)
    # on an object store the save's id is in every data file's name: two saves of one prefix
    # (one outliving its lease) never write the same object
    assert m.topology.world_size == 2 and sorted(m.files) == [f"data/rank_00000.{m.save_id}.safetensors",
                                                              f"data/rank_00001.{m.save_id}.safetensors"]
    full = torch.arange(4096 * 512, dtype=torch.float32).reshape(4096, 512)
    chunk = m.chunk_size
    for rank in range(4):  # each rank of a 4-rank job loads its quarter of the rows
        rows = slice(1024 * rank, 1024 * (rank + 1))
        target = {"w": shardfmt.ShardedTensor(torch.zeros(1024, 512), (4096, 512), (1024 * rank, 0))}
        server.reset_stats()
        rep = shardfmt.load(target, url, strict=False)
        st = server.stats()
        assert torch.equal(target["w"].local, full[rows])
        needed = 1024 * 512 * 4
        small = sum(len(x) for x in (b"",)) + 64 << 10  # COMMITTED + manifest + one header, generously
        assert st["bytes_out"] <= needed + 2 * chunk + small, (
            f"rank {rank}: {st['bytes_out']} bytes crossed the wire for {needed} needed")
        # COMMITTED, the root manifest, the rank-table part, one rank index, one header, the data
        assert st["requests"] <= 6, f"rank {rank}: {st['requests']} requests ({st['by_method']})"
        assert rep.bytes_needed == needed
    assert shardfmt.validate(url, deep=True).ok


def test_a_chunk_shared_by_an_in_place_and_a_bounced_target_crosses_the_wire_once(server, bucket):
    """A column slice (through a bounce buffer) and a bias loaded in place, in one hash chunk:
    one ranged GET of it, not one per group."""
    url = f"{bucket}/shared/step_1"
    w, b = torch.randn(256, 256), torch.randn(256)
    shardfmt.save({"w": w, "b": b}, url)
    (f,) = shardfmt.read_manifest(url).files.values()
    local, bias = torch.empty(256, 128), torch.empty(256)
    server.reset_stats()
    rep = shardfmt.load({"w": shardfmt.ShardedTensor(local, (256, 256), (0, 128)), "b": bias}, url)
    st = server.stats()
    assert torch.equal(local, w[:, 128:]) and torch.equal(bias, b)
    assert rep.bytes_read <= f.size + f.header_size, f"{rep.bytes_read} bytes read from a {f.size}-byte file"
    assert st["bytes_out"] <= f.size + (64 << 10), st  # the data once, plus COMMITTED, manifest, header


def test_cli_validate_inspect_ls_gc_on_s3_urls(server, bucket, capsys):
    root = f"{bucket}/cli"
    shardfmt.save(_state(rows=64), f"{root}/step_000000001", step=1)
    fs = _fs(server)
    fs.pipe_file(f"{root[5:]}/step_000000002/data/rank_00000.safetensors", b"torn")  # a dead save's orphan
    fs.pipe_file(f"{root[5:]}/step_000000002/LEASE", b"{}")
    fs.pipe_file(f"{root[5:]}/step_000000003/notes.txt", b"mine")  # not what a save writes: never collected
    assert shardfmt_main(["validate", "--deep", f"{root}/step_000000001"]) == 0
    assert shardfmt_main(["inspect", f"{root}/step_000000001"]) == 0
    assert "world size 1" in capsys.readouterr().out
    assert shardfmt_main(["ls", "--json", root]) == 0
    rows = {r["name"]: r["status"] for r in __import__("orjson").loads(capsys.readouterr().out)}
    assert rows == {"step_000000001": "committed", "step_000000002": "incomplete"}  # step 3: not a checkpoint
    assert shardfmt_main(["validate", f"{root}/step_000000002"]) == 1  # uncommitted: invalid
    capsys.readouterr()
    assert shardfmt_main(["gc", root]) == 0  # the orphan's objects are fresh: its lease holds
    out = capsys.readouterr().out
    assert out.startswith(f"left {root}/step_000000002: its save holds a lease until ") and out.count("\n") == 1
    assert shardfmt_main(["gc", "--lease-seconds", "0", "--json", root]) == 0
    got = __import__("orjson").loads(capsys.readouterr().out)
    assert got["removed"] == [f"{root}/step_000000002"] and got["leased"] == []
    assert fs.exists(f"{root[5:]}/step_000000001/COMMITTED") and fs.exists(f"{root[5:]}/step_000000003/notes.txt")
    assert not fs.exists(f"{root[5:]}/step_000000002/data/rank_00000.safetensors")
    assert shardfmt_main(["ls", root]) == 0 and "step_000000002" not in capsys.readouterr().out
    assert shardfmt_main(["validate", "--storage-options", '{"endpoint_url": "http://127.0.0.1:1"}',
                          f"{root}/step_000000001"]) == 2  # unreachable: one line, exit 2
    assert "cannot reach" in capsys.readouterr().err


def _torn_save_script(root: str) -> str:
    return textwrap.dedent(f"""
        import os, signal, torch, shardfmt
        import shardfmt.io.multipart as O
        ck = shardfmt.Checkpointer("{root}", storage_options={{"part_size": 5 << 20}})
        ck.save(1, {{"m": torch.nn.Linear(4, 4)}})
        orig = O.MultipartWriter._upload
        def die_after_first_part(self, number, body, fill):
            orig(self, number, body, fill)
            os.kill(os.getpid(), signal.SIGKILL)  # the process dies mid-upload
        O.MultipartWriter._upload = die_after_first_part
        big = torch.nn.Linear(2048, 2048)  # 16 MiB: several parts
        ck.save(2, {{"m": big}})
    """)


def test_torn_upload_is_ignored_by_restore_and_collected_after_its_lease(server, bucket):
    root = f"{bucket}/torn"
    out = subprocess.run([sys.executable, "-c", _torn_save_script(root)], capture_output=True, text=True,
                         timeout=240)
    assert out.returncode == -9, out.stderr[-2000:]
    fs = _fs(server)
    assert fs.exists(f"{root[5:]}/step_000000002/LEASE") and not fs.exists(f"{root[5:]}/step_000000002/COMMITTED")
    assert fs.call_s3("list_multipart_uploads", Bucket=bucket[5:]).get("Uploads"), "the dead upload is pending"
    ck = shardfmt.Checkpointer(root)
    assert [(i.step, i.status) for i in ck.list()] == [(1, "committed"), (2, "incomplete")]
    model = torch.nn.Linear(4, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ck.restore({"m": model}) == 1
    assert ck.collect_garbage() == []  # never a save whose lease holds
    removed = ck.collect_garbage(now=time.time() + ck.lease_seconds + 1)
    assert any(r.endswith("step_000000002") for r in removed)
    assert any("multipart" in r for r in removed)
    assert not fs.call_s3("list_multipart_uploads", Bucket=bucket[5:]).get("Uploads")
    assert [i.step for i in ck.list()] == [1]
    ck.save(2, {"m": model})  # the step is free again
    assert ck.latest().endswith("step_000000002")


def test_a_fresh_lease_blocks_a_save_unless_its_holder_died_on_this_host(server, bucket):
    import orjson

    fs = _fs(server)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    from shardfmt.commit.lease import lease_identity

    me = lease_identity()
    for name, holder in (("live", dict(me, host="another-node", pid=1)),
                         ("live-other-pidns", dict(me, pidns="pid:[1]", pid=dead.pid)),  # a container's
                         ("dead", dict(me, pid=dead.pid))):
        fs.pipe_file(f"{bucket[5:]}/{name}/data/rank_00000.safetensors", b"partial")
        fs.pipe_file(f"{bucket[5:]}/{name}/LEASE", orjson.dumps(dict(holder, time=time.time())))
    for live in ("live", "live-other-pidns"):
        with pytest.raises(CheckpointExistsError, match="in progress"):  # maybe live: never overwritten
            shardfmt.save({"x": torch.ones(2)}, f"{bucket}/{live}")
        assert fs.exists(f"{bucket[5:]}/{live}/data/rank_00000.safetensors")
    shardfmt.save({"x": torch.ones(2)}, f"{bucket}/dead")  # a restarted job on the same node
    assert shardfmt.validate(f"{bucket}/dead").ok


def test_archive_to_s3_then_restore_after_the_local_root_is_gone(server, bucket, tmp_path):
    import shutil

    root = str(tmp_path / "local")
    archive = f"{bucket}/archive"
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.AdamW(model.parameters())
    with shardfmt.Checkpointer(root, archive=archive, archive_every=2, keep_last=1) as ck:
        for step in range(1, 6):
            model(torch.randn(2, 64)).sum().backward()
            opt.step()
            ck.save(step, {"model": model, "optim": opt})
        ck.wait()
        assert ck.archive_errors == []
    arch = shardfmt.Checkpointer(archive)
    assert [(i.step, i.status) for i in arch.list()] == [(1, "committed"), (2, "committed"), (4, "committed")]
    assert shardfmt.validate(f"{archive}/step_000000004", deep=True).ok
    want = {k: v.clone() for k, v in model.state_dict().items()}
    shutil.rmtree(root)  # the node's disk died
    fresh = torch.nn.Linear(64, 64)
    fresh_opt = torch.optim.AdamW(fresh.parameters())
    with pytest.warns(UserWarning, match="from the archive"):
        step = shardfmt.Checkpointer(root, archive=archive, archive_every=2).restore(
            {"model": fresh, "optim": fresh_opt})
    assert step == 4
    # step 5 was never archived (⌊5/2⌋ = ⌊4/2⌋); the archive's newest is step 4, which we compare to
    ck4 = {"model": {k: torch.zeros_like(v) for k, v in want.items()}}
    shardfmt.load(ck4, f"{archive}/step_000000004", strict=False)
    assert all(bytes_equal(fresh.state_dict()[k], ck4["model"][k]) for k in want)


def test_archive_failures_are_retried_reported_and_never_raised(server, bucket, tmp_path):
    ck = shardfmt.Checkpointer(str(tmp_path / "r"), archive="s3://no-such-bucket-here/a",
                               archive_storage_options=FAST_FAIL, archive_backoff=0.01)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ck.save(1, {"m": torch.nn.Linear(4, 4)})
        ck.wait()
    assert ck.latest().endswith("step_000000001"), "training's own checkpoint is unaffected"
    assert len(ck.archive_errors) == 1 and "s3://no-such-bucket-here/a/step_000000001" in ck.archive_errors[0]
    assert "bucket does not exist" in ck.archive_errors[0]
    assert sum("retrying" in str(w.message) for w in caught) == ck.options.archive.attempts - 1


def test_missing_bucket_and_unreachable_endpoint_fail_fast_with_the_url(server):
    with pytest.raises(StorageError, match=r"s3://no-such-bucket-x/ck.*bucket does not exist"):
        shardfmt.save({"x": torch.ones(4)}, "s3://no-such-bucket-x/ck", storage_options=FAST_FAIL)
    with pytest.raises(StorageError, match="no-such-bucket-x"):
        shardfmt.load({"x": torch.ones(4)}, "s3://no-such-bucket-x/ck", storage_options=FAST_FAIL)
    t = time.monotonic()
    with pytest.raises(StorageError, match=r"s3://bkt/ck.*cannot reach"):
        shardfmt.save({"x": torch.ones(4)}, "s3://bkt/ck",
                      storage_options=dict(FAST_FAIL, endpoint_url="http://127.0.0.1:1"))
    assert time.monotonic() - t < 30


def test_a_5xx_in_the_middle_of_a_save_commits_nothing_and_leaves_no_upload(server, bucket):
    url = f"{bucket}/flaky/step_1"
    server.fail("PUT", after=3)  # LEASE and the first parts go through, then every PUT is a 500
    with pytest.raises(StorageError, match=f"{url}.*(InternalError|injected|500)"):
        shardfmt.save(_state(), url, storage_options=dict(FAST_FAIL, part_size=5 << 20))
    server.clear_faults()
    fs = _fs(server)
    assert not fs.exists(url[5:] + "/COMMITTED")
    with pytest.raises((CommitError, shardfmt.errors.CheckpointNotFoundError)):
        shardfmt.read_manifest(url)
    assert not fs.call_s3("list_multipart_uploads", Bucket=bucket[5:]).get("Uploads")
    shardfmt.save(_state(), url)  # the failed save removed what it wrote: the path is usable at once
    assert shardfmt.validate(url).ok


def test_racing_saves_of_one_path_commit_exactly_one(server, bucket):
    """The COMMITTED object is written only if absent: the second save to commit is refused."""
    import shardfmt.commit.protocol as C

    url = f"{bucket}/race/step_1"
    shardfmt.save({"x": torch.ones(4)}, url)
    storage, path = shardfmt.io.registry.get_storage(url)
    from shardfmt.format.manifest import CommitRecord

    with pytest.raises(CheckpointExistsError):
        storage.write_bytes(storage.join(path, "COMMITTED"),
                            CommitRecord(save_id="other", manifest_digest="x").to_json(), exclusive=True)
    assert C.is_committed(storage, path) and shardfmt.validate(url).ok
    # two saves starting together: the LEASE is taken only if absent, so one of them stops at once
    fresh, marker = storage.join(path + "-b"), C.commit_strategy(storage)
    marker.take_lease(fresh, "")
    with pytest.raises(CheckpointExistsError, match="at the same time"):
        marker.take_lease(fresh, "")


def test_a_save_whose_data_vanished_is_never_committed(server, bucket):
    """If a collector removed a save's objects under it, the save fails instead of committing."""
    url = f"{bucket}/vanish/step_1"
    fs = _fs(server)

    def collector_strikes(step):
        if step == "files_written":
            fs.rm(fs.find(url[5:] + "/data"))

    with pytest.raises(CommitError, match="vanished"):
        shardfmt.save(_state(rows=64), url, options=SaveOptions(_seams=Seams(on_step=collector_strikes)))
    assert not fs.exists(url[5:] + "/COMMITTED")


def test_a_save_that_outlived_its_lease_never_replaces_the_save_that_took_over(server, bucket):
    """A stalled save (its lease expired) resumes while a newer save of the same path has written
    its manifest and committed: the stale save fails, and the newer checkpoint stays intact
    (its manifest was once replaced, leaving a committed checkpoint whose manifest failed its hash)."""
    url, other = f"{bucket}/race/step_1", f"{bucket}/race_b/step_1"
    fs = _fs(server)
    newer = _state(seed=1, rows=64)
    shardfmt.save(newer, other, step=1)

    def takeover(step):
        if step == "files_written":  # the newer save wrote everything and committed meanwhile
            for key in fs.find(other[5:]):
                fs.pipe_file(url[5:] + key[len(other[5:]):], fs.cat_file(key))

    with pytest.raises(shardfmt.errors.CheckpointExistsError):
        shardfmt.save(_state(seed=2, rows=64), url, step=1, options=SaveOptions(_seams=Seams(on_step=takeover)))
    assert shardfmt.validate(url, deep=True).ok
    back = _empty_like(newer)
    shardfmt.load(back, url)
    assert all(bytes_equal(back["model"][k], newer["model"][k]) for k in newer["model"])


def test_a_save_that_outlived_its_lease_never_deletes_the_save_in_progress_that_took_over(server, bucket):
    """The stale save fails when it resumes, and removes only its own objects: the newer save,
    still writing (not yet committed), keeps every object and then commits a valid checkpoint."""
    url, other = f"{bucket}/race2/step_1", f"{bucket}/race2_b/step_1"
    fs = _fs(server)
    newer = _state(seed=1, rows=64)
    shardfmt.save(newer, other, step=1)

    def takeover(step):
        if step == "files_written":  # the newer save cleared this stale save's objects and wrote its own
            fs.rm(fs.find(url[5:]))
            for key in fs.find(other[5:]):
                if not key.endswith("/COMMITTED"):
                    fs.pipe_file(url[5:] + key[len(other[5:]):], fs.cat_file(key))

    with pytest.raises((shardfmt.errors.CheckpointExistsError, CommitError)):
        shardfmt.save(_state(seed=2, rows=64), url, step=1, options=SaveOptions(_seams=Seams(on_step=takeover)))
    theirs = sorted(k[len(other[5:]):] for k in fs.find(other[5:]) if not k.endswith("/COMMITTED"))
    assert sorted(k[len(url[5:]):] for k in fs.find(url[5:])) == theirs  # none of the newer save's removed
    fs.pipe_file(url[5:] + "/COMMITTED", fs.cat_file(other[5:] + "/COMMITTED"))  # the newer save commits
    assert shardfmt.validate(url, deep=True).ok
    back = _empty_like(newer)
    shardfmt.load(back, url)
    assert all(bytes_equal(back["model"][k], newer["model"][k]) for k in newer["model"])


def test_a_stale_save_neither_refreshes_nor_removes_the_lease_of_the_save_that_took_over(server, bucket):
    """Its heartbeat finds another save's LEASE: it stops refreshing (so it never keeps the prefix
    looking alive for itself), refuses to commit, and its abort leaves the newer save's LEASE, so
    a third save cannot start beside the live one."""
    import time

    from shardfmt.commit.lease import lease_owner
    from shardfmt.io.registry import get_storage
    from shardfmt.saving.writer import CheckpointWriter, ShardData

    st, path = get_storage(f"{bucket}/stale/step_000000001", {"lease_seconds": 2})
    a = CheckpointWriter(path, storage=st)
    a.stage()  # stalls past its 2 s lease from here on
    a.write_rank(0, [ShardData(fqn="w", data=torch.ones(8), global_shape=(8,), offsets=(0,))])
    st.remove_tree(path)  # the newer save's collector cleared the expired prefix ...
    b = CheckpointWriter(path, storage=st)
    b.stage()  # ... and the newer save took it
    time.sleep(1.5)  # a's heartbeats (every 0.5 s) find b's lease
    assert lease_owner(st, path) == b.save_id
    with pytest.raises(CommitError, match="lease was collected or taken over"):
        a.commit(step=1)
    assert lease_owner(st, path) == b.save_id
    with pytest.raises(CheckpointExistsError, match="in progress"):
        CheckpointWriter(path, storage=st).stage()
    b.write_rank(0, [ShardData(fqn="w", data=torch.full((8,), 2.0), global_shape=(8,), offsets=(0,))])
    b.commit(step=1)
    got = {"w": torch.zeros(8)}
    shardfmt.load(got, f"{bucket}/stale/step_000000001")
    assert torch.all(got["w"] == 2.0)


@pytest.fixture(scope="module")
def auth_server():
    srv = s3_server.start(auth=True)
    yield srv
    srv.stop()


def test_bad_credentials_are_refused_with_a_clear_error(auth_server):
    opts = dict(FAST_FAIL, endpoint_url=auth_server.endpoint, key="AKIAWRONGWRONGWRONG1", secret="wrong")
    with pytest.raises(AccessDeniedError, match=r"s3://bkt-auth/ck.*access denied"):
        shardfmt.save({"x": torch.ones(4)}, "s3://bkt-auth/ck", storage_options=opts)
    with pytest.raises(AccessDeniedError, match="credentials"):
        shardfmt.load({"x": torch.ones(4)}, "s3://bkt-auth/ck", storage_options=opts)
    assert auth_server.stats()["requests"] >= 1, "the requests reached the server and were refused there"


def test_checkpointer_on_s3_async_saves_retention_and_quarantine(server, bucket, capsys):
    root = f"{bucket}/ckpt"
    model = torch.nn.Linear(32, 32)
    with shardfmt.Checkpointer(root, keep_last=2) as ck:
        for step in (1, 2, 3):
            with torch.no_grad():
                model.weight.fill_(step)
            handle = ck.save(step, {"model": model}, async_=True)
        handle.wait()
        ck.wait()
        assert [(i.step, i.status) for i in ck.list()] == [(2, "committed"), (3, "committed")]
    fs = _fs(server)
    data = f"{root[5:]}/step_000000003/" + next(iter(shardfmt.read_manifest(f"{root}/step_000000003").files))
    raw = bytearray(fs.cat_file(data))
    raw[-1] ^= 0xFF  # a flipped byte in the newest checkpoint
    fs.pipe_file(data, bytes(raw))
    fresh = torch.nn.Linear(32, 32)
    ck = shardfmt.Checkpointer(root)
    with pytest.warns(UserWarning, match="unusable"):
        assert ck.restore({"model": fresh}) == 2
    assert torch.equal(fresh.weight, torch.full((32, 32), 2.0))
    assert [(i.step, i.status) for i in ck.list()] == [(2, "committed"), (3, "quarantined")]
    assert fs.exists(f"{root[5:]}/step_000000003/QUARANTINED")
    assert shardfmt_main(["ls", "--json", root]) == 0
    assert {r["name"]: r["status"] for r in orjson.loads(capsys.readouterr().out)} == \
        {"step_000000002": "committed", "step_000000003": "quarantined"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the quarantined one is not tried again
        assert shardfmt.Checkpointer(root).restore({"model": fresh}) == 2
    with pytest.warns(UserWarning, match="replacing the quarantined"):
        ck.save(3, {"model": fresh})  # training goes on from step 2 and saves step 3 again
    assert [(i.step, i.status) for i in ck.list()] == [(2, "committed"), (3, "committed")]


_CONVERT_RSS = r"""
import json, sys, threading, time
import reshard.convert, shardfmt
from shardfmt.io.registry import get_storage

def rss():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmRSS:"))

src, dst, budget = sys.argv[1], sys.argv[2], int(sys.argv[3])
st, p = get_storage(dst)
# the S3 client, its service model and multipart code paths are loaded before the baseline
shardfmt.save({"w": __import__("torch").ones(3 << 20)}, dst + "-warm", storage_options={"part_size": 5 << 20})
peak, stop = [rss()], threading.Event()
before = peak[0]
def sample():
    while not stop.is_set():
        peak[0] = max(peak[0], rss()); time.sleep(0.001)
t = threading.Thread(target=sample, daemon=True); t.start()
rep = reshard.convert.convert(src, dst, "tp=3", memory_budget=budget)
stop.set(); t.join()
print(json.dumps({"growth": max(peak[0], rss()) - before, "windows": rep.windows}))
"""


def test_convert_to_s3_keeps_its_upload_buffers_inside_the_budget(server, bucket, tmp_path):
    import json

    from tests.test_convert import _big_checkpoint

    src = str(tmp_path / "src")
    size = _big_checkpoint(src, 72)
    budget = 48 << 20
    dst = f"{bucket}/converted"
    out = subprocess.run([sys.executable, "-c", _CONVERT_RSS, src, dst, str(budget)], capture_output=True,
                         text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert size > budget
    assert got["growth"] < budget + (32 << 20), f"RSS grew {got['growth'] / 2**20:.1f} MiB"
    m = shardfmt.read_manifest(dst)
    assert m.topology.world_size == 3 and shardfmt.validate(dst, deep=True).ok
    ref = {n: torch.empty(r.shape, dtype=getattr(torch, {"F32": "float32", "BF16": "bfloat16"}[r.dtype]))
           for n, r in m.tensors.items()}
    back = {n: torch.empty_like(t) for n, t in ref.items()}
    shardfmt.load(ref, src)
    shardfmt.load(back, dst)
    assert all(bytes_equal(back[k], ref[k]) for k in ref)


def test_a_save_never_deletes_what_is_not_a_dead_save(server, bucket):
    """Objects that are not a shardfmt save are refused, whatever their age; paths that fsspec
    would expand as patterns, and a bucket's root, are refused before anything is written."""
    fs = _fs(server)
    fs.pipe_file(f"{bucket[5:]}/models/llama/weights.bin", b"precious")
    with pytest.raises(CheckpointExistsError, match="not a shardfmt checkpoint"):
        shardfmt.save({"x": torch.ones(2)}, f"{bucket}/models")
    assert fs.cat_file(f"{bucket[5:]}/models/llama/weights.bin") == b"precious"
    shardfmt.save({"x": torch.ones(2)}, f"{bucket}/exp1")
    for bad in (f"{bucket}/exp[12]", f"{bucket}/exp*", bucket):
        with pytest.raises(StorageError):
            shardfmt.save({"x": torch.ones(2)}, bad)
    assert shardfmt.validate(f"{bucket}/exp1").ok and fs.exists(f"{bucket[5:]}/models/llama/weights.bin")
    with pytest.raises(StorageError, match="part_size"):
        shardfmt.save({"x": torch.ones(2)}, f"{bucket}/y", storage_options={"part_size": "8MiB"})
    with pytest.raises(shardfmt.errors.CheckpointNotFoundError, match="bucket"):  # a misspelled bucket is not "no
        shardfmt.Checkpointer("s3://no-such-bucket-zz/run", storage_options=FAST_FAIL).restore({})  # checkpoints yet"


def test_checkpointer_roots_on_s3_follow_the_root_rules(server, bucket, caplog, capsys):
    """spec/ROOTS.md section 1 where a prefix's parent is its bucket: a new prefix in an existing bucket is a
    first run (logged), a missing bucket an error (a warning with allow_fresh_start), a store that
    does not answer a storage error; a checkpoint given as the root is an error naming its parent,
    and a root given to load is named for what it is."""
    m = torch.nn.Linear(4, 4)
    with caplog.at_level(logging.INFO, logger="shardfmt"):
        assert shardfmt.Checkpointer(f"{bucket}/fresh").restore({"m": m}) is None
    assert any(f"{bucket}/fresh" in r.getMessage() and "first run" in r.getMessage() for r in caplog.records)
    missing = r"s3://no-such-bucket-zz/run: the Checkpointer root does not exist, nor does its bucket s3://no-such-bucket-zz"
    with pytest.raises(shardfmt.errors.CheckpointNotFoundError, match=missing):
        shardfmt.Checkpointer("s3://no-such-bucket-zz/run", storage_options=FAST_FAIL).restore({"m": m})
    with pytest.warns(UserWarning, match=missing + ".*starting from scratch"):
        assert shardfmt.Checkpointer("s3://no-such-bucket-zz/run", storage_options=FAST_FAIL,
                                     allow_fresh_start=True).restore({"m": m}) is None
    with pytest.raises(StorageError, match=r"^s3://bkt/run: .*cannot reach"):
        shardfmt.Checkpointer("s3://bkt/run", allow_fresh_start=True,
                              storage_options=dict(FAST_FAIL, endpoint_url="http://127.0.0.1:1")).restore({"m": m})
    root = f"{bucket}/run"
    ck = shardfmt.Checkpointer(root)
    for step in (1, 2):
        ck.save(step, {"m": m})
    for given in ("step_000000002", "step_000000009"):
        with pytest.raises(shardfmt.errors.CheckpointNotFoundError, match=f"{root}/{given}: is a checkpoint.*pass its parent {root}$"):
            shardfmt.Checkpointer(f"{root}/{given}").restore({"m": m})
    with pytest.raises(shardfmt.errors.CheckpointNotFoundError, match=f"{root}: is a checkpoint root holding step_000000001, "
                                                               f"step_000000002: pass one of them, e.g. {root}/step_000000002"):
        shardfmt.load({"m": {"weight": torch.zeros(4, 4)}}, root)


def test_a_newer_format_versions_checkpoint_on_s3_is_never_marked_quarantined(server, bucket, capsys):
    root = f"{bucket}/next"
    ck = shardfmt.Checkpointer(root)
    for step in (1, 2):
        ck.save(step, {"m": torch.nn.Linear(4, 4)})
    fs = _fs(server)
    marker = f"{root[5:]}/step_000000002/COMMITTED"
    commit = orjson.loads(fs.cat_file(marker))
    fs.pipe_file(marker, orjson.dumps({**commit, "format_version": 3, "manifest_index": {}}))
    with pytest.raises(shardfmt.errors.FormatVersionError, match=f"{root}/step_000000002 \\(step 2\\): format version 3; "
                                                          "this reader supports up to 2"):
        shardfmt.Checkpointer(root).restore({"m": torch.nn.Linear(4, 4)})
    assert not fs.exists(f"{root[5:]}/step_000000002/QUARANTINED")
    assert shardfmt_main(["ls", "--json", root]) == 0
    assert {r["name"]: r["status"] for r in orjson.loads(capsys.readouterr().out)} == \
        {"step_000000001": "committed", "step_000000002": "unsupported"}


def test_a_storage_error_during_restore_quarantines_nothing(server, bucket, monkeypatch):
    import shardfmt.io.ranged as O

    root = f"{bucket}/flaky-restore"
    ck = shardfmt.Checkpointer(root)
    for step in (1, 2):
        ck.save(step, {"m": torch.nn.Linear(4, 4)})

    def throttled(self, offset, buffers):
        raise StorageError(f"{self._st.url(self._path)}: read failed: SlowDown (503)")

    monkeypatch.setattr(O.RangedReader, "readinto", throttled)
    with pytest.raises(StorageError, match="nothing was quarantined"):
        ck.restore({"m": torch.nn.Linear(4, 4)})
    monkeypatch.undo()
    assert [(i.step, i.status) for i in ck.list()] == [(1, "committed"), (2, "committed")]
    assert ck.restore({"m": torch.nn.Linear(4, 4)}) == 2


def test_checkpointer_lease_reaches_the_saves_heartbeat(server, bucket):
    ck = shardfmt.Checkpointer(f"{bucket}/lease", lease_seconds=8)
    assert ck.lease_seconds == 8 and ck.storage.lease_seconds == 8
    storage, _ = shardfmt.io.registry.get_storage(f"{bucket}/lease/step_000000001", ck.storage_options)
    assert storage.lease_seconds == 8  # what save() builds from the same options: heartbeat every 2 s


@pytest.mark.parametrize("change", ["appended", "truncated"])
def test_a_data_object_of_another_size_is_refused_even_unverified(server, bucket, change):
    """Spec: a file's size is always checked. On S3 it comes with every ranged GET
    (Content-Range), so a load that reads only one tensor, verify on or off, refuses an object
    whose size is not the manifest's (a truncation that spares the bytes read included)."""
    url = f"{bucket}/run/step_1"
    state = {"a": torch.arange(1024.0), "z": torch.ones(1 << 20)}
    shardfmt.save(state, url, step=1)
    fs = _fs(server)
    key = f"{url[5:]}/" + next(iter(shardfmt.read_manifest(url).files))
    raw = fs.cat_file(key)
    fs.pipe_file(key, raw + b"\0" * 4096 if change == "appended" else raw[:-100])
    for verify in (True, False):
        got = {"a": torch.zeros(1024)}
        with pytest.raises(shardfmt.errors.IntegrityError, match="the manifest says"):
            shardfmt.load(got, url, strict=False, verify=verify)


# ----------------------------------------------------------------------------- replicated bytes read once


def _shared_load(server, url, tmp_path, layout, **args) -> tuple[list[dict], dict]:
    server.reset_stats()
    res = check_all_ok(launch("shared_load", 4, {"path": url, "layout": layout, **args},
                              out_dir=str(tmp_path / f"{layout}-{args}"), timeout=240))
    return res, server.stats()


@pytest.mark.parametrize("layout", ["full", "dp_tp"])
def test_replicas_loading_from_s3_get_each_byte_once(server, bucket, tmp_path, layout):
    """4 ranks: every rank the whole state (one read group of 4), or dp=2 x tp=2 (a read
    group of 2 replicas per tp rank): the server serves each group's bytes once, not once per
    replica; the same load with sharing off serves them once per rank."""
    from tests.distributed.workers import shared_state

    url = f"{bucket}/shared/{layout}"
    state = shared_state()
    shardfmt.save(state, url)
    size = sum(t.numel() * t.element_size() for t in state.values())
    metadata = 4 * (64 << 10)  # each rank's COMMITTED, manifest, rank table, index, header: generously
    res, alone = _shared_load(server, url, tmp_path, layout, share_reads=False)
    assert all(r["equal"] == sorted(state) for r in res), res
    assert alone["bytes_out"] >= 0.95 * 4 * (size if layout == "full" else size / 2), (alone, size)
    read = sum(r["bytes_read"] for r in res)  # what the 4 ranks' plans read, each alone
    res, shared = _shared_load(server, url, tmp_path, layout)
    assert all(r["equal"] == sorted(state) for r in res), res
    replicas = 4 if layout == "full" else 2
    assert shared["bytes_out"] <= 1.02 * read / replicas + metadata, (shared, read)
    if layout == "full":
        assert shared["bytes_out"] <= 1.1 * size + metadata, (shared, size)
    assert sum(r["bytes_read"] for r in res) <= 1.02 * read / replicas  # a rank reports what it read itself


def test_a_corrupt_chunk_read_for_a_read_group_fails_every_member_without_a_hang(server, bucket, tmp_path):
    """The owner of the read finds the chunk corrupt: every rank raises an IntegrityError at
    that read (the others naming the owner), none waits for bytes that never come."""
    url = f"{bucket}/shared/corrupt"
    from tests.distributed.workers import shared_state

    shardfmt.save(shared_state(), url)
    (name,) = shardfmt.read_manifest(url).files
    fs = _fs(server)
    key = f"{url[len('s3://'):]}/{name}"
    raw = bytearray(fs.cat_file(key))
    raw[-100] ^= 0xFF  # inside the last tensor's bytes
    fs.pipe_file(key, bytes(raw))
    results = launch("shared_load", 4, {"path": url, "layout": "full"}, out_dir=str(tmp_path / "o"), timeout=240)
    got = check_all_ok(results)
    assert all(r.get("error") == "IntegrityError" for r in got), got
    owners = [r for r in got if "read these bytes for its read group" not in r["message"]]
    assert len(owners) == 1 and "hashes to" in owners[0]["message"], got


def test_incremental_checkpoints_on_s3_upload_only_what_changed_and_keep_their_bases(server, bucket):
    """spec/FORMAT.md section 4.10 on an object store: the second save uploads the changed shard
    alone (bytes counted at the server), names its base in BASES while it runs, and retention
    (keep_last=1) keeps the base the kept checkpoint needs; the restore is bit-exact."""
    root = f"{bucket}/inc"
    model = torch.nn.Linear(1024, 1024)  # 4 MiB of weight: the frozen part
    model.weight.requires_grad_(False)
    with shardfmt.Checkpointer(root, incremental=True, keep_last=1) as ck:
        ck.save(1, {"model": model})
        server.reset_stats()
        with torch.no_grad():
            model.bias += 1
        ck.save(2, {"model": model})
        uploaded = server.stats()["bytes_in"]
    assert uploaded < 64 << 10, uploaded  # the 4 KiB bias, its index and the metadata: not 4 MiB
    assert [(i.step, i.status) for i in ck.list()] == [(1, "committed"), (2, "committed")]
    fs = _fs(server)
    assert orjson.loads(fs.cat_file(f"{root[5:]}/step_000000002/BASES")) == {"bases": ["step_000000001"]}
    assert shardfmt.validate(f"{root}/step_000000002", deep=True).ok
    fresh = torch.nn.Linear(1024, 1024)
    assert shardfmt.Checkpointer(root).restore({"model": fresh}) == 2
    assert bytes_equal(fresh.weight, model.weight) and bytes_equal(fresh.bias, model.bias)


def test_a_rollback_on_s3_marks_the_later_checkpoints_and_a_new_save_replaces_one(server, bucket):
    """spec/ROOTS.md section 1 on an object store: nothing can be renamed, so ``restore(step=N)``
    writes a ROLLED_BACK object into every later checkpoint; listers pass them over, and saving
    one of their steps again replaces it (with a warning)."""
    root = f"{bucket}/rb"
    model = torch.nn.Linear(16, 16)
    with shardfmt.Checkpointer(root, keep_last=10) as ck:
        for step in (1, 2, 3):
            with torch.no_grad():
                model.weight.fill_(step)
            ck.save(step, {"model": model})
    fresh = torch.nn.Linear(16, 16)
    ck = shardfmt.Checkpointer(root)
    with pytest.warns(UserWarning, match="rolled back to step 1"):
        assert ck.restore({"model": fresh}, step=1) == 1
    assert torch.equal(fresh.weight, torch.full((16, 16), 1.0))
    fs = _fs(server)
    assert fs.exists(f"{root[5:]}/step_000000002/ROLLED_BACK") and fs.exists(f"{root[5:]}/step_000000003/ROLLED_BACK")
    assert ck.latest().endswith("step_000000001")
    assert [(i.step, i.status) for i in ck.list()] == [(1, "committed"), (2, "rolled_back"), (3, "rolled_back")]
    with torch.no_grad():
        fresh.weight.fill_(20.0)
    with pytest.warns(UserWarning, match="replacing the rolled-back checkpoint of step 2"):
        ck.save(2, {"model": fresh})
    again = torch.nn.Linear(16, 16)
    assert shardfmt.Checkpointer(root).restore({"model": again}) == 2
    assert torch.equal(again.weight, torch.full((16, 16), 20.0))


def test_dcp_save_and_load_through_the_backend_on_s3(server, bucket):
    """``dcp.save``/``dcp.load`` with ``shardfmt.dcp``'s Writer and Reader on an S3 URL: a
    committed checkpoint on the server (COMMITTED last, no lease left), read back bit for bit."""
    import torch.distributed.checkpoint as dcp

    from shardfmt.dcp import Reader, Writer

    url = f"{bucket}/dcp/step_1"
    state = _state()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.save(state, storage_writer=Writer(url, step=1))
        back = _empty_like(state)
        back.update(step=0, note="")
        dcp.load(back, storage_reader=Reader(url))
    assert all(bytes_equal(back["model"][k], state["model"][k]) for k in state["model"])
    assert back["step"] == 7 and back["note"] == "hello"
    assert shardfmt.validate(url, deep=True).ok
    fs = _fs(server)
    assert fs.exists(url + "/COMMITTED") and not fs.exists(url + "/LEASE")
