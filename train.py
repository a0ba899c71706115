"""Train the byte-level GPT on enwik8.

    python train.py                                     # configs/base on a GPU, configs/tiny_cpu (minutes) on a CPU
    python train.py --seq-len 8192 --use-cuda-kernel    # configs/base on a GPU, cosine-sim on our kernels
    torchrun --standalone --nproc_per_node=8 train.py --grad_accum_steps 8 --use-cuda-kernel   # DDP, 8 GPUs

Every field of TrainConfig can be set in the config file (``name = literal`` lines) and overridden on
the command line as ``--name value``, ``--name=value`` or ``--name-with-dashes value``; boolean flags
alone mean true (``--compile``), or take true/false. A run writes out/<run_name>/: config.json,
metrics.jsonl (one JSON object per step and per evaluation) and ckpt.pt.

``--resume auto`` continues from out/<run_name>/ckpt.pt when there is one (else starts fresh);
``--resume PATH`` from that checkpoint. A resumed run keeps the checkpoint's value of every field the command
line (or an explicit --config) does not give, and reproduces the uninterrupted run exactly (bit for bit on
CPU); resuming a run that has reached max_iters does nothing. SIGINT or SIGTERM finishes the current step and
the evaluation due after it, saves a checkpoint and exits with code 130 (or 0 when that step was the last: the
run is then finished); a second SIGINT interrupts at once. Exit codes: 0 training finished; 2 bad command
line, config, data or checkpoint; 3 diverged (a non-finite loss, gradient norm or weight: the step is not
taken, no checkpoint is written, the last good one stays); 130 stopped by a signal.

Under torchrun (WORLD_SIZE > 1) each process trains a DistributedDataParallel replica on its own GPU (or
CPU, over gloo) and draws its own random windows. grad_accum_steps counts the micro-steps of all processes
together, each doing grad_accum_steps / WORLD_SIZE of them, so a step's batch does not grow with the
process count. Evaluations are split over the ranks and summed exactly; rank 0 alone logs and writes the
checkpoint, which every rank reads on resume (with the same WORLD_SIZE).
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import difflib
import fcntl
import html
import itertools
import json
import math
import os
import random
import re
import resource
import signal
import sys
import tempfile
import time
import typing
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import wandb
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from attention_cuda import cuda_unavailable_reason
from data import DataError, RandomWindowSampler, data_fingerprint, eval_windows, load_enwik8
from model import GPT, GPTConfig
from model.gpt import option
from model.attention import attention_fn

CONFIGS = Path(__file__).resolve().parent / "configs"
GPU_CONFIG, CPU_CONFIG = CONFIGS / "base.py", CONFIGS / "tiny_cpu.py"
DTYPES = ("auto", "bfloat16", "float32")
WANDB_MODES = ("auto", "online", "offline", "disabled")
EXIT_STOPPED = 130  # stopped early by SIGINT/SIGTERM, after saving a checkpoint
EXIT_DIVERGED = 3  # stopped by a non-finite loss, gradient or weight; the last good checkpoint is kept
SAMPLE_PROMPT_BYTES = 64
# Datasheet dense bf16 peak of the H100/H200 SXM (989 TFLOP/s), the usual denominator for MFU so that
# numbers compare across reports; other devices need --peak_tflops.
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12}


@dataclass
class TrainConfig(GPTConfig):
    """Everything a run depends on: the model (GPTConfig's fields) and how it is trained and logged."""

    data_path: str | None = option(None, "a local enwik8 copy (raw, .zip or .gz); None = the verified download")
    batch_size: int = option(8, "sequences per micro-step")
    grad_accum_steps: int = option(1, "micro-steps per optimizer step, over all processes")
    max_iters: int = option(10000, "optimizer steps")
    lr_decay_iters: int | None = option(None, "the step where the cosine reaches min_lr; None = max_iters "
                                              "(a resume keeps the checkpoint's)")
    warmup_iters: int = option(500, "linear warmup steps")
    lr: float = option(1e-3, "peak learning rate")
    min_lr: float = option(1e-4, "learning rate at the end of the cosine")
    weight_decay: float = option(0.1, "AdamW decay, on matrices only (embedding and linear weights)")
    beta1: float = option(0.9, "AdamW beta1")
    beta2: float = option(0.95, "AdamW beta2")
    grad_clip: float = option(1.0, "max global grad norm; 0 = no clipping")
    seed: int = option(1337, "seeds weights, data order and dropout")
    eval_interval: int = option(500, "steps between evaluations on val")
    eval_max_windows: int | None = option(64, "windows per periodic eval; None = the whole split")
    final_eval_max_windows: int | None = option(None, "windows per split at the end; None = the whole split")
    sample_tokens: int = option(256, "bytes generated at each evaluation (0 = no sample)")
    ckpt_interval: int = option(1000, "steps between checkpoints (one is always saved at the end)")
    device: str = option("auto", "auto = cuda if available, else cpu; or cpu, cuda, cuda:N")
    dtype: str = option("auto", "auto = bfloat16 autocast on CUDA, float32 on CPU", DTYPES)
    compile: bool = option(False, "torch.compile the training forward/backward")
    peak_tflops: float | None = option(None, "device peak for perf/mfu; None = the bf16 datasheet value of "
                                             "H100/H200")
    out_dir: str = option("out", "runs are written to out_dir/run_name/")
    run_name: str | None = option(None, "None = <config name>_<attention>; also the wandb run name")
    wandb_mode: str = option("auto", "auto = online when logged in to wandb, else offline (`wandb sync` "
                                     "later)", WANDB_MODES)
    wandb_project: str = option("enwik8-attention", "wandb project")
    wandb_group: str | None = option(None, "wandb group")
    wandb_tags: str = option("", "wandb tags, comma-separated")

    def __post_init__(self):
        super().__post_init__()
        for name in ("batch_size", "grad_accum_steps", "max_iters", "eval_interval", "ckpt_interval"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: expected a positive int, got {getattr(self, name)}")
        for name in ("warmup_iters", "sample_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: expected a non-negative int, got {getattr(self, name)}")
        if not 0 <= self.seed < 2**32:  # numpy's seed range
            raise ValueError(f"seed: expected an int in [0, 2**32), got {self.seed}")
        for name in ("eval_max_windows", "final_eval_max_windows"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name}: expected None or a positive int, got {getattr(self, name)}")
        if self.lr_decay_iters is None:
            self.lr_decay_iters = self.max_iters
        if self.lr_decay_iters < self.warmup_iters:
            raise ValueError(f"lr_decay_iters: expected >= warmup_iters={self.warmup_iters}, got {self.lr_decay_iters} "
                             "(it defaults to max_iters: lower warmup_iters for a short run)")
        if not self.lr > 0:
            raise ValueError(f"lr: expected > 0, got {self.lr}")
        if not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"min_lr: expected in [0, lr={self.lr}], got {self.min_lr}")
        for name in ("weight_decay", "grad_clip"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name}: expected >= 0, got {getattr(self, name)}")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"{name}: expected in [0, 1), got {getattr(self, name)}")
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device):
            raise ValueError(f"device: expected 'auto', 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        if self.peak_tflops is not None and not self.peak_tflops > 0:
            raise ValueError(f"peak_tflops: expected None or > 0, got {self.peak_tflops}")
        if self.run_name is not None and not re.fullmatch(r"[\w.+-]+", self.run_name):
            raise ValueError(f"run_name: expected letters, digits and . _ + - (it names a directory), "
                             f"got {self.run_name!r}")

    def model_config(self) -> GPTConfig:
        return GPTConfig(**{f.name: getattr(self, f.name) for f in dataclasses.fields(GPTConfig)})


# Fields a resumed run may change: they steer logging, evaluation and where things run, not the
# trajectory of the weights. Any other difference from the checkpoint's config is refused.
RESUME_MAY_CHANGE = {"data_path", "max_iters", "eval_interval", "eval_max_windows", "final_eval_max_windows",
                     "sample_tokens", "ckpt_interval", "device", "compile", "peak_tflops", "use_cuda_kernel",
                     "out_dir", "run_name", "wandb_mode", "wandb_project", "wandb_group", "wandb_tags"}


# ----------------------------------------------------------------------------- configuration

def _field_types() -> dict[str, tuple[type, bool]]:
    """{field: (type, accepts None)} from TrainConfig's annotations."""
    types = {}
    for name, hint in typing.get_type_hints(TrainConfig).items():
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        types[name] = (args[0], True) if args else (hint, False)
    return types


FIELD_TYPES = _field_types()


def _type_name(name: str) -> str:
    base, optional = FIELD_TYPES[name]
    return base.__name__ + (" or None" if optional else "")


def _check_type(name: str, value):
    """value as the field's type (an int is a fine float), or ValueError naming the field."""
    base, optional = FIELD_TYPES[name]
    if value is None and optional:
        return None
    if base is float and type(value) is int:
        return float(value)
    if type(value) is not base:
        raise ValueError(f"{name}: expected {_type_name(name)}, got {value!r}")
    return value


def _cli_parser_for(name: str):
    """argparse `type` for a field; its __name__ is what argparse prints in 'invalid <name> value'."""
    base, optional = FIELD_TYPES[name]

    def parse(text: str):
        if optional and text.lower() == "none":
            return None
        if base is bool:
            if text.lower() in ("true", "1", "yes"):
                return True
            if text.lower() in ("false", "0", "no"):
                return False
            raise ValueError(text)
        return base(text)

    parse.__name__ = _type_name(name)
    return parse


def _unknown_field(name: str) -> str:
    close = difflib.get_close_matches(name, FIELD_TYPES, n=1)
    return f"unknown config field {name!r}" + (f" (did you mean {close[0]!r}?)" if close else "")


def read_config_file(path: Path) -> dict:
    """The ``name = literal`` assignments of a config file, type-checked against TrainConfig.

    Values are read with ast.literal_eval, so a config file can hold comments but never runs code.
    """
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start})") from None
    except OSError as err:
        raise ValueError(f"{path}: cannot read the config file: {err.strerror}") from None
    values = {}
    try:
        tree = ast.parse(text, filename=str(path))
    except SyntaxError as err:
        raise ValueError(f"{path}:{err.lineno}: not a `name = literal` line: {err.msg}") from None
    for node in tree.body:
        where = f"{path}:{node.lineno}"
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)):
            raise ValueError(f"{where}: expected a `name = literal` line")
        name = node.targets[0].id
        if name not in FIELD_TYPES:
            raise ValueError(f"{where}: {_unknown_field(name)}")
        try:
            value = ast.literal_eval(node.value)
        except ValueError:
            raise ValueError(f"{where}: {name}: expected a literal value, got `{ast.unparse(node.value)}`") from None
        try:
            values[name] = _check_type(name, value)
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from None
    return values


