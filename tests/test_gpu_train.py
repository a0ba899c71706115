"""The main job on a GPU, as a new user runs it: train.py with configs/base and no attention flags takes our
kernels (use_cuda_kernel auto), trains, writes a checkpoint, and sample.py samples from it."""
import pytest
import torch

import sample
import train
from lab.files import load_checkpoint
from helpers import read_jsonl

pytestmark = pytest.mark.gpu


def test_the_base_config_trains_on_our_kernels_and_samples(tmp_path, data_path, monkeypatch, capsys):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    out = tmp_path / "out"
    code = train.main(["--data-path", data_path, "--max_iters", "20", "--warmup_iters", "4", "--eval_interval", "10",
                       "--eval_max_windows", "4", "--final_eval_max_windows", "4", "--sample_tokens", "16",
                       "--ckpt_interval", "10", "--out_dir", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "use_cuda_kernel auto: cosine attention on our CUDA kernels" in printed
    assert "cosine attention on our CUDA kernels, 65,536 tokens/step" in printed
    run = out / "base_cosine"
    ckpt = load_checkpoint(run / "ckpt.pt")
    assert ckpt["step"] == 20 and ckpt["config"]["use_cuda_kernel"] is True
    rows = read_jsonl(run / "metrics.jsonl")
    losses = [r["train/loss"] for r in rows if "train/loss" in r]
    assert losses[-1] < losses[0]  # it learned something in 20 steps
    assert sample.main(["--ckpt", str(run), "--prompt", "The ", "--max-new-bytes", "64", "--seed", "1"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("The ") and len(text.encode()) > 4 + 32
    torch.cuda.empty_cache()


def test_a_reference_run_that_cannot_fit_is_refused_with_advice(tmp_path, data_path, capsys):
    with pytest.raises(SystemExit) as exc:
        train.main(["--data-path", data_path, "--use-cuda-kernel", "false", "--batch_size", "256",
                    "--out_dir", str(tmp_path / "out"), "--wandb-mode", "disabled"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "out of memory before the first step" in err and "--use-cuda-kernel" in err
