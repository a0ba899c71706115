"""The study's runs: what each one is (phase, variant, short convolution, context, seed, rate, steps) and its
commands.

Phases, in order; study/phases.py runs them, each decided from the results of the last:
- sweep: each variant's peak learning rate, per short_conv, at the shortest and the longest context, over the
  whole budget, with sweep_seed (not a grid seed, so the grid's seeds are not the ones the rate was picked
  on). A best rate at the edge of the rates tried adds the next rate beyond it (bracketing, up to
  MAX_EXTENSIONS times); the report flags a choice still at the edge.
- grid: variant x short_conv x context x seed at the swept rate; a context takes the rate of the swept
  context nearest it in log scale. Afterwards each run's best checkpoint is scored on the test split by
  scripts/evaluate.py: the same target bytes with the context cut to each of CUTS (up to twice the trained
  context), and the sliding-window test bpc at the trained context.
- seeds: the cells of every comparison the report words that the grid's seeds do not settle (under 3 standard
  errors, or not established after Holm's correction: phases.cells_needing_seeds) get seeds up to max_seeds.
- throughput: training tokens/s of every variant at every context, measured alone on a GPU, a process per context
  (scripts/throughput.py): the tokens/s the report quotes, and what the equal-compute phase scales by.
- compute: equal compute beside equal tokens: every variant but the reference (softmax) again, its steps
  scaled by its tokens/s over the reference's at that context and short_conv; its best checkpoint scored on
  the test split as the grid's are (without their context curves). A variant within SAME_SPEED of the
  reference's tokens/s is not run again: its equal-compute run would be its grid run to within a few percent
  of the steps, so the grid's comparison stands for it.
- recall: every variant x cell x seed at every rate of recall_lrs, each run ending as soon as its val accuracy
  reaches stop_accuracy; each cell reported at its best rate (Zoology's protocol).

Budget: every enwik8 run of the sweep and grid trains on epochs x the train split's bytes, tokens_per_step
tokens a step (batch = tokens_per_step / context), warmup over the first tenth, cosine decay to a tenth of
the peak rate; it evaluates `evals` times and keeps its best-val checkpoint (train.py --keep_best), so a run
that starts to memorise the data is scored from before it did.
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field

from model.variants import VARIANTS

PHASES = ("sweep", "grid", "seeds", "throughput", "compute", "recall")
GRID_PHASES = ("grid", "seeds")  # the runs of the grid's cells: its seeds and those the seeds phase adds
# Same-target context cuts (bytes), the default of Protocol.cuts. A run trained at T is scored at the cuts up to
# 2T: those past T are the unseen half, beyond any context it trained on.
CUTS = (256, 1024, 4096, 16384, 32768, 65536)
TARGETS = 2048  # the target bytes every cut scores, the default of Protocol.targets: the last of each long test window
MAX_EXTENSIONS = 2  # rates a sweep may add beyond the edge of the rates asked for
# Tokens/s within this fraction of the reference's: an equal-compute run would differ from the variant's grid
# run by at most this fraction of its steps, so the grid's runs stand for it (no compute run; the report says
# where).
SAME_SPEED = 0.05
REFERENCE = "softmax"  # the attention the others are compared with, and equal compute is measured against


@dataclass(frozen=True)
class Protocol:
    """What every run of the study shares; compare.py's options fill it."""

    config: str
    variants: tuple[str, ...]
    convs: tuple[int, ...]  # short_conv values: a factor of the grid, for every attention
    seq_lens: tuple[int, ...]
    seeds: tuple[int, ...]  # the grid's seeds
    max_seeds: int  # seeds a cell gets where a worded comparison is not settled (phases.cells_needing_seeds)
    sweep_seed: int
    epochs: float
    train_bytes: int  # the train split's size, which the budget is sized to
    tokens_per_step: int
    lrs: tuple[float, ...]  # the sweep's starting rates; one rate alone means no sweep
    evals: int
    eval_tokens: int
    cuts: tuple[int, ...]  # same-target context cuts
    targets: int  # the target bytes every cut scores, the last of each long test window
    test_windows: int | None  # test windows each grid run's evaluations score; None = the whole split
    compute: bool  # the equal-compute phase
    recall_cells: tuple[tuple[int, int], ...]  # (sequence length, pairs); the first is the easiest
    recall_lrs: tuple[float, ...]
    recall_steps: int
    recall_config: str
    stop_accuracy: float
    data_path: str | None
    device: str
    wandb_mode: str
    wandb_group: str
    extra: tuple[str, ...] = ()  # train.py flags for every run, after compare.py's --

    def record(self) -> dict:
        """The protocol as results.json holds it (JSON: tuples become lists)."""
        return json.loads(json.dumps(dataclasses.asdict(self)))

    @property
    def steps(self) -> int:
        """Optimizer steps of a run: epochs x the train split, tokens_per_step a step."""
        return max(1, round(self.epochs * self.train_bytes / self.tokens_per_step))

    @property
    def swept_seq_lens(self) -> tuple[int, ...]:
        return tuple(sorted({min(self.seq_lens), max(self.seq_lens)}))

    def cuts_for(self, seq_len: int) -> tuple[int, ...]:
        """The same-target cuts a run trained at seq_len is scored at: up to twice its context."""
        return tuple(c for c in self.cuts if c <= 2 * seq_len)

    @property
    def window(self) -> int:
        """The long test windows whose last `targets` bytes every same-target cut scores."""
        return max(self.cuts_for(max(self.seq_lens))) + self.targets

    @property
    def reference(self) -> str:
        return REFERENCE if REFERENCE in self.variants else self.variants[0]