def config_path(name: str) -> Path:
    """The config file --config names, ".py" optional."""
    found = next((p for p in (Path(name), Path(name + ".py")) if p.is_file()), None)
    if found is None:
        raise ValueError(f"--config: no config file at {name} or {name}.py")
    return found


def default_config(device: str) -> tuple[Path, str | None]:
    """(the config a run without --config takes, the note that says so when it is not configs/base).

    configs/base is the GPU model: on a CPU, in fp32, it outgrows a workstation's memory within a minute.
    """
    if device.startswith("cuda") or (device == "auto" and torch.cuda.is_available()):
        return GPU_CONFIG, None
    return CPU_CONFIG, (f"train.py: no CUDA device, so the CPU-sized config {CPU_CONFIG.parent.name}/{CPU_CONFIG.stem} "
                        f"(configs/base is the GPU model; pass --config configs/base to train it here anyway)")


def build_parser(defaults: dict, config_label: str) -> argparse.ArgumentParser:
    """The full command line; --help shows each field's meaning, choices and the value it gets without the flag
    (defaults: the config file's values, which win over the dataclass's)."""
    parser = argparse.ArgumentParser(prog="train.py", description="Train the byte-level GPT on enwik8. Every field "
                                     "of TrainConfig is an option; the config file sets it unless given here.",
                                     usage="train.py [--config NAME] [--resume PATH|auto] [--FIELD VALUE ...]",
                                     allow_abbrev=False)
    parser.add_argument("--config", help="config file, .py optional (default configs/base on a GPU, "
                                         "configs/tiny_cpu without one)")
    parser.add_argument("--resume", default=None, metavar="PATH|auto",
                        help="checkpoint to continue from; auto = out/<run_name>/ckpt.pt if it exists. Fields not "
                             "given here or in an explicit --config keep the checkpoint's values")
    for f in dataclasses.fields(TrainConfig):
        flags = [f"--{f.name}"] + ([f"--{f.name.replace('_', '-')}"] if "_" in f.name else [])
        if f.name == "run_name":
            flags.append("--wandb-run-name")
        bool_flag = FIELD_TYPES[f.name][0] is bool
        choices = f.metadata["choices"]
        default = (f"{defaults[f.name]!r} from {config_label}" if f.name in defaults
                   else repr(f.default))
        parser.add_argument(*flags, dest=f.name, type=_cli_parser_for(f.name), default=argparse.SUPPRESS,
                            nargs="?" if bool_flag else None, const=True if bool_flag else None,
                            metavar=_type_name(f.name).upper().replace(" ", "_"),
                            help=f.metadata["help"] + (f"; one of {', '.join(map(str, choices))}" if choices else "")
                            + f" (default {default})")
    return parser


