"""Shared by the training, DDP, context-parallel and compare tests: the tiny run's flags, small readers, and
processes joined in a process group."""
import datetime
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[1]
ENWIK8_4MB = REPO.parent / "shared" / "data" / "enwik8-first4mb"
TINY = ["--config", str(REPO / "configs" / "tiny_cpu"), "--n_layer", "1", "--n_head", "2", "--n_embd", "32",
        "--seq_len", "32", "--batch_size", "4", "--warmup_iters", "2", "--lr", "3e-3", "--dropout", "0.1",
        "--eval_interval", "10", "--eval_max_windows", "4", "--final_eval_max_windows", "8",
        "--sample_tokens", "8", "--ckpt_interval", "10", "--device", "cpu", "--wandb-mode", "offline"]


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def spawn_group(fn, world: int, store: Path, *args, backend: str = "gloo") -> None:
    """fn(rank, world, *args) in world processes joined in one group (the default group): gloo on CPUs, or
    nccl with rank r on GPU r; a failure in any of them fails the caller."""
    mp.spawn(_group_worker, args=(world, str(store), backend, fn, args), nprocs=world)


def _group_worker(rank: int, world: int, store: str, backend: str, fn, args) -> None:
    torch.set_num_threads(1)  # up to 4 processes on 2 cores
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))  # a hung ring fails, not the whole run
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()
    if backend == "gloo":
        # Done: leave without finalizing Python. gloo's worker threads may still hold a finished collective's
        # tensors, whose release takes the GIL; if it comes while Python finalizes, the process aborts (seen after
        # PyTorch's ring, whose gradients travel by all_to_all; a barrier first only made it rarer).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


# The FlashAttention error rule (tests/test_cuda_kernels.py's docstring): atol times max(|reference|, 1).
ATOL = {torch.float16: 1e-3, torch.bfloat16: 2e-3, torch.float32: 2e-4}  # times max(|reference|, 1)


def rule_violation(kernel, torch_dt, ref, dtype):
    """None if the kernel's result obeys the error rule, else what is wrong."""
    kernel, torch_dt = kernel.double(), torch_dt.double()
    if not torch.isfinite(kernel).all():
        return "non-finite values (unwritten or NaN)"
    err_kernel = (kernel - ref).abs().max().item()
    err_torch = (torch_dt - ref).abs().max().item()
    atol = ATOL[dtype] * max(ref.abs().max().item(), 1.0)
    if err_kernel > 2 * err_torch + atol:
        return f"kernel error {err_kernel:.3g} > 2 x PyTorch {dtype} error {err_torch:.3g} + atol {atol:.2g}"
    return None


def poison_allocator():
    """Fill the CUDA caching allocator's free blocks, small and large pools, with NaN: a kernel's output that
    it leaves unwritten then reads as NaN, not as an earlier result."""
    blocks = [torch.full((2**17,), float("nan"), device="cuda") for _ in range(16)]
    blocks.append(torch.full((2**26,), float("nan"), device="cuda"))
    del blocks


def decode_step_ops(model, data: torch.Tensor, prefill: int) -> list[list]:
    """The operations (and their arguments' shapes) of each decode step of model over data after a prefill of
    `prefill` bytes: what a CUDA graph of one step (CapturedStep) needs to be the same at every position."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_map

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            # tensors by their shapes, everything else (a slice's start, say) as it is, NaN as a word (NaN != NaN)
            seen = tree_map(lambda a: tuple(a.shape) if isinstance(a, torch.Tensor) else "nan" if a != a else a,
                            (args, kwargs))
            self.ops.append((str(func), seen))
            return func(*args, **(kwargs or {}))

    cache = model.new_cache(data.shape[1])
    steps = []
    with torch.no_grad():
        model(data[:, :prefill], cache=cache)
        for t in range(prefill, data.shape[1]):
            byte = data[:, t:t + 1]
            with Record() as record:
                model(byte, cache=cache)
            steps.append(record.ops)
    return steps
