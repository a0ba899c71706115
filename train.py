"""Train the byte-level GPT on enwik8, or on the associative-recall probe.

    python train.py                                     # configs/base on a GPU, configs/tiny_cpu (minutes) on a CPU
    python train.py --seq-len 8192 --use-cuda-kernel    # configs/base on a GPU, cosine-sim on our kernels
    torchrun --standalone --nproc_per_node=8 train.py --grad_accum_steps 8 --use-cuda-kernel   # DDP, 8 GPUs
    python train.py --config configs/recall --attention softmax --recall_pairs 32   # recall, about a minute on a GPU

``--task recall`` trains on generated multi-query associative recall sequences (data/recall.py) instead of
enwik8: nothing is downloaded, the loss is over the answers only, and evaluations log val/accuracy (test/accuracy
at the end) with the loss, not bpc by position (an answer's place in the sequence is not how far back its pair
is) nor samples.

Every field of TrainConfig can be set in the config file (``name = literal`` lines) and overridden on
the command line as ``--name value``, ``--name=value`` or ``--name-with-dashes value``; boolean flags
alone mean true (``--compile``), or take true/false. A run writes out/<run_name>/: config.json,
metrics.jsonl (one JSON object per step and per evaluation) and ckpt.pt; with ``--keep_best`` also best.pt, the
checkpoint of the lowest periodic val loss so far (a run that starts to memorise keeps the model from before).
``--stop_accuracy A`` (recall) ends a run, as finished, at the first periodic evaluation whose accuracy reaches A.

``--resume auto`` continues from out/<run_name>/ckpt.pt when there is one (else starts fresh);
``--resume PATH`` from that checkpoint. A resumed run keeps the checkpoint's value of every field the command
line (or an explicit --config) does not give, and reproduces the uninterrupted run exactly (bit for bit on
CPU); resuming a run that has reached max_iters does nothing. SIGINT or SIGTERM finishes the current step and
the evaluation due after it, saves a checkpoint and exits with code 130 (or 0 when that step was the last: the
run is then finished); a second SIGINT interrupts at once. Exit codes: 0 training finished; 2 bad command
line, config, data or checkpoint, or out of GPU memory (the message says what the run asked for and what to
try); 3 diverged (a non-finite loss, gradient norm or weight: the step is not taken, no checkpoint is written,
the last good one stays); 4 a checkpoint could not be written (a full disk: the last good one stays); 130
stopped by a signal.

Under torchrun (WORLD_SIZE > 1) each process trains a DistributedDataParallel replica on its own GPU (or
CPU, over gloo) and draws its own random windows. grad_accum_steps counts the micro-steps of all processes
together, each doing grad_accum_steps / WORLD_SIZE of them, so a step's batch does not grow with the
process count. Evaluations are split over the ranks and summed exactly; rank 0 alone logs and writes the
checkpoint, which every rank reads on resume (with the same WORLD_SIZE).

``--context-parallel N`` splits each sequence over N consecutive ranks, with the attention of
docs/context_parallel.md between them (softmax: PyTorch's context-parallel SDPA, on GPUs only); WORLD_SIZE / N
such groups train data-parallel, and grad_accum_steps then counts the micro-steps of the groups:

    torchrun --standalone --nproc_per_node=4 train.py --attention cosine --context-parallel 4 --seq_len 16384
    torchrun --standalone --nproc_per_node=4 train.py --attention softmax --context-parallel 4 --seq_len 16384
"""
from __future__ import annotations

import contextlib
import gc
import json
import math
import os
import random
import signal
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from data import DataError, RandomWindowSampler, RecallSampler, RecallTask, data_fingerprint, load_enwik8
from lab.config import CommandLine, TrainConfig, parse_command_line, resumed_config, usage_error
from lab.files import (CheckpointWriteError, RunDir, RunLog, checkpoint_to_resume, describe_data, resolve_wandb_mode,
                       save_checkpoint)
from lab.steps import (attention_described, autocast_for, clip_gradients, evaluate, evaluate_recall, finite_weights,
                       gather_from_ranks, lr_at, make_optimizer, memory_advice, peak_flops, peak_memory_gib, rng_states,
                       sample_text, scores_problem, set_rng_states, setup_device, training_model)
