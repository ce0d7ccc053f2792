"""export-hf / import-hf against the real client: transformers loads what we export."""

from __future__ import annotations

import json
import os
import struct

import pytest
import torch
from conftest import bytes_equal

import shardfmt
from reshard.cli import main as reshard_main
from reshard.errors import HFError
from reshard.hf_export import export_hf
from reshard.hf_import import import_hf
from reshard.hf_layout import HF_CONFIG_KEY

CONFIG = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)
INPUT = (torch.arange(24).reshape(2, 12) * 7) % 128


def _transformers():
    """transformers, imported by the tests that use it (at collection it cost every run 2 s)."""
    return pytest.importorskip("transformers")


def tiny_llama(tie: bool, seed: int = 0):
    transformers = _transformers()
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(**CONFIG, tie_word_embeddings=tie)
    return transformers.LlamaForCausalLM(cfg).eval()


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(INPUT).logits


def load_hf(path: str, **kw):
    return _transformers().AutoModelForCausalLM.from_pretrained(path, **kw).eval()


def hf_header(path: str) -> dict:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n))


@pytest.mark.slow
def test_export_tied_llama_sharded_loads_in_transformers_with_equal_logits(tmp_path):
    model = tiny_llama(tie=True)
    sd = model.state_dict()
    assert sd["lm_head.weight"].data_ptr() == sd["model.embed_tokens.weight"].data_ptr()
    ck, out = str(tmp_path / "ck"), str(tmp_path / "hf")
    shardfmt.save(sd, ck, metadata={HF_CONFIG_KEY: model.config.to_dict()})
    rep = export_hf(ck, out, max_shard_size="60KB", memory_budget="1MiB")
    names = sorted(os.listdir(out))
    assert "config.json" in names and "model.safetensors.index.json" in names
    assert len(rep.files) > 1 and all(f in names for f in rep.files)
    assert rep.files[0] == f"model-00001-of-{len(rep.files):05d}.safetensors"
    index = json.load(open(os.path.join(out, "model.safetensors.index.json")))
    assert "lm_head.weight" not in index["weight_map"]  # tied: written once
    assert rep.omitted and rep.omitted[0][0] == "lm_head.weight"
    assert set(index["weight_map"]) == set(sd) - {"lm_head.weight"}
    sizes = {}
    for f in rep.files:
        h = hf_header(os.path.join(out, f))
        assert h["__metadata__"] == {"format": "pt"}
        for k, v in h.items():
            if k != "__metadata__":
                assert index["weight_map"][k] == f
                sizes[k] = v["data_offsets"][1] - v["data_offsets"][0]
        assert os.path.getsize(os.path.join(out, f)) <= 60_000 or len(h) == 2  # one oversized tensor alone
    assert index["metadata"]["total_size"] == sum(sizes.values())
    loaded = load_hf(out)
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    assert torch.equal(logits(loaded), logits(model))

    # import back: identical model tensors, lm_head.weight an alias of the embedding again
    back = str(tmp_path / "back")
    irep = import_hf(out, back)
    assert irep.tied_alias == "model.embed_tokens.weight"
    m = shardfmt.read_manifest(back)
    assert m.metadata[HF_CONFIG_KEY]["tie_word_embeddings"] is True and m.topology.world_size == 1
    assert m.tensors["lm_head.weight"].alias_of == "model.embed_tokens.weight"
    targets = {k: torch.empty_like(v) for k, v in sd.items()}
    shardfmt.load(targets, back)
    assert all(bytes_equal(targets[k], sd[k]) for k in sd)
    # and once more: export of the import writes the same tensors
    again = str(tmp_path / "again")
    export_hf(back, again, max_shard_size="60KB")
    assert torch.equal(logits(load_hf(again)), logits(model))


