"""Train softmax, cosine-sim and fastmax attention at several context lengths on one budget, and compare.

    python compare.py --data-path .carry/data/enwik8-first4mb        # configs/base at 1024, 4096, 8192 bytes
    python compare.py --seq-lens 1024,4096,8192,16384 --tokens 16777216
    python compare.py --dry-run                                       # the plan and the commands, nothing run
    python compare.py --config configs/tiny_cpu --device cpu --seq-lens 64,128 --tokens 65536 \\
        --tokens-per-step 2048 -- --n_layer 2                          # a CPU smoke run; after -- : train.py flags

Every run is `python train.py` in a subprocess of its own, with the same seed, data and token budget:
each optimizer step holds --tokens-per-step tokens (batch = tokens_per_step / seq_len sequences) and a run
takes tokens / tokens_per_step steps, so all runs see as many tokens in as many steps, under the same
learning-rate schedule (warmup over the first tenth, cosine decay to the end). cosine and fastmax run on
our CUDA kernels where they can run the config (checked before each run), else on the PyTorch reference,
with a note saying why. Periodic evaluations score --eval-tokens tokens of val; the final one the whole
val split (unless the train.py flags after -- say otherwise), which gives the bpc-by-position curve.

--time-limit bounds the whole comparison: each run may use its share of the time left (the time left over
the runs left), is stopped with SIGTERM past it (train.py saves and exits), and runs not started in time
are listed as such. All runs log to one wandb group. Written to --out (default bench/compare):
compare.md (budget, seed, commands, a table per run), results.json (the numbers and curves behind it),
val_bpc.png (val bpc vs tokens and vs training time, per context length), throughput_memory.png (tokens/s
and peak memory vs context length) and bpc_by_position.png (does a longer context help each attention?).
"""
from __future__ import annotations

import argparse
import json
import platform
import shlex
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from lab.cli import choice_list, fmt, int_list, refuse_train_flags, require_positive, split_train_flags
from lab.config import WANDB_MODES
from lab.config import parse_args as parse_train_args
from lab.steps import attention_problem, setup_device
from model.variants import VARIANTS

ROOT = Path(__file__).resolve().parent
ATTENTIONS = ("softmax", "cosine", "fastmax")
COLORS = {"softmax": "tab:blue", "cosine": "tab:orange", "fastmax": "tab:green"}
STOP_GRACE_S = 60  # after SIGTERM, how long a run may take to save its checkpoint before it is killed
# train.py fields that compare.py sets for every run; setting them after -- would break the shared budget.
CONTROLLED = {"config", "resume", "attention", "use_cuda_kernel", "seq_len", "batch_size", "grad_accum_steps",
              "max_iters", "lr_decay_iters", "warmup_iters", "eval_interval", "eval_max_windows", "seed", "data_path",
              "device", "out_dir", "run_name", "wandb_run_name", "wandb_mode", "wandb_group", "wandb_tags",
              "sample_tokens", "ckpt_interval"}


