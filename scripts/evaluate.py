"""Evaluate a train.py checkpoint on enwik8 at context lengths of your choice: the study's extrapolation test, and
whether the model uses long context.

    python scripts/evaluate.py --ckpt out/base_cosine/ckpt.pt --seq-len 16384 --out eval.json
    python scripts/evaluate.py --ckpt out/base_cosine/ckpt.pt --same-target 256,1024,4096,16384,65536 --out ctx.json
    python scripts/evaluate.py --ckpt out/base_cosine/ckpt.pt --seq-len 8192 --sliding-stride 4096 --out sliding.json

The model is built from the checkpoint's config with seq_len the longest input it will see (RoPE's tables extend
to any length; nothing else in the model depends on it), on the data the run trained on (its data path, or
--data-path), and scored on one split (--split). Three evaluations, each asked alone or together:

  --seq-len N: consecutive windows of N bytes, scored exactly as train.py's final evaluation scores them.
      Writes "seq_len", "windows", "loss", "bpc", "bpc_by_position".
  --sliding-stride S (with --seq-len N): every byte of the split scored once by windows of N bytes starting S
      apart, each scoring its last S positions (the first all N), so every byte past the first window has at
      least N - S bytes of context: the literature's sliding-window bpc. Writes "sliding": {"seq_len", "stride",
      "windows", "bytes", "loss", "bpc"}.
  --same-target C1,C2,...: the same target bytes with the context cut to each Ci (lab.context_eval.
      same_target_losses): the split is cut into consecutive windows of --window bytes (default max(Ci) +
      --targets), and the last --targets (default 2048) target bytes of each are predicted under every cut from
      between 3Ci/4 and Ci bytes of context. Writes "same_target": {"cuts", "targets", "window", "windows",
      "block", "block_loss" (per cut, per window, the mean loss in nats of each --block bytes), "bpc" (per cut)}.

The JSON (--out) also holds "split" and "trained_seq_len". --max-windows caps each evaluation's windows (the plain
one's spread evenly over the split, the sliding and same-target ones the first that many); --tokens-per-batch
(default: a training batch's tokens, batch_size x the trained seq_len) sizes the batches of the last two.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root's packages

from data import DataError, load_enwik8  # noqa: E402
from lab.config import usage_error  # noqa: E402
from lab.context_eval import check_same_target, same_target_losses, sliding_bpc  # noqa: E402
from lab.files import load_checkpoint, write_atomically  # noqa: E402
from lab.steps import autocast_for, evaluate, model_from_checkpoint  # noqa: E402

# lab.context_eval's argument names, as this script's flags (its ValueErrors start with the name).
FLAGS = {"cuts": "--same-target", "targets": "--targets", "window": "--window", "block": "--block",
         "seq_len": "--seq-len", "stride": "--sliding-stride", "max_windows": "--max-windows",
         "tokens_per_batch": "--tokens-per-batch"}


def cut_list(text: str) -> list[int]:
    try:
        cuts = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of ints (e.g. 256,1024,4096), got {text!r}") from None
    return cuts


def flagged(err: ValueError) -> str:
    """A lab.context_eval message with its argument's name as this script's flag."""
    name, sep, rest = str(err).partition(": ")
    return f"{FLAGS[name]}: {rest}" if sep and name in FLAGS else str(err)


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """parser.error (exit 2) naming the flag for values that can never work, before the checkpoint loads."""
    for flag, value in (("--seq-len", args.seq_len), ("--max-windows", args.max_windows),
                        ("--sliding-stride", args.sliding_stride), ("--tokens-per-batch", args.tokens_per_batch)):
        if value is not None and value < 1:
            parser.error(f"{flag}: expected a positive int, got {value}")
    if args.seq_len is None and args.same_target is None:
        parser.error("--seq-len or --same-target: expected at least one evaluation to run")
    if args.sliding_stride is not None:
        if args.seq_len is None:
            parser.error("--sliding-stride: slides windows of --seq-len bytes, so it needs --seq-len")
        if args.sliding_stride > args.seq_len:
            parser.error(f"--sliding-stride: expected <= --seq-len={args.seq_len} (a larger one skips bytes), "
                         f"got {args.sliding_stride}")
    if args.same_target is None:
        for flag, value in (("--window", args.window), ("--targets", args.targets_given),
                            ("--block", args.block_given)):
            if value is not None:
                parser.error(f"{flag}: applies to --same-target, which is not given")
        return
    if args.window is None:
        args.window = max(args.same_target) + args.targets
    try:
        check_same_target(args.same_target, args.targets, args.window, args.block)
    except ValueError as err:
        parser.error(flagged(err))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="evaluate.py", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 2)[2])
    parser.add_argument("--ckpt", required=True, help="a checkpoint train.py wrote")
    parser.add_argument("--seq-len", type=int, default=None,
                        help="context length to evaluate at (bytes); the windows --sliding-stride slides")
    parser.add_argument("--sliding-stride", type=int, default=None, metavar="S",
                        help="also the sliding-window bpc at --seq-len, windows S bytes apart")
    parser.add_argument("--same-target", type=cut_list, default=None, metavar="C1,C2,...",
                        help="the same target bytes with the context cut to each of these lengths")
    parser.add_argument("--targets", type=int, default=None, metavar="N",
                        help="--same-target: target bytes scored at the end of each window (default 2048)")
    parser.add_argument("--window", type=int, default=None, metavar="N",
                        help="--same-target: bytes of each window (default max(cuts) + --targets)")
    parser.add_argument("--block", type=int, default=None, metavar="N",
                        help="--same-target: bytes per mean in block_loss (default 64)")
    parser.add_argument("--split", choices=("val", "test"), default="val")
    parser.add_argument("--max-windows", type=int, default=None, help="windows to score (default: the whole split)")
    parser.add_argument("--tokens-per-batch", type=int, default=None,
                        help="tokens per forward of the sliding and same-target evaluations (default: a training "
                             "batch's, batch_size x the trained seq_len)")
    parser.add_argument("--data-path", default=None, help="the data to read instead of the run's own")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--out", required=True, help="the JSON file to write")
    args = parser.parse_args(argv)
    args.targets_given, args.block_given = args.targets, args.block
    args.targets = 2048 if args.targets is None else args.targets
    args.block = 64 if args.block is None else args.block
    check_args(parser, args)

    ckpt = load_checkpoint(args.ckpt, "--ckpt")
    trained_seq_len = ckpt["config"]["seq_len"]
    longest = max(args.seq_len or 0, max(args.same_target or [0]))
    model, cfg, device, dtype = model_from_checkpoint(ckpt, f"--ckpt: {args.ckpt}", seq_len=longest,
                                                      device=args.device)
    try:
        split = load_enwik8(args.data_path or cfg.data_path, log=lambda *_: None)[args.split]
    except DataError as err:
        usage_error(str(err))
    if args.seq_len is not None and len(split) <= args.seq_len:
        usage_error(f"--seq-len: {args.seq_len} needs windows of seq_len + 1 bytes; the {args.split} split has "
                    f"{len(split):,}")
    if args.same_target is not None and len(split) <= args.window:
        usage_error(f"--window: {args.window} needs windows of window + 1 bytes; the {args.split} split has "
                    f"{len(split):,} (a smaller --window, or cuts)")
    autocast = autocast_for(device, dtype)
    tokens = args.tokens_per_batch or cfg.batch_size * trained_seq_len
    result = {"trained_seq_len": trained_seq_len, "split": args.split}  # the plain keys first, in their old order

    if args.seq_len is not None:
        # One window at a time at long contexts: the activations of a training batch would not fit.
        plain = dataclasses.replace(cfg, seq_len=args.seq_len,
                                    batch_size=max(1, cfg.batch_size * trained_seq_len // args.seq_len))
        loss, curve = evaluate(model, split, plain, device, autocast, args.max_windows)
        result = {"seq_len": args.seq_len, **result, "windows": args.max_windows, "loss": loss,
                  "bpc": loss / math.log(2), "bpc_by_position": curve}
        print(f"{args.ckpt}: {args.split} bpc {result['bpc']:.4f} at context {args.seq_len:,}")
    if args.sliding_stride is not None:
        result["sliding"] = sliding_bpc(model, split, args.seq_len, args.sliding_stride, device, autocast,
                                        args.max_windows, tokens)
        print(f"{args.ckpt}: {args.split} sliding bpc {result['sliding']['bpc']:.4f} at context {args.seq_len:,}, "
              f"stride {args.sliding_stride:,} ({result['sliding']['bytes']:,} bytes)")
    if args.same_target is not None:
        same = same_target_losses(model, split, args.same_target, args.targets, args.window, device, autocast,
                                  args.max_windows, args.block, tokens)
        result["same_target"] = same
        print(f"{args.ckpt}: {args.split} the same {args.targets:,} target bytes of {same['windows']} windows, bpc by "
              "context: " + ", ".join(f"{c:,}: {b:.4f}" for c, b in zip(same["cuts"], same["bpc"])))
    write_atomically(Path(args.out), lambda f: f.write((json.dumps(result) + "\n").encode()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
