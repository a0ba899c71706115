"""Fastmax linear form end to end per chunk length (Tuning.chunked_rows; 0 = the sweep), b4 h8 d64 and b1 h32 d128,
N16384 causal p=2 bf16: forward and forward+backward, then a per-kernel profile of one chunked d64 step
(bench/runs/2026-11-22_s17_chunk-rows.txt)."""
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from anywhere: the repository root's packages

import torch  # noqa: E402

from attention_cuda import Tuning, fastmax_attention  # noqa: E402
from lab.timing import time_ms  # noqa: E402


def t(fn):  # median ms of 10 CUDA-event-timed runs after 3 warm-ups
    return statistics.median(time_ms(lambda i: fn(), 1, 3, 10, "cuda"))
for d, (B, H) in ((64, (4, 8)), (128, (1, 32))):
    N = 16384
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, H, N, d, generator=g, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    do = torch.randn(B, H, N, d, generator=g, device="cuda", dtype=torch.bfloat16)
    for L in (0, 512, 1024, 2048):
        form, tuning = "linear", Tuning(chunked_rows=L)
        f = lambda: fastmax_attention(q, k, v, causal=True, temperature=d ** 0.5, form=form, backend="cuda",
                                      tuning=tuning)
        fb = lambda: torch.autograd.grad(f(), (q, k, v), do)
        with torch.no_grad():
            tf = t(f)
        tfb = t(fb)
        torch.cuda.reset_peak_memory_stats(); base = torch.cuda.memory_allocated(); fb(); torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30
        print(f"d{d} b{B} h{H} N{N} L={L or 'sweep'}: fwd {tf:.3f} ms  fwd+bwd {tfb:.3f} ms  peak extra {peak:.2f} GiB", flush=True)
    form = "quadratic"
    with torch.no_grad():
        tf = t(f)
    print(f"d{d} quadratic: fwd {tf:.3f} fwd+bwd {t(fb):.3f}", flush=True)
# profile one chunked fwd+bwd at d64 by kernel
q, k, v = (torch.randn(4, 8, 16384, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
do = torch.randn_like(q)
fb = lambda: torch.autograd.grad(fastmax_attention(q, k, v, causal=True, temperature=8.0, form="linear", backend="cuda"), (q, k, v), do)
fb(); torch.cuda.synchronize()
from torch.profiler import profile, ProfilerActivity
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    for _ in range(3): fb()
    torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60))
