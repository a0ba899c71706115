"""What a new user hits first: the attention backend chosen for the machine, out-of-memory as a message,
`make train DATA=...`, a wandb login asked for before any work, a full disk at a checkpoint, the file modes
a resume keeps, and compare.py's CPU smoke run kept apart from the committed study."""
import json
import os
import stat
import subprocess
from pathlib import Path

import pytest
import torch

import compare
import lab.files
import lab.steps
import train
from lab.config import TrainConfig
from helpers import REPO, TINY


# ----------------------------------------------------------------------------- the attention backend

def test_use_cuda_kernel_auto_takes_the_reference_without_cuda_and_says_why():
    cfg = TrainConfig(attention="cosine", n_layer=1, n_head=2, n_embd=32, seq_len=32, device="cpu")
    assert cfg.use_cuda_kernel is None
    note = lab.steps.resolve_kernel_choice(cfg, torch.device("cpu"), torch.float32)
    assert cfg.use_cuda_kernel is False
    assert note.startswith("use_cuda_kernel auto: cosine attention on the PyTorch reference, as ")
    assert "cpu" in note or "CUDA" in note
    # A config that chose is left alone, and attention on SDPA has nothing to choose.
    assert lab.steps.resolve_kernel_choice(cfg, torch.device("cpu"), torch.float32) is None
    assert TrainConfig(attention="softmax").use_cuda_kernel is False
    assert TrainConfig(attention="cosine", cosine_sdpa=True).use_cuda_kernel is False


def test_use_cuda_kernel_auto_takes_the_kernels_where_the_plan_does(monkeypatch):
    cfg = TrainConfig(attention="fastmax", n_layer=1, n_head=2, n_embd=128, seq_len=64)
    plan = type("Plan", (), {"backend": "cuda", "why": (("our kernels",),)})()
    monkeypatch.setattr(lab.steps, "attention_plan", lambda *a: plan)
    note = lab.steps.resolve_kernel_choice(cfg, torch.device("cuda", 0), torch.bfloat16)
    assert cfg.use_cuda_kernel is True and "fastmax attention on our CUDA kernels" in note


@pytest.mark.parametrize("text, value", [("auto", None), ("none", None), ("true", True), ("false", False)])
def test_use_cuda_kernel_on_the_command_line(text, value):
    from lab.config import parse_args
    cfg, _ = parse_args(["--config", "configs/tiny_cpu", "--use-cuda-kernel", text])
    assert cfg.use_cuda_kernel is value
    cfg, _ = parse_args(["--config", "configs/tiny_cpu", "--use-cuda-kernel"])
    assert cfg.use_cuda_kernel is True


def test_train_says_which_attention_code_runs(run, capsys):
    assert run("--max_iters", "2", "--run_name", "r", "--wandb-mode", "disabled") == 0
    out = capsys.readouterr().out
    assert "use_cuda_kernel auto: cosine attention on the PyTorch reference" in out
    assert "r: 0.02M params, cosine attention on the PyTorch reference, 128 tokens/step" in out


# ----------------------------------------------------------------------------- out of memory

def test_out_of_memory_is_a_message_with_what_was_asked_and_what_to_try(run, capsys, monkeypatch):
    def no_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 16.00 GiB")

    monkeypatch.setattr(train, "clip_gradients", no_memory)
    assert run("--max_iters", "3", "--run_name", "r", "--wandb-mode", "disabled") == train.EXIT_USAGE
    err = capsys.readouterr().err
    assert "out of memory during training step 1 on cpu; no checkpoint was written" in err
    assert "128 tokens a step (batch_size 4 x seq_len 32 x grad_accum_steps 1)" in err
    assert "cosine attention on the PyTorch reference" in err
    for advice in ("--use-cuda-kernel", "--batch_size", "--grad_accum_steps", "--seq-len"):
        assert advice in err
    assert "Traceback" not in err
    run_dir = run.out / "r"
    assert not (run_dir / "ckpt.pt").exists()
    assert not list(run_dir.glob(".*.tmp"))
    json.loads((run_dir / "config.json").read_text())  # whole, not half-written


def test_out_of_memory_at_an_evaluation_names_it(run, capsys, monkeypatch):
    def no_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(train, "evaluate", no_memory)
    assert run("--max_iters", "10", "--run_name", "r", "--wandb-mode", "disabled") == train.EXIT_USAGE
    assert "out of memory during the val evaluation at step 10" in capsys.readouterr().err


def test_a_reference_whose_scores_cannot_fit_is_refused_before_any_work(monkeypatch):
    cfg = TrainConfig(attention="cosine", n_layer=8, n_head=8, n_embd=512, seq_len=8192, batch_size=8,
                      use_cuda_kernel=False)
    plan = type("Plan", (), {"form": "quadratic", "score_dtype": torch.float32})()
    monkeypatch.setattr(lab.steps, "attention_plan", lambda *a: plan)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (10 * 2**30, 80 * 2**30))
    problem = lab.steps.scores_problem(cfg, torch.device("cuda", 0), torch.bfloat16)
    assert "scores of one layer alone need 16.0 GiB" in problem and "10.0 GiB free" in problem
    assert "--use-cuda-kernel" in problem
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (20 * 2**30, 80 * 2**30))
    assert lab.steps.scores_problem(cfg, torch.device("cuda", 0), torch.bfloat16) is None
    cfg.use_cuda_kernel = True  # the kernels hold no scores
    assert lab.steps.scores_problem(cfg, torch.device("cuda", 0), torch.bfloat16) is None


