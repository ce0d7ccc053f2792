"""Incremental checkpoints (spec/FORMAT.md section 4.10, spec/ROOTS.md section 1): a save
writes only the shards whose bytes changed and references the rest in its base; loads,
validation, conversion, retention, archive copies and restore's fallback all follow the chain."""

from __future__ import annotations

import json
import os
import shutil
import time

import pytest
import torch

import shardfmt
from shardfmt.errors import FormatVersionError, IntegrityError, ManifestError, ShardfmtError
from shardfmt.format import refs
from shardfmt.io.registry import get_storage
from shardfmt.training.options import RetentionPolicy
from shardfmt.training.prune import prune
from shardfmt.validation import validate


def _state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"frozen": torch.randn(1024, 1024, generator=g),  # 4 MiB: a frozen base model
            "emb": torch.randn(2048, 128, generator=g).bfloat16(),  # 0.5 MiB
            "lora": torch.randn(8, 1024, generator=g),  # 32 KiB: what training changes
            "step": 0}


def _zeros(sd: dict) -> dict:
    return {k: torch.zeros_like(v) if torch.is_tensor(v) else None for k, v in sd.items()}


def _data_bytes(path) -> int:
    d = os.path.join(path, "data")
    return sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d)) if os.path.isdir(d) else 0


def _chain_of_two(tmp_path) -> dict:
    """``step_1`` full, then ``step_2`` on it with the trainable part changed; the state as saved last."""
    sd = _state()
    shardfmt.save(sd, str(tmp_path / "step_1"))
    sd["lora"] += 1
    shardfmt.save(sd, str(tmp_path / "step_2"), base=str(tmp_path / "step_1"))
    return sd


def _assert_loads(path, sd) -> None:
    out = _zeros(sd)
    shardfmt.load(out, str(path))
    for k, v in sd.items():
        if torch.is_tensor(v):
            assert torch.equal(out[k], v), k
        else:
            assert out[k] == v, k


def test_a_save_on_a_base_writes_only_what_changed_and_loads_bit_exact(tmp_path):
    sd = _state()
    shardfmt.save(sd, str(tmp_path / "step_1"))
    sd["lora"] += 1
    sd["step"] = 2
    m = shardfmt.save(sd, str(tmp_path / "step_2"), base=str(tmp_path / "step_1"))
    chain = refs.chain_of(m)
    assert chain is not None and dict(chain.bases) == {"step_1": shardfmt.read_manifest(str(tmp_path / "step_1")).save_id}
    assert chain.depth == 1 and m.extensions[refs.EXTENSION].required
    full, incr = _data_bytes(tmp_path / "step_1"), _data_bytes(tmp_path / "step_2")
    assert incr <= 0.02 * full, (incr, full)  # the 32 KiB that changed, and a header
    _assert_loads(tmp_path / "step_2", sd)
    # the statistics of the shards taken (reused from the save that wrote them) are the full save's
    whole = shardfmt.save(sd, str(tmp_path / "whole"))
    assert m.extensions["tensor_stats"].value == whole.extensions["tensor_stats"].value
    report = validate(str(tmp_path / "step_2"), deep=True)
    assert report.ok, report.problems
    index = json.loads((tmp_path / "step_2" / "index" / "rank_00000.json").read_bytes())
    ref = index["files"]["step_1/data/rank_00000.safetensors"]
    assert ref["keys"] == ["emb", "frozen"]  # the base's own record of the file, plus the keys taken
    base_index = json.loads((tmp_path / "step_1" / "index" / "rank_00000.json").read_bytes())
    assert {k: v for k, v in ref.items() if k != "keys"} == base_index["files"]["data/rank_00000.safetensors"]


