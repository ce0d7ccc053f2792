"""Robustness fuzzer: a mutated checkpoint is reported or refused, never crashes, never loads wrong bytes.

One small valid checkpoint (chunk size 4096, so files span several chunks) is built once:
a 2-D fp32 tensor split into two shards over two rank files, a bf16 tensor, a 0-d tensor,
an int64 tensor, a replicated value and a per-rank value. Each example copies it and
applies one mutation:

(a) the parsed manifest: one number, string, list or key changed, a key deleted, added or
    renamed, or a coherent edit that keeps the manifest self-consistent (shards trading
    places, a byte range shifted, a shape or dtype reinterpreting the same bytes), now and
    then followed by one or two more edits; then re-serialised. In half the cases
    ``COMMITTED`` is rewritten to vouch for the new bytes, so the edit must be caught by
    the checks behind the digest;
(b) a safetensors header: bytes of the 8-byte length prefix or of the JSON flipped, or the
    JSON replaced by a different valid header;
(c) one data byte flipped anywhere in a data file;
(d) a data file truncated (or grown);
(e) a manifest that is not JSON, is hostile JSON (deep nesting, huge numbers) or is huge;
(f) a file deleted or replaced by a directory.

For every mutation: ``validate`` (quick and deep) returns a report or raises a
``ShardfmtError``; ``load(verify=True)`` raises a ``ShardfmtError`` or fills every target
with bytes identical to the original; each within a time bound that grows with the manifest's
size and within the memory bound of spec section 12. For byte-level corruption (b, c, d) the
deep report is not ok and, when the damage lies in a chunk the load needs, load raises
``IntegrityError``.

A hostile author re-signs what it edits, so half the byte-level mutants (and three in four
manifest mutants) are re-sealed: COMMITTED's manifest digest, the files' sizes, header sizes and
digests, chunk, file and shard digests all recomputed (``reseal``). Those must be caught by the
checks behind the digests, or load as edited (a re-sealed data flip loads the flipped bytes).
Each test reports how many mutants' loads reached the field parser, the safetensors header
parser, the tiling check and typed-JSON decoding, and fails when too few got past the digests.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import os
import shutil
import tempfile
import traceback
from collections import Counter
from typing import Any

import orjson
import pytest
import torch
from deadline import deadline
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context
from reseal import recommit, reseal

import shardfmt
from shardfmt import ShardedTensor
from shardfmt.errors import IntegrityError, ShardfmtError
from shardfmt.format.manifest import MANIFEST_NAME
from shardfmt.format.parse import parse_manifest
from shardfmt.layout.geometry import Box, intersect, row_major_strides
from shardfmt.saving.writer import CheckpointWriter, ShardData

CHUNK_SIZE = 4096
FILES = ("data/rank_00000.safetensors", "data/rank_00001.safetensors")
SECONDS = 10  # validate or load of this tiny checkpoint takes milliseconds; longer is a hang
FUZZ = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large]}


def _original_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(20240611)
    return {
        "w": torch.randn(64, 48, generator=g),  # 2 shards x 6144 bytes
        "b": (torch.randn(40, 30, generator=g) * 3).to(torch.bfloat16),
        "s": torch.tensor(3.25),
        "i": torch.arange(100, dtype=torch.int64) * 7 - 300,
    }


ORIGINAL = _original_tensors()
VALUES = {"meta": {"lr": 0.1, "names": ["a", "b"], "pair": (1, 2)}}


class _Base(dict):
    """The base checkpoint's facts; a short repr keeps falsifying examples readable."""

    def __repr__(self) -> str:
        return f"<base checkpoint at {self['path']}>"


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> dict:
    """Write the checkpoint every example mutates; return its path, manifest and bytes."""
    path = str(tmp_path_factory.mktemp("fuzz") / "base")
    t = ORIGINAL
    with CheckpointWriter(path, chunk_size=CHUNK_SIZE, format_version=1) as w:
        w.write_rank(0, [ShardData(fqn="w", data=t["w"][:32], global_shape=(64, 48), offsets=(0, 0)),
                         ShardData(fqn="b", data=t["b"], global_shape=(40, 30), offsets=(0, 0)),
                         ShardData(fqn="i", data=t["i"], global_shape=(100,), offsets=(0,))])
        w.write_rank(1, [ShardData(fqn="w", data=t["w"][32:], global_shape=(64, 48), offsets=(32, 0)),
                         ShardData(fqn="s", data=t["s"], global_shape=(), offsets=())])
        w.add_value("meta", VALUES["meta"])
        w.add_value("rng", per_rank={0: 5, 1: 6})
        manifest = w.commit(step=7)
    with open(os.path.join(path, MANIFEST_NAME), "rb") as f:
        raw = f.read()
    sizes = {n: os.path.getsize(os.path.join(path, n)) for n in FILES}
    assert all(s > CHUNK_SIZE for s in sizes.values()), "every file should span several chunks"
    return _Base(path=path, manifest=manifest, raw=raw, obj=orjson.loads(raw), sizes=sizes)


