"""compare.py and scripts/context_limit.py on CPU: tiny models through the whole pipeline, and the search."""
import importlib.util
import json
import math
import shlex

import pytest

import compare
from lab.config import parse_args
from helpers import REPO

spec = importlib.util.spec_from_file_location("context_limit", REPO / "scripts" / "context_limit.py")
context_limit = importlib.util.module_from_spec(spec)
spec.loader.exec_module(context_limit)

# 16 steps of 512 tokens: batch 16 at context 32, batch 8 at 64; evaluations at steps 8 and 16.
TINY_COMPARE = ["--config", "configs/tiny_cpu", "--device", "cpu", "--seq-lens", "32,64", "--tokens", "8192",
                "--tokens-per-step", "512", "--evals", "2", "--eval-tokens", "1024", "--wandb-mode", "disabled"]
TINY_MODEL = ["--n_layer", "1", "--n_head", "2", "--n_embd", "32", "--final_eval_max_windows", "16"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_compare_trains_every_attention_and_length_on_one_budget_and_reports(tmp_path, data_path):
    out, runs_dir = tmp_path / "report", tmp_path / "runs"
    assert compare.main([*TINY_COMPARE, "--data-path", data_path, "--runs-dir", str(runs_dir), "--out", str(out),
                         "--wandb-group", "g", "--", *TINY_MODEL]) == 0
    results = json.loads((out / "results.json").read_text())
    runs = results["runs"]
    assert [(r["attention"], r["seq_len"], r["batch_size"]) for r in runs] == [
        (a, t, 512 // t) for t in (32, 64) for a in ("softmax", "cosine", "fastmax")]
    for r in runs:
        assert r["status"] == "ok", r["status"]
        assert math.isfinite(r["final_val_bpc"]) and math.isfinite(r["test_bpc"])
        assert r["tokens_per_s"] > 0 and r["peak_mem_gib"] > 0 and 0 < r["train_s"] < r["wall_s"]
        assert [tokens for tokens, _, _ in r["val_curve"]] == [4096, 8192]
        assert r["bpc_by_position"][-1][0] == r["seq_len"]
    # On a CPU our kernels cannot run: cosine and fastmax fall back to the PyTorch reference, and say so.
    assert [r["note"] for r in runs if r["attention"] != "softmax"] == [
        "training runs on cpu, the kernels need a CUDA device"] * 4 and not any(r["kernel"] for r in runs)

    configs = [json.loads(p.read_text()) for p in sorted((runs_dir / "g").glob("*/config.json"))]
    assert len(configs) == 6
    for cfg in configs:
        assert (cfg["seed"], cfg["data_path"], cfg["wandb_group"]) == (1337, data_path, "g")
        assert cfg["max_iters"] * cfg["batch_size"] * cfg["seq_len"] == 8192

    md = (out / "compare.md").read_text()
    assert "8,192 training tokens = 16 steps × 512 tokens" in md and "Seed 1337 for every run" in md
    assert "- cosine at 32: PyTorch reference, because training runs on cpu" in md
    table = [line for line in md.splitlines() if line.startswith("| ") and line.endswith(" | ok |")]
    assert len(table) == 6
    assert sum(line.startswith("python train.py --config configs/tiny_cpu") for line in md.splitlines()) == 6
    for name in ("val_bpc", "throughput_memory", "bpc_by_position"):
        assert (out / f"{name}.png").read_bytes()[:8] == PNG_MAGIC


def test_dry_run_gives_every_length_the_same_tokens_per_step_and_steps(tmp_path, capsys):
    assert compare.main(["--dry-run", "--config", "configs/tiny_cpu", "--device", "cpu", "--seq-lens", "128,256,512",
                         "--tokens", "65536", "--tokens-per-step", "2048", "--out", str(tmp_path / "report")]) == 0
    commands = [line for line in capsys.readouterr().out.splitlines() if line.startswith("python train.py ")]
    assert len(commands) == 9
    configs = [parse_args(shlex.split(line)[2:])[0] for line in commands]
    assert {(c.batch_size * c.seq_len, c.max_iters, c.warmup_iters, c.seed) for c in configs} == {(2048, 32, 3, 1337)}
    assert sorted({c.seq_len for c in configs}) == [128, 256, 512]
    assert not (tmp_path / "report").exists()


@pytest.mark.parametrize("args, expected", [
    (["--tokens", "1000", "--tokens-per-step", "512"], "--tokens: expected a multiple of --tokens-per-step=512"),
    (["--seq-lens", "100,128", "--tokens-per-step", "512", "--tokens", "1024"], "--seq-lens: each must divide"),
    (["--attentions", "softmax,linear"], "--attentions: expected a comma list"),
    (["--seq-lens", "0"], "--seq-lens: invalid comma-separated positive int value"),
    (["--", "--batch-size", "4"], "--batch-size after --: compare.py sets it"),
])
def test_compare_bad_arguments_are_usage_errors(capsys, args, expected):
    with pytest.raises(SystemExit) as exc:
        compare.main(["--dry-run", *args])
    assert exc.value.code == 2
    assert expected in capsys.readouterr().err


@pytest.mark.parametrize("args, expected", [
    (["--variants", "cosine,linear"], "--variants: expected a comma list of softmax, softmax-cudnn, cosine"),
    (["--granularity", "0"], "--granularity: expected > 0, got 0"),
    (["--memory-cap-gib", "-1"], "--memory-cap-gib: expected > 0, got -1.0"),
    (["--start", "1536"], "--start: expected a multiple of --granularity=1024"),
    (["--start", "4096", "--max-seq-len", "2048"], "--start: expected <= --max-seq-len=2048"),
    (["--rel-tolerance", "1"], "--rel-tolerance: expected in [0, 1)"),
    (["--", "--seq-len=64"], "--seq-len after --: context_limit.py sets it for each attempt"),
])
def test_context_limit_bad_arguments_are_usage_errors(capsys, args, expected):
    with pytest.raises(SystemExit) as exc:
        context_limit.main(args)
    assert exc.value.code == 2
    assert expected in capsys.readouterr().err


def test_compare_time_limit_stops_runs_and_still_reports(tmp_path, data_path):
    out = tmp_path / "report"
    assert compare.main([*TINY_COMPARE, "--data-path", data_path, "--runs-dir", str(tmp_path / "runs"),
                         "--out", str(out), "--time-limit", "0.5", "--", *TINY_MODEL]) == 1
    statuses = [r["status"] for r in json.loads((out / "results.json").read_text())["runs"]]
    assert statuses[0].startswith("stopped at its time share")
    assert all(s.startswith(("stopped at its time share", "not run: time limit")) for s in statuses)
    assert (out / "val_bpc.png").read_bytes()[:8] == PNG_MAGIC


@pytest.mark.parametrize("limit, max_seq_len", [(1000, 2**21), (1024, 2**21), (5000, 2**21), (300_000, 2**21),
                                                (2**20, 2**21), (10**9, 2**21), (10**9, 5120)])
def test_context_limit_search_brackets_the_limit(limit, max_seq_len):
    tried = []

    def fits(seq_len):
        tried.append(seq_len)
        return seq_len <= limit

    ok, bad = context_limit.search(fits, 1024, max_seq_len, 1024, 1 / 16)
    assert all(t % 1024 == 0 for t in tried) and len(set(tried)) == len(tried)
    if limit < 1024:
        assert (ok, bad, tried) == (None, 1024, [1024])
    elif limit >= max_seq_len:
        assert (ok, bad) == (max_seq_len, None) and tried[-1] == max_seq_len
    else:
        assert ok <= limit < bad and bad - ok <= max(1024, ok / 16)
        doubling = [1024 * 2**i for i in range(len(tried)) if 1024 * 2**i <= bad]
        assert tried[:len(doubling)] == doubling  # powers of 2 up to the first failure, then bisection


@pytest.mark.slow
def test_context_limit_finds_where_a_memory_cap_bites_and_reports_refusals(tmp_path):
    out = tmp_path / "context_limit"
    # The cosine reference holds T x T scores: at 2048 the tiny model's step raises peak RSS well under
    # 0.5 GiB (about 0.26 here), at 4096 well over (about 0.88).
    assert context_limit.main(["--device", "cpu", "--memory-cap-gib", "0.5", "--variants", "cosine,cosine-kernel",
                               "--start", "2048", "--granularity", "2048", "--max-seq-len", "4096", "--out", str(out),
                               "--", "--config", "configs/tiny_cpu", "--n_layer", "1", "--n_head", "2",
                               "--n_embd", "32"]) == 0
    report = json.loads(out.with_suffix(".json").read_text())
    cosine = report["variants"]["cosine"]
    ok, failed = cosine["attempts"]
    assert (ok["seq_len"], ok["ok"], failed["seq_len"], failed["ok"], failed["reason"]) == (
        2048, True, 4096, False, "out of memory")
    assert ok["step_mem_gib"] <= 0.5 < failed["step_mem_gib"]
    assert (cosine["limit"], cosine["first_failure"]) == (2048, 4096)

    (refused,) = report["variants"]["cosine-kernel"]["attempts"]
    assert (refused["ok"], refused["reason"]) == (False, "refused") and "use_cuda_kernel" in refused["detail"]
    md = out.with_suffix(".md").read_text()
    assert f"| cosine | {cosine['limit']:,} |" in md and "| cosine-kernel | none |" in md
    assert report["model"] == {"n_layer": 1, "n_head": 2, "n_kv_head": 2, "n_embd": 32}


def test_context_limit_reports_timeouts_and_its_time_limit(tmp_path):
    timed = tmp_path / "timeout"
    assert context_limit.main(["--device", "cpu", "--variants", "softmax", "--timeout", "0.2", "--max-seq-len", "1024",
                               "--out", str(timed)]) == 0
    (tried,) = json.loads(timed.with_suffix(".json").read_text())["variants"]["softmax"]["attempts"]
    assert (tried["seq_len"], tried["ok"], tried["reason"]) == (1024, False, "timeout")

    stopped = tmp_path / "stopped"
    assert context_limit.main(["--device", "cpu", "--variants", "softmax,cosine", "--time-limit", "1e-9",
                               "--out", str(stopped)]) == 0
    variants = json.loads(stopped.with_suffix(".json").read_text())["variants"]
    assert all(v["attempts"] == [] and v["stopped"] == "search stopped by --time-limit" for v in variants.values())
    assert "| softmax | not searched |" in stopped.with_suffix(".md").read_text()
