"""The ``reshard`` command: ``plan`` shows which saved bytes feed a rank of a new topology.

Exit codes: 0 success, 1 the checkpoint or plan is unusable, 2 bad arguments or an
unreachable path. Errors print one line to stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import sys

import orjson

from shardfmt.errors import CheckpointNotFoundError, ShardfmtError, StorageError

from .geometry import Box
from .planner import DEFAULT_MAX_GAP, DEFAULT_MAX_READ, TargetSlice, plan_load
from .topology import Mesh, count_layers, held_boxes, layout_from_record, retarget


def targets_for_rank(manifest, mesh: Mesh, rank: int) -> list[TargetSlice]:
    """Every slice ``rank`` of ``mesh`` holds, each tensor laid out as it was saved."""
    coords = mesh.coords(rank)
    sizes = dict(mesh.dims)
    n_layers = count_layers(manifest.tensors)
    out: list[TargetSlice] = []
    for fqn in sorted(manifest.tensors):
        name, rec = manifest.resolve(fqn)
        if rec.view is not None or name != fqn:
            continue  # aliases and views are filled from what they point at
        lay = retarget(fqn, layout_from_record(rec.placement), mesh, num_layers=n_layers)
        for hb in held_boxes(rec.shape, lay, coords, sizes):
            out.append(TargetSlice(index=len(out), fqn=fqn, box=hb.box))
    return out


def cmd_plan(args) -> int:
    from shardfmt.reader import open_checkpoint

    mesh = Mesh.parse(args.mesh)
    if not 0 <= args.rank < mesh.world_size:
        print(f"reshard: error: --rank {args.rank} is outside a mesh of {mesh.world_size} ranks", file=sys.stderr)
        return 2
    ckpt = open_checkpoint(args.src, storage_options=_opts(args))
    targets = targets_for_rank(ckpt.manifest, mesh, args.rank)
    plan = plan_load(ckpt.manifest, targets, verify=not args.no_verify, max_gap=args.max_gap,
                     max_read=args.max_read)
    by_index = {t.index: t for t in targets}
    if args.json:
        out = {"mesh": str(mesh), "rank": args.rank, "needed_bytes": plan.needed_bytes,
               "bytes_to_read": plan.bytes_to_read, "reads": plan.describe(),
               "targets": [{"index": t.index, "tensor": t.fqn, "offsets": list(t.box.offsets),
                            "lengths": list(t.box.lengths)} for t in targets]}
        sys.stdout.write(orjson.dumps(out, option=orjson.OPT_INDENT_2).decode() + "\n")
        return 0
    print(f"rank {args.rank} of mesh {mesh} ({mesh.coords(args.rank)}): {len(targets)} slices, "
          f"{plan.needed_bytes} bytes needed, {plan.bytes_to_read} bytes read in {len(plan.reads)} reads")
    for r in plan.reads:
        print(f"{r.file} [{r.byte_range.start}, {r.byte_range.end})")
        for it in r.items:
            t = by_index[it.target]
            dst = Box(tuple(o + d for o, d in zip(t.box.offsets, it.dst_offsets)), it.src_lengths)
            print(f"    bytes [{it.src_start}, {it.src_end}) -> {t.fqn} "
                  f"{list(dst.offsets)}+{list(dst.lengths)}")
    return 0


def _opts(args):
    if not getattr(args, "storage_options", None):
        return None
    opts = orjson.loads(args.storage_options)
    if not isinstance(opts, dict):
        raise ValueError("--storage-options must be a JSON object")
    return opts


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="reshard", description="Move shardfmt checkpoints between topologies.")
    sub = p.add_subparsers(dest="command", required=True)
    pl = sub.add_parser("plan", help="print which saved bytes feed one rank of a new mesh (reads no data)")
    pl.add_argument("src")
    pl.add_argument("--mesh", required=True, help="new mesh, outermost first, e.g. pp=2,dp=2,tp=4")
    pl.add_argument("--rank", type=int, required=True)
    pl.add_argument("--no-verify", action="store_true", help="plan without rounding reads to hash chunks")
    pl.add_argument("--max-gap", type=int, default=DEFAULT_MAX_GAP, help="coalesce reads across gaps up to N bytes")
    pl.add_argument("--max-read", type=int, default=DEFAULT_MAX_READ, help="largest single read in bytes")
    pl.add_argument("--json", action="store_true")
    pl.add_argument("--storage-options", metavar="JSON")
    pl.set_defaults(func=cmd_plan)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (CheckpointNotFoundError, StorageError) as e:
        print(f"reshard: {e}", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"reshard: error: {e}", file=sys.stderr)
        return 2
    except ShardfmtError as e:
        print(f"reshard: {type(e).__name__}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