def test_unmutated_checkpoint_validates_and_loads(base):
    """The control: with no mutation, both validators pass and every tensor loads."""
    for deep in (False, True):
        report = shardfmt.validate(base["path"], deep=deep)
        assert report.ok, [str(p) for p in report.problems]
    spec = {"names": ["w", "b", "s", "i"], "w_box": None, "values": True}
    assert run_checks(base["path"], spec)[1] is None


# ----------------------------------------------------------------------------- targets


@st.composite
def target_specs(draw) -> dict:
    """Which tensors to load, and the slice of ``w`` (None: all of it)."""
    names = draw(st.lists(st.sampled_from(["w", "b", "s", "i"]), unique=True, min_size=1, max_size=4))
    w_box = None
    if "w" in names and draw(st.booleans()):
        r0 = draw(st.integers(0, 63))
        c0 = draw(st.integers(0, 47))
        w_box = Box((r0, c0), (draw(st.integers(1, 64 - r0)), draw(st.integers(1, 48 - c0))))
    return {"names": names, "w_box": w_box, "values": draw(st.booleans())}


def build_targets(spec: dict, originals: dict | None = None) -> tuple[dict, dict[str, tuple[Box, torch.Tensor]]]:
    """Return a state dict to load into and, per tensor, (box, expected bytes)."""
    sd: dict[str, Any] = {}
    expected: dict[str, tuple[Box, torch.Tensor]] = {}
    for name in spec["names"]:
        full = (originals or ORIGINAL)[name]
        box = spec["w_box"] if name == "w" and spec["w_box"] is not None else Box.full(full.shape)
        want = full[box.slices()]
        # Start from the complement of the expected bytes: an unwritten element cannot pass.
        flipped = as_bytes(want) ^ 0xFF
        local = flipped.view(full.dtype).reshape(box.lengths).clone()
        sd[name] = ShardedTensor(local, tuple(full.shape), box.offsets) if box != Box.full(full.shape) else local
        expected[name] = (box, want)
    if spec["values"]:
        sd["meta"] = None  # "rng" (per rank, saved by 2 ranks) is not loaded: this job has 1 rank
    return sd, expected


def needed_chunks(base: dict, spec: dict) -> dict[str, set[int]]:
    """Chunks (per file) holding at least one byte of an element the targets ask for."""
    m = base["manifest"]
    _, expected = build_targets(spec)
    out: dict[str, set[int]] = {n: set() for n in FILES}
    for name, (box, _) in expected.items():
        rec = m.tensors[name]
        isz = rec.itemsize
        for s in rec.shards:
            sbox = Box(s.offsets, s.lengths)
            inter = sbox if box.ndim == 0 else intersect(sbox, box)
            if inter is None or inter.is_empty():
                continue
            strides = row_major_strides(s.lengths)
            local = inter.relative_to(sbox)
            for idx in _indices(local):
                lo = s.byte_range[0] + sum(i * st_ for i, st_ in zip(idx, strides)) * isz
                out[s.file].update(range(lo // CHUNK_SIZE, (lo + isz - 1) // CHUNK_SIZE + 1))
    return out


def _indices(box: Box):
    if box.ndim == 0:
        yield ()
        return
    yield from itertools.product(*[range(o, o + n) for o, n in zip(box.offsets, box.lengths)])


# ----------------------------------------------------------------------------- checks


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _where(e: BaseException) -> str:
    """The innermost shardfmt/reshard frame of ``e``'s traceback, for the failure message."""
    tb = traceback.extract_tb(e.__traceback__)
    ours = [f for f in tb if "/shardfmt/" in f.filename or "/reshard/" in f.filename]
    f = (ours or tb)[-1]
    return f"{os.path.basename(f.filename)}:{f.lineno} in {f.name}"


def run_checks(path: str, spec: dict, label: str = "", originals: dict | None = None
               ) -> tuple[list, BaseException | None]:
    """Validate (quick and deep) and load with verification; return (reports, load error).

    Each validator must return a report or raise a ShardfmtError (None stands for the
    latter); load must raise a ShardfmtError or fill every target with the bytes the checkpoint
    holds (``originals``: the tensors as saved, or as a re-sealed mutation made them). All three
    run before any crash is reported, so one example shows every crash. Each runs within a time
    bound that grows with the manifest's size, and all three within the memory bound of
    spec section 12 (10 bytes per byte of manifest, plus 64 MiB).
    """
    size = _manifest_size(path)
    seconds = SECONDS + 2 * (size >> 20)
    peak = _PeakRss()
    crashes: list[str] = []
    reports = []
    for deep in (False, True):
        try:
            with deadline(seconds, f"validate(deep={deep}) {label}"):
                reports.append(shardfmt.validate(path, deep=deep))
        except ShardfmtError:
            reports.append(None)
        except Exception as e:  # noqa: BLE001 - the property under test
            crashes.append(f"validate(deep={deep}) raised {type(e).__name__} at {_where(e)}: {str(e)[:200]}")
            reports.append(None)
    sd, expected = build_targets(spec, originals)
    err: BaseException | None = None
    try:
        with deadline(seconds, f"load {label}"), _counting():  # validate reads past a bad digest; load must not
            shardfmt.load(sd, path, verify=True)
    except ShardfmtError as e:
        err = e
    except Exception as e:  # noqa: BLE001 - the property under test
        crashes.append(f"load raised {type(e).__name__} at {_where(e)}: {str(e)[:200]}")
        err = e
    assert not crashes, "not a ShardfmtError:\n  " + "\n  ".join(crashes)
    grown = peak.growth()
    assert grown is None or grown <= 10 * size + (64 << 20), f"{label}: peak RSS grew {grown} bytes"
    if currently_in_test_context():  # outcome statistics: pytest --hypothesis-show-statistics
        event(f"load: {type(err).__name__ if err else 'ok'}")
        event(f"validate: {'ok' if reports[0] is not None and reports[0].ok else 'not ok'}")
    if err is None:
        for name, (box, want) in expected.items():
            got = sd[name].local if isinstance(sd[name], ShardedTensor) else sd[name]
            assert torch.equal(as_bytes(got), as_bytes(want)), \
                f"load succeeded but {name} {list(box.offsets)}+{list(box.lengths)} holds different bytes"
    return reports, err


def _manifest_size(path: str) -> int:
    try:
        return os.path.getsize(os.path.join(path, MANIFEST_NAME))
    except OSError:
        return 0


class _PeakRss:
    """Peak RSS growth from now on (Linux: /proc/self/clear_refs resets the peak); None elsewhere."""

    def __init__(self) -> None:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.before = self._status("VmRSS")
        except OSError:
            self.before = None

    @staticmethod
    def _status(key: str) -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))

    def growth(self) -> int | None:
        return None if self.before is None else self._status("VmHWM") - self.before


