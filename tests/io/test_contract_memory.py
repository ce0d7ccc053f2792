"""The byte store and commit contracts on fsspec's memory filesystem (marker strategy, no network)."""

from __future__ import annotations

import uuid

import pytest

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
