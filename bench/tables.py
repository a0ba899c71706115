"""The results tables of README.md and docs/*.md, generated from the committed result files.

A table sits between two marker comments in a markdown file:

    <!-- table:cosine-vs-cudnn -->
    (generated: the table and a line naming the file it came from)
    <!-- /table -->

    python bench/tables.py           rewrite every marked table from the files under bench/
    python bench/tables.py --check   only compare; exit 1 with a diff of each document that differs

The tables are generated rather than typed so that a number in the docs always equals the file it
cites: rerun a benchmark, commit its JSON, run this script. tests/test_tables.py runs --check on CPU,
so a doc that drifts from its file fails the tests. A missing input file, a measurement the file
lacks, an unknown table name or an unclosed marker is an error (exit 2) that names the file, and
then no document is written at all.
"""
from __future__ import annotations

import argparse
import difflib
import importlib.util
import json
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
DOC_GLOBS = ("README.md", "docs/*.md")  # where markers are looked for
BEGIN = re.compile(r"^<!-- table:([a-z0-9-]+) -->$")
END = "<!-- /table -->"


class TableError(Exception):
    """Raised for anything that would leave a table wrong or half-made; the message names the file."""


# ---------------------------------------------------------------------------------------------------
# Reading the result files

class Sources:
    """The result files, read once each, relative to the repository root."""

    def __init__(self, root: Path):
        self.root = root
        self._cache: dict[str, object] = {}

    @property
    def read(self) -> list[str]:
        """The files read so far."""
        return sorted(self._cache)

    def json(self, rel: str):
        if rel not in self._cache:
            path = self.root / rel
            if not path.is_file():
                raise TableError(f"{rel}: missing (a table in the docs is generated from it)")
            try:
                self._cache[rel] = json.loads(path.read_text())
            except (OSError, ValueError) as e:
                raise TableError(f"{rel}: not readable as JSON ({e})") from e
        return self._cache[rel]

    def bench(self, rel: str) -> "Bench":
        data = self.json(rel)
        if not isinstance(data, dict) or "measurements" not in data or "environment" not in data:
            raise TableError(f"{rel}: not a benchmark.py JSON file (no environment / measurements)")
        return Bench(rel, data["environment"], data["measurements"])


@dataclass
class Bench:
    """One benchmark.py JSON file: its environment and a row per (case, implementation, pass)."""

    rel: str
    env: dict
    rows: list

    def row(self, **where) -> dict:
        hits = [r for r in self.rows if all(r.get(k) == v for k, v in where.items())]
        if len(hits) != 1:
            what = ", ".join(f"{k}={v}" for k, v in where.items())
            raise TableError(f"{self.rel}: {len(hits)} measurements with {what}, expected one")
        return hits[0]

    def ms(self, **where) -> float:
        r = self.row(**where)
        if r.get("ms") is None:
            what = ", ".join(f"{k}={v}" for k, v in where.items())
            raise TableError(f"{self.rel}: {what} was not run ({r.get('not_run')})")
        return r["ms"]

    def tflops(self, **where) -> float:
        self.ms(**where)
        return self.row(**where)["tflops"]

    def describe(self) -> str:
        """The command that wrote the file, and when and where it ran."""
        e = self.env
        try:
            return f"`{e['command']}` ({e['date'][:10]}, {e['gpu']}, torch {e['torch']}, git {e['git']})"
        except KeyError as err:
            raise TableError(f"{self.rel}: its environment lacks {err}") from err


def f(x: float, digits: int) -> str:
    return f"{x:.{digits}f}"


def kilo(x: float) -> str:
    return f"{x / 1000:.0f}k"


def thousands(x: int) -> str:
    return f"{x:,}"


def table(header: list[str], rows: list[list[str]], right: set[int] = frozenset()) -> list[str]:
    """A markdown table; columns in `right` are right-aligned (numbers)."""
    align = ["---:" if i in right else "---" for i in range(len(header))]
    return ["| " + " | ".join(r) + " |" for r in [header, align, *rows]]


# ---------------------------------------------------------------------------------------------------
# The tables. Each takes the sources and link(rel) (a markdown link to a repository file, relative to
# the document being written) and returns its lines, ending with where the numbers came from.