# ----------------------------------------------------------------------------- layers reached and re-sealing

LAYERS = {  # what a mutant got past the digests to reach: (module, function) instrumented
    "field parser": [("shardfmt.format.parse", "_manifest_fields")],
    "header parser": [("shardfmt.io.documents", "decode_header"), ("shardfmt.validation.v1", "decode_header")],
    "tiling check": [("shardfmt.loading.planner", "tiling_problems"), ("shardfmt.validation.v1", "tiling_problems")],
    "typed-JSON decoding": [("shardfmt.format.jsonvalue", "decode")],
}
_REACHED: set[str] | None = None  # the layers the current mutant's load reached, while one loads


@pytest.fixture(scope="module", autouse=True)
def _instrumented():
    """Count, per mutant, which checks behind the digests it reached."""
    import importlib

    def wrap(layer, fn):
        def counted(*a, **kw):
            if _REACHED is not None:
                _REACHED.add(layer)
            return fn(*a, **kw)
        return counted

    with pytest.MonkeyPatch.context() as mp:
        for layer, places in LAYERS.items():
            for module, name in places:
                mod = importlib.import_module(module)
                mp.setattr(mod, name, wrap(layer, getattr(mod, name)))
        yield


_LOADED: set[str] = set()  # the layers the current mutant's load reached


@contextlib.contextmanager
def _counting():
    global _REACHED
    _REACHED = _LOADED
    try:
        yield
    finally:
        _REACHED = None


def fuzz(strategy, body, examples: int, capsys, what: str) -> Counter:
    """Run ``body(case)`` on ``examples`` cases drawn from ``strategy``; report how many mutants'
    loads reached each layer behind the digests (printed, and returned for the caller's minimum
    counts: a fuzzer whose mutants all die at a digest check tests nothing behind it)."""
    reached: Counter = Counter()

    @settings(max_examples=examples, **FUZZ)
    @given(case=strategy)
    def run(case):
        _LOADED.clear()
        body(case)
        reached["mutants"] += 1
        reached.update(_LOADED)

    run()
    with capsys.disabled():
        print(f"\n[fuzz {what}] {reached['mutants']} mutants; reached: "
              + ", ".join(f"{layer} {reached[layer]}" for layer in LAYERS))
    return reached


