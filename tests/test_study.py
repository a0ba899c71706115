"""The long-context study on CPU: the plan (compare.py --dry-run), the queue and its resume, failures, the
report from made-up results, the CPU refusal and bad arguments, and a whole tiny study end to end."""
import dataclasses
import json
import math
import shlex
from pathlib import Path

import pytest
import torch

import compare
from lab.config import parse_args
from study.jobs import Protocol, after_sweep, grid_jobs, sweep_jobs
from study.report import Report, chosen_lrs
from study.runner import Runner, StudyError, read_result

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
TINY_MODEL = ["--n_layer", "1", "--n_head", "2", "--n_embd", "32", "--final_eval_max_windows", "8"]


def tiny_study(tmp_path: Path, data_path: str, *more: str) -> list[str]:
    return ["--device", "cpu", "--config", "configs/tiny_cpu", "--variants", "softmax,cosine", "--seq-lens", "32,64",
            "--seeds", "1,2", "--steps", "8", "--sweep-steps", "4", "--tokens-per-step", "256", "--lrs", "2e-3,4e-3",
            "--evals", "2", "--eval-tokens", "512", "--recall-seq-lens", "", "--data-path", data_path,
            "--wandb-mode", "disabled", "--runs-dir", str(tmp_path / "runs"), "--out", str(tmp_path / "report"),
            *more, "--", *TINY_MODEL]


def protocol(**overrides) -> Protocol:
    fields = dict(config="configs/tiny_cpu", variants=("softmax", "cosine"), seq_lens=(32, 64), seeds=(1, 2, 3),
                  steps=10, tokens_per_step=256, lrs=(1e-3, 2e-3), sweep_steps=5, evals=2, eval_tokens=512,
                  recall_seq_lens=(), recall_pairs=(4,), recall_steps=10, recall_config="configs/recall",
                  data_path=None, device="cpu", wandb_mode="disabled", wandb_group="g", extra=tuple(TINY_MODEL))
    return Protocol(**{**fields, **overrides})


def test_dry_run_gives_every_run_the_same_budget_and_schedule(capsys):
    assert compare.main(["--dry-run", "--seq-lens", "1024,4096,16384", "--seeds", "1,2,3", "--recall-seq-lens", ""]) == 0
    out = capsys.readouterr().out.splitlines()
    configs = [parse_args(shlex.split(line)[2:])[0] for line in out if line.startswith("python train.py ")]
    sweep = [c for c in configs if c.run_name.startswith("sweep_")]
    grid = [c for c in configs if c.run_name.startswith("grid_")]
    assert len(sweep) == 4 * 3 and len(grid) == 4 * 3 * 3
    assert {(c.batch_size * c.seq_len, c.max_iters, c.warmup_iters, c.lr_decay_iters) for c in grid} == {
        (32768, 1500, 150, 1500)}
    assert {c.seq_len for c in sweep} == {1024} and sorted({c.seed for c in grid}) == [1, 2, 3]
    assert {(c.attention, c.use_cuda_kernel, c.cosine_sdpa) for c in grid} == {
        ("softmax", False, False), ("cosine", False, True), ("cosine", True, False), ("fastmax", True, False)}
    assert all(c.min_lr == c.lr / 10 and c.sample_tokens == 0 for c in configs)
    assert "the sweep chooses" in out[0]


def test_a_stopped_study_has_every_cell_once_before_any_twice():
    p = protocol(seq_lens=(32, 64), seeds=(1, 2), recall_seq_lens=(64,))
    jobs = after_sweep(p, "runs", {"softmax": 2e-3, "cosine": 1e-3})
    assert [(j.phase, j.seed, j.seq_len, j.variant) for j in jobs] == [
        ("grid", 1, 64, "softmax"), ("grid", 1, 64, "cosine"), ("grid", 1, 32, "softmax"), ("grid", 1, 32, "cosine"),
        ("recall", 1, 64, "softmax"), ("recall", 1, 64, "cosine"),
        ("grid", 2, 64, "softmax"), ("grid", 2, 64, "cosine"), ("grid", 2, 32, "softmax"), ("grid", 2, 32, "cosine"),
        ("recall", 2, 64, "softmax"), ("recall", 2, 64, "cosine")]
    assert len({j.name for j in jobs}) == len(jobs)


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
    (["--seq-lens", "32768", "--tokens-per-step", "16384"], "--seq-lens: each at most --tokens-per-step=16384"),
    (["--steps", "0"], "--steps: expected > 0"),
    (["--", "--lr", "1"], "--lr after --: compare.py sets it for every run"),
])
def test_bad_arguments_are_usage_errors(capsys, args, expected):
    with pytest.raises(SystemExit) as exc:
        compare.main(["--dry-run", *args])
    assert exc.value.code == 2 and expected in capsys.readouterr().err


