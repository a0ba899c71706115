"""Time our attention kernels against what users would pick instead, on the same inputs.

    python benchmark.py --preset seeds --json bench/results_seeds.json --plot bench/seeds.png
    python benchmark.py --family fastmax --causal --dim-head 64 --seq-lens 4096,16384
    python benchmark.py --device cpu --batch 1 --heads 2 --dim-head 16 --seq-lens 64,128   # smoke run

Per sequence length and implementation: median ms over CUDA-event-timed repeats after warm-up,
TFLOP/s in the FlashAttention convention, peak extra memory, and the ratio to a baseline.
bench/README.md explains every column and flag.
"""
from __future__ import annotations

import argparse
import gc
import inspect
import itertools
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import time
import warnings
from dataclasses import asdict, dataclass, replace
from functools import partial
from importlib import metadata
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from lab.timing import time_ms

PASSES = ("fwd", "bwd", "fwd+bwd")
PASS_FLOP_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}  # FlashAttention's convention
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
GIB = 2**30

COSINE_SCALE = 10.0  # the API defaults, so "ours" and the baselines compute the same function
EXP_SCALE = 8.0
FASTMAX_COEFFS = (1.0, 1.0, 0.5)  # p=2: 1 + x + x^2/2, the same Taylor polynomial as fla's "based"

SDPA_BACKENDS = {"flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION",
                 "efficient": "EFFICIENT_ATTENTION", "math": "MATH"}
FAMILY_IMPLS = {
    "cosine": ("ours", "ours-torch", "naive", "cupy-naive", *SDPA_BACKENDS, "fa3"),
    "exp": ("ours", "ours-torch", "naive", *SDPA_BACKENDS, "fa3"),
    "fastmax": ("ours-quadratic", "ours-linear", "ours-torch", "naive", "fla-parallel", "fla-chunk",
                *SDPA_BACKENDS, "fa3"),
}
DEFAULT_IMPLS = {
    "cosine": ("ours", "naive", "cupy-naive", "flash", "cudnn", "efficient"),
    "exp": ("ours", "naive", "flash", "cudnn", "efficient"),
    "fastmax": ("ours-quadratic", "ours-linear", "naive", "fla-parallel", "fla-chunk", "flash", "cudnn"),
}
CPU_DEFAULT_IMPLS = ("ours-torch", "naive", "math")
MATERIALISES_NN = ("naive", "cupy-naive")  # checked against free memory before they run
MAX_INPUT_SETS = 32

PRESETS = {
    "seeds": dict(family="cosine", batch=[4], heads=[8], dim_head=[64],
                  seq_lens=[2**i for i in range(7, 15)], causal=(False, True)),
    # one attention layer of OLMo-2 7B (32 heads), and of 32B / 70B (64 heads), head dim 128
    "olmo2": dict(family="cosine", batch=[1], heads=[32, 64], dim_head=[128], seq_lens=[4096],
                  causal=(False, True)),
    "fastmax-seeds": dict(family="fastmax", batch=[64], heads=[8], dim_head=[32, 64],
                          seq_lens=[1000, 10000], causal=(False, True), passes=("fwd",)),
    # the linear form against the quadratic one (the crossover) and against fla, causal, to N = 65536
    "fastmax-linear": dict(family="fastmax", batch=[4], heads=[8], dim_head=[32, 64],
                           seq_lens=[2**i for i in range(11, 17)], causal=(True,)),
}


class NotRun(Exception):
    """An implementation that cannot run on this case; the message is the reason shown in its row."""


@dataclass(frozen=True)
class Case:
    family: str
    batch: int
    heads: int
    kv_heads: int
    seq_len: int
    dim_head: int
    dtype: str
    causal: bool
    mask_prob: float | None
    device: str
    pass_: str = "fwd"


class InputSet(NamedTuple):
    qkv: tuple
    do: torch.Tensor


def attention_flops(batch, heads, seq_q, seq_k, dim_head, causal, pass_):
    """FLOPs of one attention call as FlashAttention counts them: two matmuls of 2·i·j·d each per head,
    half of that when causal, backward 2.5x forward. Masks and the linear form do not change the count."""
    fwd = 4 * batch * heads * seq_q * seq_k * dim_head / (2 if causal else 1)
    return fwd * PASS_FLOP_FACTOR[pass_]