def flipped_originals(base: dict, file: str, pos: int, mask: int) -> dict[str, torch.Tensor]:
    """The tensors as they are saved once byte ``pos`` of ``file`` is XOR-ed with ``mask``."""
    out = {k: v.clone() for k, v in ORIGINAL.items()}
    m = base["manifest"]
    for name, rec in m.tensors.items():
        for sh in rec.shards:
            lo, hi = sh.byte_range
            if sh.file != file or not lo <= pos < hi:
                continue
            isz = rec.itemsize
            k, within = divmod(pos - lo, isz)
            strides = row_major_strides(sh.lengths)
            idx = []
            for st_ in strides:
                q, k = divmod(k, st_)
                idx.append(q)
            flat = out[name].view(-1).view(torch.uint8) if out[name].dim() else out[name].reshape(1).view(torch.uint8)
            gstrides = row_major_strides(rec.shape)
            g = sum((o + i) * gs for o, i, gs in zip(sh.offsets, idx, gstrides))
            flat[g * isz + within] ^= mask
    return out


def copy_base(base: dict, tmp: str) -> str:
    path = os.path.join(tmp, "ckpt")
    shutil.copytree(base["path"], path)
    return path


def write_manifest(path: str, raw: bytes, base: dict, commit: bool) -> None:
    with open(os.path.join(path, MANIFEST_NAME), "wb") as f:
        f.write(raw)
    if commit:
        recommit(path, raw, base["manifest"].save_id)


# ----------------------------------------------------------------------------- (a) manifest fields


def _nodes(obj: Any, path: tuple = ()) -> list[tuple]:
    """Every path into a JSON object (dict keys and list indices), the root excluded."""
    out = []
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.append(path + (k,))
            out.extend(_nodes(v, path + (k,)))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out.append(path + (i,))
            out.extend(_nodes(v, path + (i,)))
    return out


def _get(obj: Any, path: tuple) -> Any:
    for p in path:
        obj = obj[p]
    return obj


INTS = [0, 1, -1, 2, 7, 8, 31, 32, 33, 64, 100, 4095, 4096, 4097, 8192, 2**24, 2**31, 2**32 + 1, 2**53, 2**53 + 1,
        2**62, 2**62 + 1, 2**63 - 1, -(2**63), 2**64 - 1]
STRINGS = ["", "x", "../../etc/passwd", "/etc/passwd", "data/../../etc/passwd", "data/rank_00000.safetensors",
           "data/rank_00001.safetensors", "data/rank_00002.safetensors", "data/.hidden.safetensors",
           "data/x\n.safetensors", "F32", "BF16", "I32", "F16", "I64", "BOOL", "U8", "w", "b", "s", "i",
           "w@0,0", "w@32,0", "xxh3-128:" + "0" * 32, "xxh3-128:" + "f" * 32, "sha256:" + "0" * 64,
           "xxh3-128:" + "g" * 32, "²", "--5", "$int", "shardfmt", "x" * 5000, "\x00", "é"]
KEYS = STRINGS[:12] + ["w", "b", "zz", "a.b", "W", "0", "1", "2", "01", "-1", "²", "٣", " 1", "1.0", "$x"]
OTHERS = [None, True, False, 1.5, -0.0, 1e308, [], {}, [0], {"x": 1}, [[0, 1]], {"$int": "--5"}, {"$int": "²"},
          {"$float": "nan"}, {"$ndarray": {"dtype": "(2,3)i4", "shape": [1], "data": "AAAA"}},
          {"$ndarray": {"dtype": "<i4", "shape": [True], "data": "AAAAAA=="}},
          {"$ndarray": {"dtype": "(-1,)i4", "shape": [1], "data": "AAAAAA=="}},
          {"$ndarray": {"dtype": "<i4", "shape": [0, 2**47, 2**47], "data": ""}},
          {"$npscalar": {"dtype": "<f8", "data": "AAAAAAAAAAA="}}, {"$dict": [[[1], 2]]}, {"$bytes": "!!"},
          {"$tuple": 5}, {"$unknown": 1}]


def _json_int(v: int) -> bool:
    """Whether orjson can write ``v`` (a signed or unsigned 64-bit integer)."""
    return -(2**63) <= v <= 2**64 - 1


