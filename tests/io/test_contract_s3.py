"""The byte store and commit contracts on S3 (s3fs against moto's server on loopback)."""

from __future__ import annotations

import uuid

import pytest

from shardfmt.commit.marker import MarkerCommit
from shardfmt.commit.protocol import commit_strategy
from shardfmt.io.fsspec import FsspecStorage
from shardfmt.io.registry import get_storage
from tests import s3_server
from tests.io.contract import ByteStoreContract, CommitContract

pytestmark = pytest.mark.slow  # a moto server and a bucket per test (~7 s CPU); memory:// runs the same contracts fast



@pytest.fixture(scope="module")
def server():
    with s3_server.serving() as srv:
        yield srv


@pytest.fixture
def store(server):
    s3fs = pytest.importorskip("s3fs")  # here, not at collection (1 s of every run)
    name = "c" + uuid.uuid4().hex[:12]
    s3fs.S3FileSystem(endpoint_url=server.endpoint, skip_instance_cache=True).mkdir(name)
    return get_storage(f"s3://{name}/root")


class TestS3ByteStore(ByteStoreContract):
    pass


class TestS3Commit(CommitContract):
    pass


def test_the_contracts_run_on_s3_with_the_marker_strategy(store):
    """The classes above test what this file claims: s3:// is a remote fsspec store, committed by marker."""
    st, _ = store
    assert type(st) is FsspecStorage and st.protocol == "s3" and st.remote
    assert isinstance(commit_strategy(st), MarkerCommit) and commit_strategy(st).in_place