def test_references_point_at_the_checkpoint_that_holds_the_bytes_one_hop(tmp_path):
    sd = _chain_of_two(tmp_path)
    sd["emb"][5] = 3
    m = shardfmt.save(sd, str(tmp_path / "step_3"), base=str(tmp_path / "step_2"))
    chain = refs.chain_of(m)
    assert sorted(chain.bases) == ["step_1", "step_2"] and chain.depth == 2
    files = json.loads((tmp_path / "step_3" / "index" / "rank_00000.json").read_bytes())["files"]
    assert files["step_1/data/rank_00000.safetensors"]["keys"] == ["frozen"]
    assert files["step_2/data/rank_00000.safetensors"]["keys"] == ["lora"]
    assert _data_bytes(tmp_path / "step_3") < 600_000  # emb alone was written again
    _assert_loads(tmp_path / "step_3", sd)
    assert validate(str(tmp_path / "step_3"), deep=True).ok


def test_a_changed_dtype_or_shape_is_written_again_never_taken(tmp_path):
    sd = _state()
    shardfmt.save(sd, str(tmp_path / "step_1"))
    sd["emb"] = sd["emb"].float()  # same values, another dtype
    sd["lora"] = sd["lora"][:4].clone()  # a prefix of the same bytes, another shape
    shardfmt.save(sd, str(tmp_path / "step_2"), base=str(tmp_path / "step_1"))
    files = json.loads((tmp_path / "step_2" / "index" / "rank_00000.json").read_bytes())["files"]
    assert files["step_1/data/rank_00000.safetensors"]["keys"] == ["frozen"]
    _assert_loads(tmp_path / "step_2", sd)


def test_a_base_elsewhere_is_refused_and_an_unusable_base_gives_a_full_save(tmp_path, caplog):
    sd = _state()
    (tmp_path / "a").mkdir()
    shardfmt.save(sd, str(tmp_path / "a" / "step_1"))
    with pytest.raises(ShardfmtError, match="is the checkpoint being written"):
        shardfmt.save(sd, str(tmp_path / "a" / "step_1"), base=str(tmp_path / "a" / "step_1"), overwrite=True)
    assert validate(str(tmp_path / "a" / "step_1")).ok
    with pytest.raises(ShardfmtError, match="next to it"):
        shardfmt.save(sd, str(tmp_path / "step_2"), base=str(tmp_path / "a" / "step_1"))
    assert not (tmp_path / "step_2").exists()
    with pytest.raises(ShardfmtError, match="format_version 2"):
        shardfmt.save(sd, str(tmp_path / "step_2"), base=str(tmp_path / "a" / "step_1"), format_version=1)
    # a base that is missing, or corrupt: the save is full (and says so), never a broken chain
    with caplog.at_level("WARNING", logger="shardfmt"):
        m = shardfmt.save(sd, str(tmp_path / "step_3"), base=str(tmp_path / "step_gone"))
    assert refs.chain_of(m) is None and "cannot be used" in caplog.text
    shardfmt.save(sd, str(tmp_path / "step_4"))
    (tmp_path / "step_4" / "index" / "rank_00000.json").write_bytes(b"{}")
    m = shardfmt.save(sd, str(tmp_path / "step_5"), base=str(tmp_path / "step_4"))
    assert refs.chain_of(m) is None and _data_bytes(tmp_path / "step_5") == _data_bytes(tmp_path / "step_4")


def test_a_removed_or_replaced_base_is_a_broken_chain_for_load_and_validate(tmp_path):
    sd = _chain_of_two(tmp_path)
    os.rename(tmp_path / "step_1", tmp_path / "moved")
    with pytest.raises(IntegrityError, match="base 'step_1'.*broken chain"):
        shardfmt.load(_zeros(sd), str(tmp_path / "step_2"))
    codes = {p.code for p in validate(str(tmp_path / "step_2")).problems}
    assert "broken_chain" in codes and codes <= {"broken_chain", "missing_shards"}, codes
    # the base's name now holds another save: its bytes differ, and its save id does
    shardfmt.save(_state(seed=1), str(tmp_path / "step_1"))
    with pytest.raises(IntegrityError):
        shardfmt.load(_zeros(sd), str(tmp_path / "step_2"))
    problems = validate(str(tmp_path / "step_2")).problems
    assert any(p.code == "broken_chain" and "replaced" in p.message for p in problems), problems


