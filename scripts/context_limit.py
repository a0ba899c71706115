"""Find the longest context each attention trains at: one training step at batch 1, configs/base, bf16.

    python scripts/context_limit.py                     # softmax (SDPA); cosine, fastmax with and without our kernels
    python scripts/context_limit.py --variants softmax,cosine-kernel --max-seq-len 262144 --out $OUT/context_limit
    python scripts/context_limit.py --device cpu --memory-cap-gib 1 --variants cosine --start 256 --granularity 256 \\
        -- --config configs/tiny_cpu                      # a CPU smoke run; after -- : train.py flags

An attempt at length T builds the model as train.py does (its config and flags), draws random bytes and
takes one training step: forward, backward, gradient clipping and AdamW step, with the optimizer state
already allocated (a first step on one byte creates it), so the memory is that of every later step. Each
attempt runs in a fresh subprocess (an OOM can leave the caching allocator fragmented), with a timeout.

Lengths double from --start until an attempt fails or --max-seq-len is reached; then bisection between
the longest success and the shortest failure until they are at most max(--granularity, --rel-tolerance ×
the success) apart, every length a multiple of --granularity. With the default 1/16, a limit near a
million bytes takes 4 bisection steps instead of 10 (to 1024), and there one attempt can take minutes.

An attempt fails by running out of memory, by its timeout, or by an error (train.py refusing the config,
e.g. a kernel that cannot run it, included); the report says which. --memory-cap-gib caps the memory
below what the device has: on CUDA through the per-process memory fraction (a real OOM), on CPU by
comparing how far the step raised the process's peak RSS with the cap (the growth, so that what
importing torch costs, far more with a CUDA build, does not count). --time-limit bounds the whole search;
variants it cuts short report the bounds found so far. Writes --out.json (every attempt) and --out.md.
"""
from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # train.py and the model live at the repository root

import torch  # noqa: E402

from lab.cli import choice_list, fmt, out_of_memory, refuse_train_flags, require_positive, split_train_flags  # noqa: E402
from lab.config import TrainConfig  # noqa: E402
from lab.config import parse_args as parse_train_args  # noqa: E402
from lab.steps import autocast_for, make_optimizer, peak_memory_gib, setup_device, train_step  # noqa: E402
from model import GPT  # noqa: E402
from model.variants import VARIANTS  # noqa: E402

# The PyTorch references hold T x T scores and fail early: they go first, so a --time-limit spent on
# the slow long-context attempts of the others still leaves their results.
DEFAULT_VARIANTS = "cosine,fastmax,softmax,cosine-kernel,fastmax-kernel"


class TimeLimit(Exception):
    """--time-limit ran out before the next attempt."""


def search(fits: Callable[[int], bool], start: int, max_seq_len: int, granularity: int,
           rel_tolerance: float) -> tuple[int | None, int | None]:
    """(longest length that fits, shortest that does not); None where none was found.

    Doubles from start (capped at max_seq_len), then bisects; start and max_seq_len are multiples of
    granularity, and so is every length tried.
    """
    ok = bad = None
    seq_len = start
    while bad is None and ok != max_seq_len:
        if fits(seq_len):
            ok, seq_len = seq_len, min(2 * seq_len, max_seq_len)
        else:
            bad = seq_len
    while ok is not None and bad is not None and bad - ok > max(granularity, rel_tolerance * ok):
        mid = (ok + bad) // 2 // granularity * granularity  # > ok, as bad - ok > granularity
        if fits(mid):
            ok = mid
        else:
            bad = mid
    return ok, bad


def train_argv(variant: str, seq_len: int, device: str, extra: list[str]) -> list[str]:
    return [*VARIANTS[variant].flags(), "--seq_len", str(seq_len), "--batch_size", "1", "--device", device, *extra]


def one_step(cfg: TrainConfig, memory_cap_gib: float | None) -> dict:
    """This process's attempt: the step's outcome, peak memory and time, and the hardware it ran on."""
    device, dtype = setup_device(cfg)
    hardware = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    if memory_cap_gib is not None and device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, memory_cap_gib * 2**30 / total), device)
    autocast = autocast_for(device, dtype)
    result = {"hardware": hardware, "dtype": str(dtype).removeprefix("torch.")}
    peak_before = peak_memory_gib(device)
    try:
        torch.manual_seed(cfg.seed)
        model = GPT(cfg.model_config()).to(device)
        optimizer = make_optimizer(model, cfg, device)
        # What a step costs does not depend on which bytes it sees.
        x, y = torch.randint(0, 256, (2, 1, cfg.seq_len), device=device)
        for n in (1, cfg.seq_len):  # the step on one byte allocates AdamW's state
            t0 = time.perf_counter()
            train_step(model, optimizer, x[:, :n], y[:, :n], cfg, autocast)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
    except torch.OutOfMemoryError as err:
        return {**result, **out_of_memory(err)}
    peak = peak_memory_gib(device)
    result.update(step_s=time.perf_counter() - t0, peak_mem_gib=peak, step_mem_gib=peak - peak_before)
    if memory_cap_gib is not None and device.type == "cpu" and result["step_mem_gib"] > memory_cap_gib:
        return {**result, "ok": False, "reason": "out of memory",
                "detail": f"the step raised peak RSS by {result['step_mem_gib']:.3f} GiB > --memory-cap-gib "
                          f"{memory_cap_gib}"}
    return {**result, "ok": True}


