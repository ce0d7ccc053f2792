"""Single-process save/load round trips: every dtype, odd shapes, views, sharing, values."""

import math

import numpy as np
import pytest
import torch
from conftest import bytes_equal
from safetensors import safe_open

import shardfmt
import shardfmt.saving.writer
from shardfmt import ShardedTensor
from shardfmt.saving.options import SaveOptions, Seams

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.float8_e4m3fn, torch.float8_e5m2,
          torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool]


def _rand(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 10).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -1000), min(info.max, 1000), shape, generator=g, dtype=torch.int64).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_and_shape_round_trips(dtype, ckpt_dir):
    src = {
        "matrix": _rand((17, 33), dtype, 1),
        "scalar": _rand((), dtype, 2),
        "empty": _rand((0, 5), dtype, 3),
        "cube": _rand((3, 4, 5), dtype, 4),
        "strided": _rand((10, 12), dtype, 5).t()[2:9],  # non-contiguous source
    }
    shardfmt.save(src, ckpt_dir)
    dst = {k: torch.zeros_like(v.contiguous()) for k, v in src.items()}
    report = shardfmt.load(dst, ckpt_dir)
    assert not report.missing
    for k in src:
        assert bytes_equal(dst[k], src[k].contiguous()), k


def test_non_contiguous_targets_only_touch_their_elements(ckpt_dir):
    src = {"w": torch.arange(60, dtype=torch.float32).reshape(6, 10)}
    shardfmt.save(src, ckpt_dir)
    backing = torch.full((10, 6), -1.0)
    target = backing.t()  # a transposed, non-contiguous 6x10 view
    shardfmt.load({"w": target}, ckpt_dir)
    assert torch.equal(target, src["w"])
    big = torch.full((8, 14), -7.0)
    window = big[1:7, 2:12]  # strided window inside a larger buffer
    shardfmt.load({"w": window}, ckpt_dir)
    assert torch.equal(window, src["w"])
    mask = torch.ones_like(big, dtype=torch.bool)
    mask[1:7, 2:12] = False
    assert torch.all(big[mask] == -7.0), "elements outside the target view were written"


def test_sharded_tensor_targets_read_their_slice(ckpt_dir):
    full = torch.randn(64, 48)
    shardfmt.save({"w": full}, ckpt_dir)
    for offsets, lengths in [((0, 0), (64, 48)), ((16, 0), (16, 48)), ((0, 12), (64, 12)), ((5, 7), (30, 3))]:
        local = torch.empty(lengths)
        shardfmt.load({"w": ShardedTensor(local, (64, 48), offsets)}, ckpt_dir)
        assert torch.equal(local, full[offsets[0]:offsets[0] + lengths[0], offsets[1]:offsets[1] + lengths[1]])


def test_sharded_sources_written_by_one_process_load_whole(ckpt_dir):
    full = torch.randn(10, 6)
    src = {"w": ShardedTensor(full[:4].clone(), (10, 6), (0, 0))}
    w = shardfmt.saving.writer.CheckpointWriter(ckpt_dir)
    w.write_rank(0, [shardfmt.saving.writer.ShardData(fqn="w", data=full[:4], global_shape=(10, 6), offsets=(0, 0))])
    w.write_rank(1, [shardfmt.saving.writer.ShardData(fqn="w", data=full[4:], global_shape=(10, 6), offsets=(4, 0))])
    w.commit()
    m = shardfmt.read_manifest(ckpt_dir)  # whole: files and shards
    assert len(m.files) == 2 and len(m.tensors["w"].shards) == 2
    out = torch.empty(10, 6)
    shardfmt.load({"w": out}, ckpt_dir)
    assert torch.equal(out, full)
    del src


