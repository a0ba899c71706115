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
from dataclasses import asdict
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


def run(cli: CommandLine, held: contextlib.ExitStack) -> int:
    try:
        cfg = TrainConfig(**cli.values)
    except ValueError as err:
        usage_error(str(err))
    # Set by torchrun; a plain `python train.py` is rank 0 of 1.
    rank, local_rank = int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    if rank == 0 and cli.note:
        print(cli.note)
    run_dir = Path(cfg.out_dir) / cfg.run_name
    ckpt_path, best_path = run_dir / "ckpt.pt", run_dir / "best.pt"
    ckpt = checkpoint_to_resume(cli.resume, ckpt_path, world_size)
    if ckpt is not None:
        cfg = resumed_config(cfg, cli.given, ckpt)
    # Consecutive ranks form a context group, which splits each sequence; the groups train data-parallel, each
    # drawing its own batches (as data rank r of data_size), which all ranks of the group share.
    context = cfg.context_parallel
    if world_size % context:
        usage_error(f"context_parallel: expected a divisor of WORLD_SIZE={world_size} (the processes split into "
                    f"groups of context_parallel), got {context}")
    data_rank, data_size = rank // context, world_size // context
    if cfg.grad_accum_steps % data_size:
        data = (f"WORLD_SIZE / context_parallel = {world_size} / {context}" if context > 1
                else f"WORLD_SIZE={world_size}")
        usage_error(f"grad_accum_steps: expected a multiple of {data} (it counts the micro-steps of all data-parallel "
                    f"processes together), got {cfg.grad_accum_steps}")
    micro_steps = cfg.grad_accum_steps // data_size
    wandb_mode = resolve_wandb_mode(cfg) if rank == 0 else None  # before anything is loaded or written
    if ckpt is not None and (ckpt["step"] >= cfg.max_iters or ckpt.get("stopped_at_accuracy")):
        # Nothing left to train. A checkpoint is written after its step's evaluations, so a finished run's
        # final ones are logged already: running them again would log them twice.
        if rank == 0:
            why = (f"it reached stop_accuracy at step {ckpt['step']}" if ckpt.get("stopped_at_accuracy") else
                   f"the checkpoint is at step {ckpt['step']}, max_iters is {cfg.max_iters}; a larger --max_iters "
                   f"trains on, at min_lr past lr_decay_iters={cfg.lr_decay_iters}")
            print(f"{cfg.run_name}: already complete ({why}); nothing to do")
        return 0
    device, dtype = setup_device(cfg, local_rank, world_size)
    problem = context_device_problem(cfg, device) if context > 1 else None
    if problem is not None:
        usage_error(f"context_parallel {context}: {problem}")
    problem = scores_problem(cfg, device, dtype)
    if problem is not None:
        usage_error(problem)
    autocast = autocast_for(device, dtype)
    if world_size > 1:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                device_id=device if device.type == "cuda" else None)

    if cfg.task == "enwik8":
        splits = load_splits(cfg, rank, world_size)
        fingerprint = data_fingerprint(splits)
        sampler = RandomWindowSampler(splits["train"], cfg.batch_size, cfg.seq_len, cfg.seed, data_rank, data_size)
        prompt = bytes(splits["val"][:SAMPLE_PROMPT_BYTES])
    else:  # generated sequences: nothing to download, and no text to continue in a sample
        recall = RecallTask(cfg.seq_len, cfg.recall_pairs, cfg.recall_queries)
        fingerprint = recall.fingerprint(cfg.seed)
        sampler = RecallSampler(recall, cfg.batch_size, cfg.seed, data_rank, data_size)
        prompt = None
    # The data is part of the trajectory: a resume on other bytes (another file, the same path changed, or a
    # recall generator that draws differently now) would not continue the run it names.
    if ckpt is not None and ckpt["data"] != fingerprint:
        usage_error(f"--resume: the data differs from the checkpoint's: the run trained on "
                    f"{describe_data(ckpt['data'], ckpt['config'].get('data_path'))}, this is "
                    f"{describe_data(fingerprint, cfg.data_path)}")
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    # Per rank, so that ranks draw different dropout masks; DDP gives every rank rank 0's initial weights.
    torch.manual_seed(cfg.seed + rank)
    model = GPT(cfg.model_config()).to(device)
    if context > 1:
        context_group, _ = dist.new_subgroups(context)  # every rank takes part in making every group
        model.set_context_group(context_group)
    optimizer = make_optimizer(model, cfg, device)
    start_step, run_id, best = 0, None, None  # best: the lowest val loss so far (keep_best), {"step", "loss"}
    if ckpt is not None:
        best = ckpt.get("best")
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        sampler.load_state_dict(ckpt["sampler"])
        set_rng_states(ckpt["rng"][rank], device)
        start_step = ckpt["step"]
        # A resume under another run name is a new wandb run (a fork), not more rows in the old one.
        if ckpt["config"]["run_name"] == cfg.run_name:
            run_id = ckpt["wandb_run_id"]
    # DDP averages the gradients over ranks during backward, in buckets that overlap the computation. Over all
    # ranks, context groups included: the ranks of a group hold the same weights (DDP's broadcast from rank 0
    # sees to that) and their gradients' sum is their sequences', so one all-reduce serves both (the backward
    # below scales by the group size to turn DDP's mean over a group into that sum).
    ddp = (DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
           if world_size > 1 else None)
    train_model = model if ddp is None else ddp
    train_model = training_model(train_model, cfg)

    tokens_per_step = cfg.batch_size * cfg.seq_len * cfg.grad_accum_steps
    flops_per_token = model.flops_per_token(dtype)
    peak = peak_flops(cfg, device, dtype)
    run_log = None
    if rank == 0:
        held.callback(RunDir(run_dir).close)
        (run_dir / "config.json").write_text(json.dumps(asdict(cfg), indent=2) + "\n")
        run_log = RunLog(cfg, run_dir, run_id, start_step, wandb_mode)
        run_id = run_log.wandb.id
        task = f", recall of {cfg.recall_queries} of {cfg.recall_pairs} pairs" if cfg.task == "recall" else ""
        print(f"{cfg.run_name}: {model.num_params() / 1e6:.2f}M params, {attention_described(cfg)}"
              f"{task}, {tokens_per_step:,} tokens/step, "
              f"{flops_per_token / 1e6:.1f} MFLOP/token, {device} {dtype}"
              f"{f' x {world_size} processes' if world_size > 1 else ''}"
              f"{f' in context groups of {context}' if context > 1 else ''}, writing to {run_dir}"
              + (f", resuming at step {start_step}" if ckpt is not None else ""))
        if peak is None:
            print(f"perf/mfu not logged: no peak FLOP/s known for {device} {dtype}; pass --peak_tflops to set it")
    saved_step = start_step if ckpt is not None else None

    def checkpoint(step: int, path: Path = ckpt_path, stopped_at_accuracy: bool = False) -> None:
        nonlocal saved_step
        if not finite_weights(model):  # the same on every rank: DDP keeps the replicas equal
            raise Diverged(f"the weights hold inf or NaN at step {step}")
        # Every rank's RNG state (their dropout masks differ); the rest is the same on all ranks.
        rngs = gather_from_ranks(rng_states(device), world_size)
        if rank == 0:
            save_checkpoint({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
                             "config": asdict(cfg), "rng": rngs, "sampler": sampler.state_dict(),
                             "world_size": world_size, "wandb_run_id": run_id, "data": fingerprint, "best": best,
                             "stopped_at_accuracy": stopped_at_accuracy}, path)
        if path == ckpt_path:
            saved_step = step

    def log_eval(step: int, split: str, max_windows: int | None, with_sample: bool) -> float | None:
        """Evaluate on split, log it, keep the best checkpoint (keep_best); recall's accuracy, else None.
        enwik8 is scored by bpc, overall and by position in the window; recall by its loss and accuracy over the
        answers, which is all it asks (its other targets are IGNORE_INDEX)."""
        nonlocal doing, best
        doing = f"the {split} evaluation at step {step}"
        curve = accuracy = None
        if cfg.task == "enwik8":
            loss, curve = evaluate(model, splits[split], cfg, device, autocast, max_windows, data_rank, data_size)
        else:
            batches = recall.eval_batches(split, cfg.batch_size, max_windows)
            loss, accuracy = evaluate_recall(model, batches, device, autocast, data_rank, data_size)
        if not math.isfinite(loss):  # summed over ranks, so every rank sees the same
            raise Diverged(f"the {split} loss is {loss} at step {step}")
        if rank == 0:
            # With sample_tokens = 0 the "sample" would be the prompt alone.
            sample = (sample_text(model, prompt, cfg.sample_tokens, device, autocast, cfg.seed + step)
                      if with_sample and cfg.sample_tokens and prompt is not None else None)
            run_log.log_eval(step, split, loss, curve, sample, accuracy,
                             attention_stats(split) if cfg.task == "enwik8" and split == "val" else None)
            tqdm.write(f"step {step}: {split} bpc {loss / math.log(2):.4f}"
                       + (f", accuracy {accuracy:.4f}" if accuracy is not None else "")
                       + (f"\n--- sample ---\n{sample}\n--------------" if sample else ""))
        # Only evaluations on the periodic windows compare with each other (a final one may score more).
        if cfg.keep_best and split == "val" and max_windows == cfg.eval_max_windows and (
                best is None or loss < best["loss"]):
            best = {"step": step, "loss": loss}
            checkpoint(step, best_path)
        return accuracy

    def attention_stats(split: str) -> dict:
        """How concentrated each head's weights are on the split's first window (model/diagnostics.py), of at most
        STATS_BYTES: rank 0 measures it alone, whole, also in a context-parallel run."""
        x = torch.from_numpy(splits[split][:min(cfg.seq_len, STATS_BYTES)].astype(np.int64))[None].to(device)
        with autocast:
            stats = attention_concentration(model, x)
        return {**summarize(stats), "attn/max_weight_heads": stats["max_weight"], "attn/entropy_heads": stats["entropy"]}

    step, exit_code, stopping, reached = start_step, 0, False, False
    doing = "the first step"  # what an out-of-memory error interrupted
    bar = tqdm(total=cfg.max_iters, initial=start_step, disable=rank != 0, dynamic_ncols=True)
    # The handlers stay in place until the log is closed: a signal during wandb's finish must not cut it short.
    with StopOnSignal() as stop:
        try:
            while step < cfg.max_iters and not stopping and not reached:
                t0 = time.perf_counter()
                doing = f"training step {step + 1}"
                lr = lr_at(step, cfg)
                for group in optimizer.param_groups:
                    group["lr"] = lr
                loss_sum = torch.zeros((), device=device)
                for micro in range(micro_steps):
                    x, y = sampler.next_batch()
                    x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                    # DDP all-reduces the gradients in backward; once per step is enough, at the last micro-step.
                    with ddp.no_sync() if ddp is not None and micro < micro_steps - 1 else contextlib.nullcontext():
                        with autocast:
                            _, loss = train_model(x, y)
                        (loss * context / micro_steps).backward()
                    loss_sum += loss.detach()
                grad_norm = clip_gradients(model, cfg)
                # One all-reduce carries the loss summed over ranks and whether any rank was signalled, so the
                # logged loss is the whole step's and all ranks stop after the same step. The gradient norm
                # is the same on every rank (DDP averaged the gradients).
                stats = torch.stack([loss_sum, torch.tensor(float(stop.signum is not None), device=device)])
                if world_size > 1:
                    dist.all_reduce(stats)
                loss_total, stop_votes, norm = torch.cat([stats, grad_norm.reshape(1)]).tolist()
                train_loss, stopping = loss_total / cfg.grad_accum_steps, stop_votes > 0
                # Checked before the step is taken, so the weights never see a non-finite update.
                if not (math.isfinite(train_loss) and math.isfinite(norm)):
                    raise Diverged(f"step {step + 1} has training loss {train_loss} and gradient norm {norm} "
                                   f"(lr {lr:.3g})")
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                dt = time.perf_counter() - t0
                step += 1
                bar.update()
                if rank == 0:
                    metrics = {"train/loss": train_loss, "train/bpc": train_loss / math.log(2), "lr": lr,
                               "grad_norm": norm, "perf/tokens_per_s": tokens_per_step / dt,
                               "perf/step_ms": 1000 * dt, "perf/peak_mem_gib": peak_memory_gib(device)}
                    if peak is not None:  # one device's peak
                        metrics["perf/mfu"] = flops_per_token * tokens_per_step / dt / (peak * world_size)
                    run_log.log(step, metrics)
                    bar.set_postfix(bpc=f"{metrics['train/bpc']:.3f}", tok_s=f"{metrics['perf/tokens_per_s']:.0f}")
                # A stop still runs the evaluation due at this step: a resume starts after the checkpointed
                # step and would never log it.
                if step < cfg.max_iters:
                    if step % cfg.eval_interval == 0:
                        accuracy = log_eval(step, "val", cfg.eval_max_windows, with_sample=True)
                        reached = cfg.stop_accuracy is not None and accuracy >= cfg.stop_accuracy
                    # else the checkpoint below is this step's
                    if step % cfg.ckpt_interval == 0 and not (stopping or reached):
                        checkpoint(step)
            bar.close()
            finished = step == cfg.max_iters or reached
            if finished:
                if rank == 0 and reached:
                    print(f"val accuracy reached stop_accuracy={cfg.stop_accuracy:g} at step {step}: the run is done")
                log_eval(step, "val", cfg.final_eval_max_windows, with_sample=True)
                log_eval(step, "test", cfg.final_eval_max_windows, with_sample=False)
            checkpoint(step, stopped_at_accuracy=reached)
            if not finished:
                exit_code = EXIT_STOPPED
                if rank == 0:
                    by = signal.Signals(stop.signum).name if stop.signum is not None else "a signal to another rank"
                    print(f"stopped by {by} after step {step}; checkpoint in {ckpt_path}, continue with --resume auto")
        except Diverged as err:
            bar.close()
            exit_code = EXIT_DIVERGED
            if rank == 0:
                kept = (f"{ckpt_path} still holds step {saved_step}" if saved_step is not None
                        else "no checkpoint was written")
                print(f"train.py: error: training diverged: {err}. Stopped without taking that step or writing a "
                      f"checkpoint; {kept}. Lower --lr (now {cfg.lr:g}) or --grad_clip, and start again "
                      f"(or --resume from a good checkpoint).", file=sys.stderr)
        except torch.OutOfMemoryError:
            bar.close()
            exit_code = EXIT_USAGE
            if rank == 0:
                kept = f"{ckpt_path} holds step {saved_step}" if saved_step is not None else "no checkpoint was written"
                total = (f" ({torch.cuda.get_device_properties(device).total_memory / 2**30:.0f} GiB)"
                         if device.type == "cuda" else "")
                print(f"train.py: error: out of memory during {doing} on {device}{total}; {kept}. "
                      + memory_advice(cfg), file=sys.stderr)
        except CheckpointWriteError as err:
            bar.close()
            exit_code = EXIT_UNSAVED
            if rank == 0:
                print(f"train.py: error: {err}. Free some space (or pass another --out_dir) and continue with "
                      "--resume auto.", file=sys.stderr)
        if run_log is not None:
            run_log.close(exit_code)
    if world_size > 1:
        # DDP's reducer goes first, while the process group is still registered. Were the reducer the group's
        # last owner, the group's destructor would join gloo's worker threads with the GIL held, while a worker
        # freeing a finished collective's Python tensors waits for the GIL: a deadlock at exit, now and then
        # (pytorch/pytorch#56297). The registry's own reference is released without the GIL.
        ddp = train_model = None
        gc.collect()
        # torchrun ends the job when a rank exits with a nonzero code (130 after a signal): no rank leaves
        # before rank 0 has written its checkpoint and closed its log.
        dist.barrier()
        dist.destroy_process_group()
    return exit_code


if __name__ == "__main__":
    sys.exit(main())
