"""Is the stager's arena page-locked? torch's is_pinned against CUDA's own pointer attributes and copy timings."""
import time

import torch

import shardfmt
from shardfmt.saving.stager import _register_pinned

n = 1 << 30
w = torch.randn(n // 4, device="cuda")
s = shardfmt.Stager()
shardfmt.async_save({"w": w}, "/tmp/diag", stager=s).wait()
b = s._buffers[0]
print("torch", torch.__version__, "is_pinned(view)", b.is_pinned(), "is_pinned(base)", b._base.is_pinned() if b._base is not None else None)
try:
    import cupy
    a = cupy.cuda.runtime.pointerGetAttributes(b.data_ptr())
    print("cupy pointerGetAttributes type", a.type, "(0 unregistered, 1 host, 2 device)", "device", a.device)
except Exception as e:
    print("cupy:", type(e).__name__, e)
def t(dst, label):
    for _ in range(2):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(w, non_blocking=True)
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
    print(f"{label:28s} call {t1-t0:.4f}s  total {t2-t0:.4f}s  {n/(t2-t0)/1e9:.1f} GB/s")
t(b, "stager arena (registered)")
t(torch.empty(n // 4, pin_memory=True), "torch pin_memory=True")
t(torch.empty(n // 4), "pageable")
raw = torch.empty(n // 4)
unpin = _register_pinned(raw, torch.device("cuda", 0), {})
print("fresh register ok", unpin is not None, "is_pinned", raw.is_pinned())
t(raw, "fresh cudaHostRegister")
print("torch.cuda._pin_memory_utils:", hasattr(torch.cuda, "_pin_memory_utils"))
