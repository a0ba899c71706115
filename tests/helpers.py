"""Shared by the training, DDP, context-parallel and compare tests: the tiny run's flags, small readers, and
processes joined over gloo."""
import datetime
import json
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


def spawn_gloo(fn, world: int, store: Path, *args) -> None:
    """fn(rank, world, *args) in world processes joined in one gloo group (the default group); a failure in
    any of them fails the caller."""
    mp.spawn(_gloo_worker, args=(world, str(store), fn, args), nprocs=world)


def _gloo_worker(rank: int, world: int, store: str, fn, args) -> None:
    torch.set_num_threads(1)  # up to 4 processes on 2 cores
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))  # a hung ring fails, not the whole run
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()