Link = Callable[[str], str]

SEEDS, OLMO2, OLMO2_LONG = ("bench/results_seeds.json", "bench/results_olmo2.json",
                            "bench/runs/2026-11-27_s43_olmo2-long.json")
# The headline cosine shapes: (label, file, batch, heads, head dim, lengths).
COSINE_SHAPES = [("b4 h8 d64", SEEDS, 4, 8, 64, (4096, 8192, 16384)),
                 ("b1 h32 d128 (OLMo-2 7B layer)", OLMO2, 1, 32, 128, (4096,)),
                 ("b1 h32 d128", OLMO2_LONG, 1, 32, 128, (8192, 16384))]
# The same kernels on an H100 (the seeds preset; H100 and H200 figures are quoted apart).
COSINE_SHAPES_H100 = [("b4 h8 d64", "bench/runs/2026-11-27_s45_results_seeds-h100.json", 4, 8, 64,
                       (4096, 8192, 16384))]


def _cosine_case(b: int, h: int, d: int, n: int) -> dict:
    """The fields that pick a bf16 cosine case out of a benchmark file."""
    return dict(batch=b, heads=h, dim_head=d, seq_len=n, family="cosine", dtype="bf16", mask_prob=None, kv_heads=h)


def _cosine_cases(src: Sources, shapes=COSINE_SHAPES):
    for label, rel, b, h, d, lengths in shapes:
        bench = src.bench(rel)
        for n in lengths:
            yield label, n, bench, _cosine_case(b, h, d, n)


def _pass_times(bench: Bench, case: dict, causal: bool, impls: tuple[str, ...]) -> list[str]:
    """A cell per pass (forward, backward, both): the impls' ms, " / "-joined."""
    return [" / ".join(f(bench.ms(impl=i, causal=causal, **{"pass": p}, **case), 2) for i in impls)
            for p in ("fwd", "bwd", "fwd+bwd")]


def _sources_line(src: Sources, link: Link, rels: list[str]) -> str:
    return "Source: " + "; ".join(f"{link(r)}, {src.bench(r).describe()}" for r in rels) + "."


def _ratio_pair(bench: Bench, case: dict, pass_: str, other: str) -> str:
    return " / ".join(f(bench.ms(impl="ours", causal=c, **{"pass": pass_}, **case)
                        / bench.ms(impl=other, causal=c, **{"pass": pass_}, **case), 2) for c in (False, True))


def cosine_vs_cudnn(src: Sources, link: Link, shapes=COSINE_SHAPES) -> list[str]:
    rows = []
    for label, n, bench, case in _cosine_cases(src, shapes):
        tf = [f"{bench.tflops(impl=i, causal=False, **{'pass': p}, **case):.0f}" for p in ("fwd", "bwd")
              for i in ("ours", "cudnn")]
        rows.append([label, thousands(n), _ratio_pair(bench, case, "fwd", "cudnn"),
                     _ratio_pair(bench, case, "fwd+bwd", "cudnn"), f"{tf[0]} ({tf[1]})", f"{tf[2]} ({tf[3]})"])
    return [*table(["shape", "N", "forward, non-causal / causal", "forward+backward, non-causal / causal",
                    "forward TFLOP/s (cuDNN)", "backward TFLOP/s (cuDNN)"], rows, right={1}),
            "",
            "Our time over SDPA-cuDNN's on normalised q/k, same run (< 1 is faster); TFLOP/s non-causal, "
            "FlashAttention's FLOP count. " + _sources_line(src, link, [shape[1] for shape in shapes])]


def cosine_vs_cudnn_h100(src: Sources, link: Link) -> list[str]:
    return cosine_vs_cudnn(src, link, COSINE_SHAPES_H100)


# FlashAttention-3 on one H100 (bench/fa3_build.sh), with our kernels and cuDNN in the same run: the seeds
# shapes and the training shape's long causal lengths. (label, file, batch, heads, head dim, lengths, causal).
FA3_SHAPES = [("b4 h8 d64", "bench/runs/2026-11-27_s46_seeds-fa3-h100.json", 4, 8, 64, (4096, 8192, 16384),
               (False, True)),
              ("b1 h8 d64", "bench/runs/2026-11-27_s46_long-causal-fa3-h100.json", 1, 8, 64, (32768, 65536, 131072),
               (True,))]


