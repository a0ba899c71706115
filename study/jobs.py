"""The study's runs: what each one is (variant, context, seed, learning rate, phase) and its train.py command.

Three phases, in order: a learning-rate sweep at the shortest context (one seed per variant and rate), the
grid (every variant x context x seed at the rate its sweep chose, each evaluated again at twice its context
afterwards), and the recall probe (every variant x context x pair count on generated sequences). All runs
of a phase share the token budget: tokens_per_step tokens a step (batch = tokens_per_step / context) for
the same number of steps, under the same schedule (warmup over the first tenth, cosine decay to the end).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from model.variants import VARIANTS

PHASES = ("sweep", "grid", "recall")


@dataclass(frozen=True)
class Protocol:
    """What every run of the study shares; compare.py's options fill it."""

    config: str
    variants: tuple[str, ...]
    seq_lens: tuple[int, ...]
    seeds: tuple[int, ...]
    steps: int
    tokens_per_step: int
    lrs: tuple[float, ...]  # the sweep's rates; one rate alone means no sweep
    sweep_steps: int
    evals: int
    eval_tokens: int
    recall_seq_lens: tuple[int, ...]
    recall_pairs: tuple[int, ...]
    recall_steps: int
    recall_config: str
    data_path: str | None
    device: str
    wandb_mode: str
    wandb_group: str
    extra: tuple[str, ...] = ()  # train.py flags for every run, after compare.py's --

    @property
    def sweep_seq_len(self) -> int:
        return min(self.seq_lens)


@dataclass(frozen=True)
class Job:
    phase: str
    variant: str
    seq_len: int
    seed: int
    lr: float
    pairs: int | None = None  # recall only
    argv: tuple[str, ...] = field(default=(), compare=False)

    @property
    def name(self) -> str:
        what = f"_P{self.pairs}" if self.pairs is not None else ""
        return f"{self.phase}_{self.variant}_T{self.seq_len}{what}_lr{self.lr:g}_s{self.seed}"

    @property
    def extrapolate(self) -> bool:
        """Grid runs are evaluated again at twice their context."""
        return self.phase == "grid"

    @property
    def exclusive(self) -> bool:
        """Grid runs have their GPU alone: the report quotes their tokens/s. The sweep's and the recall
        probe's runs report only what they learned, so they may share one."""
        return self.phase == "grid"


def train_argv(p: Protocol, phase: str, variant: str, seq_len: int, seed: int, lr: float, steps: int,
               out_dir: str, name: str, pairs: int | None = None) -> tuple[str, ...]:
    """train.py's flags for one run."""
    batch = max(1, p.tokens_per_step // seq_len)
    recall = pairs is not None
    argv = ["--config", p.recall_config if recall else p.config, *VARIANTS[variant].flags(),
            "--seq_len", str(seq_len), "--batch_size", str(batch), "--grad_accum_steps", "1",
            "--max_iters", str(steps), "--lr_decay_iters", str(steps), "--warmup_iters", str(steps // 10),
            "--lr", f"{lr:g}", "--min_lr", f"{lr / 10:g}", "--seed", str(seed),
            "--eval_interval", str(max(1, steps // p.evals)), "--ckpt_interval", str(max(1, steps // p.evals)),
            "--eval_max_windows", str(max(1, p.eval_tokens // seq_len)), "--sample_tokens", "0",
            "--device", p.device, "--out_dir", out_dir, "--run_name", name, "--resume", "auto",
            "--wandb-mode", p.wandb_mode, "--wandb_group", p.wandb_group,
            "--wandb_tags", f"study,{phase},{variant},T{seq_len}"]
    if recall:
        argv += ["--task", "recall", "--recall_pairs", str(pairs)]
    elif p.data_path:
        argv += ["--data-path", p.data_path]
    return (*argv, *p.extra)


def _job(p: Protocol, out_dir: str, phase: str, variant: str, seq_len: int, seed: int, lr: float, steps: int,
         pairs: int | None = None) -> Job:
    job = Job(phase, variant, seq_len, seed, lr, pairs)
    return Job(phase, variant, seq_len, seed, lr, pairs,
               train_argv(p, phase, variant, seq_len, seed, lr, steps, out_dir, job.name, pairs))


def sweep_jobs(p: Protocol, out_dir: str) -> list[Job]:
    if len(p.lrs) == 1:
        return []
    return [_job(p, out_dir, "sweep", v, p.sweep_seq_len, p.seeds[0], lr, p.sweep_steps)
            for v in p.variants for lr in p.lrs]


def grid_jobs(p: Protocol, out_dir: str, lr_of: dict[str, float]) -> list[Job]:
    """Every variant x context x seed; seed by seed, and within a seed the longest contexts first, so that the
    runs that take longest do not start last."""
    return [_job(p, out_dir, "grid", v, t, s, lr_of[v], p.steps)
            for s in p.seeds for t in sorted(p.seq_lens, reverse=True) for v in p.variants]


def recall_jobs(p: Protocol, out_dir: str, lr_of: dict[str, float]) -> list[Job]:
    """Every variant x length x pair count x seed: whether a model learns recall within the budget is close to
    all or nothing and varies with the seed, so one seed says little."""
    return [_job(p, out_dir, "recall", v, t, s, lr_of[v], p.recall_steps, pairs)
            for s in p.seeds for t in p.recall_seq_lens for pairs in p.recall_pairs for v in p.variants]


def after_sweep(p: Protocol, out_dir: str, lr_of: dict[str, float]) -> list[Job]:
    """The grid and the recall probe in the order they run: both with the first seed, then both with the
    other seeds. A study stopped early (a time limit, a lost machine) then has every cell once before it has
    any twice."""
    grid, recall = grid_jobs(p, out_dir, lr_of), recall_jobs(p, out_dir, lr_of)
    first = p.seeds[0]
    return ([j for j in grid + recall if j.seed == first] + [j for j in grid if j.seed != first]
            + [j for j in recall if j.seed != first])
