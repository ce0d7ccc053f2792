"""Every method a scenario can time, by name: shardfmt, DCP, torch.save, safetensors, floors.

Each ``Candidate`` is ``run(call) -> metrics`` plus what the harness must know around it:
its phase ``kind``, the save candidate a load ``reads``, the load that checks a save's
output (``check_with``, after its first run), whether the harness makes its output
directory, and the load layouts it can fill. This is the only module that calls shardfmt,
reshard or DCP (``states`` builds ``shardfmt.ShardedTensor`` targets; the driver reads
``shardfmt.__version__``), and the only one that imports anything beyond shardfmt's top-level
API: the planner (``Box``, ``TargetSlice``, ``plan_load``) and ``open_checkpoint`` for the
chunk-rounded need, the S3 upload constants, and the tools' modules. After issue 17's
re-layout (main at 68adf26) they are ``shardfmt.layout.geometry.Box``,
``shardfmt.loading.planner.{TargetSlice, plan_load}``, ``shardfmt.loading.reader.open_checkpoint``,
``shardfmt.io.fsspec.{S3_PART_SIZE, S3_WRITE_CONCURRENCY}`` and ``reshard.hf_export.export_hf``.

Saves write ``call.path`` (a fresh directory, or an s3:// prefix for ``@s3``); loads fill
``call.built`` (NaN targets) from ``call.src``; convert candidates read ``call.src`` and
write ``call.path``.
"""

from __future__ import annotations

import datetime as dt
import errno
import functools
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

import shardfmt
from reshard.convert import convert
from reshard.hf_export import export_hf
from shardfmt.io.client import S3_PART_SIZE, S3_WRITE_CONCURRENCY
from shardfmt.layout.geometry import Box
from shardfmt.loading.planner import TargetSlice, plan_load
from shardfmt.loading.reader import open_checkpoint

from . import floors
from .harness.calls import Call
from .harness.model import LAYOUTS
from .probes import files_under, fsync_path, remove

SAVE_TIMEOUT = dt.timedelta(minutes=15)


@dataclass(frozen=True, slots=True, kw_only=True)
class Candidate:
    name: str
    kind: str                               # the phase kind it runs in: save, load, convert
    run: Callable[[Call], dict | None]
    reads: str | None = None                # load/convert: the candidate whose output it reads
    check_with: str | None = None           # save: the load that checks its output after round 1
    makes_dir: bool = True                  # save: the harness creates call.path first
    storage: str = "local"                  # "s3": the path is on the loopback S3 server
    layouts: tuple[str, ...] = LAYOUTS      # load: the target layouts it can fill
    same_world: bool = False                # load: only on the world that saved
    exact_check: bool = True                # load: the targets are checked against the formula
    after: Callable[[Call], dict] | None = None  # untimed, after the call: more metrics of the same call


def s3_upload_bound() -> int:
    """Bytes an S3 upload of one rank may hold: 2 x part size x parts in flight."""
    return 2 * S3_PART_SIZE * S3_WRITE_CONCURRENCY


def chunk_needed(c: Call) -> dict:
    """The bytes this rank's targets need, rounded out to whole hash chunks: the least a verified read reads."""
    key = ("needed_chunks", c.phase, c.src)
    if key not in c.env.cache:
        m = open_checkpoint(c.src).manifest
        targets = [TargetSlice(index=k, fqn=s.fqn, box=Box(b.offsets, b.lengths))
                   for k, (s, b) in enumerate(zip(c.built.specs, c.built.boxes))]
        plan = plan_load(m, targets, verify=False, max_gap=0)
        chunks: dict[str, set[int]] = {}
        for r in plan.reads:
            grid = m.files[r.file].grid(m.chunk_size)  # v1: from byte 0; v2: cut at each shard's start
            for it in r.items:
                if it.src_end > it.src_start:
                    chunks.setdefault(r.file, set()).update(grid.span(it.src_start, it.src_end))
        grids = {f: m.files[f].grid(m.chunk_size) for f in chunks}
        c.env.cache[key] = {"needed_chunks": sum(grids[f].bounds(k)[1] - grids[f].bounds(k)[0]
                                                 for f, ks in chunks.items() for k in ks)}
    return c.env.cache[key]


