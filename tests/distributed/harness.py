"""Launch real processes (gloo on 127.0.0.1, a free port) running a worker function.

Each rank runs ``python -m tests.distributed.workers JOB RANK WORLD PORT ARGS_JSON`` and
writes its result as JSON to ``<out>/rank_<r>.json``. ``launch`` waits with a timeout,
kills stragglers, and returns every rank's exit code and result.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RankResult:
    rank: int
    returncode: int | None
    result: dict | None
    stderr: str


def launch(job: str, world: int, args: dict, *, out_dir: str, timeout: float = 180.0,
           env: dict | None = None, wait_for: list[int] | None = None,
           module: str = "tests.distributed.workers") -> list[RankResult]:
    """Run ``job`` on ``world`` ranks; wait for ``wait_for`` ranks (default all), kill the rest.
    ``module`` holds the job (``workers`` or a module registering more jobs with ``workers.job``)."""
    port = free_port()
    os.makedirs(out_dir, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", **(env or {}))
    procs = []
    errs = []
    for r in range(world):
        err = open(os.path.join(out_dir, f"rank_{r}.stderr"), "w+")
        errs.append(err)
        procs.append(subprocess.Popen(
            [sys.executable, "-m", module, job, str(r), str(world), str(port),
             json.dumps(dict(args, out_dir=out_dir))],
            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True))
    deadline = time.monotonic() + timeout
    for r, p in enumerate(procs):
        if wait_for is not None and r not in wait_for:
            continue
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
    out = []
    for r, (p, err) in enumerate(zip(procs, errs)):
        err.seek(0)
        path = os.path.join(out_dir, f"rank_{r}.json")
        result = None
        if os.path.exists(path):
            with open(path) as f:
                result = json.load(f)
        out.append(RankResult(r, p.returncode, result, err.read()[-4000:]))
        err.close()
    return out


def check_all_ok(results: list[RankResult]) -> list[dict]:
    bad = [r for r in results if r.returncode != 0 or not r.result or not r.result.get("ok")]
    assert not bad, "\n".join(f"rank {r.rank} rc={r.returncode} result={r.result}\n{r.stderr}" for r in bad)
    return [r.result for r in results]
