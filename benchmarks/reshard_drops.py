"""What dropping a load's pages from the page cache costs a dim-0 2 -> 4 reshard (issue 22).

    python benchmarks/reshard_drops.py setup DIR [--tensors 16]
    python benchmarks/reshard_drops.py run DIR [--rounds 9] [--json OUT]

``setup``: 2 gloo ranks save ``--tensors`` 4096 x 4096 f32 tensors (64 MiB each) as DTensor
Shard(0). ``run``: 4 gloo ranks load them, each a quarter of the rows: two ranks read alternate
16 MiB runs of each file. Every round runs each candidate once, the order rotating, from a cold
page cache (every rank fsyncs and drops every file first, then 0.3 s idle); a candidate's time
is barrier to barrier; medians and IQRs over the rounds after a warm-up, and the job's CPU time.

Candidates:
- ``floor``: each rank ``preadv``s exactly the byte ranges shardfmt's load reads, from the same
  files, in 8 MiB pieces, and hashes each 1 MiB chunk (xxh3-128); drops nothing.
- ``shardfmt``: ``shardfmt.load`` as released (its pages dropped together when the reads end).
- ``shardfmt@drop-each``: each read's pages dropped as soon as it is done (the release before).
- ``shardfmt@keep``: nothing dropped (what the page-cache hygiene costs, by difference).
The first round's values are checked against the saved ones for every candidate.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import struct
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import xxhash

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.harness.launch import free_port  # noqa: E402
from benchmarks.probes import drop_cache  # noqa: E402

ROWS = COLS = 4096
PIECE, CHUNK = 8 << 20, 1 << 20
CANDIDATES = ("floor", "shardfmt", "shardfmt@drop-each", "shardfmt@keep")


def _init(rank: int, world: int, port: int):
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    return init_device_mesh("cpu", (world,))


def _tensor(i: int) -> torch.Tensor:
    return torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(i))


def _setup_rank(rank: int, port: int, d: str, n: int) -> None:
    from torch.distributed.tensor import Shard, distribute_tensor

    import shardfmt

    mesh = _init(rank, 2, port)
    shardfmt.save({f"w{i:02d}": distribute_tensor(_tensor(i), mesh, [Shard(0)]) for i in range(n)}, d)
    dist.destroy_process_group()


def _ranges(rank: int, world: int, d: str) -> list[tuple[str, int, str, int]]:
    """(file, offset, tensor, length): the bytes of rank ``rank``'s rows in the 2-rank save."""
    row = COLS * 4
    lo, hi = rank * ROWS // world, (rank + 1) * ROWS // world
    out = []
    for q in range(2):
        slo, shi = max(lo, q * ROWS // 2), min(hi, (q + 1) * ROWS // 2)
        if shi <= slo:
            continue
        path = os.path.join(d, "data", f"rank_{q:05d}.safetensors")
        with open(path, "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            header = json.loads(f.read(n))
        for name, entry in sorted(header.items()):
            if name != "__metadata__":
                out.append((path, 8 + n + entry["data_offsets"][0] + (slo - q * ROWS // 2) * row, name,
                            (shi - slo) * row))
    return out


def _floor(ranges, local: dict[str, torch.Tensor]) -> None:
    fds: dict[str, int] = {}
    try:
        for path, offset, name, length in ranges:
            fd = fds.get(path) or fds.setdefault(path, os.open(path, os.O_RDONLY))
            mv = memoryview(local[name].numpy()).cast("B")[:length]
            for pos in range(0, length, PIECE):
                piece = mv[pos:pos + PIECE]
                got = 0
                while got < len(piece):
                    got += os.preadv(fd, [piece[got:]], offset + pos + got)
                for c in range(0, len(piece), CHUNK):
                    xxhash.xxh3_128(piece[c:c + CHUNK]).digest()
    finally:
        for fd in fds.values():
            os.close(fd)


def _shardfmt(name: str, sd, d: str) -> None:
    import shardfmt
    from shardfmt.loading import pagecache

    add = pagecache.Drops.add
    if name.endswith("@drop-each"):
        pagecache.Drops.add = lambda self, read: pagecache.release_read(self._readers.get(read.file), read)
    elif name.endswith("@keep"):
        pagecache.Drops.add = lambda self, read: None
    try:
        shardfmt.load(sd, d)
    finally:
        pagecache.Drops.add = add


def _run_rank(rank: int, world: int, port: int, d: str, rounds: int, out: str) -> None:
    from torch.distributed.tensor import DTensor, Shard

    mesh = _init(rank, world, port)
    n = len([k for k in json.loads(open(os.path.join(d, "manifest.json")).read())["tensors"]])
    sd = {f"w{i:02d}": DTensor.from_local(torch.empty(ROWS // world, COLS), mesh, [Shard(0)]) for i in range(n)}
    local = {k: v.to_local() for k, v in sd.items()}
    ranges = _ranges(rank, world, d)
    records = []
    for rnd in range(rounds + 1):
        k = rnd % len(CANDIDATES)
        for cand in CANDIDATES[k:] + CANDIDATES[:k]:
            for t in local.values():
                t.fill_(float("nan"))
            drop_cache(d)
            time.sleep(0.3)
            dist.barrier()
            c0, t0 = os.times(), time.perf_counter()
            _floor(ranges, local) if cand == "floor" else _shardfmt(cand, sd, d)
            c1 = os.times()
            dist.barrier()
            seconds = time.perf_counter() - t0
            if rnd == 0:
                for i, name in enumerate(sorted(local)):
                    want = _tensor(i)[rank * ROWS // world:(rank + 1) * ROWS // world]
                    if not torch.equal(local[name], want):
                        raise AssertionError(f"{cand}: {name} differs from the saved values")
            records.append({"round": rnd, "candidate": cand, "rank": rank, "seconds": seconds,
                            "cpu": c1.user - c0.user + c1.system - c0.system, "sys": c1.system - c0.system})
    gathered = [None] * world
    dist.all_gather_object(gathered, records)
    if rank == 0:
        with open(out, "w") as f:
            json.dump([r for rs in gathered for r in rs], f, indent=1)
    dist.destroy_process_group()


def _summary(path: str) -> None:
    records = json.load(open(path))
    rounds = sorted({r["round"] for r in records if r["round"] > 0})
    for cand in CANDIDATES:
        secs = [next(r["seconds"] for r in records if r["candidate"] == cand and r["round"] == k and r["rank"] == 0)
                for k in rounds]
        cpu = statistics.median(sum(r["cpu"] for r in records if r["candidate"] == cand and r["round"] == k)
                                for k in rounds)
        q = statistics.quantiles(secs, n=4) if len(secs) > 1 else secs * 3
        print(f"{cand:<20} {statistics.median(secs):.3f} s [{q[0]:.3f}, {q[2]:.3f}]   job CPU {cpu:.2f} s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("command", choices=("setup", "run"))
    p.add_argument("dir")
    p.add_argument("--tensors", type=int, default=16)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--json", default="reshard_drops.json")
    a = p.parse_args()
    if a.command == "setup":
        mp.spawn(_setup_rank, args=(free_port(), a.dir, a.tensors), nprocs=2)
    else:
        mp.spawn(_run_rank, args=(4, free_port(), a.dir, a.rounds, a.json), nprocs=4)
        print(f"4 ranks loading a 2-rank save, {a.rounds} rounds after a warm-up; median [IQR], barrier to barrier")
        _summary(a.json)


if __name__ == "__main__":
    main()