def tflops(flops, ms):
    return flops / (ms * 1e9)


# ---------------------------------------------------------------------------------------------
# implementations: each builder returns fn(q, k, v) -> out for one case, or raises NotRun

def visibility(case, keep):
    """Bool, broadcastable to (b, h, n, n): True where a query sees a key; None when it sees them all."""
    vis = None
    if case.causal:
        vis = torch.ones(case.seq_len, case.seq_len, dtype=torch.bool, device=case.device).tril()
    if keep is not None:
        vis = keep[:, None, None, :] if vis is None else keep[:, None, None, :] & vis
    return vis


def build_ours(case, keep, backend, form=None):
    try:
        import attention_cuda
    except Exception as e:
        raise NotRun(f"attention_cuda does not import ({type(e).__name__}: {e})") from None
    a0, a1, a2 = FASTMAX_COEFFS
    function, options = {
        "cosine": (attention_cuda.cosine_sim_attention, dict(scale=COSINE_SCALE)),
        "exp": (attention_cuda.exp_attention, dict(scale=EXP_SCALE)),
        "fastmax": (attention_cuda.fastmax_attention, dict(p=2, a0=a0, a1=a1, a2=a2, temperature=case.dim_head**0.5,
                                                            **({} if form is None else {"form": form}))),
    }[case.family]
    return partial(function, causal=case.causal, mask=keep, backend=backend, **options)


def build_naive(case, keep):
    """The seeds' baseline: the textbook formula, materialising every N×N score in PyTorch."""
    vis = visibility(case, keep)
    hidden = None if vis is None else ~vis
    a0, a1, a2 = FASTMAX_COEFFS
    temperature = case.dim_head**0.5

    def naive(q, k, v):
        groups = q.shape[1] // k.shape[1]
        if groups > 1:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        if case.family == "cosine":
            x = COSINE_SCALE * (F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-2, -1))
            if hidden is not None:
                x = x.masked_fill(hidden, float("-inf"))
            return torch.softmax(x, dim=-1) @ v
        x = q @ k.transpose(-2, -1)
        if case.family == "exp":
            a = torch.exp(EXP_SCALE * x)
        else:
            x = x / temperature
            a = a0 + a1 * x + a2 * x * x
        if hidden is not None:
            a = a.masked_fill(hidden, 0.0)
        out = a @ v
        return out if case.family == "exp" else out / a.sum(dim=-1, keepdim=True)

    return naive


