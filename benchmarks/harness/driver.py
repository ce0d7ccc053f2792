"""The run of one scenario: plan, scratch, (S3 server), jobs, report.

1) plan the jobs (``plan.plan_jobs``); 2) make a scratch directory (checkpoints and logs);
3) start the loopback S3 server when a candidate stores on S3; 4) launch the jobs in order
(a job's checkpoints are read by later ones); 5) remove the scratch, build the report
(``report.build``), print it and write the JSON. Exit status: 0 no target failed (an overlap
is no failure), 1 a target failed, 2 the run failed.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import uuid

from .. import candidates, probes, states
from . import report
from .launch import launch
from .model import Scenario
from .plan import Options, plan_jobs


def scratch_parent() -> str:
    """A temp directory on a real disk (a tmpfs would make fsync and cold reads meaningless)."""
    tmp = tempfile.gettempdir()
    if probes.fs_type(tmp) not in ("tmpfs", "ramfs"):
        return tmp
    return os.path.dirname(probes.ROOT)


MEASURED = ("shardfmt", "reshard", "benchmarks", ":(exclude)benchmarks/results", ":(exclude)*.md")


def git_commit() -> str:
    """The last commit that changed the code measured or the harness measuring it (``MEASURED``:
    not the figures or the prose), '+dirty' if they changed since."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=probes.ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()

    try:
        dirty = git("status", "--porcelain", "--", *MEASURED)
        return git("log", "-1", "--format=%h", "--", *MEASURED) + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "?"


def _meta(sc: Scenario, opts: Options, specs, scratch: str, env_rec: dict | None) -> dict:
    import torch

    import shardfmt

    dev = env_rec["device_name"] if env_rec else "?"
    return {"scenario": sc.name, "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "commit": git_commit(), "argv": sys.argv[1:], "size_mib": opts.size_mib,
            "state_bytes": states.spec_bytes(specs), "tensors": len(specs), "ranks": opts.ranks or sc.ranks,
            "rounds": opts.rounds, "warmup": opts.warmup, "device": opts.device, "device_name": dev,
            "fsync": opts.fsync, "settle": opts.settle, "scratch_fs": probes.fs_type(scratch), "cpus": os.cpu_count(),
            "python": platform.python_version(), "torch": torch.__version__, "shardfmt": shardfmt.__version__}


def _headline(m: dict) -> str:
    io = "; ".join(f"{d['processes']} process(es): write {d['write']['mode']}, read {d['read']['mode']}"
                   for d in m.get("io_modes", []))
    return (f"{m['scenario']}: {m['state_bytes'] / 1e9:.3f} GB in {m['tensors']} tensors, {m['ranks']} rank(s) on "
            f"{m['device']} ({m['device_name']}, {m['cpus']} CPUs), fsync {'on' if m['fsync'] else 'off'}, scratch "
            f"{m['scratch_fs']}; {m['date']}, shardfmt/reshard of commit {m['commit']}, torch {m['torch']}"
            + (f"\nI/O modes the default measured ({io})" if io else ""))


IO_MODES_ENV = "SHARDFMT_IO_MODES"


def _io_modes_path(scratch: str) -> str:
    return os.path.join(scratch, "io-modes.json")


def _io_modes(scratch: str) -> list[dict]:
    """What the run's default I/O chose on each device, for each number of processes (the
    cache document ``shardfmt.io.choice`` kept in the scratch directory)."""
    from shardfmt.io import modes

    try:
        with open(os.environ.get(IO_MODES_ENV) or _io_modes_path(scratch), "rb") as f:
            found = modes.decode(f.read(modes.MAX_DOCUMENT))
    except OSError:
        return []
    entries = (modes.entry(m) for m in sorted(found.values(), key=lambda m: m.device.key))
    return [{"processes": e["processes"], "fstype": e["fstype"], **e["choices"]} for e in entries]