def cosine_vs_fa3(src: Sources, link: Link) -> list[str]:
    rows = []
    for label, rel, b, h, d, lengths, causals in FA3_SHAPES:
        bench = src.bench(rel)
        for n in lengths:
            case = _cosine_case(b, h, d, n)
            rows += [[label, thousands(n), "yes" if c else "no", *_pass_times(bench, case, c, ("ours", "fa3", "cudnn"))]
                     for c in causals]
    return [*table(["shape", "N", "causal", "forward ms: ours / FA3 / cuDNN", "backward ms", "forward+backward ms"],
                   rows, right={1}),
            "",
            "FlashAttention-3 and cuDNN on normalised q/k (F.normalize timed with them), ours on raw q/k, in one run "
            "on one H100. " + _sources_line(src, link, [shape[1] for shape in FA3_SHAPES])]


def cosine_headline(src: Sources, link: Link) -> list[str]:
    """The README's compact form of cosine-vs-cudnn: a row per length, a column pair per head dim."""
    ratios = {}
    for label, n, bench, case in _cosine_cases(src):
        ratios[case["dim_head"], n] = [_ratio_pair(bench, case, p, "cudnn") for p in ("fwd", "fwd+bwd")]
    lengths = sorted({n for _, n in ratios})
    rows = [[thousands(n), *ratios[64, n], *ratios[128, n]] for n in lengths]
    return [*table(["N", "b4 h8 d64 forward", "forward+backward", "b1 h32 d128 forward", "forward+backward"], rows,
                   right={0}),
            "",
            "Cosine-sim, bf16: our time over SDPA-cuDNN's on normalised q/k in the same run, non-causal / causal (< 1 "
            "is faster); d128 is one OLMo-2 7B attention layer. "
            + _sources_line(src, link, [SEEDS, OLMO2, OLMO2_LONG])]


def cosine_vs_flash(src: Sources, link: Link) -> list[str]:
    rows = [[label, thousands(n), *(_ratio_pair(bench, case, p, "flash") for p in ("fwd", "fwd+bwd"))]
            for label, n, bench, case in _cosine_cases(src)]
    return [*table(["shape", "N", "forward, non-causal / causal", "forward+backward, non-causal / causal"], rows,
                   right={1}),
            "",
            "Our time over SDPA-FlashAttention-2's on normalised q/k, same run. "
            + _sources_line(src, link, [SEEDS, OLMO2, OLMO2_LONG])]


def cosine_passes(src: Sources, link: Link) -> list[str]:
    rows = []
    for label, n, bench, case in _cosine_cases(src):
        rows += [[label, thousands(n), "yes" if c else "no", *_pass_times(bench, case, c, ("ours", "cudnn", "flash"))]
                 for c in (False, True)]
    return [*table(["shape", "N", "causal", "forward ms: ours / cuDNN / FA2", "backward ms", "forward+backward ms"],
                   rows, right={1}),
            "",
            "bf16, median of the timed calls. " + _sources_line(src, link, [SEEDS, OLMO2, OLMO2_LONG])]


FP32 = "bench/runs/2026-11-21_s5_dtypes/results_seeds_fp32.json"


def cosine_fp32(src: Sources, link: Link) -> list[str]:
    bench = src.bench(FP32)
    rows = []
    for n in (4096, 8192):
        for c in (False, True):
            case = dict(batch=4, heads=8, dim_head=64, seq_len=n, causal=c, dtype="fp32")
            cells = []
            for p in ("fwd", "fwd+bwd"):
                ours = bench.ms(impl="ours", **{"pass": p}, **case)
                eff = bench.ms(impl="efficient", **{"pass": p}, **case)
                cells.append(f"{f(ours, 2)} / {f(eff, 2)} ({f(eff / ours, 1)}x)")
            rows.append(["b4 h8 d64", thousands(n), "yes" if c else "no", *cells])
    return [*table(["shape", "N", "causal", "forward ms: ours / SDPA efficient (speed-up)", "forward+backward ms"],
                   rows, right={1}),
            "",
            "fp32 inputs (TF32 on the tensor cores). " + _sources_line(src, link, [FP32])]


