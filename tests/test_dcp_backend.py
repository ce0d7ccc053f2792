"""The DCP storage backend (``shardfmt.dcp``): DCP's own save and load flows, writing and
reading shardfmt checkpoints; nothing pickled on disk, nothing from disk unpickled.

One process here; the multi-process flows (FSDP2, resharding 2 -> 1 and 2 -> 4, async_save)
are in ``tests/distributed/test_dcp_flows.py``.
"""

from __future__ import annotations

import io
import os
import pickle
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.state_dict_loader import (
    _load_state_dict,  # what dcp_to_torch_save calls
)

import shardfmt
import shardfmt.api
import shardfmt.saving.options
import shardfmt.validation
from shardfmt.dcp import Reader, Writer
from shardfmt.dcp.names import dcp_leaves, leaf_at, regroup
from shardfmt.errors import CheckpointNotFoundError, StateDictError

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _trained(seed: int = 0, steps: int = 2):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    for _ in range(steps):
        model(torch.randn(3, 8)).pow(2).mean().backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    return model, opt, sched


def _state(seed: int = 0, steps: int = 2) -> dict:
    """A torchtitan-style state: model, optimizer, scheduler, train state, a dataloader's state
    in plain values."""
    model, opt, sched = _trained(seed, steps)
    return {"model": model.state_dict(), "optim": opt.state_dict(), "lr_schedulers": sched.state_dict(),
            "train_state": {"step": steps, "global_avg_losses": [0.5, 0.25], "log_steps": [1, 2]},
            "dataloader": {"world_size": 1, "dp_rank_0": {"sample_idx": 17 * steps, "epoch": 0}}}


def _tensors(state: dict, prefix: str = "") -> dict[str, torch.Tensor]:
    out = {}
    for k, v in state.items():
        name = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_tensors(v, name + "."))
        elif isinstance(v, torch.Tensor):
            out[name] = v
    return out


def _assert_same(got: dict, want: dict) -> None:
    """Every tensor bit for bit, every other leaf equal."""
    gt, wt = _tensors(got), _tensors(want)
    assert sorted(gt) == sorted(wt)
    for k in wt:
        assert gt[k].dtype == wt[k].dtype and torch.equal(gt[k].reshape(-1).view(torch.uint8), wt[k].reshape(-1).view(torch.uint8)), k
    for k in ("train_state", "dataloader", "lr_schedulers"):
        assert got[k] == want[k], k
    assert got["optim"]["param_groups"] == want["optim"]["param_groups"]


def _no_pickle_on_disk(path: str) -> None:
    """No file of the checkpoint is a pickle, and none but shardfmt's own is there."""
    for root, _, files in os.walk(path):
        for f in files:
            with open(os.path.join(root, f), "rb") as fh:
                head = fh.read(2)
            assert not (head[:1] == b"\x80" and 2 <= head[1] <= 5), f
            assert f == "COMMITTED" or f.endswith((".json", ".safetensors")), f


def test_dcp_save_writes_a_committed_verified_checkpoint_that_every_shardfmt_tool_reads(tmp_path):
    state = _state()
    path = str(tmp_path / "ck")
    dcp.save(state, storage_writer=Writer(path, step=2, metadata={"run": "a"}))
    _no_pickle_on_disk(path)
    assert shardfmt.validation.validate(path, deep=True).ok
    m = shardfmt.read_manifest(path)
    assert (m.step, m.metadata, m.format_version) == (2, {"run": "a"}, 2)
    # shardfmt's names: one value per subtree without a tensor
    assert sorted(m.values) == ["dataloader", "lr_schedulers", "optim.param_groups", "train_state"]
    fresh = _state(seed=1, steps=1)
    dcp.load(fresh, storage_reader=Reader(path))
    _assert_same(fresh, state)
    plain = _state(seed=2, steps=1)
    report = shardfmt.load(plain, path)
    assert not report.missing and not report.unexpected
    _assert_same(plain, state)


def test_dcp_load_reads_a_checkpoint_shardfmt_save_wrote_in_either_format(tmp_path):
    state = _state()
    for version in (1, 2):
        path = str(tmp_path / f"v{version}")
        shardfmt.save(state, path, format_version=version)
        fresh = _state(seed=1, steps=1)
        dcp.load(fresh, storage_reader=Reader(path))
        _assert_same(fresh, state)


def test_tied_weights_and_views_load_through_dcp(tmp_path):
    """shardfmt stores a tied weight as an alias and views of one buffer as views: DCP asks for
    each by its own name and gets its bytes."""
    base = torch.arange(24, dtype=torch.float32)
    emb = torch.randn(5, 3)
    state = {"emb": emb, "head": emb, "a": base[:12].view(3, 4), "b": base[12:].view(4, 3)}
    path = str(tmp_path / "ck")
    shardfmt.save(state, path)
    m = shardfmt.read_manifest(path)
    assert m.tensors["head"].alias_of == "emb" and m.tensors["a"].view is not None
    got = {"emb": torch.zeros(5, 3), "head": torch.zeros(5, 3), "a": torch.zeros(3, 4), "b": torch.zeros(4, 3)}
    dcp.load(got, storage_reader=Reader(path))
    for k in state:
        assert torch.equal(got[k], state[k]), k


