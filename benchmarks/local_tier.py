"""How long a training loop waits for its saves: the node-local tier against saving straight to S3.

``python benchmarks/local_tier.py --size-mib 256 --rounds 5 --saves 4 --compute 2``

Every round runs, in an order that rotates, three jobs of ``--world`` ranks (real processes,
gloo over 127.0.0.1), each rank its own "node" (a directory of its own under the scratch dir),
the shared tier a prefix on the loopback S3 server (tests/s3_server.py, moto, its own process):

- ``local``: ``Checkpointer(s3_root, local=<scratch>/{node}, replicate=...)``: each save
  lands on the node's disk; the copies to S3 run behind the loop
- ``straight``: ``Checkpointer(s3_root)``: every save written to S3 before ``save`` returns
- ``async``: ``Checkpointer(s3_root)`` with ``save(async_=True)``: the state is snapshotted
  into host buffers and written to S3 behind the loop (a save waits for the previous one)
- ``local-async``: the local tier with ``save(async_=True)``: snapshotted, written to the
  node's disk behind the loop, then copied to S3
- ``floor``: each rank writes the bytes it holds to a file on its node's disk (write, xxh3,
  fsync): the raw write of what the local tier's save writes

Each job does ``--saves`` saves of the same state (DTensor Shard(0) rows of ``--size-mib``
MiB, and a replicated bias every node needs from rank 0's file), ``--compute`` seconds of
"training" (sleep) before each, then waits until every save it copies is on S3 (``drain``).
The figure: the seconds each ``save`` call blocked the loop (every rank, every save), median
and interquartile range over the rounds, and per round the ratio of the local tier's median
to the straight save's (paired). How many of the local tier's saves reached S3 is reported
too (``replicate="skip"`` leaves a save whose turn comes while a copy runs on the disks only).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.harness.launch import free_port  # noqa: E402
from benchmarks.harness.s3 import CREDS, Server  # noqa: E402
from benchmarks.standalone import parser, summary, write_json  # noqa: E402

CANDIDATES = ("local", "local-async", "straight", "async", "floor")


def worker(args: dict) -> dict:
    """One rank of one job."""
    import datetime as dt

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import shardfmt

    rank, world = args["rank"], args["world"]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args['port']}", rank=rank, world_size=world,
                            timeout=dt.timedelta(seconds=600))
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    rows = args["size_mib"] * (1 << 20) // (4 * 4096)
    g = torch.Generator().manual_seed(0)
    m = torch.nn.Module()
    for i in range(4):
        m.register_parameter(f"w{i}", torch.nn.Parameter(distribute_tensor(torch.randn(rows // 4, 4096, generator=g),
                                                                             mesh, [Shard(0)])))
    m.register_buffer("bias", torch.randn(4096, generator=g))
    kind = args["kind"]
    if kind == "floor":
        return _floor(args, [p.to_local() for p in m.parameters()], rank)
    local = kind.startswith("local")
    kw = {"local": args["local"], "node": f"n{rank}", "replicate": args["replicate"]} if local else {}
    ck = shardfmt.Checkpointer(args["root"], keep_last=args["saves"], **kw)
    blocked = []
    for step in range(1, args["saves"] + 1):
        time.sleep(args["compute"])
        dist.barrier()
        t0 = time.perf_counter()
        ck.save(step, {"model": m}, async_=kind.endswith("async"))
        blocked.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    ck.wait()
    drain = time.perf_counter() - t0
    ck.close()
    copied = len([c for c in ck.list() if c.status == "committed"]) if rank == 0 else None
    dist.barrier()
    dist.destroy_process_group()
    return {"blocked": blocked, "drain": drain, "copied": copied}


def _floor(args: dict, tensors: list, rank: int) -> dict:
    """The raw write of this rank's bytes to its node's disk, at each save's point in the loop."""
    import torch.distributed as dist
    import xxhash

    blocked = []
    folder = args["local"].replace("{node}", f"n{rank}")
    os.makedirs(folder, exist_ok=True)
    for step in range(1, args["saves"] + 1):
        time.sleep(args["compute"])
        dist.barrier()
        t0 = time.perf_counter()
        with open(os.path.join(folder, f"floor_{step}.bin"), "wb") as f:
            for t in tensors:
                mv = memoryview(t.detach().numpy()).cast("B")
                xxhash.xxh3_128(mv).digest()
                f.write(mv)
            f.flush()
            os.fsync(f.fileno())
        blocked.append(time.perf_counter() - t0)
    dist.barrier()
    dist.destroy_process_group()
    return {"blocked": blocked, "drain": 0.0, "copied": 0}


