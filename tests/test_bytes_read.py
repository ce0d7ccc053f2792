"""Bytes read, counted at the storage layer: a rank reads only what it needs."""

import pytest
import torch

import shardfmt
import shardfmt.saving.writer
from shardfmt import ShardedTensor

CHUNK = 1 << 20


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("bytes") / "ck")
    w = torch.randn(4096, 1024)  # 16 MiB
    shardfmt.save({"w": w, "small": torch.ones(10)}, path)
    return path, w


def _rounded(nbytes_start, nbytes_end):
    lo = (nbytes_start // CHUNK) * CHUNK
    hi = -(-nbytes_end // CHUNK) * CHUNK
    return hi - lo


def test_row_slice_reads_at_most_1_1x_its_chunk_rounded_bytes(big):
    path, w = big
    m = shardfmt.read_manifest(path)
    (shard,) = m.tensors["w"].shards
    for k in range(8):
        local = torch.empty(512, 1024)
        rep = shardfmt.load({"w": ShardedTensor(local, (4096, 1024), (512 * k, 0))}, path, strict=False)
        assert torch.equal(local, w[512 * k: 512 * (k + 1)])
        need = 512 * 1024 * 4
        start = shard.byte_range[0] + k * need
        bound = _rounded(start, start + need)
        header = m.files[shard.file].header_size
        assert rep.bytes_needed == need
        assert rep.bytes_read <= 1.1 * bound + header, (k, rep.bytes_read, bound)


def test_column_slice_without_verify_reads_exactly_what_it_needs(big):
    path, w = big
    local = torch.empty(4096, 128)
    rep = shardfmt.load({"w": ShardedTensor(local, (4096, 1024), (0, 256))}, path, strict=False,
                        verify=False, max_gap=0)
    assert torch.equal(local, w[:, 256:384])
    assert rep.bytes_read == rep.bytes_needed == 4096 * 128 * 4


def test_column_slice_default_gap_is_a_speed_knob_not_correctness(big):
    path, w = big
    local = torch.empty(4096, 128)
    rep = shardfmt.load({"w": ShardedTensor(local, (4096, 1024), (0, 256))}, path, strict=False, verify=False)
    assert torch.equal(local, w[:, 256:384])
    assert rep.bytes_read >= rep.bytes_needed


def test_whole_load_reads_the_file_about_once(big):
    path, w = big
    out = {"w": torch.empty(4096, 1024), "small": torch.empty(10)}
    rep = shardfmt.load(out, path)
    size = sum(f.size for f in shardfmt.read_manifest(path).files.values())
    assert torch.equal(out["w"], w)
    assert rep.bytes_read <= size + 64 * 1024  # data once, plus the header check


def test_reshard_plan_cli_prints_reads_without_reading_data(big, capsys):
    import orjson

    from reshard.cli import main

    path, _ = big
    assert main(["plan", path, "--mesh", "tp=4", "--rank", "1", "--json"]) == 0
    out = orjson.loads(capsys.readouterr().out)
    assert out["needed_bytes"] == 4096 * 1024 * 4 + 40  # no placement recorded: every rank takes all
    assert main(["plan", path, "--mesh", "tp=4", "--rank", "9"]) == 2
    assert main(["plan", path + "-missing", "--mesh", "tp=4", "--rank", "0"]) == 2


def test_verified_column_slice_reads_each_hash_chunk_once(big):
    """Every chunk of a row-major tensor holds some of a column slice's bytes, so a verified
    reader must read them all, but once: reads are cut at chunk boundaries, never overlapping."""
    path, w = big
    m = shardfmt.read_manifest(path)
    (shard,) = m.tensors["w"].shards
    header = m.files[shard.file].header_size
    local = torch.empty(4096, 512)
    rep = shardfmt.load({"w": ShardedTensor(local, (4096, 1024), (0, 512))}, path, strict=False)
    assert torch.equal(local, w[:, 512:])
    assert rep.read_requests > 2  # several bounce reads (the cuts are exercised)
    assert rep.bytes_read <= _rounded(*shard.byte_range) + header


def test_two_column_targets_of_one_tensor_read_each_chunk_once(tmp_path):
    """Two column halves interleave row by row in the file: a read must not re-read the chunk
    it shares with the next one, even when the next copy starts inside the read's first chunk."""
    from shardfmt.layout.geometry import Box
    from shardfmt.loading.planner import TargetSlice, plan_load

    path = str(tmp_path / "c")
    shardfmt.save({"w": torch.randn(16384, 256)}, path)  # 16 MiB, 1 KiB rows
    m = shardfmt.read_manifest(path)
    halves = [TargetSlice(index=i, fqn="w", box=Box((0, 128 * i), (16384, 128))) for i in range(2)]
    (shard,) = m.tensors["w"].shards
    for bounce_read in (CHUNK, 8 * CHUNK):
        plan = plan_load(m, halves, bounce=frozenset({0, 1}), max_bounce_read=bounce_read)
        a, b = m.files[shard.file].grid(m.chunk_size).widen(*shard.byte_range)
        assert plan.bytes_to_read == b - a  # every chunk of the shard, once
        spans = sorted((r.byte_range.start, r.byte_range.end) for r in plan.reads)
        assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))


def _one_file(path):
    m = shardfmt.read_manifest(path)
    (f,) = m.files.values()
    return f