def attempt(variant: str, seq_len: int, args, extra: list[str], timeout: float) -> dict:
    """One attempt in a fresh process: one_step's result, or why there is none (timeout, crash, refusal)."""
    command = [sys.executable, __file__, "--attempt", str(seq_len), "--variants", variant, "--device", args.device,
               *(["--memory-cap-gib", str(args.memory_cap_gib)] if args.memory_cap_gib is not None else []),
               "--", *extra]
    record = {"seq_len": seq_len}
    t0 = time.monotonic()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {**record, "ok": False, "reason": "timeout", "detail": f"no result within {timeout:.0f} s"}
    record["wall_s"] = time.monotonic() - t0
    lines = done.stdout.strip().splitlines()
    if done.returncode == 0 and lines:
        return {**record, **json.loads(lines[-1])}
    errors = [line for line in done.stderr.splitlines() if line.strip()]
    if done.returncode == 2 and errors:  # train.py's usage_error: it refuses this config
        return {**record, "ok": False, "reason": "refused", "detail": errors[-1][:300]}
    if done.returncode < 0:
        return {**record, "ok": False, "reason": "killed",
                "detail": f"signal {-done.returncode} (the host's OOM killer?)"}
    return {**record, "ok": False, "reason": "error", "detail": (errors[-1] if errors else "no output")[:300]}


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    ours, extra = split_train_flags(argv)
    parser = argparse.ArgumentParser(prog="context_limit.py", description=__doc__.split("\n\n")[0],
                                     usage="context_limit.py [options] [-- train.py flags]")
    parser.add_argument("--variants", default=DEFAULT_VARIANTS, help=f"comma list of {', '.join(VARIANTS)}")
    parser.add_argument("--start", type=int, default=1024, help="first length tried (default %(default)s)")
    parser.add_argument("--max-seq-len", type=int, default=2**21, help="longest length tried (default %(default)s)")
    parser.add_argument("--granularity", type=int, default=1024,
                        help="lengths are multiples of it (default %(default)s)")
    parser.add_argument("--rel-tolerance", type=float, default=1 / 16,
                        help="bisection stops within this fraction of the limit (default %(default)s)")
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds per attempt (default %(default)s)")
    parser.add_argument("--time-limit", type=float, default=540.0, help="seconds for the whole search")
    parser.add_argument("--memory-cap-gib", type=float, default=None, help="memory to fit in (default: the device's)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--out", default=str(ROOT / "bench" / "context_limit"), help="writes OUT.json and OUT.md")
    parser.add_argument("--attempt", type=int, default=None, metavar="SEQ_LEN", help=argparse.SUPPRESS)
    args = parser.parse_args(ours)
    args.variants = choice_list(parser, "--variants", args.variants, VARIANTS)
    require_positive(parser, args, ("start", "max_seq_len", "granularity", "timeout", "time_limit",
                                          "memory_cap_gib"))
    for name in ("start", "max_seq_len"):
        if getattr(args, name) % args.granularity:
            parser.error(f"--{name.replace('_', '-')}: expected a multiple of --granularity={args.granularity}, "
                         f"got {getattr(args, name)}")
    if args.start > args.max_seq_len:
        parser.error(f"--start: expected <= --max-seq-len={args.max_seq_len}, got {args.start}")
    if not 0 <= args.rel_tolerance < 1:
        parser.error(f"--rel-tolerance: expected in [0, 1), got {args.rel_tolerance}")
    refuse_train_flags(parser, extra, ("attention", "seq_len", "batch_size", "device", "use_cuda_kernel"),
                             "sets it for each attempt")
    return args, extra


def bounds(attempts: list[dict]) -> tuple[int | None, int | None]:
    """(longest success, shortest failure) among a variant's attempts: what search() returns, and known
    after every attempt, so an interrupted search still reports its bounds."""
    return (max((a["seq_len"] for a in attempts if a["ok"]), default=None),
            min((a["seq_len"] for a in attempts if not a["ok"]), default=None))