# ----------------------------------------------------------------------------- shardfmt


def sf_save(c: Call, format_version: int | None = None) -> None:
    shardfmt.save(c.built.state, c.path, sync=c.env.fsync, timeout=SAVE_TIMEOUT, format_version=format_version)


def sf_async(c: Call, stage: str = "call") -> dict:
    stager = c.env.cache.setdefault("shardfmt.Stager", shardfmt.Stager())
    t0 = time.perf_counter()
    h = shardfmt.async_save(c.built.state, c.path, sync=c.env.fsync, stager=stager, stage=stage)
    blocked = time.perf_counter() - t0
    h.wait_staged()
    staged = time.perf_counter() - t0
    h.wait()
    return {"blocked": blocked, "staged": staged}


def sf_load(c: Call, max_gap: int | None = None, share_reads: bool | None = None, workers: int | None = None) -> dict:
    rep = shardfmt.load(c.built.state, c.src, max_gap=max_gap, share_reads=share_reads, workers=workers)
    # read_direct: 1 where the large reads of files read whole went around the page cache (the trial's outcome)
    direct = rep.read_mode is not None and rep.read_mode.mode == "direct"
    return {"bytes_read": rep.bytes_read, "bytes_needed": rep.bytes_needed, "read_requests": rep.read_requests,
            "read_direct": 1.0 if direct else 0.0, **{f"{phase}_s": seconds for phase, seconds in rep.phases.items()}}


def io_mode(mode: str, run: Callable[[Call], Any]) -> Callable[[Call], Any]:
    """``run`` with shardfmt's large transfers forced around the page cache (``direct``) or
    through it (``buffered``): ``SHARDFMT_DIRECT_IO`` set for the call (read at each use)."""
    def call(c: Call) -> Any:
        old = os.environ.get("SHARDFMT_DIRECT_IO")
        os.environ["SHARDFMT_DIRECT_IO"] = "1" if mode == "direct" else "0"
        try:
            return run(c)
        finally:
            if old is None:
                del os.environ["SHARDFMT_DIRECT_IO"]
            else:
                os.environ["SHARDFMT_DIRECT_IO"] = old
    return call


# ----------------------------------------------------------------------------- DCP


def _dcp_writer(c: Call, backend: bool = False):
    import torch.distributed.checkpoint as dcp

    if backend:  # shardfmt's DCP storage backend (shardfmt.dcp)
        from shardfmt.dcp import Writer

        return Writer(c.path, sync=c.env.fsync)
    if c.path.startswith("s3://"):
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        return FsspecWriter(c.path, sync_files=c.env.fsync)
    return dcp.FileSystemWriter(c.path, sync_files=c.env.fsync)


def dcp_save(c: Call, backend: bool = False) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save(c.built.state, storage_writer=_dcp_writer(c, backend), no_dist=not c.env.distributed)


def dcp_async(c: Call, background: bool = False) -> dict:
    import torch.distributed.checkpoint as dcp

    kw = {}
    if background:  # one reused stager, like shardfmt's (pinned + non-blocking on CUDA, no shared memory)
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        if "dcp.DefaultStager" not in c.env.cache:
            c.env.cache["dcp.DefaultStager"] = DefaultStager(StagingOptions(
                use_pinned_memory=c.env.cuda, use_shared_memory=False, use_async_staging=True,
                use_non_blocking_copy=c.env.cuda))
        kw["async_stager"] = c.env.cache["dcp.DefaultStager"]
    t0 = time.perf_counter()
    res = dcp.async_save(c.built.state, storage_writer=_dcp_writer(c), no_dist=not c.env.distributed, **kw)
    blocked = time.perf_counter() - t0
    staging = getattr(res, "staging_completion", None)  # an AsyncSaveResponse with an async stager
    if staging is not None:
        staging.result()
    staged = time.perf_counter() - t0
    getattr(res, "upload_completion", res).result()
    return {"blocked": blocked, "staged": staged}


