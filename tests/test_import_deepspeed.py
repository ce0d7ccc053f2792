"""``reshard import-deepspeed``: real DeepSpeed 0.19.8 checkpoints (tests/fixtures/deepspeed, README
there) imported and compared bit for bit with what DeepSpeed's own zero_to_fp32 rebuilt from them."""

from __future__ import annotations

import importlib.util
import math
import os
import shutil
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import shardfmt
from reshard._shardfmt import open_checkpoint
from reshard.cli import main as reshard_main
from reshard.deepspeed import import_deepspeed
from reshard.deepspeed.layout import plan_zero3, plan_zero12
from reshard.errors import DeepSpeedImportError, UnsafePickleError
from reshard.hf_export import export_hf

FIX = Path(__file__).parent / "fixtures" / "deepspeed"
CASES = sorted(p.name for p in FIX.iterdir() if (p / "latest").is_file())
STAGE1 = {"z1_ws2", "z1_ws2_bf16"}  # zero_to_fp32 has no frozen params for ZeRO-1 (not saved in fp32)


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def _import(case: str, dst: Path, **kw):
    return import_deepspeed(str(FIX / case), str(dst), trust_pickle=True, **kw)


def test_fixtures_cover_stages_dtypes_and_world_sizes():
    assert {"z1_ws2", "z2_ws1_dsopt", "z2_ws2", "z2_ws2_bf16", "z2_ws3", "z3_ws1", "z3_ws2", "z3_ws2_bf16",
            "z3_ws2_sub"} <= set(CASES)


@pytest.mark.parametrize("case", CASES)
def test_import_equals_zero_to_fp32_bit_for_bit(case, tmp_path):
    dst = tmp_path / "ckpt"
    rep = _import(case, dst, format_version=1 if case.endswith("bf16") else None)
    params = load_file(FIX / case / "zero_to_fp32.safetensors")
    optim = load_file(FIX / case / "zero_to_fp32_optim.safetensors")
    m = rep.manifest
    assert sorted(n for n in m.tensors if n.startswith("model.")) == sorted(f"model.{k}" for k in params)
    state = {f"model.{k}": torch.full_like(v, float("nan")) for k, v in params.items()}
    state |= {f"optim.state.{k}": torch.full_like(v, float("nan")) for k, v in optim.items()}
    shardfmt.load(state, str(dst))
    for k, v in params.items():
        got = state[f"model.{k}"]
        assert got.dtype == v.dtype == torch.float32 and got.shape == v.shape and _bits(got) == _bits(v), k
    for k, v in optim.items():
        assert _bits(state[f"optim.state.{k}"]) == _bits(v), k
    trainable = {k.rsplit(".", 1)[0] for k in optim}
    assert all(f"optim.state.{p}.step" in m.tensors or f"optim.state.{p}.step" in m.values for p in trainable)
    # elastic checkpoints keep no param_groups; the names are checked through a real optimizer below
    assert ("optim.param_groups" in m.values) == (case != "z2_ws2_elastic")
    assert shardfmt.validate(str(dst), deep=True).ok
    assert [n for n, _ in rep.left_out] == (["model.frozen.weight", "model.frozen.bias"] if case in STAGE1 else [])