def usage_error(message: str) -> typing.NoReturn:
    print(f"train.py: error: {message}", file=sys.stderr)
    raise SystemExit(2)


@dataclass
class CommandLine:
    values: dict  # the config file's values, then the command line's
    given: set  # fields named on the command line or in an explicit --config: a resume keeps the rest
    resume: str | None
    note: str | None  # why this config, when the run did not name one and it is not configs/base


def parse_command_line(argv: list[str] | None = None) -> CommandLine:
    """The config file (--config, else the default for this machine) and the flags over it, or exit 2."""
    first = argparse.ArgumentParser(prog="train.py", add_help=False, allow_abbrev=False)
    first.add_argument("--config")
    first.add_argument("--device", default="auto")
    known, _ = first.parse_known_args(argv)
    note = None
    try:
        if known.config is None:
            path, note = default_config(known.device)
        else:
            path = config_path(known.config)
        file_values = read_config_file(path)
    except ValueError as err:
        first.error(str(err))
    args = vars(build_parser(file_values, f"{path.parent.name}/{path.stem}").parse_args(argv))
    resume = args.pop("resume")
    args.pop("config")
    values = file_values | args
    if values.get("run_name") is None:
        values["run_name"] = f"{path.stem}_{values.get('attention', TrainConfig.attention)}"
    # run_name and out_dir say where the checkpoint is; the default config is not the user's choice.
    given = set(args) | {"run_name", "out_dir"} | (set(file_values) if known.config is not None else set())
    return CommandLine(values, given, resume, note)


