"""Timing GPU work the way benchmark.py and the probes do: CUDA events around each repeat, after warm-up."""
from __future__ import annotations

import time

import torch


def time_ms(step, n_sets, warmup, repeats, device):
    """Per-repeat milliseconds, rotating through the input sets."""
    for i in range(warmup):
        step(i % n_sets)
    if device != "cuda":
        times = []
        for r in range(repeats):
            t0 = time.perf_counter()
            step(r % n_sets)
            times.append((time.perf_counter() - t0) * 1e3)
        return times
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(repeats)]
    for r, (start, end) in enumerate(events):
        start.record()
        step(r % n_sets)
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in events]


# Where a step's time goes, by the names of the kernels (on a GPU) or ops (on a CPU) that spend it: the first
# category whose substring a lowercased name contains. Our kernels live in namespace attn (attn_cuda ops).
CATEGORIES = (
    ("attention: ours", ("attn::", "attn_cuda")),
    ("attention: SDPA", ("flash", "fmha", "cudnn", "scaled_dot_product", "efficient_attention")),
    ("matmul", ("gemm", "nvjet", "cutlass", "xmma", "aten::mm", "aten::addmm", "aten::bmm", "aten::linear")),
    ("optimizer", ("adam", "multi_tensor", "foreach")),
    ("compiled (triton)", ("triton",)),
    ("norm, softmax, loss", ("norm", "softmax", "nll", "cross_entropy")),
    ("copy and cast", ("copy", "aten::to", "aten::cat", "contiguous", "clone", "index")),
)
OTHER = "other elementwise"


def category(name: str) -> str:
    low = name.lower()
    return next((cat for cat, keys in CATEGORIES if any(k in low for k in keys)), OTHER)


def profile_ops(step, steps: int, device: str, top: int = 12) -> dict:
    """step() run `steps` times (warm: call it before) under torch.profiler. Per step: the time the GPU's
    kernels took (on a CPU: the ops' own CPU time), by category and for the `top` costliest names, and the
    wall time between two synchronisations, whose excess over the kernels' is launch and Python overhead."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        if cuda:
            torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - t0) * 1e3 / steps
    rows = []
    for event in prof.key_averages():
        on_device = event.device_type == torch.autograd.DeviceType.CUDA
        if on_device == cuda:  # kernels on a GPU; ops on a CPU (their own time, so nested ops count once)
            ms = (event.self_device_time_total if cuda else event.self_cpu_time_total) / 1e3 / steps
            if ms > 0:
                rows.append((event.key, event.count / steps, ms))
    rows.sort(key=lambda r: -r[2])
    by_category = {}
    for name, _, ms in rows:
        cat = category(name)
        by_category[cat] = by_category.get(cat, 0.0) + ms
    return {"wall_ms": wall_ms, "busy_ms": sum(ms for _, _, ms in rows),
            "categories": dict(sorted(by_category.items(), key=lambda kv: -kv[1])),
            "top": [{"name": name[:120], "calls": calls, "ms": ms} for name, calls, ms in rows[:top]]}


def profile_table(profiles: dict) -> list[str]:
    """Markdown: a column per profiled case (name -> profile_ops' dict), ms per step and share, by category."""
    names = list(profiles)
    cats = list(dict.fromkeys(c for p in profiles.values() for c in p["categories"]))
    lines = ["| ms per step (share) | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    for cat in cats:
        cells = [f"{p['categories'].get(cat, 0.0):.2f} ({p['categories'].get(cat, 0.0) / p['busy_ms']:.0%})"
                 for p in profiles.values()]
        lines.append(f"| {cat} | " + " | ".join(cells) + " |")
    lines.append("| all kernels (ops on a CPU) | " + " | ".join(f"{p['busy_ms']:.2f}" for p in profiles.values()) + " |")
    lines.append("| wall time | " + " | ".join(f"{p['wall_ms']:.2f}" for p in profiles.values()) + " |")
    return lines
