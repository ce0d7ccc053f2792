"""The node-local tier (``Checkpointer(local=...)``, spec/ROOTS.md section 3): each node's part on
its own disk, copied to the root behind the training, restored from the fastest complete copy.

"Nodes" are directories (``{node}`` in the local path) and ranks are grouped by a node name the
jobs set (``tests/distributed/tier_jobs.py``); the root is a directory here and the moto S3
server in ``test_s3_local_tier``.
"""

from __future__ import annotations

import os
import shutil
import time

import pytest
import torch

import shardfmt
from shardfmt.commit import joint
from shardfmt.commit.nodepart import list_parts
from shardfmt.errors import CheckpointNotFoundError
from shardfmt.format.nodepart import NODE_PART_NAME, NodePart, PartRecord
from shardfmt.io.local import LocalStorage
from shardfmt.io.nodepart import NodeMissError, NodePartStorage
from shardfmt.saving.options import SaveOptions
from shardfmt.training.nodes import NodeMap
from shardfmt.training.options import CheckpointerOptions
from shardfmt.training.roots import collect_garbage, list_steps
from shardfmt.validation import validate
from tests.distributed.harness import check_all_ok, launch

JOBS = "tests.distributed.tier_jobs"
STEP = "step_{:09d}"


def _run(job, world, args, out, timeout=240):
    return check_all_ok(launch(job, world, args, out_dir=str(out), module=JOBS, timeout=timeout))


def _files(path):
    return sorted(os.path.relpath(os.path.join(d, f), path) for d, _, fs in os.walk(path) for f in fs)


def _train(tmp_path, steps=(1, 2), **args):
    root, local = tmp_path / "root", tmp_path / "local"
    args = {"root": str(root), "local": str(local / "{node}"), "steps": list(steps), "replicate": "wait", **args}
    saved = _run("tier_train", 4, args, tmp_path / "o_train")
    return root, local, args, saved


# ----------------------------------------------------------------------------- saving


@pytest.mark.slow
def test_each_node_holds_its_part_and_the_root_a_committed_copy(tmp_path):
    root, local, args, saved = _train(tmp_path)
    assert all(not r["errors"] for r in saved)
    for node, ranks in (("n0", (0, 1)), ("n1", (2, 3))):
        part = local / node / STEP.format(2)
        files = _files(part)
        assert "COMMITTED" not in files and NODE_PART_NAME in files  # no node holds the whole checkpoint
        data = [f for f in files if f.startswith("data/")]
        assert data == [f"data/rank_{r:05d}.safetensors" for r in ranks]  # its own ranks' files, no other
        with pytest.raises(CheckpointNotFoundError, match="one node's part"):
            shardfmt.read_manifest(str(part))
    for step in (1, 2):  # the root's copies: committed, complete, verified
        assert validate(str(root / STEP.format(step)), deep=True).ok
    whole = {"a": torch.zeros(512, 256), "b": torch.zeros(512, 256), "bias": torch.zeros(1024, 1024)}
    shardfmt.load({"model": whole}, str(root / STEP.format(2)))
    assert {k: v.flatten()[::97].tolist() for k, v in whole.items()} == saved[0]["state"]


# ----------------------------------------------------------------------------- restoring


@pytest.mark.slow
def test_restore_prefers_the_local_copy_and_falls_back_together(tmp_path):
    root, local, args, saved = _train(tmp_path)
    got = _run("tier_restore", 4, args, tmp_path / "o1")
    assert [(r["step"], r["tier"]) for r in got] == [(2, "local")] * 4
    assert all(r["state"] == saved[0]["state"] for r in got)  # node 1 read rank 0's bias from the root's copy

    shutil.rmtree(local / "n1")  # a lost node: its parts are gone, the root's copies remain
    got = _run("tier_restore", 4, args, tmp_path / "o2")
    assert [(r["step"], r["tier"]) for r in got] == [(2, "root")] * 4
    assert all(r["state"] == saved[0]["state"] for r in got)


@pytest.mark.slow
def test_a_changed_node_mapping_restores_from_the_root(tmp_path):
    root, local, args, saved = _train(tmp_path)
    got = _run("tier_restore", 4, dict(args, nodes="stripes"), tmp_path / "o1")
    assert [(r["step"], r["tier"]) for r in got] == [(2, "root")] * 4
    assert all(r["state"] == saved[0]["state"] for r in got)