def parse_args(argv: list[str] | None = None) -> tuple[TrainConfig, str | None]:
    """(config, resume) from config file + command line, or exit 2 with a message naming the problem."""
    cli = parse_command_line(argv)
    try:
        return TrainConfig(**cli.values), cli.resume
    except ValueError as err:
        usage_error(str(err))


# ----------------------------------------------------------------------------- for scripts that drive train.py
# compare.py and scripts/context_limit.py take their own options, then train.py flags after `--`.

def split_train_flags(argv: list[str]) -> tuple[list[str], list[str]]:
    """(the driver's own arguments, the train.py flags after --)."""
    if "--" not in argv:
        return argv, []
    i = argv.index("--")
    return argv[:i], argv[i + 1:]


def refuse_train_flags(parser: argparse.ArgumentParser, extra: list[str], fields, why: str) -> None:
    """parser.error for a train.py flag in extra that sets one of fields, which the driver sets itself."""
    for flag in extra:
        name = flag[2:].split("=")[0].replace("-", "_") if flag.startswith("--") else None
        if name in fields:
            parser.error(f"{flag.split('=')[0]} after --: {parser.prog} {why}")


def out_of_memory(err: torch.OutOfMemoryError) -> dict:
    """A measuring script's record of a configuration that did not fit."""
    return {"ok": False, "reason": "out of memory", "detail": str(err).splitlines()[0][:300]}


def choice_list(parser: argparse.ArgumentParser, flag: str, text: str, choices) -> list[str]:
    """text's comma-separated items, or parser.error naming the ones not among choices."""
    values = text.split(",")
    unknown = [v for v in values if v not in choices]
    if unknown:
        parser.error(f"{flag}: expected a comma list of {', '.join(choices)}, got {', '.join(map(repr, unknown))}")
    return values


def require_positive(parser: argparse.ArgumentParser, args: argparse.Namespace, names) -> None:
    """parser.error for the first of the named options that is set (not None) and not > 0."""
    for name in names:
        value = getattr(args, name)
        if value is not None and not value > 0:
            parser.error(f"--{name.replace('_', '-')}: expected > 0, got {value}")


# ----------------------------------------------------------------------------- pieces of the loop

def autocast_for(device: torch.device, dtype: torch.dtype):
    """What every forward runs under: autocast to a lower precision, or nothing in fp32."""
    return torch.autocast(device.type, dtype=dtype) if dtype != torch.float32 else contextlib.nullcontext()


def clip_gradients(model: GPT, cfg: TrainConfig) -> torch.Tensor:
    """Clip the gradients to cfg.grad_clip; the global norm before clipping."""
    return torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip or math.inf)


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


