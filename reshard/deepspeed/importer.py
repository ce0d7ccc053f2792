"""``import_deepspeed``: a DeepSpeed ZeRO checkpoint -> a committed shardfmt checkpoint (protocol: ``reshard.deepspeed``)."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from reshard._shardfmt import (
    CheckpointWriter,
    Manifest,
    ShardData,
    Storage,
    Topology,
    check_step,
    get_storage,
)
from reshard.dcp.plan import DEFAULT_MEMORY_BUDGET
from reshard.deepspeed.layout import ParamPlan, cut, numel, plan_zero3, plan_zero12
from reshard.deepspeed.ptfile import PtFile, TensorRef
from reshard.deepspeed.records import STATE_KEYS, ModelStates, RankOptim, model_states, rank_optim
from reshard.errors import DeepSpeedImportError, SourceNotFoundError
from reshard.options import DEEPSPEED_TRUST_PICKLE_HELP as TRUST_PICKLE_HELP
from reshard.options import DEFAULT_MODEL_PREFIX
from reshard.overlap import refuse_overlap
from reshard.parse import parse_size
from shardfmt.errors import CheckpointNotFoundError

OPTIM_PREFIX = "optim."
_OPTIM_FILE = re.compile(r"(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt")
_MODEL_FILE = re.compile(r"(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt")
_UNSUPPORTED = re.compile(r"(expp_rank_|layer_).*\.pt")  # MoE experts, pipeline layers
_TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,254}")


@dataclass(frozen=True, slots=True, kw_only=True)
class DeepSpeedImportReport:
    """What ``import_deepspeed`` wrote: the manifest, what it came from, and what it left out (name, why)."""

    manifest: Manifest
    tag: str
    zero_stage: int
    world_size: int
    ds_version: str | None
    params: int
    left_out: tuple[tuple[str, str], ...]
    bytes_read: int


@dataclass(frozen=True, slots=True, kw_only=True)
class _Source:
    """The opened checkpoint: one optim file per rank, the model file(s), and what they hold."""

    optim_files: tuple[PtFile, ...]
    model_files: tuple[PtFile, ...]
    optim: tuple[RankOptim, ...]
    models: tuple[ModelStates, ...]

    def read(self, plan: ParamPlan, key: str | None) -> torch.Tensor:
        """Parameter ``plan``'s fp32 master (``key`` None) or optimizer state ``key``, gathered from its pieces."""
        parts = []
        for p in (plan.master if key is None else plan.state or ()):
            o = self.optim[p.rank]
            ref = o.flats[p.flat] if key is None else dict(o.states[p.flat].tensors)[key]
            parts.append(self.optim_files[p.rank].read(ref, p.start, p.length))
        flat = torch.cat(parts) if len(parts) != 1 else parts[0]
        return flat.float().view(plan.shape)


def import_deepspeed(
    src: str,
    dst: str,
    *,
    trust_pickle: bool,
    tag: str | None = None,
    model_prefix: str = DEFAULT_MODEL_PREFIX,
    storage_options: dict | None = None,
    memory_budget: int | str = DEFAULT_MEMORY_BUDGET,
    step: int | None = None,
    metadata: Any = None,
    overwrite: bool = False,
    format_version: int | None = None,
    verify: bool = True,
    progress: Callable[[int], None] | None = None,
) -> DeepSpeedImportReport:
    """Import the DeepSpeed ZeRO checkpoint at ``src`` (the save dir holding ``latest``) as ``dst``.

    ``trust_pickle`` must be True (``TRUST_PICKLE_HELP``). ``tag`` picks ``src/<tag>`` (default:
    the content of ``src/latest``). Parameters and buffers are named ``model_prefix + name``,
    the Adam state ``optim.state.<name>.{exp_avg,exp_avg_sq,step}``, the hyperparameters
    ``optim.param_groups`` (as ``shardfmt.get_state_dict`` names a model and its optimizer).
    ``step`` defaults to DeepSpeed's ``global_steps``; ``metadata`` to ``{"imported_from": ...}``.
    ``verify`` checks every storage's zip CRC-32 before writing. ``memory_budget`` bounds the
    tensor bytes held at once (a larger tensor is held alone). ``progress(n)`` is told each
    ``n`` bytes of tensors written (the command line's progress bar).
    """
    if trust_pickle is not True:
        raise DeepSpeedImportError(f"{src}: refusing to read DeepSpeed pickles without trust_pickle=True. "
                                   f"{TRUST_PICKLE_HELP}")
    check_step(step)
    memory_budget = parse_size(memory_budget, what="memory_budget")
    storage, root = get_storage(src, storage_options)
    refuse_overlap(storage, root, dst, storage_options)
    tag = _tag(storage, root, src) if tag is None else tag
    if not _TAG.fullmatch(tag) or tag in (".", ".."):
        raise DeepSpeedImportError(f"{src}: tag {tag!r} is not a plain directory name")
    tag_dir = storage.join(root, tag)
    source = _open(storage, root, tag_dir)
    try:
        return _write(source, dst, tag=tag, model_prefix=model_prefix, storage_options=storage_options,
                      memory_budget=memory_budget, step=step, metadata=metadata, overwrite=overwrite, progress=progress,
                      format_version=format_version, verify=verify)
    finally:
        for f in source.optim_files + source.model_files:
            f.close()