FASTMAX = "bench/runs/2026-11-27_s38_fastmax-chunked.json"
FASTMAX_CUDNN = "bench/runs/2026-11-22_s18_fastmax-cudnn.json"
FASTMAX_SWEEP = "bench/runs/2026-11-22_s14_fastmax-bar.json"
FASTMAX_LINEAR = "bench/results_fastmax-linear.json"
FASTMAX_SEEDS = "bench/results_fastmax-seeds.json"
CROSSOVER = "bench/runs/2026-11-21_s8_fastmax-crossover.json"
IMPL_NAMES = {"ours-linear": "ours, linear form", "ours-quadratic": "ours, quadratic form",
              "fla-parallel": "fla `parallel_based`", "cudnn": "cuDNN softmax", "flash": "FA2 softmax",
              "naive": "naive PyTorch", "fla-chunk": "fla `fused_chunk_based`"}


def _fastmax_case(d: int, n: int, b: int = 4, h: int = 8, causal: bool = True) -> dict:
    return dict(family="fastmax", batch=b, heads=h, kv_heads=h, dim_head=d, seq_len=n, causal=causal,
                dtype="bf16", mask_prob=None)


def fastmax_causal(src: Sources, link: Link) -> list[str]:
    """The README's compact form: a row per head dim, each cell linear / quadratic / parallel_based."""
    bench, lengths = src.bench(FASTMAX), (8192, 16384, 32768, 65536)
    impls = ("ours-linear", "ours-quadratic", "fla-parallel")
    rows = [[str(d), *(" / ".join(f(bench.ms(impl=i, **{"pass": "fwd+bwd"}, **_fastmax_case(d, n)), 1) for i in impls)
                       for n in lengths)] for d in (64, 128)]
    return [*table(["d", *(thousands(n) for n in lengths)], rows, right=set(range(1, len(lengths) + 1))),
            "",
            "Fastmax, causal forward+backward ms: our linear form / our quadratic form / flash-linear-attention's "
            "`parallel_based` (the same function); b4 h8, p=2, bf16. " + _sources_line(src, link, [FASTMAX])]


def fastmax_full(src: Sources, link: Link) -> list[str]:
    bench = src.bench(FASTMAX)
    rows = []
    for d in (64, 128):
        for n in (4096, 8192, 16384, 32768, 65536):
            cells = []
            for i in ("ours-quadratic", "ours-linear", "fla-parallel"):
                where = dict(impl=i, **{"pass": "fwd+bwd"}, **_fastmax_case(d, n))
                cells.append(f"{f(bench.ms(**where), 2)} ({f(bench.row(**where)['mem_gib'], 2)})")
            rows.append([str(d), thousands(n), *cells])
    return [*table(["d", "N", "quadratic form: ms (extra GiB)", "linear form", "fla `parallel_based`"], rows,
                   right={1, 2, 3, 4}),
            "",
            "b4 h8, causal, p=2, bf16, forward+backward; extra GiB: peak memory of one call beyond its inputs. "
            + _sources_line(src, link, [FASTMAX])]


def fastmax_vs_cudnn(src: Sources, link: Link) -> list[str]:
    rows = []
    for rel, d in ((FASTMAX_CUDNN, 32), (FASTMAX, 64), (FASTMAX, 128)):
        bench = src.bench(rel)
        for n in (16384, 32768, 65536):
            ours = bench.ms(impl="ours-linear", **{"pass": "fwd+bwd"}, **_fastmax_case(d, n))
            cudnn = bench.ms(impl="cudnn", **{"pass": "fwd+bwd"}, **_fastmax_case(d, n))
            rows.append([str(d), thousands(n), f(ours, 2), f(cudnn, 2), f(ours / cudnn, 2)])
    return [*table(["d", "N", "fastmax, linear form ms", "cuDNN softmax ms", "ratio"], rows, right={1, 2, 3, 4}),
            "",
            "b4 h8, causal, bf16, forward+backward, both in the same run; d=64 and d=128 run the chunked kernels, "
            "d=32 the sweep. " + _sources_line(src, link, [FASTMAX_CUDNN, FASTMAX])]


