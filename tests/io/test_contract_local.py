"""The byte store and commit contracts on local disk (``LocalStorage``, rename strategy)."""

from __future__ import annotations

import pytest

from shardfmt.commit.protocol import commit_strategy
from shardfmt.commit.rename import RenameCommit
from shardfmt.io.local import LocalStorage
from shardfmt.io.registry import get_storage
from tests.io.contract import ByteStoreContract, CommitContract


@pytest.fixture
def store(tmp_path):
    return get_storage(str(tmp_path / "root"))[0], str(tmp_path / "root")


@pytest.fixture(autouse=True)
def _root(tmp_path):
    (tmp_path / "root").mkdir()


class TestLocalByteStore(ByteStoreContract):
    links = True


class TestLocalCommit(CommitContract):
    overwrites = True


def test_the_contracts_run_on_local_disk_with_the_rename_strategy(store):
    """The classes above test what this file claims: a path is local disk, committed by rename."""
    st, _ = store
    assert type(st) is LocalStorage and not st.remote
    assert isinstance(commit_strategy(st), RenameCommit) and not commit_strategy(st).in_place
