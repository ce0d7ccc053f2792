"""shardfmt checkpoint -> the Hugging Face safetensors layout, streaming in bounded memory.

``export_hf(src, dst)`` writes the consolidated layout ``transformers``' ``from_pretrained``
loads: ``model.safetensors`` when everything fits in one shard (as ``save_pretrained``
does), else ``model-0000K-of-0000N.safetensors`` plus ``model.safetensors.index.json``
(``weight_map``, ``metadata.total_size``), and ``config.json`` — given, or taken from the
checkpoint's ``metadata["hf_config"]`` (``metadata["user"]["hf_config"]`` for a Checkpointer
save). Names are kept unless mapped: ``only`` selects a subtree and strips its prefix
(``only="model"`` turns ``model.model.layers.0...`` into ``model.layers.0...``), then
``strip_prefix`` and ``add_prefix`` apply. Without ``only``, the top-level ``optim`` and
``optimizer`` subtrees are left out. Tied weights: an alias is written as its own copy
(plain safetensors has no aliasing) except the output embedding ``lm_head.weight`` when the
config's ``tie_word_embeddings`` is true — then it is omitted if it is an alias of, or equal
to, the exported input embedding (transformers ties it again on load), and export fails if
it differs. Views of a shared storage are written materialised.

Protocol of ``export_hf``: 1) parse the arguments, refuse a destination over the source or
one that exists (without ``overwrite``); 2) map names (``select_names``) and leave out a tied
``lm_head.weight``; 3) ``plan_export`` (pure): cut the tensors into files and write their
headers; 4) plan the windows, check the source headers; 5) stream into a staged directory,
add the index and config, publish it (``reshard.publish``).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson
import torch

from reshard._shardfmt import (
    Box,
    EncodedHeader,
    Manifest,
    box_spans,
    dtype_code,
    encode_header,
    get_storage,
    jsonvalue,
    open_checkpoint,
)
from reshard.errors import ConfigError, HFError
from reshard.hf_layout import (
    CONFIG_NAME,
    HF_CONFIG_KEY,
    INDEX_NAME,
    INPUT_EMBEDDING_RE,
    OUTPUT_EMBEDDING,
    shard_name,
)
from reshard.options import DEFAULT_MAX_SHARD_SIZE
from reshard.overlap import refuse_overlap
from reshard.parse import out_dtype, parse_dtype, parse_size
from reshard.publish import LazyFiles, check_destination, publish, remove_quietly, stage
from reshard.stream.memory import (
    DEFAULT_BUDGET,
    MemoryPlan,
    fit_uploads,
    memory_plan,
    window_capacity,
)
from reshard.stream.plan import plan_windows
from reshard.stream.records import Part, Piece, Strided, Window
from reshard.stream.run import Buffers, Progress, Source, fill_window, run_windows, verify_headers
from shardfmt.errors import MissingKeyError

OPTIMIZER_ROOTS = ("optim", "optimizer")
_TORCH_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32",
                torch.float64: "float64"}


def _natural(name: str) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


@dataclass(frozen=True, slots=True, kw_only=True)
class ExportReport:
    """What an export wrote and left out."""

    path: str
    files: tuple[str, ...]
    tensors: int
    total_size: int
    omitted: tuple[tuple[str, str], ...]
    excluded: int
    config_written: bool
    bytes_read: int
    seconds: float
    memory_budget: int

    def to_json(self) -> dict:
        return {"path": self.path, "files": list(self.files), "tensors": self.tensors, "total_size": self.total_size,
                "omitted": [list(x) for x in self.omitted], "excluded": self.excluded,
                "config_written": self.config_written, "bytes_read": self.bytes_read,
                "seconds": round(self.seconds, 3), "memory_budget": self.memory_budget}


def config_from_metadata(metadata: Any) -> dict | None:
    """The transformers config saved in a checkpoint's metadata, if any."""
    if isinstance(metadata, dict):
        cfg = metadata.get(HF_CONFIG_KEY)
        if isinstance(cfg, dict):
            return cfg
        user = metadata.get("user")
        if isinstance(user, dict) and isinstance(user.get(HF_CONFIG_KEY), dict):
            return user[HF_CONFIG_KEY]
    return None


