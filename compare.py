"""The long-context study: softmax, cosine-sim and fastmax attention trained at several context lengths, with
and without a short convolution, over several seeds, and a report of what that shows (make compare).

    python compare.py                                   # the study, on every GPU of this machine
    python compare.py --data-path enwik8-first4mb --time-limit 540   # a local copy; stop (resumably) in 9 min
    python compare.py --dry-run                         # the plan: every run's command
    python compare.py --device cpu --config configs/tiny_cpu --variants softmax,cosine --seq-lens 32,64 \\
        --seeds 1,2 --max-seeds 2 --epochs 0.001 --tokens-per-step 256 --lrs 2e-3 --eval-tokens 256 \\
        --cuts 16,32,64,128 --targets 128 --test-windows 4 --no-compute --recall-cells "" -- --n_layer 1
                                                        # CPU smoke (a few minutes; its report goes beside its runs)

Every run is a `python train.py` (study/jobs.py writes its flags; grid runs are scored afterwards by
scripts/evaluate.py) from a shared queue over the GPUs (study/runner.py). The phases (study/jobs.py says what
each is, study/phases.py runs them in order): a learning-rate sweep per attention and short_conv at the shortest
and longest context, the grid (attention x short_conv x context x seed), more seeds where a worded difference is
not settled, throughput and equal compute, and the associative-recall probe. Every enwik8 run trains
on --epochs passes over the train split and keeps its best-val checkpoint. A run with a result is not run again,
so the same command after a stop (--time-limit, a crash, a killed machine) goes on where it was. The report
(study/report.py) goes to --out: report.md, PNG plots and results.json with every run. All runs log to one
wandb group (offline where there is no login: `wandb sync`).
"""
from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import time
from pathlib import Path

import torch

from data import DataError
from data.enwik8 import ENWIK8_SIZE, read_local, split_sizes
from lab.cli import choice_list, index_list, int_list, refuse_train_flags, require_positive, split_train_flags
from lab.config import WANDB_MODES, usage_error
from lab.config import parse_args as parse_train_args
from model import GPT
from model.variants import VARIANTS
from study.jobs import CUTS, TARGETS, Protocol, grid_jobs, lr_table, recall_jobs, swept_context, sweep_jobs
from study.phases import collect, run_study
from study.report import Report
from study.runner import Runner, StudyError

ROOT = Path(__file__).resolve().parent
DEFAULT_VARIANTS = "softmax,cosine-kernel,fastmax-kernel,fastmax-swa"
COMMITTED = "bench/study"  # the committed report, which only a study of the same protocol may overwrite
# train.py fields the study sets for every run; setting them after -- would break the shared protocol.
CONTROLLED = {"config", "resume", "attention", "use_cuda_kernel", "cosine_sdpa", "sdpa_backend", "swa_window",
              "seq_len", "batch_size", "grad_accum_steps", "max_iters", "lr_decay_iters", "warmup_iters", "lr",
              "min_lr", "eval_interval", "eval_max_windows", "final_eval_max_windows", "seed", "data_path", "device",
              "out_dir", "run_name", "wandb_run_name", "wandb_mode", "wandb_group", "wandb_tags", "sample_tokens",
              "ckpt_interval", "task", "recall_pairs", "short_conv", "keep_best", "stop_accuracy"}


def float_list(text: str) -> list[float]:
    values = [float(v) for v in text.split(",") if v.strip()]
    if not values or not all(math.isfinite(v) and v > 0 for v in values):
        raise ValueError(text)
    return values


float_list.__name__ = "comma-separated positive float"


