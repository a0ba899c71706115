"""A/B of the kernels of several source trees, each built in place, in alternating processes on one GPU.

    python bench/ab_trees.py base=/tmp/base new=. --rounds 3
    python bench/ab_trees.py base=/tmp/base new=. --cases cosine:4:8:16384:64:full,fastmax:4:8:16384:64:causal

Each round runs every tree once, in its own process (so each tree's attention_cuda, the kernels built
in that tree, is the one imported), in the order the trees are given; the rounds show the spread
between processes, which a single run cannot. Per case: forward alone, backward alone (on a retained
graph) and forward+backward, the median of --repeats after --warmup. A case is
family:batch:heads:seq_len:dim_head:full|causal in bf16, timed by the tree's own benchmark.py as it times
"ours" (fastmax: "ours-quadratic"). A tree whose kernels are not built is an error, not a JIT compile.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

DEFAULT_CASES = ("cosine:4:8:8192:64:full,cosine:4:8:16384:64:full,cosine:4:8:16384:64:causal,"
                 "cosine:1:8:65536:64:causal,cosine:1:32:16384:128:full,cosine:1:32:16384:128:causal,"
                 "fastmax:4:8:16384:64:causal")
ROOT = Path(__file__).resolve().parents[1]


def parse_case(text: str) -> dict:
    parts = text.split(":")
    if len(parts) != 6 or parts[0] not in ("cosine", "fastmax") or parts[5] not in ("full", "causal"):
        raise argparse.ArgumentTypeError(f"case {text!r}: expected family:batch:heads:seq_len:dim_head:full|causal "
                                         "with family cosine or fastmax")
    try:
        b, h, n, d = (int(x) for x in parts[1:5])
    except ValueError:
        raise argparse.ArgumentTypeError(f"case {text!r}: batch, heads, seq_len and dim_head must be integers") from None
    return dict(family=parts[0], b=b, h=h, n=n, d=d, causal=parts[5] == "causal")


def case_name(c: dict) -> str:
    return f"{c['family'][:3]} b{c['b']} h{c['h']} d{c['d']} n{c['n']} {'causal' if c['causal'] else 'full'}"


def worker(tree: Path, cases: list[dict], warmup: int, repeats: int) -> list[dict]:
    """The cases timed by the tree's own benchmark.py (its `measure`: input sets spanning twice L2, a
    finiteness check, the median of the repeats), on the tree's kernels."""
    if not list((tree / "attention_cuda").glob("_C*.so")):
        raise SystemExit(f"{tree}: no built kernels (attention_cuda/_C*.so); build the tree in place first")
    sys.path.insert(0, str(tree))
    import torch
    import attention_cuda
    import benchmark

    if Path(attention_cuda.__file__).resolve().parent != (tree / "attention_cuda").resolve():
        raise SystemExit(f"{tree}: imported attention_cuda from {attention_cuda.__file__}, not from the tree")
    gen = torch.Generator(device="cuda").manual_seed(0)
    timing = SimpleNamespace(warmup=warmup, repeats=repeats)
    rows = []
    for c in cases:
        case = benchmark.Case(family=c["family"], batch=c["b"], heads=c["h"], kv_heads=c["h"], seq_len=c["n"],
                              dim_head=c["d"], dtype="bf16", causal=c["causal"], mask_prob=None, device="cuda")
        impl = "ours-quadratic" if c["family"] == "fastmax" else "ours"
        sets, keep = benchmark.make_inputs(case, benchmark.input_set_count(case), gen)
        row = dict(case=case_name(c))
        for pass_ in benchmark.PASSES:
            got = benchmark.measure(impl, replace(case, pass_=pass_), sets, keep, timing)
            if got["not_run"] is not None:
                raise SystemExit(f"{row['case']} {pass_}: {got['not_run']}")
            row[pass_] = got["ms"]
        del sets, keep
        rows.append(row)
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trees", nargs="*", help="name=path of a tree with built kernels, two or more")
    p.add_argument("--cases", default=DEFAULT_CASES, help="comma list of family:batch:heads:seq_len:dim_head:full|causal")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--json", help="write every round's rows here")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    try:
        cases = [parse_case(t) for t in args.cases.split(",")]
    except argparse.ArgumentTypeError as e:
        p.error(f"--cases: {e}")
    if args.rounds < 1 or args.warmup < 0 or args.repeats < 1:
        p.error("--rounds and --repeats must be at least 1, --warmup at least 0")
    if args.worker:
        print(json.dumps(worker(Path(args.worker), cases, args.warmup, args.repeats)))
        return
    trees = []
    for t in args.trees:
        name, sep, path = t.partition("=")
        if not sep or not name or not Path(path, "attention_cuda").is_dir():
            p.error(f"tree {t!r}: expected name=path of a checkout (with attention_cuda/)")
        trees.append((name, Path(path).resolve()))
    if len(trees) < 2:
        p.error("give two or more trees as name=path")
    sys.path.insert(0, str(ROOT))
    import benchmark

    def tflops(c, pass_, ms):
        return benchmark.tflops(benchmark.attention_flops(c["b"], c["h"], c["n"], c["n"], c["d"], c["causal"], pass_), ms)

    results = []
    for r in range(args.rounds):
        for name, path in trees:
            cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", str(path), "--cases", args.cases,
                   "--warmup", str(args.warmup), "--repeats", str(args.repeats)]
            done = subprocess.run(cmd, capture_output=True, text=True, cwd=path)
            if done.returncode != 0:
                raise SystemExit(f"tree {name}, round {r}: {done.stderr.strip()[-2000:]}")
            rows = json.loads(done.stdout.strip().splitlines()[-1])
            for row, c in zip(rows, cases):
                results.append(dict(round=r, tree=name, **row))
                cells = "  ".join(f"{ps} {row[ps]:8.3f} ms ({tflops(c, ps, row[ps]):4.0f} TF)"
                                  for ps in benchmark.PASSES)
                print(f"{row['case']:32s} {name:>6s}  {cells}", flush=True)
    print(f"# {' '.join(sys.argv)}")
    for c in cases:
        name = case_name(c)
        for ps in benchmark.PASSES:
            cells = []
            for tree, _ in trees:
                ms = sorted(x[ps] for x in results if x["tree"] == tree and x["case"] == name)
                cells.append(f"{tree} {ms[0]:.3f}-{ms[-1]:.3f}")
            print(f"{name:32s} {ps:8s} " + "  ".join(cells))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