@dataclass
class Run:
    attention: str
    seq_len: int
    batch_size: int
    kernel: bool
    note: str | None  # why cosine/fastmax runs on the PyTorch reference, when it does
    name: str
    argv: list[str]  # train.py's arguments
    status: str = "not run: time limit"
    exit_code: int | None = None
    wall_s: float | None = None
    summary: dict = field(default_factory=dict)

    @property
    def label(self) -> str:
        return VARIANTS[self.attention + ("-kernel" if self.kernel else "")].label


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """(options, train.py flags given after --), or exit 2 naming the bad argument."""
    ours, extra = split_train_flags(argv)
    parser = argparse.ArgumentParser(prog="compare.py", description=__doc__.split("\n\n")[0],
                                     usage="compare.py [options] [-- train.py flags]")
    parser.add_argument("--config", default="configs/base", help="train.py config for every run (default %(default)s)")
    parser.add_argument("--attentions", default=",".join(ATTENTIONS), help="comma list (default %(default)s)")
    parser.add_argument("--seq-lens", type=int_list, default=[1024, 4096, 8192], help="comma list of context lengths")
    parser.add_argument("--tokens", type=int, default=2**23, help="training tokens per run (default %(default)s)")
    parser.add_argument("--tokens-per-step", type=int, default=2**16,
                        help="tokens per optimizer step, batch x seq_len (default %(default)s)")
    parser.add_argument("--evals", type=int, default=8, help="periodic evaluations per run (default %(default)s)")
    parser.add_argument("--eval-tokens", type=int, default=2**17,
                        help="val tokens per periodic evaluation (default %(default)s)")
    parser.add_argument("--seed", type=int, default=1337)
    parser.add_argument("--data-path", default=None, help="local enwik8 copy (default: download the verified one)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--no-kernels", action="store_true",
                        help="run cosine and fastmax on the PyTorch reference even where our kernels can run")
    parser.add_argument("--wandb-mode", default="auto", choices=WANDB_MODES)
    parser.add_argument("--wandb-group", default=None, help="default compare-<date>-<time>; also the runs' folder")
    parser.add_argument("--runs-dir", default="out/compare", help="where the runs' folders go (default %(default)s)")
    parser.add_argument("--out", default="bench/compare", help="report folder (default %(default)s)")
    parser.add_argument("--time-limit", type=float, default=480.0,
                        help="seconds for all runs together (default %(default)s)")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and the commands; run nothing")
    args = parser.parse_args(ours)

    args.attentions = choice_list(parser, "--attentions", args.attentions, ATTENTIONS)
    require_positive(parser, args, ("tokens", "tokens_per_step", "evals", "eval_tokens", "time_limit"))
    if args.tokens % args.tokens_per_step:
        parser.error(f"--tokens: expected a multiple of --tokens-per-step={args.tokens_per_step}, got {args.tokens}")
    bad = [t for t in args.seq_lens if args.tokens_per_step % t]
    if bad:
        parser.error(f"--seq-lens: each must divide --tokens-per-step={args.tokens_per_step} (batch = tokens per "
                     f"step / seq_len), not {', '.join(map(str, bad))}")
    refuse_train_flags(parser, extra, CONTROLLED, "sets it for every run (see its own options)")
    args.wandb_group = args.wandb_group or time.strftime("compare-%Y%m%d-%H%M%S")
    return args, extra