def test_a_rank_index_may_name_only_listed_bases_and_keys_its_header_has(tmp_path):
    from tests.golden_invalid_v2_make import rank_index

    sd = _chain_of_two(tmp_path)
    shutil.copytree(tmp_path / "step_2", tmp_path / "step_3")

    def edit(o):
        o["files"]["step_1/data/rank_00000.safetensors"]["keys"] = ["emb", "frozen", "nope"]
    rank_index(0, edit)(str(tmp_path / "step_3"))  # re-signed up the chain, as a hostile author would
    with pytest.raises(ShardfmtError, match="no such entry"):
        shardfmt.load(_zeros(sd), str(tmp_path / "step_3"))
    assert not validate(str(tmp_path / "step_3")).ok

    def other_base(o):
        o["files"]["step_9/data/rank_00000.safetensors"] = o["files"].pop("step_1/data/rank_00000.safetensors")
    rank_index(0, other_base)(str(tmp_path / "step_2"))
    with pytest.raises(ManifestError, match="not a base of this checkpoint"):
        shardfmt.load(_zeros(sd), str(tmp_path / "step_2"))


def test_a_reader_that_does_not_know_the_extension_refuses_it_by_name(tmp_path, monkeypatch):
    from shardfmt.format import parse_v2

    sd = _state()
    shardfmt.save(sd, str(tmp_path / "step_1"))
    shardfmt.save(sd, str(tmp_path / "step_2"), base=str(tmp_path / "step_1"))
    monkeypatch.setattr(parse_v2, "KNOWN_EXTENSIONS", frozenset())
    with pytest.raises(FormatVersionError, match="'incremental'"):
        shardfmt.load(_zeros(sd), str(tmp_path / "step_2"))


def test_convert_and_export_of_an_incremental_checkpoint_are_complete(tmp_path, capsys):
    from reshard.convert import convert
    from reshard.hf_export import export_hf
    from shardfmt.cli import main as shardfmt_main

    sd = _chain_of_two(tmp_path)
    convert(str(tmp_path / "step_2"), str(tmp_path / "whole"), {"world": 1})
    export_hf(str(tmp_path / "step_2"), str(tmp_path / "hf"))
    assert shardfmt_main(["inspect", str(tmp_path / "step_2")]) == 0
    assert "incremental depth 1, bases step_1" in capsys.readouterr().out
    shutil.rmtree(tmp_path / "step_1")
    from safetensors.torch import load_file

    hf = {}
    for f in sorted(os.listdir(tmp_path / "hf")):
        if f.endswith(".safetensors"):
            hf.update(load_file(str(tmp_path / "hf" / f)))
    assert all(torch.equal(hf[k], sd[k]) for k in ("frozen", "emb", "lora")), sorted(hf)
    m = shardfmt.read_manifest(str(tmp_path / "whole"))
    assert refs.chain_of(m) is None
    assert validate(str(tmp_path / "whole"), deep=True).ok
    _assert_loads(tmp_path / "whole", sd)


# ----------------------------------------------------------------------------- the Checkpointer


