"""Generation cost per new byte against the context, with the decode cache and without it (issue 38's benchmark).

    python scripts/decode.py --contexts 1024,8192,65536,131072 --batches 1,16 --json bench/decode.json
    python scripts/decode.py --config configs/tiny_cpu --contexts 256,2048 --batches 1 --device cpu

For each attention variant, context T and batch B: the model (the config's, at seq_len T, random weights:
the cost does not depend on them) takes a prefill of T - new_bytes bytes, then new_bytes decode steps,
each timed on its own; a step's cost is their median, so at the last steps it attends to nearly T
positions. On a GPU as many more steps replay one recorded as a CUDA graph (model.CapturedStep:
graph_ms_per_byte). The path without the cache runs the model over a whole window of T bytes for one byte
(timed for contexts up to --no-cache-max). Peak memory is the most the GPU held over the prefill and the steps.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root's packages

from lab.cli import choice_list, int_list  # noqa: E402
from lab.config import parse_args as parse_train_args  # noqa: E402
from lab.files import write_atomically  # noqa: E402
from lab.steps import autocast_for, setup_device  # noqa: E402
from lab.timing import profile_ops, profile_table, time_ms  # noqa: E402
from model import GPT, CapturedStep  # noqa: E402
from model.variants import VARIANTS  # noqa: E402


def measure(model: GPT, context: int, batch: int, new_bytes: int, no_cache: bool, profile: bool, device,
            autocast) -> dict:
    data = torch.randint(0, 256, (batch, context), device=device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    cache = model.new_cache()
    graph = device.type == "cuda"
    # After the prefill: the timed eager steps, the profiled ones, then (on a GPU) the graph's.
    steps = new_bytes * (1 + profile + graph)
    position = iter(range(context - steps, context))
    with torch.no_grad(), autocast:
        model(data[:, :context - steps], cache=cache)

        def step(_=None, run=lambda idx: model(idx, cache=cache)):
            t = next(position)
            run(data[:, t:t + 1])

        times = time_ms(step, 1, 0, new_bytes, device.type)
        row = {"context": context, "batch": batch, "ms_per_byte": statistics.median(times),
               "cache_mib": cache.nbytes() / 2**20}
        if profile:
            row["profile"] = profile_ops(step, new_bytes, device.type)
        if graph:
            captured = CapturedStep(model, cache, batch)
            row["graph_ms_per_byte"] = statistics.median(
                time_ms(lambda _: step(run=captured), 1, 0, new_bytes, device.type))
        row["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
        if no_cache:
            row["no_cache_ms_per_byte"] = statistics.median(time_ms(lambda _: model(data), 1, 1, 3, device.type))
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="decode.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/base", help="the model's train.py config (default %(default)s)")
    parser.add_argument("--variants", default=None, help="model/variants.py names (default: softmax, cosine on SDPA "
                        "and on our kernels, and fastmax on our kernels on a GPU; on the PyTorch reference on a CPU)")
    parser.add_argument("--contexts", type=int_list, default=[1024, 8192, 65536, 131072])
    parser.add_argument("--batches", type=int_list, default=[1, 16])
    parser.add_argument("--new-bytes", type=int, default=32, help="decode steps timed per cell (default %(default)s)")
    parser.add_argument("--no-cache-max", type=int, default=8192, help="time the path without the cache up to this "
                        "context (default %(default)s)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--profile", action="store_true", help="also profile --new-bytes more steps: where a "
                        "step's time goes, by kernel category (lab/timing.py), printed and in the rows")
    parser.add_argument("--json", default=None, help="write the rows here")
    args = parser.parse_args(argv)
    gpu = args.device != "cpu" and torch.cuda.is_available()
    default = "softmax,cosine-sdpa,cosine-kernel,fastmax-kernel" if gpu else "softmax,cosine,fastmax"
    variants = choice_list(parser, "--variants", args.variants or default, VARIANTS)
    least = args.new_bytes * (2 + args.profile)  # the prefill takes at least one byte; (GPU) the graph's steps
    bad = [t for t in args.contexts if t <= least]
    if args.new_bytes < 1 or bad:
        parser.error(f"--contexts: each above {least} (--new-bytes={args.new_bytes} >= 1, times 2 for the eager "
                     f"and the graph's steps{', 3 with --profile' if args.profile else ''}), not {bad}")
    rows = []
    for name in variants:
        for context in args.contexts:
            cfg, _ = parse_train_args(["--config", args.config, *VARIANTS[name].flags(), "--seq_len", str(context),
                                       "--device", args.device, "--dropout", "0"])
            device, dtype = setup_device(cfg)
            model = GPT(cfg.model_config()).to(device).eval()
            for batch in args.batches:
                try:
                    row = measure(model, context, batch, args.new_bytes, context <= args.no_cache_max, args.profile,
                                  device, autocast_for(device, dtype))
                except torch.OutOfMemoryError:
                    row = {"context": context, "batch": batch, "error": "out of memory"}
                rows.append({"variant": name, **row})
                print(json.dumps({k: v for k, v in rows[-1].items() if k != "profile"}), flush=True)
            del model
            if device.type == "cuda":
                torch.cuda.empty_cache()
    profiles = {f"{r['variant']} {r['context']} b{r['batch']}": r["profile"] for r in rows if r.get("profile")}
    if profiles:
        print("\n".join(profile_table(profiles)))
    hardware = torch.cuda.get_device_name() if gpu else "CPU"
    result = {"command": ["python", "scripts/decode.py", *(sys.argv[1:] if argv is None else argv)],
              "hardware": hardware, "torch": torch.__version__, "config": args.config, "new_bytes": args.new_bytes,
              "rows": rows}
    if args.json:
        write_atomically(Path(args.json), lambda f: f.write((json.dumps(result, indent=1) + "\n").encode()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
