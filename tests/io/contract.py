"""Contract tests written once against the byte store and commit interfaces, run per backend.

As zarr's ``StoreTests`` and fsspec's abstract tests do: a backend's test module subclasses
``ByteStoreContract`` (and ``CommitContract``) and gives the ``store`` fixture, a
``(store, base)`` pair whose ``base`` is an empty, writable location (a directory on local
disk, a prefix in an object store). ``links`` says whether the backend has symbolic links
(then reads under a checkpoint refuse one: spec section 2).

The shardfmt internals these tests reach (re-point here when they move): ``io.store``,
``commit.protocol.commit_strategy``, ``loading.reader.open_checkpoint``.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

import shardfmt
from shardfmt.commit.protocol import commit_strategy
from shardfmt.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    CommitError,
    IntegrityError,
    ShardfmtError,
    SpecialFileError,
)
from shardfmt.format.manifest import COMMITTED_NAME
from shardfmt.loading.reader import open_checkpoint

PAYLOAD = bytes(range(256)) * 40  # 10 KiB, every byte value


def _copy_save_files(st, src: str, dst: str) -> None:
    """Copy what a save writes below the checkpoint (data files; v2's rank indexes and rank table)."""
    for fname in st.list_tree(src):
        if fname not in ("COMMITTED", "manifest.json", "LEASE"):
            if "/" in fname:
                st.makedirs(st.join(dst, fname.rsplit("/", 1)[0]))
            st.write_bytes(st.join(dst, fname), st.read_bytes(st.join(src, fname), limit=1 << 30))


class ByteStoreContract:
    """What every ``ByteStore`` does, whatever it stores bytes on."""

    links = False

    def test_bytes_round_trip_and_size(self, store):
        st, base = store
        path = st.join(base, "a.bin")
        st.write_bytes(path, PAYLOAD)
        assert st.read_bytes(path, limit=len(PAYLOAD)) == PAYLOAD
        assert st.size(path) == len(PAYLOAD)
        assert st.exists(path) and not st.isdir(path)

    def test_a_read_larger_than_its_limit_is_refused(self, store):
        st, base = store
        path = st.join(base, "a.bin")
        st.write_bytes(path, PAYLOAD)
        with pytest.raises(IntegrityError, match="limit"):
            st.read_bytes(path, limit=len(PAYLOAD) - 1)

    def test_ranged_reads_scatter_exactly_the_bytes_asked_for(self, store):
        st, base = store
        path = st.join(base, "a.bin")
        st.write_bytes(path, PAYLOAD)
        reader = st.open_reader(path)
        try:
            assert reader.size == len(PAYLOAD)
            a, b = bytearray(100), bytearray(3000)
            reader.readinto(1234, [memoryview(a), memoryview(b)])
            assert bytes(a) + bytes(b) == PAYLOAD[1234:1234 + 3100]
            tail = bytearray(10)
            reader.readinto(len(PAYLOAD) - 10, [memoryview(tail)])
            assert bytes(tail) == PAYLOAD[-10:]
        finally:
            reader.close()

    def test_a_read_past_the_end_is_an_integrity_error(self, store):
        st, base = store
        path = st.join(base, "a.bin")
        st.write_bytes(path, PAYLOAD)
        reader = st.open_reader(path)
        try:
            with pytest.raises(IntegrityError):
                reader.readinto(len(PAYLOAD) - 10, [memoryview(bytearray(20))])
        finally:
            reader.close()

    def test_streamed_writes_read_back_whole(self, store):
        st, base = store
        st.makedirs(st.join(base, "d"))
        path = st.join(base, "d", "streamed.bin")
        w = st.open_writer(path)
        for k in range(0, len(PAYLOAD), 1000):
            w.write(memoryview(PAYLOAD)[k:k + 1000])
        w.close()
        assert st.read_bytes(path, limit=len(PAYLOAD)) == PAYLOAD

    def test_exclusive_create_is_refused_when_present_and_keeps_the_first_bytes(self, store):
        st, base = store
        path = st.join(base, "once")
        st.write_bytes(path, b"first", exclusive=True)
        with pytest.raises(ShardfmtError):
            st.write_bytes(path, b"second", exclusive=True)
        assert st.read_bytes(path, limit=100) == b"first"

    @pytest.mark.parametrize("call", ["size", "read_bytes", "open_reader"])
    def test_a_missing_file_is_checkpoint_not_found(self, store, call):
        st, base = store
        path = st.join(base, "missing.bin")
        args = {"read_bytes": {"limit": 10}}.get(call, {})
        with pytest.raises(CheckpointNotFoundError):
            getattr(st, call)(path, **args)
        assert not st.exists(path)

    def test_listing_names_each_entry_once_sorted(self, store):
        st, base = store
        st.makedirs(st.join(base, "ck", "data"))
        for name in ("ck/b", "ck/a", "ck/data/x.safetensors", "ck/data/y.safetensors"):
            st.write_bytes(st.join(base, *name.split("/")), b"1")
        assert st.listdir(st.join(base, "ck")) == ["a", "b", "data"]
        assert st.list_tree(st.join(base, "ck")) == ["a", "b", "data/x.safetensors", "data/y.safetensors"]
        assert st.isdir(st.join(base, "ck", "data"))
        assert st.list_tree(st.join(base, "nothing-here")) == []

    def test_remove_tree_removes_everything_under_it_and_nothing_beside(self, store):
        st, base = store
        st.makedirs(st.join(base, "ck", "data"))
        st.write_bytes(st.join(base, "ck", "data", "x"), b"1")
        st.write_bytes(st.join(base, "ck", "m"), b"2")
        st.write_bytes(st.join(base, "ck-beside"), b"3")
        st.remove_tree(st.join(base, "ck"))
        assert not st.exists(st.join(base, "ck")) and st.list_tree(st.join(base, "ck")) == []
        assert st.read_bytes(st.join(base, "ck-beside"), limit=10) == b"3"
        st.remove_tree(st.join(base, "never-there"))  # nothing to remove is no error

    def test_stats_count_requests_and_bytes(self, store):
        st, base = store
        path = st.join(base, "a.bin")
        before = st.stats.snapshot()
        st.write_bytes(path, PAYLOAD)
        st.read_bytes(path, limit=len(PAYLOAD))
        reader = st.open_reader(path)
        reader.readinto(0, [memoryview(bytearray(500))])
        reader.close()
        after = st.stats.snapshot()
        assert after["bytes_written"] - before["bytes_written"] == len(PAYLOAD)
        assert after["bytes_read"] - before["bytes_read"] == len(PAYLOAD) + 500
        assert after["write_requests"] > before["write_requests"]
        assert after["read_requests"] - before["read_requests"] >= 2

    def test_bucket_of_a_writable_base_exists(self, store):
        st, base = store
        assert st.bucket_exists(st.join(base, "x"))
        assert isinstance(st.url(base), str) and st.url(base)

    def test_reads_under_a_checkpoint_refuse_a_link(self, store):
        st, base = store
        if not self.links:
            pytest.skip("this store has no symbolic links")
        ck = st.join(base, "ck")
        st.makedirs(ck)
        st.write_bytes(st.join(base, "outside"), PAYLOAD)
        os.symlink(st.join(base, "outside"), st.join(ck, "manifest.json"))
        assert st.read_bytes(st.join(ck, "manifest.json"), limit=len(PAYLOAD)) == PAYLOAD  # no `within`: followed
        for call in (lambda: st.read_bytes(st.join(ck, "manifest.json"), limit=len(PAYLOAD), within=ck),
                     lambda: st.size(st.join(ck, "manifest.json"), within=ck),
                     lambda: st.open_reader(st.join(ck, "manifest.json"), within=ck)):
            with pytest.raises(SpecialFileError, match="symbolic link"):
                call()


def _state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(64, 32, generator=g), "b": torch.arange(10, dtype=torch.int64)}


