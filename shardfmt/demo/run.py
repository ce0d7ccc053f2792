"""``shardfmt demo``: train, crash, resume — and prove the resumed run is bit-identical.

Runs a small transformer (dropout, AdamW, warm-up + cosine LR, ResumableSampler) on 2
ranks through torchrun (gloo, this machine's CPUs): run A trains uninterrupted; run B is
the same job, saving every K steps, with one rank SIGKILLed between two checkpoints, which
takes the job down; the job is launched again, restores the newest checkpoint and finishes.
(Relaunching, rather than torchrun's in-place --max-restarts, because here a restarted
attempt's gloo groups could read the dead attempt's addresses from the reused store.) The demo prints the
step B resumed from, the steps redone, both loss curves side by side, and whether B's
losses and samples match A's bit for bit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time


def _launch(root: str, run: str, steps: int, save_every: int, kill_at: int | None) -> int:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "--max-restarts", "0",
           "--monitor-interval", "0.2",
           "-m", "shardfmt.demo.train", "--dir", root, "--name", run, "--steps", str(steps),
           "--save-every", str(save_every)]
    if kill_at is not None:
        cmd += ["--kill-at", str(kill_at)]
    env = dict(os.environ, OMP_NUM_THREADS="1", LOGLEVEL="ERROR", TORCH_CPP_LOG_LEVEL="ERROR")
    with open(os.path.join(root, f"{run}.torchrun.log"), "w") as log:
        try:
            return subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=600).returncode
        except subprocess.TimeoutExpired:
            return 124  # never hang the caller


def _read(root: str, run: str, rank: int) -> tuple[dict[int, dict], dict | None]:
    """A run's log: each step's record, and the resume record (None: never resumed). A step
    logged twice is an error: the resumed run rewinds the lost run's steps first."""
    steps: dict[int, dict] = {}
    resumed = None
    with open(os.path.join(root, f"{run}.rank{rank}.jsonl")) as f:
        for line in f:
            rec = json.loads(line)
            if "resumed_from" in rec:
                resumed = rec
            elif rec["step"] in steps:
                raise ValueError(f"{run}.rank{rank}.jsonl logs step {rec['step']} twice")
            else:
                steps[rec["step"]] = rec
    return steps, resumed


def prepare_dir(path: str) -> str | None:
    """Create ``path`` for the demo, or return why it cannot be used: it must be new or
    empty, as each run restores the newest checkpoint it finds there (a second demo in the
    same directory would resume the first one's runs, not train from scratch)."""
    if os.path.exists(path) and not os.path.isdir(path):
        return "exists and is not a directory"
    try:
        if not os.path.isdir(path):
            os.makedirs(path)
        elif os.listdir(path):
            return "is not empty (each run restores the checkpoints it finds there); use a new or empty directory"
    except OSError as e:
        return f"cannot be used ({e.strerror or e})"
    return None


def run_demo(args) -> int:
    root = args.dir or tempfile.mkdtemp(prefix="shardfmt-demo-")
    os.makedirs(root, exist_ok=True)
    steps, every = 30, 10
    kill_at = 25
    t0 = time.monotonic()
    print(f"demo: 2 ranks via torchrun, {steps} steps, checkpoint every {every}, rank 1 killed at step {kill_at}")
    print("[1/3] run A (uninterrupted) ...", flush=True)
    rc_a = _launch(root, "A", steps, every, None)
    print(f"[2/3] run B (rank 1 SIGKILLed at step {kill_at}; the job dies) ...", flush=True)
    rc_kill = _launch(root, "B", steps, every, kill_at)
    print("[3/3] run B restarted: restores the newest checkpoint and finishes ...", flush=True)
    rc_b = _launch(root, "B", steps, every, None)
    if rc_a or rc_b or rc_kill == 0:
        print(f"demo: a run failed (A exit {rc_a}, killed B exit {rc_kill}, restarted B exit {rc_b}); "
              f"logs in {root}")
        return 1
    a0, _ = _read(root, "A", 0)
    b0, record = _read(root, "B", 0)
    b1, _ = _read(root, "B", 1)
    a1, _ = _read(root, "A", 1)
    resumed = record["resumed_from"]
    rewound = record["rewound"]
    print(f"\nresumed from step {resumed}; steps redone: {resumed + 1}..{kill_at} "
          f"({kill_at - resumed} steps lost to the crash); the log's records of steps "
          f"{rewound[0]}..{rewound[-1]} from the lost run were rewound before the resume, so each step "
          f"appears once" if rewound else f"\nresumed from step {resumed}")
    print(f"\n{'step':>5} {'loss A':>12} {'loss B':>12}  same")
    for s in range(1, steps + 1):
        la, lb = a0[s]["loss"], b0[s]["loss"]
        mark = "" if s <= (resumed or 0) else ("yes" if la == lb else "NO")
        print(f"{s:>5} {la:>12.6f} {lb:>12.6f}  {mark}{'   <- resumed here' if s == resumed else ''}")
    after = range((resumed or 0) + 1, steps + 1)
    same_loss = all(a0[s]["loss"] == b0[s]["loss"] for s in after)
    same_ids = all(a0[s]["ids"] == b0[s]["ids"] and a1[s]["ids"] == b1[s]["ids"] for s in after)
    same_lr = all(a0[s]["lr"] == b0[s]["lr"] for s in after)
    ok = same_loss and same_ids and same_lr
    print(f"\nresumed run matches the uninterrupted one bit for bit: {'YES' if ok else 'NO'} "
          f"(losses {same_loss}, sample ids {same_ids}, learning rates {same_lr}); "
          f"{time.monotonic() - t0:.0f} s; files in {root}")
    if getattr(args, "plot", None):
        _plot(args.plot, a0, b0, steps, resumed)
    return 0 if ok else 1


def _plot(path: str, a: dict, b: dict, steps: int, resumed: int | None) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("--plot needs matplotlib (pip install matplotlib)")
        return
    xs = list(range(1, steps + 1))
    plt.figure(figsize=(7, 4))
    plt.plot(xs, [a[s]["loss"] for s in xs], label="A: uninterrupted")
    plt.plot(xs, [b[s]["loss"] for s in xs], "--", label="B: killed and resumed")
    if resumed:
        plt.axvline(resumed, color="gray", lw=0.8)
    plt.xlabel("step")
    plt.ylabel("loss")
    plt.legend()
    plt.tight_layout()
    plt.savefig(path)
    print(f"wrote {path}")
