"""Evaluate a train.py checkpoint on enwik8 at a context length of your choice: the study's extrapolation test.

    python scripts/evaluate.py --ckpt out/base_cosine/ckpt.pt --seq-len 16384 --out eval.json

The model is built from the checkpoint's config with --seq-len instead (RoPE's tables extend to any length;
nothing else in the model depends on it), on the data the run trained on (its data path, or --data-path),
and scored on consecutive windows of one split exactly as train.py's final evaluation scores them. Writes
{"seq_len", "split", "windows", "loss", "bpc", "bpc_by_position"} to --out.
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
from lab.files import load_checkpoint, write_atomically  # noqa: E402
from lab.steps import autocast_for, evaluate, model_from_checkpoint  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="evaluate.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--ckpt", required=True, help="a checkpoint train.py wrote")
    parser.add_argument("--seq-len", type=int, required=True, help="context length to evaluate at (bytes)")
    parser.add_argument("--split", choices=("val", "test"), default="val")
    parser.add_argument("--max-windows", type=int, default=None, help="windows to score (default: the whole split)")
    parser.add_argument("--data-path", default=None, help="the data to read instead of the run's own")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--out", required=True, help="the JSON file to write")
    args = parser.parse_args(argv)
    if args.seq_len < 1 or (args.max_windows is not None and args.max_windows < 1):
        parser.error("--seq-len and --max-windows: expected positive ints")

    ckpt = load_checkpoint(args.ckpt, "--ckpt")
    model, cfg, device, dtype = model_from_checkpoint(ckpt, f"--ckpt: {args.ckpt}", seq_len=args.seq_len,
                                                      device=args.device)
    try:
        split = load_enwik8(args.data_path or cfg.data_path, log=lambda *_: None)[args.split]
    except DataError as err:
        usage_error(str(err))
    if len(split) <= cfg.seq_len:
        usage_error(f"--seq-len: {cfg.seq_len} needs windows of seq_len + 1 bytes; the {args.split} split has "
                    f"{len(split):,}")
    # One window at a time at long contexts: the activations of a training batch would not fit.
    cfg = dataclasses.replace(cfg, batch_size=max(1, cfg.batch_size * ckpt["config"]["seq_len"] // cfg.seq_len))
    loss, curve = evaluate(model, split, cfg, device, autocast_for(device, dtype), args.max_windows)
    result = {"seq_len": cfg.seq_len, "trained_seq_len": ckpt["config"]["seq_len"], "split": args.split,
              "windows": args.max_windows, "loss": loss, "bpc": loss / math.log(2), "bpc_by_position": curve}
    write_atomically(Path(args.out), lambda f: f.write((json.dumps(result) + "\n").encode()))
    print(f"{args.ckpt}: {args.split} bpc {result['bpc']:.4f} at context {cfg.seq_len:,}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
