"""``LoadOptions`` (each load knob's one default) and the read targets a load builds from a state dict."""

import pytest
import torch

import shardfmt
from shardfmt.errors import MissingKeyError, StateDictError
from shardfmt.loading.options import DEFAULT_MAX_BOUNCE_READ, DEFAULT_WORKERS, LoadOptions
from shardfmt.loading.reader import open_checkpoint
from shardfmt.loading.request import request_load
from shardfmt.loading.targets import plan_reads


def _saved(tmp_path):
    path = str(tmp_path / "ck")
    state = {"a": torch.arange(64, dtype=torch.float32).reshape(8, 8), "b": torch.ones(3), "n": 7,
             "c": -torch.arange(64, dtype=torch.float32).reshape(8, 8), "d": torch.ones(5)}
    shardfmt.save(state, path)
    return state, path


def test_an_unknown_knob_is_refused_before_anything_is_read(tmp_path):
    with pytest.raises(TypeError, match="verfy"):
        shardfmt.load({}, str(tmp_path / "nothing-here"), verfy=False)


def test_a_bad_per_rank_policy_is_refused_whichever_way_it_comes(tmp_path):
    with pytest.raises(StateDictError, match="per_rank must be"):
        shardfmt.load({}, str(tmp_path / "nothing-here"), per_rank="drop")
    with pytest.raises(StateDictError, match="per_rank must be"):
        LoadOptions(per_rank="drop")


def test_options_and_keywords_agree_and_keywords_win(tmp_path):
    state, path = _saved(tmp_path)
    out = {"a": torch.zeros(8, 8), "gone": torch.zeros(2)}
    rep = shardfmt.load(out, path, options=LoadOptions(strict=False))
    assert rep.missing == ("gone",) and torch.equal(out["a"], state["a"])
    with pytest.raises(MissingKeyError, match="gone"):
        shardfmt.load(out, path, options=LoadOptions(strict=False), strict=True)


def test_storage_defaults_fill_only_what_the_caller_left_open(tmp_path):
    _, path = _saved(tmp_path)
    ckpt = open_checkpoint(path)
    local = LoadOptions().for_storage(ckpt.storage)
    assert local.max_gap == ckpt.storage.max_gap and local.workers == DEFAULT_WORKERS
    assert LoadOptions(max_gap=0, workers=2).for_storage(ckpt.storage).max_gap == 0
    assert LoadOptions().bounce_read_size(1 << 40, 4096, remote=False) == DEFAULT_MAX_BOUNCE_READ
    assert LoadOptions(max_bounce_read=12345).bounce_read_size(1 << 40, 4096, remote=True) == 12345


def test_each_destination_slice_is_one_target_naming_both_ends(tmp_path):
    """Tied tensors share memory (the first read in place, the other into memory of its own and
    copied in afterwards), a column slice is strided (bounce), a contiguous tensor is read in
    place; in one process every target is ``sole``. Nothing is read."""
    _, path = _saved(tmp_path)
    m = open_checkpoint(path).manifest
    tied = torch.zeros(8, 8)
    wide = torch.zeros(3, 2)
    state = {"a": tied, "c": tied, "b": wide[:, 0], "d": torch.zeros(5), "n": 0, "ghost": torch.zeros(1)}
    req = request_load(state, m, LoadOptions(strict=False), rank=0, world_size=1, source=path)
    by_name = {t.src.fqn: t for t in req.targets}
    assert [t.index for t in req.targets] == list(range(len(req.targets))) and set(by_name) == {"a", "b", "c", "d"}
    assert by_name["a"].dst.data_ptr() == tied.data_ptr() and by_name["a"].src_dtype == torch.float32
    assert by_name["a"].src.box.lengths == (8, 8) and not by_name["a"].bounce and not by_name["a"].views
    c = by_name["c"]
    assert c.dst.data_ptr() != tied.data_ptr() and [v.dst.data_ptr() for v in c.views] == [tied.data_ptr()]
    assert by_name["b"].bounce and not by_name["d"].bounce and all(t.sole for t in req.targets)
    assert req.missing == ("ghost",) and [leaf.fqn for leaf, _ in req.values] == ["n"]
    assert state["n"] == 0  # values are set only once every read succeeded
    plan = plan_reads(m, req.targets, LoadOptions(max_gap=0))
    assert plan.needed_bytes == (64 + 64 + 3 + 5) * 4 and set(plan.files) == {s.file for _, s in plan.shards}
