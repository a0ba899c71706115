"""train.py under torchrun: two CPU processes over gloo, as the GPU runs use NCCL."""
import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lab.config import TrainConfig
from lab.steps import evaluate
from data import RandomWindowSampler, load_enwik8
from model import GPT
from helpers import REPO, TINY, read_jsonl

# One micro-step per rank and step; 10 final eval windows in batches of 4, 4 and 2 give rank 0 six
# windows and rank 1 four, so a mean of the ranks' means would differ from the exact value.
DDP_ARGS = ["--grad_accum_steps", "2", "--eval_interval", "5", "--final_eval_max_windows", "10",
            "--wandb-mode", "disabled"]


def torchrun(data_path: str, out: Path, *args: str, wait: bool = True, **env):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               str(REPO / "train.py"), *TINY, *DDP_ARGS, "--data-path", data_path, "--out_dir", str(out), *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_SILENT="true", **env)
    if not wait:
        return subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def first_step_losses(cfg: TrainConfig, train_split) -> list[float]:
    """Each rank's loss on its first batch as main() computes it: rank 0's initial weights (DDP broadcasts
    them), each rank's own dropout RNG (seeded with seed + rank before its model was built)."""
    torch.manual_seed(cfg.seed)
    weights = GPT(cfg.model_config()).state_dict()
    losses = []
    for rank in range(2):
        torch.manual_seed(cfg.seed + rank)
        model = GPT(cfg.model_config())
        model.load_state_dict(weights)
        x, y = RandomWindowSampler(train_split, cfg.batch_size, cfg.seq_len, cfg.seed, rank, 2).next_batch()
        losses.append(model(x, y)[1].item())
    return losses


def train_rows(run_dir: Path) -> list[tuple]:
    return [(r["step"], r["train/loss"], r["grad_norm"]) for r in read_jsonl(run_dir / "metrics.jsonl")
            if "train/loss" in r]


@pytest.mark.slow
def test_two_processes_train_log_once_evaluate_exactly_and_resume_exactly(tmp_path, data_path):
    out = tmp_path / "out"
    torchrun(data_path, out, "--run_name", "straight", "--max_iters", "10", "--wandb-mode", "offline",
             WANDB_DIR=str(tmp_path))
    run_dir = out / "straight"
    rows = read_jsonl(run_dir / "metrics.jsonl")
    losses = [loss for _, loss, _ in train_rows(run_dir)]
    assert [s for s, *_ in train_rows(run_dir)] == list(range(1, 11))  # rank 0 alone writes: each step once
    assert [r["step"] for r in rows if "val/bpc" in r] == [5, 10]
    assert len(list((tmp_path / "wandb").glob("offline-run-*"))) == 1
    assert all(math.isfinite(loss) for loss in losses)
    assert sum(losses[-3:]) < sum(losses[:3])

    cfg = TrainConfig(**json.loads((run_dir / "config.json").read_text()))
    splits = load_enwik8(data_path, log=lambda *_: None)
    rank_losses = first_step_losses(cfg, splits["train"])
    assert abs(rank_losses[0] - rank_losses[1]) > 1e-3  # the ranks drew different windows...
    assert losses[0] == pytest.approx(sum(rank_losses) / 2, rel=1e-5)  # ...and the logged loss is their mean

    ckpt = torch.load(run_dir / "ckpt.pt", weights_only=False)
    assert (ckpt["step"], ckpt["world_size"], len(ckpt["rng"]), ckpt["sampler"]["batches_drawn"]) == (10, 2, 2, 10)
    model = GPT(cfg.model_config())
    model.load_state_dict(ckpt["model"])
    loss, curve = evaluate(model, splits["val"], cfg, torch.device("cpu"), contextlib.nullcontext(),
                                 cfg.final_eval_max_windows)
    final = [r for r in rows if "val/bpc" in r][-1]
    assert final["val/loss"] == pytest.approx(loss, rel=1e-6)
    assert [p for p, _ in final["val/bpc_by_position"]] == [p for p, _ in curve]
    assert [b for _, b in final["val/bpc_by_position"]] == pytest.approx([b for _, b in curve], rel=1e-6)

    torchrun(data_path, out, "--run_name", "split", "--max_iters", "5", "--lr_decay_iters", "10")
    torchrun(data_path, out, "--run_name", "split", "--max_iters", "10", "--resume", "auto")
    assert train_rows(out / "split") == train_rows(run_dir)  # bit for bit, dropout included


@pytest.mark.slow
def test_a_signal_to_one_rank_stops_all_after_the_same_step(tmp_path, data_path):
    out = tmp_path / "out"
    proc = torchrun(data_path, out, "--run_name", "r", "--max_iters", "100000", "--eval_interval", "100000",
                    wait=False)
    metrics = out / "r" / "metrics.jsonl"
    deadline = time.monotonic() + 60
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
        time.sleep(0.1)
    workers = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
    (rank1,) = [pid for pid in workers if b"RANK=1" in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")]
    os.kill(int(rank1), signal.SIGTERM)
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode != 0  # torchrun reports the workers' exit code 130 as a failure
    assert "stopped by a signal to another rank" in output, output
    ckpt = torch.load(out / "r" / "ckpt.pt", weights_only=False)
    assert ckpt["step"] == read_jsonl(metrics)[-1]["step"]


def test_grad_accum_steps_must_be_a_multiple_of_the_world_size(run, monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit) as exc:
        run("--grad_accum_steps", "3")
    assert exc.value.code == 2
    assert "grad_accum_steps: expected a multiple of WORLD_SIZE=2" in capsys.readouterr().err


def test_resume_refuses_another_world_size(run, monkeypatch, capsys):
    assert run("--max_iters", "2", "--grad_accum_steps", "2", "--run_name", "r", "--wandb-mode", "disabled") == 0
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit) as exc:
        run("--max_iters", "2", "--grad_accum_steps", "2", "--run_name", "r", "--resume", "auto")
    assert exc.value.code == 2
    assert "written by a run of 1 process(es), this one has WORLD_SIZE=2" in capsys.readouterr().err


