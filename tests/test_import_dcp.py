"""``reshard import-dcp``: torch.distributed.checkpoint directories become shardfmt checkpoints.

DCP checkpoints are written by torch itself (``dcp.save``: 2 real gloo ranks with DTensor
``Shard(0)``, and single-process saves); the imported checkpoint must load bit for bit, keep
DCP's boxes and validate. Hostile or damaged input must be refused without running code and
without leaving anything at the destination.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import pickletools
import shutil
import struct
import subprocess
import sys
import warnings
import zipfile
from fractions import Fraction

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._extension import ExtensionRegistry, StreamTransformExtension
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter, _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

import shardfmt
from reshard import cli
from reshard.dcp.importer import import_dcp
from reshard.dcp.metadata import DcpChunk, DcpLocation, DcpMetadata, DcpTensor, parse_metadata
from reshard.dcp.plan import plan_import, rank_of_files
from reshard.dcp.unpickler import record_cap
from reshard.errors import DcpImportError, UnsafePickleError
from shardfmt.errors import StateDictError
from tests.deadline import deadline
from tests.distributed.harness import check_all_ok, launch
from tests.distributed.model import truth
from tests.distributed.workers import DCP_SHARDED, DCP_VALUES, dcp_full_tensors

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))


def _dcp_save_local(state: dict, path: str, **writer_kw) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed ... uninitialized, assuming ... single process"
        dcp.save(state, storage_writer=FileSystemWriter(path, **writer_kw), no_dist=True)


LOCAL_TENSORS = {
    "model.w": truth("model.w", (7, 5)),
    "model.h": truth("model.h", (4, 3), torch.bfloat16),
    "model.count": torch.tensor(42, dtype=torch.int64),
    "model.empty": torch.empty(0, 4),
}
LOCAL_VALUES = {"step": 9, "name": "local", "cfg": {"lr": 0.5, "betas": (0.9, 0.99)}}


def _local_targets() -> dict:
    state = {k: torch.empty(v.shape, dtype=v.dtype) for k, v in LOCAL_TENSORS.items()}
    state.update({"step": None, "name": None, "cfg": {"lr": None, "betas": None}})
    return state


@pytest.fixture(scope="module")
def dcp1(tmp_path_factory) -> str:
    """A single-process DCP checkpoint (one __0_0.distcp)."""
    path = str(tmp_path_factory.mktemp("dcp1") / "ck")
    _dcp_save_local({**{k: v.clone() for k, v in LOCAL_TENSORS.items()}, **LOCAL_VALUES}, path)
    return path


@pytest.fixture(scope="module")
def dcp2(tmp_path_factory) -> str:
    """A DCP checkpoint written by dcp.save on 2 gloo ranks (DTensor Shard(0))."""
    root = tmp_path_factory.mktemp("dcp2")
    path = str(root / "ck")
    results = check_all_ok(launch("dcp_save", 2, {"path": path}, out_dir=str(root / "out"), timeout=120))
    assert results[1]["local_rows"]["model.proj.bias"] == 0  # rank 1 saved an empty slice
    return path


def _copy(src: str, tmp_path, name: str = "src") -> str:
    dst = str(tmp_path / name)
    shutil.copytree(src, dst)
    return dst


def _nothing_at(dst: str) -> bool:
    parent, base = os.path.split(dst)
    return not os.path.exists(dst) and not [n for n in os.listdir(parent) if n.startswith(base + ".")]


# ----------------------------------------------------------------------------- round trips


@pytest.mark.slow
def test_two_rank_dtensor_dcp_save_imports_bit_for_bit(dcp2, tmp_path):
    dst = str(tmp_path / "imported")
    report = import_dcp(dcp2, dst, trust_pickle=True, step=123)
    assert report.skipped == ()
    full = dcp_full_tensors()
    # what DCP itself loads from its checkpoint (an independent reader of the same bytes)
    from_dcp = {fqn: torch.empty(t.shape, dtype=t.dtype) for fqn, t in full.items()}
    from_dcp.update({"step": 0, "name": "", "sched": {"lr": 0.0, "betas": (0.0, 0.0)}})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(from_dcp, checkpoint_id=dcp2, no_dist=True)
    targets = {fqn: torch.full(t.shape, 7).to(t.dtype) for fqn, t in full.items()}
    targets.update({"step": None, "name": None, "sched": {"lr": None, "betas": None}})
    shardfmt.load(targets, dst)
    for fqn, want in full.items():
        assert _same_bits(targets[fqn], want), fqn
        assert _same_bits(targets[fqn], from_dcp[fqn]), fqn
    assert targets["step"] == 123 and targets["name"] == "run-7"
    assert targets["sched"] == {"lr": 0.001, "betas": (0.9, 0.95)} == DCP_VALUES["sched"]
    assert shardfmt.read_manifest(dst).step == 123


@pytest.mark.slow
def test_imported_manifest_keeps_dcp_boxes_ranks_and_validates(dcp2, tmp_path):
    dst = str(tmp_path / "imported")
    import_dcp(dcp2, dst, trust_pickle=True)
    saved = FileSystemReader(dcp2).read_metadata()  # torch's own reading (our own test file)
    m = shardfmt.read_manifest(dst)
    assert m.topology.world_size == 2
    assert sorted(m.files) == ["data/rank_00000.safetensors", "data/rank_00001.safetensors"]
    assert {m.files[f].rank for f in m.files} == {0, 1}
    for fqn in (*DCP_SHARDED, "model.norm.weight", "model.count"):
        want = sorted((tuple(c.offsets), tuple(c.sizes)) for c in saved.state_dict_metadata[fqn].chunks)
        rec = m.tensors[fqn]
        assert sorted((s.offsets, s.lengths) for s in rec.shards) == want, fqn
        assert rec.shape == tuple(saved.state_dict_metadata[fqn].size) and rec.placement is None
        for s in rec.shards:  # the chunk stays in the file of the rank that wrote it
            index = next(k for k in saved.storage_data if k.fqn == fqn and tuple(k.offset) == s.offsets)
            dcp_rank = int(saved.storage_data[index].relative_path.split("_")[2])
            assert m.files[s.file].rank == dcp_rank, (fqn, s.offsets)
    assert len(m.tensors["model.embed.weight"].shards) == 2
    assert m.metadata == {"imported_from": {"format": "torch.distributed.checkpoint", "version": saved.version}}
    report = shardfmt.validate(dst, deep=True)
    assert report.ok, [str(p) for p in report.problems]


def test_single_process_save_round_trips_and_cli_reports(dcp1, tmp_path, capsys):
    dst = str(tmp_path / "imported")
    assert cli.main(["import-dcp", dcp1, dst, "--trust-pickle", "--step", "9"]) == 0
    assert "imported" in capsys.readouterr().out
    targets = _local_targets()
    shardfmt.load(targets, dst)
    for fqn, want in LOCAL_TENSORS.items():
        assert _same_bits(targets[fqn], want), fqn
    assert (targets["step"], targets["name"], targets["cfg"]) == (9, "local", {"lr": 0.5, "betas": (0.9, 0.99)})
    m = shardfmt.read_manifest(dst)
    assert m.step == 9 and m.topology.world_size == 1 and list(m.files) == ["data/rank_00000.safetensors"]
    assert m.tensors["model.empty"].shape == (0, 4)


def test_cli_budget_takes_a_size_and_a_missing_source_is_a_usage_error(dcp1, tmp_path, capsys):
    """``--memory-budget`` takes sizes as the other commands do (the same parts as the bytes
    given to the library); a bad size and a source that is not there exit 2 in one line."""
    budget = LOCAL_TENSORS["model.w"].nbytes
    assert cli.main(["import-dcp", dcp1, str(tmp_path / "a"), "--trust-pickle", "--memory-budget",
                     f"{budget / 1024}KiB"]) == 0
    import_dcp(dcp1, str(tmp_path / "b"), trust_pickle=True, memory_budget=budget)
    assert list(shardfmt.read_manifest(str(tmp_path / "a")).files) == list(
        shardfmt.read_manifest(str(tmp_path / "b")).files)
    capsys.readouterr()
    assert cli.main(["import-dcp", dcp1, str(tmp_path / "c"), "--trust-pickle", "--memory-budget", "lots"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("reshard: error: memory budget: memory_budget: 'lots' is not a size") and err.count("\n") == 1
    missing = str(tmp_path / "nothing-here")
    assert cli.main(["import-dcp", missing, str(tmp_path / "d"), "--trust-pickle"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"reshard: error: no checkpoint to import: {missing}: no .metadata") and err.count("\n") == 1
    assert not (tmp_path / "c").exists() and not (tmp_path / "d").exists()


def test_cli_import_dcp_json_report_and_progress(dcp1, tmp_path, capsys):
    dst = str(tmp_path / "j")
    assert cli.main(["import-dcp", dcp1, dst, "--trust-pickle", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    m = shardfmt.read_manifest(dst)
    assert got["tensors"] == len(m.tensors) and got["files"] >= len(m.files) and got["world_size"] == 1
    assert got["bytes_read"] > 0 and got["skipped"] == [] and got["dst"] == dst
    seen = []
    import_dcp(dcp1, str(tmp_path / "p"), trust_pickle=True, progress=seen.append)
    stored = sum(r.nbytes for r in shardfmt.read_manifest(str(tmp_path / "p")).tensors.values() if r.stored)
    assert seen and sum(seen) == stored  # every tensor byte told once


def test_memory_budget_splits_a_rank_into_parts(dcp1, tmp_path):
    dst = str(tmp_path / "parts")
    budget = LOCAL_TENSORS["model.w"].nbytes  # the largest chunk: every part holds at most this
    import_dcp(dcp1, dst, trust_pickle=True, memory_budget=budget)
    m = shardfmt.read_manifest(dst)
    assert len(m.files) >= 2 and all("_part_" in f and m.files[f].rank == 0 for f in m.files)
    for f in m.files:
        held = sum(r.nbytes for r in m.tensors.values() for s in (r.shards or ()) if s.file == f)
        assert held <= budget, f
    targets = _local_targets()
    shardfmt.load(targets, dst)
    assert all(_same_bits(targets[k], v) for k, v in LOCAL_TENSORS.items())
    assert shardfmt.validate(dst, deep=True).ok


class _Xor(StreamTransformExtension):
    """A toy stream transform (DCP's extension API, as zstd compression uses it)."""

    _TABLE = bytes(b ^ 0x5A for b in range(256))

    @staticmethod
    def registry_name() -> str:
        return "test.xor"

    @staticmethod
    def from_descriptor(version: str) -> _Xor:
        return _Xor()

    def get_descriptor(self) -> str:
        return "test.xor/1"

    def transform_to(self, output):
        table = self._TABLE

        class W(io.RawIOBase):
            def writable(self):
                return True

            def write(self, b):
                data = bytes(memoryview(b).cast("B")).translate(table)
                output.write(data)
                return len(data)

            def close(self):
                if not self.closed:
                    output.close()
                super().close()

        return W()

    def transform_from(self, input):
        table = self._TABLE

        class R(io.RawIOBase):
            def readable(self):
                return True

            def readinto(self, b):
                data = input.read(len(b))
                b[:len(data)] = data.translate(table)
                return len(data)

        return R()


def test_stream_transforms_are_undone_with_dcps_extension_registry(tmp_path):
    src = str(tmp_path / "xor")
    _dcp_save_local({"w": LOCAL_TENSORS["model.w"].clone(), "step": 3}, src, _extensions=[_Xor()])
    with pytest.raises(DcpImportError, match=r"test\.xor/1"):  # torch's default registry lacks it
        import_dcp(src, str(tmp_path / "a"), trust_pickle=True)
    assert _nothing_at(str(tmp_path / "a"))
    registry = ExtensionRegistry()
    registry.register(_Xor)
    import_dcp(src, str(tmp_path / "b"), trust_pickle=True, extension_registry=registry)
    targets = {"w": torch.empty(7, 5), "step": None}
    shardfmt.load(targets, str(tmp_path / "b"))
    assert _same_bits(targets["w"], LOCAL_TENSORS["model.w"]) and targets["step"] == 3


def test_unsupported_values_are_refused_or_skipped_with_a_warning(tmp_path, capsys):
    src = str(tmp_path / "odd")
    _dcp_save_local({"w": torch.ones(3), "step": 4, "frac": Fraction(1, 3), "tags": {1, 2}}, src)
    with pytest.raises(DcpImportError, match="'frac'.*weights_only"):  # a custom class: not even loaded
        import_dcp(src, str(tmp_path / "a"), trust_pickle=True)
    assert _nothing_at(str(tmp_path / "a"))
    with pytest.warns(UserWarning, match="skipped value"):
        report = import_dcp(src, str(tmp_path / "b"), trust_pickle=True, skip_unsupported_values=True)
    assert [k for k, _ in report.skipped] == ["frac", "tags"]  # a set loads, but is not typed JSON
    assert set(report.manifest.values) == {"step"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rc = cli.main(["import-dcp", src, str(tmp_path / "c"), "--trust-pickle", "--skip-unsupported-values"])
    assert rc == 0 and "skipped value 'tags'" in capsys.readouterr().err


# ----------------------------------------------------------------------------- refusals


def test_bad_step_or_a_destination_over_the_source_is_refused_before_any_work(dcp1, tmp_path, capsys):
    src = _copy(dcp1, tmp_path / "root")  # <tmp>/root/src
    before = sorted(os.listdir(src))
    dst = str(tmp_path / "x")
    with pytest.raises(SystemExit) as e:
        cli.main(["import-dcp", src, dst, "--trust-pickle", "--step", "-5"])
    assert e.value.code == 2 and "--step" in capsys.readouterr().err and _nothing_at(dst)
    with pytest.MonkeyPatch.context() as mp:  # refused before the source is even opened
        mp.setattr("reshard.dcp.importer.get_storage", lambda *a, **k: pytest.fail("opened the source"))
        with pytest.raises(StateDictError, match="step must be"):
            import_dcp(src, dst, trust_pickle=True, step=-5)
    assert _nothing_at(dst)
    for over in (src, str(tmp_path / "root"), os.path.join(src, "ck")):
        assert cli.main(["import-dcp", src, over, "--trust-pickle", "--overwrite"]) == 2
        err = capsys.readouterr().err
        assert "error: destination overlaps the source: " in err and err.count("\n") == 1
    assert sorted(os.listdir(src)) == before


def test_missing_trust_pickle_flag_is_refused(dcp1, tmp_path, capsys):
    dst = str(tmp_path / "x")
    assert cli.main(["import-dcp", dcp1, dst]) == 2
    err = capsys.readouterr().err
    assert "--trust-pickle" in err and "pickle" in err and "run code" in err
    with pytest.raises(DcpImportError, match="trust_pickle=True"):
        import_dcp(dcp1, dst, trust_pickle=False)
    assert _nothing_at(dst)


class _Mkdir:
    """Unpickling this calls os.mkdir(marker): a stand-in for any code a pickle can run."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


class _System:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _proto4(*parts: bytes) -> bytes:
    return b"\x80\x04" + b"".join(parts) + b"."


def _u(text: str) -> bytes:  # SHORT_BINUNICODE
    raw = text.encode()
    return b"\x8c" + bytes([len(raw)]) + raw


_META = "torch.distributed.checkpoint.metadata"


def _payloads(real_metadata: bytes, marker: str) -> dict[str, bytes]:
    nested = pickle.loads(real_metadata)  # our own test file: a real Metadata object
    nested.storage_meta.modules = [_Mkdir(marker)]
    return {
        # a real Metadata with a code-running object buried inside it
        "nested_mkdir": pickle.dumps(nested),
        "os_system": pickle.dumps(_System(marker)),
        # an allowed module, then attribute walking to a function through a dotted name
        "dotted_walk": _proto4(_u(_META), _u("os.system"), b"\x93", _u(f"touch {marker}"), b"\x85R"),
        "builtins_getattr": _proto4(_u("builtins"), _u("getattr"), b"\x93"),
        "torch_load": _proto4(_u("torch"), _u("load"), b"\x93"),
    }


@pytest.mark.parametrize("kind", ["nested_mkdir", "os_system", "dotted_walk", "builtins_getattr", "torch_load"])
def test_malicious_metadata_is_refused_without_running_it(dcp1, tmp_path, capsys, kind):
    src = _copy(dcp1, tmp_path)
    marker = str(tmp_path / "PWNED")
    real = open(os.path.join(dcp1, ".metadata"), "rb").read()
    payload = _payloads(real, marker)[kind]
    with open(os.path.join(src, ".metadata"), "wb") as f:
        f.write(payload)
    dst = str(tmp_path / "dst")
    with pytest.raises(UnsafePickleError, match="refused global") as e:
        import_dcp(src, dst, trust_pickle=True)
    assert os.path.join(src, ".metadata") in str(e.value)
    want = {"nested_mkdir": "posix.mkdir", "os_system": "posix.system", "dotted_walk": f"{_META}.os.system",
            "builtins_getattr": "builtins.getattr", "torch_load": "torch.load"}[kind]
    assert want in str(e.value)
    assert cli.main(["import-dcp", src, dst, "--trust-pickle"]) == 1
    assert "error: unsafe pickle refused: " in capsys.readouterr().err
    assert not os.path.exists(marker) and _nothing_at(dst)
    if kind == "nested_mkdir":  # the payload is live: plain pickle would have run it
        pickle.loads(payload)
        assert os.path.isdir(marker)


@pytest.mark.parametrize("payload", [
    # BUILD onto an allowed class itself (would set attributes on torch's Metadata class)
    _proto4(_u(_META), _u("Metadata"), b"\x93N}", _u("pwned"), b"K\x01s\x86b"),
    # an allowed class called with arguments
    _proto4(_u(_META), _u("Metadata"), b"\x93", _u("x"), b"\x85R"),
    # a dtype called as a function, and an unknown layout name
    _proto4(_u("torch"), _u("float32"), b"\x93", _u("x"), b"\x85R"),
    _proto4(_u("torch.serialization"), _u("_get_layout"), b"\x93", _u("torch.load"), b"\x85R"),
    b"\x80\x04\x95",  # truncated
], ids=["build_on_class", "class_with_args", "call_dtype", "bad_layout", "truncated"])
def test_allowed_globals_cannot_be_abused(tmp_path, payload):
    with pytest.raises(DcpImportError):
        parse_metadata(payload, where="x/.metadata")
    assert not hasattr(Metadata, "pwned")


# ----------------------------------------------------------------------------- expansion
# Pickle's memo lets a few bytes name an object again (BINGET): a small .metadata can make
# the unpickler, or the walk over what it built, do work far beyond its size.


def _one_chunk() -> ChunkStorageMetadata:
    return ChunkStorageMetadata(offsets=torch.Size([0]), sizes=torch.Size([1]))


def _one_tensor(chunks: list) -> TensorStorageMetadata:
    return TensorStorageMetadata(properties=TensorProperties(dtype=torch.float32), size=torch.Size([1]),
                                 chunks=chunks)


def _shared_chunks() -> bytes:
    """66 KB: 4,700 state_dict keys name one tensor record whose list repeats one chunk
    10,000 times: 47 million chunk records once walked."""
    one = _one_tensor([_one_chunk()] * 10_000)
    return pickle.dumps(Metadata(state_dict_metadata={f"k{i}": one for i in range(4_700)}, storage_data={}))


def _memo_put(opcode: bytes) -> bytes:
    """9 or 14 bytes that store None at memo index 2**24 (CPython's memo array: 2**25 slots, 256 MiB)."""
    index = struct.pack("<I", 1 << 24) if opcode == b"r" else b"%d\n" % (1 << 24)
    return b"\x80\x04N" + opcode + index + b"."


def _calls(fn: tuple[str, str], args: bytes, times: int, *, keep: bool, memo: int = 0) -> bytes:
    """Call the global ``fn`` ``times`` times on one memoised argument tuple, which ``args``
    pushes (using ``memo`` memo slots of its own); keep the results in a list, or drop each."""
    head = _u(fn[0]) + _u(fn[1]) + b"\x93\x94" + args + b"\x94"  # memo 0: fn, memo 1 + memo: args
    call = b"h\x00h" + bytes([1 + memo]) + b"R"  # BINGET fn, BINGET args, REDUCE
    return _proto4(head, b"](" + call * times + b"e" if keep else (call + b"0") * times + b"N")


def _path_parts() -> bytes:
    """100 KB: 20,000 pathlib paths from one tuple of 250 references to a 200-character part
    (each was joined into a new 50 KB string: 1 GB)."""
    part = b"X" + struct.pack("<I", 200) + b"p" * 200 + b"\x940"  # BINUNICODE, memo 1, POP
    return _calls(("pathlib", "PosixPath"), part + b"(" + b"h\x01" * 250 + b"t", 20_000, keep=True, memo=1)


_MEASURED_IMPORT = r"""
import json, resource, sys, time
from reshard.dcp.importer import METADATA_LIMIT, import_dcp
from shardfmt.errors import ShardfmtError

def status(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))

# a regression fails here instead of taking the machine's memory: 1 GiB more address space
# than the read of .metadata reserves (read_bytes asks for METADATA_LIMIT + 1 bytes, untouched)
guard = status("VmSize") + METADATA_LIMIT + (1 << 30)
resource.setrlimit(resource.RLIMIT_AS, (guard, guard))
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak (VmHWM) restarts from the current RSS
before = status("VmRSS")
start = time.perf_counter()
try:
    import_dcp(sys.argv[1], sys.argv[2], trust_pickle=True)
    error = None
except ShardfmtError as e:
    error = f"{type(e).__name__}: {e}"
print(json.dumps({"seconds": time.perf_counter() - start, "growth": status("VmHWM") - before, "error": error}))
"""

_EXPANDING = {
    "shared_chunks": (_shared_chunks, "expands past"),
    "long_binput_index": (lambda: _memo_put(b"r"), "memo index 16777216"),
    "put_index": (lambda: _memo_put(b"p"), "memo index 16777216"),
    "shared_path_parts": (_path_parts, "expands past"),
}


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(_EXPANDING))
def test_metadata_that_expands_through_the_memo_is_refused_in_bounded_time_and_memory(dcp1, tmp_path, kind):
    build, cause = _EXPANDING[kind]
    src = _copy(dcp1, tmp_path)
    payload = build()
    with open(os.path.join(src, ".metadata"), "wb") as f:
        f.write(payload)
    dst = str(tmp_path / "dst")
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    try:
        out = subprocess.run([sys.executable, "-c", _MEASURED_IMPORT, src, dst], capture_output=True, text=True,
                             timeout=60, env=env, cwd=ROOT)
    except subprocess.TimeoutExpired:
        pytest.fail(f"import of a {len(payload)}-byte .metadata still running after 60 s")
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["error"] is not None and got["error"].startswith("DcpImportError: "), got
    assert got["seconds"] < 2, got
    assert got["growth"] < 100 << 20, f"RSS grew {got['growth'] / 2**20:.0f} MiB ({got['error']})"
    assert os.path.join(src, ".metadata") in got["error"] and cause in got["error"], got["error"]
    if cause == "expands past":
        assert f"past {record_cap(len(payload))} records" in got["error"]
    assert _nothing_at(dst)


def test_cli_refuses_a_metadata_that_expands_with_one_line(dcp1, tmp_path, capsys):
    src = _copy(dcp1, tmp_path)
    with open(os.path.join(src, ".metadata"), "wb") as f:
        f.write(_shared_chunks())
    dst = str(tmp_path / "dst")
    with deadline(10, "import-dcp of a 66 KB .metadata"):
        rc = cli.main(["import-dcp", src, dst, "--trust-pickle"])
    err = capsys.readouterr().err
    assert rc == 1 and err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"reshard: error: cannot import the DCP checkpoint: {os.path.join(src, '.metadata')}: expands past ")
    assert _nothing_at(dst)


def test_memo_scan_passes_the_memo_of_every_protocol_dcp_metadata_may_use(dcp1):
    md = pickle.loads(open(os.path.join(dcp1, ".metadata"), "rb").read())  # our own test file
    for i in range(100):  # past 256 memo entries: protocols 2 and 3 write LONG_BINPUT
        md.state_dict_metadata[f"extra.{i}"] = BytesStorageMetadata()
        md.storage_data[MetadataIndex(fqn=f"extra.{i}")] = _StorageInfo(relative_path="__0_0.distcp", offset=i,
                                                                        length=1)
    want = parse_metadata(pickle.dumps(md, protocol=4), where="m")
    assert len(want.values) > 100
    for protocol in (2, 3, 5):
        data = pickle.dumps(md, protocol=protocol)
        assert protocol > 3 or "LONG_BINPUT" in {op.name for op, _, _ in pickletools.genops(data)}
        assert parse_metadata(data, where="m") == want, protocol


def _shared_descriptors() -> bytes:
    """4,000 storage entries share one location whose descriptor list repeats a string 10,000 times."""
    info = _StorageInfo(relative_path="__0_0.distcp", offset=0, length=1, transform_descriptors=["x"] * 10_000)
    return pickle.dumps(Metadata(state_dict_metadata={}, storage_data={
        MetadataIndex(fqn=f"k{i}"): info for i in range(4_000)}))


def _shared_state_fields() -> bytes:
    """One tensor lists one chunk 20,000 times; that chunk's state has 50,000 more fields."""
    chunk = _one_chunk()
    vars(chunk).update((f"f{i}", None) for i in range(50_000))
    return pickle.dumps(Metadata(state_dict_metadata={"w": _one_tensor([chunk] * 20_000)}, storage_data={}))


def _size_of_a_shared_list() -> bytes:
    """20,000 torch.Size calls on one list of 10,000 dims (each was copied into a new tuple)."""
    dims = b"](K\x00" + b"2" * 9_999 + b"e\x85"  # a list of 10,000 zeros (DUP), in a 1-tuple
    return _calls(("torch", "Size"), dims, 20_000, keep=False)


def _ordered_dict_of_shared_items() -> bytes:
    """20,000 OrderedDict calls on one list of 10,000 pairs (each was copied into a new dict)."""
    pairs = b"](" + b"".join(b"M" + struct.pack("<H", i) + b"N\x86" for i in range(10_000)) + b"e\x85"
    return _calls(("collections", "OrderedDict"), pairs, 20_000, keep=False)


@pytest.mark.parametrize("build, refused", [
    (_shared_descriptors, "expands past"),
    (_size_of_a_shared_list, "torch.Size of"),
    (_ordered_dict_of_shared_items, "OrderedDict called with arguments"),
], ids=["shared_descriptors", "size_of_a_shared_list", "ordered_dict_of_shared_items"])
def test_a_shared_object_is_not_rebuilt_for_each_reference(build, refused):
    payload = build()
    with deadline(5, f"parse of a {len(payload)}-byte .metadata"), pytest.raises(DcpImportError, match=refused) as e:
        parse_metadata(payload, where="x/.metadata")
    assert str(e.value).startswith("x/.metadata: ")


def test_a_shared_record_with_many_fields_is_read_by_name_on_each_visit():
    payload = _shared_state_fields()  # within the cap: 20,000 visits, each reads two of its fields
    with deadline(5, f"parse of a {len(payload)}-byte .metadata"):
        meta = parse_metadata(payload, where="x/.metadata")
    assert len(meta.tensors["w"].chunks) == 20_000 <= record_cap(len(payload))


def test_planner_paths_with_an_out_of_range_index_are_not_used():
    md = Metadata(state_dict_metadata={"a.0": BytesStorageMetadata(), "b.1": BytesStorageMetadata()},
                  storage_data={}, planner_data={"a.0": ("a", 0), "b.1": ("b", 10 ** 5000)})
    assert parse_metadata(pickle.dumps(md), where="m").paths is None  # the keys are used as they are
    md.planner_data["b.1"] = ("b", 1)
    assert parse_metadata(pickle.dumps(md), where="m").paths == {"a.0": ("a", 0), "b.1": ("b", 1)}


def test_missing_metadata_missing_or_truncated_distcp_are_named(dcp1, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DcpImportError, match="no .metadata"):
        import_dcp(str(empty), str(tmp_path / "d0"), trust_pickle=True)
    missing = _copy(dcp1, tmp_path, "missing")
    os.remove(os.path.join(missing, "__0_0.distcp"))
    with pytest.raises(DcpImportError, match=r"__0_0\.distcp: missing"):
        import_dcp(missing, str(tmp_path / "d1"), trust_pickle=True)
    short = _copy(dcp1, tmp_path, "short")
    path = os.path.join(short, "__0_0.distcp")
    os.truncate(path, os.path.getsize(path) - 100)
    with pytest.raises(DcpImportError, match=r"__0_0\.distcp: truncated: tensor '.*' chunk"):
        import_dcp(short, str(tmp_path / "d2"), trust_pickle=True)
    assert all(_nothing_at(str(tmp_path / d)) for d in ("d0", "d1", "d2"))


def _late_item(src: str, budget: int):
    """A non-empty chunk that the import writes after at least one earlier part."""
    meta = parse_metadata(open(os.path.join(src, ".metadata"), "rb").read(), where="m")
    sizes = {n: os.path.getsize(os.path.join(src, n)) for n in os.listdir(src) if n.endswith(".distcp")}
    plan = plan_import(meta, sizes, memory_budget=budget)
    late = [it for p in plan.parts[1:] for it in p.items if it.nbytes]
    assert len(plan.parts) >= 2 and late
    return late[-1]


def _tensor_data_offset(item_bytes: bytes) -> int:
    """Where the tensor's storage bytes start inside one torch.save'd item (its zip member data/0)."""
    zf = zipfile.ZipFile(io.BytesIO(item_bytes))
    info = next(i for i in zf.infolist() if i.filename.endswith("/data/0"))
    name_len, extra_len = struct.unpack("<HH", item_bytes[info.header_offset + 26:info.header_offset + 30])
    return info.header_offset + 30 + name_len + extra_len


@pytest.mark.parametrize("damage", ["flip_one_data_byte", "zero_the_item"])
def test_corrupt_item_aborts_the_import_after_parts_were_written(dcp1, tmp_path, damage):
    src = _copy(dcp1, tmp_path)
    budget = 16
    item = _late_item(src, budget)  # earlier parts are already staged when it fails
    loc = item.location
    with open(os.path.join(src, loc.relative_path), "r+b") as f:
        f.seek(loc.offset)
        raw = bytearray(f.read(loc.length))
        if damage == "flip_one_data_byte":  # DCP has no checksum; torch.save's zip CRC catches it
            raw[_tensor_data_offset(bytes(raw)) + item.nbytes - 1] ^= 0x01
        else:
            raw[:] = bytes(len(raw))
        f.seek(loc.offset)
        f.write(raw)
    dst = str(tmp_path / "dst")
    with pytest.raises(DcpImportError, match=f"{item.fqn!r}") as e:
        import_dcp(src, dst, trust_pickle=True, memory_budget=budget)
    assert ("CRC" in str(e.value)) if damage == "flip_one_data_byte" else ("weights_only" in str(e.value))
    assert _nothing_at(dst)


def test_plan_refuses_overlapping_chunks_and_maps_files_to_ranks():
    loc = DcpLocation(relative_path="__0_0.distcp", offset=0, length=10)
    t = DcpTensor(fqn="w", dtype=torch.float32, shape=(4,),
                  chunks=(DcpChunk(offsets=(0,), sizes=(3,)), DcpChunk(offsets=(2,), sizes=(2,))))
    meta = DcpMetadata(tensors={"w": t}, values=(), locations={("w", (0,)): loc, ("w", (2,)): loc})
    with pytest.raises(DcpImportError, match="do not tile"):
        plan_import(meta, {"__0_0.distcp": 10})
    same = DcpTensor(fqn="w", dtype=torch.float32, shape=(4,),
                     chunks=(DcpChunk(offsets=(0,), sizes=(4,)), DcpChunk(offsets=(0,), sizes=(4,))))
    plan = plan_import(DcpMetadata(tensors={"w": same}, values=(), locations={("w", (0,)): loc}),
                       {"__0_0.distcp": 10}, extra_files=["__3_0.distcp"])
    assert [len(p.items) for p in plan.parts] == [1] and plan.world_size == 4  # a listed duplicate, once
    assert rank_of_files(["__1_0.distcp", "__0_0.distcp", "__1_1.distcp"]) == {
        "__0_0.distcp": 0, "__1_0.distcp": 1, "__1_1.distcp": 1}
    assert rank_of_files(["b.distcp", "a.distcp"]) == {"a.distcp": 0, "b.distcp": 1}


def test_model_and_adam_state_load_into_the_structure_dcp_saved(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, betas=(0.8, 0.9))
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    saved = {"model": model.state_dict(), "optim": opt.state_dict(), "epoch": 2}
    src, dst = str(tmp_path / "dcp"), str(tmp_path / "imported")
    _dcp_save_local(saved, src)
    import_dcp(src, dst, trust_pickle=True)
    # DCP saved optim.param_groups.0.lr, ...; shardfmt names the tensor-free list one value
    m = shardfmt.read_manifest(dst)
    assert "optim.param_groups" in m.values and "optim.param_groups.0.lr" not in m.values

    def blank(x):
        if isinstance(x, torch.Tensor):
            return torch.full_like(x, -1)
        if isinstance(x, dict):
            return {k: blank(v) for k, v in x.items()}
        return None if not isinstance(x, list) else [blank(v) for v in x]

    targets = blank(saved)
    targets["optim"]["param_groups"] = None  # a value leaf: replaced whole
    shardfmt.load(targets, dst)
    for k, v in saved["model"].items():
        assert _same_bits(targets["model"][k], v), k
    for i, st in saved["optim"]["state"].items():
        for k, v in st.items():
            assert _same_bits(targets["optim"]["state"][i][k], v), (i, k)
    assert targets["optim"]["param_groups"] == saved["optim"]["param_groups"]
    assert targets["epoch"] == 2


def test_group_values_rebuilds_tensor_free_containers_as_shardfmt_names_them():
    from reshard.dcp.plan import Slot, group_values

    tensors = ["optim.state.0.exp_avg"]
    values = ["optim.state.0.step", "optim.param_groups.0.lr", "optim.param_groups.0.params", "sched.lr",
              "gap.0", "gap.2", "top"]
    paths = {"optim.state.0.exp_avg": ("optim", "state", "0", "exp_avg"), "optim.state.0.step": ("optim", "state", "0", "step"),
             "optim.param_groups.0.lr": ("optim", "param_groups", 0, "lr"),
             "optim.param_groups.0.params": ("optim", "param_groups", 0, "params"),
             "sched.lr": ("sched", "lr"), "gap.0": ("gap", 0), "gap.2": ("gap", 2), "top": ("top",)}
    got = dict(group_values(values, tensors, paths))
    assert got == {
        "optim.state.0.step": Slot("optim.state.0.step"),  # next to a tensor: its own value
        "optim.param_groups": [{"lr": Slot("optim.param_groups.0.lr"), "params": Slot("optim.param_groups.0.params")}],
        "sched": {"lr": Slot("sched.lr")},
        "gap.0": Slot("gap.0"), "gap.2": Slot("gap.2"),  # a list with a hole cannot be rebuilt
        "top": Slot("top"),
    }
    assert dict(group_values(values, tensors, None)) == {k: Slot(k) for k in values}
    # {"a.b": 1, "a": {"t": tensor, "b": {"c": 2}}}: a rebuilt "a.b" would collide with the
    # literal key "a.b": keep DCP's keys
    clash_paths = {"a.b": ("a.b",), "a.b.c": ("a", "b", "c"), "a.t": ("a", "t")}
    clash = dict(group_values(["a.b", "a.b.c"], ["a.t"], clash_paths))
    assert clash == {"a.b": Slot("a.b"), "a.b.c": Slot("a.b.c")}
    assert dict(group_values(["a.b", "a.b.c"], [], clash_paths)) == {"a.b": Slot("a.b"), "a": {"b": {"c": Slot("a.b.c")}}}