def test_the_queue_resumes_a_killed_run_skips_done_ones_and_retries_failures(tmp_path, data_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    p = protocol(seq_lens=(32,), seeds=(1,), variants=("softmax",), data_path=data_path)
    runs = tmp_path / "runs"
    (job,) = grid_jobs(p, str(runs), {"softmax": 2e-3})
    # A run that a killed study left at step 4 of 10: its checkpoint, and no result.
    import train
    assert train.main([*job.argv, "--max_iters", "4"]) == 0
    runner = Runner(runs, [None], deadline=math.inf, log=lambda *_: None)
    assert runner.pending([job]) == [job]
    assert runner.run([job])
    result = read_result(runs / job.name)
    assert result["status"] == "ok" and result["steps"] == 10
    rows = [json.loads(line) for line in (runs / job.name / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "train/loss" in r] == list(range(1, 11))  # steps 1-4, then resumed 5-10
    assert result["extrapolation"]["seq_len"] == 64 and math.isfinite(result["extrapolation"]["bpc"])
    # Done: not run again. Failed: run again, and the reason is kept until then.
    assert runner.pending([job]) == []
    broken = grid_jobs(protocol(seq_lens=(32,), seeds=(1,), variants=("softmax",), data_path="/nonexistent"),
                       str(runs), {"softmax": 1e-3})[0]
    assert not runner.run([broken])
    assert "failed (exit 2)" in read_result(runs / broken.name)["status"]
    assert "/nonexistent" in read_result(runs / broken.name)["status"]
    assert runner.pending([broken]) == [broken]
    # The same run under another protocol (here more steps) is refused, not resumed or taken as done.
    (longer,) = grid_jobs(protocol(seq_lens=(32,), seeds=(1,), variants=("softmax",), steps=20, data_path=data_path),
                          str(runs), {"softmax": 2e-3})
    with pytest.raises(StudyError, match="other settings .*grid_softmax_T32"):
        runner.run([longer])


def test_grid_runs_have_their_gpu_alone_while_sweep_and_recall_runs_share_it(tmp_path, monkeypatch):
    """Runs whose timings the report quotes (the grid) never overlap another on their GPU; the others run
    up to per_device at once on each; consecutive runs of one kind go as one batch, in the queue's order."""
    import threading
    import time
    spans, lock = [], threading.Lock()

    def execute(self, job, device):
        start = time.monotonic()
        time.sleep(0.2)
        with lock:
            spans.append((job, device, start, time.monotonic()))
        self.run_dir(job).mkdir(parents=True, exist_ok=True)
        return {"name": job.name, "command": ["python", "train.py", *job.argv], "status": "ok"}

    monkeypatch.setattr(Runner, "_execute", execute)
    p = protocol(recall_seq_lens=(16,), recall_pairs=(2,))
    jobs = after_sweep(p, str(tmp_path), {"softmax": 2e-3, "cosine": 1e-3})
    runner = Runner(tmp_path, ["0", "1"], deadline=math.inf, log=lambda *_: None, per_device=3)
    assert runner.run(jobs)
    assert sorted(j.name for j, *_ in spans) == sorted(j.name for j in jobs)

    def overlapping(a, b):
        return a[1] == b[1] and a[2] < b[3] and b[2] < a[3] and a is not b

    assert not any(overlapping(a, b) for a in spans if a[0].exclusive for b in spans)
    shared = [a for a in spans if not a[0].exclusive]
    assert max(sum(overlapping(a, b) for b in shared) for a in shared) == 2  # three at once on a GPU
    first_recall = min(s for j, _, s, _ in spans if j.phase == "recall")
    assert all(end <= first_recall for j, _, _, end in spans if j.phase == "grid" and j.seed == 1)


def test_past_the_deadline_no_run_starts_and_the_report_says_what_is_missing(tmp_path, data_path):
    assert compare.main(tiny_study(tmp_path, data_path, "--time-limit", "1e-9")) == 1
    md = (tmp_path / "report" / "report.md").read_text()
    assert "**Incomplete:** 4 of 4 runs have no result yet" in md  # the sweep's: the grid waits for it


def fake_result(phase, variant, seq_len, seed, lr, val, **more):
    curve = [[2**i, val + 1.0 / (i + 1)] for i in range(int(math.log2(seq_len)) + 1)]
    return {"name": f"{phase}_{variant}_T{seq_len}_lr{lr:g}_s{seed}", "phase": phase, "variant": variant,
            "seq_len": seq_len, "seed": seed, "lr": lr, "pairs": None, "status": "ok", "command": ["python", "train.py"],
            "val_bpc": val, "test_bpc": val + 0.01, "train_bpc": val - 0.05, "tokens_per_s": 1000.0 * seq_len,
            "peak_mem_gib": seq_len / 64, "val_bpc_by_position": curve,
            "extrapolation": {"bpc": val * (1.5 if variant == "softmax" else 1.0),
                              "bpc_by_position": [[2 * pos, bpc] for pos, bpc in curve]}, **more}


def test_the_report_from_results_says_what_they_support(tmp_path):
    p = protocol(seq_lens=(32, 1024), recall_seq_lens=(64,))
    # softmax's rate wins by 0.1 bpc; cosine's by 0.015, less than its seeds' std below (0.05): a tie.
    results = [fake_result("sweep", v, 32, 1, lr, 1.9 - lr * 100 if v == "softmax" else 1.97 + lr * 15)
               for v in p.variants for lr in p.lrs]
    # softmax: a clear gain from the longer context; cosine: a difference within the seeds' spread.
    for seed, noise in zip(p.seeds, (-0.05, 0.0, 0.05)):
        results += [fake_result("grid", "softmax", 32, seed, 2e-3, 1.80 + noise / 10),
                     fake_result("grid", "softmax", 1024, seed, 2e-3, 1.60 + noise / 10),
                     fake_result("grid", "cosine", 32, seed, 1e-3, 1.80 + noise),
                     fake_result("grid", "cosine", 1024, seed, 1e-3, 1.79 - noise)]
    results.append({**fake_result("grid", "cosine", 1024, 4, 1e-3, 0.0), "status": "failed (exit 1): out of memory"})
    # recall: softmax learns it with every seed, cosine with one of three.
    results += [{**fake_result("recall", v, 64, seed, 2e-3, 0.5), "pairs": 4, "test_accuracy": acc,
                 "name": f"recall_{v}_T64_P4_s{seed}"}
                for v, accs in (("softmax", (1.0, 0.98, 0.99)), ("cosine", (0.95, 0.01, 0.02)))
                for seed, acc in zip(p.seeds, accs)]
    assert chosen_lrs(results, p.variants, p.lrs) == {"softmax": 2e-3, "cosine": 1e-3}
    jobs = sweep_jobs(p, "runs") + grid_jobs(p, "runs", {"softmax": 2e-3, "cosine": 1e-3})
    out = tmp_path / "report"
    Report(p, results, jobs, "CPU", "python compare.py", 123456).write(out)
    md = (out / "report.md").read_text()
    assert "**softmax (SDPA)**: a longer context helps: val bpc falls by 0.200 from 32 to 1,024 bytes" in md
    assert "**cosine (PyTorch reference)**: the data does not show that a longer context helps" in md
    assert "it breaks (bpc x1.50)" in md and "it holds (bpc x1.00)" in md
    assert ("- **At 1,024 bytes**: softmax (SDPA) has the lowest val bpc (1.600 ± 0.005); cosine (PyTorch reference) "
            "(+0.190) is behind by more than twice the standard error." in md)
    assert ("- **At 32 bytes**: softmax (SDPA) has the lowest val bpc (1.800 ± 0.005); cosine (PyTorch reference) "
            "(+0.000) is within it." in md)
    assert "| softmax (SDPA) | 1,024 | 3 | 1.600 ± 0.005 | 1.610 ± 0.005 | 1.550 ± 0.005 | 0.050 ± 0.000 |" in md
    assert "| softmax (SDPA) | 0.002 | 0.002 | 0.002 |" not in md and "| 1.800 | 1.700 | 0.002 |" in md
    assert "`grid_cosine_T1024_lr0.001_s4`: failed (exit 1): out of memory" in md
    assert "the rates tie and the choice is the sweep's seed's: cosine (PyTorch reference) by 0.015 bpc (seeds' std 0.050)." in md
    assert "| softmax (SDPA) | 0.990 ± 0.010, 3/3 learned |" in md
    assert "| cosine (PyTorch reference) | 0.327 ± 0.540, 1/3 learned |" in md
    assert (out / "recall.png").read_bytes().startswith(PNG_MAGIC)
    assert "Quality floor not met" not in md and "**Incomplete:**" not in md
    assert "The train bpc rises" not in md and "compute the same function" not in md
    assert "learns the recall task reliably" not in md  # softmax learned it with every seed
    for name in ("val_bpc_by_context", "bpc_by_position", "extrapolation", "throughput_memory"):
        assert (out / f"{name}.png").read_bytes()[:8] == PNG_MAGIC
        assert f"]({name}.png)" in md
    saved = json.loads((out / "results.json").read_text())
    assert len(saved["runs"]) == len(results) and saved["protocol"]["seeds"] == [1, 2, 3]


def test_the_report_says_what_its_runs_cannot_show(tmp_path):
    """The budget and rate caveats always; under-fitting where the train bpc rises with the context; the few
    windows behind the long positions; and two ways of computing one function named as such."""
    p = protocol(variants=("cosine-sdpa", "cosine-kernel"), seq_lens=(32, 1024), lrs=(1e-3,), eval_tokens=4096)
    results = [fake_result("grid", v, t, seed, 1e-3, (1.8 if t == 32 else 2.2) + (v == "cosine-kernel") / 10
                           + seed / 100) for v in p.variants for t in p.seq_lens for seed in p.seeds]
    results += [{**fake_result("recall", v, 64, seed, 1e-3, 0.5), "pairs": 4, "test_accuracy": 0.99 if seed == 1 else 0.01,
                 "name": f"recall_{v}_T64_P4_s{seed}"} for v in p.variants for seed in p.seeds]
    p = dataclasses.replace(p, recall_seq_lens=(64,))
    Report(p, results, [], "CPU", "python compare.py", 123456).write(tmp_path)
    md = (tmp_path / "report.md").read_text()
    limits = md.split("## What it does not show")[1].split("\n\n")[1]
    assert "No attention learns the recall task reliably in 10 steps (the best, 1 of 3 runs)" in limits
    assert "a 1,024-byte run trains on 1 sequence(s) a step against 8 at 32" in limits
    assert "learning rate was chosen at 32 bytes and kept at every context" in limits
    assert ("The train bpc rises with the context too (cosine (SDPA, cuDNN, on l2-normalised q, k) 2.17 against "
            "1.77; cosine (our kernels) 2.27 against 1.87, at 1,024 and 32 bytes)") in limits
    assert "At 1,024 bytes the val bpc by position averages 4 window(s)" in limits
    assert ("cosine (SDPA, cuDNN, on l2-normalised q, k) and cosine (our kernels) compute the same function; what "
            "separates them (up to 0.100 bpc here) is how it is computed and rounded, and the seeds") in limits


@pytest.mark.slow
def test_a_tiny_study_runs_end_to_end_and_a_second_call_redoes_nothing(tmp_path, data_path):
    args = tiny_study(tmp_path, data_path)
    assert compare.main(args) == 0
    results = json.loads((tmp_path / "report" / "results.json").read_text())["runs"]
    assert sorted(r["phase"] for r in results) == ["grid"] * 8 + ["sweep"] * 4
    assert all(r["status"] == "ok" and math.isfinite(r["val_bpc"]) for r in results)
    grid = [r for r in results if r["phase"] == "grid"]
    assert all(r["extrapolation"]["seq_len"] == 2 * r["seq_len"] for r in grid)
    assert {r["lr"] for r in grid} <= {2e-3, 4e-3}
    md = (tmp_path / "report" / "report.md").read_text()
    assert "## What the data says" in md and "Quality floor not met" in md  # 8 steps learn nothing
    mtimes = {p: p.stat().st_mtime for p in (tmp_path / "runs").glob("*/*/metrics.jsonl")}
    assert compare.main(args) == 0
    assert {p: p.stat().st_mtime for p in mtimes} == mtimes