def write_atomically(path: Path, write) -> None:
    """write(f) into a temp file that then replaces path: a crash mid-write leaves the previous file intact.

    The temp file lives in the same directory so os.replace is a rename on one filesystem; fsync before the
    rename (and of the directory after it) so the new name never points at unwritten data. A process killed
    mid-write leaves its temp file behind, which the next run in that directory removes (RunDir).
    """
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def save_checkpoint(state: dict, path: Path) -> None:
    write_atomically(path, lambda f: torch.save(state, f))


CHECKPOINT_KEYS = {"model", "optimizer", "step", "config", "rng", "sampler", "world_size", "wandb_run_id", "data"}


def load_checkpoint(path: str | Path) -> dict:
    """The checkpoint at path, or a usage error naming the file and what is wrong with it.

    torch.save writes a zip archive with a CRC-32 per member, which torch.load does not check: read every
    member once through zipfile first, so a flipped byte is caught rather than trained on.
    """
    what = f"--resume: {path}"
    try:
        with zipfile.ZipFile(path) as archive:
            corrupt = archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError) as err:
        usage_error(f"{what} is not a checkpoint written by train.py (not a torch archive: {err})")
    if corrupt is not None:
        usage_error(f"{what} is corrupt: its member {corrupt} fails its CRC-32 check; resume from another "
                    "checkpoint, or start the run afresh")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as err:  # noqa: BLE001 - unpickling fails in many ways; each is "unreadable" here
        usage_error(f"{what} cannot be read: {type(err).__name__}: {err}")
    missing = sorted(CHECKPOINT_KEYS - ckpt.keys()) if isinstance(ckpt, dict) else None
    if missing is None or missing or not isinstance(ckpt["config"], dict):
        usage_error(f"{what} is not a checkpoint written by this train.py "
                    + (f"(missing {', '.join(missing)})" if missing else "(expected a dict with a config dict)"))
    return ckpt


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
def sample_text(model: GPT, prompt: bytes, n_bytes: int, device, autocast, seed: int) -> str:
    """The prompt and n_bytes sampled after it, drawn from a generator of its own (not the training RNG)."""
    model.eval()
    generator = torch.Generator(device=device).manual_seed(seed)
    idx = torch.tensor([list(prompt)], dtype=torch.long, device=device)
    with autocast:
        out = model.generate(idx, n_bytes, generator=generator)
    model.train()
    return bytes(out[0].tolist()).decode("utf-8", errors="replace")


def cuda_kernel_problem(cfg: TrainConfig, device: torch.device, dtype: torch.dtype) -> str | None:
    """Why attention_cuda's kernels cannot run cfg's attention here, or None.

    The kernels cover some head dims, dtypes and forms only; one call on the run's shapes (batch 1)
    finds out at startup rather than at the first training step.
    """
    if device.type != "cuda":
        return f"training runs on {device}, the kernels need a CUDA device"
    reason = cuda_unavailable_reason()
    if reason is None:
        q = torch.zeros(1, cfg.n_head, cfg.seq_len, cfg.head_dim, device=device, dtype=dtype)
        kv = q[:, :cfg.n_kv_head]
        try:
            attention_fn(cfg)(q, kv, kv)
        except (ValueError, NotImplementedError) as err:
            reason = str(err)
    return reason


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


def resolve_wandb_mode(cfg: TrainConfig) -> str:
    if cfg.wandb_mode != "auto":
        return cfg.wandb_mode
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    return "online" if wandb.login(prompt=False, verify=False) else "offline"


def json_line(row: dict) -> str:
    """row as one line of strict JSON: inf and NaN (which json.dumps writes as bare tokens that strict parsers
    reject) become null."""
    def clean(value):
        if isinstance(value, float) and not math.isfinite(value):
            return None
        if isinstance(value, (list, tuple)):
            return [clean(v) for v in value]
        return value

    return json.dumps({k: clean(v) for k, v in row.items()}, allow_nan=False) + "\n"


class RunDir:
    """Rank 0's hold on out/<run_name>/: one train.py writes there at a time (an flock on .lock, released
    when the process ends however it ends), so what killed runs left behind can be removed safely."""

    def __init__(self, path: Path):
        path.mkdir(parents=True, exist_ok=True)
        self.lock = open(path / ".lock", "w")
        try:
            fcntl.flock(self.lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.lock.close()
            usage_error(f"{path} is in use by another train.py (it holds {path / '.lock'}); wait for it to end, "
                        "or pass another --run_name")
        for stale in path.glob(".*.tmp"):  # temp files of writes a SIGKILL cut short (write_atomically)
            stale.unlink()

    def close(self) -> None:
        self.lock.close()


def kept_metrics(path: Path, start_step: int) -> str:
    """The lines of metrics.jsonl up to start_step, or a usage error naming the line that is not a metrics row.

    Rows past the checkpoint we resume from belong to a timeline that is being replaced, and a last line
    without its newline was cut short by a crash: both go.
    """
    kept = []
    for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(keepends=True), 1):
        if not line.endswith("\n"):
            break
        try:
            step = json.loads(line)["step"]
            if not isinstance(step, int):
                raise TypeError
        except (ValueError, TypeError, KeyError):
            usage_error(f"{path}:{number}: not a metrics row (a JSON object with an int \"step\"): {line[:80]!r}; "
                        "mend or delete that line, then resume")
        if step <= start_step:
            kept.append(line)
    return "".join(kept)