def _run_jobs(sc: Scenario, opts: Options, scratch: str, timeout: float) -> list[dict]:
    base = os.path.join(scratch, "ckpt")
    os.makedirs(base)
    common = {"scenario": sc.name, "size_mib": opts.size_mib, "device": opts.device, "fsync": opts.fsync,
              "settle": opts.settle, "base": base, "pg_timeout": max(900.0, timeout / 2)}
    server = None
    if any(candidates.get(n).storage == "s3" for p in sc.phases for n in p.candidates):
        from .s3 import Server

        server = Server()
        bucket = "bench-" + uuid.uuid4().hex[:10]
        server.make_bucket(bucket)
        common.update(s3_endpoint=server.endpoint, s3_base=f"s3://{bucket}/ck")
        print(f"S3 server {server.endpoint}, bucket {bucket}", flush=True)
    records: list[dict] = []
    env = dict(server.env()) if server else {}
    # each run measures its devices' I/O modes afresh (in a warm-up: the first save or load) unless told where
    env.setdefault(IO_MODES_ENV, os.environ.get(IO_MODES_ENV) or _io_modes_path(scratch))
    try:
        for k, job in enumerate(plan_jobs(sc, opts)):
            body = dict(common, phases=[p.to_json() for p in job.phases])
            records += launch(body, job.world, os.path.join(scratch, "logs", f"job{k}"), timeout=timeout, env=env)
    finally:
        if server is not None:
            server.stop()
    return records


def run(sc: Scenario, opts: Options, *, json_out: str | None, scratch_dir: str | None, spread: str,
        timeout: float) -> int:
    specs = states.build_specs(sc.state.builder, opts.size_mib, replicated=sc.state.replicated)
    scratch = tempfile.mkdtemp(prefix="shardfmt-bench-", dir=scratch_dir or scratch_parent())
    print(f"{sc.name}: {len(specs)} tensors, {states.spec_bytes(specs) / 1e9:.3f} GB; {opts.rounds} rounds "
          f"(+{opts.warmup} warm-up); scratch {scratch} ({probes.fs_type(scratch)}, "
          f"{shutil.disk_usage(scratch).free / 1e9:.0f} GB free)", flush=True)
    code0, load0, t0 = probes.code_fingerprint(), os.getloadavg(), time.perf_counter()
    try:
        records = _run_jobs(sc, opts, scratch, timeout)
    except RuntimeError as e:
        print(f"\nFAILED: {e}\n(logs kept in {os.path.join(scratch, 'logs')})", file=sys.stderr)
        return 2
    finally:  # the checkpoints go whatever happens (an interrupted run too); the logs of a failed one stay
        probes.remove(os.path.join(scratch, "ckpt"))
    meta = _meta(sc, opts, specs, scratch, next((r for r in records if r.get("kind") == "env"), None))
    meta["io_modes"] = _io_modes(scratch)
    shutil.rmtree(scratch, ignore_errors=True)
    meta.update(wall_s=time.perf_counter() - t0, load_avg_before=load0, load_avg_after=os.getloadavg(),
                code_before=code0, code_after=probes.code_fingerprint())
    meta["headline"] = _headline(meta)
    body = report.build(sc, records, spread=spread)
    if json_out:
        with open(json_out, "w") as f:
            json.dump({"meta": meta, **body, "records": records}, f, indent=1)
    print("\n" + report.text(meta, body))
    print(f"\nwall {meta['wall_s']:.0f}s; load average (1/5/15 min) before "
          f"{'/'.join(f'{x:.2f}' for x in load0)}, after {'/'.join(f'{x:.2f}' for x in meta['load_avg_after'])}"
          " (a shared machine: a high value means noisy figures)")
    if meta["code_after"] != code0:
        print(f"WARNING: shardfmt/reshard sources changed during the run ({code0} -> {meta['code_after']})")
    if json_out:
        print(f"wrote {json_out}")
    return 1 if any(v["verdict"] == "fail" for v in body["targets"]) else 0
