"""The ``reshard`` commands themselves. ``reshard.cli`` imports this module only once one of
them runs: they need torch, which ``--help`` and ``--version`` never import."""

from __future__ import annotations

import sys

import orjson

from reshard._shardfmt import (
    Box,
    Mesh,
    open_checkpoint,
    parse_storage_options,
    plan_load,
    targets_for_rank,
)
from reshard.convert import convert
from reshard.dcp.importer import import_dcp
from reshard.deepspeed.importer import import_deepspeed
from reshard.hf_export import export_hf
from reshard.hf_import import import_hf
from reshard.options import DCP_TRUST_PICKLE_HELP, DEEPSPEED_TRUST_PICKLE_HELP
from reshard.parse import human, parse_mesh
from shardfmt.cli.output import byte_bar
from shardfmt.training.roots import checkpoint_at


def run(name: str, args) -> int:
    """Run command ``name`` (``cmd_<name>``); SRC given with ``--src-step`` is a Checkpointer
    root, and the command reads its checkpoint of that step."""
    if getattr(args, "src_step", None) is not None:
        args.src = checkpoint_at(args.src, args.src_step, _opts(args))
    return globals()[f"cmd_{name}"](args)


def cmd_plan(args) -> int:
    mesh = parse_mesh(args.mesh)
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


def cmd_import_dcp(args) -> int:
    if not args.trust_pickle:
        print(f"reshard: error: import-dcp needs --trust-pickle. {DCP_TRUST_PICKLE_HELP}", file=sys.stderr)
        return 2
    bar = byte_bar("import-dcp", shown=not (args.no_progress or args.json))
    try:
        rep = import_dcp(args.src, args.dst, trust_pickle=True, storage_options=_opts(args),
                         memory_budget=args.memory_budget, step=args.step, overwrite=args.overwrite,
                         skip_unsupported_values=args.skip_unsupported_values,
                         progress=None if bar is None else bar.update)
    finally:
        if bar is not None:
            bar.close()
    for key, why in rep.skipped:
        print(f"reshard: warning: skipped value {key!r}: {why}", file=sys.stderr)
    m = open_checkpoint(args.dst, storage_options=_opts(args)).manifest  # (a v2 commit record lists no files)
    shards = sum(len(t.shards or t.listed or ()) for t in m.tensors.values() if t.stored)
    if args.json:
        sys.stdout.write(orjson.dumps({
            "src": args.src, "dst": args.dst, "tensors": len(m.tensors), "shards": shards, "files": len(m.files),
            "world_size": m.topology.world_size, "values": len(m.values), "bytes_read": rep.bytes_read,
            "skipped": [{"key": k, "why": w} for k, w in rep.skipped]}, option=orjson.OPT_INDENT_2).decode() + "\n")
        return 0
    print(f"imported {args.src} -> {args.dst}: {len(m.tensors)} tensors ({shards} shards) in {len(m.files)} "
          f"files from {m.topology.world_size} ranks, {len(m.values)} values, {rep.bytes_read} bytes read")
    return 0


def cmd_import_deepspeed(args) -> int:
    if not args.trust_pickle:
        print(f"reshard: error: import-deepspeed needs --trust-pickle. {DEEPSPEED_TRUST_PICKLE_HELP}", file=sys.stderr)
        return 2
    bar = byte_bar("import-deepspeed", shown=not args.no_progress)
    try:
        rep = import_deepspeed(args.src, args.dst, trust_pickle=True, tag=args.tag, model_prefix=args.model_prefix,
                               storage_options=_opts(args), memory_budget=args.memory_budget, step=args.step,
                               overwrite=args.overwrite, format_version=args.format_version, verify=not args.no_verify,
                               progress=None if bar is None else bar.update)
    finally:
        if bar is not None:
            bar.close()
    for name, why in rep.left_out:
        print(f"reshard: note: {name} left out: {why}", file=sys.stderr)
    m = rep.manifest
    print(f"imported {args.src} (tag {rep.tag}, ZeRO-{rep.zero_stage}, {rep.world_size} ranks, DeepSpeed "
          f"{rep.ds_version}) -> {args.dst}: {rep.params} trainable parameters, {len(m.tensors)} tensors, "
          f"{len(m.values)} values, {rep.bytes_read} bytes read")
    return 0


