"""Replicated bytes read once (``shardfmt.loading.shared``): who shares with whom, who reads
what, and a 2-rank gloo load on local disk with sharing forced on (the S3 cases, counted at
the server, are in test_s3.py)."""

from __future__ import annotations

import pytest

import shardfmt
from shardfmt.layout.geometry import ByteRange
from shardfmt.loading.planner import LoadPlan, PhysicalRead
from shardfmt.loading.shared import owners, read_groups, reads_key
from tests.distributed.harness import check_all_ok, launch


def _plan(*ranges, verify=True) -> LoadPlan:
    return LoadPlan(reads=tuple(PhysicalRead(file=f, byte_range=ByteRange(s, e), items=()) for f, s, e in ranges),
                    needed_bytes=0, verify=verify)


def test_the_key_follows_the_byte_ranges_the_checkpoint_and_verification():
    a = _plan(("data/r0", 8, 4096), ("data/r1", 8, 100))
    assert reads_key(a, "s1") == reads_key(_plan(("data/r0", 8, 4096), ("data/r1", 8, 100)), "s1")
    others = [_plan(("data/r0", 8, 4096), ("data/r1", 8, 101)), _plan(("data/r0", 8, 4096)),
              _plan(("data/r0", 8, 4096), ("data/r1", 8, 100), verify=False)]
    keys = {reads_key(a, "s1"), reads_key(a, "s2"), *(reads_key(p, "s1") for p in others)}
    assert len(keys) == 5


def test_read_groups_are_ranks_with_equal_keys_two_or_more_and_never_a_rank_that_does_not_share():
    assert read_groups([b"a", b"b", b"a", None, b"b", b"c", None]) == [(0, 2), (1, 4)]
    assert read_groups([None, None]) == [] and read_groups([b"x"]) == []


@pytest.mark.parametrize("lengths,members", [([100] * 8, 4), ([64, 32, 16, 8, 4, 2, 1, 1], 3), ([5], 4), ([], 2)])
def test_owners_spread_the_bytes_largest_first_to_the_least_loaded(lengths, members):
    got = owners(lengths, members)
    assert len(got) == len(lengths) and all(0 <= o < members for o in got)
    load = [sum(n for n, o in zip(lengths, got) if o == m) for m in range(members)]
    assert max(load, default=0) - min(load, default=0) <= max(lengths, default=0)
    assert got == owners(lengths, members)  # every member derives the same answer


def test_two_ranks_forced_to_share_on_local_disk_read_each_byte_once(tmp_path):
    from tests.distributed.workers import shared_state

    path = str(tmp_path / "ck")
    state = shared_state()
    shardfmt.save(state, path)
    size = sum(t.numel() * t.element_size() for t in state.values())
    runs = {}
    for share in (True, False):
        res = check_all_ok(launch("shared_load", 2, {"path": path, "layout": "full", "share_reads": share},
                                  out_dir=str(tmp_path / f"o{share}"), timeout=120))
        assert all(r["equal"] == sorted(state) for r in res), res
        runs[share] = sum(r["bytes_read"] for r in res)
    assert size <= runs[True] <= 1.01 * size  # one rank read it all, the other nothing
    assert runs[False] >= 2 * size


def test_a_rank_that_gives_the_load_up_lets_the_others_read_alone(tmp_path):
    """Rank 1 failed before loading (``skip_load``): ranks 0 and 2 load in full, each reading
    its own bytes, and nobody waits."""
    from tests.distributed.workers import shared_state

    path = str(tmp_path / "ck")
    state = shared_state()
    shardfmt.save(state, path)
    size = sum(t.numel() * t.element_size() for t in state.values())
    res = check_all_ok(launch("shared_load", 3, {"path": path, "layout": "full", "share_reads": True, "skip_rank": 1},
                              out_dir=str(tmp_path / "o"), timeout=120))
    assert res[1]["skipped"] and all(res[r]["equal"] == sorted(state) for r in (0, 2)), res
    assert all(res[r]["bytes_read"] >= size for r in (0, 2))


def test_a_load_on_a_sub_group_shares_among_its_ranks_without_the_others(tmp_path):
    """Ranks 0 and 1 of 3 load on their own process group, rank 2 never calls load: the two
    share their reads (one copy in all) and nobody waits for rank 2. (Rank 0 hosts the job's
    store, so it is the one that stays.)"""
    from tests.distributed.workers import shared_state

    path = str(tmp_path / "ck")
    state = shared_state()
    shardfmt.save(state, path)
    size = sum(t.numel() * t.element_size() for t in state.values())
    res = check_all_ok(launch("shared_load", 3, {"path": path, "layout": "full", "share_reads": True,
                                                 "sub_group": [0, 1]}, out_dir=str(tmp_path / "o"), timeout=120))
    assert res[2]["outside"] and all(res[r]["equal"] == sorted(state) for r in (0, 1)), res
    assert size <= res[0]["bytes_read"] + res[1]["bytes_read"] <= 1.01 * size
