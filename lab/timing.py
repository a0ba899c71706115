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
