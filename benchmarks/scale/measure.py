"""One measurement in a fresh process: CPU seconds and peak RSS above the import baseline.

The child (``python -m benchmarks.scale child ...``) imports everything first, then
``Meter.start`` writes "5" to ``/proc/self/clear_refs`` (the peak, VmHWM, drops to the
current RSS) and reads VmRSS: that is the baseline. Each ``with meter.phase(name)`` records
the phase's CPU seconds (``time.process_time``: this process's user + system time, so
other jobs on the 2 shared cores do not count), its wall seconds, and VmHWM at its end
minus the baseline: the peak RSS of the measurement so far. The parent (``run_child``)
reads the child's result as the last line of its stdout.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field

MIB = 1 << 20


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise OSError(f"/proc/self/status has no {key}")


def reset_peak() -> None:
    """Drop this process's VmHWM to its current RSS (Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


@dataclass(slots=True)
class Meter:
    """Phases of one measurement: CPU s, wall s, and peak RSS above the baseline (MiB)."""

    phases: dict[str, dict] = field(default_factory=dict)
    facts: dict[str, object] = field(default_factory=dict)
    base_kib: int = 0
    cpu0: float = 0.0

    def start(self) -> None:
        """Take the baseline: every import done, nothing of the measurement allocated yet."""
        reset_peak()
        self.base_kib = _status_kib("VmRSS")
        self.cpu0 = time.process_time()

    @contextlib.contextmanager
    def phase(self, name: str):
        c0, w0 = time.process_time(), time.perf_counter()
        yield
        self.phases[name] = {"cpu_s": time.process_time() - c0, "wall_s": time.perf_counter() - w0,
                             "peak_mib": self.peak_mib()}

    def peak_mib(self) -> float:
        return (_status_kib("VmHWM") - self.base_kib) / 1024

    def fact(self, name: str, value) -> None:
        self.facts[name] = value

    def result(self) -> dict:
        """Every phase, the facts, and the peak over the phases (work done after the last phase,
        e.g. figures computed for the report, does not count)."""
        peak = max((p["peak_mib"] for p in self.phases.values()), default=self.peak_mib())
        return {"phases": self.phases, "facts": self.facts, "peak_mib": peak,
                "cpu_s": sum(p["cpu_s"] for p in self.phases.values()), "baseline_mib": self.base_kib / 1024}


def child_env() -> dict:
    """The child's environment: this checkout first on the path, one thread for torch's pools."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.environ.get("PYTHONPATH", "")
    return dict(os.environ, PYTHONPATH=root + (os.pathsep + path if path else ""), OMP_NUM_THREADS="1",
                MKL_NUM_THREADS="1")


def run_child(args: list[str], *, timeout: float) -> dict:
    """Run ``python -m benchmarks.scale <args>`` in a fresh process; return its JSON result
    (``{"error": ...}`` when it failed or ran past ``timeout`` wall seconds)."""
    cmd = [sys.executable, "-m", "benchmarks.scale", *args]
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=child_env())
    except subprocess.TimeoutExpired:
        return {"error": f"ran past {timeout:.0f} s wall (killed)", "wall_s": time.perf_counter() - t0}
    lines = p.stdout.strip().splitlines()
    if p.returncode != 0 or not lines:
        return {"error": f"exit {p.returncode}: {p.stderr.strip()[-2000:]}", "wall_s": time.perf_counter() - t0}
    out = json.loads(lines[-1])
    out["wall_s"] = time.perf_counter() - t0
    return out


def emit(result: dict) -> None:
    """The child's last stdout line: its result."""
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()


def available_mib() -> float:
    """MemAvailable of the machine (what a measurement may still take without swapping others out)."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024
    return float("inf")