# ----------------------------------------------------------------------------- make train DATA=

def test_make_train_passes_data_as_data_path():
    out = subprocess.run(["make", "-n", "train", "DATA=/some/enwik8", "ARGS=--max_iters 5"], cwd=REPO,
                         capture_output=True, text=True, check=True).stdout
    assert "train.py --data-path /some/enwik8 --max_iters 5" in out
    out = subprocess.run(["make", "-n", "train"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert "--data-path" not in out


# ----------------------------------------------------------------------------- wandb

def test_wandb_online_without_a_login_fails_first_and_leaves_nothing(run, capsys, monkeypatch):
    monkeypatch.setattr(lab.files.wandb, "login", lambda **kwargs: False)
    with pytest.raises(SystemExit) as exc:
        run("--max_iters", "2", "--run_name", "r", "--wandb-mode", "online")
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "wandb login" in err and "--wandb-mode offline" in err
    assert not (run.out / "r").exists()  # no .lock, no config.json, no data read


# ----------------------------------------------------------------------------- checkpoints and files

def test_a_full_disk_at_a_checkpoint_says_so_and_keeps_the_last_good_one(run, capsys, monkeypatch):
    assert run("--max_iters", "10", "--run_name", "r", "--wandb-mode", "disabled") == 0
    good = (run.out / "r" / "ckpt.pt").read_bytes()

    def full_disk(obj, f, *args, **kwargs):
        f.write(b"x" * 100)
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0")

    monkeypatch.setattr(lab.files.torch, "save", full_disk)
    monkeypatch.setattr(lab.files.shutil, "disk_usage", lambda path: type("U", (), {"free": 0})())
    code = run("--max_iters", "20", "--run_name", "r", "--resume", "auto", "--wandb-mode", "disabled")
    assert code == train.EXIT_UNSAVED
    err = capsys.readouterr().err
    assert "is full" in err and "still holds the previous checkpoint" in err and "--resume auto" in err
    assert "inline_container" not in err
    assert (run.out / "r" / "ckpt.pt").read_bytes() == good
    assert not list((run.out / "r").glob(".*.tmp"))


def test_another_failed_checkpoint_write_names_its_cause(tmp_path, monkeypatch):
    def broken(obj, f, *args, **kwargs):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(lab.files.torch, "save", broken)
    with pytest.raises(lab.files.CheckpointWriteError, match="OSError.*Input/output error; no checkpoint was written"):
        lab.files.save_checkpoint({"w": torch.zeros(2)}, tmp_path / "ckpt.pt")


def test_a_resume_keeps_the_modes_of_the_files_it_rewrites(run):
    assert run("--max_iters", "10", "--run_name", "r", "--wandb-mode", "disabled") == 0
    metrics = run.out / "r" / "metrics.jsonl"
    mode = stat.S_IMODE(metrics.stat().st_mode)
    assert mode == 0o666 & ~_umask()
    os.chmod(metrics, 0o640)
    assert run("--max_iters", "20", "--run_name", "r", "--resume", "auto", "--wandb-mode", "disabled") == 0
    assert stat.S_IMODE(metrics.stat().st_mode) == 0o640
    assert stat.S_IMODE((run.out / "r" / "ckpt.pt").stat().st_mode) == 0o666 & ~_umask()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# ----------------------------------------------------------------------------- compare.py

def test_compare_on_a_cpu_leaves_out_what_needs_a_gpu(capsys):
    assert compare.cpu_variants(["softmax", "cosine-kernel", "cosine-sdpa", "cosine"]) == ["softmax", "cosine"]
    assert "leaving out cosine-kernel, cosine-sdpa (our kernels and SDPA's GPU backends need a CUDA GPU)" in (
        capsys.readouterr().out)
    with pytest.raises(SystemExit):
        compare.cpu_variants(["cosine-kernel"])
    assert "a CPU smoke run takes softmax, cosine or fastmax" in capsys.readouterr().err


def test_a_study_of_other_settings_never_writes_over_the_committed_report(tmp_path, capsys):
    committed = json.loads((REPO / compare.COMMITTED / "results.json").read_text())["protocol"]
    runs = tmp_path / "runs" / "study"
    assert compare.report_folder(None, committed, runs) == REPO / compare.COMMITTED
    other = {**committed, "steps": 20, "device": "cpu"}
    assert compare.report_folder(None, other, runs) == runs / "report"
    assert "differ from the committed study's (device, steps)" in capsys.readouterr().out
    assert compare.report_folder(str(tmp_path / "mine"), other, runs) == tmp_path / "mine"


def test_compare_help_shows_the_cpu_smoke_command(capsys):
    with pytest.raises(SystemExit):
        compare.main(["--help"])
    assert "--device cpu" in capsys.readouterr().out
