"""``shardfmt io-modes DIR``: whether large transfers on DIR's device go direct or buffered,
and the measurements behind it (``io.choice``; ``--again`` measures now)."""

from __future__ import annotations

import json
import os
import statistics

from shardfmt.cli.output import usage
from shardfmt.io import choice, modes


def cmd_io_modes(args) -> int:
    if not os.path.isdir(args.dir):
        return usage("shardfmt", f"io-modes: {args.dir}: not a directory")
    if args.processes is not None and args.processes < 1:
        return usage("shardfmt", f"io-modes: --processes {args.processes}: must be at least 1")
    found = choice.device_modes(args.dir, again=args.again, processes=args.processes)
    forced = choice.forced()
    if args.json:
        print(json.dumps({**modes.entry(found), "forced": forced, "cache": choice.cache_path()}, indent=1, sort_keys=True))
        return 0
    d = found.device
    print(f"{args.dir}: {d.fstype} on {d.mount} (device {d.device}, host {d.host}), "
          f"{d.processes} process{'es' if d.processes > 1 else ''} at once")
    for op, c in sorted(found.choices.items()):
        figures = "".join(f"; {way} median {statistics.median(t):.3f} s over {len(t)} rounds"
                          for way, t in (("direct", c.direct_s), ("buffered", c.buffered_s)) if t)
        print(f"  {op}: {c.mode} ({c.why}{figures})")
    if forced is not None:
        print(f"  {choice.FORCE_ENV} is set: every large transfer is {forced}, whatever was measured")
    print(f"  kept in: {choice.cache_path() or 'this process only'}")
    return 0