class Tiny(torch.nn.Module):
    """The fixtures' model (gen_ds_ckpt.py), rebuilt without DeepSpeed."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(7, 3)
        self.proj = torch.nn.Linear(3, 5)
        self.norm = torch.nn.LayerNorm(5)
        self.frozen = torch.nn.Linear(5, 3)
        self.head = torch.nn.Linear(3, 7, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("counter", torch.zeros(4))
        for p in self.frozen.parameters():
            p.requires_grad_(False)


@pytest.mark.parametrize("case", ["z2_ws2", "z3_ws2_sub"])
def test_loads_into_a_plain_torch_model_and_adamw(case, tmp_path):
    dst = tmp_path / "ckpt"
    _import(case, dst)
    model = Tiny()
    decay = [model.emb.weight, model.proj.weight]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": [model.proj.bias, model.norm.weight, model.norm.bias], "weight_decay": 0.0}],
                            lr=0.05)
    state = shardfmt.get_state_dict(model, opt)
    shardfmt.load(state, str(dst))
    shardfmt.set_state_dict(model, opt, state)
    params = load_file(FIX / case / "zero_to_fp32.safetensors")
    optim = load_file(FIX / case / "zero_to_fp32_optim.safetensors")
    for name, p in model.named_parameters(remove_duplicate=False):
        assert _bits(p.detach()) == _bits(params[name]), name
    names = {p: n for n, p in model.named_parameters()}
    for p, s in opt.state.items():
        assert _bits(s["exp_avg"]) == _bits(optim[f"{names[p]}.exp_avg"])
        assert float(s["step"]) == 2.0
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0] and opt.param_groups[0]["lr"] == 0.05


@pytest.mark.parametrize("case", ["z1_ws2_bf16", "z2_ws2", "z3_ws2"])
def test_export_hf_of_an_import(case, tmp_path):
    dst, hf = tmp_path / "ckpt", tmp_path / "hf"
    _import(case, dst)
    export_hf(str(dst), str(hf), only="model")
    params = load_file(FIX / case / "zero_to_fp32.safetensors")
    got = load_file(hf / "model.safetensors")
    assert set(got) <= set(params) and set(params) - set(got) <= {"head.weight"}  # a tie is written once
    assert all(_bits(got[k]) == _bits(params[k]) for k in got)


def test_cli_round_trip_and_flag_required(tmp_path, capsys):
    src, dst = FIX / "z2_ws2", tmp_path / "ckpt"
    assert reshard_main(["import-deepspeed", str(src), str(dst)]) == 2
    assert "needs --trust-pickle" in capsys.readouterr().err and not dst.exists()
    with pytest.raises(DeepSpeedImportError, match="trust_pickle=True"):
        import_deepspeed(str(src), str(dst), trust_pickle=False)
    assert not dst.exists()
    assert reshard_main(["import-deepspeed", str(src), str(dst), "--trust-pickle", "--format-version", "1",
                         "--model-prefix", ""]) == 0
    out = capsys.readouterr().out
    assert "ZeRO-2, 2 ranks, DeepSpeed 0.19.8" in out
    m = open_checkpoint(str(dst)).manifest
    assert {"emb.weight", "head.weight", "optim.state.emb.weight.exp_avg"} <= set(m.tensors)
    assert m.tensors["head.weight"].alias_of == "emb.weight"


def _copy(case: str, tmp_path: Path) -> Path:
    out = tmp_path / case
    shutil.copytree(FIX / case, out)
    return out


def test_missing_latest_and_tag(tmp_path):
    src = _copy("z2_ws2", tmp_path)
    (src / "latest").unlink()
    with pytest.raises(DeepSpeedImportError, match="latest: missing"):
        import_deepspeed(str(src), str(tmp_path / "a"), trust_pickle=True)
    assert import_deepspeed(str(src), str(tmp_path / "b"), trust_pickle=True, tag="global_step2").zero_stage == 2
    with pytest.raises(DeepSpeedImportError, match="no such tag directory"):
        import_deepspeed(str(src), str(tmp_path / "c"), trust_pickle=True, tag="global_step9")


def test_missing_rank_file(tmp_path):
    src = _copy("z3_ws2", tmp_path)
    (src / "global_step2" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(DeepSpeedImportError, match=r"zero_pp_rank_1_mp_rank_00_optim_states.pt: missing"):
        import_deepspeed(str(src), str(tmp_path / "out"), trust_pickle=True)
    assert not (tmp_path / "out").exists()


def test_truncated_file(tmp_path, capsys):
    src = _copy("z2_ws2", tmp_path)
    f = src / "global_step2" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(DeepSpeedImportError, match="zero_pp_rank_1_mp_rank_00_optim_states.pt: not a torch.save zip"):
        import_deepspeed(str(src), str(tmp_path / "out"), trust_pickle=True)
    assert reshard_main(["import-deepspeed", str(src), str(tmp_path / "out"), "--trust-pickle"]) == 1
    err = capsys.readouterr().err
    assert "error: cannot import the DeepSpeed checkpoint: " in err and "Traceback" not in err


def test_flipped_storage_byte_fails_the_crc(tmp_path):
    src = _copy("z2_ws2", tmp_path)
    f = src / "global_step2" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    with zipfile.ZipFile(f) as zf:
        info = next(i for i in zf.infolist() if i.filename.endswith("/data/7"))
    raw = bytearray(f.read_bytes())
    name_len, extra_len = struct.unpack("<HH", raw[info.header_offset + 26:info.header_offset + 30])
    assert info.CRC != 0
    raw[info.header_offset + 30 + name_len + extra_len + 2] ^= 0x40
    f.write_bytes(bytes(raw))
    with pytest.raises(DeepSpeedImportError, match="storage '7' fails its zip CRC-32"):
        import_deepspeed(str(src), str(tmp_path / "out"), trust_pickle=True)


def test_files_of_two_stages_mixed(tmp_path):
    src = _copy("z3_ws2", tmp_path)
    name = "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    shutil.copy(FIX / "z2_ws2" / "global_step2" / name, src / "global_step2" / name)
    with pytest.raises(DeepSpeedImportError, match=f"{name}: ZeRO stage 2 over 2 ranks, rank 0's file says stage 3"):
        import_deepspeed(str(src), str(tmp_path / "out"), trust_pickle=True)


def _rewrite_pickle(path: Path, old: bytes, new: bytes) -> None:
    with zipfile.ZipFile(path) as zf:
        entries = [(i, zf.read(i)) for i in zf.infolist()]
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zf:
        for info, data in entries:
            zf.writestr(info, data.replace(old, new, 1) if info.filename.endswith("data.pkl") else data)


def test_refused_global(tmp_path, capsys):
    src = _copy("z2_ws2", tmp_path)
    f = src / "global_step2" / "mp_rank_00_model_states.pt"
    _rewrite_pickle(f, b"ccollections\nOrderedDict\n", b"cposix\nsystem\n")
    with pytest.raises(UnsafePickleError, match=r"mp_rank_00_model_states.pt: refused global posix.system") as e:
        import_deepspeed(str(src), str(tmp_path / "out"), trust_pickle=True)
    assert isinstance(e.value, DeepSpeedImportError)
    assert reshard_main(["import-deepspeed", str(src), str(tmp_path / "out"), "--trust-pickle"]) == 1
    assert "error: unsafe pickle refused: " in capsys.readouterr().err and not (tmp_path / "out").exists()


def test_storage_larger_than_its_entry_is_refused_before_reading(tmp_path):
    src = _copy("z2_ws1_dsopt", tmp_path)
    f = src / "global_step2" / "mp_rank_00_model_states.pt"
    # the first storage (the 4-float buffer 'counter') claims 2^31 - 1 elements: BININT1 4 -> BININT 0x7fffffff
    _rewrite_pickle(f, b"cpuq\tK\x04t", b"cpuq\tJ\xff\xff\xff\x7ft")
    with pytest.raises(DeepSpeedImportError, match="mp_rank_00_model_states.pt: .*is 16 bytes in the file"):
        import_deepspeed(str(src), str(tmp_path / "out"), trust_pickle=True)


def test_partitions_that_do_not_add_up():
    with pytest.raises(DeepSpeedImportError, match="does not add up"):
        plan_zero12([(("w", (10,)),)], [[4], [4]], None, world_size=2, paddings=None, where="f")
    with pytest.raises(DeepSpeedImportError, match="more than 3 apart"):
        plan_zero12([(("w", (3,)),)], [[4], [4]], None, world_size=2, paddings=None, where="f")
    with pytest.raises(DeepSpeedImportError, match="equal on every rank"):
        plan_zero3([(("w", (10,)),)], [[5], [4]], None, world_size=2, where="f")
    with pytest.raises(DeepSpeedImportError, match="does not add up"):
        plan_zero3([(("w", (10,)),)], [[6], [6]], None, world_size=2, where="f")
    plans = plan_zero3([(("a", (3,)), ("b", (4,)))], [[4], [4]], [[4], [4]], world_size=2, where="f")
    assert [(p.rank, p.start, p.length) for p in plans[0].master] == [(0, 0, 2), (1, 0, 1)]
    assert [(p.rank, p.start, p.length) for p in plans[1].master] == [(0, 2, 2), (1, 2, 2)]


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed (see fixtures README)")
def test_fresh_deepspeed_checkpoint_end_to_end(tmp_path):
    """Train with real DeepSpeed (ZeRO-3, 2 gloo ranks), run its zero_to_fp32, import, compare."""
    out = tmp_path / "run"
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(29500 + os.getpid() % 1000), "WORLD_SIZE": "2"}
    procs = [subprocess.Popen([sys.executable, str(FIX / "gen_ds_ckpt.py"), str(out), "3"],
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(2)]
    assert [p.wait(timeout=600) for p in procs] == [0, 0]
    subprocess.run([sys.executable, str(FIX / "make_oracle.py"), str(out)], check=True, env=env, timeout=600)
    rep = import_deepspeed(str(out), str(tmp_path / "ckpt"), trust_pickle=True)
    params = load_file(out / "zero_to_fp32.safetensors")
    state = {f"model.{k}": torch.empty_like(v) for k, v in params.items()}
    shardfmt.load(state, str(tmp_path / "ckpt"))
    assert rep.zero_stage == 3 and all(_bits(state[f"model.{k}"]) == _bits(v) for k, v in params.items())


def test_progress_is_told_every_tensor_byte_written(tmp_path):
    seen: list[int] = []
    rep = _import(CASES[0], tmp_path / "p", memory_budget=64, progress=seen.append)
    m = rep.manifest
    stored = sum(t.itemsize * math.prod(t.shape) for t in shardfmt.read_manifest(str(tmp_path / "p")).tensors.values()
                 if t.stored)
    assert len(seen) > 1 and sum(seen) == stored, (seen, stored)  # one call per part written
    assert m.step is not None