def build_sdpa(case, keep, backend):
    """torch SDPA pinned to one backend: softmax on l2-normalised q/k with scale 10 == cosine-sim;
    for exp and fastmax it is plain softmax attention, a reference point, not the same function."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    which = getattr(SDPBackend, SDPA_BACKENDS[backend])
    attn_mask = None if keep is None else visibility(case, keep)  # SDPA takes is_causal or a mask, not both
    is_causal = case.causal and keep is None
    cosine = case.family == "cosine"
    gqa = case.kv_heads != case.heads

    def sdpa(q, k, v):
        if cosine:  # inside the timed region: a user of SDPA pays for the normalisation too
            q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
        with sdpa_kernel(which):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal,
                                                  scale=COSINE_SCALE if cosine else None, enable_gqa=gqa)

    return sdpa


def build_fa3(case, keep):
    """FlashAttention-3 (`flash_attn_interface`, built from its hopper/ directory; not on PyPI): softmax on
    l2-normalised q/k with scale 10 == cosine-sim, as for SDPA. It takes (b, n, h, d), so it is given
    transposed views of our (b, h, n, d) inputs, whose strides its TMA loads take as they are."""
    if case.device != "cuda":
        raise NotRun("FlashAttention-3 runs on CUDA devices only")
    if keep is not None:
        raise NotRun("FlashAttention-3 takes no key-padding mask")
    try:
        from flash_attn_interface import flash_attn_func
    except Exception as e:
        raise NotRun(f"flash_attn_interface does not import ({type(e).__name__}: {e})") from None
    cosine = case.family == "cosine"

    def fa3(q, k, v):
        if cosine:  # inside the timed region, as for SDPA
            q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
        out = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                              softmax_scale=COSINE_SCALE if cosine else None, causal=case.causal)
        return out.transpose(1, 2)

    return fa3


def build_cupy_naive(case, keep):
    """The naive cosine formula in CuPy (forward only). exp(scale·(q̂·k̂ - 1)) <= 1, so no row max."""
    if case.pass_ != "fwd":
        raise NotRun("the CuPy baseline has no backward")
    if case.device != "cuda":
        raise NotRun("CuPy needs a CUDA device")
    if case.dtype == "bf16":
        raise NotRun("CuPy has no bfloat16")
    try:
        import cupy
    except Exception as e:
        raise NotRun(f"cupy does not import ({type(e).__name__}: {e})") from None

    def alloc_from_torch(size):
        # CuPy's arrays then live in torch's caching allocator: its peak counter sees them, and
        # empty_cache() returns them, as for every other implementation
        block = torch.empty(size, dtype=torch.uint8, device="cuda")
        return cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(block.data_ptr(), size, block), 0)

    cupy.cuda.set_allocator(alloc_from_torch)
    vis = visibility(case, keep)
    vis = None if vis is None else cupy.from_dlpack(vis.to(torch.uint8)).astype(bool)

    # torch and CuPy both launch on the legacy default stream here, so torch's events time CuPy's kernels
    def cupy_naive(q, k, v):
        q, k, v = (cupy.from_dlpack(t.detach()) for t in (q, k, v))
        groups = q.shape[1] // k.shape[1]
        if groups > 1:
            k, v = cupy.repeat(k, groups, axis=1), cupy.repeat(v, groups, axis=1)
        q = q / cupy.sqrt((q * q).sum(axis=-1, keepdims=True))
        k = k / cupy.sqrt((k * k).sum(axis=-1, keepdims=True))
        a = cupy.exp(COSINE_SCALE * (q @ k.swapaxes(-1, -2) - 1))
        if vis is not None:
            a = cupy.where(vis, a, 0)
        return torch.from_dlpack((a @ v) / a.sum(axis=-1, keepdims=True))

    return cupy_naive


def build_fla(case, keep, chunked):
    """flash-linear-attention's Triton "based" kernels: causal 1 + x + x²/2 with x = scale·q·k.
    We pass scale = d^-0.5 = 1/temperature of ours, so both compute the same function."""
    if case.device != "cuda":
        raise NotRun("fla based kernels are Triton kernels and run on CUDA devices only")
    if not case.causal:
        raise NotRun("fla based kernels are causal only")
    if keep is not None:
        raise NotRun("fla based kernels take no key-padding mask")
    if case.kv_heads != case.heads:
        raise NotRun("fla based kernels take no grouped KV")
    if chunked and case.dim_head > 16:
        raise NotRun("fla fused_chunk_based only accepts d <= 16")
    try:
        from fla.ops.based import fused_chunk_based, parallel_based
    except Exception as e:
        raise NotRun(f"fla does not import ({type(e).__name__}: {e})") from None
    fn = fused_chunk_based if chunked else parallel_based
    params = tuple(inspect.signature(fn).parameters)
    # fla 0.6.0 takes (batch, time, heads, dim); other versions changed layouts, so check, not guess
    if params != ("q", "k", "v", "scale", "use_norm"):
        raise NotRun(f"fla {fn.__name__}{params} is not 0.6.0's (q, k, v, scale, use_norm)")
    scale = case.dim_head**-0.5

    def fla_based(q, k, v):
        out = fn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=scale)
        return out.transpose(1, 2)

    return fla_based


BUILDERS = {
    "ours": partial(build_ours, backend="cuda"),
    "ours-quadratic": partial(build_ours, backend="cuda", form="quadratic"),
    "ours-linear": partial(build_ours, backend="cuda", form="linear"),
    "ours-torch": partial(build_ours, backend="torch"),
    "naive": build_naive,
    "cupy-naive": build_cupy_naive,
    "fla-parallel": partial(build_fla, chunked=False),
    "fla-chunk": partial(build_fla, chunked=True),
    "fa3": build_fa3,
    **{name: partial(build_sdpa, backend=name) for name in SDPA_BACKENDS},
}


# ---------------------------------------------------------------------------------------------
# inputs, timing, memory

def input_set_count(case):
    """Enough input sets to span twice the L2 cache, so a repeat does not find its inputs cached."""
    if case.device != "cuda":
        return 1
    itemsize = DTYPES[case.dtype].itemsize
    set_bytes = 2 * (case.heads + case.kv_heads) * case.batch * case.seq_len * case.dim_head * itemsize
    l2_bytes = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
    return min(MAX_INPUT_SETS, max(1, math.ceil(2 * l2_bytes / set_bytes)))


def make_inputs(case, n_sets, gen):
    """Fresh random q, k, v, dO (never zeros) and, with --mask-prob, a random key-padding mask."""
    b, n, d = case.batch, case.seq_len, case.dim_head
    # exp has no normalisation: keep its logits scale·q·k near unit spread, so exp() stays finite
    qk_std = (EXP_SCALE * d**0.5) ** -0.5 if case.family == "exp" else 1.0

    def randn(heads, std=1.0):
        return torch.randn(b, heads, n, d, generator=gen, device=case.device, dtype=DTYPES[case.dtype]) * std

    sets = [InputSet(tuple(t.requires_grad_() for t in (randn(case.heads, qk_std),
                                                         randn(case.kv_heads, qk_std),
                                                         randn(case.kv_heads))),
                     randn(case.heads))
            for _ in range(n_sets)]
    keep = None
    if case.mask_prob is not None:
        keep = torch.rand(b, n, generator=gen, device=case.device) >= case.mask_prob
        keep[:, 0] = True  # every query keeps a key; the baselines would return NaN for an empty row
    return sets, keep


def make_step(fn, pass_, sets):
    """The timed region, run on input set i."""
    if pass_ == "fwd":
        def step(i):
            with torch.no_grad():
                return fn(*sets[i].qkv)
    elif pass_ == "fwd+bwd":
        def step(i):
            s = sets[i]
            return torch.autograd.grad(fn(*s.qkv), s.qkv, s.do)
    else:
        outs = [fn(*s.qkv) for s in sets]  # untimed forwards; their graphs are kept for every repeat

        def step(i):
            return torch.autograd.grad(outs[i], sets[i].qkv, sets[i].do, retain_graph=True)
    return step


def check_nn_fits(case, n_sets):
    """Skip a baseline that materialises N×N scores when they cannot fit (a rough count of copies)."""
    if case.device != "cuda":
        return
    copies = {"fwd": 2, "fwd+bwd": 4, "bwd": 2 * n_sets + 2}[case.pass_]
    need = copies * case.batch * case.heads * case.seq_len**2 * DTYPES[case.dtype].itemsize
    free = torch.cuda.mem_get_info()[0] + torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
    if need > 0.9 * free:
        raise NotRun(f"materialises N×N scores: needs ~{need / GIB:.0f} GiB, {free / GIB:.0f} GiB free")


def first_run(step, device):
    """Run once: surfaces errors before timing, checks the result is finite, measures peak extra memory
    (what the timed region allocates beyond what existed before it)."""
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    result = step(0)
    mem_gib = None
    if device == "cuda":
        torch.cuda.synchronize()
        mem_gib = (torch.cuda.max_memory_allocated() - base) / GIB
    outs = result if isinstance(result, tuple) else (result,)
    if not all(bool(torch.isfinite(t).all()) for t in outs):
        raise NotRun("produced NaN or inf on random inputs")
    return mem_gib


def error_reason(e, caught):
    """One line: the exception, plus the warnings that explain it (SDPA says why it refused there)."""
    reason = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"
    why = dict.fromkeys(str(w.message).split(" (Triggered internally")[0].strip() for w in caught)
    return "; ".join([reason[:200], *why])


def case_fields(case):
    fields = asdict(case)
    fields["pass"] = fields.pop("pass_")
    return fields


def measure(name, case, sets, keep, args):
    row = dict(impl=name, **case_fields(case), ms=None, ms_q1=None, ms_q3=None, tflops=None,
               mem_gib=None, repeats=args.repeats, not_run=None, baseline=None, vs_baseline=None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            if name in MATERIALISES_NN:
                check_nn_fits(case, len(sets))
            fn = BUILDERS[name](case, keep)
            step = make_step(fn, case.pass_, sets)
            mem_gib = first_run(step, case.device)
            times = time_ms(step, len(sets), args.warmup, args.repeats, case.device)
            q1, ms, q3 = (float(t) for t in np.percentile(times, [25, 50, 75]))
            flops = attention_flops(case.batch, case.heads, case.seq_len, case.seq_len, case.dim_head,
                                    case.causal, case.pass_)
            row.update(ms=ms, ms_q1=q1, ms_q3=q3, tflops=tflops(flops, ms), mem_gib=mem_gib)
        except NotRun as e:
            row["not_run"] = str(e)
        except Exception as e:  # an OOM or a refusal in one implementation must not end the sweep
            row["not_run"] = error_reason(e, caught)
        finally:
            fn = step = None  # drop graphs and outputs before freeing the cache
            gc.collect()
            if case.device == "cuda":
                torch.cuda.empty_cache()
    if row["not_run"] is None:
        for message in dict.fromkeys(str(w.message) for w in caught):
            print(f"warning from {name}: {message}", file=sys.stderr)
    return row


def attach_baseline(rows, choice):
    """Fill baseline and vs_baseline (= ms / baseline ms; < 1 is faster) for rows of one case."""
    measured = [r for r in rows if r["ms"] is not None]
    if choice == "sdpa":
        candidates = [r for r in measured if r["impl"] in SDPA_BACKENDS]
    else:
        candidates = [r for r in measured if r["impl"] == choice]
    if not candidates:
        return
    base = min(candidates, key=lambda r: r["ms"])
    for r in rows:
        r["baseline"] = base["impl"]
        if r["ms"] is not None:
            r["vs_baseline"] = r["ms"] / base["ms"]


# ---------------------------------------------------------------------------------------------
# output

def describe(row):
    mask = "" if row["mask_prob"] is None else f" mask_prob={row['mask_prob']}"
    return (f"{row['family']} {row['pass']} b={row['batch']} h={row['heads']} kv={row['kv_heads']} "
            f"d={row['dim_head']} {row['dtype']} {'causal' if row['causal'] else 'non-causal'}{mask}")


def _num(x, fmt):
    return "n/a" if x is None else format(x, fmt)


def print_tables(rows, args):
    for pass_ in args.passes:
        prs = [r for r in rows if r["pass"] == pass_]
        base = "fastest SDPA backend" if args.baseline == "sdpa" else args.baseline
        print(f"\n== {describe(prs[0])} | baseline: {base}")
        print(f"{'seq_len':>7} | {'impl':<14} | {'ms':>9} | {'TFLOP/s':>8} | {'extra GiB':>9} | vs baseline")
        for r in prs:
            head = f"{r['seq_len']:>7} | {r['impl']:<14} | "
            if r["not_run"] is not None:
                print(head + f"not run: {r['not_run']}")
                continue
            ratio = "n/a" if r["vs_baseline"] is None else f"{r['vs_baseline']:.2f}x {r['baseline']}"
            print(head + f"{r['ms']:>9.3f} | {r['tflops']:>8.2f} | {_num(r['mem_gib'], '.3f'):>9} | {ratio}")
        for kernel in (i for i in args.impls if i.startswith("ours")):
            print(f"\n{kernel} vs baseline ({describe(prs[0])})")
            print("seq_len | slower: x | kernel ms | baseline ms | kernel TFLOP/s | baseline TFLOP/s "
                  "| kernel GiB | baseline GiB | baseline")
            for n in args.seq_lens:
                here = [r for r in prs if r["seq_len"] == n]
                k = next(r for r in here if r["impl"] == kernel)
                if k["not_run"] is not None:
                    print(f"{n:>7} | not run: {k['not_run']}")
                    continue
                b = next((r for r in here if r["impl"] == k["baseline"]), None)
                if b is None:
                    print(f"{n:>7} | no baseline measured | {k['ms']:.3f} ms")
                    continue
                print(f"{n:>7} | {k['vs_baseline']:>9.2f} | {k['ms']:>9.3f} | {b['ms']:>11.3f} "
                      f"| {k['tflops']:>14.2f} | {b['tflops']:>16.2f} | {_num(k['mem_gib'], '.3f'):>10} "
                      f"| {_num(b['mem_gib'], '.3f'):>12} | {b['impl']}")
    sys.stdout.flush()


def environment(device, argv):
    def version(dist):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    try:
        git = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=Path(__file__).parent,
                             capture_output=True, text=True).stdout.strip() or None
    except OSError:  # no git on this machine
        git = None
    env = dict(command=shlex.join(["python", "benchmark.py", *argv]), date=time.strftime("%Y-%m-%d %H:%M:%S"),
               git=git, python=platform.python_version(), torch=torch.__version__,
               cuda=torch.version.cuda, device=device, triton=version("triton"),
               fla=version("flash-linear-attention"), fa3=version("flash_attn_3"))
    if device == "cuda":
        env.update(gpu=torch.cuda.get_device_name(), cudnn=torch.backends.cudnn.version(),
                   matmul_tf32=torch.backends.cuda.matmul.allow_tf32)
        try:
            import cupy
            env["cupy"] = cupy.__version__
        except Exception:
            env["cupy"] = None
    else:
        env.update(cpu=platform.processor() or platform.machine(), threads=torch.get_num_threads(),
                   note="CPU timings are a smoke test of benchmark.py, not performance claims")
    return env


def write_json(path, env, rows):
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(dict(environment=env, measurements=rows), indent=1) + "\n")
    os.replace(tmp, path)  # a sweep cut short leaves the last complete file, never half of one


def plot(path, rows, metric):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = {}
    for r in rows:
        if r["ms"] is not None:
            panels.setdefault(describe(r), {}).setdefault(r["impl"], []).append((r["seq_len"], r[metric]))
    if not panels:
        print(f"--plot {path}: nothing was measured, no plot written")
        return
    cols = min(3, len(panels))
    rows_of_panels = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows_of_panels, cols, figsize=(5.5 * cols, 4 * rows_of_panels), squeeze=False)
    for ax, (title, lines) in zip(axes.flat, panels.items()):
        for impl, points in lines.items():
            xs, ys = zip(*sorted(points))
            ax.plot(xs, ys, marker="o", label=impl)
        ax.set_xscale("log", base=2)
        ax.set(title=title, xlabel="seq_len", ylabel="ms (median)" if metric == "ms" else "TFLOP/s")
        ax.title.set_fontsize(8)
        ax.legend(fontsize=7)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# command line

def _int_at_least(text, minimum):
    if not text.strip().isdigit() or int(text) < minimum:
        raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}")
    return int(text)


def positive_int(text):
    return _int_at_least(text, 1)


def non_negative_int(text):
    return _int_at_least(text, 0)


def int_list(text):
    try:
        return [positive_int(x) for x in text.split(",")]
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated positive integers, got {text!r}") from None


def probability(text):
    try:
        p = float(text)
    except ValueError:
        p = -1.0
    if not 0 <= p < 1:
        raise argparse.ArgumentTypeError(f"expected a drop probability in [0, 1), got {text!r}")
    return p


def build_parser():
    all_impls = sorted(set(itertools.chain(*FAMILY_IMPLS.values())))
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=PRESETS, help="a named sweep; other flags override its fields")
    p.add_argument("--family", choices=FAMILY_IMPLS, default="cosine")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu: a smoke run of this script, timed with perf_counter")
    p.add_argument("--dtype", choices=DTYPES, default="bf16")
    p.add_argument("--batch", type=int_list, default=[4], help="comma list")
    p.add_argument("--heads", type=int_list, default=[8], help="query heads, comma list")
    p.add_argument("--kv-heads", type=positive_int, help="key/value heads (grouped KV); default = heads")
    p.add_argument("--dim-head", type=int_list, default=[64], help="comma list")
    p.add_argument("--seq-lens", type=int_list, default=[1024, 2048, 4096, 8192], help="comma list")
    p.add_argument("--causal", action="store_const", const=(True,), default=(False,))
    p.add_argument("--mask-prob", type=probability,
                   help="random key-padding mask dropping each key with this probability")
    only = p.add_mutually_exclusive_group()
    only.add_argument("--only-forwards", dest="passes", action="store_const", const=("fwd",))
    only.add_argument("--only-backwards", dest="passes", action="store_const", const=("bwd",),
                      help="time the backward alone, on a retained forward graph")
    p.set_defaults(passes=PASSES)
    p.add_argument("--impls", help=f"comma list from: {', '.join(all_impls)}")
    p.add_argument("--baseline", default="sdpa",
                   choices=["sdpa", *(i for i in all_impls if not i.startswith("ours"))],
                   help="the ratio's denominator; sdpa = the fastest SDPA backend measured for that case")
    p.add_argument("--repeats", type=positive_int, help="timed repeats (default 30 on cuda, 3 on cpu)")
    p.add_argument("--warmup", type=non_negative_int, help="untimed runs first (default 5 on cuda, 1 on cpu)")
    p.add_argument("--seed", type=non_negative_int, default=0)
    p.add_argument("--json", help="write every measurement with its config and the environment here")
    p.add_argument("--plot", help="write a PNG of --plot-metric against seq_len here")
    p.add_argument("--plot-metric", choices=("tflops", "ms"), default="tflops")
    return p


def parse_args(argv):
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.preset is not None:
        parser.set_defaults(**PRESETS[args.preset])
        args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA GPU is visible (use --device cpu for a smoke run)")
    if args.kv_heads is not None and any(h % args.kv_heads for h in args.heads):
        parser.error(f"--kv-heads {args.kv_heads}: must divide every --heads value {args.heads}")
    known = FAMILY_IMPLS[args.family]
    if args.impls is None:
        args.impls = list(DEFAULT_IMPLS[args.family] if args.device == "cuda" else CPU_DEFAULT_IMPLS)
    else:
        args.impls = list(dict.fromkeys(args.impls.split(",")))
        unknown = [i for i in args.impls if i not in known]
        if unknown:
            parser.error(f"--impls: {unknown} not implementations of --family {args.family}; "
                         f"expected some of {', '.join(known)}")
    if args.baseline != "sdpa" and args.baseline not in args.impls:
        parser.error(f"--baseline {args.baseline}: add it to --impls (running: {', '.join(args.impls)})")
    if args.repeats is None:
        args.repeats = 30 if args.device == "cuda" else 3
    if args.warmup is None:
        args.warmup = 5 if args.device == "cuda" else 1
    return args


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    env = environment(args.device, argv)
    print(f"# {env['command']}")
    print(f"# torch {env['torch']} cuda {env['cuda']} on {env.get('gpu') or env.get('cpu')}")
    if args.device == "cpu":
        print(f"# {env['note']}")
    if args.family == "fastmax":
        print("# fastmax: temperature = sqrt(d) (fla: scale = d^-0.5), so ours, naive and fla compute the "
              "same function; TFLOP/s counts the quadratic form's FLOPs for every implementation")
    gen = torch.Generator(device=args.device).manual_seed(args.seed)
    rows = []
    shapes = itertools.product(args.batch, args.heads, args.dim_head, args.causal)
    for batch, heads, dim_head, causal in shapes:
        group = []
        for seq_len in args.seq_lens:
            case = Case(args.family, batch, heads, args.kv_heads or heads, seq_len, dim_head, args.dtype,
                        causal, args.mask_prob, args.device)
            n_sets = input_set_count(case)
            sets, keep = make_inputs(case, n_sets, gen)
            for pass_ in args.passes:
                here = [measure(name, replace(case, pass_=pass_), sets, keep, args) for name in args.impls]
                attach_baseline(here, args.baseline)
                group += here
            del sets, keep
        print_tables(group, args)
        rows += group
        if args.json:
            write_json(args.json, env, rows)
    if args.plot:
        plot(args.plot, rows, args.plot_metric)
    return rows


if __name__ == "__main__":
    main()