class Model(torch.nn.Module):
    """A frozen base and a small trainable part, as ``_state`` lays them out."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        sd = _state(seed)
        self.frozen = torch.nn.Parameter(sd["frozen"], requires_grad=False)
        self.emb = torch.nn.Parameter(sd["emb"], requires_grad=False)
        self.lora = torch.nn.Parameter(sd["lora"])


def _train(ck, steps, model, *, async_=False):
    for step in steps:
        with torch.no_grad():
            model.lora += 1
        h = ck.save(step, {"model": model}, async_=async_)
        if async_:
            h.wait()


def _restored(root, step) -> Model:
    got = Model(seed=9)
    assert shardfmt.Checkpointer(str(root)).restore({"model": got}) == step
    return got


def _same(a: Model, b: Model) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_the_checkpointer_chains_saves_and_writes_every_kth_in_full(tmp_path):
    model = Model()
    root = tmp_path / "root"
    with shardfmt.Checkpointer(str(root), incremental=True, full_every=3, keep_last=10) as ck:
        _train(ck, [1, 2, 3, 4, 5], model)
    full = _data_bytes(root / "step_000000001")
    sizes = {s: _data_bytes(root / f"step_{s:09d}") for s in range(1, 6)}
    assert sizes[4] == full and all(sizes[s] < 0.05 * full for s in (2, 3, 5)), sizes
    depth = {s: refs.chain_of(shardfmt.read_manifest(str(root / f"step_{s:09d}"))) for s in range(1, 6)}
    assert [None if c is None else c.depth for c in depth.values()] == [None, 1, 2, None, 1]
    assert _same(_restored(root, 5), model)


def test_async_incremental_saves_chain_too(tmp_path):
    model = Model()
    root = tmp_path / "root"
    with shardfmt.Checkpointer(str(root), incremental=True, keep_last=10) as ck:
        _train(ck, [1, 2, 3], model, async_=True)
    assert _data_bytes(root / "step_000000003") < 0.05 * _data_bytes(root / "step_000000001")
    assert _same(_restored(root, 3), model)


def test_retention_keeps_the_bases_of_what_it_keeps(tmp_path):
    model = Model()
    root = tmp_path / "root"
    with shardfmt.Checkpointer(str(root), incremental=True, full_every=3, keep_last=1) as ck:
        _train(ck, [1, 2], model)
        assert sorted(os.listdir(root)) == [f"step_{s:09d}" for s in (1, 2)]  # 2 needs 1
        _train(ck, [3], model)  # on 2, but lora changed again: it needs 1 (the frozen part), not 2
        assert sorted(os.listdir(root)) == [f"step_{s:09d}" for s in (1, 3)]
        _train(ck, [4], model)  # full: nothing needs 1-3 any more
        assert sorted(os.listdir(root)) == ["step_000000004"]
        _train(ck, [5], model)
        assert sorted(os.listdir(root)) == ["step_000000004", "step_000000005"]
    assert _same(_restored(root, 5), model)


def test_retention_keeps_the_base_of_a_save_still_running_until_its_lease_expires(tmp_path):
    sd = _state()
    root = tmp_path / "root"
    for s in (1, 2):
        shardfmt.save(sd, str(root / f"step_{s:09d}"))
    live = root / "step_000000003.tmp-0123456789abcdef"
    live.mkdir()
    (live / "BASES").write_bytes(b'{"bases": ["step_000000001"]}\n')
    storage, path = get_storage(str(root))
    prune(storage, path, RetentionPolicy(keep_last=1), busy=lambda p: False, lease_seconds=600)
    assert sorted(os.listdir(root)) == ["step_000000001", "step_000000002", live.name]
    old = time.time() - 3600
    os.utime(live, (old, old))
    prune(storage, path, RetentionPolicy(keep_last=1), busy=lambda p: False, lease_seconds=600)
    assert sorted(os.listdir(root)) == ["step_000000002", live.name]
    assert shardfmt.Checkpointer(str(root)).collect_garbage()  # the dead save, BASES and all
    assert sorted(os.listdir(root)) == ["step_000000002"]


def test_restore_falls_back_past_a_checkpoint_whose_base_is_corrupt(tmp_path):
    model = Model()
    root = tmp_path / "root"
    with shardfmt.Checkpointer(str(root), incremental=True, full_every=2, keep_last=10) as ck:
        _train(ck, [1, 2, 3, 4], model)  # 1 full, 2 on 1, 3 full, 4 on 3
    f = root / "step_000000003" / "data" / "rank_00000.safetensors"
    raw = bytearray(f.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # inside `frozen`, which step 4 takes from step 3
    f.write_bytes(bytes(raw))
    with pytest.warns(UserWarning, match="step_000000004"):
        got = _restored(root, 2)
    names = sorted(os.listdir(root))
    assert len([n for n in names if ".corrupt-" in n]) == 2 and "step_000000003" not in names
    at_2 = Model()
    with torch.no_grad():
        for _ in range(2):
            at_2.lora += 1  # the same float additions as steps 1 and 2
    assert _same(got, at_2)


def test_an_archive_copy_carries_its_bases(tmp_path):
    model = Model()
    root, arch = tmp_path / "root", tmp_path / "arch"
    with shardfmt.Checkpointer(str(root), incremental=True, keep_last=1, archive=str(arch), archive_every=2) as ck:
        _train(ck, [1, 2, 3, 4], model)
    assert ck.archive_errors == []
    archived = sorted(os.listdir(arch))
    assert archived == [f"step_{s:09d}" for s in (1, 2, 4)]  # 2 and 4, with the base they need
    assert validate(str(arch / "step_000000004"), deep=True).ok
    shutil.rmtree(root)
    assert _same(_restored(arch, 4), model)  # the archive is a root of its own


@pytest.mark.slow
def test_two_ranks_save_incrementally_and_restore_on_two_and_one(tmp_path):
    """Each rank takes its own unchanged rows from its own files of the base: the second and
    third saves write the head alone; a 2-rank restore and a 1-process load are bit-exact."""
    from tests.distributed.harness import check_all_ok, launch

    root = tmp_path / "root"
    saved = check_all_ok(launch("incremental_train", 2, {"root": str(root)}, out_dir=str(tmp_path / "o1"),
                                module="tests.distributed.incremental_jobs", timeout=180))
    assert sorted(os.listdir(root)) == ["step_000000001", "step_000000003"]  # keep_last=1: 3, and the base it needs
    full, last = _data_bytes(root / "step_000000001"), _data_bytes(root / "step_000000003")
    assert last < 0.05 * full, (last, full)
    chain = refs.chain_of(shardfmt.read_manifest(str(root / "step_000000003")))
    assert chain is not None and "step_000000001" in chain.bases
    restored = check_all_ok(launch("incremental_restore", 2, {"root": str(root)}, out_dir=str(tmp_path / "o2"),
                                   module="tests.distributed.incremental_jobs", timeout=180))
    for r in restored:
        assert r["step"] == 3 and r["frozen"] == saved[0]["frozen"] and r["head"] == saved[0]["head"]
    one = {"frozen": torch.zeros(2048, 512), "head": torch.zeros(64, 512)}
    shardfmt.load({"model": one}, str(root / "step_000000003"))
    assert one["frozen"].flatten().tolist()[:4096] == saved[0]["frozen"]
    assert one["head"].flatten().tolist()[:4096] == saved[0]["head"]
    assert validate(str(root / "step_000000003"), deep=True).ok
    rolled = check_all_ok(launch("incremental_rollback", 2, {"root": str(root)}, out_dir=str(tmp_path / "o3"),
                                 module="tests.distributed.incremental_jobs", timeout=180))
    assert all(r["step"] == 1 and r["same"] for r in rolled), rolled
    assert len(rolled[0]["warned"]) == 1 and not rolled[1]["warned"]  # rank 0 set step 3 aside
    assert [n.split("-")[0] for n in sorted(os.listdir(root))] == ["step_000000001", "step_000000003.rolledback"]


# ----------------------------------------------------------------------------- what review found


def test_retention_removes_nothing_when_a_kept_checkpoint_cannot_be_read(tmp_path, monkeypatch):
    """Fail closed: a storage failure reading a kept checkpoint's chain says nothing about its bases."""
    from shardfmt.errors import StorageError
    from shardfmt.training import chains

    sd = _state()
    root = tmp_path / "root"
    shardfmt.save(sd, str(root / "step_000000001"))
    shardfmt.save(sd, str(root / "step_000000002"), base=str(root / "step_000000001"))
    storage, path = get_storage(str(root))

    def throttled(*a, **k):
        raise StorageError("503 SlowDown")
    monkeypatch.setattr(chains, "open_checkpoint", throttled)
    with pytest.raises(StorageError):
        prune(storage, path, RetentionPolicy(keep_last=1), busy=lambda p: False)
    assert sorted(os.listdir(root)) == ["step_000000001", "step_000000002"]