def fastmax_sweep(src: Sources, link: Link) -> list[str]:
    bench = src.bench(FASTMAX_SWEEP)
    impls = ("ours-quadratic", "ours-linear", "fla-parallel", "cudnn")
    rows = [[str(d), thousands(n), *(f(bench.ms(impl=i, **{"pass": "fwd+bwd"}, **_fastmax_case(d, n)), 2)
                                     for i in impls)]
            for d in (32, 64) for n in (16384, 32768, 65536)]
    return [*table(["d", "N", "quadratic form ms", "linear form (sweep) ms", "fla `parallel_based` ms",
                    "cuDNN softmax ms"], rows, right={1, 2, 3, 4, 5}),
            "",
            "b4 h8, causal, p=2, bf16, forward+backward, before the chunked kernels existed, so the linear "
            "form ran on the sweep, as it still does off Hopper and at d=32. "
            + _sources_line(src, link, [FASTMAX_SWEEP])]


def fastmax_crossover(src: Sources, link: Link) -> list[str]:
    """Quadratic / linear time per head dim and length: where the sweep's crossover was read from."""
    lengths = (4096, 8192, 16384, 32768, 65536, 131072)
    rows = []
    for rel, dims in ((CROSSOVER, (16,)), (FASTMAX_LINEAR, (32, 64)), (CROSSOVER, (96, 128))):
        bench = src.bench(rel)
        for d in dims:
            cells = []
            for n in lengths:
                case = dict(**_fastmax_case(d, n), **{"pass": "fwd+bwd"})
                have = [r for r in bench.rows if all(r.get(k) == v for k, v in case.items())]
                if not have:
                    cells.append("")
                    continue
                quadratic, linear = bench.ms(impl="ours-quadratic", **case), bench.ms(impl="ours-linear", **case)
                cells.append(f"{f(quadratic, 1)} / {f(linear, 1)}")
            rows.append([str(d), *cells])
    return [*table(["d", *(thousands(n) for n in lengths)], rows, right=set(range(1, 7))),
            "",
            "Quadratic / linear form (the sweep), forward+backward ms, b4 h8, causal, p=2, bf16. "
            + _sources_line(src, link, [CROSSOVER, FASTMAX_LINEAR])]


def fastmax_seeds(src: Sources, link: Link) -> list[str]:
    bench = src.bench(FASTMAX_SEEDS)
    impls = ("ours-quadratic", "ours-linear", "fla-parallel", "flash", "cudnn", "naive")
    rows = []
    for d in (32, 64):
        for n in (1000, 10000):
            for c in (False, True):
                case = dict(**_fastmax_case(d, n, b=64, causal=c), **{"pass": "fwd"})
                cells = []
                for i in impls:
                    r = bench.row(impl=i, **case)
                    cells.append("not run" if r["ms"] is None else f(r["ms"], 2))
                rows.append([str(d), thousands(n), "yes" if c else "no", *cells])
    return [*table(["d", "N", "causal", *(IMPL_NAMES[i] for i in impls)], rows, right=set(range(1, 9))),
            "",
            "b64 h8, p=2, bf16, forward ms (the Fastmax paper's shapes; fla's kernels are causal only, naive "
            "does not fit at 10,000). " + _sources_line(src, link, [FASTMAX_SEEDS])]


THROUGHPUT, THROUGHPUT_COMPILED = "bench/throughput.json", "bench/runs/2026-11-27_s42_throughput-compiled-h200.json"