class RunLog:
    """Rank 0's record of a run: metrics.jsonl in the run directory, and the same values in wandb."""

    def __init__(self, cfg: TrainConfig, run_dir: Path, run_id: str | None, start_step: int):
        path = run_dir / "metrics.jsonl"
        if path.exists():
            kept = kept_metrics(path, start_step)
            write_atomically(path, lambda f: f.write(kept.encode()))
        self.wandb = wandb.init(project=cfg.wandb_project, name=cfg.run_name, group=cfg.wandb_group,
                                tags=[t for t in cfg.wandb_tags.split(",") if t], config=asdict(cfg),
                                mode=resolve_wandb_mode(cfg), id=run_id, resume="allow" if run_id else None)
        self.jsonl = open(path, "a")  # after wandb.init, which can fail, so that a failure leaks no file

    def log(self, step: int, metrics: dict, wandb_extra: dict | None = None) -> None:
        self.jsonl.write(json_line({"step": step, **metrics}))
        self.jsonl.flush()
        self.wandb.log({**metrics, **(wandb_extra or {})}, step=step)

    def log_eval(self, step: int, split: str, loss: float, curve, sample: str | None = None) -> None:
        metrics = {f"{split}/loss": loss, f"{split}/bpc": loss / math.log(2), f"{split}/bpc_by_position": curve}
        table = wandb.Table(columns=["position", "bpc"], data=[list(point) for point in curve])
        extra = {f"{split}/bpc_by_position": wandb.plot.line(table, "position", "bpc",
                                                            title=f"{split} bpc by position, step {step}")}
        if sample is not None:
            metrics[f"{split}/sample"] = sample
            extra[f"{split}/sample"] = wandb.Html(f"<pre>{html.escape(sample)}</pre>")
        self.log(step, metrics, extra)

    def close(self, exit_code: int) -> None:
        self.jsonl.close()
        self.wandb.finish(exit_code=exit_code)


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


# ----------------------------------------------------------------------------- main

