"""The ``shardfmt`` command: validate, inspect, ls, gc, demo, drill.

Exit codes: 0 success (valid), 1 the checkpoint is invalid, 2 unusable arguments, an
unreachable path, a path that names no checkpoint (a Checkpointer root, a Hugging Face folder)
or a checkpoint of a format version this release cannot read (never judged invalid: a script
that removes invalid checkpoints keeps a newer release's), 130 interrupted (Ctrl-C), 141 stdout
closed early (``| head``). Errors print one line to stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections import Counter

import orjson
from tqdm import tqdm

from shardfmt.demo.drill import DEFAULT_PATTERN, run_drill
from shardfmt.demo.run import prepare_dir, run_demo
from shardfmt.errors import CheckpointNotFoundError, FormatVersionError, ShardfmtError, StorageError
from shardfmt.format import jsonvalue, refs
from shardfmt.io.registry import get_storage, parse_storage_options
from shardfmt.loading.reader import open_checkpoint
from shardfmt.training.roots import checkpoint_at, collect_garbage, list_checkpoints, require_root
from shardfmt.validation import validate

SIGPIPE_EXIT = 141  # 128 + SIGPIPE: the status a shell shows for a command its reader stopped (`... | head`)


def _print_json(obj) -> None:
    option = orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS
    try:
        text = orjson.dumps(obj, option=option)
    except TypeError:  # a string JSON cannot hold: a file name that is not UTF-8
        text = orjson.dumps(_utf8(obj), option=option)
    sys.stdout.write(text.decode() + "\n")


def _utf8(obj):
    """``obj`` with every string valid UTF-8: the bytes of a name that is not (which Python
    keeps as lone surrogates) appear as ``\\xNN``."""
    if isinstance(obj, str):
        try:
            return obj.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
        except UnicodeEncodeError:  # a surrogate no undecodable byte stands for
            return obj.encode("utf-8", "backslashreplace").decode("utf-8")
    if isinstance(obj, dict):
        return {_utf8(k): _utf8(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_utf8(v) for v in obj]
    return obj


def stdout_closed() -> int:
    """The reader of stdout went away (``shardfmt ls ROOT | head``): send what is left to
    /dev/null, so that neither this nor the flush at exit prints a traceback, and return
    ``SIGPIPE_EXIT``. Both command-line tools end this way."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # stdout is not a file (captured): nothing to flush at exit
        pass
    return SIGPIPE_EXIT


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _storage_options(args) -> dict | None:
    try:
        return parse_storage_options(getattr(args, "storage_options", None))
    except ValueError as e:
        raise SystemExit(_usage(str(e))) from None


def _usage(msg: str) -> int:
    print(f"shardfmt: error: {msg}", file=sys.stderr)
    return 2


def cmd_validate(args) -> int:
    bar = None
    if args.deep and not args.json:  # a deep check reads every byte: show how far it is
        bar = tqdm(desc="validate", unit="B", unit_scale=True, unit_divisor=1024, disable=None, dynamic_ncols=True,
                   leave=False)
    try:
        report = validate(checkpoint_at(args.path, args.step, _storage_options(args)), deep=args.deep,
                          storage_options=_storage_options(args),
                          progress=None if bar is None else bar.update)
    finally:
        if bar is not None:
            bar.close()
    if args.json:
        _print_json(report.to_json())
    elif report.ok:
        print(f"{report.path}: valid{' (deep)' if args.deep else ''}")
    elif report.unsupported:
        print(f"{report.path}: cannot be validated by this release: {report.problems[0].message}")
    else:
        print(f"{report.path}: INVALID, {len(report.problems)} problem(s)")
        for p in report.problems:
            print(f"  {p}")
    return 0 if report.ok else 2 if report.unsupported else 1


def inspect_summary(manifest) -> dict:
    chain = refs.chain_of(manifest)
    by_dtype: Counter = Counter()
    for rec in list(manifest.tensors.values()) + list(manifest.storages.values()):
        if rec.alias_of is None and rec.view is None:
            by_dtype[rec.dtype] += rec.nbytes
    return {
        "save_id": manifest.save_id,
        "step": manifest.step,
        "created_at": manifest.created_at,
        "format_version": manifest.format_version,
        "writer": dict(manifest.writer),
        "topology": manifest.topology.to_json(),
        "tensors": len(manifest.tensors),
        "values": len(manifest.values),
        "bytes_per_dtype": dict(sorted(by_dtype.items())),
        "files": {name: f.size for name, f in manifest.files.items()},
        "total_bytes": sum(f.size for f in manifest.files.values()),
        "own_bytes": sum(f.size for name, f in manifest.files.items() if refs.split(name)[0] is None),
        "chain": None if chain is None else {"bases": dict(sorted(chain.bases.items())), "depth": chain.depth},
        "save_costs": _save_costs(manifest),
    }


