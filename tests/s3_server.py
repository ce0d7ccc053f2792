"""A loopback S3 server for tests and benchmarks: moto's server app in its own process.

Run as a script (``python tests/s3_server.py [--auth]``) it binds 127.0.0.1 on a free port,
prints ``PORT <n>`` and serves until killed. Around moto's WSGI app sits a thin middleware
that counts what clients ask for, so tests and benchmarks can assert requests and bytes at
the server — the only place every client's traffic meets:

- ``GET /__stats``: JSON ``{"requests", "bytes_in", "bytes_out", "by_method"}``.
- ``POST /__stats/reset``: zero the counters.
- ``POST /__fail?method=PUT&after=N&count=K&status=500``: the (N+1)-th to (N+K)-th requests
  with that method get ``status`` instead of reaching moto (a 5xx in the middle of a save);
  ``POST /__fail/clear`` removes every fault.

``--auth`` starts moto with authentication enforced (``INITIAL_NO_AUTH_ACTION_COUNT=0``) so
unknown credentials are refused, as on real S3. ``start()`` is the importable launcher.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass


class _Counting:
    def __init__(self, app) -> None:
        self.app = app
        self.lock = threading.Lock()
        self.reset()
        self.faults: list[dict] = []

    def reset(self) -> None:
        with self.lock:
            self.requests = 0
            self.bytes_in = 0
            self.bytes_out = 0
            self.by_method: dict[str, int] = {}

    def _control(self, environ, start_response):
        path = environ.get("PATH_INFO", "")
        if path == "/__stats" and environ["REQUEST_METHOD"] == "GET":
            with self.lock:
                body = json.dumps({"requests": self.requests, "bytes_in": self.bytes_in,
                                   "bytes_out": self.bytes_out, "by_method": self.by_method}).encode()
        elif path == "/__stats/reset":
            self.reset()
            body = b"{}"
        elif path == "/__fail/clear":
            with self.lock:
                self.faults.clear()
            body = b"{}"
        elif path == "/__fail":
            from urllib.parse import parse_qs

            q = {k: v[0] for k, v in parse_qs(environ.get("QUERY_STRING", "")).items()}
            with self.lock:
                self.faults.append({"method": q.get("method", "PUT"), "after": int(q.get("after", 0)),
                                    "count": int(q.get("count", 1 << 30)), "status": int(q.get("status", 500))})
            body = b"{}"
        else:
            return None
        start_response("200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
        return [body]

    def _fault(self, method: str) -> int | None:
        with self.lock:
            for f in self.faults:
                if f["method"] != method:
                    continue
                if f["after"] > 0:
                    f["after"] -= 1
                    return None
                if f["count"] > 0:
                    f["count"] -= 1
                    return f["status"]
        return None

    def __call__(self, environ, start_response):
        if environ.get("PATH_INFO", "").startswith("/__"):
            out = self._control(environ, start_response)
            if out is not None:
                return out
        method = environ["REQUEST_METHOD"]
        n_in = int(environ.get("CONTENT_LENGTH") or 0)
        with self.lock:
            self.requests += 1
            self.bytes_in += n_in
            self.by_method[method] = self.by_method.get(method, 0) + 1
        status = self._fault(method)
        if status is not None:
            environ["wsgi.input"].read(n_in)
            body = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>InternalError</Code>'
                    b"<Message>injected failure</Message></Error>")
            start_response(f"{status} Injected", [("Content-Type", "application/xml"),
                                                  ("Content-Length", str(len(body)))])
            return [body]
        out = self.app(environ, start_response)
        counted = []
        for piece in out:
            counted.append(piece)
            with self.lock:
                self.bytes_out += len(piece)
        if hasattr(out, "close"):
            out.close()
        return counted


def serve(auth: bool) -> None:
    if auth:
        os.environ["INITIAL_NO_AUTH_ACTION_COUNT"] = "0"
    from moto.server import DomainDispatcherApplication, create_backend_app
    from werkzeug.serving import make_server

    parent = os.getppid()

    def orphaned() -> None:  # never outlive the test run or benchmark that started us
        while os.getppid() == parent:
            time.sleep(1)
        os._exit(0)

    threading.Thread(target=orphaned, daemon=True).start()
    app = _Counting(DomainDispatcherApplication(create_backend_app))
    server = make_server("127.0.0.1", 0, app, threaded=True)
    print(f"PORT {server.server_address[1]}", flush=True)
    server.serve_forever()


@dataclass
class Server:
    """A running server process: its endpoint, and its counters."""

    proc: subprocess.Popen
    endpoint: str

    def stats(self) -> dict:
        with urllib.request.urlopen(self.endpoint + "/__stats", timeout=10) as r:
            return json.loads(r.read())

    def reset_stats(self) -> None:
        urllib.request.urlopen(urllib.request.Request(self.endpoint + "/__stats/reset", method="POST"),
                               timeout=10).read()

    def fail(self, method: str, *, after: int = 0, count: int = 1 << 30, status: int = 500) -> None:
        url = f"{self.endpoint}/__fail?method={method}&after={after}&count={count}&status={status}"
        urllib.request.urlopen(urllib.request.Request(url, method="POST"), timeout=10).read()

    def clear_faults(self) -> None:
        urllib.request.urlopen(urllib.request.Request(self.endpoint + "/__fail/clear", method="POST"),
                               timeout=10).read()

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=10)


def start(*, auth: bool = False, timeout: float = 60.0) -> Server:
    """Start a server process and wait until it answers."""
    env = dict(os.environ)
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__)] + (["--auth"] if auth else []),
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, text=True)
    deadline = time.monotonic() + timeout
    line = proc.stdout.readline() if proc.stdout else ""
    if not line.startswith("PORT "):
        proc.kill()
        raise RuntimeError(f"moto server did not start: {line!r}")
    srv = Server(proc, f"http://127.0.0.1:{int(line.split()[1])}")
    while True:
        try:
            srv.stats()
            return srv
        except OSError:
            if time.monotonic() > deadline:
                srv.stop()
                raise
            time.sleep(0.05)



CREDS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


@contextlib.contextmanager
def serving():
    """Start a server and point the AWS environment (credentials, endpoint) at it until exit."""
    srv = start()
    old = {k: os.environ.get(k) for k in list(CREDS) + ["AWS_ENDPOINT_URL"]}
    os.environ.update(CREDS, AWS_ENDPOINT_URL=srv.endpoint)
    try:
        yield srv
    finally:
        srv.stop()
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


if __name__ == "__main__":
    serve(auth="--auth" in sys.argv[1:])