from model import GPT
from model.diagnostics import attention_concentration, summarize
from model.context_parallel import context_device_problem

EXIT_USAGE = 2  # the command line, config, data or checkpoint is wrong, or the run does not fit the GPU
EXIT_STOPPED = 130  # stopped early by SIGINT/SIGTERM, after saving a checkpoint
EXIT_DIVERGED = 3  # stopped by a non-finite loss, gradient or weight; the last good checkpoint is kept
EXIT_UNSAVED = 4  # a checkpoint could not be written (a full disk); the last good one is kept
SAMPLE_PROMPT_BYTES = 64
STATS_BYTES = 32768  # the longest window the attention's concentration is measured on at evaluation


class StopOnSignal:
    """SIGINT/SIGTERM ask the loop to stop after the current step; a second SIGINT interrupts at once."""

    def __enter__(self):
        self.signum = None
        self.previous = {s: signal.signal(s, self._handle) for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def _handle(self, signum, frame):
        self.signum = signum
        signal.signal(signal.SIGINT, signal.default_int_handler)

    def __exit__(self, *exc):
        for s, handler in self.previous.items():
            signal.signal(s, handler)


class Diverged(Exception):
    """A non-finite loss, gradient norm or weight: the run stops without taking the step or writing a checkpoint."""


def main(argv: list[str] | None = None) -> int:
    cli = parse_command_line(argv)
    with contextlib.ExitStack() as held:  # the run directory's lock, released however the run ends
        return run(cli, held)


def run(cli: CommandLine, held: contextlib.ExitStack) -> int:
    cfg, ranks, run_dir, ckpt = configure(cli)
    wandb_mode = resolve_wandb_mode(cfg) if ranks.rank == 0 else None  # before anything is loaded or written
    if already_complete(cfg, ckpt, ranks.rank):
        return 0
    device, dtype = start_device(cfg, ranks)
    data = load_data(cfg, ranks, ckpt)
    trainer = Trainer(cfg, ranks, device, dtype, data, run_dir, ckpt)
    if ranks.rank == 0:
        trainer.open_run_dir(held, wandb_mode, resumed=ckpt is not None)
    exit_code = trainer.train()
    if ranks.world_size > 1:
        # The trainer, and with it DDP's reducer, goes first, while the process group is still registered. Were
        # the reducer the group's last owner, the group's destructor would join gloo's worker threads with the GIL
        # held, while a worker freeing a finished collective's Python tensors waits for the GIL: a deadlock at
        # exit, now and then (pytorch/pytorch#56297). The registry's own reference is released without the GIL.
        trainer = None
        gc.collect()
        # torchrun ends the job when a rank exits with a nonzero code (130 after a signal): no rank leaves
        # before rank 0 has written its checkpoint and closed its log.
        dist.barrier()
        dist.destroy_process_group()
    return exit_code


@dataclass(frozen=True)
class Ranks:
    """This process's place in the job (set by torchrun; a plain `python train.py` is rank 0 of 1). Consecutive
    ranks form a context group, which splits each sequence; the groups train data-parallel, each drawing its own
    batches (as data rank data_rank of data_size), which all ranks of the group share."""
    rank: int
    local_rank: int
    world_size: int
    context: int  # the ranks of a context group (context_parallel)

    @property
    def data_rank(self) -> int:
        return self.rank // self.context

    @property
    def data_size(self) -> int:
        return self.world_size // self.context


def configure(cli: CommandLine) -> tuple[TrainConfig, Ranks, Path, dict | None]:
    """The run's config (the checkpoint's where it resumes, cli's fields on top), this process's ranks, the run
    directory and the checkpoint to resume from (None for a fresh run); or exit 2."""
    try:
        cfg = TrainConfig(**cli.values)
    except ValueError as err:
        usage_error(str(err))
    rank, local_rank = int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    if rank == 0 and cli.note:
        print(cli.note)
    run_dir = Path(cfg.out_dir) / cfg.run_name
    ckpt = checkpoint_to_resume(cli.resume, run_dir / "ckpt.pt", world_size)
    if ckpt is not None:
        cfg = resumed_config(cfg, cli.given, ckpt)
    context = cfg.context_parallel
    if world_size % context:
        usage_error(f"context_parallel: expected a divisor of WORLD_SIZE={world_size} (the processes split into "
                    f"groups of context_parallel), got {context}")
    ranks = Ranks(rank, local_rank, world_size, context)
    if cfg.grad_accum_steps % ranks.data_size:
        data = (f"WORLD_SIZE / context_parallel = {world_size} / {context}" if context > 1
                else f"WORLD_SIZE={world_size}")
        usage_error(f"grad_accum_steps: expected a multiple of {data} (it counts the micro-steps of all data-parallel "
                    f"processes together), got {cfg.grad_accum_steps}")
    return cfg, ranks, run_dir, ckpt


def already_complete(cfg: TrainConfig, ckpt: dict | None, rank: int) -> bool:
    """Whether the checkpoint resumed has nothing left to train (rank 0 says so). A checkpoint is written after
    its step's evaluations, so a finished run's final ones are logged already: running them again would log them
    twice."""
    if ckpt is None or (ckpt["step"] < cfg.max_iters and not ckpt.get("stopped_at_accuracy")):
        return False
    if rank == 0:
        why = (f"it reached stop_accuracy at step {ckpt['step']}" if ckpt.get("stopped_at_accuracy") else
               f"the checkpoint is at step {ckpt['step']}, max_iters is {cfg.max_iters}; a larger --max_iters "
               f"trains on, at min_lr past lr_decay_iters={cfg.lr_decay_iters}")
        print(f"{cfg.run_name}: already complete ({why}); nothing to do")
    return True


def start_device(cfg: TrainConfig, ranks: Ranks) -> tuple[torch.device, torch.dtype]:
    """This process's device and dtype, once the run is known to fit them (or exit 2); under torchrun, the
    process group joined."""
    device, dtype = setup_device(cfg, ranks.local_rank, ranks.world_size)
    problem = context_device_problem(cfg, device) if ranks.context > 1 else None
    if problem is not None:
        usage_error(f"context_parallel {ranks.context}: {problem}")
    problem = scores_problem(cfg, device, dtype)
    if problem is not None:
        usage_error(problem)
    if ranks.world_size > 1:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                device_id=device if device.type == "cuda" else None)
    return device, dtype