@pytest.mark.slow
def test_a_node_that_needs_another_nodes_bytes_waits_for_the_roots_copy(tmp_path):
    """Without the root's copy of step 2, node 1 cannot read the bias rank 0 wrote on node 0: no
    rank restores step 2 from the tier; all take step 1 (its copy is committed). A state each
    node holds whole (no replicated tensor) restores from the tier alone."""
    root, local, args, saved = _train(tmp_path)
    shutil.rmtree(root / STEP.format(2))
    got = _run("tier_restore", 4, args, tmp_path / "o1")
    assert [(r["step"], r["tier"]) for r in got] == [(1, "local")] * 4
    assert any("another node" in w for r in got for w in r["warned"])

    root2, local2, args2, saved2 = _train(tmp_path / "sharded", replicated=False)
    shutil.rmtree(root2)
    got = _run("tier_restore", 4, args2, tmp_path / "o2")
    assert [(r["step"], r["tier"]) for r in got] == [(2, "local")] * 4
    assert all(r["state"] == saved2[0]["state"] for r in got)


@pytest.mark.slow
def test_async_saves_on_the_tier_reach_the_root_and_restore(tmp_path):
    """``save(async_=True)`` with ``local=``: each save is written to the node disks behind the
    loop, committed there, then copied; the next save first lets it commit (its copy counts)."""
    root, local, args, saved = _train(tmp_path, steps=(1, 2, 3), **{"async": True})
    assert all(not r["errors"] for r in saved)
    assert sorted(os.listdir(root)) == [STEP.format(s) for s in (1, 2, 3)]
    assert validate(str(root / STEP.format(3)), deep=True).ok
    got = _run("tier_restore", 4, args, tmp_path / "o1")
    assert [(r["step"], r["tier"]) for r in got] == [(3, "local")] * 4
    assert all(r["state"] == saved[0]["state"] for r in got)


# ----------------------------------------------------------------------------- the replicate policy


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["skip", "wait"])
def test_a_save_while_an_earlier_copy_runs_follows_the_policy(tmp_path, policy):
    root, local, args, saved = _train(tmp_path, steps=(1, 2, 3), replicate=policy, slow_copy=1.5)
    copied = sorted(os.listdir(root))
    if policy == "skip":  # step 2 came while step 1 was being copied: left on the tier only, logged
        assert STEP.format(2) not in copied and STEP.format(1) in copied
        assert any("stays on the node-local tier only" in m for m in saved[0]["log"])
        assert all(b < 1.4 for r in saved for b in r["blocked"][1:]), [r["blocked"] for r in saved]
    else:
        assert copied == [STEP.format(s) for s in (1, 2, 3)]
        assert any("waited" in m for m in saved[0]["log"])
    parts = [p[0] for p in list_parts(LocalStorage(), str(local / "n1"))]
    # keep=2 on each node, and any part being copied (step 1's, when step 3 came: skip)
    assert parts == [2, 3] or (policy == "skip" and parts == [1, 2, 3]), parts


# ----------------------------------------------------------------------------- the parts alone


def test_a_part_reads_through_its_node_storage_and_names_what_it_lacks(tmp_path):
    sd, path = _part_of(tmp_path, "")
    [info] = list_steps(LocalStorage(), str(tmp_path / "n0"))  # what `shardfmt ls` shows
    assert info.status == "node_part" and info.step == 1 and "node 0 of 1" in info.reason
    out = {"w": torch.zeros(512, 1024), "b": torch.zeros(10, dtype=torch.long)}
    shardfmt.load(out, path, storage=NodePartStorage(path))
    assert torch.equal(out["w"], sd["w"]) and torch.equal(out["b"], sd["b"])
    os.remove(os.path.join(path, "data", "rank_00000.safetensors"))  # as if another node held it
    with pytest.raises(NodeMissError, match="rank_00000.safetensors: another node"):
        shardfmt.load(out, path, storage=NodePartStorage(path))


SID = "0123456789abcdef"


def test_a_joint_copy_commits_once_when_every_writer_marked(tmp_path):
    st = LocalStorage()
    dst = str(tmp_path / "shared" / STEP.format(1))
    staging = joint.join(st, dst, SID)
    assert joint.join(st, dst, SID) == staging  # a second writer joins
    joint.mark(st, staging, 0, SID)
    assert not joint.complete(st, staging, 2, "a", SID)  # node 1 has not copied: nobody commits
    st.write_bytes(os.path.join(staging, "NODES", "node_00001"), b"fedcba9876543210\n")  # another save's marker
    assert not joint.complete(st, staging, 2, "a", SID) and not joint.marked(st, staging, 1, SID)
    os.remove(os.path.join(staging, "NODES", "node_00001"))
    joint.mark(st, staging, 1, SID)
    assert joint.complete(st, staging, 2, "a", SID)
    assert not joint.complete(st, staging, 2, "b", SID)  # the claim is a's: exactly one commits
    assert joint.complete(st, staging, 2, "a", SID)  # ... and a retry of a's finds it its own
    joint.release(st, staging, "b")  # not b's to give up
    assert not joint.complete(st, staging, 2, "b", SID)
    joint.release(st, staging, "a")  # a failed: the next writer claims
    assert joint.complete(st, staging, 2, "b", SID)
    joint.release(st, staging, "b")
    st.write_bytes(os.path.join(staging, "COMMITTER"), b"")  # a claim whose write failed after its file was made
    with pytest.raises(shardfmt.errors.CommitError, match="empty claim"):
        joint.complete(st, staging, 2, "a", SID)
    assert joint.complete(st, staging, 2, "a", SID)  # removed: the retry claims


