"""The pieces of a training step and of an evaluation: device and precision, optimizer and schedule,
RNG state, evaluation by position (enwik8) or over the answers (recall), sampling, and the measures logged
(peak memory, peak FLOP/s)."""
from __future__ import annotations

import contextlib
import itertools
import math
import random
import resource
import sys

import numpy as np
import torch
import torch.distributed as dist

from attention_cuda import cuda_unavailable_reason
from data import eval_windows, score
from lab.config import TrainConfig, usage_error
from model import GPT
from model.attention import attention_fn, attention_plan

# Datasheet dense bf16 peak of the H100/H200 SXM (989 TFLOP/s), the usual denominator for MFU so that
# numbers compare across reports; other devices need --peak_tflops.
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12}


def autocast_for(device: torch.device, dtype: torch.dtype):
    """What every forward runs under: autocast to a lower precision, or nothing in fp32."""
    return torch.autocast(device.type, dtype=dtype) if dtype != torch.float32 else contextlib.nullcontext()


def clip_gradients(model: GPT, cfg: TrainConfig) -> torch.Tensor:
    """Clip the gradients to cfg.grad_clip; the global norm before clipping."""
    return torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip or math.inf)


def training_model(model: torch.nn.Module, cfg: TrainConfig) -> torch.nn.Module:
    """The module a training step calls: the model (or its DDP wrapper), compiled where cfg asks (--compile)."""
    return torch.compile(model) if cfg.compile else model