def run_job(kind: str, rnd: int, opts, scratch: str, env: dict) -> list[dict]:
    out = os.path.join(scratch, f"r{rnd}-{kind}")
    os.makedirs(out)
    port = free_port()
    procs = []
    for r in range(opts.world):
        a = {"rank": r, "world": opts.world, "port": port, "kind": kind, "size_mib": opts.size_mib,
             "saves": opts.saves, "compute": opts.compute, "replicate": opts.replicate,
             "root": f"s3://bench/r{rnd}-{kind}", "local": os.path.join(out, "{node}"),
             "out": os.path.join(out, f"rank_{r}.json")}
        procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", json.dumps(a)],
                                      cwd=ROOT, env=env))
    for p in procs:
        if p.wait(timeout=1800) != 0:
            raise RuntimeError(f"{kind} round {rnd}: a rank failed (exit {p.returncode})")
    res = []
    for r in range(opts.world):
        with open(os.path.join(out, f"rank_{r}.json")) as f:
            res.append(json.load(f))
    shutil.rmtree(out, ignore_errors=True)
    return res


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        a = json.loads(sys.argv[2])
        res = worker(a)
        with open(a["out"], "w") as f:
            json.dump(res, f)
        return
    p = parser(__doc__, size_mib=256, rounds=5)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--saves", type=int, default=4)
    p.add_argument("--compute", type=float, default=2.0, help="seconds of 'training' before each save")
    p.add_argument("--replicate", default="skip", choices=("skip", "wait"))
    opts = p.parse_args()
    scratch = tempfile.mkdtemp(prefix="shardfmt-local-tier-", dir=opts.dir)
    srv = Server()
    env = dict(os.environ, **CREDS, AWS_ENDPOINT_URL=srv.endpoint, OMP_NUM_THREADS="1",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    import s3fs

    s3fs.S3FileSystem(endpoint_url=srv.endpoint, key=CREDS["AWS_ACCESS_KEY_ID"],
                      secret=CREDS["AWS_SECRET_ACCESS_KEY"]).mkdir("bench")
    per: dict[str, list[dict]] = {k: [] for k in CANDIDATES}
    try:
        for rnd in range(-opts.warmup, opts.rounds):
            k = rnd % len(CANDIDATES)
            order = CANDIDATES[k:] + CANDIDATES[:k]
            for kind in order:
                res = run_job(kind, rnd, opts, scratch, env)
                blocked = [b for r in res for b in r["blocked"]]
                row = {"round": rnd, "blocked_median": statistics.median(blocked), "blocked": blocked,
                       "drain": max(r["drain"] for r in res), "copied": res[0]["copied"]}
                print(f"round {rnd} {kind:8s} blocked median {row['blocked_median']:.3f} s, drain "
                      f"{row['drain']:.2f} s, {row['copied']} of {opts.saves} saves on S3", flush=True)
                if rnd >= 0:
                    per[kind].append(row)
    finally:
        srv.stop()
        shutil.rmtree(scratch, ignore_errors=True)
    out = {"options": vars(opts), "candidates": {}}
    for kind, rows in per.items():
        out["candidates"][kind] = {"blocked": summary([r["blocked_median"] for r in rows]),
                                   "drain": summary([r["drain"] for r in rows]),
                                   "copied": [r["copied"] for r in rows], "rounds": rows}
    pairs = (("local", "straight"), ("local", "floor"), ("local-async", "straight"), ("local-async", "async"))
    for one, other in pairs:
        ratios = [a["blocked_median"] / b["blocked_median"] for a, b in zip(per[one], per[other])]
        out[f"{one}/{other}"] = summary(ratios)
    for kind in CANDIDATES:
        s = out["candidates"][kind]["blocked"]
        print(f"{kind:8s} blocked per save: median {s['median']:.3f} s [{s['q1']:.3f}, {s['q3']:.3f}]; "
              f"saves on S3 per job: {out['candidates'][kind]['copied']}")
    for one, other in pairs:
        s = out[f"{one}/{other}"]
        print(f"{one} / {other} (paired per round): {s['median']:.3f} [{s['q1']:.3f}, {s['q3']:.3f}]")
    write_json(opts.json, out)


if __name__ == "__main__":
    main()
