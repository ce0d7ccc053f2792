"""DeepSpeed partitions -> shardfmt -> DeepSpeed partitions, bit for bit.

Each real DeepSpeed checkpoint (tests/fixtures/deepspeed) is imported as a shardfmt checkpoint;
then, for every dp rank, ``reshard.deepspeed.partitions.flat_targets`` gives the buffers DeepSpeed
holds on that rank (ZeRO-1/2 ``single_partition_of_fp32_groups``, ZeRO-3 ``fp32_flat_groups``,
Adam's ``exp_avg``/``exp_avg_sq``) as ``FlatShard`` targets; ``shardfmt.load`` fills them, and they
must equal DeepSpeed's own tensors, read from that rank's optim-states file through the restricted
unpickler, on every parameter element, while the padding keeps its sentinel. Also across world
sizes: a 2-rank checkpoint loaded into 3-rank ZeRO-2 and ZeRO-3 partitions."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import shardfmt
from reshard._shardfmt import get_storage
from reshard.deepspeed import import_deepspeed
from reshard.deepspeed.partitions import (
    MASTER,
    SENTINEL_BITS,
    FlatBuffer,
    FlatGroups,
    flat_targets,
    from_records,
    sentinel,
)
from reshard.deepspeed.ptfile import PtFile
from reshard.deepspeed.records import model_states, rank_optim
from reshard.errors import DeepSpeedImportError

FIX = Path(__file__).parent / "fixtures" / "deepspeed"
CASES = sorted(p.name for p in FIX.iterdir() if (p / "latest").is_file())


def _bits(t: torch.Tensor) -> list[int]:
    return t.contiguous().view(torch.int32).tolist()


def _imported(case: str, tmp_path_factory) -> str:
    dst = tmp_path_factory.mktemp(case) / "ckpt"
    import_deepspeed(str(FIX / case), str(dst), trust_pickle=True,
                     format_version=1 if case.endswith("bf16") else None)
    return str(dst)


def _open(case: str):
    """Rank 0's model-states record, and every rank's optim record with its open file."""
    storage, root = get_storage(str(FIX / case), None)
    tag = (FIX / case / "latest").read_text().strip()
    names = sorted(p.name for p in (FIX / case / tag).iterdir())
    model_name = next(n for n in names if n.endswith("model_states.pt"))  # rank 0's (sorted first)
    mf = PtFile(storage, root, str(FIX / case / tag / model_name))
    model = model_states(mf.load(), mf.path)
    mf.close()
    optim = []
    for r in range(sum(n.endswith("optim_states.pt") for n in names)):
        name = next(n for n in names if n.endswith(f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt"))
        f = PtFile(storage, root, str(FIX / case / tag / name))
        optim.append((rank_optim(f.load(), f.path), f))
    return model, optim


def _check(buf: FlatBuffer, want: torch.Tensor, where: str) -> None:
    """``buf`` equals ``want`` bit for bit on its real ranges; everything else holds the sentinel."""
    got = buf.tensor
    assert got.dtype == want.dtype == torch.float32, where
    assert buf.real and buf.real[-1][1] <= want.numel() <= got.numel(), (where, buf.real, want.numel(), got.numel())
    real = torch.zeros(got.numel(), dtype=torch.bool)
    for lo, hi in buf.real:
        real[lo:hi] = True
        assert _bits(got[lo:hi]) == _bits(want[lo:hi]), (where, lo, hi)
    assert (got.view(torch.int32)[~real] == SENTINEL_BITS).all(), where


@pytest.mark.parametrize("case", CASES)
def test_an_import_restores_every_ranks_deepspeed_partitions_bit_for_bit(case, tmp_path_factory):
    ckpt = _imported(case, tmp_path_factory)
    model, optim = _open(case)
    try:
        groups = from_records(model, optim[0][0])
        world = optim[0][0].world_size
        assert len(optim) == world
        for rank, (o, f) in enumerate(optim):
            flat = flat_targets(groups, rank=rank, world_size=world)
            shardfmt.load(flat.targets, ckpt, strict=False)
            assert len(flat.buffers) == 3 * len(o.flats)
            for buf in flat.buffers:
                ref = o.flats[buf.group] if buf.key == MASTER else dict(o.states[buf.group].tensors)[buf.key]
                want = f.read(ref)
                _check(buf, want, f"{case} rank {rank} group {buf.group} {buf.key}")
                if buf.key == MASTER and o.stage in (1, 2):  # saved stripped of exactly its tail padding
                    assert want.numel() == buf.real[-1][1], (rank, buf.group)
                elif not case.endswith("elastic"):  # ZeRO-3 flats and unstripped Adam state: the whole buffer
                    assert want.numel() == buf.tensor.numel(), (rank, buf.group, buf.key)
    finally:
        for _, f in optim:
            f.close()


def _expected(groups: FlatGroups, buf: FlatBuffer, rank: int, world: int, full: dict[str, torch.Tensor]) -> torch.Tensor:
    """The buffer built by hand from the whole tensors: sentinel, then each parameter's elements."""
    out = sentinel(buf.tensor.numel())
    if groups.stage == 3:
        offset = 0
        for name, shape in groups.param_shapes[buf.group]:
            pn = math.ceil(math.prod(shape) / world)
            got = full[name].reshape(-1)[rank * pn:(rank + 1) * pn]
            out[offset:offset + got.numel()] = got
            offset += pn
        return out
    part = buf.tensor.numel()
    whole = sentinel(part * world)
    for name, shape, off in groups.members(buf.group):
        whole[off:off + math.prod(shape)] = full[name].reshape(-1)
    return whole[rank * part:(rank + 1) * part]