def select_names(names, *, only: str | None, strip_prefix: str | None,
                 add_prefix: str | None) -> tuple[dict[str, str], int]:
    """Map checkpoint names to exported names; return ({exported: checkpoint name}, excluded)."""
    out: dict[str, str] = {}
    excluded = 0
    for name in sorted(names):
        new = name
        if only is not None:
            root = only.rstrip(".")
            if not new.startswith(root + "."):
                excluded += 1
                continue
            new = new[len(root) + 1:]
        elif new.split(".", 1)[0] in OPTIMIZER_ROOTS:
            excluded += 1
            continue
        if strip_prefix and new.startswith(strip_prefix):
            new = new[len(strip_prefix):]
        if add_prefix:
            new = add_prefix + new
        if not new or new == "__metadata__":
            raise HFError(f"tensor {name!r} maps to the name {new!r}, which safetensors cannot hold")
        if new in out:
            raise HFError(f"tensors {out[new]!r} and {name!r} both map to {new!r}")
        out[new] = name
    return out, excluded


def _exported_names(path: str, m: Manifest, *, only: str | None, strip_prefix: str | None,
                    add_prefix: str | None) -> tuple[dict[str, str], int]:
    """``select_names`` over the checkpoint's tensors; none at all is a MissingKeyError."""
    names, excluded = select_names(m.tensors, only=only, strip_prefix=strip_prefix, add_prefix=add_prefix)
    if not names:
        tops = sorted({n.split(".", 1)[0] for n in m.tensors})
        raise MissingKeyError(f"{path}: no tensors to export"
                              + (f" under {only!r}" if only else "") + f" (top-level names: {tops[:10]})")
    return names, excluded


