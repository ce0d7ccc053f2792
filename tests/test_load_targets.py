"""The tensors a user hands to ``load``: tied, strided, autograd leaves, expanded, offline ranks."""

import os

import pytest
import torch
from conftest import flip_byte

import shardfmt
import shardfmt.saving.writer


@pytest.mark.parametrize("workers", [1, 4])
@pytest.mark.parametrize("same", [True, False])
def test_tied_targets_load_from_a_checkpoint_that_stores_them_apart(tmp_path, workers, same):
    """Tied weights (one tensor under two names) loaded from a checkpoint holding two tensors:
    bytes read for one name must not be overwritten by the other's before they are hashed, and
    the tensor ends up holding one name's values (the later name's), never a mix of both (two
    threads copying into it at once left one)."""
    path = str(tmp_path / "ck")
    emb = torch.arange(1 << 18, dtype=torch.float32)
    head = emb.clone() if same else -emb
    shardfmt.save({"emb": emb, "head": head, "other": torch.ones(300)}, path, chunk_size=1 << 16)
    tied = torch.zeros(1 << 18)
    other = torch.zeros(300)
    rep = shardfmt.load({"emb": tied, "head": tied, "other": other}, path, workers=workers, max_read=1 << 16)
    assert rep.loaded == ("emb", "head", "other")
    assert torch.equal(tied, head)
    assert torch.equal(other, torch.ones(300))


class _LM(torch.nn.Module):
    def __init__(self, tie: bool) -> None:
        super().__init__()
        self.emb = torch.nn.Linear(64, 64, bias=False)
        self.head = torch.nn.Linear(64, 64, bias=False)
        if tie:
            self.head.weight = self.emb.weight


def test_checkpointer_restores_an_untied_checkpoint_into_a_tied_model(tmp_path):
    """The fallback must not take a reader's mistake for corruption (and quarantine the checkpoint)."""
    root = str(tmp_path / "run")
    untied = _LM(tie=False)
    with torch.no_grad():
        untied.head.weight.copy_(untied.emb.weight)
    shardfmt.Checkpointer(root).save(1, {"model": untied})
    tied = _LM(tie=True)
    assert shardfmt.Checkpointer(root).restore({"model": tied}) == 1
    assert torch.equal(tied.emb.weight, untied.emb.weight)
    assert sorted(os.listdir(root)) == ["step_000000001"]


def test_one_element_views_with_a_non_unit_stride(tmp_path):
    """``zeros(1, 2)[:, 0]`` is contiguous by torch's rule but its stride is 2."""
    path = str(tmp_path / "ck")
    src = torch.tensor([[5.0, 6.0]])[:, 0]
    assert src.is_contiguous() and src.stride() == (2,)
    shardfmt.save({"one": src, "w": torch.arange(4.0)}, path)
    one = torch.zeros(1, 2)[:, 0]
    piece = torch.zeros(1, 2)
    shardfmt.load({"one": one, "w": shardfmt.ShardedTensor(piece[:, 1], (4,), (3,))}, path)
    assert one.tolist() == [5.0] and piece.tolist() == [[0.0, 3.0]]


def test_parameters_load_in_place_through_casts_and_strided_views(tmp_path):
    path = str(tmp_path / "ck")
    w = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    shardfmt.save({"w": w, "b": torch.arange(4, dtype=torch.float32)}, path)
    p_t = torch.nn.Parameter(torch.zeros(4, 3)).t()  # a transposed view of a leaf that requires grad
    p_b = torch.nn.Parameter(torch.zeros(4, dtype=torch.float64))
    shardfmt.load({"w": p_t, "b": p_b}, path, cast=True)
    assert torch.equal(p_t.detach(), w) and p_b.tolist() == [0.0, 1.0, 2.0, 3.0]
    assert p_b.requires_grad and p_b.grad_fn is None


def test_an_expanded_target_is_refused_before_anything_is_read(tmp_path):
    path = str(tmp_path / "ck")
    shardfmt.save({"v": torch.arange(4.0), "w": torch.ones(3, 4)}, path)
    v = torch.full((4,), -1.0)
    with pytest.raises(shardfmt.errors.StateDictError, match="w: the target tensor has elements that share memory"):
        shardfmt.load({"v": v, "w": torch.zeros(4).expand(3, 4)}, path)
    assert v.tolist() == [-1.0] * 4