def _save_costs(manifest) -> dict | None:
    """A Checkpointer save's record of what its run's earlier saves cost (None: none)."""
    try:
        meta = jsonvalue.decode(manifest.metadata, where="metadata")
    except ShardfmtError:
        return None
    costs = meta.get("save_costs") if isinstance(meta, dict) else None
    return costs if isinstance(costs, dict) and isinstance(costs.get("last"), dict) else None


def cmd_inspect(args) -> int:
    ckpt = open_checkpoint(checkpoint_at(args.path, args.step, _storage_options(args)),
                           storage_options=_storage_options(args))
    info = inspect_summary(ckpt.manifest)
    if args.json:
        _print_json(info)
        return 0
    topo = info["topology"]
    mesh = ",".join(f"{d['name']}={d['size']}" for d in topo["mesh"]) or "-"
    print(f"checkpoint  {ckpt.path}")
    print(f"step        {info['step']}")
    print(f"save id     {info['save_id']}   created {info['created_at']}")
    print("writer      " + " ".join(f"{k} {v}" for k, v in sorted(info["writer"].items())))
    print(f"topology    world size {topo['world_size']}, mesh {mesh}")
    print(f"tensors     {info['tensors']}   values {info['values']}")
    print("bytes per dtype")
    for k, v in info["bytes_per_dtype"].items():
        print(f"  {k:<12} {_human(v):>12}")
    costs = info.get("save_costs")
    if costs:
        last = costs["last"]
        print(f"save costs  this run's {costs['saves']} earlier save(s): the loop waited {costs['blocked_s']:.3f} s, "
              f"{costs['total_s']:.3f} s to the commit (medians); the last (step {last['step']}): "
              f"{last['blocked_s']:.3f} s / {last['total_s']:.3f} s, {_human(last['bytes'])} from rank 0")
    if info["chain"] is not None:
        print(f"incremental depth {info['chain']['depth']}, bases {', '.join(info['chain']['bases'])}; "
              f"{_human(info['own_bytes'])} of its files are its own, the rest its bases'")
    print(f"files       {len(info['files'])}, {_human(info['total_bytes'])} in all")
    for name, size in info["files"].items():
        print(f"  {name:<40} {_human(size):>12}")
    return 0


def cmd_ls(args) -> int:
    rows = list_checkpoints(args.root, _storage_options(args))
    if args.json:
        _print_json(rows)
        return 0
    if not rows:
        print(f"{args.root}: no checkpoints")
        return 0
    print(f"{'name':<36} {'step':>10} {'size':>12}  status")
    for r in rows:
        step = "-" if r["step"] is None else str(r["step"])
        size = "-" if r["size"] is None else _human(r["size"])
        extra = f"  ({r['reason']})" if r["reason"] else ""
        print(f"{r['name']:<36} {step:>10} {size:>12}  {r['status']}{extra}")
    return 0


def cmd_gc(args) -> int:
    storage, root = get_storage(args.root, _storage_options(args))
    require_root(storage, root)
    removed = collect_garbage(storage, root, lease_seconds=args.lease_seconds, dry_run=args.dry_run)
    if args.json:
        _print_json({"removed": removed, "dry_run": args.dry_run})
    elif not removed:
        print(f"{args.root}: nothing to collect")
    else:
        for u in removed:
            print(("would remove " if args.dry_run else "removed ") + u)
    return 0


def cmd_demo(args) -> int:
    if args.dir is not None:
        why = prepare_dir(args.dir)
        if why is not None:
            return _usage(f"--dir {args.dir}: {why}")
    return run_demo(args)


