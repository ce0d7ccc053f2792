"""The byte store and commit contracts on S3 (s3fs against moto's server on loopback)."""

from __future__ import annotations

import os
import uuid

import pytest

from shardfmt.io.registry import get_storage
from tests import s3_server
from tests.io.contract import ByteStoreContract, CommitContract

s3fs = pytest.importorskip("s3fs")

CREDS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


@pytest.fixture(scope="module")
def server():
    srv = s3_server.start()
    old = {k: os.environ.get(k) for k in list(CREDS) + ["AWS_ENDPOINT_URL"]}
    os.environ.update(CREDS, AWS_ENDPOINT_URL=srv.endpoint)
    yield srv
    srv.stop()
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture
def store(server):
    name = "c" + uuid.uuid4().hex[:12]
    s3fs.S3FileSystem(endpoint_url=server.endpoint, skip_instance_cache=True).mkdir(name)
    return get_storage(f"s3://{name}/root")


class TestS3ByteStore(ByteStoreContract):
    pass


class TestS3Commit(CommitContract):
    pass
