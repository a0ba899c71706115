"""train.py's configuration: TrainConfig, config files, the command line, and what a resume may change.

A config file holds ``name = literal`` lines (read with ast.literal_eval, so it never runs code); the
command line overrides it with ``--name value``, ``--name=value`` or ``--name-with-dashes value``.
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import os
import re
import sys
import typing
from dataclasses import dataclass
from pathlib import Path

import torch

from data.recall import EVAL_SEQUENCES, RecallTask
from model import GPTConfig
from model.context_parallel import context_zigzag
from model.gpt import option

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
GPU_CONFIG, CPU_CONFIG = CONFIGS / "base.py", CONFIGS / "tiny_cpu.py"
DTYPES = ("auto", "bfloat16", "float32")
WANDB_MODES = ("auto", "online", "offline", "disabled")
TASKS = ("enwik8", "recall")


@dataclass
class TrainConfig(GPTConfig):
    """Everything a run depends on: the model (GPTConfig's fields) and how it is trained and logged."""

    task: str = option("enwik8", "what to train on: enwik8's bytes, or generated associative recall sequences "
                                 "(MQAR, data/recall.py) scored by accuracy on the answers", TASKS)
    recall_pairs: int = option(16, "recall: key-value pairs at the start of each sequence")
    recall_queries: int | None = option(None, "recall: keys asked for later in each sequence, each once; "
                                              "None = recall_pairs")
    data_path: str | None = option(None, "a local enwik8 copy (raw, .zip or .gz); None = the verified download")
    batch_size: int = option(8, "sequences per micro-step")
    grad_accum_steps: int = option(1, "micro-steps per optimizer step, over all processes")
    context_parallel: int = option(1, "under torchrun, the consecutive ranks that split each sequence (enwik8; "
                                      "softmax on GPUs only); the WORLD_SIZE / context_parallel groups of them "
                                      "train data-parallel")
    max_iters: int = option(10000, "optimizer steps")
    lr_decay_iters: int | None = option(None, "the step where the cosine reaches min_lr; None = max_iters "
                                              "(a resume keeps the checkpoint's)")
    warmup_iters: int = option(500, "linear warmup steps")
    lr: float = option(1e-3, "peak learning rate")
    min_lr: float = option(1e-4, "learning rate at the end of the cosine")
    weight_decay: float = option(0.1, "AdamW decay, on matrices only (embedding, linear and conv weights)")
    beta1: float = option(0.9, "AdamW beta1")
    beta2: float = option(0.95, "AdamW beta2")
    grad_clip: float = option(1.0, "max global grad norm; 0 = no clipping")
    seed: int = option(1337, "seeds weights, data order and dropout")
    eval_interval: int = option(500, "steps between evaluations on val")
    eval_max_windows: int | None = option(64, "windows (recall: sequences) per periodic eval; None = the whole "
                                              "split")
    final_eval_max_windows: int | None = option(None, "windows (recall: sequences) per split at the end; None = the "
                                                      f"whole split (recall: its {EVAL_SEQUENCES} sequences)")
    keep_best: bool = option(False, "also keep the checkpoint of the lowest val loss so far, best.pt beside ckpt.pt, "
                                    "written at each evaluation that improves it: a run that starts to memorise its "
                                    "data keeps the model from before (the study evaluates it)")
    stop_accuracy: float | None = option(None, "recall: end the run, as finished, at the first periodic evaluation "
                                               "whose val accuracy reaches this (Zoology's early stop); None = "
                                               "train to max_iters")
    sample_tokens: int = option(256, "bytes generated at each evaluation (0 = no sample); enwik8 only")
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
        if self.context_parallel < 1:
            raise ValueError(f"context_parallel: expected a positive int, got {self.context_parallel}")
        if self.context_parallel > 1:
            if self.task != "enwik8":
                raise ValueError(f"context_parallel: splits enwik8's windows; task {self.task!r} scores its answers "
                                 "from whole sequences' logits, so expected context_parallel 1")
            try:
                context_zigzag(self, self.context_parallel)
            except ValueError as err:
                raise ValueError(f"context_parallel {self.context_parallel}: {err}") from None
        if self.stop_accuracy is not None and (self.task != "recall" or not 0 < self.stop_accuracy <= 1):
            raise ValueError(f"stop_accuracy: expected None, or an accuracy in (0, 1] with task 'recall', got "
                             f"{self.stop_accuracy} with task {self.task!r}")
        if self.task == "recall":
            if self.data_path is not None:
                raise ValueError(f"data_path: task 'recall' generates its sequences and reads no file; expected "
                                 f"None, got {self.data_path!r}")
            try:
                recall = RecallTask(self.seq_len, self.recall_pairs, self.recall_queries)
            except ValueError as err:  # RecallTask's pairs and queries are our recall_pairs and recall_queries
                raise ValueError(f"recall_{err}") from None
            self.recall_queries = recall.queries

    def model_config(self) -> GPTConfig:
        return GPTConfig(**{f.name: getattr(self, f.name) for f in dataclasses.fields(GPTConfig)})


# Fields a resumed run may change: they steer logging, evaluation and where things run, not the
# trajectory of the weights. Any other difference from the checkpoint's config is refused.
RESUME_MAY_CHANGE = {"data_path", "max_iters", "eval_interval", "eval_max_windows", "final_eval_max_windows",
                     "sample_tokens", "ckpt_interval", "device", "compile", "peak_tflops", "use_cuda_kernel", "keep_best",
                     "out_dir", "run_name", "wandb_mode", "wandb_project", "wandb_group", "wandb_tags"}


# ----------------------------------------------------------------------------- reading it

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
    return base.__name__ + ((" or auto" if base is bool else " or None") if optional else "")


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
        # An optional flag's None is its automatic choice (use_cuda_kernel), so "auto" names it too.
        if optional and text.lower() in (("none", "auto") if base is bool else ("none",)):
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
    parser = argparse.ArgumentParser(prog="train.py", description="Train the byte-level GPT on enwik8 (or the "
                                     "recall probe, --task recall). Every field of TrainConfig is an option; the "
                                     "config file sets it unless given here.",
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
    """Exit 2 with message, prefixed by the running script's name as argparse's own errors are."""
    print(f"{os.path.basename(sys.argv[0])}: error: {message}", file=sys.stderr)
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