def _tag(storage: Storage, root: str, src: str) -> str:
    try:
        raw = storage.read_bytes(storage.join(root, "latest"), limit=4096, within=root)
    except CheckpointNotFoundError:
        raise SourceNotFoundError(f"{storage.join(root, 'latest')}: missing: not a DeepSpeed save directory, or "
                                   "its save did not finish (DeepSpeed writes 'latest' last); pass a tag") from None
    try:
        return raw.decode().strip()
    except UnicodeDecodeError:
        raise DeepSpeedImportError(f"{storage.join(root, 'latest')}: not a text tag") from None


def _listing(storage: Storage, tag_dir: str) -> tuple[dict[int, str], dict[int | None, str]]:
    """Optim files by dp rank, model files by dp rank (None: ZeRO-1/2's single file)."""
    try:
        names = sorted(storage.listdir(tag_dir))
    except (CheckpointNotFoundError, FileNotFoundError, NotADirectoryError):
        raise SourceNotFoundError(f"{tag_dir}: no such tag directory") from None
    optim: dict[int, str] = {}
    model: dict[int | None, str] = {}
    for name in names:
        if _UNSUPPORTED.fullmatch(name):
            raise DeepSpeedImportError(f"{storage.join(tag_dir, name)}: MoE and pipeline-parallel checkpoints are "
                                       "not supported")
        m = _OPTIM_FILE.fullmatch(name) or _MODEL_FILE.fullmatch(name)
        if m is None:
            continue
        mp = int(m.group(m.re.groups))
        if mp != 0:
            raise DeepSpeedImportError(f"{storage.join(tag_dir, name)}: model-parallel rank {mp}: checkpoints with "
                                       "tensor or model parallelism are not supported (as by zero_to_fp32)")
        if m.re is _OPTIM_FILE:
            optim[int(m.group(2))] = name
        else:
            model[None if m.group(1) is None else int(m.group(1))] = name
    if not optim:
        raise DeepSpeedImportError(f"{tag_dir}: no *_optim_states.pt files: not a DeepSpeed ZeRO checkpoint tag")
    return optim, model


def _open(storage: Storage, root: str, tag_dir: str) -> _Source:
    """Open and check every file: 1) rank 0's optim file gives stage and world size; 2) the other ranks'
    must exist and agree; 3) the model file(s) the stage implies."""
    optim_names, model_names = _listing(storage, tag_dir)
    files: list[PtFile] = []
    try:
        first = _file(storage, root, tag_dir, optim_names, 0, "optim", files)
        o0 = rank_optim(first.load(), first.path)
        world = o0.world_size
        extra = sorted(r for r in optim_names if r >= world)
        if extra:
            raise DeepSpeedImportError(f"{storage.join(tag_dir, optim_names[extra[0]])}: dp rank {extra[0]} in a "
                                       f"checkpoint of {world} ranks (partition_count): a leftover of another save?")
        optim = [o0]
        for r in range(1, world):
            f = _file(storage, root, tag_dir, optim_names, r, "optim", files)
            o = rank_optim(f.load(), f.path)
            if o.stage != o0.stage or o.world_size != world:
                raise DeepSpeedImportError(f"{f.path}: ZeRO stage {o.stage} over {o.world_size} ranks, rank 0's file "
                                           f"says stage {o0.stage} over {world} (files of different saves mixed)")
            optim.append(o)
        if o0.stage == 3:
            model_files = [_file(storage, root, tag_dir, model_names, r, "model", files) for r in range(world)]
        else:
            if any(k is not None for k in model_names):
                raise DeepSpeedImportError(f"{tag_dir}: ZeRO-3 model-states files in a ZeRO-{o0.stage} checkpoint "
                                           "(files of different saves mixed)")
            model_files = [_file(storage, root, tag_dir, model_names, None, "model", files)]
        models = tuple(model_states(f.load(), f.path) for f in model_files)
        return _Source(optim_files=tuple(files[:world]), model_files=tuple(model_files), optim=tuple(optim),
                       models=models)
    except BaseException:
        for f in files:
            f.close()
        raise