@pytest.mark.parametrize("case", ["z2_ws2_palign", "z3_ws2"])
@pytest.mark.parametrize("stage", [2, 3])
def test_a_two_rank_import_loads_into_three_rank_partitions(case, stage, tmp_path_factory):
    """Flat -> flat across world sizes: W=2 partitions, through shardfmt, become W=3 partitions of
    either stage, equal to zero_to_fp32's whole tensors cut by hand."""
    ckpt = _imported(case, tmp_path_factory)
    model, optim = _open(case)
    for _, f in optim:
        f.close()
    groups = FlatGroups(stage=stage, param_shapes=model.param_shapes,
                        alignment_paddings=optim[0][0].alignment_paddings if stage == 2 else None)
    params = load_file(FIX / case / "zero_to_fp32.safetensors")
    state = load_file(FIX / case / "zero_to_fp32_optim.safetensors")
    for rank in range(3):
        flat = flat_targets(groups, rank=rank, world_size=3)
        shardfmt.load(flat.targets, ckpt, strict=False)
        for buf in flat.buffers:
            full = params if buf.key == MASTER else {n: state[f"{n}.{buf.key}"] for n, _ in model.param_shapes[buf.group]}
            want = _expected(groups, buf, rank, 3, full)
            assert _bits(buf.tensor) == _bits(want), (rank, buf.group, buf.key)


def test_flat_targets_arithmetic():
    """ZeRO-2 W=3 with a 3-element gap after 'a': N = 5 + 3 + 4 = 12, T = 12, P = 4; ZeRO-3: chunks of 2 and 2."""
    groups = FlatGroups(stage=2, param_shapes=((("a", (5,)), ("b", (2, 2))),), alignment_paddings=((3, 0),))
    got = [flat_targets(groups, rank=r, world_size=3, state_keys=()) for r in range(3)]
    assert [b.real for t in got for b in t.buffers] == [((0, 4),), ((0, 1),), ((0, 4),)]
    assert {k: (s.start, s.local.numel()) for k, s in got[1].targets.items()} == {"model.a": (4, 1)}
    z3 = flat_targets(FlatGroups(stage=3, param_shapes=groups.param_shapes), rank=2, world_size=3, state_keys=())
    assert z3.buffers[0].tensor.numel() == 4 and z3.buffers[0].real == ((0, 1),)  # a[4:6] holds 1, b[4:6] none
    with pytest.raises(DeepSpeedImportError, match="dp rank 3 of a world of 3"):
        flat_targets(groups, rank=3, world_size=3)
