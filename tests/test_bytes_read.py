"""Bytes read, counted at the storage layer: a rank reads only what it needs."""

import pytest
import torch

import shardfmt
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
    from reshard.geometry import Box
    from reshard.planner import TargetSlice, plan_load

    path = str(tmp_path / "c")
    shardfmt.save({"w": torch.randn(16384, 256)}, path)  # 16 MiB, 1 KiB rows
    m = shardfmt.read_manifest(path)
    halves = [TargetSlice(index=i, fqn="w", box=Box((0, 128 * i), (16384, 128))) for i in range(2)]
    (shard,) = m.tensors["w"].shards
    for bounce_read in (CHUNK, 8 * CHUNK):
        plan = plan_load(m, halves, bounce=frozenset({0, 1}), max_bounce_read=bounce_read)
        lo, hi = shard.byte_range
        assert plan.bytes_to_read == min(-(-hi // CHUNK) * CHUNK, m.files[shard.file].size) - lo // CHUNK * CHUNK
        spans = sorted((r.byte_range.start, r.byte_range.end) for r in plan.reads)
        assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))