@pytest.mark.slow
def test_untied_single_file_with_checkpointer_nesting_optimizer_left_out(tmp_path):
    model = tiny_llama(tie=False, seed=1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(INPUT).logits.sum().backward()
    opt.step()
    ck = str(tmp_path / "ck")
    ckpt = shardfmt.Checkpointer(str(tmp_path / "root"))
    path = ckpt.save(1, {"model": model, "optim": opt}, metadata={HF_CONFIG_KEY: model.config.to_dict()})
    out = str(tmp_path / "hf")
    rep = export_hf(path, out, only="model")
    assert rep.files == ("model.safetensors",) and rep.excluded > 0  # optimizer and RNG left out
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    assert "lm_head.weight" in hf_header(os.path.join(out, "model.safetensors"))
    assert torch.equal(logits(load_hf(out)), logits(model))
    # without --only: names kept as they are (model.model.layers...), optimizer state left out
    raw = str(tmp_path / "raw")
    rep = export_hf(path, raw)
    keys = set(hf_header(os.path.join(raw, "model.safetensors"))) - {"__metadata__"}
    assert keys == {"model." + k for k in model.state_dict()}
    # prefix mapping gives the same names as --only
    mapped = str(tmp_path / "mapped")
    export_hf(path, mapped, strip_prefix="model.")
    assert set(hf_header(os.path.join(mapped, "model.safetensors"))) - {"__metadata__"} == set(model.state_dict())
    del ck


@pytest.mark.slow
def test_dtype_bf16_export_and_config(tmp_path):
    model = tiny_llama(tie=False, seed=2)
    ck, out = str(tmp_path / "ck"), str(tmp_path / "hf")
    shardfmt.save({"model": model.state_dict(), "optim": {"step": torch.tensor(3.0)}}, ck,
                  metadata={"user": {HF_CONFIG_KEY: model.config.to_dict()}})
    export_hf(ck, out, only="model", dtype="bf16")
    cfg = json.load(open(os.path.join(out, "config.json")))
    assert cfg["dtype"] == "bfloat16"
    h = hf_header(os.path.join(out, "model.safetensors"))
    assert {v["dtype"] for k, v in h.items() if k != "__metadata__"} == {"BF16"}
    loaded = load_hf(out, dtype=torch.bfloat16)
    want = model.to(torch.bfloat16).state_dict()
    for k, v in loaded.state_dict().items():
        assert bytes_equal(v, want[k]), k


@pytest.mark.slow
def test_tied_config_with_separately_stored_equal_or_different_head(tmp_path):
    """A distributed save of a tied model stores both tensors: equal -> lm_head left out;
    different -> refused rather than silently replaced by the embedding on load."""
    model = tiny_llama(tie=True, seed=3)
    sd = {k: v.clone() for k, v in model.state_dict().items()}  # clones: no alias recorded
    cfg = model.config.to_dict()
    ck = str(tmp_path / "ck")
    shardfmt.save(sd, ck, metadata={HF_CONFIG_KEY: cfg})
    assert shardfmt.read_manifest(ck).tensors["lm_head.weight"].alias_of is None
    rep = export_hf(ck, str(tmp_path / "hf"), memory_budget="1MiB")
    assert rep.omitted[0][0] == "lm_head.weight" and "equal to" in rep.omitted[0][1]
    assert torch.equal(logits(load_hf(str(tmp_path / "hf"))), logits(model))
    sd["lm_head.weight"][3, 5] += 1
    bad = str(tmp_path / "bad")
    shardfmt.save(sd, bad, metadata={HF_CONFIG_KEY: cfg})
    with pytest.raises(HFError, match="differs from the input embedding"):
        export_hf(bad, str(tmp_path / "hf2"))
    assert not os.path.exists(str(tmp_path / "hf2"))
    untied = dict(cfg, tie_word_embeddings=False)
    (tmp_path / "cfg.json").write_text(json.dumps(untied))
    rep = export_hf(bad, str(tmp_path / "hf3"), config=str(tmp_path / "cfg.json"))
    assert rep.omitted == ()
    assert "lm_head.weight" in hf_header(os.path.join(tmp_path, "hf3", "model.safetensors"))


def test_views_are_materialised_and_aliases_copied(tmp_path):
    fused = torch.arange(48, dtype=torch.float32)
    sd = {"qkv.q": fused[:16].view(4, 4), "qkv.kT": fused[16:32].view(4, 4).t(), "w": torch.ones(3),
          "w_again": None}
    sd["w_again"] = sd["w"]
    ck, out = str(tmp_path / "ck"), str(tmp_path / "hf")
    shardfmt.save(sd, ck)
    m = shardfmt.read_manifest(ck)
    assert m.tensors["qkv.kT"].view is not None and m.tensors["w_again"].alias_of == "w"
    rep = export_hf(ck, out)
    assert rep.config_written is False
    from safetensors.torch import load_file

    got = load_file(os.path.join(out, "model.safetensors"))
    assert set(got) == {"qkv.q", "qkv.kT", "w", "w_again"}
    for k in got:
        assert bytes_equal(got[k], sd[k].contiguous()), k


@pytest.mark.slow
def test_import_hf_sharded_on_a_mesh_with_rules(tmp_path):
    model = tiny_llama(tie=False, seed=4)
    out = str(tmp_path / "hf")
    model.save_pretrained(out, max_shard_size="100KB")  # transformers' own layout, indexed
    assert os.path.exists(os.path.join(out, "model.safetensors.index.json"))
    rules = tmp_path / "tp.json"
    rules.write_text(json.dumps({"rules": [
        {"match": r"(q_proj|k_proj|v_proj|gate_proj|up_proj)\.weight$", "placements": {"tp": ["shard", 0]}},
        {"match": r"(o_proj|down_proj)\.weight$", "placements": {"tp": ["shard", 1]}},
        {"match": r"(embed_tokens|lm_head)\.weight$", "placements": {"tp": ["shard", 0]}},
    ]}))
    ck = str(tmp_path / "ck")
    rep = import_hf(out, ck, mesh="pp=2,tp=2", rules=str(rules), memory_budget="1MiB")
    m = shardfmt.read_manifest(ck)  # whole: files and shards
    assert m.save_id == rep.manifest.save_id
    assert m.topology.world_size == 4 and sorted(m.files) == [f"data/rank_{r:05d}.safetensors" for r in range(4)]
    q = m.tensors["model.layers.1.self_attn.q_proj.weight"]
    assert q.placement.placements == (("shard", 0),) and q.placement.stage == 1
    assert sorted(s.file for s in q.shards) == ["data/rank_00002.safetensors", "data/rank_00003.safetensors"]
    assert shardfmt.validate(ck, deep=True).ok
    sd = model.state_dict()
    targets = {k: torch.empty_like(v) for k, v in sd.items()}
    shardfmt.load(targets, ck)
    assert all(bytes_equal(targets[k], sd[k]) for k in sd)
    # and straight back out: transformers loads it with the same logits
    again = str(tmp_path / "again")
    export_hf(ck, again)
    assert torch.equal(logits(load_hf(again)), logits(model))


def test_import_hf_errors(tmp_path):
    with pytest.raises(shardfmt.errors.CheckpointNotFoundError, match="no such directory"):
        import_hf(str(tmp_path / "missing"), str(tmp_path / "x"))
    (tmp_path / "pickled").mkdir()
    (tmp_path / "pickled" / "pytorch_model.bin").write_bytes(b"\x80\x04")
    with pytest.raises(HFError, match="never pickle"):
        import_hf(str(tmp_path / "pickled"), str(tmp_path / "x"))
    d = tmp_path / "badindex"
    d.mkdir()
    from safetensors.torch import save_file

    save_file({"a": torch.ones(2), "b": torch.zeros(3)}, str(d / "model-00001-of-00001.safetensors"),
              metadata={"format": "pt"})
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"a": "model-00001-of-00001.safetensors", "c": "model-00001-of-00001.safetensors"}}))
    with pytest.raises(HFError, match="'b'"):
        import_hf(str(d), str(tmp_path / "x"))
    d2 = tmp_path / "weird"
    d2.mkdir()
    hdr = json.dumps({"x": {"dtype": "F4", "shape": [2], "data_offsets": [0, 1]}}).encode()
    (d2 / "model.safetensors").write_bytes(struct.pack("<Q", len(hdr)) + hdr + b"\x00")
    with pytest.raises(shardfmt.errors.HeaderError, match="unsupported dtype 'F4'"):
        import_hf(str(d2), str(tmp_path / "x"))
    with pytest.raises(ValueError, match="need a mesh"):
        import_hf(str(d), str(tmp_path / "x"), rules=str(tmp_path / "r.json"))
    assert not os.path.exists(str(tmp_path / "x"))


