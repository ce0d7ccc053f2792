"""CUDA paths (skipped without a GPU): pinned side-stream snapshots, loads into CUDA targets."""

import pytest
import torch

import shardfmt

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_async_save_of_cuda_tensors_is_isolated_and_stages_in_pinned_memory(tmp_path):
    w = torch.randn(1024, 1024, device="cuda")
    ref = w.cpu()
    stager = shardfmt.Stager()
    for stage in ("call", "background"):
        path = str(tmp_path / stage)
        h = shardfmt.async_save({"w": w, "b": w[:, :3]}, path, stager=stager, stage=stage)
        if stage == "background":
            h.wait_staged()
        w.add_(1.0)  # queued on the current stream right after the call
        h.wait()
        out = {"w": torch.empty(1024, 1024, device="cuda"), "b": torch.empty(1024, 3, device="cuda")}
        shardfmt.load(out, path)
        assert out["w"].device.type == "cuda"
        assert torch.equal(out["w"].cpu(), ref) and torch.equal(out["b"].cpu(), ref[:, :3])
        ref = w.cpu()
    assert all(b.is_pinned() for b in stager._buffers)


def test_load_into_strided_cuda_target_leaves_neighbours(tmp_path):
    w = torch.randn(64, 48)
    shardfmt.save({"w": w}, str(tmp_path / "c"))
    big = torch.full((64, 100), -7.0, device="cuda")
    shardfmt.load({"w": big[:, 20:68]}, str(tmp_path / "c"))
    assert torch.equal(big[:, 20:68].cpu(), w)
    assert torch.all(big[:, :20] == -7.0) and torch.all(big[:, 68:] == -7.0)


def test_background_staging_sees_writes_queued_on_the_callers_stream(tmp_path):
    """The snapshot waits for what the caller queued on *its* current stream before the call,
    even though a background thread (whose current stream is the default one) copies."""
    side = torch.cuda.Stream()
    w = torch.zeros(4096, 4096, device="cuda")
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # keep the stream busy so a copy that does not wait reads zeros
        w.fill_(3.0)
        h = shardfmt.async_save({"w": w}, str(tmp_path / "c"), stager=shardfmt.Stager(), stage="background")
    h.wait_staged()
    h.wait()
    out = {"w": torch.empty(4096, 4096)}
    shardfmt.load(out, str(tmp_path / "c"))
    assert torch.all(out["w"] == 3.0)


def test_a_failed_host_register_leaves_no_cuda_error_behind():
    """cudaHostRegister's failure must not surface at the caller's next kernel launch."""
    from shardfmt.saving.stager import _register_pinned

    arena = torch.empty(1 << 20, dtype=torch.uint8)
    unpin = _register_pinned(arena, torch.device("cuda", 0), {})
    assert unpin is not None
    try:
        assert _register_pinned(arena, torch.device("cuda", 0), {}) is None  # already registered: fails
        torch.ones(8, device="cuda").add_(1)  # C10_CUDA_KERNEL_LAUNCH_CHECK = cudaGetLastError()
        torch.cuda.synchronize()
    finally:
        unpin()
