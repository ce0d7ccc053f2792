"""The byte store and commit contracts on local disk (``LocalStorage``, rename strategy)."""

from __future__ import annotations

import pytest

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
