"""The associative-recall probe: the generator's format and streams, the scorer, the short convolution of its
models, and train.py's --task recall."""
import contextlib
import json
import math
import os
import subprocess
import sys

import pytest
import torch
import wandb

import train
from data import recall
from data.recall import EVAL_SEQUENCES, FILLER, IGNORE_INDEX, KEY_BYTES, VALUE_BYTES, RecallSampler, RecallTask, score
from lab.config import TrainConfig, parse_args
from lab.files import load_checkpoint
from lab.steps import evaluate_recall
from model import GPT
from helpers import REPO, TINY, read_jsonl
from test_train import wandb_history

# TINY is the enwik8 smoke run; these flags make it a recall one: 4 pairs, 3 of them asked, in 32 bytes.
RECALL = ["--task", "recall", "--recall_pairs", "4", "--recall_queries", "3"]


def check_format(task: RecallTask, x: torch.Tensor, y: torch.Tensor) -> None:
    """Every row as the module docstring describes it."""
    p, q = task.pairs, task.queries
    assert x.shape == y.shape == (len(x), task.seq_len) and x.dtype == y.dtype == torch.int64
    for row_x, row_y in zip(x.tolist(), y.tolist()):
        keys, values = row_x[0:2 * p:2], row_x[1:2 * p:2]
        assert len(set(keys)) == p and set(keys) <= set(KEY_BYTES.tolist())
        assert set(values) <= set(VALUE_BYTES.tolist())
        value_of = dict(zip(keys, values))
        answers = [i for i, target in enumerate(row_y) if target != IGNORE_INDEX]
        assert len(answers) == q and all(i >= 2 * p for i in answers)
        asked = [row_x[i] for i in answers]
        assert len(set(asked)) == q and set(asked) <= set(keys)  # distinct keys of this row's pairs
        for i in answers:
            assert row_y[i] == value_of[row_x[i]]  # the target at a query key is its value...
            if i + 1 < task.seq_len:
                assert row_x[i + 1] == row_y[i]  # ...which follows it in the input too
        query_bytes = {j for i in answers for j in (i, i + 1)}
        assert all(row_x[j] == FILLER for j in range(2 * p, task.seq_len) if j not in query_bytes)


@pytest.mark.parametrize("seq_len, pairs, queries", [(64, 6, 4), (63, 16, None), (200, 1, 1), (300, 127, 10)])
def test_sequences_have_the_documented_format(seq_len, pairs, queries):
    task = RecallTask(seq_len, pairs, queries)  # (63, 16): 2*16 + 2*16 = seq_len + 1, no filler at all
    x, y = RecallSampler(task, 16, seed=0).next_batch()
    check_format(task, x, y)
    check_format(task, *next(task.eval_batches("test", 16)))


def test_queries_reach_every_part_of_the_rest_and_the_last_answer_may_lie_past_the_inputs():
    task = RecallTask(32, 4, 4)
    _, y = RecallSampler(task, 2000, seed=1).next_batch()
    answered = (y != IGNORE_INDEX).sum(0)
    assert (answered[:8] == 0).all() and (answered[8:] > 0).all()  # every position after the pairs is used
    # The input is seq[:-1], the targets seq[1:]: a query at the last input position has its value only in y.
    assert (y[:, -1] != IGNORE_INDEX).any()


def test_a_stream_is_a_function_of_seed_rank_and_counter():
    task = RecallTask(64, 8)
    uninterrupted = RecallSampler(task, 4, seed=7)
    batches = [uninterrupted.next_batch() for _ in range(5)]
    interrupted = RecallSampler(task, 4, seed=7)
    for _ in range(3):
        interrupted.next_batch()
    resumed = RecallSampler(task, 4, seed=7)
    resumed.load_state_dict(interrupted.state_dict())
    for expected in batches[3:]:
        assert all(torch.equal(a, b) for a, b in zip(resumed.next_batch(), expected))
    assert not torch.equal(RecallSampler(task, 4, seed=8).next_batch()[0], batches[0][0])
    assert not torch.equal(RecallSampler(task, 4, seed=7, rank=1, world_size=2).next_batch()[0], batches[0][0])
    with pytest.raises(ValueError, match="seed=8"):
        RecallSampler(task, 4, seed=8).load_state_dict(interrupted.state_dict())


