"""A local S3 server for the tests (and for trying object storage by hand): moto in server mode on loopback.

    python -m moto.server -H 127.0.0.1 -p 5555      # then: export AWS_ENDPOINT_URL=http://127.0.0.1:5555
                                                    #       AWS_ACCESS_KEY_ID=test AWS_SECRET_ACCESS_KEY=test

`S3Server` runs it as a child process; `ThreadedS3Server` runs it in this process, where it can be stopped and
started again on the same port with its objects kept (moto keeps them in the process), for the store-fault
tests. Credentials are moto's dummy ones, given through the environment as for a real store.
"""

import os
import socket
import subprocess
import sys
import time
import urllib.request

ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
       "AWS_EC2_METADATA_DISABLED": "true"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(endpoint: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(endpoint + "/moto-api/", timeout=2).read()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def environment(endpoint: str) -> dict[str, str]:
    return {**ENV, "AWS_ENDPOINT_URL": endpoint}


def make_bucket(endpoint: str, name: str) -> None:
    import boto3

    boto3.client("s3", endpoint_url=endpoint, **{k.lower(): v for k, v in ENV.items()
                                                 if k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")},
                 region_name=ENV["AWS_DEFAULT_REGION"]).create_bucket(Bucket=name)


class S3Server:
    """moto's server as a child process on a free loopback port."""

    def __init__(self, env: dict[str, str] | None = None):
        """`env`: moto's own settings, e.g. INITIAL_NO_AUTH_ACTION_COUNT=1 (after one request, credentials that
        are not moto IAM users are denied: a store that refuses this job's writes)."""
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     env={**os.environ, **(env or {})})
        try:
            wait_ready(self.endpoint)
        except OSError:
            self.stop()
            raise

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


class ThreadedS3Server:
    """moto's server in a thread of this process; `stop` then `start` again keeps its buckets and objects."""

    def __init__(self):
        import logging

        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.WARNING)  # a line per request otherwise

        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self.start()

        self.running = True

    def reset(self) -> None:
        """Deletes every bucket and object (moto's reset API)."""
        urllib.request.urlopen(urllib.request.Request(self.endpoint + "/moto-api/reset", method="POST")).read()

    def start(self) -> None:
        self.server.start()
        wait_ready(self.endpoint)
        self.running = True

    def stop(self) -> None:
        """Connections are refused from now on (the listening socket is closed), as when a store is down."""
        if self.running:
            self.running = False
            self.server.stop()
            self.server._server.server_close()