def dcp_load(c: Call, backend: bool = False) -> None:
    import torch.distributed.checkpoint as dcp

    if backend:
        from shardfmt.dcp import Reader

        reader = Reader(c.src)
    elif c.src.startswith("s3://"):
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        reader = FsspecReader(c.src)
    else:
        reader = dcp.FileSystemReader(c.src)
    b = c.built
    if any(x.placement == "slice" for x in b.boxes):  # one process, a slice: DCP reads whole tensors
        full = c.env.cache.setdefault(("dcp.full", c.phase), {
            s.fqn: torch.empty(s.shape, dtype=getattr(torch, s.dtype), device=c.env.device) for s in b.specs})
        dcp.load(full, storage_reader=reader, no_dist=True)
        for s, x, t in zip(b.specs, b.boxes, b.locals):  # the copy of the slice is part of the time
            t.copy_(full[s.fqn][tuple(slice(o, o + n) for o, n in zip(x.offsets, x.lengths))])
        return
    dcp.load(b.state, storage_reader=reader, no_dist=not c.env.distributed)


# ----------------------------------------------------------------------------- torch, safetensors


def _rank_file(c: Call, path: str, ext: str) -> str:
    return os.path.join(path, f"rank_{c.env.rank}.{ext}")


def torch_save(c: Call) -> None:
    with open(_rank_file(c, c.path, "pt"), "wb") as f:
        torch.save({s.fqn: t for s, t in zip(c.built.specs, c.built.locals)}, f)
        if c.env.fsync:
            f.flush()
            os.fsync(f.fileno())


def torch_load(c: Call) -> None:
    got = torch.load(_rank_file(c, c.src, "pt"), weights_only=True, mmap=False, map_location=c.env.device)
    for s, t in zip(c.built.specs, c.built.locals):
        t.copy_(got[s.fqn])


def st_save(c: Call) -> None:
    from safetensors.torch import save_file

    path = _rank_file(c, c.path, "safetensors")
    save_file({s.fqn: t for s, t in zip(c.built.specs, c.built.locals)}, path)
    if c.env.fsync:
        fsync_path(path)


def st_load(c: Call) -> None:
    from safetensors.torch import load_file

    got = load_file(_rank_file(c, c.src, "safetensors"), device=str(c.env.device))
    for s, t in zip(c.built.specs, c.built.locals):
        t.copy_(got[s.fqn])


# ----------------------------------------------------------------------------- floors


def floor_write(c: Call, hashed: bool = True) -> None:
    b = c.built
    floors.write_floor(_rank_file(c, c.path, "bin"), b.locals, hashed=hashed, fsync=c.env.fsync,
                       host=c.env.bounce("save", b.locals))


def floor_read(c: Call, hashed: bool = True, direct: bool = False, hinted: bool = False) -> dict | None:
    b = c.built
    key = ("floor.plan", c.phase, c.src)
    if key not in c.env.cache:
        c.env.cache[key] = floors.floor_reads(b.specs, b.boxes, c.src, src_world=c.src_world, rank=c.env.rank)
    reads, _ = c.env.cache[key]
    host = c.env.bounce(f"load:{c.phase}", b.locals)
    if direct:
        try:
            floors.read_floor_direct(reads, b.locals, hashed=hashed, host=host)
            return {"floor_direct": 1.0}
        except OSError as e:  # a filesystem without O_DIRECT: the buffered floor, said so in the record
            if e.errno != errno.EINVAL:
                raise
    floors.read_floor(reads, b.locals, hashed=hashed, host=host, hinted=hinted)
    return {"floor_direct": 0.0} if direct else None


def memcpy(c: Call) -> None:
    b = c.built
    floors.memcpy(c.env.host("memcpy", b.locals), b.locals, non_blocking=c.env.cuda)


# ----------------------------------------------------------------------------- offline tools


def _data_files(src: str) -> list[str]:
    return [p for p in files_under(src) if p.endswith(".safetensors")]


def copy_floor(c: Call, *, hashed: bool, overlapped: bool) -> dict:
    return {"bytes_read": floors.copy_files(_data_files(c.src), c.path, hashed=hashed, overlapped=overlapped)}


