"""Where fastmax's time goes at head dim 128 (issue 37): one forward+backward per form, causal p=2, bf16,
b4 h8, kernel by kernel (torch.profiler), against cuDNN's softmax on the same shapes; and the FLOPs the
linear form's state and read kernels do, to set each kernel's time against the tensor cores' rate.

    python scripts/probes/linear_d128.py [--seq-lens 16384,32768] [--dim-head 128] [--json PATH]

The linear form's GEMMs, per row and per call, from LinFeatures (csrc/linear/lin_sm90.cuh): features =
64 x tiles (first order in kFirstTiles, second order kSecond / 4 tiles), columns kDw = D + 8; lin_state
and lin_read's R1 each do 2 x features x kDw FLOPs a row, R2 the same plus its contraction with x.
"""
import argparse
import contextlib
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from anywhere: the repository root's packages

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from attention_cuda import _extension, fastmax_attention  # noqa: E402
from lab.timing import profile_ops, time_ms  # noqa: E402


def features(d: int) -> int:
    nb = d // 16
    first_tiles = (nb + 1 + 3) // 4
    return 64 * (first_tiles + 16 * nb * (nb + 1) // 2 // 4)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq-lens", default="16384,32768")
    ap.add_argument("--dim-head", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--json")
    args = ap.parse_args()
    assert _extension.unavailable_reason() is None, _extension.unavailable_reason()
    b, h, d = args.batch, args.heads, args.dim_head
    rows = []
    for n in (int(s) for s in args.seq_lens.split(",")):
        torch.manual_seed(0)
        q, k, v, do = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=i < 3)
                       for i in range(4))
        quad_tf = 4 * b * h * n * n * d / 2 / 1e12  # the causal forward, FlashAttention's convention
        per_row = 2 * features(d) * (d + 8) / 1e12
        calls = {
            "linear": lambda: fastmax_attention(q, k, v, causal=True, temperature=d**0.5, form="linear"),
            "quadratic": lambda: fastmax_attention(q, k, v, causal=True, temperature=d**0.5, form="quadratic"),
            "cudnn": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        }
        for name, fn in calls.items():
            ctx = (torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION) if name == "cudnn"
                   else contextlib.nullcontext())
            with ctx:
                for direction in ("fwd", "fwd+bwd"):
                    def step():
                        out = fn()
                        if direction == "fwd+bwd":
                            out.backward(do)
                    with torch.no_grad() if direction == "fwd" else torch.enable_grad():
                        ms = statistics.median(time_ms(lambda i: step(), 1, 2, 5, "cuda"))
                        prof = profile_ops(step, 2, "cuda", top=14)
                    row = {"n": n, "d": d, "impl": name, "direction": direction, "ms": ms,
                           "quadratic_tflop": quad_tf * (3.5 if direction == "fwd+bwd" else 1.0),
                           "linear_gemm_tflop_per_call": per_row * b * h * n, "top": prof["top"]}
                    rows.append(row)
                    print(f"\n== N {n} d{d} {name} {direction}: {ms:.2f} ms  (kernels {prof['busy_ms']:.2f})")
                    for t in prof["top"]:
                        print(f"   {t['ms']:8.3f} ms {t['calls']:5.1f}x  {t['name'][:110]}")
        print(f"\nN {n}: one state/R1 call = {per_row * b * h * n:.2f} TFLOP "
              f"({features(d)} features x {d + 8} columns); quadratic causal forward {quad_tf:.2f} TFLOP")
    if args.json:
        Path(args.json).write_text(json.dumps({"command": " ".join(sys.argv), "device": torch.cuda.get_device_name(),
                                               "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