def test_val_and_test_are_fixed_sets_apart_from_training_and_each_other():
    task = RecallTask(64, 8)

    def rows(split, batch_size, n=None):
        return torch.cat([x for x, _ in task.eval_batches(split, batch_size, n)])

    val = rows("val", 5, 40)
    assert torch.equal(val, rows("val", 3, 40))  # the same sequences, whatever the batch size
    assert torch.equal(val[:10], rows("val", 7, 10))  # a periodic eval scores the first of them
    assert len(rows("val", 256)) == len(rows("val", 64, 10**6)) == EVAL_SEQUENCES
    kv_blocks = {tuple(r[:16].tolist()) for r in val}
    assert len(kv_blocks) == 40
    assert kv_blocks.isdisjoint(tuple(r[:16].tolist()) for r in rows("test", 8, 40))
    for seed in (0, 1):
        train_x, _ = RecallSampler(task, 40, seed).next_batch()
        assert kv_blocks.isdisjoint(tuple(r[:16].tolist()) for r in train_x)


def test_score_counts_the_argmax_at_answers_only():
    targets = torch.tensor([[IGNORE_INDEX, 130, IGNORE_INDEX, 200],
                            [IGNORE_INDEX, IGNORE_INDEX, 140, IGNORE_INDEX]])
    logits = torch.zeros(2, 4, 256)
    logits[0, 0, 7] = 1.0  # an ignored position: whatever it predicts does not count
    logits[0, 1, 130] = 1.0  # right
    logits[0, 3, 201] = 1.0  # wrong
    logits[1, 2, 140] = 5.0  # right...
    logits[1, 2, 141] = 4.0  # ...the argmax, not a near miss
    correct, answers = score(logits, targets)
    assert (correct.item(), answers.item()) == (2, 3)


def test_evaluate_recall_is_exact_over_uneven_batches():
    torch.manual_seed(0)
    task = RecallTask(32, 4, 3)
    model = GPT(TrainConfig(n_layer=1, n_head=2, n_embd=32, seq_len=32).model_config())
    (x, y), = task.eval_batches("val", 10, 10)
    with torch.no_grad():
        logits, _ = model(x)
    answered = y != IGNORE_INDEX
    expected_loss = torch.nn.functional.cross_entropy(logits[answered], y[answered]).item()
    expected_accuracy = (logits.argmax(-1)[answered] == y[answered]).float().mean().item()
    loss, accuracy = evaluate_recall(model, task.eval_batches("val", 4, 10), "cpu", contextlib.nullcontext())
    assert loss == pytest.approx(expected_loss, rel=1e-6) and accuracy == pytest.approx(expected_accuracy)
    assert model.training  # put back in training mode


@pytest.mark.parametrize("kwargs, message", [
    (dict(seq_len=64, pairs=0), "pairs: expected a positive int, got 0"),
    (dict(seq_len=64, pairs=True), "pairs: expected a positive int, got True"),
    (dict(seq_len=0, pairs=4), "seq_len: expected a positive int, got 0"),
    (dict(seq_len=64, pairs=4, queries=0), "queries: expected a positive int, got 0"),
    (dict(seq_len=1024, pairs=128), "pairs: expected at most 127 (the keys are distinct bytes 1-127), got 128"),
    (dict(seq_len=64, pairs=4, queries=5), "queries: expected at most pairs=4 (each asks a different key), got 5"),
    (dict(seq_len=62, pairs=16), "pairs: 16 pairs and 16 queries take 2 * 16 + 2 * 16 = 64 bytes, more than the "
                                 "seq_len + 1 = 63 of a sequence; expected seq_len >= 63"),
])
def test_bad_task_arguments_name_the_argument(kwargs, message):
    with pytest.raises(ValueError) as exc:
        RecallTask(**kwargs)
    assert message in str(exc.value)


