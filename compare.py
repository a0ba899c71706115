"""The long-context study: softmax, cosine-sim and fastmax attention trained at several context lengths
with several seeds on one budget, and a report of what that shows (make compare).

    python compare.py                                   # the study, on every GPU of this machine
    python compare.py --data-path enwik8-first4mb --time-limit 540   # a local copy; stop (resumably) in 9 min
    python compare.py --dry-run                         # the plan: every run's train.py command
    python compare.py --device cpu --config configs/tiny_cpu --variants softmax,cosine --seq-lens 32,64 \\
        --seeds 1,2 --steps 20 --tokens-per-step 256 --lrs 2e-3 --recall-seq-lens "" -- --n_layer 1   # CPU smoke

Every run is `python train.py` (study/jobs.py writes its flags), from a shared queue over the GPUs
(study/runner.py; a grid run has its GPU alone, sweep and recall runs share one --runs-per-gpu at a time):
first a learning-rate sweep at the shortest context, then every variant x context x seed at the rate its
sweep chose (each evaluated again at twice its context), then the associative-recall probe.
A run with a result is not run again, so the same command after a stop (--time-limit, a crash, a killed
machine) goes on where it was. The report (study/report.py) goes to --out: report.md, PNG plots and
results.json with every run. All runs log to one wandb group (offline where there is no login: `wandb sync`).
"""
from __future__ import annotations

import argparse
import math
import shlex
import sys
import time
from pathlib import Path

import torch

from lab.cli import choice_list, index_list, int_list, refuse_train_flags, require_positive, split_train_flags
from lab.config import WANDB_MODES, usage_error
from lab.config import parse_args as parse_train_args
from model import GPT
from model.variants import VARIANTS
from study.jobs import Protocol, after_sweep, sweep_jobs
from study.report import Report, chosen_lrs, collect
from study.runner import Runner, StudyError

ROOT = Path(__file__).resolve().parent
DEFAULT_VARIANTS = "softmax,cosine-sdpa,cosine-kernel,fastmax-kernel"
# train.py fields the study sets for every run; setting them after -- would break the shared protocol.
CONTROLLED = {"config", "resume", "attention", "use_cuda_kernel", "cosine_sdpa", "sdpa_backend", "seq_len",
              "batch_size", "grad_accum_steps", "max_iters", "lr_decay_iters", "warmup_iters", "lr", "min_lr",
              "eval_interval", "eval_max_windows", "seed", "data_path", "device", "out_dir", "run_name",
              "wandb_run_name", "wandb_mode", "wandb_group", "wandb_tags", "sample_tokens", "ckpt_interval", "task",
              "recall_pairs"}


def float_list(text: str) -> list[float]:
    values = [float(v) for v in text.split(",") if v.strip()]
    if not values or not all(math.isfinite(v) and v > 0 for v in values):
        raise ValueError(text)
    return values


float_list.__name__ = "comma-separated positive float"


def int_list_or_none(text: str) -> list[int]:
    return int_list(text) if text.strip() else []


int_list_or_none.__name__ = int_list.__name__


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """(options, train.py flags given after --), or exit 2 naming the bad argument."""
    ours, extra = split_train_flags(argv)
    parser = argparse.ArgumentParser(prog="compare.py", description=__doc__.split("\n\n")[0],
                                     usage="compare.py [options] [-- train.py flags]")
    add = parser.add_argument
    add("--config", default="configs/study", help="train.py config of every enwik8 run (default %(default)s)")
    add("--variants", default=DEFAULT_VARIANTS, help="comma list of model/variants.py's (default %(default)s)")
    add("--seq-lens", type=int_list, default=[1024, 8192, 32768], help="contexts, comma list (default 1024,8192,32768)")
    add("--seeds", type=int_list, default=[1, 2, 3], help="seeds, comma list (default 1,2,3)")
    add("--steps", type=int, default=1500, help="optimizer steps per run (default %(default)s)")
    add("--tokens-per-step", type=int, default=32768, help="batch x context, every run (default %(default)s)")
    add("--lrs", type=float_list, default=[1e-3, 2e-3, 4e-3],
        help="the sweep's peak rates at the shortest context; one rate = no sweep (default 1e-3,2e-3,4e-3)")
    add("--sweep-steps", type=int, default=500, help="steps per sweep run (default %(default)s)")
    add("--evals", type=int, default=4, help="periodic evaluations per run (default %(default)s)")
    add("--eval-tokens", type=int, default=2**17, help="val tokens per periodic evaluation (default %(default)s)")
    add("--recall-seq-lens", type=int_list_or_none, default=[256, 1024],
        help="the recall probe's sequence lengths; empty = no probe (default 256,1024)")
    add("--recall-pairs", type=int_list, default=[16, 64], help="key-value pairs per sequence (default 16,64)")
    add("--recall-steps", type=int, default=1000, help="steps per recall run (default %(default)s)")
    add("--recall-config", default="configs/recall", help="train.py config of the recall runs")
    add("--data-path", default=None, help="a local enwik8 copy (default: the verified download)")
    add("--device", default="auto", help="auto: every visible GPU (the study needs them); cpu: a smoke run")
    add("--gpus", type=index_list, default=None, help="GPU indices to use (default: all visible)")
    add("--runs-per-gpu", type=int, default=3, help="sweep and recall runs sharing a GPU at once (their timings are "
        "not reported; a grid run has its GPU alone) (default %(default)s)")
    add("--wandb-mode", default="auto", choices=WANDB_MODES)
    add("--name", default="study", help="the study's name: its wandb group and its runs' folder (default %(default)s)")
    add("--runs-dir", default="out", help="runs go to RUNS_DIR/NAME/ (default %(default)s)")
    add("--out", default="bench/study", help="report folder (default %(default)s)")
    add("--time-limit", type=float, default=math.inf, help="seconds for this call; the rest resumes later")
    add("--dry-run", action="store_true", help="print the plan and the commands; run nothing")
    args = parser.parse_args(ours)
    args.variants = choice_list(parser, "--variants", args.variants, VARIANTS)
    require_positive(parser, args, ("steps", "tokens_per_step", "sweep_steps", "evals", "eval_tokens",
                                    "recall_steps", "time_limit", "runs_per_gpu"))
    bad = [t for t in args.seq_lens + args.recall_seq_lens if t > args.tokens_per_step]
    if bad:
        parser.error(f"--seq-lens: each at most --tokens-per-step={args.tokens_per_step} (batch = tokens per step / "
                     f"context), not {', '.join(map(str, bad))}")
    refuse_train_flags(parser, extra, CONTROLLED, "sets it for every run (see its own options)")
    return args, extra