def load_splits(cfg: TrainConfig, rank: int, world_size: int) -> dict[str, np.ndarray]:
    """enwik8's train/val/test splits, each checked to hold a window, or exit 2."""
    # Rank 0 downloads and verifies enwik8 (once) while the others wait; then they read its cache.
    if rank != 0:
        dist.barrier()
    try:
        splits = load_enwik8(cfg.data_path, log=print if rank == 0 else lambda *_: None)
    except DataError as err:
        usage_error(str(err))
    if rank == 0 and world_size > 1:
        dist.barrier()
    # Checked here, not left to the sampler and the first evaluation: a short val split would only fail
    # after eval_interval steps of training.
    for name, split in splits.items():
        if len(split) <= cfg.seq_len:
            usage_error(f"seq_len: {cfg.seq_len} needs windows of seq_len + 1 bytes, but the {name} split of the "
                        f"data has {len(split):,}")
    return splits


@dataclass
class Data:
    """What the run trains and evaluates on: enwik8's splits, or the recall task's generated sequences."""
    sampler: RandomWindowSampler | RecallSampler
    fingerprint: dict  # what a checkpoint records of the data, to refuse a resume on other data
    splits: dict[str, np.ndarray] | None = None  # enwik8
    recall: RecallTask | None = None
    prompt: bytes | None = None  # what the samples continue: enwik8's, as recall's sequences are no text


