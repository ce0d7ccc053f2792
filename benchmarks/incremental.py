#!/usr/bin/env python
"""Incremental checkpoints (issue 19, part 1): a frozen base plus a small trainable part.

    python benchmarks/incremental.py --size-mib 768 --rounds 5 --json out.json

One process. Every round times, in an order that rotates from round to round:

- ``full``: ``shardfmt.save`` of the state into a fresh directory;
- ``incremental``: ``shardfmt.save(..., base=...)`` of the state onto a base saved (untimed)
  just before, the trainable part changed in between (what a fine-tune's next save is);
- ``floor.write``: the raw write (+ xxh3 of every chunk, + fsync) of the state's bytes;
- ``dcp.save``: ``torch.distributed.checkpoint.save`` (FileSystemWriter) of the same state;

and then loads, each from a cold page cache (fsync + POSIX_FADV_DONTNEED of every file of
both checkpoints): the full checkpoint, and the incremental one (its bytes in two
checkpoints). Reported: medians and interquartile ranges over the rounds, the bytes each save
wrote (every file under its directory) and each load read (``LoadReport.bytes_read``), and
the targets: incremental bytes <= 10% and time <= 20% of a full save's (judged on the
rounds' paired ratios: their interquartile range must lie below the bound), and a restore of
the incremental checkpoint needing the same bytes as a restore of the full one and reading no
more, but for the block padding of the extra reads its base's file takes (direct reads fetch
whole 4 KiB blocks; the base's file holds the replaced shards between the ones taken).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

import shardfmt  # noqa: E402
from benchmarks import floors, probes  # noqa: E402
from benchmarks.standalone import parser, summary, write_json  # noqa: E402

TRAINABLE_FRACTION = 0.01  # LoRA-sized: 1% of the state's bytes change between saves


def build(size_mib: int, layers: int = 12) -> dict[str, torch.Tensor]:
    """A frozen transformer-like base (4 square matrices a layer, f32) and a LoRA pair per matrix."""
    per = size_mib * (1 << 20) // (layers * 4 * 4)  # f32 elements of one matrix
    d = int(per ** 0.5)
    r = max(1, int(TRAINABLE_FRACTION * d / 2))  # A (r x d) and B (d x r): 2 r d = 1% of d^2
    g = torch.Generator().manual_seed(0)
    sd = {}
    for i in range(layers):
        for m in ("q", "k", "v", "o"):
            sd[f"layers.{i}.{m}.weight"] = torch.randn(d, d, generator=g)
            sd[f"layers.{i}.{m}.lora_a"] = torch.randn(r, d, generator=g)
            sd[f"layers.{i}.{m}.lora_b"] = torch.zeros(d, r)
    return sd


def train_step(sd: dict[str, torch.Tensor], k: int) -> None:
    for name, t in sd.items():
        if "lora" in name:
            t.add_(0.01 * (k + 1))


def written(path: str) -> int:
    return sum(os.path.getsize(f) for f in probes.files_under(path))


def timed(fn) -> float:
    os.sync()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def dcp_save(sd: dict, path: str) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save(sd, storage_writer=dcp.FileSystemWriter(path))


def one_round(sd: dict, work: str, k: int, order: list[str]) -> dict:
    rec: dict[str, float] = {}
    inc_root = os.path.join(work, f"inc{k}")
    os.makedirs(inc_root)
    base, top = os.path.join(inc_root, "step_1"), os.path.join(inc_root, "step_2")
    full = os.path.join(work, f"full{k}", "step_2")
    shardfmt.save(sd, base)  # untimed: the previous checkpoint
    train_step(sd, k)
    calls = {
        "full": lambda: shardfmt.save(sd, full),
        "incremental": lambda: shardfmt.save(sd, top, base=base),
        "floor.write": lambda: floors.write_floor(os.path.join(work, f"floor{k}"), list(sd.values()),
                                                  hashed=True, fsync=True),
        "dcp.save": lambda: dcp_save(sd, os.path.join(work, f"dcp{k}")),
    }
    for name in order:
        rec[f"{name}.s"] = timed(calls[name])
    rec["full.bytes"], rec["incremental.bytes"] = written(os.path.dirname(full)), written(top)
    rec["floor.bytes"] = written(os.path.join(work, f"floor{k}"))
    for name in (["full", "incremental"] if k % 2 == 0 else ["incremental", "full"]):
        probes.drop_cache(inc_root)
        probes.drop_cache(os.path.dirname(full))
        target = {n: torch.empty_like(t) for n, t in sd.items()}
        src = full if name == "full" else top
        t0 = time.perf_counter()
        report = shardfmt.load(target, src)
        rec[f"load.{name}.s"] = time.perf_counter() - t0
        rec[f"load.{name}.bytes"] = report.bytes_read
        rec[f"load.{name}.requests"] = report.read_requests
        rec[f"load.{name}.needed"] = report.bytes_needed
        assert all(torch.equal(target[n], sd[n]) for n in sd), f"{name}: the load is not bit-exact"
    for d in os.listdir(work):
        shutil.rmtree(os.path.join(work, d), ignore_errors=True) if os.path.isdir(os.path.join(work, d)) \
            else os.unlink(os.path.join(work, d))
    return rec


def main(argv=None) -> int:
    a = parser(__doc__, size_mib=768, rounds=5).parse_args(argv)
    sd = build(a.size_mib)
    state_bytes = sum(t.numel() * t.element_size() for t in sd.values())
    trainable = sum(t.numel() * t.element_size() for n, t in sd.items() if "lora" in n)
    names = ["full", "incremental", "floor.write", "dcp.save"]
    work = tempfile.mkdtemp(prefix="shardfmt-incr-", dir=a.dir)
    records = []
    try:
        for k in range(a.warmup + a.rounds):
            order = names[k % len(names):] + names[:k % len(names)]
            rec = one_round(sd, work, k, order)
            if k >= a.warmup:
                records.append(rec)
            print(f"round {k}{' (warm-up)' if k < a.warmup else ''}: "
                  + ", ".join(f"{n} {v:.3f}" for n, v in rec.items() if n.endswith(".s")), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    keys = sorted(records[0])
    stats = {k: summary([r[k] for r in records]) for k in keys}
    paired = {
        "incremental/full time": summary([r["incremental.s"] / r["full.s"] for r in records]),
        "incremental/full bytes": summary([r["incremental.bytes"] / r["full.bytes"] for r in records]),
        "full/floor.write time": summary([r["full.s"] / r["floor.write.s"] for r in records]),
        "dcp.save/full time": summary([r["dcp.save.s"] / r["full.s"] for r in records]),
        "load incremental/full time": summary([r["load.incremental.s"] / r["load.full.s"] for r in records]),
        "load incremental/full bytes read": summary([r["load.incremental.bytes"] / r["load.full.bytes"]
                                                     for r in records]),
    }
    targets = {
        "second save writes <= 10% of a full save's bytes": paired["incremental/full bytes"]["q3"] <= 0.10,
        "second save takes <= 20% of a full save's time": paired["incremental/full time"]["q3"] <= 0.20,
        # Direct reads fetch whole 4 KiB blocks: each read the base's file adds (its shards are
        # split by the ones this checkpoint replaced) may read up to 8 KiB of padding.
        "restore reads no more than a full checkpoint's (beyond block padding of its extra reads)": all(
            r["load.incremental.needed"] == r["load.full.needed"] and r["load.incremental.bytes"]
            <= r["load.full.bytes"] + 8192 * max(0, r["load.incremental.requests"] - r["load.full.requests"])
            for r in records),
    }
    out = {"state_bytes": state_bytes, "trainable_bytes": trainable, "rounds": a.rounds, "stats": stats,
           "paired": paired, "targets": targets, "records": records, "cpu": probes.cpu_name(),
           "fs": probes.fs_type(work), "code": probes.code_fingerprint(), "torch": torch.__version__}
    print(f"state {state_bytes / 2**20:.0f} MiB, trainable {trainable / 2**20:.2f} MiB, {a.rounds} rounds")
    for k, v in paired.items():
        print(f"  {k:<36} median {v['median']:.4f}  IQR [{v['q1']:.4f}, {v['q3']:.4f}]")
    for k, ok in targets.items():
        print(f"  {'PASS' if ok else 'FAIL'}: {k}")
    write_json(a.json, out)
    return 0 if all(targets.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