def devices(args) -> list[str | None]:
    """The workers' CUDA_VISIBLE_DEVICES values (None: the CPU), or exit 2 where the study cannot run."""
    if args.device == "cpu":
        return [None]
    if not torch.cuda.is_available():
        usage_error("the study trains its runs on CUDA GPUs and this machine has none (torch.cuda.is_available() is "
               "False): run it on a GPU machine, or pass --device cpu with a tiny config for a smoke run (see "
               "compare.py --help)")
    visible = range(torch.cuda.device_count())
    chosen = args.gpus if args.gpus is not None else list(visible)
    if not chosen or any(g not in visible for g in chosen):
        usage_error(f"--gpus: expected indices among {list(visible)}, got {args.gpus}")
    return [str(g) for g in chosen]


def main(argv: list[str] | None = None) -> int:
    args, extra = parse_args(sys.argv[1:] if argv is None else argv)
    runs_dir = Path(args.runs_dir) / args.name
    p = Protocol(config=args.config, variants=tuple(args.variants), seq_lens=tuple(args.seq_lens),
                 seeds=tuple(args.seeds), steps=args.steps, tokens_per_step=args.tokens_per_step,
                 lrs=tuple(args.lrs), sweep_steps=args.sweep_steps, evals=args.evals, eval_tokens=args.eval_tokens,
                 recall_seq_lens=tuple(args.recall_seq_lens), recall_pairs=tuple(args.recall_pairs),
                 recall_steps=args.recall_steps, recall_config=args.recall_config, data_path=args.data_path,
                 device="cpu" if args.device == "cpu" else "auto", wandb_mode=args.wandb_mode,
                 wandb_group=args.name, extra=tuple(extra))
    command = shlex.join(["python", "compare.py", *(sys.argv[1:] if argv is None else argv)])
    if args.dry_run:
        if len(p.lrs) > 1:
            print(f"# the grid and recall runs take the rate the sweep chooses; shown here with --lr {p.lrs[0]:g}")
        first = {v: p.lrs[0] for v in p.variants}
        for job in sweep_jobs(p, str(runs_dir)) + after_sweep(p, str(runs_dir), first):
            print(shlex.join(["python", "train.py", *job.argv]))
        return 0
    workers = devices(args)
    hardware = (f"{len(workers)} x {torch.cuda.get_device_name(0)}" if workers[0] is not None else "CPU")
    runner = Runner(runs_dir, workers, time.monotonic() + args.time_limit,
                    per_device=args.runs_per_gpu if workers[0] is not None else 1)
    jobs = sweep_jobs(p, str(runs_dir))
    try:
        done = runner.run(jobs)
        lr_of = chosen_lrs(collect(runs_dir), p.variants, p.lrs)
        if done and len(lr_of) == len(p.variants):
            later = after_sweep(p, str(runs_dir), lr_of)
            jobs += later
            done = runner.run(later)
    except StudyError as err:
        usage_error(str(err))
    cfg, _ = parse_train_args(["--config", p.config, *p.extra])
    report = Report(p, collect(runs_dir), jobs, f"{hardware}, torch {torch.__version__}", command,
                    GPT(cfg.model_config()).num_params())
    report.write(Path(args.out))
    print(f"report: {Path(args.out) / 'report.md'}" + ("" if done else " (incomplete: the same command goes on)"))
    return 0 if done else 1


if __name__ == "__main__":
    sys.exit(main())
