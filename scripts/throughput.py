"""Training throughput of each attention in one process: tokens/s and peak memory per context length.

    python scripts/throughput.py                                    # configs/base at 8192, 16384, 32768
    python scripts/throughput.py --seq-lens 8192,32768,65536 --out bench/throughput
    python scripts/throughput.py --device cpu --variants softmax,cosine-sdpa,cosine --seq-lens 64 \\
        --tokens-per-step 256 --steps 2 -- --config configs/tiny_cpu   # a CPU smoke run

Every variant trains the same model (train.py's config and flags after --) on the same random bytes with
the same optimizer, clipping and autocast as train.py, so the ratios between rows are the attentions' own.
A step holds --tokens-per-step tokens (batch = tokens_per_step / seq_len); `-- --compile True` compiles
the model as train.py does. Variants are model/variants.py's:
cosine-sdpa, cosine-sim as SDPA on l2-normalised q, k on cuDNN, is the baseline a user would build without
our kernels. A variant that fails at a length (out of memory, or a refusal) is recorded with the reason and the rest go
on. Timing: --warmup steps, then --steps steps between two synchronisations. Writes OUT.json and OUT.md.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # train.py and the model live at the repository root

import torch  # noqa: E402

from lab.cli import choice_list, int_list, out_of_memory, require_positive, split_train_flags  # noqa: E402
from lab.config import TrainConfig, parse_args  # noqa: E402
from lab.steps import (autocast_for, attention_problem, make_optimizer, peak_memory_gib, setup_device,  # noqa: E402
                       train_step, training_model)
from lab.timing import profile_ops, profile_table  # noqa: E402
from model import GPT  # noqa: E402
from model.variants import VARIANTS  # noqa: E402

DEFAULT_VARIANTS = "softmax,softmax-cudnn,cosine-sdpa,cosine-kernel,fastmax-kernel"

def measure(cfg: TrainConfig, device, dtype, warmup: int, steps: int, profile: bool) -> dict:
    """tokens/s and peak memory of `steps` training steps after `warmup` ones; with profile, also where
    the time of as many more steps goes (lab.timing.profile_ops)."""
    autocast = autocast_for(device, dtype)
    torch.manual_seed(cfg.seed)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    model = GPT(cfg.model_config()).to(device)
    optimizer = make_optimizer(model, cfg, device)
    train_model = training_model(model, cfg)
    x, y = torch.randint(0, 256, (2, cfg.batch_size, cfg.seq_len), device=device)

    def step():
        train_step(train_model, optimizer, x, y, cfg, autocast)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(warmup):
        step()
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    seconds = (time.perf_counter() - t0) / steps
    result = {"ok": True, "step_ms": 1e3 * seconds, "tokens_per_s": cfg.batch_size * cfg.seq_len / seconds,
              "peak_mem_gib": peak_memory_gib(device)}
    if profile:
        result["profile"] = profile_ops(step, steps, device.type)
    return result


def run_one(variant: str, seq_len: int, args, extra: list[str], device, dtype) -> dict:
    batch = max(1, args.tokens_per_step // seq_len)
    cfg, _ = parse_args([*extra, *VARIANTS[variant].flags(), "--seq_len", str(seq_len), "--batch_size", str(batch)])
    record = {"variant": variant, "seq_len": seq_len, "batch_size": batch}
    problem = attention_problem(cfg, device, dtype)
    if problem is not None:
        return {**record, "ok": False, "reason": "refused", "detail": problem}
    try:
        return {**record, **measure(cfg, device, dtype, args.warmup, args.steps, args.profile)}
    except torch.OutOfMemoryError as err:
        return {**record, **out_of_memory(err)}


def write_report(results: list[dict], args, extra: list[str], hardware: str, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    command = "python scripts/throughput.py " + " ".join(sys.argv[1:])
    out.with_suffix(".json").write_text(json.dumps({"command": command, "hardware": hardware,
                                                    "tokens_per_step": args.tokens_per_step,
                                                    "results": results}, indent=1) + "\n")
    seq_lens = sorted({r["seq_len"] for r in results})
    variants = list(dict.fromkeys(r["variant"] for r in results))
    cell = {(r["variant"], r["seq_len"]): r for r in results}
    base = "cosine-sdpa" if "cosine-sdpa" in variants else variants[0]
    lines = [f"# Training throughput ({hardware})", "", f"`{command}`", "",
             f"{args.tokens_per_step} tokens per step, {args.warmup} warm-up + {args.steps} timed steps; "
             f"ratio = tokens/s over {base}'s at the same length.", "",
             "| variant | " + " | ".join(f"{n}: tok/s (ratio), GiB" for n in seq_lens) + " |",
             "|---|" + "---|" * len(seq_lens)]
    for v in variants:
        row = []
        for n in seq_lens:
            r, b = cell.get((v, n)), cell.get((base, n))
            if r is None or not r["ok"]:
                row.append(r["reason"] if r else "")
                continue
            ratio = f" ({r['tokens_per_s'] / b['tokens_per_s']:.2f}x)" if b and b["ok"] else ""
            row.append(f"{r['tokens_per_s'] / 1e3:.0f}k{ratio}, {r['peak_mem_gib']:.1f}")
        lines.append(f"| {v} | " + " | ".join(row) + " |")
    profiles = {f"{r['variant']} {r['seq_len']}": r["profile"] for r in results if r.get("profile")}
    if profiles:
        lines += ["", f"Where a step's time goes ({args.steps} profiled steps after the timed ones; GPU kernels' "
                  "time by kernel name, lab/timing.py's categories; wall time includes launch and Python "
                  "overhead):", "", *profile_table(profiles)]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    ours, extra = split_train_flags(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="throughput.py", description=__doc__.split("\n\n")[0],
                                     usage="throughput.py [options] [-- train.py flags]")
    parser.add_argument("--variants", default=DEFAULT_VARIANTS, help=f"comma list of {', '.join(VARIANTS)}")
    parser.add_argument("--seq-lens", type=int_list, default=[8192, 16384, 32768],
                        help="comma list of context lengths")
    parser.add_argument("--tokens-per-step", type=int, default=2**16)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--profile", action="store_true", help="also profile --steps more steps: time per "
                        "kernel category (issue 37's breakdown), in OUT.md and OUT.json")
    parser.add_argument("--out", default=str(ROOT / "bench" / "throughput"), help="writes OUT.json and OUT.md")
    args = parser.parse_args(ours)
    variants = choice_list(parser, "--variants", args.variants, VARIANTS)
    require_positive(parser, args, ("tokens_per_step", "steps"))
    if not extra or "--config" not in extra:
        extra = ["--config", "configs/base", *extra]
    cfg, _ = parse_args([*extra, "--device", args.device])
    device, dtype = setup_device(cfg)
    extra = [*extra, "--device", str(device)]
    hardware = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    results = []
    for seq_len in args.seq_lens:
        for variant in variants:
            results.append(run_one(variant, seq_len, args, extra, device, dtype))
            r = results[-1]
            print(f"{variant:15s} {seq_len:7d}: " + (f"{r['tokens_per_s'] / 1e3:8.0f}k tok/s {r['step_ms']:8.1f} ms "
                                                     f"{r['peak_mem_gib']:6.1f} GiB" if r["ok"] else r["reason"]),
                  flush=True)
    write_report(results, args, extra, hardware, Path(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