def _variant_labels() -> dict[str, str]:
    """model/variants.py's labels, the file loaded by path: the model package imports torch, which these
    tables do not need."""
    spec = importlib.util.spec_from_file_location("_variants", ROOT / "model" / "variants.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks itself up there
    spec.loader.exec_module(module)
    return {name: v.label for name, v in module.VARIANTS.items()}


VARIANT_NAMES = _variant_labels()


def _throughput_file(src: Sources, rel: str) -> tuple[dict, list[int], list[str]]:
    data = src.json(rel)
    try:
        results = {(r["variant"], r["seq_len"]): r for r in data["results"]}
        lengths = sorted({n for _, n in results})
        variants = list(dict.fromkeys(v for v, _ in results))
        for key in results:
            if not results[key]["ok"]:
                raise TableError(f"{rel}: {key} did not run")
    except (KeyError, TypeError) as e:
        raise TableError(f"{rel}: not a scripts/throughput.py result file ({e!r})") from e
    return results, lengths, variants


def _throughput(src: Sources, link: Link, rel: str) -> list[str]:
    results, lengths, variants = _throughput_file(src, rel)
    rows = [[VARIANT_NAMES.get(v, v), *(f"{kilo(results[v, n]['tokens_per_s'])}, {f(results[v, n]['peak_mem_gib'], 1)}"
                                       for n in lengths)] for v in variants]
    data = src.json(rel)
    return [*table(["attention", *(f"{thousands(n)}: tokens/s, peak GiB" for n in lengths)], rows,
                   right=set(range(1, len(lengths) + 1))),
            "",
            f"Training steps of configs/base, {thousands(data['tokens_per_step'])} tokens per step, bf16. "
            f"Source: {link(rel)}, `{data['command']}` ({data['hardware']})."]


def throughput(src: Sources, link: Link) -> list[str]:
    return _throughput(src, link, THROUGHPUT)


def throughput_compiled(src: Sources, link: Link) -> list[str]:
    return _throughput(src, link, THROUGHPUT_COMPILED)


CONTEXT = "bench/context_limit.json"


def context_limit(src: Sources, link: Link) -> list[str]:
    data = src.json(CONTEXT)
    rows = []
    try:
        for name, v in data["variants"].items():
            ok = [a for a in v["attempts"] if a["ok"]]
            last = max(ok, key=lambda a: a["seq_len"]) if ok else None
            limit = "none" if v["limit"] is None else thousands(v["limit"])
            if v["reached_max"]:
                limit = f"≥ {limit} (the search's cap)"
            failed = [a for a in v["attempts"] if not a["ok"]]
            why = f"{thousands(v['first_failure'])} ({failed[0]['reason']})" if v["first_failure"] else ""
            rows.append([VARIANT_NAMES.get(name, name), limit,
                         f(last["peak_mem_gib"], 1) if last else "", f(last["step_s"], 2) if last else "", why])
        command = " ".join(data["command"])
    except (KeyError, TypeError) as e:
        raise TableError(f"{CONTEXT}: not a scripts/context_limit.py result file ({e!r})") from e
    return [*table(["attention", "longest context that trains", "peak GiB there", "step s there", "first failure"],
                   rows, right={1, 2, 3}),
            "",
            f"One training step of configs/base at batch 1, {data['dtype']}. Source: {link(CONTEXT)}, "
            f"`{command}` ({data['hardware']}, torch {data['torch']})."]


COMPARE = "bench/compare/results.json"
ATTENTION_NAMES = {("softmax", False): "softmax (SDPA)", ("cosine", True): "cosine (our kernels)",
                   ("fastmax", True): "fastmax (our kernels)"}


def _compare_runs(src: Sources) -> tuple[dict, list]:
    data = src.json(COMPARE)
    try:
        runs = data["runs"]
        for r in runs:
            if r["status"] != "ok":
                raise TableError(f"{COMPARE}: run {r['attention']} at {r['seq_len']} ended {r['status']}")
        return data, runs
    except (KeyError, TypeError) as e:
        raise TableError(f"{COMPARE}: not a compare.py result file ({e!r})") from e


def _compare_source(data: dict, link: Link, lead: str = "") -> str:
    b = data["budget"]
    return (f"{lead}Same seed, data and budget for every run: {thousands(b['tokens_per_run'])} training tokens "
            f"({b['steps']} steps of {thousands(b['tokens_per_step'])}), configs/base. Source: {link(COMPARE)}, "
            f"`{' '.join(data['command'])}` ({data['hardware']}, torch {data['torch']}).")


def compare(src: Sources, link: Link) -> list[str]:
    data, runs = _compare_runs(src)
    rows = [[ATTENTION_NAMES.get((r["attention"], r["kernel"]), r["attention"]), thousands(r["seq_len"]),
             str(r["batch_size"]), f(r["final_val_bpc"], 4), f(r["test_bpc"], 4), thousands(round(r["tokens_per_s"])),
             f(r["peak_mem_gib"], 2), f(r["train_s"], 1)] for r in runs]
    return [*table(["attention", "context", "batch", "final val bpc", "test bpc", "tokens/s", "peak GiB",
                    "training s"], rows, right=set(range(1, 8))),
            "",
            _compare_source(data, link)]


STUDY = "bench/study/results.json"


def study(src: Sources, link: Link) -> list[str]:
    """The study's grid: per attention and short_conv, test bpc (mean [95% t interval] over seeds, as the report
    computed it) and training tokens/s per context."""
    data = src.json(STUDY)
    try:
        p = data["protocol"]
        cells = {(c["variant"], c["conv"], c["seq_len"]): c for c in data["cells"]}
        grid = [cells[v, conv, n] for v in p["variants"] for conv in p["convs"] for n in p["seq_lens"]]
        speeds = any(c["tokens_per_s"] is not None for c in grid)
        rows = [[VARIANT_NAMES.get(v, v), str(conv),
                 *(_interval(cells[v, conv, n]["test_bpc"]) for n in p["seq_lens"]),
                 *((kilo(cells[v, conv, n]["tokens_per_s"]) if cells[v, conv, n]["tokens_per_s"] else "–")
                   for n in p["seq_lens"] if speeds)]
                for v in p["variants"] for conv in p["convs"]]
        seeds = sorted({c["seeds"] for c in grid})
        conv = data["tokens_per_s_conv"]
        measured = (f" with short conv {conv} for both rows (the convolution costs the same under every "
                    "attention)" if len(p["convs"]) > 1 and conv is not None else "")
        lengths = [thousands(n) for n in p["seq_lens"]]
        interim = (f"**Interim**: {data['missing']} of the {data['planned']} runs planned so far have not run. "
                   if data["missing"] else "")
        caption = (f"{interim}The study (`make compare`), with its paired differences (Holm-corrected), same-target "
                   f"context curves, learning-rate sweep, memorising check and recall probe in "
                   f"{link('bench/study/report.md')}: test bpc of each run's best-val checkpoint at its trained "
                   f"context, mean [95% t interval] over {seeds[0] if len(seeds) == 1 else f'{seeds[0]}-{seeds[-1]}'} "
                   f"seeds" + (f", and training tokens/s measured alone on one {data['tokens_per_s_gpu']}{measured}"
                               if speeds else "") + ". "
                   f"Every run {p['epochs']:g} epochs of "
                   f"{'the verified enwik8' if p['data_path'] is None else 'the 4 MB enwik8 prefix (a pilot)'} at its "
                   f"attention's swept rate, {p['config']}, trained on {data['trained_on']}. Source: {link(STUDY)}, "
                   f"`{data['command']}` ({data['hardware']}).")
    except (KeyError, TypeError, IndexError) as e:
        raise TableError(f"{STUDY}: not a compare.py study file ({e!r})") from e
    header = ["attention", "short conv", *(f"test bpc, {n}" for n in lengths),
              *(f"tokens/s, {n}" for n in lengths if speeds)]
    return [*table(header, rows, right=set(range(1, len(header)))), "", caption]


def _interval(bpc: list) -> str:
    mean, low, high = bpc
    if mean is None:
        return "–"
    return f"{mean:.2f}" if low is None else f"{mean:.2f} [{low:.2f}, {high:.2f}]"


TABLES: dict[str, Callable[[Sources, Link], list[str]]] = {
    "cosine-headline": cosine_headline,
    "cosine-vs-cudnn": cosine_vs_cudnn,
    "cosine-vs-cudnn-h100": cosine_vs_cudnn_h100,
    "cosine-vs-flash": cosine_vs_flash,
    "cosine-vs-fa3": cosine_vs_fa3,
    "cosine-passes": cosine_passes,
    "cosine-fp32": cosine_fp32,
    "fastmax-causal": fastmax_causal,
    "fastmax-full": fastmax_full,
    "fastmax-vs-cudnn": fastmax_vs_cudnn,
    "fastmax-sweep": fastmax_sweep,
    "fastmax-crossover": fastmax_crossover,
    "fastmax-seeds": fastmax_seeds,
    "throughput": throughput,
    "throughput-compiled": throughput_compiled,
    "context-limit": context_limit,
    "compare": compare,
    "study": study,
}


# ---------------------------------------------------------------------------------------------------
# The documents

def documents(root: Path) -> list[Path]:
    return sorted({p for g in DOC_GLOBS for p in root.glob(g) if p.is_file()})


def render(doc: Path, root: Path) -> tuple[str, list[str], list[str]]:
    """The document with every marked table regenerated, the names of its tables and the files they read."""
    rel_doc = doc.relative_to(root).as_posix()

    def link(rel: str) -> str:
        return f"[`{rel}`]({Path(os.path.relpath(root / rel, doc.parent)).as_posix()})"

    lines, out, names, read = doc.read_text().split("\n"), [], [], set()
    i = 0
    while i < len(lines):
        m = BEGIN.match(lines[i])
        out.append(lines[i])
        i += 1
        if not m:
            if lines[i - 1].startswith("<!-- table") or lines[i - 1] == END:
                raise TableError(f"{rel_doc}:{i}: a table marker out of place: {lines[i - 1]!r}")
            continue
        name = m.group(1)
        if name not in TABLES:
            raise TableError(f"{rel_doc}:{i}: unknown table {name!r} (bench/tables.py knows {', '.join(TABLES)})")
        start = i
        while i < len(lines) and lines[i] != END:
            if BEGIN.match(lines[i]):
                raise TableError(f"{rel_doc}:{start}: table {name!r} has no {END!r} before the next table")
            i += 1
        if i == len(lines):
            raise TableError(f"{rel_doc}:{start}: table {name!r} has no closing {END!r}")
        src = Sources(root)  # per table, so that an error names the files this table reads
        try:
            out += TABLES[name](src, link)
        except TableError as e:
            raise TableError(f"{e} [table {name!r} in {rel_doc}]") from e
        except (KeyError, IndexError, TypeError, ValueError) as e:
            raise TableError(f"{', '.join(src.read)}: not what table {name!r} in {rel_doc} expects ({e!r})") from e
        read.update(src.read)
        out.append(END)
        names.append(name)
        i += 1
    return "\n".join(out), names, sorted(read)


def inputs(root: Path = ROOT) -> list[str]:
    """The result files the documents' tables are generated from (repository-relative paths)."""
    return sorted({rel for doc in documents(root) for rel in render(doc, root)[2]})


def run(root: Path, check: bool) -> int:
    """Generate every table first (any error leaves every document as it was), then write or compare."""
    rendered, placed = [], set()
    for doc in documents(root):
        new, names, _ = render(doc, root)
        placed.update(names)
        rendered.append((doc, new))
    unplaced = sorted(set(TABLES) - placed)
    if unplaced:
        raise TableError(f"tables placed in no document ({', '.join(DOC_GLOBS)}): {', '.join(unplaced)}")
    stale = []
    for doc, new in rendered:
        old = doc.read_text()
        if new == old:
            continue
        rel = doc.relative_to(root).as_posix()
        if check:
            diff = difflib.unified_diff(old.split("\n"), new.split("\n"), f"{rel} (committed)", f"{rel} (generated)",
                                        lineterm="", n=0)
            stale.append(rel + "\n" + "\n".join(diff))
        else:
            doc.write_text(new)
            print(f"bench/tables.py: rewrote the tables of {rel}")
    if stale:
        print("bench/tables.py --check: these documents differ from their result files "
              "(run `python bench/tables.py` and commit):\n\n" + "\n\n".join(stale), file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="compare only; exit 1 when a table differs from its file")
    p.add_argument("--root", type=Path, default=ROOT, help="repository root (default: this checkout)")
    args = p.parse_args(argv)
    try:
        return run(args.root.resolve(), args.check)
    except TableError as e:
        print(f"bench/tables.py: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