def test_an_empty_state_dict_rebuilds_the_checkpoint_nested_as_saved(tmp_path):
    """DCP's offline flow (``dcp_to_torch_save``): the reader's metadata names every leaf's path."""
    state = _state()
    path = str(tmp_path / "ck")
    dcp.save(state, storage_writer=Writer(path))
    got: dict = {}
    _load_state_dict(got, storage_reader=Reader(path), planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    assert torch.equal(got["model"]["0"]["weight"], state["model"]["0.weight"])  # DCP's own paths: "model" -> "0.weight"
    assert got["train_state"] == state["train_state"] and got["dataloader"] == state["dataloader"]
    assert got["optim"]["param_groups"][0]["betas"] == state["optim"]["param_groups"][0]["betas"]


def test_pickled_bytes_are_refused_on_save_naming_the_key_unless_allowed(tmp_path):
    """torchtitan's dataloader stores ``pickle.dumps(state)``: refused unless the user opts in,
    and then a reader refuses to hand them over unless it opts in too."""
    blob = pickle.dumps({"idx": 3})
    state = {"w": torch.ones(4), "dataloader": {"dp_rank_0": blob}}
    with pytest.raises(BaseException, match="dataloader.dp_rank_0: holds pickled bytes") as e:
        dcp.save(state, storage_writer=Writer(str(tmp_path / "refused")))
    assert "allow_pickled_bytes" in str(e.value)
    assert not (tmp_path / "refused").exists() or not (tmp_path / "refused" / "COMMITTED").exists()
    path = str(tmp_path / "allowed")
    with pytest.warns(UserWarning, match="dataloader.dp_rank_0 holds pickled bytes"):
        dcp.save(state, storage_writer=Writer(path, allow_pickled_bytes=True))
    _no_pickle_on_disk(path)  # stored as base64 inside the JSON manifest, never as a pickle file
    got = {"w": torch.zeros(4), "dataloader": {"dp_rank_0": b""}}
    with pytest.raises(BaseException, match="dataloader.dp_rank_0: holds pickled bytes"):
        dcp.load(got, storage_reader=Reader(path))
    with pytest.warns(UserWarning, match="handed over as bytes"):
        dcp.load(got, storage_reader=Reader(path, allow_pickled_bytes=True))
    assert got["dataloader"]["dp_rank_0"] == blob  # bytes, still pickled: never unpickled here


class _Opaque:
    pass


def test_a_value_that_is_not_typed_json_is_refused_naming_the_key_and_nothing_is_committed(tmp_path):
    path = tmp_path / "ck"
    with pytest.raises(BaseException, match=r"extra\.thing: cannot store a value of type"):
        dcp.save({"w": torch.ones(2), "extra": {"thing": _Opaque()}}, storage_writer=Writer(str(path)))
    assert not (path / "COMMITTED").exists()


def test_the_reader_never_unpickles_what_it_reads(tmp_path, monkeypatch):
    """The bytes handed to DCP are made by ``torch.save`` in this process from typed JSON: a
    manifest edited to hold anything else can only fail to decode, never run."""
    path = str(tmp_path / "ck")
    dcp.save({"w": torch.ones(2), "v": {"a": 1}}, storage_writer=Writer(path))
    seen = []
    real = torch.save

    def spy(obj, f, *a, **k):
        seen.append(obj)
        return real(obj, f, *a, **k)

    monkeypatch.setattr(torch, "save", spy)
    got = {"w": torch.zeros(2), "v": {"a": 0}}
    dcp.load(got, storage_reader=Reader(path))
    assert seen == [1] and got["v"] == {"a": 1}


def test_a_committed_checkpoint_is_replaced_only_with_overwrite(tmp_path):
    path = str(tmp_path / "ck")
    dcp.save({"w": torch.ones(2)}, storage_writer=Writer(path))
    with pytest.raises(BaseException, match="a committed checkpoint is already there"):
        dcp.save({"w": torch.full((2,), 2.0)}, storage_writer=Writer(path))
    dcp.save({"w": torch.full((2,), 2.0)}, storage_writer=Writer(path, overwrite=True))
    got = {"w": torch.zeros(2)}
    dcp.load(got, storage_reader=Reader(path))
    assert got["w"].tolist() == [2.0, 2.0]


def test_checkpoint_id_names_the_place_and_one_writer_serves_many_saves(tmp_path):
    writer, reader = Writer(), Reader()
    for step in (1, 2):
        dcp.save({"w": torch.full((3,), float(step))}, storage_writer=writer, checkpoint_id=str(tmp_path / f"s{step}"))
    got = {"w": torch.zeros(3)}
    dcp.load(got, storage_reader=reader, checkpoint_id=str(tmp_path / "s2"))
    assert got["w"].tolist() == [2.0] * 3
    assert sorted(os.listdir(tmp_path)) == ["s1", "s2"]


def test_a_corrupt_chunk_fails_the_dcp_load_naming_the_file(tmp_path):
    path = tmp_path / "ck"
    dcp.save({"w": torch.arange(1 << 16, dtype=torch.float32)}, storage_writer=Writer(str(path)))
    (data,) = list((path / "data").iterdir())
    raw = bytearray(data.read_bytes())
    raw[-100] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(BaseException, match="rank_00000.safetensors"):
        dcp.load({"w": torch.zeros(1 << 16)}, storage_reader=Reader(str(path)))


def test_without_a_path_the_error_says_what_to_give():
    with pytest.raises(BaseException, match=r"give Writer\(path\)"):
        dcp.save({"w": torch.ones(1)}, storage_writer=Writer())
    with pytest.raises(BaseException, match=r"give Reader\(path\)"):
        dcp.load({"w": torch.ones(1)}, storage_reader=Reader())


def test_writer_options_that_dcp_cannot_honour_are_refused_up_front():
    with pytest.raises(StateDictError, match="format-2"):
        Writer("x", options=shardfmt.saving.options.SaveOptions(format_version=1))
    with pytest.raises(StateDictError, match="mesh="):
        Writer("x", mesh={"dp": 0})


# ----------------------------------------------------------------------------- names (pure)


def test_regroup_makes_one_value_of_every_subtree_without_a_tensor():
    tensors = [("model", "w"), ("optim", "state", "w", "exp_avg")]
    values = {("optim", "param_groups", 0, "lr"): 0.1, ("optim", "param_groups", 0, "params"): ["w"],
              ("optim", "param_groups", 2, "lr"): 0.2, ("train", "step"): 3, ("top",): "x"}
    assert regroup(tensors, values) == {
        "optim.param_groups": [{"lr": 0.1, "params": ["w"]}, {}, {"lr": 0.2}],  # index 1: an empty dict DCP dropped
        "top": "x", "train": {"step": 3}}


def test_regroup_refuses_a_leaf_with_entries_under_it():
    with pytest.raises(StateDictError, match="a leaf and entries under it"):
        regroup([("a", "b")], {("a",): 1})


def test_dcp_leaves_follow_dcps_own_flattening():
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    value = {"groups": [{"lr": 0.1, "betas": (0.9, 0.95), "params": [1, 2]}, {"lr": 0.2}], "plain": [1, [2, 3]],
             "deep": [[{"x": 1}]], "empty": {}, 7: "int key"}
    flat, mapping = flatten_state_dict({"v": value})
    leaves = dcp_leaves("v", value)
    assert sorted(n for n, _ in leaves) == sorted(flat)
    for name, within in leaves:
        assert leaf_at(value, within) == flat[name]
        assert ("v",) + tuple(str(k) if not isinstance(k, int) or isinstance(leaf_at(value, within[:i]), dict) else k
                              for i, k in enumerate(within)) == tuple(mapping[name])


def test_bytes_handed_to_dcp_round_trip_exactly():
    value = {"t": (1, 2.5, None), "b": b"\x00\x01", "n": float("inf")}
    buf = io.BytesIO()
    torch.save(value, buf)
    buf.seek(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.load(buf, weights_only=True) == value


def test_a_failed_save_commits_nothing_and_the_writers_next_save_clears_what_it_staged(tmp_path):
    writer = Writer(str(tmp_path / "ck"))
    with pytest.raises(BaseException, match="extra: cannot store a value of type"):
        dcp.save({"w": torch.ones(2), "extra": _Opaque()}, storage_writer=writer)
    (staged,) = os.listdir(tmp_path)
    assert staged.startswith("ck.tmp-")  # a staging directory: no reader takes it for a checkpoint
    with pytest.raises(CheckpointNotFoundError, match="no checkpoint there"):
        shardfmt.read_manifest(str(tmp_path / "ck"))
    dcp.save({"w": torch.ones(2)}, storage_writer=writer)
    assert os.listdir(tmp_path) == ["ck"]


def test_a_tuple_holding_tensors_is_one_dcp_leaf_and_is_refused_naming_it(tmp_path):
    with pytest.raises(BaseException, match=r"pair\[0\]: cannot store a value of type torch.Tensor"):
        dcp.save({"w": torch.ones(2), "pair": (torch.ones(1), 2)}, storage_writer=Writer(str(tmp_path / "ck")))
