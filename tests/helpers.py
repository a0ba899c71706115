"""Shared by the training, DDP and compare tests: the tiny run's flags and small readers."""
import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ENWIK8_4MB = REPO.parent / "shared" / "data" / "enwik8-first4mb"
TINY = ["--config", str(REPO / "configs" / "tiny_cpu"), "--n_layer", "1", "--n_head", "2", "--n_embd", "32",
        "--seq_len", "32", "--batch_size", "4", "--warmup_iters", "2", "--lr", "3e-3", "--dropout", "0.1",
        "--eval_interval", "10", "--eval_max_windows", "4", "--final_eval_max_windows", "8",
        "--sample_tokens", "8", "--ckpt_interval", "10", "--device", "cpu", "--wandb-mode", "offline"]


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]
