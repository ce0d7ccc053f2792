"""The loopback S3 server of a scenario with ``@s3`` candidates: tests/s3_server.py (moto in
its own process, 127.0.0.1, a free port), which counts requests and bytes *at the server*.
Workers find it through ``AWS_ENDPOINT_URL`` and test credentials, as tests/test_s3.py does;
DCP's s3fs picks the endpoint up from the same variable."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request

from ..probes import ROOT

SERVER_SCRIPT = os.path.join(ROOT, "tests", "s3_server.py")
CREDS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


class Server:
    """1) start the server and wait for it to answer; 2) ``env()`` for the workers; 3) ``stop()``."""

    def __init__(self, timeout: float = 60.0) -> None:
        self.proc = subprocess.Popen([sys.executable, SERVER_SCRIPT], stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True, cwd=ROOT)
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        if not line.startswith("PORT "):
            self.stop()
            raise RuntimeError(f"the S3 server did not start: {line!r}")
        self.endpoint = f"http://127.0.0.1:{int(line.split()[1])}"
        deadline = time.monotonic() + timeout
        while True:
            try:
                stats(self.endpoint)
                break
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise
                time.sleep(0.05)

    def env(self) -> dict[str, str]:
        return dict(CREDS, AWS_ENDPOINT_URL=self.endpoint)

    def make_bucket(self, bucket: str) -> None:
        _fs(self.endpoint).mkdir(bucket)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)


def _fs(endpoint: str):
    import s3fs

    return s3fs.S3FileSystem(endpoint_url=endpoint, key=CREDS["AWS_ACCESS_KEY_ID"],
                             secret=CREDS["AWS_SECRET_ACCESS_KEY"], skip_instance_cache=True)


def stats(endpoint: str) -> dict:
    with urllib.request.urlopen(endpoint + "/__stats", timeout=30) as r:
        return json.loads(r.read())


def reset_stats(endpoint: str) -> None:
    urllib.request.urlopen(urllib.request.Request(endpoint + "/__stats/reset", method="POST"), timeout=30).read()


def remove(url: str, endpoint: str) -> None:
    """Delete every object under the s3:// prefix ``url`` (nothing there is fine)."""
    fs = _fs(endpoint)
    path = url.removeprefix("s3://")
    if fs.exists(path):
        fs.rm(path, recursive=True)