def plan(args, extra: list[str]) -> tuple[list[Run], str]:
    """The runs, in the order they go (all attentions at one length, then the next length), and a line
    naming the hardware. Which of cosine/fastmax can use our kernels is asked of train.py's own check."""
    steps = args.tokens // args.tokens_per_step
    runs, hardware = [], None
    for seq_len in args.seq_lens:
        batch = args.tokens_per_step // seq_len
        for attention in args.attentions:
            argv = ["--config", args.config, "--attention", attention, "--seq_len", str(seq_len),
                    "--batch_size", str(batch), "--grad_accum_steps", "1", "--max_iters", str(steps),
                    "--lr_decay_iters", str(steps), "--warmup_iters", str(steps // 10),
                    "--eval_interval", str(max(1, steps // args.evals)),
                    "--eval_max_windows", str(max(1, args.eval_tokens // seq_len)),
                    # Text samples are not compared, and generating one costs seconds per evaluation.
                    "--sample_tokens", "0", "--ckpt_interval", str(steps), "--seed", str(args.seed),
                    "--device", args.device, "--wandb-mode", args.wandb_mode, "--wandb_group", args.wandb_group,
                    "--wandb_tags", f"compare,{attention},T{seq_len}",
                    *(["--data-path", args.data_path] if args.data_path else []), *extra]
            cfg, _ = parse_train_args(argv)
            device, dtype = setup_device(cfg)
            hardware = hardware or (f"{torch.cuda.get_device_name(device)}, {dtype}" if device.type == "cuda"
                                    else f"CPU ({platform.processor() or platform.machine()}), {dtype}")
            kernel, note = False, None
            if attention != "softmax":
                if args.no_kernels:
                    note = "--no-kernels"
                else:
                    note = attention_problem(replace(cfg, use_cuda_kernel=True), device, dtype)
                    kernel = note is None
            name = f"{attention}{'-kernel' if kernel else ''}_T{seq_len}"
            argv += ["--use-cuda-kernel"] * kernel + ["--out_dir", str(Path(args.runs_dir) / args.wandb_group),
                                                      "--run_name", name]
            runs.append(Run(attention, seq_len, batch, kernel, note, name, argv))
    return runs, hardware


def summarize(metrics_path: Path, tokens_per_step: int, steps: int) -> dict:
    """The numbers a run's metrics.jsonl gives the report; training time sums step times (no evaluations)."""
    lines = metrics_path.read_text().splitlines(keepends=True) if metrics_path.exists() else []
    rows = [json.loads(line) for line in lines if line.endswith("\n")]  # a line cut short by a kill is no row
    train_rows = [r for r in rows if "train/loss" in r]
    if not train_rows:
        return {}
    elapsed, seconds = {}, 0.0
    for r in train_rows:
        seconds += r["perf/step_ms"] / 1000
        elapsed[r["step"]] = seconds
    evals = [r for r in rows if "val/bpc" in r]
    tests = [r for r in rows if "test/bpc" in r]
    finished = bool(tests) and tests[-1]["step"] == steps
    speeds = [r["perf/tokens_per_s"] for r in train_rows[1:] or train_rows]  # step 1 carries the warm-up
    return {"steps_done": train_rows[-1]["step"], "train_s": seconds,
            "tokens_per_s": statistics.median(speeds),
            "peak_mem_gib": max(r["perf/peak_mem_gib"] for r in train_rows),
            "val_curve": [[e["step"] * tokens_per_step, elapsed[e["step"]], e["val/bpc"]] for e in evals],
            "final_val_bpc": evals[-1]["val/bpc"] if finished else None,
            "test_bpc": tests[-1]["test/bpc"] if finished else None,
            "bpc_by_position": evals[-1]["val/bpc_by_position"] if finished else None}


def execute(run: Run, run_dir: Path, log_path: Path, time_limit: float, steps: int, tokens_per_step: int) -> None:
    """Run train.py, its output to log_path; fill in run's status, exit code, wall time and summary."""
    command = [sys.executable, str(ROOT / "train.py"), *run.argv]
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        log.write(shlex.join(command) + "\n")
        log.flush()
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        try:
            proc.wait(timeout=time_limit)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    run.wall_s, run.exit_code = time.monotonic() - t0, proc.returncode
    run.summary = summarize(run_dir / "metrics.jsonl", tokens_per_step, steps)
    if timed_out:
        run.status = f"stopped at its time share ({time_limit:.0f} s) after step {run.summary.get('steps_done', 0)}"
    elif proc.returncode == 0:
        run.status = "ok"
    else:
        output = log_path.read_text(errors="replace")
        lines = [line for line in output.splitlines() if line.strip() and "it/s" not in line]
        reason = "out of memory" if "OutOfMemoryError" in output else lines[-1] if lines else "no output"
        run.status = f"failed (exit {proc.returncode}): {reason[:200]}"


def write_report(args, runs: list[Run], hardware: str, command: list[str], out: Path) -> None:
    """compare.md and results.json."""
    steps = args.tokens // args.tokens_per_step
    cfg, _ = parse_train_args(runs[0].argv)
    final_eval = ("the whole val split" if cfg.final_eval_max_windows is None
                  else f"{cfg.final_eval_max_windows} val windows")
    budget = {"tokens_per_run": args.tokens, "tokens_per_step": args.tokens_per_step, "steps": steps,
              "warmup_steps": steps // 10, "seed": args.seed, "eval_tokens": args.eval_tokens,
              "evals": args.evals, "final_eval": final_eval}
    (out / "results.json").write_text(json.dumps(
        {"command": command, "hardware": hardware, "torch": torch.__version__, "config": args.config,
         "data_path": args.data_path, "wandb_group": args.wandb_group, "budget": budget,
         "runs": [{"attention": r.attention, "kernel": r.kernel, "note": r.note, "seq_len": r.seq_len,
                   "batch_size": r.batch_size, "status": r.status, "exit_code": r.exit_code, "wall_s": r.wall_s,
                   "command": ["python", "train.py", *r.argv], **r.summary} for r in runs]}, indent=1) + "\n")

    model = ", ".join(f"{k} {getattr(cfg, k)}" for k in ("n_layer", "n_head", "n_kv_head", "n_embd", "dropout"))
    lines = [
        "# Softmax vs cosine-sim vs fastmax attention on enwik8",
        "",
        f"Written by `{shlex.join(command)}` on {hardware}, torch {torch.__version__}.",
        "",
        f"- Budget, every run: {args.tokens:,} training tokens = {steps} steps × {args.tokens_per_step:,} tokens "
        f"(batch × context length); lr {cfg.lr:g} after {steps // 10} warmup steps, cosine decay to "
        f"{cfg.min_lr:g} at the last step.",
        f"- Seed {args.seed} for every run (initial weights, batches, dropout); data "
        f"`{args.data_path or 'enwik8 (downloaded, verified)'}`, split 90/5/5.",
        f"- Model: `{args.config}` ({model}); {cfg.dtype} dtype setting.",
        f"- Evaluations: {args.evals} per run on {args.eval_tokens:,} val tokens each; the final val bpc, test "
        f"bpc and the bpc-by-position curve are over {final_eval}.",
        "- tokens/s: median over a run's steps, step 1 (warm-up) left out; peak memory: the largest "
        "`perf/peak_mem_gib` train.py logged (CUDA: allocated by tensors; CPU: process peak RSS); training s: "
        "the steps' time, evaluations excluded; wall s: the whole subprocess.",
        f"- wandb group `{args.wandb_group}` (mode {args.wandb_mode}).",
    ]
    notes = sorted({f"{r.attention} at {r.seq_len:,}: PyTorch reference, because {r.note}" for r in runs if r.note})
    if notes:
        lines += ["", "Notes:", *[f"- {n}" for n in notes]]
    lines += ["", "| attention | context | batch | final val bpc | test bpc | tokens/s | peak mem GiB | training s "
              "| wall s | status |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in runs:
        s = r.summary
        lines.append(f"| {r.label} | {r.seq_len:,} | {r.batch_size} | {fmt(s.get('final_val_bpc'), '.4f')} | "
                     f"{fmt(s.get('test_bpc'), '.4f')} | {fmt(s.get('tokens_per_s'), ',.0f')} | "
                     f"{fmt(s.get('peak_mem_gib'), '.2f')} | {fmt(s.get('train_s'), '.1f')} | "
                     f"{fmt(r.wall_s, '.1f')} | {r.status} |")
    lines += ["", "![val bpc vs tokens and vs training time](val_bpc.png)", "",
              "![tokens/s and peak memory vs context length](throughput_memory.png)", "",
              "![final val bpc by position in the context](bpc_by_position.png)", "", "## Commands", "", "```bash",
              shlex.join(command), *[shlex.join(["python", "train.py", *r.argv]) for r in runs], "```", ""]
    (out / "compare.md").write_text("\n".join(lines))


def plot(args, runs: list[Run], out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator

    thousands = FuncFormatter(lambda value, _: f"{value:,.0f}")

    steps = args.tokens // args.tokens_per_step
    budget = (f"{args.tokens:,} tokens per run ({steps} steps × {args.tokens_per_step:,}), seed {args.seed}, "
              f"{Path(args.config).name}, {Path(args.data_path).name if args.data_path else 'enwik8'}")
    done = [r for r in runs if r.summary]
    style = {"marker": "o", "markersize": 3}

    seq_lens = sorted({r.seq_len for r in runs})
    fig, axes = plt.subplots(2, len(seq_lens), figsize=(4.5 * len(seq_lens), 7.5), sharey="row", squeeze=False)
    for col, seq_len in enumerate(seq_lens):
        for r in [r for r in done if r.seq_len == seq_len and r.summary["val_curve"]]:
            tokens, seconds, bpc = zip(*r.summary["val_curve"])
            axes[0][col].plot([t / 1e6 for t in tokens], bpc, color=COLORS[r.attention], label=r.label, **style)
            axes[1][col].plot(seconds, bpc, color=COLORS[r.attention], label=r.label, **style)
        batch = args.tokens_per_step // seq_len
        axes[0][col].set_title(f"context {seq_len:,} bytes, batch {batch}")
        axes[0][col].set_xlabel("training tokens (millions)")
        axes[1][col].set_xlabel("training time (s, evaluations excluded)")
        for ax in axes[:, col]:
            ax.grid(alpha=0.3)
            if ax.has_data():
                ax.legend(fontsize=8)
    for ax in axes[:, 0]:
        ax.set_ylabel("val bpc (lower is better)")
    fig.suptitle(f"Validation bits per character during training\n{budget}")
    fig.tight_layout()
    fig.savefig(out / "val_bpc.png", dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for label in dict.fromkeys(r.label for r in runs):
        mine = [r for r in done if r.label == label]
        color = COLORS[mine[0].attention] if mine else None
        for ax, key in zip(axes, ("tokens_per_s", "peak_mem_gib")):
            ax.plot([r.seq_len for r in mine], [r.summary[key] for r in mine], color=color, label=label, **style)
    axes[0].yaxis.set_major_formatter(thousands)
    for ax, ylabel in zip(axes, ("training tokens/s (median step)", "peak memory (GiB)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(seq_lens, [f"{t:,}" for t in seq_lens])
        ax.minorticks_off()
        ax.set_xlabel("context length (bytes)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if ax.has_data():
            ax.legend(fontsize=8)
    fig.suptitle(f"Throughput and memory per context length ({args.tokens_per_step:,} tokens per step)\n{budget}")
    fig.tight_layout()
    fig.savefig(out / "throughput_memory.png", dpi=110)
    plt.close(fig)

    labels = list(dict.fromkeys(r.label for r in runs))
    fig, axes = plt.subplots(1, len(labels), figsize=(4.5 * len(labels), 4.5), sharey=True, squeeze=False)
    for ax, label in zip(axes[0], labels):
        for r in [r for r in done if r.label == label and r.summary["bpc_by_position"]]:
            positions, bpc = zip(*r.summary["bpc_by_position"])
            ax.plot(positions, bpc, label=f"context {r.seq_len:,}", **style)
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_locator(LogLocator(base=4))
        ax.xaxis.set_major_formatter(thousands)
        ax.set_title(label)
        ax.set_xlabel("position in the context (bytes)")
        ax.grid(alpha=0.3)
        if ax.has_data():
            ax.legend(fontsize=8)
    axes[0][0].set_ylabel("final val bpc at that position")
    fig.suptitle("Does a longer context help? Final val bpc by position in the context (buckets 1, 2, 3-4, "
                 f"5-8, ...)\n{budget}")
    fig.tight_layout()
    fig.savefig(out / "bpc_by_position.png", dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args, extra = parse_args(argv)
    runs, hardware = plan(args, extra)
    steps = args.tokens // args.tokens_per_step
    print(f"{len(runs)} runs of {args.tokens:,} tokens ({steps} steps × {args.tokens_per_step:,}), seed {args.seed}, "
          f"on {hardware}; wandb group {args.wandb_group}")
    for r in runs:
        print(f"  {r.label:<30} context {r.seq_len:>7,}  batch {r.batch_size:>4}"
              + (f"  note: PyTorch reference, because {r.note}" if r.note else ""))
    if args.dry_run:
        for r in runs:
            print(shlex.join(["python", "train.py", *r.argv]))
        return 0

    out, group_dir = Path(args.out), Path(args.runs_dir) / args.wandb_group
    out.mkdir(parents=True, exist_ok=True)
    group_dir.mkdir(parents=True, exist_ok=True)
    command = ["python", "compare.py", *argv]
    deadline = time.monotonic() + args.time_limit
    try:
        for i, r in enumerate(runs):
            share = (deadline - time.monotonic()) / (len(runs) - i)
            if share <= 0:
                break
            execute(r, group_dir / r.name, group_dir / f"{r.name}.log", share, steps, args.tokens_per_step)
            s = r.summary
            print(f"{r.label:<30} context {r.seq_len:>7,}: {r.status}; final val bpc "
                  f"{fmt(s.get('final_val_bpc'), '.4f')}, {fmt(s.get('tokens_per_s'), ',.0f')} tokens/s, "
                  f"peak {fmt(s.get('peak_mem_gib'), '.2f')} GiB, {r.wall_s:.0f} s (log {group_dir / r.name}.log)",
                  flush=True)
            write_report(args, runs, hardware, command, out)  # so that an interrupted comparison leaves a report
    finally:
        write_report(args, runs, hardware, command, out)
        plot(args, runs, out)
    print(f"wrote {out / 'compare.md'}, results.json and 3 plots")
    return 0 if all(r.status == "ok" for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
