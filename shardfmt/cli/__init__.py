"""The ``shardfmt`` command: validate, inspect, ls, gc, demo, drill, io-modes.

Exit codes: 0 success (valid), 1 the checkpoint is invalid, 2 unusable arguments, an
unreachable path, a path that names no checkpoint (a Checkpointer root, a Hugging Face folder)
or a checkpoint of a format version this release cannot read (never judged invalid: a script
that removes invalid checkpoints keeps a newer release's), 130 interrupted (Ctrl-C), 141 stdout
closed early (``| head``). Errors print one line to stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import re
import sys

from shardfmt._version import __version__
from shardfmt.cli.output import SIGPIPE_EXIT, deferred, run, stdout_closed, usage
from shardfmt.cli.parser import Parser
from shardfmt.demo.drill import DEFAULT_PATTERN, run_drill
from shardfmt.demo.run import prepare_dir, run_demo

__all__ = ["SIGPIPE_EXIT", "build_parser", "main", "stdout_closed"]


def _usage(msg: str) -> int:
    return usage("shardfmt", msg)


def _checkpoints(name: str):
    """The command ``name`` of ``shardfmt.cli.checkpoints`` (it needs torch: imported when it runs)."""
    return deferred("shardfmt.cli.checkpoints", name)


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
    p = Parser(prog="shardfmt", description="Sharded, pickle-free PyTorch checkpoints.")
    p.add_argument("--version", action="version", version=f"shardfmt {__version__}")
    sub = p.add_subparsers(dest="command", required=True, parser_class=Parser)

    def add_common(sp):
        sp.add_argument("--json", action="store_true", help="print JSON instead of text")
        sp.add_argument("--storage-options", metavar="JSON", help="fsspec storage options as a JSON object")

    v = sub.add_parser("validate", help="check a checkpoint (exit 0 valid, 1 invalid, 2 unusable)")
    v.add_argument("path", help="a checkpoint directory or URL (s3://...), or a Checkpointer root with --step")
    v.add_argument("--step", type=int, help="PATH is a Checkpointer root: check its checkpoint of this step")
    v.add_argument("--deep", action="store_true", help="re-hash every chunk of every file")
    add_common(v)
    v.set_defaults(func=_checkpoints("cmd_validate"))

    i = sub.add_parser("inspect", help="step, topology, tensors, bytes per dtype, files")
    i.add_argument("path", help="a checkpoint directory or URL (s3://...), or a Checkpointer root with --step")
    i.add_argument("--step", type=int, help="PATH is a Checkpointer root: show its checkpoint of this step")
    i.add_argument("--tensors", nargs="?", const="*", metavar="GLOB",
                   help="list the tensors instead (those whose names match GLOB, e.g. 'model.*.weight'): "
                        "shape, dtype, bytes, placement over the mesh")
    add_common(i)
    i.set_defaults(func=_checkpoints("cmd_inspect"))

    ls = sub.add_parser("ls", help="list the checkpoints under ROOT with their status")
    ls.add_argument("root", help="a Checkpointer root: the directory or URL holding step_* checkpoints")
    add_common(ls)
    ls.set_defaults(func=_checkpoints("cmd_ls"))

    g = sub.add_parser("gc", help="remove what dead saves left under ROOT (never a live save's)")
    g.add_argument("root", help="a Checkpointer root: the directory or URL holding step_* checkpoints")
    g.add_argument("--lease-seconds", type=float, default=None,
                   help="a save whose lease is older than this is dead (default: 600 local, 120 object stores)")
    g.add_argument("--dry-run", action="store_true", help="list what would be removed, remove nothing")
    add_common(g)
    g.set_defaults(func=_checkpoints("cmd_gc"))

    d = sub.add_parser("demo", help="train on 2 ranks, SIGKILL one, resume, and compare bit for bit")
    d.add_argument("--dir", help="a new or empty directory to write to (default: a new temporary directory); "
                                 "each run restores the checkpoints it finds there, so a used one is refused")
    d.add_argument("--plot", metavar="FILE.png", help="draw both loss curves (needs matplotlib)")
    d.set_defaults(func=cmd_demo)

    m = sub.add_parser("io-modes", help="whether large transfers in DIR go direct or buffered, and the "
                                        "measurements behind it (measured once per device and kept)")
    m.add_argument("dir", help="a directory on the device (a Checkpointer root)")
    m.add_argument("--again", action="store_true",
                   help="measure now (the mode in force changes only if the other is clearly faster)")
    m.add_argument("--processes", type=int, metavar="N",
                   help="the processes of the node that save and load at once, e.g. the GPUs a node trains "
                        "on (default: LOCAL_WORLD_SIZE, else 1): which way is faster can depend on it")
    m.add_argument("--json", action="store_true", help="print JSON instead of text")
    m.set_defaults(func=deferred("shardfmt.cli.io_modes", "cmd_io_modes"))

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
    again = "; gc stopped part way: run it again to finish" if args.command == "gc" else ""
    return run("shardfmt", args.func, args, interrupted=again)


if __name__ == "__main__":
    sys.exit(main())