@st.composite
def manifest_mutations(draw, obj: dict) -> tuple[dict, str]:
    """Apply one random mutation to a deep copy of the manifest object; describe it."""
    new = copy.deepcopy(obj)
    paths = _nodes(new)
    path = draw(st.sampled_from(paths))
    parent = _get(new, path[:-1])
    key = path[-1]
    value = parent[key]
    ops = ["replace"]
    if isinstance(value, (dict, list)):
        ops += ["clear", "shrink", "grow"]
    if isinstance(value, int) and not isinstance(value, bool):
        ops += ["nudge"]
    if isinstance(parent, dict):
        ops += ["delete", "rename"]
    ops += ["add_key_here"] if isinstance(value, dict) else []
    op = draw(st.sampled_from(ops))
    if op == "replace":
        choice = draw(st.sampled_from(["int", "str", "other", "same_type"]))
        if choice == "int" or (choice == "same_type" and isinstance(value, int) and not isinstance(value, bool)):
            near = [value + 1, value - 1, value * 2] if isinstance(value, int) and not isinstance(value, bool) else []
            repl = draw(st.sampled_from(INTS + [v for v in near if _json_int(v)]))
        elif choice == "str" or (choice == "same_type" and isinstance(value, str)):
            repl = draw(st.sampled_from(STRINGS + ([value[:-1], value + "0"] if isinstance(value, str) else [])))
        else:
            repl = draw(st.sampled_from(OTHERS))
        parent[key] = repl
    elif op == "nudge":
        parent[key] = value + draw(st.sampled_from([d for d in (1, -1, 2, -2, 4, -4, 8, 4096, -4096)
                                                    if _json_int(value + d)] or [0]))
    elif op == "clear":
        parent[key] = type(value)()
    elif op == "shrink":
        if value:
            if isinstance(value, list):
                value.pop(draw(st.integers(0, len(value) - 1)))
            else:
                value.pop(draw(st.sampled_from(sorted(value))))
    elif op == "grow":
        if isinstance(value, list):
            extra = copy.deepcopy(value[draw(st.integers(0, len(value) - 1))]) if value else 0
            value.insert(draw(st.integers(0, len(value))), extra)
        else:
            value[draw(st.sampled_from(["extra", "x", "__proto__", "alias_of", "view", "shards", "ranks"]))] = \
                draw(st.sampled_from([1, "w", [], {}, None]))
    elif op == "delete":
        del parent[key]
    elif op == "rename":
        parent[draw(st.sampled_from(KEYS))] = parent.pop(key)
    elif op == "add_key_here":
        value[draw(st.sampled_from(["extra", "alias_of", "view", "ranks"]))] = draw(st.sampled_from([1, "w", [], {}]))
    return new, f"{op} at {path!r}: {str(value)[:60]!r} -> {str(_get_or(new, path))[:60]!r}"


def _get_or(obj, path):
    try:
        return _get(obj, path)
    except (KeyError, IndexError, TypeError):
        return "<gone>"


class _Quiet(dict):
    """A mutated manifest object whose repr stays short in falsifying examples ("what" says it all)."""

    def __repr__(self) -> str:
        return "<mutated manifest>"


@st.composite
def coherent_mutations(draw, obj: dict) -> tuple[dict, str]:
    """Edits that keep the manifest self-consistent, so only cross-checks against the files catch them."""
    new = copy.deepcopy(obj)
    t = new["tensors"]
    w0, w1 = t["w"]["shards"]
    kind = draw(st.sampled_from(["swap_w_offsets", "swap_w_places", "shift_range", "transpose_b", "retype_s",
                                 "retype_w", "move_i", "hostile_value", "claimed_world", "split_w"]))
    if kind == "swap_w_offsets":  # the two halves of w trade places in the tensor
        w0["offsets"], w1["offsets"] = w1["offsets"], w0["offsets"]
    elif kind == "swap_w_places":  # ...or trade their files and bytes
        for k in ("file", "byte_range", "key", "digest"):
            w0[k], w1[k] = w1[k], w0[k]
    elif kind == "shift_range":  # same length, other bytes of the same file
        name = draw(st.sampled_from(["w", "b", "s", "i"]))
        shard = t[name]["shards"][0]
        delta = draw(st.sampled_from([-8, -4, -2, -1, 1, 2, 4, 8, 64, 4096]))
        shard["byte_range"] = [x + delta for x in shard["byte_range"]]
    elif kind == "transpose_b":  # same bytes read as another shape
        t["b"]["shape"] = t["b"]["shards"][0]["lengths"] = [30, 40]
    elif kind == "retype_s":  # same bytes read as another dtype of the same size
        t["s"]["dtype"] = draw(st.sampled_from(["I32", "U32"]))
    elif kind == "retype_w":
        t["w"]["dtype"] = "I32"
    elif kind == "move_i":  # point i at the first bytes of w's shard (same file, same length)
        t["i"]["shards"][0]["byte_range"] = [w0["byte_range"][0], w0["byte_range"][0] + 800]
        t["i"]["shards"][0]["digest"] = w0["digest"]
    elif kind == "hostile_value":  # a well-formed record holding a value that must not decode
        new["values"]["meta"]["value"]["lr"] = draw(st.sampled_from(OTHERS))
    elif kind == "claimed_world":  # a world size the manifest merely claims
        new["topology"].update(world_size=2**24, mesh=[{"name": "world", "size": 2**24}])
    elif kind == "split_w":  # w's first half claimed as many small shards of the same bytes
        rows = draw(st.sampled_from([1, 2, 4]))
        isz, width = 4, 48
        t["w"]["shards"] = [dict(w0, offsets=[r, 0], lengths=[rows, width], key=f"w@{r},0",
                                 byte_range=[w0["byte_range"][0] + r * width * isz,
                                             w0["byte_range"][0] + (r + rows) * width * isz])
                            for r in range(0, 32, rows)] + [w1]
    return new, f"coherent {kind}"


