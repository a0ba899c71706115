"""The long-context study on CPU: the plan (compare.py --dry-run) and its budget, the phases' decisions on made-up
results (bracketing the rates, seeds where a difference is not settled, equal compute, the recall
rates), the queue and its resume, the report's statistics and words, and a tiny study end to end."""
import dataclasses
import json
import math
import shlex
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import compare
import study.jobs
from lab.config import parse_args
from study.jobs import (Job, Protocol, bracket, compute_jobs, grid_jobs, lr_table, make_job, swept_context,
                        sweep_jobs, throughput_jobs)
from study.phases import (cells_needing_seeds, chosen_rates, comparisons, established, extra_seeds, next_rates,
                          paired_comparisons, recall_best, run_study)
from study.report import Report
from study.runner import Runner, StudyError, command_lines, read_result
from study.stats import paired

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
TINY_MODEL = ["--n_layer", "1", "--n_head", "2", "--n_embd", "32"]


def protocol(**overrides) -> Protocol:
    fields = dict(config="configs/tiny_cpu", variants=("softmax", "cosine"), convs=(0, 3), seq_lens=(32, 64),
                  seeds=(1, 2, 3), max_seeds=5, sweep_seed=0, epochs=2.0, train_bytes=2560, tokens_per_step=256,
                  lrs=(1e-3, 2e-3, 4e-3), evals=2, eval_tokens=512, cuts=(16, 32, 64, 128), targets=128,
                  test_windows=None, compute=True, recall_cells=((32, 4), (64, 8)), recall_lrs=(1e-3, 3e-3),
                  recall_steps=10, recall_config="configs/recall", stop_accuracy=0.99, data_path=None,
                  device="cpu", wandb_mode="disabled", wandb_group="g", extra=tuple(TINY_MODEL))
    return Protocol(**{**fields, **overrides})


# ----------------------------------------------------------------------------- the plan

