"""lab/context_eval.py and scripts/evaluate.py's --same-target and --sliding-stride, on CPU: the plans (every
scored byte once, with the context promised), equality with naive loops and with lab.steps.evaluate, bad
arguments, and the script end to end on a checkpoint of a 2-step run."""
import contextlib
import importlib.util
import json
import math
import types

import numpy as np
import pytest
import torch

from helpers import REPO
from lab.context_eval import (check_same_target, plan_cut, plan_sliding, same_target_byte_losses,
                              same_target_losses, sliding_bpc)
from lab.steps import evaluate
from model import GPT, GPTConfig

spec = importlib.util.spec_from_file_location("evaluate_script", REPO / "scripts" / "evaluate.py")
evaluate_script = importlib.util.module_from_spec(spec)
spec.loader.exec_module(evaluate_script)

CPU = torch.device("cpu")
NO_AUTOCAST = contextlib.nullcontext()


pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_gpt(seq_len: int = 128) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=1, n_embd=32, n_head=2, seq_len=seq_len, attention="softmax"))


def random_split(n: int, seed: int = 0, low: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(low, 256, n).astype(np.uint8)


class TargetLoss(torch.nn.Module):
    """A stand-in model whose per-token loss is the target byte's value: a sum of losses then counts which
    bytes were scored."""

    def __init__(self, seq_len: int):
        super().__init__()
        self.cfg = types.SimpleNamespace(seq_len=seq_len)

    def forward(self, x, y, reduction="none"):
        assert x.shape[1] <= self.cfg.seq_len
        return None, y.float()


@pytest.mark.parametrize("cut, targets, window", [(4, 8, 12), (12, 48, 60), (32, 48, 100), (64, 16, 80),
                                                  (256, 2048, 2304), (1024, 2048, 3072), (65536, 2048, 67584),
                                                  (7, 9, 20)])
def test_plan_cut_scores_the_last_targets_once_each_within_three_quarters_to_all_of_the_cut(cut, targets, window):
    plan = plan_cut(cut, targets, window)
    s = min(targets, cut // 4)
    assert plan.scored == s and len(plan.starts) == targets // s
    assert (plan.starts >= 0).all() and (plan.starts + cut <= window).all()  # inside the long window
    assert (plan.scored_from == plan.starts + cut - s).all()  # the sub-window's last s positions
    scored = np.concatenate([np.arange(f, f + s) for f in plan.scored_from])
    assert scored.tolist() == list(range(window - targets, window))  # the last targets positions, once, in order
    starts = np.repeat(plan.starts, s)
    context = scored - starts + 1  # position p of the long window sees its bytes starts .. p
    assert (4 * context >= 3 * cut).all() and (context <= cut).all()
    assert (context.min(), context.max()) == plan.context()


def test_same_target_equals_a_naive_loop_of_one_forward_per_sub_window():
    model = tiny_gpt()
    cuts, targets, window = [4, 12, 32, 64], 48, 112
    split = random_split(3 * window + 50)
    # A small batch: several batches per cut, the last one partial, sub-windows of two long windows in one.
    losses = same_target_byte_losses(model, split, cuts, targets, window, CPU, NO_AUTOCAST, tokens_per_batch=100)
    assert losses.shape == (len(cuts), 3, targets) and losses.dtype == np.float64
    naive = np.empty_like(losses)
    model.eval()
    with torch.no_grad():
        for k, cut in enumerate(cuts):
            s = min(targets, cut // 4)
            for i in range(3):
                for j in range(targets // s):
                    end = i * window + window - targets + (j + 1) * s  # the sub-window's inputs end here
                    sub = torch.from_numpy(split[end - cut:end + 1].astype(np.int64))[None]
                    _, loss = model(sub[:, :-1], sub[:, 1:], reduction="none")
                    naive[k, i, j * s:(j + 1) * s] = loss[0, cut - s:].double().numpy()
    model.train()
    # Equal up to float32 rounding: a batch of sub-windows and one at a time may take different GEMM blockings
    # (bitwise equal on some CPUs, not on others); a wrong window or offset would be off by far more.
    np.testing.assert_allclose(losses, naive, rtol=1e-5, atol=1e-6)

    result = same_target_losses(model, split, cuts, targets, window, CPU, NO_AUTOCAST, max_windows=2, block=16,
                                tokens_per_batch=100)
    assert model.training  # its mode restored
    assert {k: result[k] for k in ("cuts", "targets", "window", "windows", "block")} == {
        "cuts": cuts, "targets": targets, "window": window, "windows": 2, "block": 16}
    np.testing.assert_allclose(result["block_loss"], naive[:, :2].reshape(4, 2, 3, 16).mean(-1), rtol=1e-6)
    np.testing.assert_allclose(result["bpc"], naive[:, :2].mean(axis=(1, 2)) / math.log(2), rtol=1e-6)


def test_same_target_scores_the_same_bytes_under_every_cut():
    split = random_split(1000, low=1)
    losses = same_target_byte_losses(TargetLoss(64), split, [4, 16, 64], 32, 96, CPU, NO_AUTOCAST)
    window_ends = 96 * np.arange(1, 11)  # the 10 long windows' last targets are bytes window_end - 31 .. window_end
    expected = split[window_ends[:, None] + np.arange(-31, 1)]
    for k in range(3):
        np.testing.assert_array_equal(losses[k], expected)


@pytest.mark.parametrize("n_targets, seq_len, stride, max_windows", [
    (64, 16, 16, None), (65, 16, 16, None), (100, 16, 5, None), (16, 16, 3, None), (17, 16, 3, None),
    (1000, 37, 1, None), (999, 64, 48, None), (500, 32, 7, 10), (500, 32, 7, 1000)])
def test_plan_sliding_scores_every_target_once_with_seq_len_minus_stride_context(n_targets, seq_len, stride,
                                                                                   max_windows):
    starts, score_from = plan_sliding(n_targets, seq_len, stride, max_windows)
    assert (starts >= 0).all() and (starts + seq_len <= n_targets).all()
    assert (np.diff(starts) > 0).all() and (np.diff(starts)[:-1] == stride).all()  # the last may be a shifted tail
    scored = np.concatenate([np.arange(s + f, s + seq_len) for s, f in zip(starts, score_from)])
    every = len(plan_sliding(n_targets, seq_len, stride)[0])
    if max_windows is None or max_windows >= every:
        assert scored.tolist() == list(range(n_targets))  # each target once, in order
    else:
        assert len(starts) == max_windows and scored.tolist() == list(range(len(scored)))  # the first windows'
    assert score_from[0] == 0 and (score_from[1:] >= seq_len - stride).all()  # context >= seq_len - stride + 1


def test_sliding_with_stride_seq_len_is_lab_steps_evaluate():
    model = tiny_gpt(32)
    split = random_split(7 * 32 + 1)
    cfg = types.SimpleNamespace(seq_len=32, batch_size=3)
    loss, _ = evaluate(model, split, cfg, CPU, NO_AUTOCAST, None)
    result = sliding_bpc(model, split, 32, 32, CPU, NO_AUTOCAST, tokens_per_batch=64)
    assert model.training
    assert result["windows"] == 7 and result["bytes"] == 7 * 32
    assert result["loss"] == pytest.approx(loss, rel=1e-12)
    assert result["bpc"] == pytest.approx(loss / math.log(2), rel=1e-12)
    # More context for most bytes: a different (here untrained, so about as bad) number, the same bytes.
    assert sliding_bpc(model, split, 32, 8, CPU, NO_AUTOCAST)["bytes"] == 7 * 32


@pytest.mark.parametrize("n, seq_len, stride", [(100, 16, 5), (17, 16, 3), (1001, 64, 48), (333, 33, 33)])
def test_sliding_scores_every_byte_once(n, seq_len, stride):
    split = random_split(n, seed=n, low=1)
    result = sliding_bpc(TargetLoss(seq_len), split, seq_len, stride, CPU, NO_AUTOCAST, tokens_per_batch=50)
    assert result["bytes"] == n - 1
    assert result["loss"] * result["bytes"] == pytest.approx(float(split[1:].sum()), abs=1e-6)


def same(model, split, cuts, targets=16, window=64, **kwargs):
    return same_target_losses(model, split, cuts, targets, window, CPU, NO_AUTOCAST, **{"block": 8, **kwargs})


@pytest.mark.parametrize("call, name", [
    (lambda m, d: same(m, d, [3, 16], 16, 64), "cuts"),
    (lambda m, d: same(m, d, [], 16, 64), "cuts"),
    (lambda m, d: same(m, d, [16, 16], 16, 64), "cuts"),
    (lambda m, d: same(m, d, [16, 64], 16, 64), "cuts"),  # 64 > window - targets
    (lambda m, d: same(m, d, [16, 128], 16, 200), "cuts"),  # > the model's 64
    (lambda m, d: same(m, d, [24], 16, 64), "targets"),  # s = 6 does not divide 16
    (lambda m, d: same(m, d, [16], 0, 64), "targets"),
    (lambda m, d: same(m, d, [16], 16, 16), "window"),
    (lambda m, d: same(m, d[:60], [16], 16, 64), "window"),  # split too short
    (lambda m, d: same(m, d, [16], 16, 64, block=64), "block"),
    (lambda m, d: same(m, d, [16], 16, 64, max_windows=0), "max_windows"),
    (lambda m, d: same(m, d.astype(np.int64), [16], 16, 64), "split"),
    (lambda m, d: sliding_bpc(m, d, 32, 33, CPU, NO_AUTOCAST), "stride"),
    (lambda m, d: sliding_bpc(m, d, 32, 0, CPU, NO_AUTOCAST), "stride"),
    (lambda m, d: sliding_bpc(m, d, 128, 16, CPU, NO_AUTOCAST), "seq_len"),  # longer than the model's 64
    (lambda m, d: sliding_bpc(m, d[:30], 32, 16, CPU, NO_AUTOCAST), "seq_len"),  # longer than the split
    (lambda m, d: sliding_bpc(m, d, 32, 16, CPU, NO_AUTOCAST, tokens_per_batch=0), "tokens_per_batch"),
])
def test_bad_arguments_are_value_errors_naming_them(call, name):
    with pytest.raises(ValueError) as err:
        call(TargetLoss(64), random_split(500))
    assert str(err.value).startswith(f"{name}: "), err.value


def test_check_same_target_explains_what_targets_must_divide():
    with pytest.raises(ValueError, match=r"targets: expected a multiple of s = min\(targets, cut // 4\).*cut 1000 "
                                         r"scores 250"):
        check_same_target([256, 1000], 2048, 4096)


@pytest.fixture
def checkpoint(run) -> str:
    assert run("--max_iters", "2", "--run_name", "r", "--eval_interval", "100", "--sample_tokens", "0") == 0
    return str(run.out / "r" / "ckpt.pt")


def test_evaluate_script_same_target_and_sliding_end_to_end(checkpoint, tmp_path, capsys):
    out = tmp_path / "eval.json"
    common = ["--ckpt", checkpoint, "--max-windows", "6", "--device", "cpu"]
    assert evaluate_script.main([*common, "--seq-len", "64", "--out", str(out)]) == 0
    plain = json.loads(out.read_text())
    assert set(plain) == {"seq_len", "trained_seq_len", "split", "windows", "loss", "bpc", "bpc_by_position"}
    assert (plain["seq_len"], plain["trained_seq_len"], plain["windows"]) == (64, 32, 6)

    assert evaluate_script.main([*common, "--seq-len", "64", "--sliding-stride", "16", "--same-target", "8,16,64",
                                 "--targets", "16", "--block", "8", "--tokens-per-batch", "512",
                                 "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert {k: result[k] for k in plain} == plain  # the plain evaluation's keys, unchanged
    sliding = result["sliding"]
    assert {k: sliding[k] for k in ("seq_len", "stride", "windows", "bytes")} == {
        "seq_len": 64, "stride": 16, "windows": 6, "bytes": 64 + 5 * 16}
    assert sliding["bpc"] == pytest.approx(sliding["loss"] / math.log(2)) and 0 < sliding["bpc"] < 8.5
    same = result["same_target"]
    assert {k: same[k] for k in ("cuts", "targets", "window", "windows", "block")} == {
        "cuts": [8, 16, 64], "targets": 16, "window": 80, "windows": 6, "block": 8}  # window = max(cuts) + targets
    assert np.array(same["block_loss"]).shape == (3, 6, 2)
    assert same["bpc"] == pytest.approx(np.array(same["block_loss"]).mean(axis=(1, 2)) / math.log(2))
    assert all(0 < b < 8.5 for b in same["bpc"])
    assert "sliding bpc" in capsys.readouterr().out

    assert evaluate_script.main([*common, "--same-target", "8,16", "--targets", "16", "--block", "16",
                                 "--window", "100", "--out", str(out)]) == 0  # alone
    alone = json.loads(out.read_text())
    assert set(alone) == {"trained_seq_len", "split", "same_target"} and alone["same_target"]["window"] == 100

    with pytest.raises(SystemExit) as exc:  # a window longer than the split is refused once the data is read
        evaluate_script.main([*common, "--same-target", "16", "--window", str(10**8), "--out", str(out)])
    assert exc.value.code == 2 and "--window: 100000000 needs windows of window + 1 bytes" in capsys.readouterr().err


@pytest.mark.parametrize("args, expected", [
    ([], "--seq-len or --same-target: expected at least one evaluation"),
    (["--same-target", "8,x"], "argument --same-target: expected a comma list of ints"),
    (["--same-target", "3,16"], "--same-target: expected an int >= 4, got 3"),
    (["--same-target", "16,16"], "--same-target: expected distinct values"),
    (["--same-target", "40", "--targets", "16"], "--targets: expected a multiple of s"),
    (["--same-target", "64", "--targets", "32"], "--block: expected a divisor of targets=32, got 64"),
    (["--same-target", "64", "--window", "1000"], "--window: expected > targets=2048"),
    (["--same-target", "64", "--window", "2100"], "--same-target: [64] exceed window - targets = 52"),
    (["--seq-len", "64", "--window", "100"], "--window: applies to --same-target, which is not given"),
    (["--seq-len", "64", "--targets", "16"], "--targets: applies to --same-target"),
    (["--sliding-stride", "8", "--same-target", "64"], "--sliding-stride: slides windows of --seq-len bytes"),
    (["--seq-len", "64", "--sliding-stride", "65"], "--sliding-stride: expected <= --seq-len=64"),
    (["--seq-len", "64", "--sliding-stride", "0"], "--sliding-stride: expected a positive int, got 0"),
    (["--seq-len", "0"], "--seq-len: expected a positive int"),
    (["--seq-len", "64", "--tokens-per-batch", "0"], "--tokens-per-batch: expected a positive int"),
])
def test_evaluate_script_bad_arguments_are_usage_errors_naming_them(capsys, tmp_path, args, expected):
    with pytest.raises(SystemExit) as exc:  # refused before the (absent) checkpoint is read
        evaluate_script.main(["--ckpt", str(tmp_path / "none.pt"), "--out", str(tmp_path / "e.json"), *args])
    assert exc.value.code == 2
    assert expected in capsys.readouterr().err