def cmd_drill(args) -> int:
    command = list(args.command_line)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        return _usage("drill: give the training command after --, e.g. shardfmt drill -- torchrun "
                      "--nproc_per_node 2 train.py")
    if args.kill_at_save < 2:
        return _usage("drill: --kill-at-save must be at least 2 (the job needs a checkpoint to resume from)")
    try:
        re.compile(args.pattern)
    except re.error as e:
        return _usage(f"drill: --pattern {args.pattern!r}: {e}")
    return run_drill(command, kill_at_save=args.kill_at_save, pattern=args.pattern, rtol=args.rtol,
                     atol=args.atol, work=args.dir, timeout=args.timeout)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="shardfmt", description="Sharded, pickle-free PyTorch checkpoints.")
    sub = p.add_subparsers(dest="command", required=True)

    def add_common(sp):
        sp.add_argument("--json", action="store_true", help="print JSON instead of text")
        sp.add_argument("--storage-options", metavar="JSON", help="fsspec storage options as a JSON object")

    v = sub.add_parser("validate", help="check a checkpoint (exit 0 valid, 1 invalid, 2 unusable)")
    v.add_argument("path")
    v.add_argument("--step", type=int, help="PATH is a Checkpointer root: check its checkpoint of this step")
    v.add_argument("--deep", action="store_true", help="re-hash every chunk of every file")
    add_common(v)
    v.set_defaults(func=cmd_validate)

    i = sub.add_parser("inspect", help="step, topology, tensors, bytes per dtype, files")
    i.add_argument("path")
    i.add_argument("--step", type=int, help="PATH is a Checkpointer root: show its checkpoint of this step")
    add_common(i)
    i.set_defaults(func=cmd_inspect)

    ls = sub.add_parser("ls", help="list the checkpoints under ROOT with their status")
    ls.add_argument("root")
    add_common(ls)
    ls.set_defaults(func=cmd_ls)

    g = sub.add_parser("gc", help="remove what dead saves left under ROOT (never a live save's)")
    g.add_argument("root")
    g.add_argument("--lease-seconds", type=float, default=None,
                   help="a save whose lease is older than this is dead (default: 600 local, 120 object stores)")
    g.add_argument("--dry-run", action="store_true", help="list what would be removed, remove nothing")
    add_common(g)
    g.set_defaults(func=cmd_gc)

    d = sub.add_parser("demo", help="train on 2 ranks, SIGKILL one, resume, and compare bit for bit")
    d.add_argument("--dir", help="a new or empty directory to write to (default: a new temporary directory); "
                                 "each run restores the checkpoints it finds there, so a used one is refused")
    d.add_argument("--plot", metavar="FILE.png", help="draw both loss curves (needs matplotlib)")
    d.set_defaults(func=cmd_demo)

    r = sub.add_parser("drill", help="run YOUR training command uninterrupted, then killed between checkpoints "
                                     "and restarted, and compare the step lines it prints",
                       description="Runs COMMAND three times, each with its own checkpoint directory (the job's "
                                   "Checkpointers keep their checkpoints there): uninterrupted; with its highest "
                                   "rank SIGKILLed when the job asks for save K; restarted, resuming. Then compares "
                                   "the numbers on every line that names a step.")
    r.add_argument("--kill-at-save", type=int, default=2, metavar="K",
                   help="kill when the job asks for its K-th save, after K-1 are committed (default 2)")
    r.add_argument("--pattern", default=DEFAULT_PATTERN,
                   help="regex finding a step's lines, with a group named step (default: 'step <n>')")
    r.add_argument("--rtol", type=float, default=0.0, help="relative tolerance (default 0: bit for bit)")
    r.add_argument("--atol", type=float, default=0.0, help="absolute tolerance (default 0)")
    r.add_argument("--dir", help="where the runs' checkpoints and logs go (default: a new temporary directory)")
    r.add_argument("--timeout", type=float, default=3600.0, help="seconds each run may take (default 3600)")
    r.add_argument("command_line", nargs=argparse.REMAINDER, metavar="-- COMMAND", help="the training command")
    r.set_defaults(func=cmd_drill)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        rc = args.func(args)
        sys.stdout.flush()  # here, where a closed pipe can still be handled
        return rc
    except BrokenPipeError:
        return stdout_closed()
    except (CheckpointNotFoundError, StorageError) as e:
        print(f"shardfmt: {e}", file=sys.stderr)
        return 2
    except FormatVersionError as e:  # a newer release's checkpoint: not invalid, unreadable here
        print(f"shardfmt: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    except ShardfmtError as e:
        print(f"shardfmt: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
