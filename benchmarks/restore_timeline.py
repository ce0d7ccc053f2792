#!/usr/bin/env python
"""Where a restore's time goes, shardfmt's next to DCP's for the same state (issue 22).

    python benchmarks/restore_timeline.py --size-mib 384 --rounds 5 --json out.json

One process. A model of ``Linear(2048, 2048)`` layers and its Adam state (one step taken) are
saved once by a ``Checkpointer`` and once by ``torch.distributed.checkpoint.save``; every
round then restores each into a fresh model and optimizer, from a cold page cache (fsync +
POSIX_FADV_DONTNEED of every file before each), in an order that alternates:

- ``shardfmt``: ``Checkpointer.restore``; its phases from ``stats.restores[-1].phases``
  (discover, open, plan, read, verify, apply: ``training.interval.RestoreCost``);
- ``dcp``: the same state loaded the way DCP's documentation does it: ``get_state_dict``,
  ``dcp.load`` with a ``FileSystemReader`` whose calls are timed (``read_metadata``: open;
  the planner's local and global plans: plan; ``read_data``: read), then ``set_state_dict``
  (apply). DCP has no discover (it is given the directory) and no verify (no digests).

Reported: the median seconds of each phase and of the whole, per candidate; every restore is
checked bit-exact against the saved model.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict  # noqa: E402

import shardfmt  # noqa: E402
from benchmarks import probes  # noqa: E402
from benchmarks.standalone import parser, write_json  # noqa: E402

WIDTH = 2048
PHASES = ("discover", "open", "plan", "read", "verify", "apply")


def training_state(layers: int, seed: int | None):
    if seed is not None:
        torch.manual_seed(seed)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(layers)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(2, WIDTH)).sum().backward()
    opt.step()
    opt.zero_grad()
    return model, opt


class TimedReader(dcp.FileSystemReader):
    """DCP's file reader with its calls timed into ``seconds`` (open, plan, read)."""

    def __init__(self, path: str, seconds: dict[str, float]) -> None:
        super().__init__(path)
        self.seconds = seconds

    def _timed(self, phase: str, fn, *a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - t0

    def read_metadata(self, *a, **k):
        return self._timed("open", super().read_metadata, *a, **k)

    def prepare_local_plan(self, plan):
        return self._timed("plan", super().prepare_local_plan, plan)

    def prepare_global_plan(self, plans):
        return self._timed("plan", super().prepare_global_plan, plans)

    def read_data(self, plan, planner):
        def read():
            fut = super(TimedReader, self).read_data(plan, planner)
            fut.wait()  # done by the time it returns (the file reader reads in the call): timed whole
            return fut
        return self._timed("read", read)


def dcp_restore(path: str, layers: int) -> tuple[dict[str, float], torch.nn.Module]:
    model, opt = training_state(layers, None)
    seconds: dict[str, float] = {}
    t0 = time.perf_counter()
    msd, osd = get_state_dict(model, opt)
    sd = {"model": msd, "optim": osd}
    t1 = time.perf_counter()
    dcp.load(sd, storage_reader=TimedReader(path, seconds))
    t2 = time.perf_counter()
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    t3 = time.perf_counter()
    seconds["plan"] = seconds.get("plan", 0.0) + (t1 - t0)  # the state dicts built to load into
    seconds["apply"] = t3 - t2
    seconds["total"] = t3 - t0
    return seconds, model


def shardfmt_restore(root: str, layers: int) -> tuple[dict[str, float], torch.nn.Module]:
    model, opt = training_state(layers, None)
    ck = shardfmt.Checkpointer(root)
    t0 = time.perf_counter()
    ck.restore({"model": model, "optim": opt})
    total = time.perf_counter() - t0
    return {**ck.stats.restores[-1].phases, "total": total}, model


def main(argv=None) -> int:
    a = parser(__doc__ + "\n--size-mib is the model's bytes (Adam adds twice that).", size_mib=384,
               rounds=5).parse_args(argv)
    layers = max(1, a.size_mib * (1 << 20) // (WIDTH * WIDTH * 4))
    model, opt = training_state(layers, 0)
    work = tempfile.mkdtemp(prefix="shardfmt-timeline-", dir=a.dir)
    root, dcp_dir = os.path.join(work, "root"), os.path.join(work, "dcp")
    records: dict[str, list[dict[str, float]]] = {"shardfmt": [], "dcp": []}
    try:
        shardfmt.Checkpointer(root).save(1, {"model": model, "optim": opt})
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, storage_writer=dcp.FileSystemWriter(dcp_dir))
        for k in range(a.warmup + a.rounds):
            for name in (["shardfmt", "dcp"] if k % 2 == 0 else ["dcp", "shardfmt"]):
                probes.drop_cache(work)
                seconds, back = shardfmt_restore(root, layers) if name == "shardfmt" else dcp_restore(dcp_dir, layers)
                assert all(torch.equal(x, y) for x, y in zip(back.state_dict().values(),
                                                             model.state_dict().values())), name
                if k >= a.warmup:
                    records[name].append(seconds)
            print(f"round {k}{' (warm-up)' if k < a.warmup else ''} done", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    medians = {name: {ph: statistics.median(r.get(ph, 0.0) for r in recs) for ph in (*PHASES, "total")}
               for name, recs in records.items()}
    state_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    out = {"state_bytes": state_bytes, "layers": layers, "rounds": a.rounds, "medians": medians, "records": records,
           "cpu": probes.cpu_name(), "fs": probes.fs_type(a.dir or tempfile.gettempdir()),
           "code": probes.code_fingerprint(), "torch": torch.__version__}
    print(f"model {state_bytes / 2**20:.0f} MiB + Adam state, {a.rounds} rounds, cold cache; median seconds")
    print(f"  {'phase':<10}" + "".join(f"{n:>12}" for n in medians))
    for ph in (*PHASES, "total"):
        print(f"  {ph:<10}" + "".join(f"{medians[n][ph]:>12.3f}" for n in medians))
    write_json(a.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