def _file(storage: Storage, root: str, tag_dir: str, names: dict, rank: int | None, kind: str,
          opened: list[PtFile]) -> PtFile:
    name = names.get(rank)
    if name is None:
        want = (f"[bf16_]zero_pp_rank_{rank}_mp_rank_00_optim_states.pt" if kind == "optim" else
                "mp_rank_00_model_states.pt" if rank is None else f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt")
        raise DeepSpeedImportError(f"{storage.join(tag_dir, want)}: missing (the checkpoint's rank "
                                   f"{0 if rank is None else rank} file)")
    f = PtFile(storage, root, storage.join(tag_dir, name))
    opened.append(f)
    return f


def _plans(s: _Source) -> list[ParamPlan]:
    o0, m0 = s.optim[0], s.models[0]
    world = o0.world_size
    where = s.optim_files[0].path
    if len(m0.param_shapes) != len(o0.flats):
        raise DeepSpeedImportError(f"{s.model_files[0].path}: param_shapes has {len(m0.param_shapes)} groups, the "
                                   f"optimizer {len(o0.flats)} fp32 partitions")
    flat = [[f.numel for f in o.flats] for o in s.optim]
    states = None if any(not o.states for o in s.optim) else \
        [[dict(st.tensors)["exp_avg"].numel for st in o.states] for o in s.optim]
    for o, f in zip(s.optim, s.optim_files):
        if any(k != "exp_avg" and dict(st.tensors)[k].numel != dict(st.tensors)["exp_avg"].numel
               for st in o.states for k in STATE_KEYS):
            raise DeepSpeedImportError(f"{f.path}: optimizer state tensors of one group differ in length")
    if o0.stage == 3:
        return plan_zero3(m0.param_shapes, flat, states, world_size=world, where=where)
    return plan_zero12(m0.param_shapes, flat, states, world_size=world, paddings=o0.alignment_paddings, where=where)


def _frozen(s: _Source) -> Iterator[tuple[str, torch.Tensor]]:
    """Frozen parameters as zero_to_fp32 gives them: ZeRO-2 the saved tensor, ZeRO-3 the ranks'
    fragments concatenated and cut to size; ZeRO-1 saves none."""
    m0 = s.models[0]
    frags = [dict(m.frozen_fragments) for m in s.models]
    for name, shape in m0.frozen_shapes:
        n = numel(shape, f"{s.model_files[0].path}: {name}")
        refs = [f.get(name) for f in (frags if s.optim[0].stage == 3 else frags[:1])]
        missing = [i for i, r in enumerate(refs) if r is None]
        if missing:
            raise DeepSpeedImportError(f"{s.model_files[missing[0]].path}: no frozen_param_fragments entry for {name!r}")
        if s.optim[0].stage != 3:
            ref = refs[0]
            if tuple(ref.size) != tuple(shape):
                raise DeepSpeedImportError(f"{s.model_files[0].path}: frozen {name!r} is {list(ref.size)}, "
                                           f"frozen_param_shapes says {list(shape)}")
            yield name, s.model_files[0].read(ref).float()
            continue
        try:
            parts = cut([r.numel for r in refs], 0, n)
        except ValueError as e:
            raise DeepSpeedImportError(f"{s.model_files[0].path}: frozen {name!r}: {e} in the ranks' fragments") from None
        yield name, torch.cat([s.model_files[r].read(refs[r], st, k) for r, st, k in parts]).float().view(shape)


def _buffers(s: _Source) -> Iterator[tuple[str, torch.Tensor]]:
    for name, ref in s.models[0].buffers:
        t = s.model_files[0].read(ref)
        yield name, t.float() if t.is_floating_point() else t


def _step_value(s: _Source, plan: ParamPlan) -> TensorRef | int | float | None:
    return s.optim[0].states[plan.flat_group].step if s.optim[0].states else None


def _param_groups(s: _Source, plans: list[ParamPlan]) -> list[dict[str, Any]] | None:
    if not s.optim[0].param_groups:
        return None
    by_flat: dict[int, list[str]] = {}
    for p in plans:
        by_flat.setdefault(p.flat_group, []).append(p.name)
    return [{**{k: v for k, v in g.items() if k != "params"},
             "params": [n for k in g["params"] for n in by_flat.get(k, [])]} for g in s.optim[0].param_groups]


def _tensors(s: _Source, plans: list[ParamPlan], model_prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor to write, in order: buffers, frozen and trainable parameters, optimizer state."""
    for name, t in _buffers(s):
        yield model_prefix + name, t
    for name, t in _frozen(s):
        yield model_prefix + name, t
    for p in plans:
        yield model_prefix + p.name, s.read(p, None)
        if p.state is not None:
            for key in STATE_KEYS:
                yield f"{OPTIM_PREFIX}state.{p.name}.{key}", s.read(p, key)
            step = _step_value(s, p)
            if isinstance(step, TensorRef):
                yield f"{OPTIM_PREFIX}state.{p.name}.step", s.optim_files[0].read(step).clone()


def _write(s: _Source, dst: str, *, tag: str, model_prefix: str, storage_options: dict | None, memory_budget: int,
           step: int | None, metadata: Any, overwrite: bool, format_version: int | None,
           verify: bool, progress: Callable[[int], None] | None = None) -> DeepSpeedImportReport:
    plans = _plans(s)
    if verify:
        for f in s.optim_files + s.model_files:
            f.verify()
    m0, o0 = s.models[0], s.optim[0]
    written = {model_prefix + n for n, _ in m0.buffers} | {model_prefix + p.name for p in plans}
    left_out = [(model_prefix + n, "frozen parameter: ZeRO-1 checkpoints keep it only in the model dtype "
                 "(zero_to_fp32 leaves it out too)") for n in _stage1_frozen(s)]
    if metadata is None:
        metadata = {"imported_from": {"format": "deepspeed", "version": m0.ds_version, "tag": tag,
                                      "zero_stage": o0.stage, "world_size": o0.world_size}}
    with CheckpointWriter(dst, storage_options=storage_options, overwrite=overwrite,
                          format_version=format_version) as writer:
        batch: list[ShardData] = []
        held, part = 0, 0
        for fqn, t in _tensors(s, plans, model_prefix):
            written.add(fqn)
            t = t.contiguous()
            if batch and held + t.nbytes > memory_budget:
                writer.write_rank(0, batch, part=part)
                if progress is not None:
                    progress(held)
                batch, held, part = [], 0, part + 1
            batch.append(ShardData(fqn=fqn, data=t, global_shape=tuple(t.shape), offsets=(0,) * t.dim()))
            held += t.nbytes
        if batch or part == 0:
            writer.write_rank(0, batch, part=part)
            if progress is not None:
                progress(held)
        for p in plans:
            value = _step_value(s, p)
            if p.state is not None and isinstance(value, (int, float)):
                writer.add_value(f"{OPTIM_PREFIX}state.{p.name}.step", value)
        groups = _param_groups(s, plans)
        if groups is not None:
            writer.add_value(f"{OPTIM_PREFIX}param_groups", groups)
        for alias, owner in m0.shared:
            if model_prefix + owner in written and model_prefix + alias not in written:
                writer.add_alias(model_prefix + alias, model_prefix + owner)
        manifest = writer.commit(step=m0.global_steps if step is None else step, metadata=metadata,
                                 topology=Topology(world_size=1))
    return DeepSpeedImportReport(manifest=manifest, tag=tag, zero_stage=o0.stage, world_size=o0.world_size,
                                 ds_version=m0.ds_version, params=len(plans), left_out=tuple(left_out),
                                 bytes_read=sum(f.bytes_read for f in s.optim_files + s.model_files))


def _stage1_frozen(s: _Source) -> list[str]:
    """Frozen parameters a ZeRO-1 checkpoint has only in ``module``: neither trainable nor saved as frozen."""
    m0 = s.models[0]
    if s.optim[0].stage != 1:
        return []
    known = {n for g in m0.param_shapes for n, _ in g} | {n for n, _ in m0.buffers} | {a for a, _ in m0.shared}
    return [n for n in m0.module_names if n not in known]


__all__ = ["DEFAULT_MODEL_PREFIX", "TRUST_PICKLE_HELP", "DeepSpeedImportReport", "import_deepspeed"]