def test_bad_stream_arguments_name_the_argument():
    task = RecallTask(64, 4)
    with pytest.raises(ValueError, match="split: expected one of \\('val', 'test'\\), got 'train'"):
        task.eval_batches("train", 4)
    with pytest.raises(ValueError, match="max_sequences: expected a positive int, got 0"):
        task.eval_batches("val", 4, 0)
    with pytest.raises(ValueError, match="batch_size: expected a positive int, got 0"):
        RecallSampler(task, 0, seed=0)
    with pytest.raises(ValueError, match="rank: expected an int in \\[0, world_size=2\\), got 2"):
        RecallSampler(task, 4, seed=0, rank=2, world_size=2)


# ----------------------------------------------------------------------------- the short convolution

@pytest.mark.parametrize("attention", ["softmax", "cosine", "fastmax"])
def test_the_short_convolution_is_causal_and_trained(attention):
    torch.manual_seed(0)
    cfg = TrainConfig(n_layer=2, n_head=2, n_embd=32, seq_len=16, attention=attention, short_conv=3)
    model = GPT(cfg.model_config())
    idx = torch.randint(0, 256, (1, 16))
    changed = idx.clone()
    changed[0, 10] = (idx[0, 10] + 1) % 256
    with torch.no_grad():
        a, b = model(idx)[0], model(changed)[0]
    torch.testing.assert_close(a[:, :10], b[:, :10], rtol=0, atol=1e-6)  # no earlier logit moves
    assert not torch.allclose(a[:, 10:], b[:, 10:])
    model(idx, idx.roll(-1, dims=1))[1].backward()
    assert all(block.conv.conv.weight.grad.abs().sum() > 0 for block in model.blocks)


def test_without_the_short_convolution_the_model_is_unchanged():
    torch.manual_seed(0)
    plain = GPT(TrainConfig(n_layer=2, n_head=2, n_embd=32, seq_len=16).model_config())
    assert not any("conv" in name for name in plain.state_dict())  # checkpoints from before it still load
    with pytest.raises(ValueError, match="short_conv: expected 0 \\(none\\) or a kernel size of at least 2, got 1"):
        TrainConfig(short_conv=1)


# ----------------------------------------------------------------------------- train.py --task recall

@pytest.fixture
def run(tmp_path, monkeypatch):
    """main() in-process on the recall task, writing under tmp_path, wandb offline there (no data path:
    conftest's run fixture passes one, which recall refuses)."""
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")

    def go(*args: str) -> int:
        return train.main([*TINY, *RECALL, "--out_dir", str(tmp_path / "out"), *args])

    go.out = tmp_path / "out"
    go.wandb_dir = tmp_path / "wandb"
    wandb.teardown()  # wandb reads WANDB_DIR once per process, at its first setup
    yield go
    wandb.teardown()