def convert_to(mesh: str, budget_mib: int) -> Callable[[Call], dict]:
    def run(c: Call) -> dict:
        rep = convert(c.src, c.path, mesh, memory_budget=budget_mib << 20)
        return {"bytes_read": rep.bytes_read, "source_bytes": rep.source_bytes, "windows": rep.windows,
                "read_x": rep.bytes_read / rep.source_bytes}
    return run


def export_hf_at(budget_mib: int) -> Callable[[Call], dict]:
    def run(c: Call) -> dict:
        rep = export_hf(c.src, c.path, memory_budget=budget_mib << 20)
        return {"bytes_read": rep.bytes_read, "files": len(rep.files)}
    return run


def dcp_to_hf(c: Call) -> None:
    """The DCP route to a Hugging Face file: dcp_to_torch_save + torch.load + save_file (+ fsync)."""
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    os.makedirs(c.path, exist_ok=True)
    pt = os.path.join(c.path, "full.pt")
    dcp_to_torch_save(c.src, pt)
    sd = torch.load(pt, weights_only=True)
    target = os.path.join(c.path, "model.safetensors")
    save_file(sd, target, metadata={"format": "pt"})
    fsync_path(target)


def save_tp_pp(c: Call) -> None:
    """A one-process save converted to pp=2 x tp=2 (Megatron splits by each tensor's shard_dim)."""
    b = c.built
    shapes = {s.fqn: s.shape for s in b.specs}
    (vocab, hidden), ffn = shapes["model.embed_tokens.weight"], shapes["model.layers.0.mlp.gate_proj.weight"][0]
    layers = sum(1 for s in b.specs if s.fqn.endswith("input_layernorm.weight"))
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
           "intermediate_size": ffn, "vocab_size": vocab, "num_hidden_layers": layers,
           "num_attention_heads": 16, "num_key_value_heads": 16, "tie_word_embeddings": False}
    one, rules = c.path + ".one-rank", c.path + ".rules.json"
    shardfmt.save(b.state, one, metadata={"hf_config": cfg}, sync=c.env.fsync)
    place = {0: {"tp": ["shard", 0]}, 1: {"tp": ["shard", 1]}, None: {}}
    with open(rules, "w") as f:
        json.dump({"rules": [{"match": f"^{s.fqn}$".replace(".", "\\."), "placements": place[s.shard_dim]}
                             for s in b.specs]}, f)
    try:
        convert(one, c.path, "pp=2,tp=2", rules=rules)
    finally:
        remove(one)
        remove(rules)


# ----------------------------------------------------------------------------- the registry