def test_the_budget_is_sized_to_the_data_and_every_run_shares_it(capsys, data_path):
    assert compare.main(["--dry-run", "--data-path", data_path, "--epochs", "8"]) == 0
    out = capsys.readouterr().out.splitlines()
    train_bytes = compare.train_bytes(data_path)
    steps = round(8 * train_bytes / 32768)
    assert out[0] == f"# {steps} steps of 32,768 tokens per enwik8 run: 8 epochs of {train_bytes:,} train bytes"
    configs = [parse_args(shlex.split(line)[2:])[0] for line in out if line.startswith("python train.py ")]
    sweep = [c for c in configs if c.run_name.startswith("sweep_")]
    grid = [c for c in configs if c.run_name.startswith("grid_")]
    recall = [c for c in configs if c.task == "recall"]
    assert len(sweep) == 4 * 2 * 2 * 3 and len(grid) == 4 * 2 * 3 * 3 and len(recall) == 4 * 4 * 3 * 4
    assert {(c.batch_size * c.seq_len, c.max_iters, c.warmup_iters, c.lr_decay_iters) for c in sweep + grid} == {
        (32768, steps, steps // 10, steps)}
    assert {c.seq_len for c in sweep} == {1024, 32768} and {c.seed for c in sweep} == {0}
    assert sorted({c.seed for c in grid}) == [1, 2, 3] and {c.short_conv for c in grid} == {0, 3}
    assert {(c.attention, c.use_cuda_kernel, c.swa_window) for c in grid} == {
        ("softmax", False, 0), ("cosine", True, 0), ("fastmax", True, 0), ("fastmax", True, 64)}
    assert all(c.keep_best and c.final_eval_max_windows == c.eval_max_windows for c in sweep + grid)
    assert all(c.min_lr == pytest.approx(c.lr / 10) and c.sample_tokens == 0 for c in configs)
    assert {(c.seq_len, c.recall_pairs, c.stop_accuracy) for c in recall} == {
        (256, 16, 0.99), (256, 64, 0.99), (1024, 16, 0.99), (1024, 64, 0.99)}
    assert {c.lr for c in recall} == {3e-4, 1e-3, 3e-3, 1e-2} and {c.seed for c in recall} == {1, 2, 3}
    assert {c.wandb_tags.split(",")[-1] for c in grid} == {"conv0", "conv3"}
    assert {c.wandb_tags.split(",")[-1] for c in recall} == {"P16", "P64"}  # configs/recall's conv, not conv0
    evaluations = [line for line in out if line.startswith("python scripts/evaluate.py ")]
    assert len(evaluations) == len(grid)
    assert any("--same-target 256,1024,4096,16384,32768,65536 --targets 2048 --window 67584" in e for e in evaluations)
    assert any("--seq-len 1024 --split test --same-target 256,1024 " in e for e in evaluations)


def test_the_full_enwik8_budget_scales_with_its_train_split(capsys):
    assert compare.main(["--dry-run", "--epochs", "2"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == (
        "# 5493 steps of 32,768 tokens per enwik8 run: 2 epochs of 90,000,000 train bytes")


def test_each_context_takes_the_rate_of_the_nearest_swept_one():
    p = protocol(seq_lens=(1024, 4096, 8192, 32768))
    assert p.swept_seq_lens == (1024, 32768)
    assert [swept_context(p, t) for t in p.seq_lens] == [1024, 1024, 32768, 32768]
    table = lr_table(p, {(v, c, t): (1e-3 if t == 1024 else 4e-3) for v in p.variants for c in p.convs
                         for t in p.swept_seq_lens})
    assert table["softmax", 0, 4096] == 1e-3 and table["cosine", 3, 8192] == 4e-3


@pytest.mark.parametrize("tried, expected", [
    ({1e-3: 2.0, 2e-3: 1.9, 4e-3: 1.95}, None),  # bracketed
    ({1e-3: 2.0, 2e-3: 1.9, 4e-3: 1.8}, 8e-3),  # the highest wins: one step up
    ({1e-3: 1.7, 2e-3: 1.9, 4e-3: 1.95}, 5e-4),  # the lowest wins: one step down
])
def test_a_winning_edge_extends_the_sweep(tried, expected):
    assert bracket(tried) == pytest.approx(expected) if expected else bracket(tried) is None


def sweep_result(v, c, t, lr, best, **more):
    return {"name": make_job(protocol(), "runs", "sweep", v, t, 0, lr, c).name, "phase": "sweep", "variant": v,
            "conv": c, "seq_len": t, "seed": 0, "lr": lr, "status": "ok", "best_val_bpc": best, "commands": [], **more}


def test_the_sweep_extends_at_most_max_extensions_rates_then_flags_the_edge(tmp_path):
    p = protocol(variants=("softmax",), convs=(0,), seq_lens=(32,))
    results = [sweep_result("softmax", 0, 32, lr, 2.0 - lr * 10) for lr in p.lrs]  # the highest always wins
    assert next_rates(p, results) == {("softmax", 0, 32): [1e-3, 2e-3, 4e-3, 8e-3]}
    assert chosen_rates(p, results) == {}  # not chosen while extending
    results.append(sweep_result("softmax", 0, 32, 8e-3, 2.0 - 8e-2))
    results.append(sweep_result("softmax", 0, 32, 16e-3, 2.0 - 16e-2))
    assert next_rates(p, results) == {}  # MAX_EXTENSIONS reached
    assert chosen_rates(p, results) == {("softmax", 0, 32): 16e-3}
    md = Report(p, results, [], "CPU", "python compare.py", 1).rate_table()
    assert any("| 0.016 **edge** |" in line for line in md)


def grid_result(v, c, t, seed, test_bpc, phase="grid", lr=2e-3, **more):
    p = protocol()
    return {"name": make_job(p, "runs", phase, v, t, seed, lr, c).name, "phase": phase, "variant": v, "conv": c,
            "seq_len": t, "seed": seed, "lr": lr, "status": "ok", "val_bpc": test_bpc + 0.1,
            "best_val_bpc": test_bpc + 0.1, "best_step": 10, "train_bpc": test_bpc - 0.1, "steps": 10,
            "evaluation": {"bpc": test_bpc}, "commands": [], **more}


def recall_result(v, seed, t, pairs, accuracy, lr=3e-3, steps=10):
    return {"name": f"recall_{v}_P{pairs}_T{t}_lr{lr:g}_s{seed}", "phase": "recall", "variant": v, "seed": seed,
            "seq_len": t, "pairs": pairs, "lr": lr, "status": "ok", "steps": steps, "conv": 0, "commands": [],
            "test_accuracy": accuracy}


def test_cells_whose_difference_is_not_settled_get_more_seeds():
    p = protocol(variants=("softmax", "cosine"), convs=(0,), seq_lens=(32,))
    noise = {1: -0.01, 2: 0.0, 3: 0.01}
    clear = [grid_result("softmax", 0, 32, s, 2.0 + noise[s]) for s in p.seeds] + [
        grid_result("cosine", 0, 32, s, 1.5 + noise[s]) for s in p.seeds]
    assert cells_needing_seeds(p, clear) == set()
    close = [grid_result("softmax", 0, 32, s, 2.0 + noise[s]) for s in p.seeds] + [
        grid_result("cosine", 0, 32, s, 2.0 + noise[s] * (-1) ** s) for s in p.seeds]
    assert cells_needing_seeds(p, close) == {("softmax", 0, 32), ("cosine", 0, 32)}
    assert extra_seeds(p) == (4, 5)
    # Over 3 standard errors (about 7) but, at 3 seeds, not established once the other comparisons count (Holm):
    # its cells get seeds too.
    four = protocol(variants=("softmax", "cosine"), convs=(0,), seq_lens=(32, 64))
    shift, wobble = {1: 0.0, 2: 0.1, 3: 0.2}, {1: 0.05, 2: -0.07, 3: 0.02}
    big = [r for s in four.seeds for r in (
        grid_result("softmax", 0, 32, s, 2.0 + noise[s]), grid_result("cosine", 0, 32, s, 1.5 + noise[s] + shift[s]),
        grid_result("softmax", 0, 64, s, 2.0 + wobble[s]), grid_result("cosine", 0, 64, s, 2.0 - wobble[s]))]
    test = next(t for t in paired_comparisons(four, big) if (t["a"], t["b"]) == (("softmax", 0, 32), ("cosine", 0, 32)))
    assert test["diff"].p < 0.05 and not test["diff"].under(3.0) and not established(test)
    assert {("softmax", 0, 32), ("cosine", 0, 32)} <= cells_needing_seeds(four, big)
    more = grid_jobs(p, "runs", {("softmax", 0, 32): 2e-3, ("cosine", 0, 32): 2e-3}, seeds=extra_seeds(p),
                     cells={("cosine", 0, 32)})
    assert [(j.phase, j.variant, j.seed) for j in more] == [("seeds", "cosine", 4), ("seeds", "cosine", 5)]


def test_the_comparisons_cover_attention_convolution_and_context():
    whats = [w for w, _, _ in comparisons(protocol())]
    assert "cosine - softmax, conv 0, 32" in whats and "cosine - softmax, conv 3, 64" in whats
    assert "softmax: conv 3 - conv 0, 64" in whats and "cosine, conv 3: 64 - 32" in whats
    assert len(whats) == 2 * 2 + 2 * 2 + 2 * 2


def test_equal_compute_scales_each_attentions_steps_by_its_speed():
    p = protocol(convs=(0,), seq_lens=(32,), seeds=(1,))
    speed = {("softmax", 0, 32): 1000.0, ("cosine", 0, 32): 1500.0}
    (job,) = compute_jobs(p, "runs", {("softmax", 0, 32): 1e-3, ("cosine", 0, 32): 2e-3}, speed)
    assert (job.variant, job.steps, job.lr) == ("cosine", round(p.steps * 1.5), 2e-3)
    assert "--max_iters" in job.commands[0] and str(job.steps) in job.commands[0]
    # Scored like the grid's runs (the metric its difference is taken on), without the grid's context curves.
    (script, *argv), grid = job.commands[1], make_job(p, "runs", "grid", "cosine", 32, 1, 2e-3).commands[1]
    assert script == "scripts/evaluate.py" and argv[:6] == ["--ckpt", f"runs/{job.name}/best.pt", "--seq-len", "32",
                                                            "--split", "test"]
    assert "--same-target" not in argv and "--sliding-stride" not in argv and "--same-target" in grid
    assert compute_jobs(p, "runs", {}, {("softmax", 0, 32): 1000.0}) == []  # no speed: left out
    # Within 5% of the reference's speed the equal-compute run would be the grid's run again: not planned.
    lrs = {("cosine", 0, 32): 2e-3}
    assert compute_jobs(p, "runs", lrs, {("softmax", 0, 32): 1000.0, ("cosine", 0, 32): 1040.0}) == []
    (slower,) = compute_jobs(p, "runs", lrs, {("softmax", 0, 32): 1000.0, ("cosine", 0, 32): 900.0})
    assert slower.steps == round(p.steps * 0.9)


def test_the_report_says_where_equal_compute_is_equal_tokens(tmp_path):
    p = protocol(convs=(0,), seq_lens=(32, 64))
    rows = [{"ok": True, "variant": v, "seq_len": t, "tokens_per_s": speed}
            for v, t, speed in (("softmax", 32, 1000.0), ("cosine", 32, 1020.0), ("softmax", 64, 1000.0),
                                ("cosine", 64, 1500.0))]
    results = [{"name": "throughput_c0_T64", "phase": "throughput", "variant": "all", "seq_len": 64, "seed": 0,
                "conv": 0, "lr": 0.0, "steps": 0, "pairs": None, "status": "ok", "commands": [],
                "throughput": {"hardware": "NVIDIA H200", "results": rows}}]
    Report(p, results, [], "CPU", "python compare.py", 1).write(tmp_path)
    compute = (tmp_path / "report.md").read_text().split("## Equal compute")[1].split("##")[0]
    assert ("Within 5% of softmax (SDPA)'s tokens/s, so not run again (the grid's comparison stands for equal "
            "compute): cosine (PyTorch reference) at 32 (x1.020).") in compute
    assert "at 64" not in compute  # 1.5x: a compute run of its own


def test_the_report_names_the_short_conv_its_tokens_per_s_were_measured_with(tmp_path):
    p = protocol(convs=(0, 3), seq_lens=(32,))
    (job,) = throughput_jobs(p, "runs")
    assert job.conv == 3
    rows = [{"ok": True, "variant": v, "seq_len": 32, "tokens_per_s": 1000.0} for v in p.variants]
    results = [{**FakeRunner.result(job), "throughput": {"hardware": "NVIDIA H200", "results": rows}}]
    Report(p, results, [], "CPU", "python compare.py", 1).write(tmp_path)
    assert ("tokens/s: the throughput phase, alone on one NVIDIA H200 (compiled, with short_conv 3 for every "
            "short_conv") in (tmp_path / "report.md").read_text()
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["tokens_per_s_conv"] == 3 and data["tokens_per_s_gpu"] == "NVIDIA H200"
    assert {c["conv"]: c["tokens_per_s"] for c in data["cells"] if c["variant"] == "softmax"} == {0: 1000.0,
                                                                                                 3: 1000.0}


def test_the_report_names_the_gpus_its_runs_trained_on(tmp_path):
    p = protocol(seq_lens=(32,))
    jobs = grid_jobs(p, "runs", {(v, c, 32): 1e-3 for v in p.variants for c in p.convs})
    gpus = ["NVIDIA H200", "NVIDIA H200", "NVIDIA H100 80GB HBM3", None]  # None: a run from before it was recorded
    results = [{**FakeRunner.result(j), "gpu": gpu} for j, gpu in zip(jobs, gpus)]
    Report(p, results, jobs, "1 x NVIDIA H100 80GB HBM3, torch 2.11", "python compare.py", 1).write(tmp_path)
    trained_on = "NVIDIA H200 (2 runs), NVIDIA H100 80GB HBM3 (1 run), not recorded (1 run)"
    assert (f"on 1 x NVIDIA H100 80GB HBM3, torch 2.11; the runs trained on {trained_on}."
            in (tmp_path / "report.md").read_text())
    assert json.loads((tmp_path / "results.json").read_text())["trained_on"] == trained_on


def test_recall_takes_each_cell_at_the_rate_that_solved_it_in_the_most_seeds_then_fastest():
    p = protocol(variants=("softmax",), recall_lrs=(1e-3, 3e-3, 1e-2))
    easy, hard = p.recall_cells
    # (lr, seed) -> (test accuracy, steps); a run that never solves its cell runs to the cap (10 steps)
    easiest = {1e-3: [(1.0, 8), (1.0, 9), (1.0, 9)], 3e-3: [(1.0, 3), (0.9999, 4), (1.0, 3)],
               1e-2: [(1.0, 2), (0.02, 10), (1.0, 2)]}
    hardest = {1e-3: [(0.97, 9), (1.0, 9), (0.5, 10)], 3e-3: [(0.03, 10)] * 3, 1e-2: [(0.9, 10)] * 3}
    runs = [recall_result("softmax", seed, t, n, acc, lr, steps)
            for (t, n), by_lr in ((easy, easiest), (hard, hardest))
            for lr, rows in by_lr.items() for seed, (acc, steps) in zip(p.seeds, rows)]
    best = recall_best(p, runs)
    # easiest: 1e-3 and 3e-3 solve every seed, 3e-3 in fewer steps (its accuracy a hair lower); 1e-2 fails a seed
    assert best["softmax", *easy][0] == 3e-3 and len(best["softmax", *easy][1]) == 3
    # hardest: the smallest rate is the only one to solve it at all (2 seeds of 3)
    assert best["softmax", *hard][0] == 1e-3
    assert ("softmax", *hard) not in recall_best(p, runs[:-1])  # a seed not run yet: the cell is not settled


class FakeRunner:
    """Runs nothing: writes each job a made-up result, as the phases would find them."""

    def __init__(self, runs_dir: Path):
        self.runs_dir, self.ran = runs_dir, []

    def run(self, jobs):
        for job in jobs:
            self.ran.append(job)
            path = self.runs_dir / job.name
            path.mkdir(parents=True, exist_ok=True)
            (path / "result.json").write_text(json.dumps(self.result(job)))
        return True

    @staticmethod
    def result(job: Job) -> dict:
        base = {"name": job.name, "phase": job.phase, "variant": job.variant, "conv": job.conv,
                "seq_len": job.seq_len, "seed": job.seed, "lr": job.lr, "steps": job.steps, "pairs": job.pairs,
                "status": "ok", "commands": command_lines(job)}
        if job.phase == "throughput":
            rows = [{"variant": v, "seq_len": job.seq_len, "ok": True,
                     "tokens_per_s": 2000.0 if v == "cosine" else 1000.0} for v in ("softmax", "cosine")]
            return {**base, "throughput": {"hardware": "NVIDIA H200", "results": rows}}
        if job.pairs is not None:
            return {**base, "test_accuracy": 1.0 if job.lr == 3e-3 else 0.5}
        # The highest rate wins the sweep; the grid's cosine differs from softmax by noise alone.
        bpc = 2.0 - job.lr * 10 + (0.01 * (-1) ** job.seed if job.variant == "cosine" else 0.0)
        return {**base, "best_val_bpc": bpc, "val_bpc": bpc, "best_step": 1, "train_bpc": bpc,
                "evaluation": {"bpc": bpc}}


def test_the_phases_follow_each_other_from_their_results(tmp_path):
    p = protocol(convs=(0,), seq_lens=(32,), seeds=(1, 2, 3), max_seeds=4, lrs=(1e-3, 2e-3))
    runner = FakeRunner(tmp_path)
    planned, done = run_study(p, runner, str(tmp_path))
    assert done and planned == list(dict.fromkeys(runner.ran))  # a later sweep call lists the rates run before
    phases = [j.phase for j in runner.ran]
    assert phases == sorted(phases, key=["sweep", "grid", "seeds", "throughput", "compute", "recall"].index)
    sweep = [j for j in runner.ran if j.phase == "sweep"]
    assert sorted({j.lr for j in sweep}) == [1e-3, 2e-3, 4e-3, 8e-3]  # extended twice past the winning edge
    grid = [j for j in runner.ran if j.phase == "grid"]
    assert {j.lr for j in grid} == {8e-3} and len(grid) == 2 * 3
    assert [(j.variant, j.seed) for j in runner.ran if j.phase == "seeds"] == [("softmax", 4), ("cosine", 4)]
    compute = [j for j in runner.ran if j.phase == "compute"]
    assert {(j.variant, j.steps) for j in compute} == {("cosine", 2 * p.steps)} and len(compute) == len(p.seeds)
    recall = [j for j in runner.ran if j.phase == "recall"]
    assert {j.lr for j in recall} == set(p.recall_lrs) and {j.seed for j in recall} == set(p.seeds)
    assert len(recall) == 2 * len(p.recall_cells) * len(p.seeds) * len(p.recall_lrs)


# ----------------------------------------------------------------------------- the queue

def test_the_queue_resumes_a_killed_run_skips_done_ones_and_retries_failures(tmp_path, data_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    p = protocol(seq_lens=(32,), seeds=(1,), variants=("softmax",), convs=(0,), data_path=data_path,
                 test_windows=2)
    runs = tmp_path / "runs"
    (job,) = grid_jobs(p, str(runs), {("softmax", 0, 32): 2e-3})
    # A run that a killed study left half done: its checkpoint, and no result.
    import train
    assert train.main([*job.commands[0][1:], "--max_iters", "4"]) == 0
    runner = Runner(runs, [None], deadline=math.inf, log=lambda *_: None, gpus={None: "CPU"})
    assert runner.pending([job]) == [job]
    assert runner.run([job])
    result = read_result(runs / job.name)
    assert result["status"] == "ok" and result["steps"] == p.steps and result["gpu"] == "CPU"
    rows = [json.loads(line) for line in (runs / job.name / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "train/loss" in r] == list(range(1, p.steps + 1))
    assert result["evaluation"]["same_target"]["cuts"] == [16, 32, 64]
    assert math.isfinite(result["evaluation"]["sliding"]["bpc"]) and "max_weight" in result["attention"]
    assert result["best_val_bpc"] <= result["val_bpc"]
    # Done: not run again. Failed: run again, and the reason is kept until then.
    assert runner.pending([job]) == []
    (broken,) = grid_jobs(dataclasses.replace(p, data_path="/nonexistent"), str(runs), {("softmax", 0, 32): 1e-3})
    assert not runner.run([broken])
    assert "failed (exit 2)" in read_result(runs / broken.name)["status"]
    assert "/nonexistent" in read_result(runs / broken.name)["status"]
    assert runner.pending([broken]) == [broken]
    # The same run under another protocol (here more epochs) is refused, not resumed or taken as done.
    (longer,) = grid_jobs(dataclasses.replace(p, epochs=4.0), str(runs), {("softmax", 0, 32): 2e-3})
    with pytest.raises(StudyError, match="other settings .*grid_softmax_c0_T32"):
        runner.run([longer])


def test_a_worker_runs_on_the_gpu_its_index_names_among_those_the_study_was_given(tmp_path, monkeypatch):
    runner = Runner(tmp_path, ["1"], deadline=math.inf, log=lambda *_: None)
    show = [sys.executable, "-c", "import os; print('visible', os.environ['CUDA_VISIBLE_DEVICES'])"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,7")  # the study was given GPUs 5 and 7: its GPU 1 is 7
    assert runner._subprocess(show, tmp_path / "a.log", "1") == (0, False)
    assert "visible 7" in (tmp_path / "a.log").read_text()
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert runner._subprocess(show, tmp_path / "b.log", "1") == (0, False)
    assert "visible 1" in (tmp_path / "b.log").read_text()


def test_throughput_is_a_process_per_context_with_every_variant():
    p = protocol()
    jobs = throughput_jobs(p, "runs")
    assert [j.seq_len for j in jobs] == sorted(p.seq_lens) and len({j.name for j in jobs}) == len(jobs)
    for job in jobs:
        (script, *argv), = job.commands
        assert script == "scripts/throughput.py" and job.exclusive
        assert argv[argv.index("--seq-lens") + 1] == str(job.seq_len)
        assert argv[argv.index("--variants") + 1] == ",".join(p.variants)
        assert argv[argv.index("--out") + 1] == f"runs/{job.name}/throughput"


def test_throughput_has_its_gpu_alone_while_training_runs_share_it(tmp_path, monkeypatch):
    import threading
    import time
    spans, lock = [], threading.Lock()

    def execute(self, job, device):
        start = time.monotonic()
        time.sleep(0.2)
        with lock:
            spans.append((job, device, start, time.monotonic()))
        self.run_dir(job).mkdir(parents=True, exist_ok=True)
        return {"name": job.name, "commands": command_lines(job), "status": "ok"}

    monkeypatch.setattr(Runner, "_execute", execute)
    p = protocol(convs=(0,))
    jobs = (sweep_jobs(p, str(tmp_path)) + throughput_jobs(p, str(tmp_path))
            + grid_jobs(p, str(tmp_path), {(v, 0, t): 1e-3 for v in p.variants for t in p.seq_lens}))
    runner = Runner(tmp_path, ["0", "1"], deadline=math.inf, log=lambda *_: None, per_device=3)
    assert runner.run(jobs)
    assert sorted(j.name for j, *_ in spans) == sorted(j.name for j in jobs)

    def overlapping(a, b):
        return a[1] == b[1] and a[2] < b[3] and b[2] < a[3] and a is not b

    assert not any(overlapping(a, b) for a in spans if a[0].exclusive for b in spans)

    def most_at_once(device):
        events = sorted([(s, 1) for j, d, s, _ in spans if d == device] + [(e, -1) for j, d, _, e in spans if d == device])
        running = [0]
        for _, change in events:
            running.append(running[-1] + change)
        return max(running)

    assert most_at_once("0") == most_at_once("1") == 3  # three at once on a GPU


# ----------------------------------------------------------------------------- the report

def block_losses(bpc: float, cuts, rng, spread: float = 0.02) -> dict:
    """An evaluation.json's same_target entry: 2 windows x 2 blocks per cut, around `bpc` (minus a gain per cut)."""
    losses = [[[(bpc - 0.05 * i + spread * rng.standard_normal()) * math.log(2) for _ in range(2)]
               for _ in range(2)] for i, _ in enumerate(cuts)]
    return {"cuts": list(cuts), "block_loss": losses, "targets": 128, "window": 256, "windows": 2, "block": 64}


# What train.py logs as val/attn/* for a 1-layer, 2-head model (TINY_MODEL).
ONE_LAYER_ATTENTION = {"max_weight": 0.3, "entropy": 2.0, "entropy_uniform": 4.0, "max_weight_heads": [[0.2, 0.4]],
                       "entropy_heads": [[1.5, 2.5]]}


def report_results(p: Protocol) -> list[dict]:
    rng = np.random.default_rng(0)
    results = [sweep_result(v, c, t, lr, 2.0 - lr * 10 if v == "softmax" else 2.0 + (lr - 2e-3) ** 2)
               for v in p.variants for c in p.convs for t in p.swept_seq_lens for lr in p.lrs]
    for seed in p.seeds:
        for c in p.convs:
            for t in p.seq_lens:
                for v in p.variants:
                    # cosine beats softmax by 0.2 (clearly); conv 3 changes nothing beyond noise.
                    bpc = 1.6 + (0.2 if v == "softmax" else 0.0) + 0.01 * rng.standard_normal()
                    evaluation = {"bpc": bpc, "sliding": {"bpc": bpc - 0.01},
                                  "same_target": block_losses(bpc, p.cuts_for(t), rng)}
                    results.append(grid_result(v, c, t, seed, bpc, lr=4e-3 if v == "softmax" else 2e-3,
                                               evaluation=evaluation, attention=ONE_LAYER_ATTENTION))
    # One run began to memorise: its final val is 0.1 above its best.
    results[-1] = {**results[-1], "val_bpc": results[-1]["best_val_bpc"] + 0.1, "best_step": 3}
    # Equal compute: cosine again with twice the steps, 0.1 better than its equal-token runs.
    results += [grid_result("cosine", 0, 32, seed, 1.5 + 0.01 * rng.standard_normal(), phase="compute", steps=20)
                for seed in p.seeds]
    # Recall: at its best rate softmax solves the easiest cell with two seeds of three: the probe is invalid.
    results += [recall_result(v, seed, t, n, 1.0 if v == "softmax" and seed != 3 and lr == 3e-3 else 0.01, lr)
                for v in p.variants for seed in p.seeds for t, n in p.recall_cells for lr in p.recall_lrs]
    results.append({**results[-1], "name": "broken", "status": "failed (exit 1): out of memory"})
    return results


def test_a_hybrids_blocks_are_shown_by_the_attention_they_run_and_fastmax_gets_its_verdict(tmp_path):
    # Two blocks: block 1 is Based's 64-byte sliding-window softmax (model.attention.layer_window), block 0 fastmax.
    p = protocol(variants=("softmax", "fastmax-swa"), convs=(0,), seq_lens=(64, 1024),
                 extra=("--n_layer", "2", "--n_head", "2", "--n_embd", "32"))
    attention = {"max_weight_heads": [[0.01, 0.03], [0.6, 0.8]], "entropy_heads": [[3.0, 3.2], [1.0, 1.2]],
                 "entropy_uniform": (4.0 + math.log(64)) / 2, "max_weight": 0.36, "entropy": 2.1}
    rng = np.random.default_rng(0)
    results = [grid_result(v, 0, t, seed, 1.8, attention=attention,
                           evaluation={"bpc": 1.8, "same_target": block_losses(1.8, p.cuts_for(t), rng)})
               for seed in p.seeds for t in p.seq_lens for v in p.variants]
    Report(p, results, [], "CPU", "python compare.py", 1).write(tmp_path)
    md = (tmp_path / "report.md").read_text()
    table = md.split("## How concentrated each attention's weights are")[1].split("##")[0]
    hybrid = "| fastmax + sliding-window softmax (our kernels; Based), its "
    assert f"{hybrid}fastmax blocks | 0 | 1,024 | 0.020 | 3.100 | 4.000 |" in table  # the uniform: the mean less log 64
    assert f"{hybrid}64-byte sliding-window softmax blocks | 0 | 1,024 | 0.700 | 1.100 | 4.159 |" in table
    # At 64 bytes the rows measured (every position) do not all see a whole window: no uniform to split.
    assert f"{hybrid}fastmax blocks | 0 | 64 | 0.020 | 3.100 | – |" in table
    assert "| softmax (SDPA) | 0 | 64 | 0.360 | 2.100 | 4.079 |" in table  # one group: every block's mean
    fastmax = md.split("## Fastmax at long context")[1].split("##")[0]
    assert "short_conv 0: uses it: the same bytes score lower" in fastmax
    assert "its fastmax weights' largest 0.020" in fastmax
    assert ("Of these, fastmax + sliding-window softmax (our kernels; Based) with short_conv 0 uses the long "
            "context.") in fastmax


def test_a_difference_only_the_unadjusted_interval_calls_is_not_established():
    # Seeds 1-3 differ by -0.10, -0.11, -0.12: the t interval excludes 0 (p ~ 0.004), but a Holm-adjusted p of 0.2
    # (many comparisons) does not let the report call it.
    diff = paired({1: 2.0, 2: 2.0, 3: 2.0}, {1: 1.90, 2: 1.89, 3: 1.88})
    assert diff.excludes_zero
    assert Report.words({"diff": diff, "holm": 0.2}, "lower", "higher").startswith(
        "not established (Holm): -0.110 bpc")
    assert Report.words({"diff": diff, "holm": 0.01}, "lower", "higher").startswith("lower: -0.110 bpc")
    noisy = paired({1: 2.0, 2: 2.0, 3: 2.0}, {1: 1.8, 2: 2.1, 3: 2.05})
    assert Report.words({"diff": noisy, "holm": 0.9}, "lower", "higher").startswith("within noise: ")


def test_the_report_words_follow_the_statistics(tmp_path):
    p = protocol()
    results = report_results(p)
    Report(p, results, [], "CPU", "python compare.py", 123456).write(tmp_path)
    md = (tmp_path / "report.md").read_text()
    says = md.split("## What the data says")[1].split("## What it does not show")[0]
    assert "**32 bytes, short_conv 0** (test bpc against softmax (SDPA)): cosine (PyTorch reference) lower than " \
           "softmax: -0.207 bpc [-0.242, -0.172] (n=3, Holm p = 0.0138)" in says
    assert "**short_conv 3 against 0, cosine (PyTorch reference)**: 32: within noise" in says
    assert "Holm p =" in says and "beats" not in md
    assert "| cosine (PyTorch reference) | 0 | **-0.2" in says  # the glance table: established, so in bold
    assert "| cosine (PyTorch reference) | 3 | **-0.2" in says and "| softmax (SDPA) |" not in says
    assert "uses it: the same bytes score lower" in says  # each cut 0.05 lower in the made-up curves
    table = md.split("## Paired differences")[1].split("##")[0]
    assert "| cosine - softmax, conv 0, 32 | 3 | -0.2" in table
    assert f"adjusted over all {len(comparisons(p))} comparisons" in table
    assert "1 grid run(s) ended more than 0.02 bpc above their best evaluation" in md
    assert ("**The probe is invalid**: at no rate did softmax (SDPA) solve the easiest cell (32 bytes, 4 pairs) "
            "in every seed") in md
    assert "| softmax (SDPA) | 2/3 (0.003, **edge**) | 2/3 (0.003, **edge**) |" in md
    assert "| cosine (PyTorch reference) | 0/3 | 0/3 |" in md
    assert "## How concentrated each attention's weights are" in md and "| 0.300 | 2.000 | 4.000 |" in md
    compute = md.split("## Equal compute")[1].split("##")[0]
    assert "| cosine (PyTorch reference) | 0 | 32 | 20 | 1.5" in compute and "| -0.3" in compute
    assert "`broken`: failed (exit 1): out of memory" in md
    assert "Quality floor not met" not in md
    for name in ("test_bpc_by_context", "same_target_context"):
        assert (tmp_path / f"{name}.png").read_bytes()[:8] == PNG_MAGIC and f"]({name}.png)" in md
    saved = json.loads((tmp_path / "results.json").read_text())
    assert len(saved["runs"]) == len(results) and saved["protocol"]["seeds"] == [1, 2, 3]
    # The per-cell summary the docs' table reads (bench/tables.py does no statistics of its own).
    cell = next(c for c in saved["cells"] if (c["variant"], c["conv"], c["seq_len"]) == ("cosine", 0, 32))
    mean, low, high = cell["test_bpc"]
    assert cell["seeds"] == 3 and low < mean < high and abs(mean - 1.6) < 0.03
    assert len(saved["cells"]) == len(p.variants) * len(p.convs) * len(p.seq_lens)


def test_the_recall_probe_is_unsettled_until_softmax_has_run_every_seed_at_every_rate(tmp_path):
    p = protocol()
    (t, n), seeds = p.recall_cells[0], p.seeds

    def recall(seed: int, lr: float, accuracy: float) -> dict:
        return recall_result("softmax", seed, t, n, accuracy, lr)

    def verdict(results: list[dict]) -> str:
        Report(p, results, [], "CPU", "python compare.py", 1).write(tmp_path)
        return (tmp_path / "report.md").read_text().split("## Associative recall")[1].split("|")[0]

    assert "Not settled yet: 0 of 6 of softmax (SDPA)'s runs of the easiest cell (32 bytes, 4 pairs)" in verdict([])
    solves_at_1e3 = [recall(s, 1e-3, 1.0) for s in seeds]
    assert "Not settled yet: 3 of 6" in verdict(solves_at_1e3)  # 3e-3 might solve it faster: not run yet
    fails = [recall(seeds[0], lr, 0.01) for lr in p.recall_lrs]
    assert "**The probe is invalid**" in verdict(fails)  # a failing seed at every rate settles it
    assert "in every seed at its best rate: the probe can tell the attentions apart" in verdict(
        solves_at_1e3 + [recall(s, 3e-3, 0.01) for s in seeds])


def test_the_recall_table_flags_a_rate_at_the_edge_of_the_sweep(tmp_path):
    p = protocol(variants=("softmax", "cosine"), recall_lrs=(1e-3, 3e-3, 1e-2))
    fastest = {"softmax": 1e-2, "cosine": 3e-3}
    results = [recall_result(v, seed, t, n, 1.0, lr, 100 if lr == fastest[v] else 400)
               for v in p.variants for lr in p.recall_lrs for seed in p.seeds for t, n in p.recall_cells]
    Report(p, results, [], "CPU", "python compare.py", 1).write(tmp_path)
    md = (tmp_path / "report.md").read_text()
    assert "| softmax (SDPA) | 3/3 (0.01, **edge**) | 3/3 (0.01, **edge**) |" in md
    assert "| cosine (PyTorch reference) | 3/3 (0.003) | 3/3 (0.003) |" in md


def test_a_pilot_says_so_and_how_to_run_the_full_study(tmp_path):
    p = protocol(data_path="enwik8-first4mb", train_bytes=3_738_658)
    Report(p, [], [], "CPU", "python compare.py", 1).write(tmp_path)
    md = (tmp_path / "report.md").read_text()
    assert "**A pilot on a local copy" in md and "runs it on the full file" in md
    assert "Transformer-XL" in md


# ----------------------------------------------------------------------------- compare.py

def test_a_cpu_only_machine_is_told_what_to_do(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exc:
        compare.main([])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "trains its runs on CUDA GPUs" in err and "--device cpu" in err


@pytest.mark.parametrize("args, expected", [
    (["--variants", "softmax,flash4"], "--variants: expected a comma list"),
    (["--seq-lens", "64,x"], "--seq-lens: invalid comma-separated positive int value"),
    (["--lrs", "1e-3,-1"], "--lrs: invalid comma-separated positive float value"),
    (["--convs", "0,1"], "--convs: invalid comma-separated short_conv"),
    (["--recall-cells", "256by16"], "--recall-cells: invalid comma-separated LENGTHxPAIRS value"),
    (["--seq-lens", "32768", "--tokens-per-step", "16384"], "--seq-lens: each at most --tokens-per-step=16384"),
    (["--epochs", "0"], "--epochs: expected > 0"),
    (["--seeds", "1,2,3", "--max-seeds", "2"], "--max-seeds: expected at least the 3 seeds"),
    (["--sweep-seed", "1"], "--sweep-seed: expected a seed outside --seeds"),
    (["--stop-accuracy", "2"], "--stop-accuracy: expected an accuracy in (0, 1]"),
    (["--data-path", "/nonexistent"], "--data-path: data_path: /nonexistent does not exist"),
    (["--seq-lens", "128", "--tokens-per-step", "128"], "--cuts: expected one at most the shortest context (128)"),
    (["--", "--lr", "1"], "--lr after --: compare.py sets it for every run"),
    (["--", "--short_conv", "3"], "--short_conv after --: compare.py sets it for every run"),
])
def test_bad_arguments_are_usage_errors(capsys, args, expected):
    with pytest.raises(SystemExit) as exc:
        compare.main(["--dry-run", *args])
    assert exc.value.code == 2 and expected in capsys.readouterr().err


def test_past_the_deadline_no_run_starts_and_the_report_says_what_is_missing(tmp_path, data_path, capsys):
    args = ["--device", "cpu", "--config", "configs/tiny_cpu", "--variants", "softmax", "--seq-lens", "32",
            "--convs", "0", "--seeds", "1", "--max-seeds", "1", "--epochs", "0.0005", "--tokens-per-step", "256",
            "--lrs", "2e-3,4e-3", "--cuts", "16,32", "--targets", "64", "--data-path", data_path,
            "--wandb-mode", "disabled", "--recall-cells", "",
            "--runs-dir", str(tmp_path / "runs"), "--time-limit", "1e-9", "--", *TINY_MODEL]
    assert compare.main(args) == 1
    md = (tmp_path / "runs" / "study" / "report" / "report.md").read_text()
    assert "**Incomplete:** 2 of 2 planned runs have no result yet" in md  # the sweep's: the grid waits for it
    assert "Quality floor not met" not in md  # no grid run yet is not a run below the floor
    assert "so the report goes to" in capsys.readouterr().out  # not over the committed study


@pytest.mark.slow
def test_a_tiny_study_runs_end_to_end_and_a_second_call_redoes_nothing(tmp_path, data_path, monkeypatch):
    monkeypatch.setattr(study.jobs, "SAME_SPEED", 0.0)  # two attentions' CPU speeds may be within 5%: run both
    args = ["--device", "cpu", "--config", "configs/tiny_cpu", "--variants", "softmax,cosine", "--seq-lens", "32",
            "--convs", "0", "--seeds", "1,2", "--max-seeds", "2", "--epochs", "0.0005", "--tokens-per-step", "256",
            "--lrs", "2e-3", "--eval-tokens", "256", "--cuts", "16,32,64", "--targets", "64", "--test-windows", "2",
            "--recall-cells", "32x4", "--recall-lrs", "1e-3,3e-3", "--recall-steps", "5", "--data-path", data_path,
            "--wandb-mode", "disabled", "--runs-dir", str(tmp_path / "runs"), "--out", str(tmp_path / "report"),
            "--", *TINY_MODEL]
    assert compare.main(args) == 0
    results = json.loads((tmp_path / "report" / "results.json").read_text())["runs"]
    phases = [r["phase"] for r in results]
    assert {p: phases.count(p) for p in phases} == {"grid": 4, "throughput": 1, "compute": 2, "recall": 2 * 2 * 2}
    assert all(r["status"] == "ok" for r in results)
    grid = [r for r in results if r["phase"] in ("grid", "compute")]
    assert all(math.isfinite(r["evaluation"]["bpc"]) for r in grid)  # equal compute is scored as the grid is
    assert all(r["evaluation"]["same_target"]["cuts"] == [16, 32, 64] for r in grid if r["phase"] == "grid")
    md = (tmp_path / "report" / "report.md").read_text()
    assert "## What the data says" in md and "Quality floor not met" in md  # a few steps learn nothing
    assert "## Equal compute" in md and "## Associative recall" in md
    mtimes = {p: p.stat().st_mtime for p in (tmp_path / "runs").glob("*/*/metrics.jsonl")}
    assert compare.main(args) == 0
    assert {p: p.stat().st_mtime for p in mtimes} == mtimes