def load_data(cfg: TrainConfig, ranks: Ranks, ckpt: dict | None) -> Data:
    """The task's data, with this data rank's sampler; exit 2 when it is not the data the checkpoint trained on."""
    if cfg.task == "enwik8":
        splits = load_splits(cfg, ranks.rank, ranks.world_size)
        sampler = RandomWindowSampler(splits["train"], cfg.batch_size, cfg.seq_len, cfg.seed, ranks.data_rank,
                                      ranks.data_size)
        data = Data(sampler, data_fingerprint(splits), splits=splits, prompt=bytes(splits["val"][:SAMPLE_PROMPT_BYTES]))
    else:  # generated sequences: nothing to download
        recall = RecallTask(cfg.seq_len, cfg.recall_pairs, cfg.recall_queries)
        sampler = RecallSampler(recall, cfg.batch_size, cfg.seed, ranks.data_rank, ranks.data_size)
        data = Data(sampler, recall.fingerprint(cfg.seed), recall=recall)
    # The data is part of the trajectory: a resume on other bytes (another file, the same path changed, or a
    # recall generator that draws differently now) would not continue the run it names.
    if ckpt is not None and ckpt["data"] != data.fingerprint:
        usage_error(f"--resume: the data differs from the checkpoint's: the run trained on "
                    f"{describe_data(ckpt['data'], ckpt['config'].get('data_path'))}, this is "
                    f"{describe_data(data.fingerprint, cfg.data_path)}")
    return data