@pytest.mark.gpu
def test_two_gpus_over_nccl(tmp_path, data_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    out = tmp_path / "out"
    torchrun(data_path, out, "--run_name", "r", "--max_iters", "10", "--device", "cuda")
    rows = read_jsonl(out / "r" / "metrics.jsonl")
    assert [s for s, *_ in train_rows(out / "r")] == list(range(1, 11))
    assert all(math.isfinite(loss) for _, loss, _ in train_rows(out / "r"))
    cfg = TrainConfig(**json.loads((out / "r" / "config.json").read_text()))
    ckpt = torch.load(out / "r" / "ckpt.pt", weights_only=False)
    assert (ckpt["world_size"], len(ckpt["rng"])) == (2, 2) and all(r["cuda"] is not None for r in ckpt["rng"])
    device = torch.device("cuda", 0)
    model = GPT(cfg.model_config()).to(device)
    model.load_state_dict(ckpt["model"])
    loss, _ = evaluate(model, load_enwik8(data_path, log=lambda *_: None)["val"], cfg, device,
                             torch.autocast("cuda", dtype=torch.bfloat16), cfg.final_eval_max_windows)
    assert [r for r in rows if "val/loss" in r][-1]["val/loss"] == pytest.approx(loss, rel=1e-4)


# Dropout off: the single process draws its masks over whole windows, the context group over slices.
CONTEXT_ARGS = ["--context-parallel", "2", "--dropout", "0", "--max_iters", "6", "--eval_interval", "3"]


def eval_rows(run_dir: Path) -> list[tuple]:
    return [(r["step"], r["val/loss"], r["val/bpc_by_position"]) for r in read_jsonl(run_dir / "metrics.jsonl")
            if "val/loss" in r]


@pytest.mark.slow
@pytest.mark.parametrize("family", ["cosine", "fastmax"])
def test_a_context_group_of_two_trains_and_evaluates_as_one_process(family, tmp_path, data_path, run):
    """Two processes splitting each window train as one process on the same batches: the same losses step by
    step (so the same gradients), the same evaluations, bpc by position included."""
    torchrun(data_path, tmp_path / "out", "--run_name", "cp", "--attention", family, *CONTEXT_ARGS)
    assert run(*DDP_ARGS, "--run_name", "single", "--attention", family, *CONTEXT_ARGS[2:]) == 0
    got, expected = tmp_path / "out" / "cp", run.out / "single"
    assert [s for s, *_ in train_rows(got)] == list(range(1, 7))
    for column in (1, 2):  # the loss, the gradient norm
        assert [r[column] for r in train_rows(got)] == pytest.approx([r[column] for r in train_rows(expected)], rel=1e-5)
    assert [(s, p) for s, _, curve in eval_rows(got) for p, _ in curve] == \
           [(s, p) for s, _, curve in eval_rows(expected) for p, _ in curve]
    for (_, loss, curve), (_, loss_1, curve_1) in zip(eval_rows(got), eval_rows(expected), strict=True):
        assert loss == pytest.approx(loss_1, rel=1e-5)
        assert [b for _, b in curve] == pytest.approx([b for _, b in curve_1], rel=1e-5)


@pytest.mark.slow
def test_a_context_parallel_run_resumes_exactly(tmp_path, data_path):
    out = tmp_path / "out"
    torchrun(data_path, out, "--run_name", "straight", "--attention", "cosine", *CONTEXT_ARGS)
    torchrun(data_path, out, "--run_name", "split", "--attention", "cosine", *CONTEXT_ARGS, "--max_iters", "3",
             "--lr_decay_iters", "6")
    torchrun(data_path, out, "--run_name", "split", *CONTEXT_ARGS, "--resume", "auto")
    ckpt = torch.load(out / "split" / "ckpt.pt", weights_only=False)
    assert (ckpt["step"], ckpt["world_size"], ckpt["config"]["context_parallel"]) == (6, 2, 2)
    assert train_rows(out / "split") == train_rows(out / "straight")


@pytest.mark.parametrize("world, args, message", [
    ("3", ["--attention", "cosine", "--context-parallel", "2"],
     "context_parallel: expected a divisor of WORLD_SIZE=3 (the processes split into groups of context_parallel), "
     "got 2"),
    ("4", ["--attention", "cosine", "--context-parallel", "2", "--grad_accum_steps", "3"],
     "grad_accum_steps: expected a multiple of WORLD_SIZE / context_parallel = 4 / 2"),
    ("2", ["--attention", "softmax", "--context-parallel", "2"],
     "context_parallel 2: device: softmax across ranks runs on PyTorch's context-parallel SDPA, whose ring takes "
     "SDPA's flash and cuDNN kernels, on cuda; got cpu"),
    ("2", ["--attention", "softmax", "--context-parallel", "2", "--sdpa_backend", "math"],
     "context_parallel 2: sdpa_backend: softmax across ranks runs on PyTorch's context-parallel SDPA"),
    ("2", ["--attention", "cosine", "--context-parallel", "2", "--seq_len", "34"],
     "context_parallel 2: seq_len: context parallelism over 2 ranks cuts each sequence into 4 chunks (zigzag order, "
     "cosine), expected a multiple of 4, got 34"),
])
def test_context_parallel_settings_that_cannot_run_are_usage_errors(world, args, message, run, monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", world)
    with pytest.raises(SystemExit) as exc:
        run(*args)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
