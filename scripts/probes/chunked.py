"""Probe of the chunked Hopper linear form: 48 checks against float64 next to the sweep, then timings (bench/runs/2026-11-22_s16_chunked-linear.txt)."""
# Chunked Hopper linear form (lin_state + lin_read) against the sweep (attn_cuda::linear) and a float64
# reference, on chunk-major inputs; then timings at b4 h8 N16384.
import math, statistics, sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from anywhere: the repository root's packages
import torch
from attention_cuda import _extension
from attention_cuda import _ops as ops
from lab.timing import time_ms
assert _extension.unavailable_reason() is None, _extension.unavailable_reason()
dev = "cuda"
print("chunked dims bf16", ops.chunked_head_dims(torch.bfloat16), "f16", ops.chunked_head_dims(torch.float16))

def rows(B, C, H, L, D, dtype, const=True, scale=1.0, gen=None):
    x = torch.zeros(B, C, H, L, D + 16, device=dev, dtype=torch.float32)
    x[..., :D] = torch.randn(B, C, H, L, D, device=dev, generator=gen) * scale
    x[..., D] = 1.0 if const else (torch.rand(B, C, H, L, device=dev, generator=gen) > 0.2).float()
    return x.to(dtype)

def image_scale(ux, uw, heads, coef):
    n = ux.shape[1] * ux.shape[3] * heads
    bound = n * ux.float().abs().amax().clamp_min(1) ** 2 * uw.float().abs().amax() * max(abs(coef[0]), abs(coef[1]), 2 * abs(coef[2]))
    return torch.exp2(torch.floor(torch.log2(2.0 ** 14 / bound))).reshape(1).float()

def new_linear(ux, uw, rx, rg, upd, rd, causal, reverse, second, cu, cr, r1_cols, want_r2):
    coef = [a * b for a, b in zip(cu, cr)]
    sc = image_scale(ux, uw, upd, coef)
    img = ops.lin_state(ux, uw, upd, causal, reverse, second, coef, sc)
    return ops.lin_read(rx, rg if want_r2 else None, img, rd, second, r1_cols, sc)

def ref(ux, uw, rx, rg, upd, rd, causal, reverse, second, cu, cr):
    c = [a * b for a, b in zip(cu, cr)]
    if not second: c[2] = 0.0
    ux, uw, rx, rg = (t.double() for t in (ux, uw, rx, rg))
    B, C, Hu, L, W = ux.shape; D = W - 16; Hr = rx.shape[2]; Hkv = Hu // upd
    r1 = torch.zeros_like(rx); r2 = torch.zeros(*rx.shape[:4], D, dtype=torch.float64, device=dev)
    for b in range(B):
        for kv in range(Hkv):
            U = ux[b, :, kv * upd:(kv + 1) * upd].reshape(C, upd * L, W)  # chunk, rows
            Wt = uw[b, :, kv * upd:(kv + 1) * upd].reshape(C, upd * L, W)
            for cc in range(C):
                vis = [j for j in range(C) if (not causal) or (j > cc if reverse else j < cc)]
                if not vis: continue
                Uv = U[vis].reshape(-1, W); Wv = Wt[vis].reshape(-1, W)
                X = rx[b, cc, kv * rd:(kv + 1) * rd]  # rd, L, W
                G = rg[b, cc, kv * rd:(kv + 1) * rd]
                dot = X[..., :D] @ Uv[:, :D].T
                f = c[0] * X[..., D:D + 1] * Uv[:, D] + c[1] * dot + c[2] * dot ** 2
                r1[b, cc, kv * rd:(kv + 1) * rd] = f @ Wv
                gw = G @ Wv.T  # rd, L, S
                df = c[1] + 2 * c[2] * dot
                r2[b, cc, kv * rd:(kv + 1) * rd] = (gw * df) @ Uv[:, :D]
    return r1, r2

torch.manual_seed(0)
gen = torch.Generator(device=dev).manual_seed(1)
fails = 0
cases = []
for D in (64, 128):
    for dtype in (torch.bfloat16, torch.float16):
        for causal, reverse in ((True, False), (True, True), (False, False)):
            for second in (True, False):
                for upd, rd in ((1, 2), (2, 1)):
                    cases.append((D, dtype, causal, reverse, second, upd, rd))