def test_a_recall_run_logs_accuracy_and_resumes_exactly(run):
    assert run("--max_iters", "20", "--lr_decay_iters", "20", "--run_name", "straight") == 0
    rows = read_jsonl(run.out / "straight" / "metrics.jsonl")
    steps = [r for r in rows if "train/loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 21)) and all(math.isfinite(r["train/loss"]) for r in steps)
    evals = [r for r in rows if "val/accuracy" in r]
    assert [r["step"] for r in evals] == [10, 20]
    (test,) = [r for r in rows if "test/accuracy" in r]
    for r, split in [*((e, "val") for e in evals), (test, "test")]:
        assert set(r) == {"step", f"{split}/loss", f"{split}/bpc", f"{split}/accuracy"}  # no curve, no sample
        assert 0 <= r[f"{split}/accuracy"] <= 1 and r[f"{split}/bpc"] == pytest.approx(r[f"{split}/loss"] / math.log(2))
    (wandb_run,) = run.wandb_dir.glob("offline-run-*")
    history = wandb_history(wandb_run)
    assert [h["val/accuracy"] for h in history if "val/accuracy" in h] == [r["val/accuracy"] for r in evals]
    assert [h["test/accuracy"] for h in history if "test/accuracy" in h] == [test["test/accuracy"]]

    ckpt = load_checkpoint(run.out / "straight" / "ckpt.pt")
    assert ckpt["data"]["task"] == "recall" and ckpt["config"]["recall_queries"] == 3
    assert ckpt["sampler"]["batches_drawn"] == 20
    assert run("--max_iters", "10", "--lr_decay_iters", "20", "--run_name", "split") == 0
    assert run("--max_iters", "20", "--lr_decay_iters", "20", "--run_name", "split", "--resume", "auto") == 0
    def trajectory(name):  # the training rows but their timings, and the final evaluations
        rows = read_jsonl(run.out / name / "metrics.jsonl")
        return ([{k: v for k, v in r.items() if not k.startswith("perf/")} for r in rows if "train/loss" in r],
                [r for r in rows if r["step"] == 20 and "train/loss" not in r])

    assert trajectory("split") == trajectory("straight")  # bit for bit


def test_a_resume_refuses_a_generator_that_draws_differently(run, capsys, monkeypatch):
    assert run("--max_iters", "2", "--run_name", "r", "--wandb-mode", "disabled") == 0
    monkeypatch.setattr(recall, "VALUE_BYTES", recall.VALUE_BYTES[::-1])  # as if the generator had changed
    with pytest.raises(SystemExit) as exc:
        run("--max_iters", "4", "--run_name", "r", "--wandb-mode", "disabled", "--resume", "auto")
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "the data differs from the checkpoint's" in err
    assert "recall sequences (seq_len 32, 4 pairs, 3 queries, seed 1337)" in err


@pytest.mark.parametrize("args, expected", [
    (["--data-path", "enwik8"], "data_path: task 'recall' generates its sequences and reads no file; expected None, "
                                "got 'enwik8'"),
    (["--recall_pairs", "12"], "recall_pairs: 12 pairs and 3 queries take 2 * 12 + 2 * 3 = 30 bytes"),
    (["--recall_pairs", "12", "--recall_queries", "none", "--seq_len", "40"], "recall_pairs: 12 pairs and 12 queries"),
    (["--recall_queries", "5"], "recall_queries: expected at most pairs=4"),
    (["--task", "copy"], "task: expected one of ('enwik8', 'recall'), got 'copy'"),
])
def test_bad_recall_settings_are_usage_errors_naming_the_field(run, capsys, args, expected):
    with pytest.raises(SystemExit) as exc:
        run("--seq_len", "16", *args)
    assert exc.value.code == 2 and expected in capsys.readouterr().err


def test_the_gpu_recipe_is_a_recall_run():
    cfg, _ = parse_args(["--config", str(REPO / "configs" / "recall")])
    assert (cfg.task, cfg.recall_pairs, cfg.recall_queries, cfg.short_conv, cfg.seq_len) == ("recall", 16, 16, 3, 256)


@pytest.mark.slow
def test_two_processes_score_recall_exactly(tmp_path):
    """Under torchrun the ranks split the eval batches (10 sequences in batches of 4: six for rank 0, four for
    rank 1) and their sums add up to the single-process accuracy and loss."""
    out = tmp_path / "out"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               str(REPO / "train.py"), *TINY, *RECALL, "--grad_accum_steps", "2", "--max_iters", "6",
               "--final_eval_max_windows", "10", "--out_dir", str(out), "--run_name", "r", "--wandb-mode", "disabled"]
    done = subprocess.run(command, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    cfg = TrainConfig(**json.loads((out / "r" / "config.json").read_text()))
    model = GPT(cfg.model_config())
    model.load_state_dict(load_checkpoint(out / "r" / "ckpt.pt")["model"])
    task = RecallTask(cfg.seq_len, cfg.recall_pairs, cfg.recall_queries)
    loss, accuracy = evaluate_recall(model, task.eval_batches("test", cfg.batch_size, 10), "cpu",
                                     contextlib.nullcontext())
    (test,) = [r for r in read_jsonl(out / "r" / "metrics.jsonl") if "test/accuracy" in r]
    assert test["test/loss"] == pytest.approx(loss, rel=1e-6) and test["test/accuracy"] == accuracy