@pytest.mark.parametrize("bounced", ["column slice", "cast"])
def test_in_place_and_bounced_targets_sharing_a_chunk_read_it_once(tmp_path, bounced):
    """A bias loaded in place and a weight loaded through a bounce buffer (a column slice, or a
    cast), each one hash chunk: every byte is read once, the bias copied out of the bounced read."""
    path = str(tmp_path / "ck")
    w, b = torch.randn(256, 256), torch.randn(256)
    shardfmt.save({"w": w, "b": b}, path, chunk_size=CHUNK)
    f = _one_file(path)
    bias = torch.empty(256)
    if bounced == "cast":
        local = torch.empty(256, 256, dtype=torch.float64)
        rep = shardfmt.load({"w": local, "b": bias}, path, cast=True)
        assert torch.equal(local, w.double())
    else:
        local = torch.empty(256, 128)
        rep = shardfmt.load({"w": ShardedTensor(local, (256, 256), (0, 128)), "b": bias}, path)
        assert torch.equal(local, w[:, 128:])
    assert torch.equal(bias, b)
    assert rep.bytes_read <= f.size - f.header_size, f"{rep.bytes_read} bytes read from a {f.size}-byte file"
    assert rep.read_requests == 2 and rep.metadata_reads == 3  # each shard's chunk once; the rank table, index, header


def _tp_checkpoint(path):
    """A small MLP saved by a 2-rank data-parallel job: replicated, so rank 0 writes it all."""
    g = torch.Generator().manual_seed(0)
    sd = {"norm.weight": torch.randn(512, generator=g), "fc1.weight": torch.randn(1024, 512, generator=g),
          "fc1.bias": torch.randn(1024, generator=g), "fc2.weight": torch.randn(512, 1024, generator=g),
          "fc2.bias": torch.randn(512, generator=g)}
    w = shardfmt.saving.writer.CheckpointWriter(path)
    w.write_rank(0, [shardfmt.saving.writer.ShardData(fqn=k, data=v, global_shape=tuple(v.shape), offsets=(0,) * v.dim())
                     for k, v in sd.items()])
    w.write_rank(1, [])
    w.commit()
    return sd


def test_two_rank_tensor_parallel_load_reads_the_checkpoint_once_per_rank(tmp_path):
    """Each rank of a 2-rank TP job: fc1 ColwiseParallel (rows, in place), fc2 RowwiseParallel
    (a column slice of the weight, through a bounce buffer), norm and fc2's bias replicated.
    The checkpoint (4 MiB, 1 MiB hash chunks) is read at most once per rank, not 1.5x."""
    path = str(tmp_path / "ck")
    sd = _tp_checkpoint(path)
    f = shardfmt.read_manifest(path).files["data/rank_00000.safetensors"]
    for r in range(2):
        out = {"norm.weight": torch.empty(512),
               "fc1.weight": ShardedTensor(torch.empty(512, 512), (1024, 512), (512 * r, 0)),
               "fc1.bias": ShardedTensor(torch.empty(512), (1024,), (512 * r,)),
               "fc2.weight": ShardedTensor(torch.empty(512, 512), (512, 1024), (0, 512 * r)),
               "fc2.bias": torch.empty(512)}
        rep = shardfmt.load(out, path, rank=r)
        assert torch.equal(out["fc1.weight"].local, sd["fc1.weight"][512 * r: 512 * (r + 1)])
        assert torch.equal(out["fc1.bias"].local, sd["fc1.bias"][512 * r: 512 * (r + 1)])
        assert torch.equal(out["fc2.weight"].local, sd["fc2.weight"][:, 512 * r: 512 * (r + 1)])
        assert torch.equal(out["norm.weight"], sd["norm.weight"]) and torch.equal(out["fc2.bias"], sd["fc2.bias"])
        assert rep.bytes_read <= f.size + f.header_size, (r, rep.bytes_read, f.size)


def test_reshard_plan_lists_each_byte_range_once(tmp_path, capsys):
    """``reshard plan`` for rank 1 of tp=2: a column slice (RowwiseParallel weight) and its
    replicated bias, each in its own hash chunks, are read once, each source byte listed once."""
    import orjson

    from reshard.cli import main
    from shardfmt.format.manifest import Topology
    from shardfmt.layout.dtensor import placement_record
    from shardfmt.layout.topology import Layout, Shard

    path = str(tmp_path / "ck")
    w = shardfmt.saving.writer.CheckpointWriter(path)
    w.write_rank(0, [
        shardfmt.saving.writer.ShardData(fqn="fc2.weight", data=torch.randn(256, 256), global_shape=(256, 256), offsets=(0, 0),
                           placement=placement_record(Layout(("tp",), (Shard(1),)))),
        shardfmt.saving.writer.ShardData(fqn="fc2.bias", data=torch.randn(256), global_shape=(256,), offsets=(0,),
                           placement=placement_record(Layout((), ())))])
    w.commit(topology=Topology(world_size=1, mesh=(("tp", 1),)))
    f = _one_file(path)
    assert main(["plan", path, "--mesh", "tp=2", "--rank", "1", "--json"]) == 0
    out = orjson.loads(capsys.readouterr().out)
    reads = sorted(tuple(r["byte_range"]) for r in out["reads"])
    # every chunk of the file once: its data, each shard's chunks (v2: the header has none)
    assert reads[0][0] == f.header_size and reads[-1][1] == f.size, reads
    assert all(a[1] == b[0] for a, b in zip(reads, reads[1:])), reads
    assert out["bytes_to_read"] == f.size - f.header_size
    copied = sorted(tuple(c["src_bytes"]) for r in out["reads"] for c in r["copies"])
    assert all(a[1] <= b[0] for a, b in zip(copied, copied[1:])), copied  # no source byte copied twice