def test_retention_keeps_the_base_of_a_checkpoint_being_archived(tmp_path):
    sd = _state()
    root = tmp_path / "root"
    shardfmt.save(sd, str(root / "step_000000001"))
    shardfmt.save(sd, str(root / "step_000000002"), base=str(root / "step_000000001"))
    shardfmt.save(sd, str(root / "step_000000003"))
    storage, path = get_storage(str(root))
    prune(storage, path, RetentionPolicy(keep_last=1), busy=lambda p: p.endswith("step_000000002"))
    assert sorted(os.listdir(root)) == ["step_000000001", "step_000000002", "step_000000003"]
    assert validate(str(root / "step_000000002")).ok


def test_a_base_replaced_while_the_save_runs_fails_the_commit_and_unverified_loads(tmp_path, monkeypatch):
    from shardfmt.saving import protocol

    sd = _state()
    shardfmt.save(sd, str(tmp_path / "step_1"))
    read = protocol.try_read_base

    def then_replace(*a, **k):
        got = read(*a, **k)
        shardfmt.save(_state(seed=3), str(tmp_path / "step_1"), overwrite=True)  # same names, other bytes
        return got
    monkeypatch.setattr(protocol, "try_read_base", then_replace)
    with pytest.raises(ShardfmtError, match="replaced"):
        shardfmt.save(sd, str(tmp_path / "step_2"), base=str(tmp_path / "step_1"))
    assert not (tmp_path / "step_2").exists()
    monkeypatch.setattr(protocol, "try_read_base", read)
    shardfmt.save(sd, str(tmp_path / "step_1"), overwrite=True)
    shardfmt.save(sd, str(tmp_path / "step_2"), base=str(tmp_path / "step_1"))
    assert refs.chain_of(shardfmt.read_manifest(str(tmp_path / "step_2"))) is not None
    shardfmt.save(sd, str(tmp_path / "step_1"), overwrite=True)  # equal bytes, another save
    with pytest.raises(IntegrityError, match="replaced"):
        shardfmt.load(_zeros(sd), str(tmp_path / "step_2"), verify=False)
    _assert_loads(tmp_path / "step_2", sd)  # verified: the bytes are checked, and they are equal


