"""The byte store and commit contracts on fsspec's memory filesystem (marker strategy, no network)."""

from __future__ import annotations

import uuid

import pytest

from shardfmt.commit.marker import MarkerCommit
from shardfmt.commit.protocol import commit_strategy
from shardfmt.io.fsspec import FsspecStorage
from shardfmt.io.registry import get_storage
from tests.io.contract import ByteStoreContract, CommitContract


@pytest.fixture
def store():
    st, base = get_storage(f"memory://contract-{uuid.uuid4().hex[:12]}/root")
    st.makedirs(base)
    yield st, base
    st.remove_tree(base)


class TestMemoryByteStore(ByteStoreContract):
    pass


class TestMemoryCommit(CommitContract):
    pass


def test_the_contracts_run_on_fsspec_memory_with_the_marker_strategy(store):
    """The classes above test what this file claims: memory:// is an fsspec store, committed by marker."""
    st, _ = store
    assert type(st) is FsspecStorage and st.protocol == "memory" and not st.remote
    assert isinstance(commit_strategy(st), MarkerCommit) and commit_strategy(st).in_place