@pytest.mark.slow
def test_export_errors_and_cli(tmp_path, capsys):
    model = tiny_llama(tie=False, seed=5)
    ck = str(tmp_path / "ck")
    shardfmt.save({"model": model.state_dict()}, ck, metadata={HF_CONFIG_KEY: model.config.to_dict()})
    with pytest.raises(shardfmt.errors.MissingKeyError, match="under 'decoder'"):
        export_hf(ck, str(tmp_path / "x"), only="decoder")
    clash = str(tmp_path / "clash")
    shardfmt.save({"a.w": torch.ones(2), "w": torch.zeros(2)}, clash)
    with pytest.raises(HFError, match="both map to 'w'"):
        export_hf(clash, str(tmp_path / "x"), strip_prefix="a.")
    out = str(tmp_path / "hf")
    assert reshard_main(["export-hf", ck, out, "--only", "model", "--max-shard-size", "100KB",
                         "--memory-budget", "2MiB", "--no-progress"]) == 0
    assert "exported" in capsys.readouterr().out
    assert torch.equal(logits(load_hf(out)), logits(model))
    assert reshard_main(["export-hf", ck, out, "--only", "model", "--no-progress"]) == 1
    assert "error: already exists: " in capsys.readouterr().err
    assert reshard_main(["export-hf", ck, out, "--only", "model", "--overwrite", "--no-progress"]) == 0
    assert os.listdir(out) == ["model.safetensors", "config.json"] or sorted(os.listdir(out)) == [
        "config.json", "model.safetensors"]
    assert [n for n in os.listdir(tmp_path) if ".tmp-" in n or ".old-" in n] == []
    assert reshard_main(["export-hf", ck, str(tmp_path / "y"), "--max-shard-size", "big"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not a size" in err
    back = str(tmp_path / "back")
    assert reshard_main(["import-hf", out, back, "--mesh", "tp=2", "--no-progress", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["world"] == 2 and rep["tensors"] == len(model.state_dict())
    assert reshard_main(["import-hf", str(tmp_path / "nope"), str(tmp_path / "z")]) == 2
    assert "no such directory" in capsys.readouterr().err


@pytest.mark.slow
def test_llama_saved_by_4_ranks_tp2_pp2_exports_and_loads_with_equal_logits(tmp_path):
    _transformers()  # the ranks build the model with it
    from tests.distributed.harness import check_all_ok, launch

    ck, out = str(tmp_path / "ck"), str(tmp_path / "hf")
    results = check_all_ok(launch("hf_llama_tp_pp", 4, {"path": ck, "config": CONFIG, "input": INPUT.tolist()},
                                  out_dir=str(tmp_path / "logs"), timeout=240))
    m = shardfmt.read_manifest(ck)
    assert m.topology.mesh == (("pp", 2), ("tp", 2)) and len(m.files) == 4
    q = m.tensors["model.model.layers.1.self_attn.q_proj.weight"]
    assert q.placement.placements == (("shard", 0),) and len(q.shards) == 2
    assert len(m.tensors["model.model.layers.1.input_layernorm.weight"].shards) == 1  # replicated: once
    rep = export_hf(ck, out, only="model", max_shard_size="100KB", memory_budget="1MiB")
    assert rep.excluded == len([n for n in m.tensors if not n.startswith("model.")])  # optimizer state
    assert len(rep.files) > 1
    loaded = load_hf(out)
    want = torch.tensor(results[0]["logits"], dtype=torch.float32)
    assert torch.equal(logits(loaded).flatten(), want)
    # the same checkpoint converted to one rank exports the same bytes
    one, out1 = str(tmp_path / "one"), str(tmp_path / "hf1")
    from reshard.convert import convert

    convert(ck, one, "x=1", memory_budget="1MiB")
    export_hf(one, out1, only="model", max_shard_size="100KB")
    for f in rep.files:
        with open(os.path.join(out, f), "rb") as a, open(os.path.join(out1, f), "rb") as b:
            assert a.read() == b.read(), f