def _part_of(tmp_path, root: str):
    sd = {"w": torch.randn(512, 1024), "b": torch.arange(10)}
    path = str(tmp_path / "n0" / STEP.format(1))
    shardfmt.save(sd, path, step=1, options=SaveOptions(node_part=NodePart(index=0, count=1, ranks=(0,), root=root)))
    return sd, path


def test_a_claimant_that_fails_commits_on_its_retry_and_nothing_is_committed_torn(tmp_path, monkeypatch):
    from shardfmt.training import replicate

    st = LocalStorage()
    root = str(tmp_path / "shared")
    sd, path = _part_of(tmp_path, root)
    publish, calls = joint.publish, []

    def flaky(storage, dst, staging, m, docs, required):
        calls.append(sorted(required))
        if len(calls) == 1:
            raise shardfmt.errors.StorageError("throttled")
        return publish(storage, dst, staging, m, docs, required)

    monkeypatch.setattr(joint, "publish", flaky)
    rep = replicate.Replicator(st, st, root, attempts=3, backoff=0.0)
    rep.copy(STEP.format(1), path)
    rep.wait()
    assert not rep.errors and len(calls) == 2
    assert "data/rank_00000.safetensors" in calls[0]
    assert validate(os.path.join(root, STEP.format(1)), deep=True).ok
    out = {"w": torch.zeros(512, 1024), "b": torch.zeros(10, dtype=torch.long)}
    shardfmt.load(out, os.path.join(root, STEP.format(1)))
    assert torch.equal(out["w"], sd["w"])


def test_a_copy_missing_a_file_is_never_committed(tmp_path):
    st = LocalStorage()
    sd, path = _part_of(tmp_path, "")
    dst = str(tmp_path / "shared" / STEP.format(1))
    from shardfmt.training.replicate import open_part

    _, root_m, _ = open_part(st, path)
    staging = joint.join(st, dst, root_m.save_id)
    with pytest.raises(shardfmt.errors.CommitError, match="rank_00000.safetensors is missing"):
        joint.publish(st, dst, staging, root_m, {}, {"data/rank_00000.safetensors": 10})
    assert not os.path.exists(os.path.join(dst, "COMMITTED"))


def test_a_restore_takes_only_its_own_roots_parts(tmp_path):
    from shardfmt.io.registry import get_storage
    from shardfmt.training.local_tier import LocalTier
    from shardfmt.training.options import ArchivePolicy, LocalTierPolicy
    from shardfmt.training.ranks import Ranks

    os.makedirs(tmp_path / "a")
    os.makedirs(tmp_path / "b")
    _part_of(tmp_path, str(tmp_path / "a"))  # job A's part of step 1, on node n0's disk
    policy = LocalTierPolicy(url=str(tmp_path / "{node}"), node="n0")

    def tier(root):
        st, r = get_storage(str(root))
        return LocalTier(policy, st, r, Ranks(), ArchivePolicy())

    assert [s for s, _ in tier(tmp_path / "a").usable()] == [1]
    assert tier(tmp_path / "b").usable() == []  # job B (another root, the same disk) never resumes A's state
    st, r = get_storage(str(tmp_path / "a"))
    with pytest.raises(ValueError, match="the root itself"):
        LocalTier(LocalTierPolicy(url=str(tmp_path / "a")), st, r, Ranks(), ArchivePolicy())


def test_node_part_records_and_options_are_checked(tmp_path):
    with pytest.raises(shardfmt.errors.IntegrityError, match="not a node part record"):
        PartRecord.parse(b'{"save_id": "x"}', source="NODE_PART")
    with pytest.raises(ValueError, match="ascending"):
        NodePart(index=0, count=1, ranks=(1, 0))
    with pytest.raises(ValueError, match="local directory"):
        CheckpointerOptions().with_keywords(local="s3://b/x")
    with pytest.raises(ValueError, match="incremental"):
        CheckpointerOptions().with_keywords(local="/x", incremental=True)
    with pytest.raises(ValueError, match="replicate"):
        CheckpointerOptions().with_keywords(local="/x", replicate="sometimes")
    m = NodeMap.of_names(["h1", "h1", "h0", "h0", "h1"])
    assert m.names == ("h1", "h0") and m.part(2, "t").ranks == (2, 3) and m.part(4, "t").ranks == (0, 1, 4)


# ----------------------------------------------------------------------------- the root on S3