def test_rank_given_offline_is_a_rank_of_the_saving_job(tmp_path):
    path = str(tmp_path / "ck")
    w = shardfmt.saving.writer.CheckpointWriter(path)
    full = torch.arange(8.0)
    for r in range(4):
        w.write_rank(r, [shardfmt.saving.writer.ShardData(fqn="w", data=full[2 * r:2 * r + 2], global_shape=(8,), offsets=(2 * r,))])
    w.add_value("rng", per_rank={r: f"state-{r}" for r in range(4)})
    w.commit()
    for r in range(4):
        sd = {"w": shardfmt.ShardedTensor(torch.zeros(2), (8,), (2 * r,)), "rng": shardfmt.PerRank(None)}
        shardfmt.load(sd, path, rank=r)
        assert sd["rng"].value == f"state-{r}" and sd["w"].local.tolist() == [2.0 * r, 2.0 * r + 1]
    with pytest.raises(shardfmt.errors.StateDictError, match="rank=4 is not a rank of the job that saved it"):
        shardfmt.load({"rng": shardfmt.PerRank(None)}, path, rank=4)


def test_a_failed_verification_says_the_targets_may_hold_partial_data(tmp_path):
    path = str(tmp_path / "ck")
    shardfmt.save({"w": torch.arange(4096.0)}, path, chunk_size=4096)
    f = os.path.join(path, "data", "rank_00000.safetensors")
    flip_byte(f, 9000)
    with pytest.raises(shardfmt.errors.IntegrityError, match="chunk 2 .*may hold part of the checkpoint's data"):
        shardfmt.load({"w": torch.zeros(4096)}, path)


def test_a_tensor_where_a_value_was_saved_and_back_are_named(tmp_path):
    path = str(tmp_path / "ck")
    shardfmt.save({"w": torch.ones(2), "step": 3}, path)
    with pytest.raises(shardfmt.errors.StateDictError, match="step: the checkpoint holds a value here, not a tensor"):
        shardfmt.load({"step": torch.zeros(1)}, path)
    with pytest.raises(shardfmt.errors.StateDictError, match="w: the checkpoint holds a tensor here"):
        shardfmt.load({"w": None}, path)


def test_a_cast_that_would_drop_the_imaginary_part_is_refused(tmp_path):
    path = str(tmp_path / "ck")
    shardfmt.save({"z": torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex64)}, path)
    with pytest.raises(shardfmt.errors.DTypeError, match="z: .*imaginary part"):
        shardfmt.load({"z": torch.zeros(2)}, path, cast=True)
    out = torch.zeros(2, dtype=torch.complex128)
    shardfmt.load({"z": out}, path, cast=True)
    assert out.tolist() == [1 + 2j, 3 - 1j]


def test_column_slices_of_one_buffer_load_in_place_without_memory_of_their_own(tmp_path):
    """Views of one buffer that interleave (a fused QKV matrix's column blocks held apart) share a
    memory span but no element: each is read through a bounce buffer into its own columns, none
    gets a private copy, and every column ends up right."""
    from shardfmt.loading.options import LoadOptions
    from shardfmt.loading.reader import open_checkpoint
    from shardfmt.loading.request import request_load

    g = torch.Generator().manual_seed(0)
    sd = {"q": torch.randn(64, 8, generator=g), "k": torch.randn(64, 8, generator=g), "v": torch.randn(64, 8, generator=g)}
    path = str(tmp_path / "ck")
    shardfmt.save(sd, path)
    qkv = torch.zeros(64, 24)
    state = {"q": qkv[:, :8], "k": qkv[:, 8:16], "v": qkv[:, 16:]}
    req = request_load(state, open_checkpoint(path).manifest, LoadOptions(), rank=0, world_size=1, source=path)
    assert all(t.bounce and not t.views for t in req.targets)
    assert {t.dst.data_ptr() for t in req.targets} == {qkv[:, i:].data_ptr() for i in (0, 8, 16)}
    shardfmt.load(state, path, workers=4)
    assert torch.equal(qkv, torch.cat([sd["q"], sd["k"], sd["v"]], dim=1))