def conv_list(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or any(v < 0 or v == 1 for v in values):
        raise ValueError(text)
    return sorted(set(values))


conv_list.__name__ = "comma-separated short_conv (0, or a kernel size of at least 2)"


def recall_cells(text: str) -> list[tuple[int, int]]:
    """'256x16,1024x64' -> [(256, 16), (1024, 64)]: (sequence length, key-value pairs); empty = no probe."""
    cells = []
    for item in filter(None, (v.strip() for v in text.split(","))):
        t, pairs = item.split("x")
        cells.append((int(t), int(pairs)))
    if any(t < 1 or pairs < 1 for t, pairs in cells):
        raise ValueError(text)
    return cells


recall_cells.__name__ = "comma-separated LENGTHxPAIRS"


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """(options, train.py flags given after --), or exit 2 naming the bad argument."""
    ours, extra = split_train_flags(argv)
    parser = argparse.ArgumentParser(prog="compare.py", description=__doc__.split("\n\n")[0],
                                     usage="compare.py [options] [-- train.py flags]",
                                     epilog="examples:\n" + __doc__.split("\n\n")[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--config", default="configs/study", help="train.py config of every enwik8 run (default %(default)s)")
    add("--variants", default=DEFAULT_VARIANTS, help="comma list of model/variants.py's (default %(default)s)")
    add("--convs", type=conv_list, default=[0, 3], help="short_conv values, a factor of the grid (default 0,3)")
    add("--seq-lens", type=int_list, default=[1024, 8192, 32768], help="contexts, comma list (default 1024,8192,32768)")
    add("--seeds", type=int_list, default=[1, 2, 3], help="the grid's seeds (default 1,2,3)")
    add("--max-seeds", type=int, default=5, help="seeds a cell gets where a worded difference is not settled: under "
        "3 standard errors, or not established after Holm's correction (default %(default)s)")
    add("--sweep-seed", type=int, default=0, help="the rate sweeps' seed, not one of the grid's (default %(default)s)")
    add("--epochs", type=float, default=2.0, help="passes over the train split per enwik8 run: the budget, sized to "
        "the data (default %(default)s)")
    add("--tokens-per-step", type=int, default=32768, help="batch x context, every enwik8 run (default %(default)s)")
    add("--lrs", type=float_list, default=[1e-3, 2e-3, 4e-3],
        help="the sweep's starting rates, extended past an edge that wins; one rate = no sweep (default 1e-3,2e-3,4e-3)")
    add("--evals", type=int, default=10, help="periodic evaluations per run: the best-val checkpoint is chosen among "
        "them (default %(default)s)")
    add("--eval-tokens", type=int, default=2**18, help="val tokens per evaluation (default %(default)s)")
    add("--cuts", type=int_list, default=list(CUTS), help="same-target context cuts, each run scored at those up to "
        f"twice its context (default {','.join(map(str, CUTS))})")
    add("--targets", type=int, default=TARGETS, help="target bytes every cut scores, the last of each long test window "
        "(default %(default)s)")
    add("--test-windows", type=int, default=None, help="test windows each grid run's evaluations score (default: "
        "the whole split)")
    add("--no-compute", action="store_true", help="leave out the equal-compute phase (and its throughput runs)")
    add("--recall-cells", type=recall_cells, default=[(256, 16), (256, 64), (1024, 16), (1024, 64)],
        help="the recall probe's LENGTHxPAIRS cells, the easiest first; empty = no probe "
        "(default 256x16,256x64,1024x16,1024x64)")
    add("--recall-lrs", type=float_list, default=[3e-4, 1e-3, 3e-3, 1e-2],
        help="rates every recall cell and seed runs at, each cell reported at its best "
        "(default 3e-4,1e-3,3e-3,1e-2)")
    add("--recall-steps", type=int, default=4000, help="steps at most per recall run (default %(default)s)")
    add("--recall-config", default="configs/recall", help="train.py config of the recall runs")
    add("--stop-accuracy", type=float, default=0.99, help="a recall run ends once its val accuracy reaches this "
        "(default %(default)s)")
    add("--data-path", default=None, help="a local enwik8 copy (default: the verified download)")
    add("--device", default="auto", help="auto: every visible GPU (the study needs them); cpu: a smoke run")
    add("--gpus", type=index_list, default=None, help="GPU indices to use (default: all visible)")
    add("--runs-per-gpu", type=int, default=3, help="training runs sharing a GPU at once (their timings are not "
        "reported; the throughput phase has its GPU alone) (default %(default)s)")
    add("--wandb-mode", default="auto", choices=WANDB_MODES)
    add("--name", default="study", help="the study's name: its wandb group and its runs' folder (default %(default)s)")
    add("--runs-dir", default="out", help="runs go to RUNS_DIR/NAME/ (default %(default)s)")
    add("--out", default=None, help=f"report folder (default {COMMITTED}, the committed study's, for a study of its "
        "settings; for other settings report/ beside the runs)")
    add("--time-limit", type=float, default=math.inf, help="seconds for this call; the rest resumes later")
    add("--dry-run", action="store_true", help="print the plan and the commands; run nothing")
    args = parser.parse_args(ours)
    args.variants = choice_list(parser, "--variants", args.variants, VARIANTS)
    require_positive(parser, args, ("epochs", "tokens_per_step", "evals", "eval_tokens", "recall_steps", "targets",
                                    "test_windows", "time_limit", "runs_per_gpu", "max_seeds"))
    if args.max_seeds < len(args.seeds):
        parser.error(f"--max-seeds: expected at least the {len(args.seeds)} seeds of --seeds, got {args.max_seeds}")
    if args.sweep_seed in args.seeds:
        parser.error(f"--sweep-seed: expected a seed outside --seeds (the grid's seeds must not be the ones the rates "
                     f"were chosen on), got {args.sweep_seed}")
    if not 0 < args.stop_accuracy <= 1:
        parser.error(f"--stop-accuracy: expected an accuracy in (0, 1], got {args.stop_accuracy}")
    bad = [t for t in args.seq_lens if t > args.tokens_per_step]
    if bad:
        parser.error(f"--seq-lens: each at most --tokens-per-step={args.tokens_per_step} (batch = tokens per step / "
                     f"context), not {', '.join(map(str, bad))}")
    if min(args.cuts) > min(args.seq_lens):
        parser.error(f"--cuts: expected one at most the shortest context ({min(args.seq_lens)}), so that every run is "
                     f"scored within its context, got {','.join(map(str, args.cuts))}")
    refuse_train_flags(parser, extra, CONTROLLED, "sets it for every run (see its own options)")
    return args, extra


def train_bytes(data_path: str | None) -> int:
    """The train split's size, which the budget is sized to: the full enwik8's without a local copy (train.py
    downloads it), else the copy's; exit 2 naming --data-path when it cannot be read."""
    if data_path is None:
        return split_sizes(ENWIK8_SIZE)[0]
    try:
        return split_sizes(len(read_local(data_path, log=lambda *_: None)))[0]
    except (DataError, ValueError) as err:
        usage_error(f"--data-path: {err}")


def cpu_variants(variants: list[str]) -> list[str]:
    """The variants a CPU can train, saying once which it leaves out (our kernels, a forced SDPA GPU backend), or
    exit 2 when none is left."""
    gpu_only = [v for v in variants if dict(VARIANTS[v].settings).get("use_cuda_kernel")
                or dict(VARIANTS[v].settings).get("sdpa_backend", "auto") not in ("auto", "math")]
    kept = [v for v in variants if v not in gpu_only]
    if not kept:
        usage_error(f"--variants: {', '.join(variants)} all need a CUDA GPU (our kernels, or SDPA's GPU backends); "
                    "a CPU smoke run takes softmax, cosine or fastmax")
    if gpu_only:
        print(f"compare.py: on the CPU, leaving out {', '.join(gpu_only)} (our kernels and SDPA's GPU backends need "
              "a CUDA GPU)")
    return kept


def report_folder(out: str | None, protocol: dict, runs_dir: Path) -> Path:
    """--out; without it the committed study's folder when this study has its protocol (or none is there yet),
    else report/ beside the study's runs: a smoke run, or a study of other settings, never overwrites the
    committed report unless --out names it."""
    if out is not None:
        return Path(out)
    committed = ROOT / COMMITTED / "results.json"
    theirs = json.loads(committed.read_text())["protocol"] if committed.exists() else protocol
    if theirs == protocol:
        return ROOT / COMMITTED
    differ = sorted(k for k in protocol.keys() | theirs.keys() if protocol.get(k) != theirs.get(k))
    named = ", ".join(differ[:4]) + (f" and {len(differ) - 4} more" if len(differ) > 4 else "")
    print(f"compare.py: these settings differ from the committed study's ({named}), so the report goes "
          f"to {runs_dir / 'report'} rather than {COMMITTED} (--out names another folder)")
    return runs_dir / "report"


def devices(args) -> list[str | None]:
    """The workers' GPUs as indices among those this process sees (None: the CPU), or exit 2 where the study
    cannot run."""
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


def protocol(args, extra: list[str]) -> Protocol:
    variants = cpu_variants(args.variants) if args.device == "cpu" else args.variants
    return Protocol(config=args.config, variants=tuple(variants), convs=tuple(args.convs),
                    seq_lens=tuple(args.seq_lens), seeds=tuple(args.seeds), max_seeds=args.max_seeds,
                    sweep_seed=args.sweep_seed, epochs=args.epochs, train_bytes=train_bytes(args.data_path),
                    tokens_per_step=args.tokens_per_step, lrs=tuple(args.lrs), evals=args.evals,
                    eval_tokens=args.eval_tokens, cuts=tuple(sorted(set(args.cuts))), targets=args.targets,
                    test_windows=args.test_windows,
                    compute=not args.no_compute,
                    recall_cells=tuple(args.recall_cells), recall_lrs=tuple(args.recall_lrs),
                    recall_steps=args.recall_steps, recall_config=args.recall_config,
                    stop_accuracy=args.stop_accuracy, data_path=args.data_path,
                    device="cpu" if args.device == "cpu" else "auto", wandb_mode=args.wandb_mode,
                    wandb_group=args.name, extra=tuple(extra))


def dry_run(p: Protocol, runs_dir: str) -> None:
    """The plan: the budget, then the first commands of each phase that does not wait on another's results."""
    print(f"# {p.steps} steps of {p.tokens_per_step:,} tokens per enwik8 run: {p.epochs:g} epochs of "
          f"{p.train_bytes:,} train bytes")
    if len(p.lrs) > 1:
        print(f"# the grid takes the rates the sweep chooses (extended past a winning edge); shown with {p.lrs[0]:g}; "
              "more seeds, throughput and equal compute follow from results")
    first = {(v, c, swept_context(p, t)): p.lrs[0] for v in p.variants for c in p.convs for t in p.seq_lens}
    for job in sweep_jobs(p, runs_dir) + grid_jobs(p, runs_dir, lr_table(p, first)) + recall_jobs(p, runs_dir):
        for command in job.commands:
            print(shlex.join(["python", *command]))


def main(argv: list[str] | None = None) -> int:
    args, extra = parse_args(sys.argv[1:] if argv is None else argv)
    runs_dir = Path(args.runs_dir) / args.name
    p = protocol(args, extra)
    command = shlex.join(["python", "compare.py", *(sys.argv[1:] if argv is None else argv)])
    if args.dry_run:
        dry_run(p, str(runs_dir))
        return 0
    workers = devices(args)
    gpus = {w: "CPU" if w is None else torch.cuda.get_device_name(int(w)) for w in workers}
    hardware = f"{len(workers)} x {gpus[workers[0]]}" if workers[0] is not None else "CPU"
    runner = Runner(runs_dir, workers, time.monotonic() + args.time_limit,
                    per_device=args.runs_per_gpu if workers[0] is not None else 1, gpus=gpus)
    try:
        jobs, done = run_study(p, runner, str(runs_dir))
    except StudyError as err:
        usage_error(str(err))
    cfg, _ = parse_train_args(["--config", p.config, *p.extra])
    report = Report(p, collect(runs_dir, jobs), jobs, f"{hardware}, torch {torch.__version__}", command,
                    GPT(cfg.model_config()).num_params())
    out = report_folder(args.out, p.record(), runs_dir)
    report.write(out)
    print(f"report: {out / 'report.md'}" + ("" if done else " (incomplete: the same command goes on)"))
    return 0 if done else 1


if __name__ == "__main__":
    sys.exit(main())
