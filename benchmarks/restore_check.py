#!/usr/bin/env python
"""What the post-restore check costs a restore (issue 20, item 6).

    python benchmarks/restore_check.py --size-mib 384 --rounds 7 --json out.json

One process. A model of ``Linear(2048, 2048)`` layers is saved once by a ``Checkpointer``; then
every round times, in an order that rotates from round to round, from a cold page cache (fsync
+ POSIX_FADV_DONTNEED of every file before each) and then again from a warm one:

- ``checked``: ``Checkpointer.restore`` into a fresh model (the statistics of the loaded values
  summed in the read pass and compared with the saved ones);
- ``unchecked``: the same with ``allow_mismatch=True`` (no statistics summed, none compared);
- ``floor.read``: ``readinto`` + xxh3 of the checkpoint's data files, whole, into one buffer.

Reported: medians and interquartile ranges, and the rounds' paired ratios checked/unchecked.
The target (the issue's "no extra pass over the state"): the cold checked/unchecked ratio's
median within 3%, its interquartile range reaching 1.0 (the check's cost not told apart from
the noise of the restore itself); the warm ratio, where there is no disk to hide the sums
behind, is reported without a target.
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

WIDTH = 2048


def model(layers: int, seed: int | None) -> torch.nn.Module:
    if seed is not None:
        torch.manual_seed(seed)
    m = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(layers)])
    return m


def floor_read(step_dir: str, buf: torch.Tensor) -> None:
    view = floors.byte_view(buf)
    for name in sorted(os.listdir(os.path.join(step_dir, "data"))):
        path = os.path.join(step_dir, "data", name)
        size = os.path.getsize(path)
        fd = os.open(path, os.O_RDONLY)
        try:
            floors.read_pieces(fd, view[:size], 0, hashed=True, path=path)
        finally:
            os.close(fd)


def one_round(root: str, step_dir: str, saved: torch.nn.Module, layers: int, order: list[str],
              buf: torch.Tensor) -> dict[str, float]:
    rec = {}
    for cache in ("cold", "warm"):
        for name in order:
            fresh = model(layers, None)
            call = {
                "checked": lambda m=fresh: shardfmt.Checkpointer(root).restore({"model": m}),
                "unchecked": lambda m=fresh: shardfmt.Checkpointer(root).restore({"model": m}, allow_mismatch=True),
                "floor.read": lambda: floor_read(step_dir, buf),
            }[name]
            if cache == "cold":
                probes.drop_cache(root)
            else:
                probes.warm_cache(root)
            t0 = time.perf_counter()
            call()
            rec[f"{cache}.{name}.s"] = time.perf_counter() - t0
            if name != "floor.read":
                assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(),
                                                             saved.state_dict().values())), name
    return rec


def main(argv=None) -> int:
    a = parser(__doc__, size_mib=384, rounds=7).parse_args(argv)
    layers = max(1, a.size_mib * (1 << 20) // (WIDTH * WIDTH * 4))
    saved = model(layers, 0)
    work = tempfile.mkdtemp(prefix="shardfmt-check-", dir=a.dir)
    root = os.path.join(work, "root")
    names = ["checked", "unchecked", "floor.read"]
    records = []
    try:
        shardfmt.Checkpointer(root).save(1, {"model": saved})
        step_dir = os.path.join(root, "step_000000001")
        files = [os.path.join(step_dir, "data", n) for n in os.listdir(os.path.join(step_dir, "data"))]
        buf = torch.empty(max(os.path.getsize(f) for f in files), dtype=torch.uint8)
        for k in range(a.warmup + a.rounds):
            order = names[k % len(names):] + names[:k % len(names)]
            rec = one_round(root, step_dir, saved, layers, order, buf)
            if k >= a.warmup:
                records.append(rec)
            print(f"round {k}{' (warm-up)' if k < a.warmup else ''}: "
                  + ", ".join(f"{n} {v:.3f}" for n, v in rec.items()), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    stats = {k: summary([r[k] for r in records]) for k in sorted(records[0])}
    paired = {f"{c} checked/unchecked": summary([r[f"{c}.checked.s"] / r[f"{c}.unchecked.s"] for r in records])
              for c in ("cold", "warm")}
    paired.update({f"{c} checked/floor.read": summary([r[f"{c}.checked.s"] / r[f"{c}.floor.read.s"]
                                                       for r in records]) for c in ("cold", "warm")})
    cold = paired["cold checked/unchecked"]
    targets = {"cold restore with the check within 3% of one without (median), the IQR reaching 1.0":
               cold["median"] <= 1.03 and cold["q1"] <= 1.0}
    state_bytes = sum(t.numel() * t.element_size() for t in saved.state_dict().values())
    out = {"state_bytes": state_bytes, "rounds": a.rounds, "stats": stats, "paired": paired, "targets": targets,
           "records": records, "cpu": probes.cpu_name(), "fs": probes.fs_type(work),
           "code": probes.code_fingerprint(), "torch": torch.__version__}
    print(f"state {state_bytes / 2**20:.0f} MiB ({layers} layers), {a.rounds} rounds")
    for k, v in stats.items():
        print(f"  {k:<24} median {v['median']:.4f} s  IQR [{v['q1']:.4f}, {v['q3']:.4f}]")
    for k, v in paired.items():
        print(f"  {k:<28} median {v['median']:.4f}  IQR [{v['q1']:.4f}, {v['q3']:.4f}]")
    for k, ok in targets.items():
        print(f"  {'PASS' if ok else 'MISS'}: {k}")
    write_json(a.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
