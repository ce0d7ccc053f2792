"""What the one-process benchmark scripts share (``incremental``, ``restore_check``,
``restore_timeline``): their command line and their summary of a figure's rounds."""

from __future__ import annotations

import argparse
import json
import statistics


def parser(doc: str, *, size_mib: int, rounds: int) -> argparse.ArgumentParser:
    """``--size-mib``, ``--rounds``, ``--warmup``, ``--dir`` (the scratch's parent), ``--json``."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mib", type=int, default=size_mib)
    p.add_argument("--rounds", type=int, default=rounds)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--dir", default=None, help="scratch parent directory (default: the temp dir)")
    p.add_argument("--json", default=None)
    return p


def summary(values: list[float]) -> dict:
    """Median, quartiles (inclusive method), min and max of a figure's rounds."""
    q = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else [values[0]] * 3
    return {"median": statistics.median(values), "q1": q[0], "q3": q[2], "min": min(values), "max": max(values)}


def write_json(path: str | None, out: dict) -> None:
    """The report as JSON at ``path`` (``--json``; None: not written)."""
    if path:
        with open(path, "w") as f:
            json.dump(out, f, indent=1)