def train_step(model: GPT, optimizer: torch.optim.Optimizer, x, y, cfg: TrainConfig, autocast) -> None:
    """One whole training step on one batch, as the training loop takes it (for the measuring scripts)."""
    with autocast:
        _, loss = model(x, y)
    loss.backward()
    clip_gradients(model, cfg)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate for 0-based step: linear warmup, then cosine decay to min_lr at lr_decay_iters."""
    if step < cfg.warmup_iters:
        return cfg.lr * (step + 1) / cfg.warmup_iters
    if step >= cfg.lr_decay_iters:
        return cfg.min_lr
    progress = (step - cfg.warmup_iters) / (cfg.lr_decay_iters - cfg.warmup_iters)
    return cfg.min_lr + 0.5 * (1 + math.cos(math.pi * progress)) * (cfg.lr - cfg.min_lr)


def make_optimizer(model: GPT, cfg: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    params = list(model.parameters())
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), fused=device.type == "cuda")


def rng_states(device: torch.device) -> dict:
    # The CUDA state of this process's device only: reading every GPU's would make each DDP rank create
    # a CUDA context on all of them.
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None}


def set_rng_states(states: dict, device: torch.device) -> None:
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    if states["cuda"] is not None and device.type == "cuda":
        torch.cuda.set_rng_state(states["cuda"], device)


def gather_from_ranks(obj, world_size: int) -> list:
    """[rank 0's obj, rank 1's obj, ...] on every rank (a collective: all ranks must call it)."""
    if world_size == 1:
        return [obj]
    objs = [None] * world_size
    dist.all_gather_object(objs, obj)
    return objs


def bpc_by_position(loss_sum: torch.Tensor, count: torch.Tensor) -> list[tuple[int, float]]:
    """[(p, bpc)] over buckets of 1-based position in the window, each up to p: 1, 2, 3-4, 5-8, ...,
    the last ending at seq_len. A position is how many bytes of context the prediction had."""
    curve, lo, hi = [], 0, 1
    while lo < len(loss_sum):
        hi = min(hi, len(loss_sum))
        n = count[lo:hi].sum().item()
        if n:
            curve.append((hi, loss_sum[lo:hi].sum().item() / n / math.log(2)))
        lo, hi = hi, 2 * hi
    return curve


@torch.no_grad()
def evaluate(model: GPT, split: np.ndarray, cfg: TrainConfig, device, autocast, max_windows,
             rank: int = 0, world_size: int = 1):
    """(mean loss in nats, bpc-by-position curve) over eval_windows of one split.

    Under DDP (a collective: all ranks must call it) rank r scores batches r, r + world_size, ... and
    the per-position loss sums and counts are added over ranks: the single-process result, which an
    average of the ranks' means would not be, as ranks can score different numbers of targets.
    Under context parallelism rank and world_size are the data-parallel ones: every rank of a context group
    holds its batches' whole per-token loss (GPT's share of reduction="none"), so the sums over all ranks
    count each batch once per member, which leaves the means unchanged.
    """
    model.eval()
    loss_sum = torch.zeros(cfg.seq_len, dtype=torch.float64, device=device)
    count = torch.zeros(cfg.seq_len, dtype=torch.float64, device=device)
    batches = eval_windows(split, cfg.seq_len, cfg.batch_size, max_windows)
    for x, y, keep in itertools.islice(batches, rank, None, world_size):
        x, y, keep = x.to(device), y.to(device), keep.to(device)
        with autocast:
            _, loss = model(x, y, reduction="none")
        loss_sum += (loss.double() * keep).sum(0)
        count += keep.sum(0)
    model.train()
    if world_size > 1:
        dist.all_reduce(loss_sum)
        dist.all_reduce(count)
    loss_sum, count = loss_sum.cpu(), count.cpu()
    return (loss_sum.sum() / count.sum()).item(), bpc_by_position(loss_sum, count)


@torch.no_grad()
def evaluate_recall(model: GPT, batches, device, autocast, rank: int = 0, world_size: int = 1) -> tuple[float, float]:
    """(mean loss in nats, accuracy) over the answers of recall (x, y) batches (RecallTask.eval_batches).

    Under DDP (a collective) rank r scores batches r, r + world_size, ... and the sums are added over ranks,
    as in evaluate.
    """
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss, correct answers, answers
    for x, y in itertools.islice(batches, rank, None, world_size):
        x, y = x.to(device), y.to(device)
        with autocast:
            logits, loss = model(x, y, reduction="none")  # 0 at the ignored targets
        totals += torch.stack([loss.double().sum(), *score(logits, y)])
    model.train()
    if world_size > 1:
        dist.all_reduce(totals)
    loss_sum, correct, answers = totals.tolist()
    return loss_sum / answers, correct / answers


@torch.no_grad()
def sample_text(model: GPT, prompt: bytes, n_bytes: int, device, autocast, seed: int) -> str:
    """The prompt and n_bytes sampled after it, drawn from a generator of its own (not the training RNG)."""
    model.eval()
    generator = torch.Generator(device=device).manual_seed(seed)
    idx = torch.tensor([list(prompt)], dtype=torch.long, device=device)
    with autocast:
        out = model.generate(idx, n_bytes, generator=generator)
    model.train()
    return bytes(out[0].tolist()).decode("utf-8", errors="replace")


def model_from_checkpoint(ckpt: dict, arg: str, **overrides) -> tuple[GPT, TrainConfig, torch.device, torch.dtype]:
    """The model a checkpoint (load_checkpoint's) holds, built from its config with overrides on the device
    and dtype they name: (model, config, device, dtype), or exit 2 naming arg when it does not build here."""
    try:
        cfg = TrainConfig(**{**ckpt["config"], **overrides})
    except (TypeError, ValueError) as err:
        usage_error(f"{arg}: its config does not build a model here: {err}")
    device, dtype = setup_device(cfg)
    model = GPT(cfg.model_config()).to(device)
    model.load_state_dict(ckpt["model"])
    return model, cfg, device, dtype


def resolve_kernel_choice(cfg: TrainConfig, device: torch.device, dtype: torch.dtype) -> str | None:
    """Settle use_cuda_kernel = None (auto) for this device and dtype: our kernels where attention_cuda's plan for
    the model's attention takes them (CUDA, the kernels loaded or JIT-built, the head dim compiled), else the
    PyTorch reference. Returns the line that says which and why, or None when the config had chosen already."""
    if cfg.use_cuda_kernel is not None:
        return None
    plan = attention_plan(cfg, device, dtype)  # use_cuda_kernel None plans with backend "auto"
    cfg.use_cuda_kernel = plan.backend == "cuda"
    if cfg.use_cuda_kernel:
        return f"use_cuda_kernel auto: {cfg.attention} attention on our CUDA kernels (--use-cuda-kernel false: the reference)"
    reason = "".join(map(str, plan.why[0][1:]))
    return (f"use_cuda_kernel auto: {cfg.attention} attention on the PyTorch reference, as {reason}"
            + (" (--use-cuda-kernel forces the kernels)" if device.type == "cuda" else ""))


def attention_problem(cfg: TrainConfig, device: torch.device, dtype: torch.dtype) -> str | None:
    """Why the attention cfg asks for cannot run here, or None: our kernels (use_cuda_kernel), or a forced
    SDPA backend (sdpa_backend), which cover some devices, head dims, dtypes and forms only. One call on
    the run's shapes (batch 1) finds out at startup rather than at the first training step."""
    if cfg.use_cuda_kernel:
        if device.type != "cuda":
            return f"training runs on {device}, the kernels need a CUDA device"
        reason = cuda_unavailable_reason()
        if reason is not None:
            return reason
    elif cfg.sdpa_backend not in ("auto", "math") and device.type != "cuda":
        return f"training runs on {device}, SDPA's {cfg.sdpa_backend} backend needs a CUDA device"
    elif cfg.sdpa_backend == "auto":
        return None
    q = torch.zeros(1, cfg.n_head, cfg.seq_len, cfg.head_dim, device=device, dtype=dtype)
    kv = q[:, :cfg.n_kv_head]
    try:
        attention_fn(cfg)(q, kv, kv)
    except (ValueError, NotImplementedError, RuntimeError) as err:  # SDPA: "No available kernel" is a RuntimeError
        return str(err).strip().splitlines()[0]
    return None


def attention_described(cfg: TrainConfig) -> str:
    """The model's attention and the code it runs on, in words."""
    if cfg.on_sdpa:
        words = f"{cfg.attention} attention on SDPA ({cfg.sdpa_backend})"
    else:
        words = f"{cfg.attention} attention on " + ("our CUDA kernels" if cfg.use_cuda_kernel else "the PyTorch reference")
    return words + (f" (every other block sliding-window softmax over {cfg.swa_window})" if cfg.swa_window else "")


def memory_advice(cfg: TrainConfig) -> str:
    """What a step asks for and what would make it fit, for an out-of-memory message."""
    tokens = cfg.batch_size * cfg.seq_len * cfg.grad_accum_steps
    tips = [f"a smaller --batch_size with a larger --grad_accum_steps (the same {tokens:,} tokens a step in more, "
            "smaller micro-steps)", "a shorter --seq-len"]
    if not (cfg.on_sdpa or cfg.use_cuda_kernel):
        tips.insert(0, "--use-cuda-kernel (our kernels never hold the seq_len x seq_len scores)")
    return (f"the run asks for {tokens:,} tokens a step (batch_size {cfg.batch_size} x seq_len {cfg.seq_len:,} x "
            f"grad_accum_steps {cfg.grad_accum_steps}), {cfg.n_layer} layers of width {cfg.n_embd}, "
            f"{attention_described(cfg)}. Try " + "; or ".join(tips))


def scores_problem(cfg: TrainConfig, device: torch.device, dtype: torch.dtype) -> str | None:
    """Why the run cannot fit this GPU, found before any work, or None: the PyTorch reference's quadratic form
    holds each layer's (batch, heads, seq_len, seq_len) scores, and one such matrix alone larger than the free
    memory can never be held. (The test is a floor: a run that passes it may still run out.)"""
    if device.type != "cuda" or cfg.on_sdpa or cfg.use_cuda_kernel:
        return None
    plan = attention_plan(cfg, device, dtype)
    if plan.form != "quadratic":
        return None
    scores = cfg.batch_size * cfg.n_head * (cfg.seq_len // cfg.context_parallel) * cfg.seq_len
    need = scores * plan.score_dtype.itemsize
    free = torch.cuda.mem_get_info(device)[0]
    if need <= free:
        return None
    return (f"out of memory before the first step: the PyTorch reference's scores of one layer alone need "
            f"{need / 2**30:,.1f} GiB ({scores:,} {plan.score_dtype} values) and {device} has {free / 2**30:,.1f} GiB "
            f"free; " + memory_advice(cfg))


def peak_memory_gib(device: torch.device) -> float:
    """CUDA: peak memory allocated by tensors. CPU: the process's peak resident set size."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / (2**30 if sys.platform == "darwin" else 2**20)


def peak_flops(cfg: TrainConfig, device: torch.device, dtype: torch.dtype) -> float | None:
    if cfg.peak_tflops is not None:
        return cfg.peak_tflops * 1e12
    if device.type == "cuda" and dtype == torch.bfloat16:
        name = torch.cuda.get_device_name(device)
        return next((peak for gpu, peak in PEAK_BF16_FLOPS.items() if gpu in name), None)
    return None


def device_of(name: str) -> torch.device:
    """The device a config's device field names: auto = cuda if available, else cpu."""
    return torch.device(name if name != "auto" else "cuda" if torch.cuda.is_available() else "cpu")


def setup_device(cfg: TrainConfig, local_rank: int = 0, world_size: int = 1) -> tuple[torch.device, torch.dtype]:
    device = device_of(cfg.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            usage_error(f"device: {cfg.device!r} asked for, but PyTorch sees no CUDA device")
        if world_size > 1:
            if device.index is not None:
                usage_error(f"device: {cfg.device!r} pins one GPU, but under torchrun each of the WORLD_SIZE="
                            f"{world_size} processes takes cuda:LOCAL_RANK; pass --device cuda or auto")
            if local_rank >= torch.cuda.device_count():
                usage_error(f"LOCAL_RANK={local_rank}: only {torch.cuda.device_count()} CUDA devices are visible; "
                            "start at most one process per GPU (--nproc_per_node)")
            device = torch.device("cuda", local_rank)
        elif device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True  # the few fp32 matmuls outside autocast
    dtype = {"auto": torch.bfloat16 if device.type == "cuda" else torch.float32,
             "bfloat16": torch.bfloat16, "float32": torch.float32}[cfg.dtype]
    note = resolve_kernel_choice(cfg, device, dtype)
    if note is not None and local_rank == 0:
        print(note)
    reason = attention_problem(cfg, device, dtype)
    if reason:
        field = "use_cuda_kernel: our CUDA kernels" if cfg.use_cuda_kernel else f"sdpa_backend: {cfg.sdpa_backend!r}"
        usage_error(f"{field} cannot run this config: {reason}")
    return device, dtype


def finite_weights(model: GPT) -> bool:
    return bool(torch.stack([p.isfinite().all() for p in model.parameters()]).all())


