"""The ``shardfmt`` commands that read checkpoints and roots: validate, inspect, ls, gc.

``shardfmt.cli`` imports this module only once one of them runs: they need torch, which
``--help`` and ``--version`` never import.
"""

from __future__ import annotations

import fnmatch
import time
from collections import Counter

from shardfmt.cli.output import byte_bar, human, print_json, usage
from shardfmt.errors import ShardfmtError
from shardfmt.format import jsonvalue, refs
from shardfmt.io.registry import get_storage, parse_storage_options
from shardfmt.loading.reader import open_checkpoint
from shardfmt.training.roots import (
    checkpoint_at,
    collect_garbage,
    leased_saves,
    list_checkpoints,
    require_root,
)
from shardfmt.validation import validate


def _storage_options(args) -> dict | None:
    try:
        return parse_storage_options(getattr(args, "storage_options", None))
    except ValueError as e:
        raise SystemExit(usage("shardfmt", str(e))) from None


def cmd_validate(args) -> int:
    bar = byte_bar("validate", shown=args.deep and not args.json)  # a deep check reads every byte
    try:
        report = validate(checkpoint_at(args.path, args.step, _storage_options(args)), deep=args.deep,
                          storage_options=_storage_options(args),
                          progress=None if bar is None else bar.update)
    finally:
        if bar is not None:
            bar.close()
    if args.json:
        print_json(report.to_json())
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


def _placement(rec) -> str:
    """How a tensor record is laid out, in words: ``dp:Shard(0) tp:Replicate``, ``2 shards``..."""
    if rec.alias_of is not None:
        return f"alias of {rec.alias_of}"
    if rec.view is not None:
        return f"view of {rec.view.base}"
    p = rec.placement
    if p is not None and p.placements:
        words = {"shard": "Shard", "strided_shard": "StridedShard", "replicate": "Replicate"}
        parts = [f"{d}:{words.get(pl[0], pl[0])}" + (f"({', '.join(map(str, pl[1:]))})" if len(pl) > 1 else "")
                 for d, pl in zip(p.mesh_dims, p.placements)]
        return " ".join(parts) + ("" if p.stage is None else f" stage {p.stage}")
    n = len(rec.listed) if rec.listed is not None else len(rec.shards)
    return "whole" if n == 1 else f"{n} boxes"


def tensor_rows(manifest, pattern: str = "*") -> list[dict]:
    """One row per tensor whose name matches the glob ``pattern``, in name order."""
    return [{"name": name, "shape": list(rec.shape), "dtype": rec.dtype, "placement": _placement(rec),
             "bytes": rec.nbytes if rec.stored else 0}
            for name, rec in sorted(manifest.tensors.items()) if fnmatch.fnmatchcase(name, pattern)]


def _print_tensors(rows: list[dict]) -> None:
    if not rows:
        print("no tensor matches")
        return
    width = min(60, max(len(r["name"]) for r in rows))
    for r in rows:
        shape = "x".join(map(str, r["shape"])) or "scalar"
        print(f"{r['name']:<{width}}  {shape:>16}  {r['dtype']:<6} {human(r['bytes']):>10}  {r['placement']}")


def cmd_inspect(args) -> int:
    ckpt = open_checkpoint(checkpoint_at(args.path, args.step, _storage_options(args)),
                           storage_options=_storage_options(args))
    if args.tensors is not None:
        rows = tensor_rows(ckpt.manifest, args.tensors)
        if args.json:
            print_json(rows)
        else:
            _print_tensors(rows)
        return 0
    info = inspect_summary(ckpt.manifest)
    if args.json:
        print_json(info)
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
        print(f"  {k:<12} {human(v):>12}")
    costs = info.get("save_costs")
    if costs:
        last = costs["last"]
        print(f"save costs  this run's {costs['saves']} earlier save(s): the loop waited {costs['blocked_s']:.3f} s, "
              f"{costs['total_s']:.3f} s to the commit (medians); the last (step {last['step']}): "
              f"{last['blocked_s']:.3f} s / {last['total_s']:.3f} s, {human(last['bytes'])} from rank 0")
    if info["chain"] is not None:
        print(f"incremental depth {info['chain']['depth']}, bases {', '.join(info['chain']['bases'])}; "
              f"{human(info['own_bytes'])} of its files are its own, the rest its bases'")
    print(f"files       {len(info['files'])}, {human(info['total_bytes'])} in all")
    for name, size in info["files"].items():
        print(f"  {name:<40} {human(size):>12}")
    return 0


def cmd_ls(args) -> int:
    rows = list_checkpoints(args.root, _storage_options(args))
    if args.json:
        print_json(rows)
        return 0
    if not rows:
        print(f"{args.root}: no checkpoints")
        return 0
    print(f"{'name':<36} {'step':>10} {'size':>12}  status")
    for r in rows:
        step = "-" if r["step"] is None else str(r["step"])
        size = "-" if r["size"] is None else human(r["size"])
        extra = f"  ({r['reason']})" if r["reason"] else ""
        print(f"{r['name']:<36} {step:>10} {size:>12}  {r['status']}{extra}")
    return 0


def cmd_gc(args) -> int:
    storage, root = get_storage(args.root, _storage_options(args))
    require_root(storage, root)
    now = time.time()
    removed = collect_garbage(storage, root, lease_seconds=args.lease_seconds, dry_run=args.dry_run, now=now)
    leased = leased_saves(storage, root, lease_seconds=args.lease_seconds, now=now)
    if args.json:
        print_json({"removed": removed, "dry_run": args.dry_run,
                    "leased": [{"path": s.url, "expires_in_s": round(s.expires_at - now, 1)} for s in leased]})
        return 0
    for u in removed:
        print(("would remove " if args.dry_run else "removed ") + u)
    for s in leased:
        when = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(s.expires_at))
        print(f"left {s.url}: its save holds a lease until {when} (in {_duration(s.expires_at - now)}; "
              "a live save renews it)")
    if not removed and not leased:
        print(f"{args.root}: nothing to collect")
    return 0


def _duration(seconds: float) -> str:
    seconds = max(0, round(seconds))
    return f"{seconds // 60} min {seconds % 60} s" if seconds >= 60 else f"{seconds} s"