def _summary(nbytes: int, seconds: float) -> str:
    rate = f", {human(nbytes / seconds)}/s" if seconds > 0 else ""
    return f"{human(nbytes)} in {seconds:.2f} s{rate}"


def cmd_convert(args) -> int:
    rep = convert(args.src, args.dst, args.mesh, rules=args.rules, memory_budget=args.memory_budget,
                  dtype=args.dtype, verify=not args.no_verify, overwrite=args.overwrite, per_rank=args.per_rank,
                  deep_validate=args.deep_validate, storage_options=_opts(args), progress=not args.no_progress)
    if args.json:
        sys.stdout.write(orjson.dumps(rep.to_json(), option=orjson.OPT_INDENT_2).decode() + "\n")
        return 0
    for name in rep.dropped_values:
        print(f"reshard: note: per-rank value {name!r} left out (saved by {rep.src_world} ranks, "
              f"the new mesh has {rep.world})", file=sys.stderr)
    for i in rep.unused_rules:
        print(f"reshard: note: rule {i} of {args.rules} matched no tensor", file=sys.stderr)
    read = f", read {rep.bytes_read / rep.source_bytes:.2f}x the source" if rep.source_bytes else ""
    mesh = Mesh(rep.manifest.topology.mesh)
    print(f"converted {args.src} -> {args.dst}: {rep.src_world} -> {rep.world} ranks ({mesh}), {rep.files} "
          f"files, {_summary(rep.bytes_written, rep.seconds)}{read}; validated and committed")
    return 0


def cmd_export_hf(args) -> int:
    rep = export_hf(args.src, args.dst, max_shard_size=args.max_shard_size, dtype=args.dtype, only=args.only,
                    strip_prefix=args.strip_prefix, add_prefix=args.add_prefix, config=args.config,
                    memory_budget=args.memory_budget, verify=not args.no_verify, overwrite=args.overwrite,
                    storage_options=_opts(args), progress=not args.no_progress)
    if args.json:
        sys.stdout.write(orjson.dumps(rep.to_json(), option=orjson.OPT_INDENT_2).decode() + "\n")
        return 0
    for name, why in rep.omitted:
        print(f"reshard: note: {name} left out: {why}", file=sys.stderr)
    if rep.excluded:
        print(f"reshard: note: {rep.excluded} tensors outside the exported names left out "
              f"({'not under ' + repr(args.only) if args.only else 'optimizer state'})", file=sys.stderr)
    if not rep.config_written:
        print("reshard: note: no config.json written (none in the checkpoint's metadata['hf_config']; "
              "pass --config)", file=sys.stderr)
    print(f"exported {args.src} -> {args.dst}: {rep.tensors} tensors in {len(rep.files)} file(s), "
          f"{_summary(rep.total_size, rep.seconds)}")
    return 0


def cmd_import_hf(args) -> int:
    rep = import_hf(args.src, args.dst, mesh=args.mesh, rules=args.rules, dtype=args.dtype,
                    memory_budget=args.memory_budget, overwrite=args.overwrite, storage_options=_opts(args),
                    progress=not args.no_progress)
    if args.json:
        sys.stdout.write(orjson.dumps(rep.to_json(), option=orjson.OPT_INDENT_2).decode() + "\n")
        return 0
    tied = f"; {rep.tied_alias} also serves lm_head.weight (tied)" if rep.tied_alias else ""
    print(f"imported {args.src} -> {args.dst}: {rep.tensors} tensors from {len(rep.source_files)} file(s) into "
          f"{rep.manifest.topology.world_size} rank(s), {_summary(rep.bytes_written, rep.seconds)}{tied}")
    return 0


def _opts(args):
    return parse_storage_options(getattr(args, "storage_options", None))