def test_tied_weights_are_stored_once_and_come_back_shared(ckpt_dir):
    emb = torch.nn.Embedding(50, 16)
    head = torch.nn.Linear(16, 50, bias=False)
    head.weight = emb.weight  # tied
    sd = {"emb.weight": emb.weight.detach(), "head.weight": head.weight.detach()}
    shardfmt.save(sd, ckpt_dir)
    m = shardfmt.read_manifest(ckpt_dir)
    assert m.tensors["head.weight"].alias_of == "emb.weight"
    size = sum(f.size for f in m.files.values())
    assert size < 50 * 16 * 4 * 2, "tied weight written twice"
    emb2 = torch.nn.Embedding(50, 16)
    head2 = torch.nn.Linear(16, 50, bias=False)
    head2.weight = emb2.weight
    dst = {"emb.weight": emb2.weight.detach(), "head.weight": head2.weight.detach()}
    shardfmt.load(dst, ckpt_dir)
    assert torch.equal(emb2.weight, emb.weight)
    assert emb2.weight.data_ptr() == head2.weight.data_ptr()
    separate = {"emb.weight": torch.zeros(50, 16), "head.weight": torch.zeros(50, 16)}
    shardfmt.load(separate, ckpt_dir)
    assert torch.equal(separate["head.weight"], emb.weight.detach())


def test_views_of_one_buffer_are_stored_once(ckpt_dir):
    buf = torch.randn(1000)
    sd = {"a": buf[0:600], "b": buf[400:1000].view(20, 30), "c": buf[::10]}
    shardfmt.save(sd, ckpt_dir)
    m = shardfmt.read_manifest(ckpt_dir)
    assert all(m.tensors[k].view is not None for k in sd)
    data_bytes = sum(f.size for f in m.files.values())
    assert data_bytes < 1000 * 4 + 1024, "overlapping views written more than once"
    buf2 = torch.zeros(1000)
    dst = {"a": buf2[0:600], "b": buf2[400:1000].view(20, 30), "c": buf2[::10]}
    shardfmt.load(dst, ckpt_dir)
    assert torch.equal(buf2, buf)
    plain = {"a": torch.zeros(600), "b": torch.zeros(20, 30), "c": torch.zeros(100)}
    shardfmt.load(plain, ckpt_dir)
    assert torch.equal(plain["b"], buf[400:].view(20, 30)) and torch.equal(plain["c"], buf[::10])


def test_json_values_round_trip_exactly(ckpt_dir):
    rng = np.random.RandomState(3)
    import random

    values = {
        "none": None, "bool": True, "int": -(1 << 62), "bigint": 1 << 80, "float": 0.1, "negzero": -0.0,
        "nan": float("nan"), "inf": float("inf"), "ninf": float("-inf"), "str": "ünï\u0000code",
        "tuple": (1, (2.5, "x"), []), "intkeys": {0: "a", 7: {"b": (1,)}}, "mixed": {1: 2, "1": 3},
        "dollar": {"$tuple": 5}, "bytes": b"\x00\xffabc", "nd": rng.randn(3, 4).astype(np.float32),
        "ndint": np.arange(6, dtype=np.uint32).reshape(2, 3), "npscalar": np.float64(2.5),
        "numpy_rng": rng.get_state(), "py_rng": random.Random(5).getstate(),
        "list": [1, "two", None, [3.0]],
    }
    sd = {"t": torch.ones(2), "vals": dict(values)}
    shardfmt.save(sd, ckpt_dir)
    out = {"t": torch.zeros(2), "vals": None}
    shardfmt.load(out, ckpt_dir)
    got = out["vals"]
    assert set(got) == set(values)
    for k, v in values.items():
        g = got[k]
        if isinstance(v, float) and math.isnan(v):
            assert math.isnan(g)
        elif k == "negzero":
            assert g == 0.0 and math.copysign(1, g) == -1
        elif k in ("nd", "ndint"):
            assert g.dtype == v.dtype and np.array_equal(g, v)
        elif k == "numpy_rng":
            assert g[0] == v[0] and np.array_equal(g[1], v[1]) and g[2:] == v[2:]
            r2 = np.random.RandomState()
            r2.set_state(g)
            r1 = np.random.RandomState()
            r1.set_state(v)
            assert np.array_equal(r1.randn(5), r2.randn(5))
        elif k == "npscalar":
            assert type(g) is np.float64 and g == v
        else:
            assert g == v and type(g) is type(v), k
    assert random.Random(5).getstate() == got["py_rng"]


def test_unstorable_value_is_refused_naming_the_key(ckpt_dir):
    class Custom:
        pass

    with pytest.raises(shardfmt.errors.EncodingError, match=r"opt\.thing"):
        shardfmt.save({"t": torch.ones(1), "opt": {"thing": Custom()}}, ckpt_dir)
    with pytest.raises(shardfmt.errors.EncodingError, match="set"):
        shardfmt.save({"s": {1, 2}}, ckpt_dir)
    import os

    assert not os.path.exists(ckpt_dir)