def setup_device(cfg: TrainConfig, local_rank: int = 0, world_size: int = 1) -> tuple[torch.device, torch.dtype]:
    device = torch.device(cfg.device if cfg.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu")
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
    if cfg.use_cuda_kernel:
        reason = cuda_kernel_problem(cfg, device, dtype)
        if reason:
            usage_error(f"use_cuda_kernel: our CUDA kernels cannot run this config: {reason}")
    return device, dtype


def checkpoint_to_resume(resume: str | None, ckpt_path: Path, world_size: int) -> dict | None:
    """The checkpoint --resume names (None for a fresh run), checked for integrity and process count."""
    if resume == "auto":
        resume = str(ckpt_path) if ckpt_path.exists() else None
    elif resume is None and ckpt_path.exists():
        usage_error(f"{ckpt_path} exists: pass --resume auto to continue that run, "
                    "or --run_name NAME to start another")
    if resume is None:
        return None
    if not Path(resume).is_file():
        usage_error(f"--resume: no checkpoint at {resume}")
    ckpt = load_checkpoint(resume)
    if ckpt["world_size"] != world_size:
        usage_error(f"--resume: the checkpoint was written by a run of {ckpt['world_size']} process(es), this one has "
                    f"WORLD_SIZE={world_size}; each rank's data stream and dropout RNG continue only under the same "
                    "number of processes")
    return ckpt


def resumed_config(cfg: TrainConfig, given: set, ckpt: dict) -> TrainConfig:
    """The checkpoint's config with the fields this command line gave on top, refusing any change to the
    trajectory. Fields not given keep the checkpoint's values, derived ones included: lr_decay_iters stays
    where the run's cosine ends when a larger max_iters trains on, data_path stays the run's data."""
    saved = ckpt["config"]
    unknown = sorted(saved.keys() - FIELD_TYPES.keys())
    if unknown:
        usage_error(f"--resume: the checkpoint's config has fields this train.py does not know: {', '.join(unknown)}")
    try:
        resumed = TrainConfig(**(saved | {k: getattr(cfg, k) for k in given}))
    except ValueError as err:
        usage_error(f"--resume: {err}")
    changed = sorted(k for k, v in saved.items() if k not in RESUME_MAY_CHANGE and getattr(resumed, k) != v)
    if changed:
        k = changed[0]
        usage_error(f"--resume: the config differs from the checkpoint's in {', '.join(changed)} (e.g. {k}: "
                    f"checkpoint {saved[k]!r}, now {getattr(resumed, k)!r}); "
                    "resuming must not change the model or the optimisation")
    return resumed


def describe_data(fingerprint: dict, path: str | None) -> str:
    return (f"{path or 'enwik8 (verified download)'}: {fingerprint['bytes']:,} bytes, "
            f"sha256 {fingerprint['sha256'][:16]}...")


class Diverged(Exception):
    """A non-finite loss, gradient norm or weight: the run stops without taking the step or writing a checkpoint."""


def finite_weights(model: GPT) -> bool:
    return bool(torch.stack([p.isfinite().all() for p in model.parameters()]).all())


def main(argv: list[str] | None = None) -> int:
    cli = parse_command_line(argv)
    with contextlib.ExitStack() as held:  # the run directory's lock, released however the run ends
        return run(cli, held)


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
    ckpt_path = run_dir / "ckpt.pt"
    ckpt = checkpoint_to_resume(cli.resume, ckpt_path, world_size)
    if ckpt is not None:
        cfg = resumed_config(cfg, cli.given, ckpt)
    if cfg.grad_accum_steps % world_size:
        usage_error(f"grad_accum_steps: expected a multiple of WORLD_SIZE={world_size} (it counts the micro-steps "
                    f"of all processes together), got {cfg.grad_accum_steps}")
    micro_steps = cfg.grad_accum_steps // world_size
    if ckpt is not None and ckpt["step"] >= cfg.max_iters:
        # Nothing left to train. A checkpoint is written after its step's evaluations, so a finished run's
        # final ones are logged already: running them again would log them twice.
        if rank == 0:
            print(f"{cfg.run_name}: already complete: the checkpoint is at step {ckpt['step']}, max_iters is "
                  f"{cfg.max_iters}; nothing to do (a larger --max_iters trains on, at min_lr past "
                  f"lr_decay_iters={cfg.lr_decay_iters})")
        return 0
    device, dtype = setup_device(cfg, local_rank, world_size)
    autocast = autocast_for(device, dtype)
    if world_size > 1:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                device_id=device if device.type == "cuda" else None)

    # Rank 0 downloads and verifies enwik8 (once) while the others wait; then they read its cache.
    if rank != 0:
        dist.barrier()
    try:
        splits = load_enwik8(cfg.data_path, log=print if rank == 0 else lambda *_: None)
    except DataError as err:
        usage_error(str(err))
    if rank == 0 and world_size > 1:
        dist.barrier()
    # The data is part of the trajectory: a resume on other bytes (another file, or the same path changed)
    # would not continue the run it names.
    fingerprint = data_fingerprint(splits)
    if ckpt is not None and ckpt["data"] != fingerprint:
        usage_error(f"--resume: the data differs from the checkpoint's: the run trained on "
                    f"{describe_data(ckpt['data'], ckpt['config'].get('data_path'))}, this is "
                    f"{describe_data(fingerprint, cfg.data_path)}")
    # Checked here, not left to the sampler and the first evaluation: a short val split would only fail
    # after eval_interval steps of training.
    for name, split in splits.items():
        if len(split) <= cfg.seq_len:
            usage_error(f"seq_len: {cfg.seq_len} needs windows of seq_len + 1 bytes, but the {name} split of the "
                        f"data has {len(split):,}")
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    # Per rank, so that ranks draw different dropout masks; DDP gives every rank rank 0's initial weights.
    torch.manual_seed(cfg.seed + rank)
    sampler = RandomWindowSampler(splits["train"], cfg.batch_size, cfg.seq_len, cfg.seed, rank, world_size)
    model = GPT(cfg.model_config()).to(device)
    optimizer = make_optimizer(model, cfg, device)
    start_step, run_id = 0, None
    if ckpt is not None:
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        sampler.load_state_dict(ckpt["sampler"])
        set_rng_states(ckpt["rng"][rank], device)
        start_step = ckpt["step"]
        # A resume under another run name is a new wandb run (a fork), not more rows in the old one.
        if ckpt["config"]["run_name"] == cfg.run_name:
            run_id = ckpt["wandb_run_id"]
    # DDP averages the gradients over ranks during backward, in buckets that overlap the computation.
    ddp = (DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
           if world_size > 1 else None)
    train_model = model if ddp is None else ddp
    train_model = torch.compile(train_model) if cfg.compile else train_model

    tokens_per_step = cfg.batch_size * cfg.seq_len * cfg.grad_accum_steps
    flops_per_token = model.flops_per_token()
    peak = peak_flops(cfg, device, dtype)
    run_log = None
    if rank == 0:
        held.callback(RunDir(run_dir).close)
        (run_dir / "config.json").write_text(json.dumps(asdict(cfg), indent=2) + "\n")
        run_log = RunLog(cfg, run_dir, run_id, start_step)
        run_id = run_log.wandb.id
        print(f"{cfg.run_name}: {model.num_params() / 1e6:.2f}M params, {cfg.attention} attention"
              f"{' (CUDA kernel)' if cfg.use_cuda_kernel else ''}, {tokens_per_step:,} tokens/step, "
              f"{flops_per_token / 1e6:.1f} MFLOP/token, {device} {dtype}"
              f"{f' x {world_size} processes' if world_size > 1 else ''}, writing to {run_dir}"
              + (f", resuming at step {start_step}" if ckpt is not None else ""))
        if peak is None:
            print(f"perf/mfu not logged: no peak FLOP/s known for {device} {dtype}; pass --peak_tflops to set it")
    prompt = bytes(splits["val"][:SAMPLE_PROMPT_BYTES])
    saved_step = start_step if ckpt is not None else None

    def checkpoint(step: int) -> None:
        nonlocal saved_step
        if not finite_weights(model):  # the same on every rank: DDP keeps the replicas equal
            raise Diverged(f"the weights hold inf or NaN at step {step}")
        # Every rank's RNG state (their dropout masks differ); the rest is the same on all ranks.
        rngs = gather_from_ranks(rng_states(device), world_size)
        if rank == 0:
            save_checkpoint({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
                             "config": asdict(cfg), "rng": rngs, "sampler": sampler.state_dict(),
                             "world_size": world_size, "wandb_run_id": run_id, "data": fingerprint}, ckpt_path)
        saved_step = step

    def log_eval(step: int, split: str, max_windows: int | None, with_sample: bool) -> None:
        loss, curve = evaluate(model, splits[split], cfg, device, autocast, max_windows, rank, world_size)
        if not math.isfinite(loss):  # summed over ranks, so every rank sees the same
            raise Diverged(f"the {split} loss is {loss} at step {step}")
        if rank == 0:
            # With sample_tokens = 0 the "sample" would be the prompt alone.
            sample = (sample_text(model, prompt, cfg.sample_tokens, device, autocast, cfg.seed + step)
                      if with_sample and cfg.sample_tokens else None)
            run_log.log_eval(step, split, loss, curve, sample)
            tqdm.write(f"step {step}: {split} bpc {loss / math.log(2):.4f}"
                       + (f"\n--- sample ---\n{sample}\n--------------" if sample else ""))

    step, exit_code, stopping = start_step, 0, False
    bar = tqdm(total=cfg.max_iters, initial=start_step, disable=rank != 0, dynamic_ncols=True)
    # The handlers stay in place until the log is closed: a signal during wandb's finish must not cut it short.
    with StopOnSignal() as stop:
        try:
            while step < cfg.max_iters and not stopping:
                t0 = time.perf_counter()
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
                        (loss / micro_steps).backward()
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
                        log_eval(step, "val", cfg.eval_max_windows, with_sample=True)
                    if step % cfg.ckpt_interval == 0 and not stopping:  # else the checkpoint below is this step's
                        checkpoint(step)
            bar.close()
            finished = step == cfg.max_iters
            if finished:
                log_eval(step, "val", cfg.final_eval_max_windows, with_sample=True)
                log_eval(step, "test", cfg.final_eval_max_windows, with_sample=False)
            checkpoint(step)
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
        if run_log is not None:
            run_log.close(exit_code)
    if world_size > 1:
        # torchrun ends the job when a rank exits with a nonzero code (130 after a signal): no rank leaves
        # before rank 0 has written its checkpoint and closed its log.
        dist.barrier()
        dist.destroy_process_group()
    return exit_code


if __name__ == "__main__":
    sys.exit(main())