def swept_context(p: Protocol, seq_len: int) -> int:
    """The swept context whose rate a run at seq_len takes: the nearest in log scale (the shorter on a tie)."""
    return min(p.swept_seq_lens, key=lambda s: (abs(math.log(seq_len / s)), s))


@dataclass(frozen=True)
class Job:
    phase: str
    variant: str
    seq_len: int
    seed: int
    lr: float
    conv: int = 0
    steps: int = 0
    pairs: int | None = None  # recall only
    commands: tuple[tuple[str, ...], ...] = field(default=(), compare=False)  # each: a script and its arguments

    @property
    def name(self) -> str:
        if self.phase == "throughput":
            return f"throughput_c{self.conv}_T{self.seq_len}"
        # Recall runs take the short convolution of their config (recall_config), enwik8 runs the protocol's.
        what = f"_P{self.pairs}" if self.pairs is not None else f"_c{self.conv}"
        steps = f"_n{self.steps}" if self.phase == "compute" else ""
        return f"{self.phase}_{self.variant}{what}_T{self.seq_len}_lr{self.lr:g}_s{self.seed}{steps}"

    @property
    def exclusive(self) -> bool:
        """Throughput has its GPU alone: its figures are the study's tokens/s. Training runs report what they
        learned, not how fast, so several share one GPU."""
        return self.phase == "throughput"