@st.composite
def case_a(draw, base: dict) -> dict:
    # The first edit may be a coherent one (it needs the pristine records); mostly that is
    # all, sometimes one or two random edits follow.
    obj, what = draw(st.one_of(manifest_mutations(base["obj"]), coherent_mutations(base["obj"])))
    whats = [what]
    for _ in range(draw(st.sampled_from([0, 0, 0, 1, 2]))):
        obj, what = draw(manifest_mutations(obj))
        whats.append(what)
    return {"what": "; ".join(whats), "commit": draw(st.sampled_from([True, True, True, False])),
            "spec": draw(target_specs()), "obj": _Quiet(obj)}


def _fuzz_manifest_case(base: dict, case: dict) -> None:
    raw = orjson.dumps(case["obj"], option=orjson.OPT_SORT_KEYS) + b"\n"
    with tempfile.TemporaryDirectory() as tmp:
        path = copy_base(base, tmp)
        write_manifest(path, raw, base, case["commit"])
        reports, err = run_checks(path, case["spec"], case["what"])
        if raw != base["raw"] and not case["commit"]:
            # COMMITTED no longer vouches for the manifest: nothing may load.
            assert all(r is None or not r.ok for r in reports), \
                f"validate passed an uncommitted edit ({case['what']})"
            assert err is not None, f"load accepted a manifest COMMITTED does not vouch for ({case['what']})"


@pytest.mark.slow
def test_fuzz_manifest_fields(base, capsys):
    reached = fuzz(case_a(base), lambda case: _fuzz_manifest_case(base, case), 160, capsys, "manifest fields")
    # three in four mutants are re-signed: they must get past the digest to the checks behind it
    assert reached["field parser"] >= reached["mutants"] // 3, reached
    assert min(reached["tiling check"], reached["typed-JSON decoding"]) >= reached["mutants"] // 40, reached


# ----------------------------------------------------------------------------- (b) safetensors headers


def _header(path: str, name: str) -> tuple[int, bytes]:
    with open(os.path.join(path, name), "rb") as f:
        data = f.read()
    n = int.from_bytes(data[:8], "little")
    return n, data


@st.composite
def case_b(draw) -> dict:
    return {
        "reseal": draw(st.booleans()),
        "file": draw(st.sampled_from(FILES)),
        "kind": draw(st.sampled_from(["prefix", "json", "rewrite"])),
        "pos": draw(st.integers(0, 10_000)),
        "mask": draw(st.integers(1, 255)),
        "rewrite": draw(st.sampled_from(["dtype", "shape", "offsets", "rename", "drop", "add", "metadata",
                                         "swap_offsets", "not_object"])),
        "spec": draw(target_specs()),
    }


def _rewrite_header(body: dict, how: str) -> dict:
    keys = sorted(k for k in body if k != "__metadata__")
    k = keys[0]
    if how == "dtype":
        body[k]["dtype"] = {"F32": "I32", "BF16": "F16", "I64": "F64"}.get(body[k]["dtype"], "U8")
    elif how == "shape":
        body[k]["shape"] = list(reversed(body[k]["shape"])) if len(body[k]["shape"]) > 1 and \
            body[k]["shape"][0] != body[k]["shape"][-1] else body[k]["shape"] + [1]
    elif how == "offsets":
        a, b = body[k]["data_offsets"]
        body[k]["data_offsets"] = [a + 4, b + 4]
    elif how == "rename":
        body[k + "x"] = body.pop(k)
    elif how == "drop":
        del body[keys[-1]]
    elif how == "add":
        body["zz"] = {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]}
    elif how == "metadata":
        body["__metadata__"] = {"format": "shardfmt", "rank": "9"}
    elif how == "swap_offsets" and len(keys) > 1:
        body[keys[0]]["data_offsets"], body[keys[1]]["data_offsets"] = \
            body[keys[1]]["data_offsets"], body[keys[0]]["data_offsets"]
    elif how == "not_object":
        return []  # type: ignore[return-value]
    return body


@pytest.mark.slow
def test_fuzz_safetensors_headers(base, capsys):
    reached = fuzz(case_b(), lambda case: _fuzz_header_case(base, case), 40, capsys, "safetensors headers")
    assert reached["header parser"] >= reached["mutants"] // 8, reached  # re-sealed ones, past the header digest