class CommitContract:
    """What every commit strategy promises: a save becomes a checkpoint all at once, never torn.

    ``overwrites``: whether the strategy can replace a committed checkpoint (rename: by an
    atomic exchange; marker: no, an object store cannot swap a prefix at once)."""

    overwrites = False
    storage_options: dict | None = None

    def _staged(self, st, base, name="ck"):
        """A checkpoint's files (saved at ``base/src`` on this store) staged for ``base/name``."""
        src = st.join(base, "src")
        shardfmt.save(_state(), st.url(src), storage_options=self.storage_options)
        m = open_checkpoint(src, storage=st).manifest
        strategy, path = commit_strategy(st), st.join(base, name)
        staging = strategy.prepare(path, m.save_id, overwrite=False)
        _copy_save_files(st, src, staging)
        return strategy, path, staging, m

    def _is_checkpoint(self, st, path) -> bool:
        try:
            open_checkpoint(path, storage=st)
        except (CheckpointNotFoundError, CommitError):
            return False
        return True

    def test_publish_makes_the_checkpoint_visible_all_at_once(self, store):
        st, base = store
        strategy, path, staging, m = self._staged(st, base)
        seen = []

        def at(step):
            seen.append(step)
            if step in ("files_written", "manifest_written"):
                assert not strategy.is_committed(path) and not self._is_checkpoint(st, path), step

        assert not self._is_checkpoint(st, path)
        strategy.publish(path, staging, m, on_step=at)
        assert seen[0] == "files_written" and seen[-1] in ("published", "cleaned")
        assert strategy.is_committed(path) and self._is_checkpoint(st, path)
        out = {k: torch.zeros_like(v) for k, v in _state().items()}
        shardfmt.load(out, st.url(path), storage_options=self.storage_options)
        assert all(torch.equal(out[k], v) for k, v in _state().items())

    def test_abort_leaves_no_checkpoint_and_nothing_of_the_save(self, store):
        st, base = store
        strategy, path, staging, m = self._staged(st, base)
        strategy.abort(path, staging, m.save_id)
        strategy.release(staging)
        assert not strategy.is_committed(path) and not self._is_checkpoint(st, path)
        assert st.list_tree(staging) == [] and st.list_tree(path) == []

    def test_a_second_publish_of_the_same_path_is_refused(self, store):
        st, base = store
        strategy, path, staging, m = self._staged(st, base)
        strategy.publish(path, staging, m)
        with pytest.raises(CheckpointExistsError):
            strategy.prepare(path, "f" * 16, overwrite=False)
        assert strategy.is_committed(path) and self._is_checkpoint(st, path)

    def test_overwrite_replaces_a_checkpoint_where_the_strategy_can_and_is_refused_where_not(self, store):
        st, base = store
        strategy, path, staging, m = self._staged(st, base)
        strategy.publish(path, staging, m)
        if not self.overwrites:
            with pytest.raises(CommitError, match="not supported"):
                strategy.prepare(path, "f" * 16, overwrite=True)
            assert self._is_checkpoint(st, path)
            return
        again = strategy.prepare(path, "f" * 16, overwrite=True)
        _copy_save_files(st, path, again)
        strategy.publish(path, again, m, overwrite=True)
        assert self._is_checkpoint(st, path) and st.list_tree(again) == []

    def test_a_failure_before_the_marker_leaves_no_checkpoint(self, store):
        st, base = store
        strategy, path, staging, m = self._staged(st, base)

        def crash(step):
            if step == "manifest_written":
                raise RuntimeError("crash")

        with pytest.raises(RuntimeError):
            strategy.publish(path, staging, m, on_step=crash)
        assert not st.exists(st.join(path, COMMITTED_NAME)) and not self._is_checkpoint(st, path)

    def test_a_live_saves_lease_is_fresh_and_its_leftover_is_judged_by_it(self, store):
        st, base = store
        strategy, path, staging, m = self._staged(st, base, name="step_000000001")
        assert strategy.heartbeat(staging, m.save_id)
        name = staging[len(base.rstrip("/")) + 1:]
        assert strategy.may_be_leftover(name)
        assert strategy.leftover_state(base, name) == "leftover"  # a save's files: its lease decides
        assert abs(strategy.lease_time(staging) - time.time()) < 120
        strategy.publish(path, staging, m)
        strategy.release(staging)
        assert strategy.leftover_state(base, "step_000000001") in ("committed", "keep")
