"""keep_best keeps the checkpoint of the lowest periodic val loss; stop_accuracy ends a recall run as finished."""
import pytest

import train
from lab.config import TrainConfig
from lab.files import load_checkpoint
from helpers import read_jsonl

RECALL = ["--task", "recall", "--data-path", "none", "--seq_len", "32", "--recall_pairs", "4", "--sample_tokens", "0"]


def test_keep_best_keeps_the_lowest_periodic_val_loss(run):
    assert run("--max_iters", "30", "--eval_interval", "5", "--keep_best", "--run_name", "r",
               "--wandb-mode", "disabled") == 0
    rows = read_jsonl(run.out / "r" / "metrics.jsonl")
    periodic = [r for r in rows if "val/loss" in r][:-1]  # the last one is the final evaluation, on more windows
    low = min(periodic, key=lambda r: r["val/loss"])
    best = load_checkpoint(run.out / "r" / "best.pt")
    assert best["step"] == low["step"] and best["best"] == {"step": low["step"], "loss": low["val/loss"]}
    last = load_checkpoint(run.out / "r" / "ckpt.pt")
    assert last["step"] == 30 and last["best"] == best["best"]


def test_keep_best_carries_over_a_resume(run):
    assert run("--max_iters", "10", "--eval_interval", "5", "--keep_best", "--run_name", "r",
               "--wandb-mode", "disabled") == 0
    before = load_checkpoint(run.out / "r" / "ckpt.pt")["best"]
    assert run("--max_iters", "20", "--eval_interval", "5", "--keep_best", "--run_name", "r", "--resume", "auto",
               "--wandb-mode", "disabled") == 0
    after = load_checkpoint(run.out / "r" / "best.pt")["best"]
    assert after["loss"] <= before["loss"]


def test_stop_accuracy_ends_a_recall_run_as_finished(run, capsys, monkeypatch):
    monkeypatch.setattr(train, "evaluate_recall", lambda *a, **k: (0.5, 1.0))
    assert run(*RECALL, "--max_iters", "40", "--eval_interval", "10", "--stop_accuracy", "0.99", "--run_name", "r",
               "--wandb-mode", "disabled") == 0
    assert "reached stop_accuracy=0.99 at step 10" in capsys.readouterr().out
    ckpt = load_checkpoint(run.out / "r" / "ckpt.pt")
    assert ckpt["step"] == 10 and ckpt["stopped_at_accuracy"]
    rows = read_jsonl(run.out / "r" / "metrics.jsonl")
    assert max(r["step"] for r in rows) == 10 and any("test/accuracy" in r for r in rows)
    # Resuming a run that stopped there does nothing, as for one that reached max_iters.
    assert run(*RECALL, "--max_iters", "40", "--eval_interval", "10", "--stop_accuracy", "0.99", "--run_name", "r",
               "--resume", "auto", "--wandb-mode", "disabled") == 0
    assert "already complete (it reached stop_accuracy at step 10)" in capsys.readouterr().out


@pytest.mark.parametrize("fields, message", [
    (dict(stop_accuracy=0.9), "stop_accuracy: expected None, or an accuracy in (0, 1] with task 'recall'"),
    (dict(task="recall", stop_accuracy=1.5), "stop_accuracy"),
])
def test_stop_accuracy_is_checked(fields, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        TrainConfig(**fields)
