"""The linear form's diagonal blocks (one causal L x L block per chunk, on the tiled kernels) against the
same work laid out plainly, b4 h8 N16384 d64 L1024 p=2 bf16: where does their time go?

Each line times one attn_cuda::fwd or ::bwd call (lab.timing.time_ms, median of 20): as the linear form
calls it (chunk-major views of the (d + 16)-wide rows, with a key mask), without the mask, and on
contiguous copies; and the whole quadratic form's forward for scale (its diagonal blocks are 1/16 of it).
"""
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from anywhere: the repository root's packages

import torch  # noqa: E402

from attention_cuda import _extension, _kernels, _ops, fastmax_attention  # noqa: E402
from attention_cuda.score import ScorePolicy  # noqa: E402
from lab.timing import time_ms  # noqa: E402

torch.manual_seed(0)
B, H, N, d, L = 4, 8, 16384, 64, 1024
policy = ScorePolicy("fastmax", d ** -0.5, None, 1.0, 1.0, 0.5)  # the diagonal blocks' (rows unnormalised)


def t(fn):
    return statistics.median(time_ms(lambda i: fn(), 1, 3, 20, "cuda"))


assert _extension.unavailable_reason() is None, _extension.unavailable_reason()
q, k, v, do = (torch.randn(B, H, N, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
qc, kc, vc = (_ops.lin_rows(x, None, None, 0, N, d + 16, L) for x in (q, k, v))
views = _kernels._diagonal(qc, kc, vc)
plain = tuple(x.contiguous() for x in views)
keep = torch.ones(B * N // L, L, dtype=torch.bool, device="cuda")
rows = (B * N // L, H, L, d)
dout_c = _ops.lin_rows(do, None, None, 0, N, d, L).view(rows)


def fwd(x, mask):
    return _ops.fwd(*x, mask=mask, bias=None, causal=True, policy=policy)


def bwd(x, mask, saved):
    return _ops.bwd(dout_c, *x, mask=mask, bias=None, out=saved.out, stat=saved.stat, causal=True, bias_grad=False)


for name, x, mask in (("views + mask (as called)", views, keep), ("views, no mask", views, None),
                      ("contiguous, no mask", plain, None), ("contiguous + mask", plain, keep)):
    saved = fwd(x, mask)
    print(f"diag {name:26s} fwd {t(lambda: fwd(x, mask)):.3f} ms  bwd {t(lambda: bwd(x, mask, saved)):.3f} ms",
          flush=True)
with torch.no_grad():
    tq = t(lambda: fastmax_attention(q, k, v, causal=True, temperature=d ** 0.5, form="quadratic", backend="cuda"))
print(f"whole quadratic forward (N{N}): {tq:.3f} ms; 1/16 of it: {tq / 16:.3f} ms")
