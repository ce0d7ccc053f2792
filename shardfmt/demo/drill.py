"""``shardfmt drill -- <command>``: the kill-and-resume drill, on the user's own training job.

    shardfmt drill --kill-at-save 2 -- torchrun --standalone --nproc_per_node 2 train.py --steps 50

The command is run as it is, three times, each with its own checkpoint directory
(``training.drill``: the job's Checkpointers keep their checkpoints there):

1. run A, uninterrupted;
2. run B, whose highest rank SIGKILLs itself when the job asks for its ``K``-th save, after
   ``K - 1`` were committed: the steps since the last checkpoint are lost, and torchrun takes
   the job down (the drill expects it to fail);
3. run B again, as a restarted job would be: it restores the newest checkpoint and finishes.

Then every line the runs printed that names a step (``--pattern``, a regex with a ``step``
group; default ``step <n>``) is compared: for each step run A printed, the numbers on run B's
lines of that step (from the restarted run for the steps it redid) must equal A's, bit for bit
(``--rtol``/``--atol`` for GPU runs, whose kernels are not deterministic). Exit 0 when they
all match, 1 when any differs or a run failed, 2 for a usage error.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import tempfile

from shardfmt.training.drill import DIR_ENV, KILL_ENV

DEFAULT_PATTERN = r"\bstep\W{0,3}(?P<step>\d+)"
_NUMBER = re.compile(r"[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?|[-+]?(?:nan|inf)", re.IGNORECASE)


def _run(command: list[str], env: dict, log_path: str, timeout: float) -> tuple[int, str]:
    with open(log_path, "w") as log:
        try:
            rc = subprocess.run(command, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = 124
        except OSError as e:
            log.write(f"shardfmt drill: cannot run {command[0]!r}: {e}\n")
            rc = 127
    with open(log_path, errors="replace") as f:
        return rc, f.read()


def step_lines(text: str, pattern: re.Pattern) -> dict[int, list[tuple[float, ...]]]:
    """Step -> the numbers of every line naming it (the step itself left out), in order."""
    out: dict[int, list[tuple[float, ...]]] = {}
    for line in text.splitlines():
        if "shardfmt:" in line or "shardfmt drill:" in line:
            continue  # shardfmt's own log lines (a restore's or a save's timings), not the job's
        m = pattern.search(line)
        if m is None:
            continue
        rest = line[:m.start("step")] + " " + line[m.end("step"):]
        out.setdefault(int(m.group("step")), []).append(tuple(float(x) for x in _NUMBER.findall(rest)))
    return out


_ABORT_AT_EXIT = "terminate called without an active exception"  # libstdc++'s words for std::terminate


def _same(a: tuple[float, ...], b: tuple[float, ...], rtol: float, atol: float) -> bool:
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if math.isnan(x) and math.isnan(y):
            continue
        if x != y and not abs(x - y) <= atol + rtol * abs(y):
            return False
    return True


def compare(a: dict[int, list], b1: dict[int, list], b2: dict[int, list], *, rtol: float,
            atol: float) -> tuple[int | None, list[str]]:
    """Run B's lines as the restarted job leaves them (the killed run's up to the step the restart
    resumed after; the restart's from there), against run A's. Returns (the step the restart
    resumed from, the differences found)."""
    resumed = min(b2) - 1 if b2 else None
    b = {s: v for s, v in b1.items() if resumed is None or s <= resumed} | b2
    problems = []
    for s in sorted(a):
        if s not in b:
            problems.append(f"step {s}: run A printed it, run B never did")
        elif sorted(a[s]) != sorted(b[s]) and not (
                len(a[s]) == len(b[s]) and all(_same(x, y, rtol, atol) for x, y in zip(sorted(a[s]), sorted(b[s])))):
            problems.append(f"step {s}: run A printed {a[s][:2]}, run B {b[s][:2]}")
    problems += [f"step {s}: run B printed it, run A never did" for s in sorted(set(b) - set(a))]
    return resumed, problems


def run_drill(command: list[str], *, kill_at_save: int = 2, pattern: str = DEFAULT_PATTERN, rtol: float = 0.0,
              atol: float = 0.0, work: str | None = None, timeout: float = 3600.0) -> int:
    rx = re.compile(pattern)
    if "step" not in rx.groupindex:
        print("shardfmt drill: --pattern needs a group named step, e.g. 'step (?P<step>\\d+)'", file=sys.stderr)
        return 2
    work = work or tempfile.mkdtemp(prefix="shardfmt-drill-")
    for run in ("A", "B"):  # each run's Checkpointer roots go under its own directory
        os.makedirs(os.path.join(work, run), exist_ok=True)
    base = dict(os.environ)
    base.pop(KILL_ENV, None)
    runs = {}
    print(f"drill: {' '.join(command)}\n  work and logs in {work}", flush=True)
    print("[1/3] run A, uninterrupted ...", flush=True)
    runs["A"] = _run(command, {**base, DIR_ENV: os.path.join(work, "A")}, os.path.join(work, "A.log"), timeout)
    print(f"[2/3] run B, its highest rank SIGKILLed at save {kill_at_save} ...", flush=True)
    runs["B1"] = _run(command, {**base, DIR_ENV: os.path.join(work, "B"), KILL_ENV: str(kill_at_save)},
                      os.path.join(work, "B.killed.log"), timeout)
    print("[3/3] run B restarted: it restores its newest checkpoint and finishes ...", flush=True)
    runs["B2"] = _run(command, {**base, DIR_ENV: os.path.join(work, "B")}, os.path.join(work, "B.restarted.log"),
                      timeout)
    (rc_a, out_a), (rc_k, out_k), (rc_b, out_b) = runs["A"], runs["B1"], runs["B2"]
    if rc_a or rc_b or rc_k == 0:
        print(f"drill: a run did not go as planned (A exit {rc_a}; killed B exit {rc_k}, expected non-zero; "
              f"restarted B exit {rc_b}); see the logs in {work}")
        failed = [(name, rc, out) for name, (rc, out), bad in (
            ("A", runs["A"], rc_a != 0), ("B, killed", runs["B1"], rc_k == 0), ("B, restarted", runs["B2"], rc_b != 0))
            if bad]
        for name, rc, out in failed:
            tail = "\n    ".join(out.splitlines()[-15:])
            print(f"  the last lines of run {name} (exit {rc}):\n    {tail}")
        if any(_ABORT_AT_EXIT in out for _, _, out in failed):
            print(f"drill: a process printed \"{_ABORT_AT_EXIT}\": a rank that aborts as Python exits after its "
                  "work is done is torch's gloo teardown (a process group's worker thread frees the last "
                  "collective's tensors during the interpreter's finalization). Leaving with os._exit(0) once "
                  "the work is done avoids it, as shardfmt's demo does: after Checkpointer.close() (or wait()), "
                  "since os._exit skips the exit-time wait for background saves and copies")
        return 1
    a, b1, b2 = step_lines(out_a, rx), step_lines(out_k, rx), step_lines(out_b, rx)
    if b2 and b1 and min(b2) == min(a):
        print(f"drill: the restarted run B started from its first step, not from a checkpoint: nothing was "
              f"resumed (does the job call Checkpointer.restore? see {work}/B.restarted.log)")
        return 1
    if not a:
        print(f"drill: run A printed no line matching {pattern!r}: nothing to compare (see {work}/A.log)")
        return 1
    resumed, problems = compare(a, b1, b2, rtol=rtol, atol=atol)
    lost = f"; steps {resumed + 1}..{max(b1)} were lost and redone" if resumed is not None and b1 and \
        max(b1) > resumed else ""
    how = "bit for bit" if rtol == atol == 0 else f"within rtol {rtol}, atol {atol}"
    print(f"\nrun B was killed after step {max(b1) if b1 else '?'} and resumed from step {resumed}{lost}")
    if problems:
        print(f"drill: the resumed run differs from the uninterrupted one ({len(problems)} differences):")
        for p in problems[:20]:
            print(f"  {p}")
        return 1
    print(f"drill: the resumed run matches the uninterrupted one {how}: {len(a)} steps compared")
    return 0


__all__ = ["DEFAULT_PATTERN", "compare", "run_drill", "step_lines"]