for D, dtype, causal, reverse, second, upd, rd in cases:
    B, C, L, Hkv = 2, 3, 128, 2
    ux = rows(B, C, Hkv * upd, L, D, dtype, const=upd == 1, scale=0.3, gen=gen)
    uw = rows(B, C, Hkv * upd, L, D, dtype, gen=gen)
    rx = rows(B, C, Hkv * rd, L, D, dtype, scale=0.3, gen=gen)
    rg = rows(B, C, Hkv * rd, L, D, dtype, gen=gen) * 0.01
    cu, cr = [1.0, 1.0, 1.0], [0.7, 0.5, 0.125]
    r1_cols = D + 8
    try:
        o1, o2 = ops.linear(ux, uw, rx, rg, upd, rd, causal, reverse, second, cu, cr, (D + 16) // 16, True)
        n1, n2 = new_linear(ux, uw, rx, rg, upd, rd, causal, reverse, second, cu, cr, r1_cols, True)
        torch.cuda.synchronize()
    except Exception as e:
        print("ERROR", D, dtype, causal, reverse, second, upd, rd, str(e)[:300]); fails += 1; continue
    f1, f2 = ref(ux, uw, rx, rg, upd, rd, causal, reverse, second, cu, cr)
    def err(a, b, cols):
        return ((a[..., :cols].double() - b[..., :cols]).abs().max() / b[..., :cols].abs().max().clamp_min(1e-30)).item()
    e = [err(o1, f1, D + 1), err(n1, f1, D + 1), err(o2, f2, D), err(n2, f2, D)]
    ok = e[1] <= 2 * e[0] + 1e-3 and e[3] <= 2 * e[2] + 1e-3
    fails += not ok
    print(f"{'ok ' if ok else 'BAD'} D{D} {str(dtype)[6:]:8s} causal={causal:d} rev={reverse:d} p2={second:d} upd={upd} rd={rd}"
          f"  R1 old {e[0]:.2e} new {e[1]:.2e}   R2 old {e[2]:.2e} new {e[3]:.2e}", flush=True)
print("FAILS", fails, "of", len(cases))

# Timing, b4 h8 d64 N16384 causal p=2 bf16.
def t(fn):  # median ms of 10 CUDA-event-timed runs after 2 warm-ups
    return statistics.median(time_ms(lambda i: fn(), 1, 2, 10, "cuda"))
for D in (64, 128):
    B, H, N = (4, 8, 16384) if D == 64 else (1, 32, 16384)
    for L in ((128,) if False else ()) + (512, 1024):
        C = N // L
        x, w, y, g = (rows(B, C, H, L, D, torch.bfloat16, scale=0.3, gen=gen) for _ in range(4))
        cu, cr = [1.0, 1.0, 1.0], [1.0, 0.125, 0.125 ** 2]
        coef = [a * b for a, b in zip(cu, cr)]
        sc = image_scale(x, w, 1, coef)
        img = ops.lin_state(x, w, 1, True, False, True, coef, sc)
        ts = t(lambda: ops.lin_state(x, w, 1, True, False, True, coef, sc))
        tr1 = t(lambda: ops.lin_read(y, None, img, 1, True, D + 8, sc))
        tr2 = t(lambda: ops.lin_read(y, g, img, 1, True, 0, sc))
        tr12 = t(lambda: ops.lin_read(y, g, img, 1, True, D, sc))
        nb = D // 16; F = 16 * (nb + 1 + 16 * nb * (nb + 1) // 2)
        fl = 2 * B * H * N * F * (D + 8)
        print(f"D{D} L{L}: state {ts:.3f} ms ({fl / ts / 1e9:.0f} TF)  read R1 {tr1:.3f} ({fl / tr1 / 1e9:.0f} TF)  "
              f"R2 {tr2:.3f} ({2 * B * H * N * F * 80 / tr2 / 1e9:.0f} TF)  R1+R2 {tr12:.3f}  image {img.numel() / 2**20:.0f} MiB", flush=True)
    if D == 64:
        L = 128; C = N // L
        x, w, y, g = (rows(B, C, H, L, D, torch.bfloat16, scale=0.3, gen=gen) for _ in range(4))
        told = t(lambda: ops.linear(x, w, y, None, 1, 1, True, False, True, [1.0] * 3, [1.0, 0.125, 0.0156], (D + 16) // 16, False))
        told2 = t(lambda: ops.linear(x, w, y, g, 1, 1, True, False, True, [1.0] * 3, [1.0, 0.125, 0.0156], 0, True))
        print(f"old sweep fwd (R1) {told:.3f} ms, dq (R2) {told2:.3f} ms")