class Trainer:
    """A run from its first (or resumed) step to its end: the model, the optimizer and the data stream, the
    evaluations, and what rank 0 writes (the log, ckpt.pt, best.pt)."""

    def __init__(self, cfg: TrainConfig, ranks: Ranks, device: torch.device, dtype: torch.dtype, data: Data,
                 run_dir: Path, ckpt: dict | None):
        self.cfg, self.ranks, self.device, self.dtype, self.data = cfg, ranks, device, dtype, data
        self.autocast = autocast_for(device, dtype)
        self.run_dir, self.ckpt_path, self.best_path = run_dir, run_dir / "ckpt.pt", run_dir / "best.pt"
        random.seed(cfg.seed)
        np.random.seed(cfg.seed)
        # Per rank, so that ranks draw different dropout masks; DDP gives every rank rank 0's initial weights.
        torch.manual_seed(cfg.seed + ranks.rank)
        self.model = GPT(cfg.model_config()).to(device)
        if ranks.context > 1:
            context_group, _ = dist.new_subgroups(ranks.context)  # every rank takes part in making every group
            self.model.set_context_group(context_group)
        self.optimizer = make_optimizer(self.model, cfg, device)
        self.step, self.run_id = 0, None
        self.best = None  # the lowest val loss so far (keep_best), {"step", "loss"}
        self.saved_step = None  # the step ckpt.pt holds
        if ckpt is not None:
            self.model.load_state_dict(ckpt["model"])
            self.optimizer.load_state_dict(ckpt["optimizer"])
            data.sampler.load_state_dict(ckpt["sampler"])
            set_rng_states(ckpt["rng"][ranks.rank], device)
            self.step = self.saved_step = ckpt["step"]
            self.best = ckpt.get("best")
            # A resume under another run name is a new wandb run (a fork), not more rows in the old one.
            if ckpt["config"]["run_name"] == cfg.run_name:
                self.run_id = ckpt["wandb_run_id"]
        # DDP averages the gradients over ranks during backward, in buckets that overlap the computation. Over
        # all ranks, context groups included: the ranks of a group hold the same weights (DDP's broadcast from
        # rank 0 sees to that) and their gradients' sum is their sequences', so one all-reduce serves both
        # (train_step scales by the group size to turn DDP's mean over a group into that sum).
        self.ddp = (DistributedDataParallel(self.model, device_ids=[device.index] if device.type == "cuda" else None)
                    if ranks.world_size > 1 else None)
        self.train_model = training_model(self.model if self.ddp is None else self.ddp, cfg)
        self.micro_steps = cfg.grad_accum_steps // ranks.data_size  # this process's share of each step
        self.tokens_per_step = cfg.batch_size * cfg.seq_len * cfg.grad_accum_steps
        self.flops_per_token = self.model.flops_per_token(dtype)
        self.peak = peak_flops(cfg, device, dtype)
        self.run_log = None  # rank 0's (open_run_dir)
        self.doing = "the first step"  # what an out-of-memory error interrupted

    def open_run_dir(self, held: contextlib.ExitStack, wandb_mode: str, resumed: bool) -> None:
        """Rank 0's: hold the run directory (held releases it), write config.json, open the log, say what runs."""
        cfg, ranks, run_dir = self.cfg, self.ranks, self.run_dir
        held.callback(RunDir(run_dir).close)
        (run_dir / "config.json").write_text(json.dumps(asdict(cfg), indent=2) + "\n")
        self.run_log = RunLog(cfg, run_dir, self.run_id, self.step, wandb_mode)
        self.run_id = self.run_log.wandb.id
        task = f", recall of {cfg.recall_queries} of {cfg.recall_pairs} pairs" if cfg.task == "recall" else ""
        print(f"{cfg.run_name}: {self.model.num_params() / 1e6:.2f}M params, {attention_described(cfg)}"
              f"{task}, {self.tokens_per_step:,} tokens/step, "
              f"{self.flops_per_token / 1e6:.1f} MFLOP/token, {self.device} {self.dtype}"
              f"{f' x {ranks.world_size} processes' if ranks.world_size > 1 else ''}"
              f"{f' in context groups of {ranks.context}' if ranks.context > 1 else ''}, writing to {run_dir}"
              + (f", resuming at step {self.step}" if resumed else ""))
        if self.peak is None:
            print(f"perf/mfu not logged: no peak FLOP/s known for {self.device} {self.dtype}; "
                  "pass --peak_tflops to set it")

    def train(self) -> int:
        """Train to max_iters, stop_accuracy or a signal, evaluating and checkpointing on the way, then close the
        log; the exit code (rank 0 says what ended a run early)."""
        # The handlers stay in place until the log is closed: a signal during wandb's finish must not cut it short.
        with StopOnSignal() as stop:
            try:
                reached = self.loop(stop)
                exit_code = self.finish(stop, reached)
            except Diverged as err:
                exit_code = EXIT_DIVERGED
                if self.ranks.rank == 0:
                    kept = (f"{self.ckpt_path} still holds step {self.saved_step}" if self.saved_step is not None
                            else "no checkpoint was written")
                    print(f"train.py: error: training diverged: {err}. Stopped without taking that step or writing a "
                          f"checkpoint; {kept}. Lower --lr (now {self.cfg.lr:g}) or --grad_clip, and start again "
                          f"(or --resume from a good checkpoint).", file=sys.stderr)
            except torch.OutOfMemoryError:
                exit_code = EXIT_USAGE
                if self.ranks.rank == 0:
                    kept = (f"{self.ckpt_path} holds step {self.saved_step}" if self.saved_step is not None
                            else "no checkpoint was written")
                    total = (f" ({torch.cuda.get_device_properties(self.device).total_memory / 2**30:.0f} GiB)"
                             if self.device.type == "cuda" else "")
                    print(f"train.py: error: out of memory during {self.doing} on {self.device}{total}; {kept}. "
                          + memory_advice(self.cfg), file=sys.stderr)
            except CheckpointWriteError as err:
                exit_code = EXIT_UNSAVED
                if self.ranks.rank == 0:
                    print(f"train.py: error: {err}. Free some space (or pass another --out_dir) and continue with "
                          "--resume auto.", file=sys.stderr)
            if self.run_log is not None:
                self.run_log.close(exit_code)
        return exit_code

    def loop(self, stop: StopOnSignal) -> bool:
        """Take steps until max_iters, a signal or stop_accuracy, each followed by the evaluation and checkpoint
        due after it; whether the run reached stop_accuracy."""
        cfg = self.cfg
        stopping = reached = False
        with tqdm(total=cfg.max_iters, initial=self.step, disable=self.ranks.rank != 0, dynamic_ncols=True) as bar:
            while self.step < cfg.max_iters and not stopping and not reached:
                t0 = time.perf_counter()
                train_loss, grad_norm, lr, stopping = self.train_step(stop)
                dt = time.perf_counter() - t0
                self.step += 1
                bar.update()
                if self.ranks.rank == 0:
                    self.log_step(train_loss, grad_norm, lr, dt, bar)
                # A stop still runs the evaluation due at this step: a resume starts after the checkpointed
                # step and would never log it.
                if self.step < cfg.max_iters:
                    if self.step % cfg.eval_interval == 0:
                        accuracy = self.log_eval("val", cfg.eval_max_windows, with_sample=True)
                        reached = cfg.stop_accuracy is not None and accuracy >= cfg.stop_accuracy
                    # else the checkpoint below is this step's
                    if self.step % cfg.ckpt_interval == 0 and not (stopping or reached):
                        self.checkpoint(self.ckpt_path)
        return reached

    def train_step(self, stop: StopOnSignal) -> tuple[float, float, float, bool]:
        """One optimizer step over this process's micro-steps: (the step's training loss over all ranks, the
        gradient norm, the lr, whether any rank was signalled). Diverged, without taking the step, on a
        non-finite loss or gradient norm."""
        cfg, device = self.cfg, self.device
        self.doing = f"training step {self.step + 1}"
        lr = lr_at(self.step, cfg)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        loss_sum = torch.zeros((), device=device)
        for micro in range(self.micro_steps):
            x, y = self.data.sampler.next_batch()
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            # DDP all-reduces the gradients in backward; once per step is enough, at the last micro-step.
            last = micro == self.micro_steps - 1
            with self.ddp.no_sync() if self.ddp is not None and not last else contextlib.nullcontext():
                with self.autocast:
                    _, loss = self.train_model(x, y)
                (loss * self.ranks.context / self.micro_steps).backward()
            loss_sum += loss.detach()
        grad_norm = clip_gradients(self.model, cfg)
        # One all-reduce carries the loss summed over ranks and whether any rank was signalled, so the
        # logged loss is the whole step's and all ranks stop after the same step. The gradient norm
        # is the same on every rank (DDP averaged the gradients).
        stats = torch.stack([loss_sum, torch.tensor(float(stop.signum is not None), device=device)])
        if self.ranks.world_size > 1:
            dist.all_reduce(stats)
        loss_total, stop_votes, norm = torch.cat([stats, grad_norm.reshape(1)]).tolist()
        train_loss = loss_total / cfg.grad_accum_steps
        # Checked before the step is taken, so the weights never see a non-finite update.
        if not (math.isfinite(train_loss) and math.isfinite(norm)):
            raise Diverged(f"step {self.step + 1} has training loss {train_loss} and gradient norm {norm} "
                           f"(lr {lr:.3g})")
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return train_loss, norm, lr, stop_votes > 0

    def log_step(self, train_loss: float, grad_norm: float, lr: float, dt: float, bar: tqdm) -> None:
        """Rank 0's: the step's row in the log, and its bpc and throughput on the progress bar."""
        metrics = {"train/loss": train_loss, "train/bpc": train_loss / math.log(2), "lr": lr,
                   "grad_norm": grad_norm, "perf/tokens_per_s": self.tokens_per_step / dt,
                   "perf/step_ms": 1000 * dt, "perf/peak_mem_gib": peak_memory_gib(self.device)}
        if self.peak is not None:  # one device's peak
            metrics["perf/mfu"] = self.flops_per_token * self.tokens_per_step / dt / (self.peak * self.ranks.world_size)
        self.run_log.log(self.step, metrics)
        bar.set_postfix(bpc=f"{metrics['train/bpc']:.3f}", tok_s=f"{metrics['perf/tokens_per_s']:.0f}")

    def finish(self, stop: StopOnSignal, reached: bool) -> int:
        """After the last step taken: a finished run's final evaluations, the last checkpoint, and the exit code
        (0, or 130 when a signal stopped the run before its end)."""
        finished = self.step == self.cfg.max_iters or reached
        if finished:
            if self.ranks.rank == 0 and reached:
                print(f"val accuracy reached stop_accuracy={self.cfg.stop_accuracy:g} at step {self.step}: "
                      "the run is done")
            self.log_eval("val", self.cfg.final_eval_max_windows, with_sample=True)
            self.log_eval("test", self.cfg.final_eval_max_windows, with_sample=False)
        self.checkpoint(self.ckpt_path, stopped_at_accuracy=reached)
        if finished:
            return 0
        if self.ranks.rank == 0:
            by = signal.Signals(stop.signum).name if stop.signum is not None else "a signal to another rank"
            print(f"stopped by {by} after step {self.step}; checkpoint in {self.ckpt_path}, continue with "
                  "--resume auto")
        return EXIT_STOPPED

    def log_eval(self, split: str, max_windows: int | None, with_sample: bool) -> float | None:
        """Evaluate on split, log it, keep the best checkpoint (keep_best); recall's accuracy, else None.
        enwik8 is scored by bpc, overall and by position in the window; recall by its loss and accuracy over the
        answers, which is all it asks (its other targets are IGNORE_INDEX)."""
        cfg, data, step = self.cfg, self.data, self.step
        self.doing = f"the {split} evaluation at step {step}"
        curve = accuracy = None
        if cfg.task == "enwik8":
            loss, curve = evaluate(self.model, data.splits[split], cfg, self.device, self.autocast, max_windows,
                                   self.ranks.data_rank, self.ranks.data_size)
        else:
            batches = data.recall.eval_batches(split, cfg.batch_size, max_windows)
            loss, accuracy = evaluate_recall(self.model, batches, self.device, self.autocast, self.ranks.data_rank,
                                             self.ranks.data_size)
        if not math.isfinite(loss):  # summed over ranks, so every rank sees the same
            raise Diverged(f"the {split} loss is {loss} at step {step}")
        if self.ranks.rank == 0:
            # With sample_tokens = 0 the "sample" would be the prompt alone.
            sample = (sample_text(self.model, data.prompt, cfg.sample_tokens, self.device, self.autocast,
                                  cfg.seed + step)
                      if with_sample and cfg.sample_tokens and data.prompt is not None else None)
            self.run_log.log_eval(step, split, loss, curve, sample, accuracy,
                                  self.attention_stats(split) if cfg.task == "enwik8" and split == "val" else None)
            tqdm.write(f"step {step}: {split} bpc {loss / math.log(2):.4f}"
                       + (f", accuracy {accuracy:.4f}" if accuracy is not None else "")
                       + (f"\n--- sample ---\n{sample}\n--------------" if sample else ""))
        # Only evaluations on the periodic windows compare with each other (a final one may score more).
        if cfg.keep_best and split == "val" and max_windows == cfg.eval_max_windows and (
                self.best is None or loss < self.best["loss"]):
            self.best = {"step": step, "loss": loss}
            self.checkpoint(self.best_path)
        return accuracy

    def attention_stats(self, split: str) -> dict:
        """How concentrated each head's weights are on the split's first window (model/diagnostics.py), of at most
        STATS_BYTES: rank 0 measures it alone, whole, also in a context-parallel run."""
        window = self.data.splits[split][:min(self.cfg.seq_len, STATS_BYTES)]
        x = torch.from_numpy(window.astype(np.int64))[None].to(self.device)
        with self.autocast:
            stats = attention_concentration(self.model, x)
        return {**summarize(stats), "attn/max_weight_heads": stats["max_weight"],
                "attn/entropy_heads": stats["entropy"]}

    def checkpoint(self, path: Path, stopped_at_accuracy: bool = False) -> None:
        """Save the run at this step to path (rank 0 writes it); Diverged, writing nothing, when the weights are
        not finite."""
        if not finite_weights(self.model):  # the same on every rank: DDP keeps the replicas equal
            raise Diverged(f"the weights hold inf or NaN at step {self.step}")
        # Every rank's RNG state (their dropout masks differ); the rest is the same on all ranks.
        rngs = gather_from_ranks(rng_states(self.device), self.ranks.world_size)
        if self.ranks.rank == 0:
            save_checkpoint({"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                             "step": self.step, "config": asdict(self.cfg), "rng": rngs,
                             "sampler": self.data.sampler.state_dict(), "world_size": self.ranks.world_size,
                             "wandb_run_id": self.run_id, "data": self.data.fingerprint, "best": self.best,
                             "stopped_at_accuracy": stopped_at_accuracy}, path)
        if path == self.ckpt_path:
            self.saved_step = self.step


if __name__ == "__main__":
    sys.exit(main())