def train_argv(p: Protocol, job: Job, out_dir: str) -> tuple[str, ...]:
    """train.py's flags for one training run."""
    recall = job.pairs is not None
    batch = max(1, p.tokens_per_step // job.seq_len)
    every = max(1, job.steps // p.evals)
    # A checkpoint at the end only: a run stopped at the deadline saves one as it exits (SIGTERM), and runs are
    # short enough that one killed outright is simply run again.
    argv = ["--config", p.recall_config if recall else p.config, *VARIANTS[job.variant].flags(),
            "--seq_len", str(job.seq_len), "--batch_size", str(batch), "--grad_accum_steps", "1",
            "--max_iters", str(job.steps), "--lr_decay_iters", str(job.steps), "--warmup_iters", str(job.steps // 10),
            "--lr", f"{job.lr:g}", "--min_lr", f"{job.lr / 10:g}", "--seed", str(job.seed),
            "--eval_interval", str(every), "--ckpt_interval", str(job.steps), "--sample_tokens", "0",
            "--device", p.device, "--out_dir", out_dir, "--run_name", job.name, "--resume", "auto",
            "--wandb-mode", p.wandb_mode, "--wandb_group", p.wandb_group,
            # A recall run's short convolution is its config's, not the protocol's: its tag names the pairs.
            "--wandb_tags", f"study,{job.phase},{job.variant},T{job.seq_len},"
                            + (f"P{job.pairs}" if recall else f"conv{job.conv}")]
    if recall:
        argv += ["--task", "recall", "--recall_pairs", str(job.pairs), "--stop_accuracy", f"{p.stop_accuracy:g}"]
    else:
        # The final evaluation scores the periodic ones' windows, so the best-val checkpoint is chosen among
        # like evaluations; the test split is scored again from the best checkpoint (scripts/evaluate.py).
        windows = str(max(1, p.eval_tokens // job.seq_len))
        argv += ["--short_conv", str(job.conv), "--keep_best", "--eval_max_windows", windows,
                 "--final_eval_max_windows", windows]
        if p.data_path:
            argv += ["--data-path", p.data_path]
    return (*argv, *p.extra)


def evaluate_argv(p: Protocol, job: Job, out_dir: str) -> tuple[str, ...]:
    """scripts/evaluate.py's flags for an enwik8 run: its best checkpoint on the test split in windows of its
    context (the metric the study compares); for a grid run (grid, seeds) also the same target bytes at every cut
    up to twice its context, and the sliding-window bpc at its context (stride a quarter of it)."""
    run_dir = f"{out_dir}/{job.name}"
    curves = (("--same-target", ",".join(map(str, p.cuts_for(job.seq_len))), "--targets", str(p.targets),
               "--window", str(p.window), "--sliding-stride", str(max(1, job.seq_len // 4)))
              if job.phase in GRID_PHASES else ())
    return ("--ckpt", f"{run_dir}/best.pt", "--seq-len", str(job.seq_len), "--split", "test", *curves,
            "--device", "auto", "--out", f"{run_dir}/evaluation.json",
            *(("--max-windows", str(p.test_windows)) if p.test_windows else ()))


def make_job(p: Protocol, out_dir: str, phase: str, variant: str, seq_len: int, seed: int, lr: float, conv: int = 0,
             steps: int | None = None, pairs: int | None = None) -> Job:
    job = Job(phase, variant, seq_len, seed, lr, conv, p.steps if steps is None else steps, pairs)
    commands = [("train.py", *train_argv(p, job, out_dir))]
    if phase in (*GRID_PHASES, "compute"):
        commands.append(("scripts/evaluate.py", *evaluate_argv(p, job, out_dir)))
    return dataclasses.replace(job, commands=tuple(commands))


def throughput_jobs(p: Protocol, out_dir: str) -> list[Job]:
    """A scripts/throughput.py process per context: every variant, compiled as the runs are, on random bytes (what
    is timed is the step, not the data), with the largest short_conv: the convolution costs the same under every
    attention, so one measurement serves every short_conv. Per context, so that the ratios at a context come from
    one process and a deadline loses one context's compiles, not the phase's."""
    jobs = []
    for t in sorted(p.seq_lens):
        job = Job("throughput", "all", t, 0, 0.0, max(p.convs))
        argv = ("--variants", ",".join(p.variants), "--seq-lens", str(t),
                "--tokens-per-step", str(p.tokens_per_step), "--warmup", "3", "--steps", "10",
                "--device", "cpu" if p.device == "cpu" else "auto", "--out", f"{out_dir}/{job.name}/throughput",
                "--", "--config", p.config, "--short_conv", str(job.conv), *p.extra)
        jobs.append(dataclasses.replace(job, commands=(("scripts/throughput.py", *argv),)))
    return jobs


def sweep_jobs(p: Protocol, out_dir: str, rates: dict | None = None) -> list[Job]:
    """The sweep's runs: every variant x short_conv x swept context at each of its rates (rates: (variant, conv,
    seq_len) -> the rates to run; default the protocol's); none when the protocol gives one rate."""
    if len(p.lrs) == 1:
        return []
    return [make_job(p, out_dir, "sweep", v, t, p.sweep_seed, lr, conv)
            for v in p.variants for conv in p.convs for t in p.swept_seq_lens
            for lr in (rates or {}).get((v, conv, t), p.lrs)]


def bracket(tried: dict[float, float]) -> float | None:
    """The next rate to try when the best of `tried` (rate -> best val bpc) lies at the edge of the rates tried:
    the best times or over the step between the rates (twice by default); None when it is bracketed."""
    rates = sorted(tried)
    best = min(rates, key=lambda r: tried[r])
    if len(rates) < 2 or rates[0] < best < rates[-1]:
        return None
    ratio = rates[1] / rates[0]
    return best * ratio if best == rates[-1] else best / ratio


def lr_table(p: Protocol, best_of: dict) -> dict:
    """(variant, conv, seq_len) -> rate for every grid cell, from best_of: (variant, conv, swept seq_len) -> rate."""
    return {(v, c, t): best_of[v, c, swept_context(p, t)] for v in p.variants for c in p.convs for t in p.seq_lens}


def grid_jobs(p: Protocol, out_dir: str, lrs: dict, seeds=None, cells=None) -> list[Job]:
    """variant x short_conv x context x seed at the table's rates (cells: limit to these (variant, conv, seq_len));
    seed by seed, the longest contexts first within a seed, so the longest runs do not start last and a study
    stopped early has every cell once before it has any twice."""
    phase = "grid" if seeds is None else "seeds"
    return [make_job(p, out_dir, phase, v, t, s, lrs[v, c, t], c)
            for s in (p.seeds if seeds is None else seeds) for t in sorted(p.seq_lens, reverse=True)
            for c in p.convs for v in p.variants if cells is None or (v, c, t) in cells]


def speed_ratios(p: Protocol, speed: dict) -> dict:
    """(variant, conv, seq_len) -> its tokens/s over the reference's, for every variant but the reference where
    both were measured (speed: (variant, conv, seq_len) -> tokens/s)."""
    return {(v, c, t): speed[v, c, t] / speed[p.reference, c, t] for v in p.variants for c in p.convs
            for t in p.seq_lens if v != p.reference and (v, c, t) in speed and (p.reference, c, t) in speed}


def same_speed(ratio: float) -> bool:
    """Whether a variant at this speed ratio keeps its grid runs for equal compute (SAME_SPEED)."""
    return abs(ratio - 1) <= SAME_SPEED


def compute_jobs(p: Protocol, out_dir: str, lrs: dict, speed: dict) -> list[Job]:
    """Equal compute: every variant but the reference at the grid's rates and seeds, its steps scaled by its
    tokens/s over the reference's, where that is more than SAME_SPEED from 1. A cell without both speeds is
    left out (the report says which)."""
    ratios = speed_ratios(p, speed)
    return [make_job(p, out_dir, "compute", v, t, s, lrs[v, c, t], c, max(1, round(p.steps * ratios[v, c, t])))
            for s in p.seeds for t in sorted(p.seq_lens, reverse=True) for c in p.convs for v in p.variants
            if (v, c, t) in ratios and not same_speed(ratios[v, c, t])]


def recall_jobs(p: Protocol, out_dir: str) -> list[Job]:
    """Every variant x cell x seed at every rate of recall_lrs: the report takes each cell at its best rate
    (phases.recall_best). Whether a model learns recall is close to all or nothing and varies with the seed, so
    the report counts the seeds that solved each cell. The easiest cell first: it settles whether the probe is valid,
    and a study cut short reports whole cells."""
    return [make_job(p, out_dir, "recall", v, t, s, lr, steps=p.recall_steps, pairs=pairs)
            for t, pairs in p.recall_cells for v in p.variants for s in p.seeds for lr in p.recall_lrs]