def _fuzz_header_case(base: dict, case: dict) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = copy_base(base, tmp)
        fpath = os.path.join(path, case["file"])
        n, data = _header(path, case["file"])
        buf = bytearray(data)
        if case["kind"] == "prefix":
            pos = case["pos"] % 8
            buf[pos] ^= case["mask"]
            damaged = {pos}
        elif case["kind"] == "json":
            pos = 8 + case["pos"] % n
            buf[pos] ^= case["mask"]
            damaged = {pos}
        else:
            body = _rewrite_header(orjson.loads(data[8:8 + n]), case["rewrite"])
            js = orjson.dumps(body)
            js += b" " * (max(n - len(js), 0) if len(js) <= n else (-(8 + len(js)) % 8))
            buf = bytearray(len(js).to_bytes(8, "little") + js + data[8 + n:])
            damaged = {i for i in range(min(len(buf), len(data))) if buf[i] != data[i]} | \
                ({min(len(buf), len(data))} if len(buf) != len(data) else set())
        if bytes(buf) == data:
            return
        with open(fpath, "wb") as f:
            f.write(buf)
        if case["reseal"]:  # the author re-signs the edit: the header's own checks must catch it, or
            reseal(path)    # the load must give exactly the saved bytes
            run_checks(path, case["spec"])
            return
        reports, err = run_checks(path, case["spec"])
        assert reports[1] is None or not reports[1].ok, "deep validate passed a changed header"
        need = needed_chunks(base, case["spec"])[case["file"]]
        if len(buf) != len(data) and need:
            assert isinstance(err, IntegrityError), f"load of a resized file gave {err!r}"
        elif any(p // CHUNK_SIZE in need for p in damaged):
            assert isinstance(err, IntegrityError), f"load through a changed header gave {err!r}"


# ----------------------------------------------------------------------------- (c) data byte flips


@st.composite
def case_c(draw) -> dict:
    return {"file": draw(st.sampled_from(FILES)), "pos": draw(st.integers(0, 1 << 20)),
            "mask": draw(st.integers(1, 255)), "spec": draw(target_specs()), "reseal": draw(st.booleans())}


@pytest.mark.slow
def test_fuzz_data_byte_flips(base, capsys):
    reached = fuzz(case_c(), lambda case: _fuzz_flip_case(base, case), 40, capsys, "data byte flips")
    assert reached["header parser"] >= reached["mutants"] // 8, reached


def _fuzz_flip_case(base: dict, case: dict) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = copy_base(base, tmp)
        fpath = os.path.join(path, case["file"])
        pos = case["pos"] % base["sizes"][case["file"]]
        with open(fpath, "r+b") as f:
            f.seek(pos)
            b = f.read(1)[0]
            f.seek(pos)
            f.write(bytes([b ^ case["mask"]]))
        if case["reseal"]:  # a consistent edit of the data: it loads as edited, or is refused
            reseal(path)
            run_checks(path, case["spec"], originals=flipped_originals(base, case["file"], pos, case["mask"]))
            return
        reports, err = run_checks(path, case["spec"])
        assert reports[1] is None or not reports[1].ok, f"deep validate missed a flipped byte at {pos}"
        if pos // CHUNK_SIZE in needed_chunks(base, case["spec"])[case["file"]]:
            assert isinstance(err, IntegrityError), \
                f"{case['file']} byte {pos} (chunk {pos // CHUNK_SIZE}) flipped, load gave {err!r}"


# ----------------------------------------------------------------------------- (d) truncation


@st.composite
def case_d(draw) -> dict:
    return {"file": draw(st.sampled_from(FILES)), "cut": draw(st.integers(0, 1 << 20)),
            "grow": draw(st.sampled_from([0, 0, 0, 1, 4096])), "spec": draw(target_specs()),
            "reseal": draw(st.booleans())}


@pytest.mark.slow
def test_fuzz_truncation(base, capsys):
    reached = fuzz(case_d(), lambda case: _fuzz_truncation_case(base, case), 24, capsys, "truncation")
    assert reached["field parser"] >= reached["mutants"] // 4, reached


def _fuzz_truncation_case(base: dict, case: dict) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = copy_base(base, tmp)
        fpath = os.path.join(path, case["file"])
        size = base["sizes"][case["file"]]
        if case["grow"]:
            with open(fpath, "ab") as f:
                f.write(b"\0" * case["grow"])
        else:
            os.truncate(fpath, case["cut"] % size)
        if case["reseal"]:
            reseal(path)  # sizes and hashes agree again: the header's data no longer ends at the file's end
        reports, err = run_checks(path, case["spec"])
        assert all(r is None or not r.ok for r in reports), "validate passed a file of the wrong size"
        if needed_chunks(base, case["spec"])[case["file"]] and case["reseal"]:
            assert err is not None, "load of a re-sealed resized file succeeded"
        elif needed_chunks(base, case["spec"])[case["file"]]:
            assert isinstance(err, IntegrityError), f"load of a resized file gave {err!r}"


# ----------------------------------------------------------------------------- (e) hostile manifests


def _hostile(base: dict, kind: str) -> bytes:
    raw = base["raw"]
    if kind == "empty":
        return b""
    if kind == "garbage":
        return b"\x89PNG\r\n\x1a\n not json at all"
    if kind == "truncated":
        return raw[: len(raw) // 2]
    if kind == "array":
        return b"[1,2,3]"
    if kind == "null":
        return b"null"
    if kind == "nan":
        return raw.replace(b'"step":7', b'"step":NaN')
    if kind == "bigint":
        return raw.replace(b'"chunk_size":4096', b'"chunk_size":99999999999999999999999')
    if kind == "inf":
        return raw.replace(b'"chunk_size":4096', b'"chunk_size":1e400')
    if kind == "float_chunk":
        return raw.replace(b'"chunk_size":4096', b'"chunk_size":4096.0')
    if kind == "deep_metadata":
        return raw.replace(b'"metadata":null', b'"metadata":' + b"[" * 1000 + b"]" * 1000)
    if kind == "deep_value":
        return raw.replace(b'"value":{"lr"', b'"value":{"deep":' + b"[" * 1000 + b"]" * 1000 + b',"lr"')
    if kind == "deep_tuples":  # 25 tagged levels: legal depth, but each tag is a branch point for a schema
        return raw.replace(b'"value":{"lr"', b'"value":{"deep":' + b'{"$tuple":[' * 25 + b"0" + b"]}" * 25 + b',"lr"')
    if kind == "too_deep":
        return b'{"format":"shardfmt","x":' + b"[" * 5000 + b"]" * 5000 + b"}"
    if kind == "huge_whitespace":
        return raw[:-1] + b" " * (8 << 20) + b"\n"
    if kind == "huge_metadata":
        return raw.replace(b'"metadata":null', b'"metadata":"' + b"x" * (4 << 20) + b'"')
    if kind == "extra_chunk":
        return raw.replace(b'"chunks":[', b'"chunks":[' + b'"xxh3-128:' + b"0" * 32 + b'",' * 1, 1)
    if kind == "huge_shape":
        return raw.replace(b'"shape":[100]', b'"shape":[9007199254740992]')
    if kind == "utf16":
        return raw.decode().encode("utf-16")
    if kind == "bom":
        return b"\xef\xbb\xbf" + raw
    if kind == "dup_keys":
        return raw[:1] + b'"format":"other",' + raw[1:]
    raise AssertionError(kind)


HOSTILE = ["empty", "garbage", "truncated", "array", "null", "nan", "bigint", "inf", "float_chunk",
           "deep_metadata", "deep_value", "deep_tuples", "too_deep", "huge_whitespace", "huge_metadata",
           "extra_chunk", "huge_shape", "utf16", "bom", "dup_keys"]


@pytest.mark.parametrize("commit", [False, True], ids=["stale_commit", "recommitted"])
@pytest.mark.parametrize("kind", HOSTILE)
def test_hostile_manifests(base, kind, commit):
    raw = _hostile(base, kind)
    assert raw != base["raw"], f"{kind}: the mutation did not apply"
    spec = {"names": ["w", "b", "s", "i"], "w_box": None, "values": True}
    with tempfile.TemporaryDirectory() as tmp:
        path = copy_base(base, tmp)
        write_manifest(path, raw, base, commit)
        try:
            parse_manifest(raw)
        except ShardfmtError:
            pass
        except Exception as e:  # noqa: BLE001 - the property under test
            pytest.fail(f"parse_manifest raised {type(e).__name__} at {_where(e)}: {str(e)[:200]}")
        reports, err = run_checks(path, spec, f"({kind} manifest)")
        if not commit:
            assert all(r is None or not r.ok for r in reports)
            assert err is not None


# ----------------------------------------------------------------------------- (f) missing pieces


@pytest.mark.parametrize("what", ["COMMITTED", "manifest.json", FILES[0], FILES[1], "data"])
@pytest.mark.parametrize("how", ["delete", "directory", "empty"])
def test_missing_or_replaced_files(base, what, how):
    spec = {"names": ["w", "b", "s", "i"], "w_box": None, "values": True}
    with tempfile.TemporaryDirectory() as tmp:
        path = copy_base(base, tmp)
        target = os.path.join(path, what)
        if os.path.isdir(target):
            shutil.rmtree(target)
        else:
            os.remove(target)
        if how == "directory":
            os.makedirs(target)
        elif how == "empty":
            open(target, "wb").close()
        reports, err = run_checks(path, spec)
        assert all(r is None or not r.ok for r in reports), f"validate passed with {what} {how}"
        assert err is not None, f"load succeeded with {what} {how}"