def _read_config(config) -> dict:
    if isinstance(config, Mapping):
        return dict(config)
    try:
        with open(config, "rb") as f:
            obj = orjson.loads(f.read())
    except OSError as e:
        raise ConfigError(f"{config}: cannot read the config ({e.strerror or e})") from None
    except orjson.JSONDecodeError as e:
        raise ConfigError(f"{config}: not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise ConfigError(f"{config}: a config.json must be a JSON object")
    return obj


@dataclass(frozen=True, slots=True, kw_only=True)
class ExportPlan:
    """The exported files: their names and headers, the pieces each holds in file order, and
    the index's ``weight_map`` (exported name -> file)."""

    files: tuple[str, ...]
    headers: tuple[EncodedHeader, ...]
    pieces: tuple[Piece, ...]
    weight_map: Mapping[str, str]
    tensors: int

    @property
    def total_size(self) -> int:
        """Tensor bytes in all files (the index's ``metadata.total_size``)."""
        return sum(h.file_size - len(h.data) for h in self.headers)


@dataclass(frozen=True, slots=True, kw_only=True)
class _Item:
    """One exported tensor: ``box`` of source record ``src`` (materialised through ``strided``
    for a view), written as ``dtype`` with ``shape`` under ``name``."""

    name: str
    src: str
    box: Box
    dtype: torch.dtype
    strided: Strided | None
    shape: tuple[int, ...]


def _items(m: Manifest, names: Mapping[str, str], cast: torch.dtype | None) -> list[_Item]:
    """One item per exported tensor, in natural name order."""
    items = []
    for new in sorted(names, key=_natural):
        name = names[new]
        rec = m.tensors[name]
        dt = out_dtype(rec.dtype, cast)
        if rec.view is not None:
            v = rec.view
            n = 1 + sum((k - 1) * s for k, s in zip(rec.shape, v.stride)) if all(rec.shape) else 0
            box = Box((v.storage_offset,), (n,)) if n else Box((0,), (0,))
            items.append(_Item(name=new, src=v.base, box=box, dtype=dt, shape=tuple(rec.shape),
                               strided=Strided(tuple(rec.shape), tuple(v.stride), 0)))
        else:
            base, brec = m.resolve(name)
            items.append(_Item(name=new, src=base, box=Box.full(brec.shape), dtype=dt, strided=None,
                               shape=tuple(rec.shape)))
    return items


def plan_export(m: Manifest, names: Mapping[str, str], cast: torch.dtype | None, *, max_bytes: int) -> ExportPlan:
    """Cut the exported tensors (``names``: exported -> checkpoint name) into files greedily,
    in natural name order, as transformers does; each file's header lists its tensors by
    element size descending, then name (pure)."""
    items = _items(m, names, cast)
    groups: list[list[int]] = [[]]
    size = 0
    for i, it in enumerate(items):
        n = _numel(it.shape) * it.dtype.itemsize
        if groups[-1] and size + n > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(i)
        size += n
    nfiles = len(groups)
    pieces: list[Piece] = []
    headers = []
    weight_map: dict[str, str] = {}
    for f, g in enumerate(groups):
        order = [items[i] for i in sorted(g, key=lambda i: (-items[i].dtype.itemsize, items[i].name))]
        headers.append(encode_header([(it.name, dtype_code(it.dtype, what=it.name), it.shape) for it in order],
                                     metadata={"format": "pt"}))
        for it in order:
            pieces.append(Piece(file=f, src=it.src, box=it.box, dtype=it.dtype, strided=it.strided))
            weight_map[it.name] = shard_name(f, nfiles)
    return ExportPlan(files=tuple(shard_name(f, nfiles) for f in range(nfiles)), headers=tuple(headers),
                      pieces=tuple(pieces), weight_map=weight_map, tensors=len(items))


def _windows(m: Manifest, pieces: tuple[Piece, ...], mem: MemoryPlan) -> list[Window]:
    """The windows that stream every piece (one unit each); a materialised view is held whole."""
    shapes = {p.src: m.tensor(p.src).shape for p in pieces}
    capacity = window_capacity(mem, sum(p.buffer_bytes for p in pieces))
    if any(p.strided is not None and p.buffer_bytes > capacity for p in pieces):
        capacity = mem.window  # a materialised view is held whole: use the whole slot
    return plan_windows(pieces, [[i] for i in range(len(pieces))], shapes, capacity=capacity,
                        names={i: p.src for i, p in enumerate(pieces)})


def _output_config(cfg: dict | None, cast: torch.dtype | None) -> dict | None:
    """The config.json to write: ``cfg`` with its dtype set to ``cast``."""
    out_cfg = dict(cfg) if cfg is not None else None
    if out_cfg is not None and cast is not None:
        out_cfg["dtype"] = _TORCH_NAMES[cast]
        if "torch_dtype" in out_cfg:
            out_cfg["torch_dtype"] = _TORCH_NAMES[cast]
    return out_cfg

def export_hf(
    src: str,
    dst: str,
    *,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    dtype: str | torch.dtype | None = None,
    only: str | None = None,
    strip_prefix: str | None = None,
    add_prefix: str | None = None,
    config: str | Mapping | None = None,
    memory_budget: int | str = DEFAULT_BUDGET,
    verify: bool = True,
    overwrite: bool = False,
    storage_options: dict | None = None,
    progress: bool = False,
) -> ExportReport:
    """Export the checkpoint at ``src`` to the Hugging Face layout in directory ``dst``.

    See the module docstring for names, tied weights and the config. Files are cut greedily
    at ``max_shard_size`` (``"5GB"`` = 5*10^9 bytes, as transformers counts; a larger tensor
    gets a file of its own), tensors in natural name order. ``dtype`` casts floating
    tensors (and sets the config's ``dtype``). At most ``memory_budget`` bytes of tensor data
    are held at once. The directory appears complete or not at all (staged, then renamed,
    on local disk).
    """
    t0 = time.perf_counter()
    max_bytes = parse_size(max_shard_size, what="max shard size")
    budget = parse_size(memory_budget, what="memory budget")
    cast = parse_dtype(dtype)
    given_cfg = _read_config(config) if config is not None else None
    refuse_overlap(*get_storage(src, storage_options), dst, storage_options)
    ckpt = open_checkpoint(src, storage_options=storage_options)
    before = ckpt.storage.stats.snapshot()
    m = ckpt.manifest
    dst_storage, dst_path = get_storage(dst, storage_options)
    check_destination(dst_storage, dst_path, overwrite)

    cfg = given_cfg if config is not None else config_from_metadata(jsonvalue.decode(m.metadata, where="metadata"))
    names, excluded = _exported_names(ckpt.path, m, only=only, strip_prefix=strip_prefix, add_prefix=add_prefix)
    source = Source(storage=ckpt.storage, path=ckpt.path, manifest=m, verify=verify)
    mem = memory_plan(fit_uploads(dst_storage, budget), chunk_size=m.chunk_size, verify=verify,
                      workers=min(4, ckpt.storage.read_concurrency))
    buffers, omitted = _leave_out_tied_output(source, names, cfg, mem)
    plan = plan_export(m, names, cast, max_bytes=max_bytes)
    windows = _windows(m, plan.pieces, mem)
    verify_headers(source, plan.pieces)
    if buffers is None:
        buffers = Buffers(mem, need=max((w.nbytes for w in windows), default=0))
    out_cfg = _output_config(cfg, cast)
    bar = Progress(plan.total_size, "export-hf", progress)
    try:
        _write(source, plan, windows, buffers, out_cfg, dst_storage, dst_path, overwrite=overwrite, bar=bar)
    finally:
        bar.close()
    return ExportReport(path=dst, files=plan.files, tensors=plan.tensors, total_size=plan.total_size,
                        omitted=tuple(omitted), excluded=excluded, config_written=out_cfg is not None,
                        bytes_read=ckpt.storage.stats.snapshot()["bytes_read"] - before["bytes_read"],
                        seconds=time.perf_counter() - t0, memory_budget=budget)


def _write(source: Source, plan: ExportPlan, windows: list[Window], buffers: Buffers, out_cfg: dict | None,
           storage, path: str, *, overwrite: bool, bar: Progress) -> None:
    """Stream the files into a staged directory, add the index (several files) and config.json,
    and publish it at ``path``; on failure nothing is left but what was there."""
    staging = stage(storage, path)
    sinks = LazyFiles(storage, staging, list(plan.files), list(plan.headers))
    try:
        run_windows(source, plan.pieces, windows, sinks, buffers, progress=bar)
        sinks.close_all()
        if len(plan.files) > 1:
            index = {"metadata": {"total_size": plan.total_size}, "weight_map": dict(sorted(plan.weight_map.items()))}
            storage.write_bytes(storage.join(staging, INDEX_NAME),
                                (json.dumps(index, indent=2, sort_keys=True) + "\n").encode())
        if out_cfg is not None:
            storage.write_bytes(storage.join(staging, CONFIG_NAME),
                                (json.dumps(out_cfg, indent=2, sort_keys=True) + "\n").encode())
        publish(storage, staging, path, overwrite)
    except BaseException:
        sinks.abort_all()
        if staging != path or not overwrite:
            remove_quietly(storage, staging)
        raise


def _numel(shape) -> int:
    n = 1
    for x in shape:
        n *= x
    return n


def _leave_out_tied_output(source: Source, names: dict[str, str], cfg: dict | None,
                           mem: MemoryPlan) -> tuple[Buffers | None, list[tuple[str, str]]]:
    """Under ``tie_word_embeddings``, drop ``lm_head.weight`` from ``names`` when it may be
    left out; return (the buffers allocated to compare it, or None; [(name, why)] omitted)."""
    if not (cfg and cfg.get("tie_word_embeddings") is True and OUTPUT_EMBEDDING in names):
        return None, []
    buffers = Buffers(mem, need=mem.window)
    why = _tied_output(source, names, buffers)
    if why is None:
        return buffers, []
    del names[OUTPUT_EMBEDDING]
    return buffers, [(OUTPUT_EMBEDDING, why)]


def _tied_output(source: Source, names: dict[str, str], buffers: Buffers) -> str | None:
    """Why ``lm_head.weight`` can be left out under ``tie_word_embeddings`` (None: it cannot).

    Raise when the config says tied but the stored output embedding differs from the input one.
    """
    m = source.manifest
    head = names[OUTPUT_EMBEDDING]
    rec = m.tensors[head]
    head_base, _ = m.resolve(head)
    inputs = [new for new, old in names.items() if INPUT_EMBEDDING_RE.search(new) and new != OUTPUT_EMBEDDING]
    for new in inputs:
        base, _ = m.resolve(names[new])
        if base == head_base and rec.view is None:
            return f"tied to {new} (an alias in the checkpoint; tie_word_embeddings is true)"
    cands = [new for new in inputs if m.tensors[names[new]].shape == rec.shape
             and m.tensors[names[new]].dtype == rec.dtype]
    if len(cands) != 1 or rec.view is not None or m.tensors[names[cands[0]]].view is not None:
        return None  # no single input embedding to tie to: keep it
    emb = cands[0]
    if equal_records(source, head_base, m.resolve(names[emb])[0], buffers):
        return f"equal to {emb} (tie_word_embeddings is true)"
    raise HFError(f"the config has tie_word_embeddings=true, but {OUTPUT_EMBEDDING} ({head!r}) differs from the "
                  f"input embedding {emb} ({names[emb]!r}); pass a config with tie_word_embeddings=false")


def equal_records(source: Source, a: str, b: str, buffers: Buffers) -> bool:
    """Whether two records of the same shape and dtype hold the same bytes (streamed in runs)."""
    m = source.manifest
    rec = m.tensor(a)
    dt = out_dtype(rec.dtype, None)
    slot = buffers.slots[0]
    cap = max(dt.itemsize, (slot.numel() // 2) // 8 * 8)

    for span in box_spans(rec.shape, Box.full(rec.shape), dt.itemsize, max_span=cap) if _numel(rec.shape) else []:
        n = span.box.numel * dt.itemsize
        pieces = [Piece(file=0, src=a, box=span.box, dtype=dt), Piece(file=1, src=b, box=span.box, dtype=dt)]
        off = -(-n // 8) * 8
        window = Window(parts=(Part(piece=0, box=span.box, offset=0, nbytes=n),
                               Part(piece=1, box=span.box, offset=off, nbytes=n)), nbytes=off + n)
        fill_window(source, pieces, window, slot, buffers)
        if not torch.equal(slot[:n], slot[off:off + n]):
            return False
    return True


__all__ = ["DEFAULT_MAX_SHARD_SIZE", "ExportPlan", "ExportReport", "config_from_metadata", "equal_records",
           "export_hf", "plan_export", "select_names"]