def write_report(args, extra: list[str], attempts: dict[str, list[dict]], stopped: dict[str, str],
                 command: list[str]) -> None:
    """OUT.json (every attempt) and OUT.md (a row per variant, then every attempt)."""
    ran = next((a for tries in attempts.values() for a in tries if "hardware" in a), {})
    cfg, _ = parse_train_args(train_argv(args.variants[0], args.start, args.device, extra))
    model = {k: getattr(cfg, k) for k in ("n_layer", "n_head", "n_kv_head", "n_embd")}
    rule = (f"lengths doubling from {args.start:,} up to {args.max_seq_len:,}, then bisection to within "
            f"max({args.granularity:,}, {args.rel_tolerance:g} × the limit), multiples of {args.granularity:,}")
    variants = {}
    for name, tries in attempts.items():
        limit, failure = bounds(tries)
        variants[name] = {"limit": limit, "first_failure": failure, "reached_max": limit == args.max_seq_len,
                          "stopped": stopped.get(name), "attempts": tries}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(f"{args.out}.json").write_text(json.dumps(
        {"command": command, "hardware": ran.get("hardware"), "dtype": ran.get("dtype"), "torch": torch.__version__,
         "model": model, "train_flags": extra, "search": rule, "timeout_s": args.timeout,
         "memory_cap_gib": args.memory_cap_gib, "variants": variants}, indent=1) + "\n")

    lines = [
        "# Longest context that trains, per attention",
        "",
        f"Written by `{shlex.join(command)}` on {ran.get('hardware', 'no machine: no attempt ran')}, "
        f"torch {torch.__version__}.",
        "",
        f"One training step (forward, backward, clipping, AdamW with its state allocated) at batch 1 in "
        f"{ran.get('dtype', cfg.dtype)}, model {', '.join(f'{k} {v}' for k, v in model.items())}"
        + (f" (train.py flags `{shlex.join(extra)}`)" if extra else " (configs/base)")
        + f"; a fresh process per attempt, timeout {args.timeout:.0f} s; memory: "
        + (f"capped at {args.memory_cap_gib:g} GiB" if args.memory_cap_gib else "the whole device")
        + f". Search: {rule}.",
        "",
        "| attention | longest that trained | peak memory there (GiB) | step time there (s) | shortest that failed "
        "| why it failed | attempts |",
        "| --- | ---: | ---: | ---: | ---: | --- | ---: |",
    ]
    for name, v in variants.items():
        at_limit = next((a for a in v["attempts"] if a["ok"] and a["seq_len"] == v["limit"]), {})
        failed = next((a for a in v["attempts"] if not a["ok"] and a["seq_len"] == v["first_failure"]), {})
        limit = ("none" if v["first_failure"] else "not searched") if v["limit"] is None else (
            f"{v['limit']:,}" + (" (the --max-seq-len)" if v["reached_max"] else ""))
        lines.append(f"| {name} | {limit} | {fmt(at_limit.get('peak_mem_gib'), '.2f')} | "
                     f"{fmt(at_limit.get('step_s'), '.2f')} | {fmt(v['first_failure'], ',')} | "
                     f"{'; '.join(filter(None, [failed.get('reason'), v['stopped']]))} | {len(v['attempts'])} |")
    lines += ["", "## Attempts", "", "| attention | length | result | peak GiB | step s | detail |",
              "| --- | ---: | --- | ---: | ---: | --- |"]
    for name, v in variants.items():
        lines += [f"| {name} | {a['seq_len']:,} | {'ok' if a['ok'] else a['reason']} | "
                  f"{fmt(a.get('peak_mem_gib'), '.2f')} | {fmt(a.get('step_s'), '.2f')} | "
                  f"{a.get('detail', '').replace('|', '/')} |" for a in v["attempts"]]
    Path(f"{args.out}.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args, extra = parse_args(argv)
    if args.attempt is not None:
        cfg, _ = parse_train_args(train_argv(args.variants[0], args.attempt, args.device, extra))
        print(json.dumps(one_step(cfg, args.memory_cap_gib)))
        return 0

    command = ["python", "scripts/context_limit.py", *argv]
    attempts = {v: [] for v in args.variants}
    stopped = {}
    deadline = time.monotonic() + args.time_limit
    for variant in args.variants:
        def fits(seq_len: int) -> bool:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeLimit
            record = attempt(variant, seq_len, args, extra, min(args.timeout, left))
            attempts[variant].append(record)
            print(f"{variant:<15} {seq_len:>9,}: " + (
                f"ok, peak {record['peak_mem_gib']:.2f} GiB, step {record['step_s']:.2f} s" if record["ok"]
                else f"{record['reason']}: {record.get('detail', '')}"), flush=True)
            write_report(args, extra, attempts, stopped, command)  # a search killed later leaves its results
            return record["ok"]

        try:
            search(fits, args.start, args.max_seq_len, args.granularity, args.rel_tolerance)
        except TimeLimit:
            stopped[variant] = "search stopped by --time-limit"
            print(f"{variant}: --time-limit reached; the bounds so far are reported")
    write_report(args, extra, attempts, stopped, command)
    print(f"wrote {args.out}.json and {args.out}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
