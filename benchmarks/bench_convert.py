"""Offline conversion: ``reshard convert`` and ``export-hf`` vs the raw I/O floor and the DCP route.

One ~2 GiB Llama-shaped fp32 checkpoint, saved as 4 ranks (pp=2, tp=2: Megatron column/row
splits, replicated norms) and, for the DCP route, as a torch.distributed.checkpoint of the
same state. Every method runs in a fresh process on a cold page cache (the source is fsynced
and dropped from the cache first), writes with fsync, and is measured for wall time and peak
RSS growth over the process's RSS before the call (VmRSS sampled in a thread):

    raw          read every source data file and write the same bytes to new files (the floor)
    raw||        the same with reads overlapped with writes (a reader thread, two 8 MiB buffers):
                 the stronger floor, as convert overlaps them too
    raw+hash     the same with xxh3 over every 1 MiB chunk read and written (what a verified
                 convert must do at least)
    convert@B    reshard convert to --dst-mesh with a B MiB memory budget
    export@B     reshard export-hf with a B MiB budget
    dcp          dcp_to_torch_save + torch.load + safetensors save_file (+ fsync)

Targets (issue 6): convert >= 0.7x the raw read+write throughput; peak RSS growth <= budget +
32 MiB; at a 256 MiB budget export-hf faster than the DCP route with less than half its RSS
growth.

    python benchmarks/bench_convert.py                    # ~2 GiB, 2 rounds
    python benchmarks/bench_convert.py --size-mib 512 --rounds 1 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import traceback

from common import (
    MIB,
    PIECE,
    ROOT,
    RSSSampler,
    code_fingerprint,
    drop_cache,
    files_under,
    fsync_path,
    hash_chunks,
    launch,
    malloc_trim,
    remove,
    rotate,
)

HIDDEN, FFN, VOCAB = 2048, 5632, 32000


def make_spec(size_mib: int) -> list[tuple[str, tuple[int, ...], int | None]]:
    """(name, shape, tp dim or None) of a Llama-shaped model of about ``size_mib`` MiB (fp32)."""
    out = [("model.embed_tokens.weight", (VOCAB, HIDDEN), 0), ("lm_head.weight", (VOCAB, HIDDEN), 0),
           ("model.norm.weight", (HIDDEN,), None)]
    layer = [("self_attn.q_proj.weight", (HIDDEN, HIDDEN), 0), ("self_attn.k_proj.weight", (HIDDEN, HIDDEN), 0),
             ("self_attn.v_proj.weight", (HIDDEN, HIDDEN), 0), ("self_attn.o_proj.weight", (HIDDEN, HIDDEN), 1),
             ("mlp.gate_proj.weight", (FFN, HIDDEN), 0), ("mlp.up_proj.weight", (FFN, HIDDEN), 0),
             ("mlp.down_proj.weight", (HIDDEN, FFN), 1), ("input_layernorm.weight", (HIDDEN,), None),
             ("post_attention_layernorm.weight", (HIDDEN,), None)]
    per_layer = sum(4 * _numel(s) for _, s, _ in layer)
    fixed = sum(4 * _numel(s) for _, s, _ in out)
    layers = max(2, round((size_mib * MIB - fixed) / per_layer))
    layers += layers % 2  # two pipeline stages
    for i in range(layers):
        out += [(f"model.layers.{i}.{n}", s, d) for n, s, d in layer]
    return out


def _numel(shape) -> int:
    n = 1
    for x in shape:
        n *= x
    return n


def spec_bytes(spec) -> int:
    return sum(4 * _numel(s) for _, s, _ in spec)


# ----------------------------------------------------------------------------- jobs (one process each)


def _stage_of(name: str, layers: int) -> int:
    if ".layers." in name:
        return int(name.split(".layers.")[1].split(".")[0]) * 2 // layers
    return 0 if "embed_tokens" in name else 1


def job_setup(a: dict) -> list[dict]:
    """Write the source checkpoint (4 ranks, pp=2 x tp=2) and the DCP checkpoint of the same state."""
    import torch
    import torch.distributed.checkpoint as dcp

    import shardfmt
    from shardfmt.format.manifest import Topology
    from shardfmt.layout.dtensor import placement_record
    from shardfmt.layout.topology import Layout, Shard

    spec = make_spec(a["size_mib"])
    layers = 1 + max(int(n.split(".layers.")[1].split(".")[0]) for n, _, _ in spec if ".layers." in n)
    g = torch.Generator().manual_seed(0)
    state = {n: torch.empty(s).uniform_(-1, 1, generator=g) for n, s, _ in spec}
    w = shardfmt.saving.writer.CheckpointWriter(a["src"])
    for pp in range(2):
        for tp in range(2):
            mine = []
            for n, s, d in spec:
                if _stage_of(n, layers) != pp:
                    continue
                t = state[n]
                if d is None:
                    if tp == 0:  # replicated over tp: written once
                        mine.append(shardfmt.saving.writer.ShardData(fqn=n, data=t, global_shape=s, offsets=(0,) * len(s),
                                                       placement=placement_record(Layout((), (), stage=pp))))
                    continue
                k = s[d] // 2
                offs = [0] * len(s)
                offs[d] = tp * k
                mine.append(shardfmt.saving.writer.ShardData(
                    fqn=n, data=t.narrow(d, tp * k, k).contiguous(), global_shape=s, offsets=tuple(offs),
                    placement=placement_record(Layout(("tp",), (Shard(d),), stage=pp))))
            w.write_rank(pp * 2 + tp, mine)
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
           "intermediate_size": FFN, "vocab_size": VOCAB, "num_hidden_layers": layers,
           "num_attention_heads": 16, "num_key_value_heads": 16, "tie_word_embeddings": False}
    w.commit(topology=Topology(world_size=4, mesh=(("pp", 2), ("tp", 2))), metadata={"hf_config": cfg})
    dcp.save(state, checkpoint_id=a["dcp"], no_dist=True)
    for p in files_under(a["dcp"]):
        fsync_path(p)
    return [{"method": "setup", "bytes": spec_bytes(spec), "tensors": len(spec)}]


def _data_files(src: str) -> list[str]:
    return [p for p in files_under(src) if p.endswith(".safetensors")]


def _raw(a: dict, hashed: bool) -> dict:
    import torch

    out = a["out"]
    os.makedirs(out, exist_ok=True)
    buf = torch.empty(PIECE, dtype=torch.uint8)
    mv = memoryview(buf.numpy()).cast("B")
    total = 0
    for i, path in enumerate(_data_files(a["src"])):
        size = os.path.getsize(path)
        rfd = os.open(path, os.O_RDONLY)
        wfd = os.open(os.path.join(out, f"f{i}"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            pos = 0
            while pos < size:
                n = os.preadv(rfd, [mv[: min(PIECE, size - pos)]], pos)
                piece = mv[:n]
                if hashed:
                    hash_chunks(piece)  # verify on read
                    hash_chunks(piece)  # hash on write
                done = 0
                while done < n:
                    done += os.write(wfd, piece[done:])
                pos += n
            os.fsync(wfd)
        finally:
            os.close(rfd)
            os.close(wfd)
        total += size
    return {"bytes_read": total}


def _raw_pipelined(a: dict) -> dict:
    """Read into one 8 MiB buffer on a thread while the other is written: I/O overlapped."""
    from concurrent.futures import ThreadPoolExecutor

    import torch

    out = a["out"]
    os.makedirs(out, exist_ok=True)
    bufs = [memoryview(torch.empty(PIECE, dtype=torch.uint8).numpy()).cast("B") for _ in range(2)]
    total = 0

    def read(fd: int, k: int, pos: int, n: int) -> memoryview:
        got = 0
        while got < n:
            got += os.preadv(fd, [bufs[k][got:n]], pos + got)
        return bufs[k][:n]

    with ThreadPoolExecutor(max_workers=1) as pool:
        for i, path in enumerate(_data_files(a["src"])):
            size = os.path.getsize(path)
            rfd = os.open(path, os.O_RDONLY)
            wfd = os.open(os.path.join(out, f"f{i}"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                starts = list(range(0, size, PIECE))
                fut = pool.submit(read, rfd, 0, 0, min(PIECE, size)) if starts else None
                for j in range(len(starts)):
                    piece = fut.result()
                    if j + 1 < len(starts):
                        nxt = starts[j + 1]
                        fut = pool.submit(read, rfd, (j + 1) % 2, nxt, min(PIECE, size - nxt))
                    done = 0
                    while done < len(piece):
                        done += os.write(wfd, piece[done:])
                os.fsync(wfd)
            finally:
                os.close(rfd)
                os.close(wfd)
            total += size
    return {"bytes_read": total}


def job_run(a: dict) -> list[dict]:
    """Run one method on a cold cache, timed, with RSS sampled."""
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    method = a["method"]

    if method == "dcp":
        import torch.distributed.checkpoint.format_utils  # noqa: F401
        from safetensors.torch import save_file  # noqa: F401
    malloc_trim()
    sampler = RSSSampler()
    before = sampler.start()
    t0 = time.perf_counter()
    extra: dict = {}
    if method in ("raw", "raw+hash"):
        extra = _raw(a, method == "raw+hash")
    elif method == "raw||":
        extra = _raw_pipelined(a)
    elif method.startswith("convert@"):
        from reshard.convert import convert

        rep = convert(a["src"], a["out"], a["dst_mesh"], memory_budget=a["budget"])
        extra = {"bytes_read": rep.bytes_read, "windows": rep.windows, "source_bytes": rep.source_bytes}
    elif method.startswith("export@"):
        from reshard.hf_export import export_hf

        rep = export_hf(a["src"], a["out"], memory_budget=a["budget"])
        extra = {"bytes_read": rep.bytes_read, "files": len(rep.files)}
    elif method == "dcp":
        from safetensors.torch import save_file
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        os.makedirs(a["out"], exist_ok=True)
        pt = os.path.join(a["out"], "full.pt")
        dcp_to_torch_save(a["dcp"], pt)
        sd = torch.load(pt, weights_only=True)
        target = os.path.join(a["out"], "model.safetensors")
        save_file(sd, target, metadata={"format": "pt"})
        fsync_path(target)
        del sd
    else:
        raise ValueError(method)
    seconds = time.perf_counter() - t0
    peak = sampler.stop()
    sampler.close()
    return [{"method": method, "round": a["round"], "seconds": seconds, "rss_growth": peak - before,
             "budget": a.get("budget"), **extra}]


JOBS = {"setup": job_setup, "run": job_run}


def worker_main(argv: list[str]) -> None:
    name, rank, _world, _port, raw = argv[0], int(argv[1]), int(argv[2]), int(argv[3]), argv[4]
    args = json.loads(raw)
    try:
        result = {"ok": True, "records": JOBS[name](args)}
    except BaseException as e:  # noqa: BLE001 - reported to the driver
        result = {"ok": False, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc(), "records": []}
        print(result["trace"], file=sys.stderr, flush=True)
    with open(os.path.join(args["out_dir"], f"rank_{rank}.json"), "w") as f:
        json.dump(result, f)
    os._exit(0 if result["ok"] else 1)


# ----------------------------------------------------------------------------- driver


def summarize(records: list[dict], state_bytes: int) -> dict:
    by: dict[str, list[dict]] = {}
    for r in records:
        if r["method"] != "setup":
            by.setdefault(r["method"], []).append(r)
    out = {}
    for m, rs in by.items():
        secs = statistics.median(r["seconds"] for r in rs)
        out[m] = {"seconds": secs, "gbps": state_bytes / secs / 1e9, "runs": [round(r["seconds"], 2) for r in rs],
                  "rss_growth_mib": max(r["rss_growth"] for r in rs) / MIB, "budget_mib": (rs[0]["budget"] or 0) / MIB,
                  "read_x": (statistics.median(r["bytes_read"] for r in rs) / rs[0]["source_bytes"]
                             if rs[0].get("source_bytes") else None)}
    return out


def targets_of(s: dict) -> list[dict]:
    t = []
    for m, v in s.items():
        for floor in ("raw", "raw||"):
            if m.startswith("convert@") and floor in s:
                ratio = s[floor]["seconds"] / v["seconds"]
                t.append({"target": f"{m} throughput >= 0.7x {floor} read+write", "value": round(ratio, 2),
                          "pass": ratio >= 0.7})
        if m.startswith(("convert@", "export@")):
            t.append({"target": f"{m} RSS growth <= budget + 32 MiB", "value": round(v["rss_growth_mib"], 1),
                      "limit": v["budget_mib"] + 32, "pass": v["rss_growth_mib"] <= v["budget_mib"] + 32})
    e, d = s.get("export@256"), s.get("dcp")
    if e and d:
        t.append({"target": "export@256 faster than the DCP route", "value": round(d["seconds"] / e["seconds"], 2),
                  "pass": e["seconds"] < d["seconds"]})
        t.append({"target": "export@256 RSS growth < half the DCP route's",
                  "value": round(e["rss_growth_mib"] / max(d["rss_growth_mib"], 1e-9), 3),
                  "pass": e["rss_growth_mib"] < d["rss_growth_mib"] / 2})
    return t


def main(argv=None) -> int:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--worker":
        sys.path.insert(0, ROOT)
        worker_main(sys.argv[2:])
        return 0
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mib", type=int, default=2048, help="checkpoint size in MiB (default 2048; rounded)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--dst-mesh", default="tp=4", help="convert's new mesh (source: pp=2,tp=2; default tp=4)")
    p.add_argument("--budgets", default="1024,256", help="convert/export memory budgets in MiB (default 1024,256)")
    p.add_argument("--methods", default="raw,raw||,raw+hash,convert,export,dcp")
    p.add_argument("--dir", default=None, help="scratch directory (default: a temp dir under /tmp, removed after)")
    p.add_argument("--json", default=None, help="write records, summary and targets to this file")
    p.add_argument("--job-timeout", type=float, default=1800.0)
    args = p.parse_args(argv)
    scratch = args.dir or tempfile.mkdtemp(prefix="shardfmt-cbench-", dir="/tmp")
    own = args.dir is None
    os.makedirs(scratch, exist_ok=True)
    src, dcp_dir, out = (os.path.join(scratch, x) for x in ("src", "dcp", "out"))
    budgets = [int(x) for x in args.budgets.split(",") if x]
    methods = []
    for m in args.methods.split(","):
        if m in ("convert", "export"):
            methods += [f"{m}@{b}" for b in budgets]
        elif m:
            methods.append(m)
    code0 = code_fingerprint()
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    records: list[dict] = []
    try:
        print(f"setup: {args.size_mib} MiB state -> {src} (4 ranks, pp=2 x tp=2) and {dcp_dir} (DCP)", flush=True)
        records += launch(__file__, "setup", 1, {"size_mib": args.size_mib, "src": src, "dcp": dcp_dir},
                          os.path.join(scratch, "logs", "setup"), args.job_timeout)
        state_bytes = records[0]["bytes"]
        for rnd in range(args.rounds):
            for m in rotate(methods, rnd):
                remove(out)
                drop_cache(src)
                drop_cache(dcp_dir)
                a = {"method": m, "round": rnd, "src": src, "dcp": dcp_dir, "out": out, "dst_mesh": args.dst_mesh}
                if "@" in m:
                    a["budget"] = int(m.split("@")[1]) * MIB
                rec = launch(__file__, "run", 1, a, os.path.join(scratch, "logs", f"{m}.{rnd}"), args.job_timeout)
                records += rec
                r = rec[0]
                print(f"round {rnd} {m:>12}: {r['seconds']:7.2f} s  {state_bytes / r['seconds'] / 1e9:5.2f} GB/s  "
                      f"RSS +{r['rss_growth'] / MIB:7.1f} MiB"
                      + (f"  read {r['bytes_read'] / r['source_bytes']:.3f}x" if r.get("source_bytes") else ""),
                      flush=True)
                remove(out)
    finally:
        if own:
            shutil.rmtree(scratch, ignore_errors=True)
    summary = summarize(records, state_bytes)
    targets = targets_of(summary)
    print(f"\n{state_bytes / 1e9:.2f} GB of fp32 weights, {records[0]['tensors']} tensors; medians of {args.rounds} "
          f"round(s), cold page cache, fsync on")
    print(f"{'method':>12} {'seconds':>8} {'GB/s':>6} {'x raw':>6} {'RSS MiB':>8} {'read x':>7}")
    raw = summary.get("raw", {}).get("seconds")
    for m, v in summary.items():
        print(f"{m:>12} {v['seconds']:8.2f} {v['gbps']:6.2f} {(raw / v['seconds'] if raw else float('nan')):6.2f} "
              f"{v['rss_growth_mib']:8.1f} {'' if v['read_x'] is None else format(v['read_x'], '.3f'):>7}")
    print()
    for t in targets:
        print(f"{'PASS' if t['pass'] else 'FAIL'}  {t['target']}: {t['value']}"
              + (f" (limit {t['limit']:.0f})" if "limit" in t else ""))
    code1 = code_fingerprint()
    wall = time.perf_counter() - t0
    print(f"\nwall {wall:.0f}s; load average before {load_before[0]:.2f}, after {os.getloadavg()[0]:.2f} "
          "(the machine is shared: a high value means noisy figures)"
          + ("" if code0 == code1 else "\nWARNING: sources changed during the run"))
    if args.json:
        import torch

        with open(args.json, "w") as f:
            json.dump({"records": records, "summary": summary, "targets": targets, "wall_s": wall,
                       "env": {"python": platform.python_version(), "torch": torch.__version__,
                               "cpus": os.cpu_count(), "argv": sys.argv[1:], "code": code0}}, f, indent=1)
        print(f"wrote {args.json}")
    return 0 if all(t["pass"] for t in targets) else 1


if __name__ == "__main__":
    sys.exit(main())