def test_a_chain_that_names_the_checkpoint_itself_is_refused(tmp_path):
    sd = _state()
    shardfmt.save(sd, str(tmp_path / "step_1"))
    shardfmt.save(sd, str(tmp_path / "step_2"), base=str(tmp_path / "step_1"))
    shutil.rmtree(tmp_path / "step_1")
    os.rename(tmp_path / "step_2", tmp_path / "step_1")
    with pytest.raises(ManifestError, match="itself"):
        shardfmt.load(_zeros(sd), str(tmp_path / "step_1"))
    assert "broken_chain" in {p.code for p in validate(str(tmp_path / "step_1")).problems}


def test_a_chain_past_the_formats_limits_is_refused_at_the_commit(tmp_path):
    from shardfmt.errors import CommitError
    from shardfmt.saving.writer import CheckpointWriter

    w = CheckpointWriter(str(tmp_path / "step_1"))
    with pytest.raises(CommitError, match="save in full"):
        w.add_chain(refs.Chain(bases={f"step_{i}": "x" for i in range(refs.MAX_BASES + 1)}, depth=1))
    with pytest.raises(ValueError, match="full_every"):
        shardfmt.Checkpointer(str(tmp_path / "root"), incremental=True, full_every=5000)


def test_ls_shows_what_an_incremental_checkpoint_holds_itself(tmp_path, capsys):
    from shardfmt.cli import main as shardfmt_main

    model = Model()
    root = tmp_path / "root"
    with shardfmt.Checkpointer(str(root), incremental=True) as ck:
        _train(ck, [1, 2], model)
    assert shardfmt_main(["ls", "--json", str(root)]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    sizes = {n: r.get("bytes", r.get("size")) for n, r in rows.items()}
    assert sizes["step_000000002"] < 0.05 * sizes["step_000000001"], rows
