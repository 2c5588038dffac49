"""Fixtures shared by every test layer: the local S3 server (tests/s3_server.py) and the storage a
checkpoint test runs against, so one test proves a behaviour on a local folder and on an object store."""

import os
import uuid

import pytest


@pytest.fixture(scope="session")
def s3_server():
    """moto's S3 server on a loopback port, started once per test session; its endpoint and dummy credentials
    are put in the environment (as a user would for a real store), so the ranks a test starts inherit them."""
    pytest.importorskip("s3fs", reason="object-storage tests need s3fs (pip install 'torchtitan[test]')")
    pytest.importorskip("moto.server", reason="object-storage tests need moto[server] (pip install 'torchtitan[test]')")
    from tests.s3_server import S3Server, environment

    server = S3Server()
    saved = {k: os.environ.get(k) for k in environment(server.endpoint)}
    os.environ.update(environment(server.endpoint))
    yield server
    server.stop()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


class Store:
    """Where a test's checkpoints live: `root(dump_folder)` is the checkpoint folder, `argv` the options that
    put it there (none locally; --checkpoint.folder s3://<fresh bucket>/checkpoint on the S3 server)."""

    def __init__(self, kind: str, bucket: str | None = None):
        self.kind, self.bucket = kind, bucket
        self.url = f"s3://{bucket}/checkpoint" if bucket else None
        self.argv = ["--checkpoint.folder", self.url] if self.url else []

    def root(self, dump_folder) -> str:
        return self.url or os.path.join(str(dump_folder), "checkpoint")


@pytest.fixture(params=["local", "s3"])
def store(request):
    if request.param == "local":
        return Store("local")
    server = request.getfixturevalue("s3_server")
    from tests.s3_server import make_bucket

    bucket = f"test-{uuid.uuid4().hex[:12]}"
    make_bucket(server.endpoint, bucket)
    return Store("s3", bucket)