def _all() -> list[Candidate]:
    S, L, C = "save", "load", "convert"
    same = ("rows",)
    return [
        Candidate(name="memcpy", kind=S, run=memcpy, makes_dir=False),
        Candidate(name="floor.write", kind=S, run=floor_write),
        Candidate(name="raw.write", kind=S, run=lambda c: floor_write(c, hashed=False)),
        Candidate(name="shardfmt.save", kind=S, run=sf_save, makes_dir=False),
        Candidate(name="shardfmt.save.v1", kind=S, run=lambda c: sf_save(c, 1), makes_dir=False),
        Candidate(name="shardfmt.save@s3", kind=S, run=sf_save, makes_dir=False, storage="s3"),
        Candidate(name="shardfmt.async_save", kind=S, run=sf_async, makes_dir=False, check_with="shardfmt.load"),
        Candidate(name="shardfmt.async_save.bg", kind=S, run=lambda c: sf_async(c, "background"), makes_dir=False,
                  check_with="shardfmt.load"),
        Candidate(name="dcp.save", kind=S, run=dcp_save),
        Candidate(name="dcp+shardfmt.save", kind=S, run=functools.partial(dcp_save, backend=True), makes_dir=False),
        Candidate(name="dcp.save@s3", kind=S, run=dcp_save, makes_dir=False, storage="s3"),
        Candidate(name="dcp.async_save", kind=S, run=dcp_async, check_with="dcp.load"),
        Candidate(name="dcp.async_save.bg", kind=S, run=lambda c: dcp_async(c, True), check_with="dcp.load"),
        Candidate(name="torch.save", kind=S, run=torch_save),
        Candidate(name="safetensors.save", kind=S, run=st_save),
        Candidate(name="shardfmt.save(pp=2,tp=2)", kind=S, run=save_tp_pp, makes_dir=False),
        Candidate(name="floor.read", kind=L, run=floor_read, reads="floor.write", exact_check=False),
        Candidate(name="floor.read@hinted", kind=L, run=functools.partial(floor_read, hinted=True),
                  reads="floor.write", exact_check=False),
        Candidate(name="floor.read@direct", kind=L, run=functools.partial(floor_read, direct=True),
                  reads="floor.write", exact_check=False),
        Candidate(name="raw.read", kind=L, run=lambda c: floor_read(c, hashed=False), reads="raw.write",
                  exact_check=False),
        Candidate(name="shardfmt.load", kind=L, run=sf_load, reads="shardfmt.save", after=chunk_needed),
        Candidate(name="shardfmt.load.v1", kind=L, run=sf_load, reads="shardfmt.save.v1"),
        *[Candidate(name=f"shardfmt.save@{m}", kind=S, run=io_mode(m, sf_save), makes_dir=False)
          for m in ("direct", "buffered")],
        *[Candidate(name=f"shardfmt.load@{m}", kind=L, run=io_mode(m, sf_load), reads="shardfmt.save",
                    after=chunk_needed) for m in ("direct", "buffered")],
        *[Candidate(name=f"shardfmt.load@{m}/w{w}", kind=L, run=io_mode(m, functools.partial(sf_load, workers=w)),
                    reads="shardfmt.save", after=chunk_needed) for m in ("direct", "buffered") for w in (1, 2, 8)],
        *[Candidate(name=f"shardfmt.load@gap={label}", kind=L, run=functools.partial(sf_load, max_gap=gap),
                    reads="shardfmt.save", after=chunk_needed) for label, gap in (("0", 0), ("1MiB", 1 << 20))],
        Candidate(name="shardfmt.load@s3", kind=L, run=sf_load, reads="shardfmt.save@s3", storage="s3"),
        Candidate(name="shardfmt.load@s3/alone", kind=L, run=functools.partial(sf_load, share_reads=False),
                  reads="shardfmt.save@s3", storage="s3"),
        Candidate(name="dcp.load", kind=L, run=dcp_load, reads="dcp.save"),
        Candidate(name="dcp+shardfmt.load", kind=L, run=functools.partial(dcp_load, backend=True),
                  reads="dcp+shardfmt.save"),
        Candidate(name="dcp.load@s3", kind=L, run=dcp_load, reads="dcp.save@s3", storage="s3"),
        Candidate(name="torch.load", kind=L, run=torch_load, reads="torch.save", layouts=same, same_world=True),
        Candidate(name="safetensors.load", kind=L, run=st_load, reads="safetensors.save", layouts=same,
                  same_world=True),
        Candidate(name="copy", kind=C, run=lambda c: copy_floor(c, hashed=False, overlapped=False),
                  reads="shardfmt.save(pp=2,tp=2)"),
        Candidate(name="copy||", kind=C, run=lambda c: copy_floor(c, hashed=False, overlapped=True),
                  reads="shardfmt.save(pp=2,tp=2)"),
        Candidate(name="copy+hash", kind=C, run=lambda c: copy_floor(c, hashed=True, overlapped=False),
                  reads="shardfmt.save(pp=2,tp=2)"),
        *[Candidate(name=f"convert@{b}", kind=C, run=convert_to("tp=4", b), reads="shardfmt.save(pp=2,tp=2)")
          for b in (1024, 256)],
        Candidate(name="export-hf@256", kind=C, run=export_hf_at(256), reads="shardfmt.save(pp=2,tp=2)"),
        Candidate(name="dcp->hf", kind=C, run=dcp_to_hf, reads="dcp.save"),
    ]


CANDIDATES: dict[str, Candidate] = {c.name: c for c in _all()}


def get(name: str) -> Candidate:
    if name not in CANDIDATES:
        raise KeyError(f"unknown candidate {name!r} (known: {', '.join(CANDIDATES)})")
    return CANDIDATES[name]