def test_lists_of_tensors_flatten_by_index(ckpt_dir):
    sd = {"layers": [torch.ones(2), {"w": torch.zeros(3)}, 5]}
    shardfmt.save(sd, ckpt_dir)
    m = shardfmt.read_manifest(ckpt_dir)
    assert set(m.tensors) == {"layers.0", "layers.1.w"} and "layers.2" in m.values
    out = {"layers": [torch.empty(2), {"w": torch.empty(3)}, None]}
    shardfmt.load(out, ckpt_dir)
    assert out["layers"][2] == 5 and torch.equal(out["layers"][0], torch.ones(2))


def test_flatten_collisions_and_bad_keys_raise(ckpt_dir):
    with pytest.raises(shardfmt.errors.StateDictError, match="same name"):
        shardfmt.save({"a.b": torch.ones(1), "a": {"b": torch.ones(1)}}, ckpt_dir)
    with pytest.raises(shardfmt.errors.StateDictError, match="same name"):
        shardfmt.save({"x": {0: torch.ones(1), "0": torch.ones(1)}}, ckpt_dir)
    with pytest.raises(shardfmt.errors.StateDictError, match="empty"):
        shardfmt.save({"a..b": torch.ones(1)}, ckpt_dir)
    with pytest.raises(shardfmt.errors.StateDictError, match="key"):
        shardfmt.save({"x": {(1, 2): torch.ones(1)}}, ckpt_dir)


def test_model_state_dict_with_dotted_keys_round_trips(ckpt_dir):
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8))
    shardfmt.save({"model": model.state_dict()}, ckpt_dir)
    other = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8))
    shardfmt.load({"model": other.state_dict()}, ckpt_dir)
    for a, b in zip(model.state_dict().values(), other.state_dict().values()):
        assert torch.equal(a, b)


def test_every_shard_file_opens_with_safetensors(ckpt_dir):
    sd = {"a": torch.randn(5, 3), "b": torch.arange(7, dtype=torch.int16), "c": torch.tensor(True),
          "d": torch.randn(4).bfloat16(), "e": torch.empty(0)}
    w = shardfmt.saving.writer.CheckpointWriter(ckpt_dir, chunk_size=4096)
    big = torch.randn(9, 4)
    w.write_rank(0, [shardfmt.saving.writer.ShardData(fqn=k, data=v, global_shape=tuple(v.shape), offsets=(0,) * v.dim())
                     for k, v in sd.items()]
                 + [shardfmt.saving.writer.ShardData(fqn="big", data=big[:3], global_shape=(9, 4), offsets=(0, 0)),
                    shardfmt.saving.writer.ShardData(fqn="big", data=big[6:], global_shape=(9, 4), offsets=(6, 0))])
    w.write_rank(1, [shardfmt.saving.writer.ShardData(fqn="big", data=big[3:6], global_shape=(9, 4), offsets=(3, 0))])
    w.commit()
    m = shardfmt.read_manifest(ckpt_dir)
    seen = {}
    for fname in m.files:
        with safe_open(f"{ckpt_dir}/{fname}", framework="pt") as f:
            for key in f.keys():
                seen[(fname, key)] = f.get_tensor(key)
    for fqn, rec in m.tensors.items():
        for s in rec.shards:
            t = seen[(s.file, s.key)]
            ref = sd[fqn] if fqn in sd else big[s.offsets[0]:s.offsets[0] + s.lengths[0]]
            assert bytes_equal(t, ref), (fqn, s.key)


def test_dtype_mismatch_needs_cast(ckpt_dir):
    shardfmt.save({"w": torch.randn(4, 4)}, ckpt_dir)
    with pytest.raises(shardfmt.errors.DTypeError, match="w"):
        shardfmt.load({"w": torch.zeros(4, 4, dtype=torch.bfloat16)}, ckpt_dir)
    out = torch.zeros(4, 4, dtype=torch.float64)
    shardfmt.load({"w": out}, ckpt_dir, cast=True)
    ref = {"w": torch.zeros(4, 4)}
    shardfmt.load(ref, ckpt_dir)
    assert torch.equal(out, ref["w"].double())