@pytest.fixture(scope="module")
def s3():
    from tests import s3_server

    with s3_server.serving() as srv:
        yield srv


@pytest.mark.slow
def test_an_s3_root_gets_each_save_from_every_node_and_serves_the_restore(tmp_path, s3):
    import uuid

    import s3fs

    bucket = "b" + uuid.uuid4().hex[:12]
    fs = s3fs.S3FileSystem(endpoint_url=s3.endpoint, skip_instance_cache=True, use_listings_cache=False)
    fs.mkdir(bucket)
    root, local = f"s3://{bucket}/run", tmp_path / "local"
    args = {"root": root, "local": str(local / "{node}"), "steps": [1, 2], "replicate": "wait"}
    saved = _run("tier_train", 4, args, tmp_path / "o_train")
    assert all(not r["errors"] for r in saved)
    for step in (1, 2):
        assert validate(f"{root}/{STEP.format(step)}", deep=True).ok
        names = {p.rsplit("/", 1)[1] for p in fs.find(f"{bucket}/run/{STEP.format(step)}")}
        assert "LEASE" not in names and {"COMMITTED", "node_00000", "node_00001", "COMMITTER"} <= names
    got = _run("tier_restore", 4, args, tmp_path / "o1")
    assert [(r["step"], r["tier"]) for r in got] == [(2, "local")] * 4
    assert all(r["state"] == saved[0]["state"] for r in got)
    shutil.rmtree(local)  # every node lost its disk: the root's copies remain
    got = _run("tier_restore", 4, args, tmp_path / "o2")
    assert [(r["step"], r["tier"]) for r in got] == [(2, "root")] * 4
    assert all(r["state"] == saved[0]["state"] for r in got)


def test_a_part_reads_what_another_node_holds_from_the_roots_copy_on_an_object_store(tmp_path):
    """The root's copy on an object store (``memory://`` here, its readers have no direct I/O):
    a node part missing a file (another node's) reads it from there, verified."""
    import uuid

    from shardfmt.io.registry import get_storage
    from shardfmt.training.replicate import copy_part

    sd, path = _part_of(tmp_path, "")
    shared, root = get_storage(f"memory://shared-{uuid.uuid4().hex[:8]}/run")
    there = shared.join(root, STEP.format(1))
    assert copy_part(LocalStorage(), path, shared, there)
    os.remove(os.path.join(path, "data", "rank_00000.safetensors"))  # as if another node held it
    st = NodePartStorage(path, (shared, there))
    out = {"w": torch.zeros(512, 1024), "b": torch.zeros(10, dtype=torch.long)}
    rep = shardfmt.load(out, path, storage=st)
    assert torch.equal(out["w"], sd["w"]) and torch.equal(out["b"], sd["b"])
    assert st.from_shared == {"data/rank_00000.safetensors"} and rep.bytes_read >= sd["w"].nbytes


def test_a_failing_node_disk_is_no_storage_error_to_retry(tmp_path, monkeypatch):
    """An I/O error on the node's own disk makes the tier's copy unusable (a restore falls
    back); one reading the root's copy stays a StorageError (the restore fails, to be retried)."""
    from shardfmt.errors import StorageError
    from shardfmt.io.nodepart import NodeDiskError

    sd, path = _part_of(tmp_path, "")
    st = NodePartStorage(path)

    def eio(self, *a, **k):
        raise StorageError("Input/output error")

    monkeypatch.setattr(LocalStorage, "read_bytes", eio)
    with pytest.raises(NodeDiskError, match="Input/output"):
        st.read_bytes(os.path.join(path, "manifest.json"), limit=1 << 20, within=path)
    monkeypatch.undo()
    reader = st.open_reader(os.path.join(path, "data", "rank_00000.safetensors"), within=path)
    monkeypatch.setattr(type(reader._reader), "readinto", eio)
    with pytest.raises(NodeDiskError):
        reader.readinto(0, [memoryview(bytearray(8))])


def test_a_copy_a_node_never_finished_is_never_committed_and_is_collected(tmp_path):
    """A node that dies before its marker: nobody commits; once the lease expires the collector
    removes the staging as any dead save's (its markers are among the names a save writes)."""
    st = LocalStorage()
    root = str(tmp_path / "shared")
    staging = joint.join(st, os.path.join(root, STEP.format(1)), SID)
    st.write_bytes(os.path.join(staging, "data", "rank_00000.safetensors"), b"x" * 64)
    joint.mark(st, staging, 0, SID)
    assert not joint.complete(st, staging, 2, "a", SID)  # node 1 never marks
    assert collect_garbage(st, root, lease_seconds=600.0) == []  # its lease is fresh: left alone
    removed = collect_garbage(st, root, lease_seconds=600.0, now=time.time() + 3600)
    assert len(removed) == 1 and not os.path.exists(staging) and os.listdir(root) == []
