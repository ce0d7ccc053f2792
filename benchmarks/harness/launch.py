"""Run a job on ``world`` processes, one per rank, and collect every rank's records."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

from ..probes import ROOT


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(job: dict, world: int, out_dir: str, *, timeout: float, env: dict | None = None) -> list[dict]:
    """Run ``job`` (JSON-able) on ``world`` ranks; return their records.

    1) the job goes to ``out_dir/job.json`` with a free port for gloo; every rank runs
    ``python -m benchmarks.harness.worker job.json RANK`` in its own session with this
    checkout first on PYTHONPATH (rank 0's stdout is ours: progress; stderr goes to
    ``out_dir/rank_<r>.stderr``); 2) each writes ``out_dir/rank_<r>.json``; 3) past
    ``timeout`` seconds the survivors are killed. Raises RuntimeError naming every failed rank.
    Each rank gets ``LOCAL_RANK``/``LOCAL_WORLD_SIZE`` as torchrun sets them (one node): the
    library sizes its writer threads and its I/O probe (``shardfmt.io.probe``) from them.
    """
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "job.json")
    with open(path, "w") as f:
        json.dump(dict(job, world=world, port=free_port(), out_dir=out_dir), f)
    penv = dict(os.environ, **(env or {}))
    penv["PYTHONPATH"] = ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")
    procs = []
    for r in range(world):
        err = open(os.path.join(out_dir, f"rank_{r}.stderr"), "w")
        procs.append((subprocess.Popen([sys.executable, "-m", "benchmarks.harness.worker", path, str(r)], cwd=ROOT,
                                       env=dict(penv, LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(world)), stdout=None if r == 0 else subprocess.DEVNULL, stderr=err,
                                       start_new_session=True), err))
    deadline = time.monotonic() + timeout
    for p, _ in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for p, err in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
        err.close()
    return _collect(procs, out_dir)


def _collect(procs, out_dir: str) -> list[dict]:
    records, bad = [], []
    for r, (p, _) in enumerate(procs):
        path = os.path.join(out_dir, f"rank_{r}.json")
        res = None
        if os.path.exists(path):
            with open(path) as f:
                res = json.load(f)
        if res is None or not res.get("ok"):
            with open(os.path.join(out_dir, f"rank_{r}.stderr")) as f:
                tail = f.read()[-3000:]
            bad.append(f"rank {r} rc={p.returncode}: {res.get('error') if res else 'no result'}\n{tail}")
        if res:
            records.extend(res["records"])
    if bad:
        raise RuntimeError(f"a job on {len(procs)} ranks failed:\n" + "\n".join(bad))
    return records