def test_shape_mismatch_and_missing_keys(ckpt_dir):
    shardfmt.save({"w": torch.randn(4, 4), "v": 3}, ckpt_dir)
    with pytest.raises(shardfmt.errors.ShapeError, match="w"):
        shardfmt.load({"w": torch.zeros(4, 5)}, ckpt_dir)
    with pytest.raises(shardfmt.errors.MissingKeyError, match="nope"):
        shardfmt.load({"w": torch.zeros(4, 4), "nope": torch.zeros(1)}, ckpt_dir)
    rep = shardfmt.load({"w": torch.zeros(4, 4), "nope": torch.zeros(1)}, ckpt_dir, strict=False)
    assert rep.missing == ("nope",) and rep.unexpected == ("v",)


def test_unsupported_dtype_is_named(ckpt_dir):
    with pytest.raises(shardfmt.errors.DTypeError, match="z"):
        shardfmt.save({"z": torch.zeros(2, dtype=torch.complex128)}, ckpt_dir)


def test_deterministic_bytes(tmp_path):
    import datetime as dt

    sd = {"a": torch.arange(10.0), "b": {"c": torch.ones(3, dtype=torch.int8)}, "v": (1, 2)}
    kw = dict(options=SaveOptions(_seams=Seams(save_id="fixed", writer_versions={"shardfmt": "x"},
                                               clock=lambda: dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc))))
    shardfmt.save(sd, str(tmp_path / "one"), **kw)
    shardfmt.save(sd, str(tmp_path / "two"), **kw)
    for name in ("manifest.json", "COMMITTED", "data/rank_00000.safetensors"):
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes()


def test_per_rank_value_comes_back(ckpt_dir):
    shardfmt.save({"rng": shardfmt.PerRank((1, 2, 3))}, ckpt_dir)
    out = {"rng": None}
    shardfmt.load(out, ckpt_dir)
    assert out["rng"] == (1, 2, 3)
    with pytest.raises(shardfmt.errors.StateDictError, match="rank=1 is not a rank of the job"):
        shardfmt.load({"rng": None}, ckpt_dir, rank=1)


def test_a_tensor_and_its_lazy_conjugate_are_saved_apart(ckpt_dir):
    x = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    shardfmt.save({"a": x, "b": x.conj(), "c": -x[:1]}, ckpt_dir)
    out = {k: torch.zeros(n, dtype=torch.complex64) for k, n in (("a", 2), ("b", 2), ("c", 1))}
    shardfmt.load(out, ckpt_dir)
    assert out["a"].tolist() == [1 + 2j, 3 - 4j]
    assert out["b"].tolist() == [1 - 2j, 3 + 4j]
    assert out["c"].tolist() == [-1 - 2j]


def test_a_zero_dim_numpy_value_keeps_its_shape(ckpt_dir):
    shardfmt.save({"a": np.array(3.5), "b": np.arange(6, dtype=np.int16).reshape(2, 3)[:, ::2]}, ckpt_dir)
    out = {"a": None, "b": None}
    shardfmt.load(out, ckpt_dir)
    assert out["a"].shape == () and out["a"] == 3.5
    assert out["b"].tolist() == [[0, 2], [3, 5]]


def test_integers_at_the_format_limit(ckpt_dir):
    ok = -(10 ** 4298)  # 4300 characters with its sign
    shardfmt.save({"n": ok}, ckpt_dir)
    out = {"n": None}
    shardfmt.load(out, ckpt_dir)
    assert out["n"] == ok
    with pytest.raises(shardfmt.errors.EncodingError, match="more than 4300 characters"):
        shardfmt.save({"n": -(10 ** 4299)}, ckpt_dir + "_2")


def test_a_nested_tensor_is_a_typed_error(ckpt_dir):
    nt = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    with pytest.raises(shardfmt.errors.StateDictError, match="w: nested tensors cannot be saved"):
        shardfmt.save({"w": nt}, ckpt_dir)


def test_a_value_inside_a_tuple_is_refused_before_anything_is_read(ckpt_dir):
    shardfmt.save({"x": (torch.ones(2), 5)}, ckpt_dir)
    out = {"x": (torch.zeros(2), 0)}
    with pytest.raises(shardfmt.errors.StateDictError, match="x.1: cannot replace a value inside an immutable tuple"):
        shardfmt.load(out, ckpt_dir)
    assert out["x"][0].tolist() == [0.0, 0.0]
