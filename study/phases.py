"""The study's phases in order, each decided from the results of those before it (study/jobs.py says what each
phase is). run_study is what compare.py runs; the decisions are plain functions of the results, so tests
drive them on made-up results.
"""
from __future__ import annotations

import json
from pathlib import Path

from study.jobs import (GRID_PHASES, MAX_EXTENSIONS, Job, Protocol, bracket, compute_jobs, grid_jobs, lr_table,
                        recall_jobs, sweep_jobs, throughput_jobs)
from study.stats import holm, paired

ALPHA = 0.05  # the family-wise error rate of the comparisons the report words (Holm)
SOLVED = 0.95  # recall test accuracy from which a run counts as having solved its cell (chance is 1/128)


def collect(runs_dir: Path, jobs: list[Job]) -> list[dict]:
    """The results of these jobs found in runs_dir. Only those: a folder may hold runs of an earlier plan (another
    rate before the sweep was extended, a calibration), which must not join a cell they do not belong to."""
    names = {j.name for j in jobs}
    return [r for path in sorted(runs_dir.glob("*/result.json")) if (r := json.loads(path.read_text()))["name"] in names]


def ok(results: list[dict], phase: str) -> list[dict]:
    return [r for r in results if r["phase"] == phase and r["status"] == "ok"]


# ----------------------------------------------------------------------------- rates

def sweep_scores(p: Protocol, results: list[dict]) -> dict:
    """(variant, conv, swept seq_len) -> {rate: best val bpc} of the sweep's finished runs."""
    scores = {}
    for r in ok(results, "sweep"):
        scores.setdefault((r["variant"], r["conv"], r["seq_len"]), {})[r["lr"]] = r["best_val_bpc"]
    return scores


def next_rates(p: Protocol, results: list[dict]) -> dict:
    """(variant, conv, swept seq_len) -> the rates its sweep runs next: those run so far and one beyond the edge
    where the best lies at it and fewer than MAX_EXTENSIONS rates were added; cells already bracketed (or out
    of extensions) are left out."""
    more = {}
    for key, tried in sweep_scores(p, results).items():
        if len(tried) < len(p.lrs):  # the cell's first rates have not all finished
            continue
        rate = bracket(tried)
        if rate is not None and len(tried) < len(p.lrs) + MAX_EXTENSIONS:
            more[key] = sorted(tried) + [rate]
    return more


def chosen_rates(p: Protocol, results: list[dict]) -> dict:
    """(variant, conv, swept seq_len) -> the rate of the lowest best-val bpc, for every cell whose sweep is done
    (the protocol's one rate when there is no sweep)."""
    keys = [(v, c, t) for v in p.variants for c in p.convs for t in p.swept_seq_lens]
    if len(p.lrs) == 1:
        return {key: p.lrs[0] for key in keys}
    scores = sweep_scores(p, results)
    return {key: min(scores[key], key=scores[key].get) for key in keys
            if len(scores.get(key, {})) >= len(p.lrs) and key not in next_rates(p, results)}


# ----------------------------------------------------------------------------- comparisons and seeds

def metric(r: dict) -> float | None:
    """What the study compares: the test bpc of a run's best-val checkpoint at its trained context."""
    return (r.get("evaluation") or {}).get("bpc")


def cell_values(results: list[dict], variant: str, conv: int, seq_len: int) -> dict[int, float]:
    """seed -> metric of the cell's finished grid (and added-seed) runs."""
    return {r["seed"]: metric(r) for r in results
            if r["phase"] in GRID_PHASES and r["status"] == "ok" and metric(r) is not None
            and (r["variant"], r["conv"], r["seq_len"]) == (variant, conv, seq_len)}


def comparisons(p: Protocol) -> list[tuple[str, tuple, tuple]]:
    """The comparisons the report words, as (what, cell a, cell b), the difference being b - a: each attention
    against the reference at every context and short_conv; the short convolution's effect per attention and
    context; and the longest context against the shortest per attention and short_conv."""
    out = []
    short, long = min(p.seq_lens), max(p.seq_lens)
    for c in p.convs:
        for t in p.seq_lens:
            out += [(f"{v} - {p.reference}, conv {c}, {t:,}", (p.reference, c, t), (v, c, t))
                    for v in p.variants if v != p.reference]
    if len(p.convs) > 1:
        a, b = min(p.convs), max(p.convs)
        out += [(f"{v}: conv {b} - conv {a}, {t:,}", (v, a, t), (v, b, t)) for v in p.variants for t in p.seq_lens]
    if short != long:
        out += [(f"{v}, conv {c}: {long:,} - {short:,}", (v, c, short), (v, c, long))
                for v in p.variants for c in p.convs]
    return out


def paired_comparisons(p: Protocol, results: list[dict]) -> list[dict]:
    """Every comparison the report words: {what, a, b, diff (the paired difference b - a over seeds), holm (its
    p-value adjusted over all of them)}."""
    tests = [{"what": what, "a": a, "b": b, "diff": paired(cell_values(results, *a), cell_values(results, *b))}
             for what, a, b in comparisons(p)]
    for test, adjusted in zip(tests, holm([t["diff"].p for t in tests])):
        test["holm"] = adjusted
    return tests


def established(test: dict) -> bool:
    """Whether the report may word a comparison as a difference: its Holm-adjusted p under ALPHA and its
    interval clear of 0."""
    return test["holm"] < ALPHA and test["diff"].excludes_zero


def cells_needing_seeds(p: Protocol, results: list[dict]) -> set[tuple]:
    """The cells of every comparison with fewer than max_seeds seeds that the seeds so far do not settle: under
    3 standard errors, or not established once every comparison counts. (Three seeds settle almost nothing:
    with 2 degrees of freedom Holm over 38 comparisons asks the first for t > 27, where five seeds ask for t > 8.)"""
    need = set()
    for test in paired_comparisons(p, results):
        diff = test["diff"]
        if diff.n < p.max_seeds and (diff.under(3.0) or not established(test)):
            need |= {test["a"], test["b"]}
    return need


def extra_seeds(p: Protocol) -> tuple[int, ...]:
    """The seeds after the grid's, up to max_seeds in all."""
    return tuple(range(max(p.seeds) + 1, max(p.seeds) + 1 + max(0, p.max_seeds - len(p.seeds))))


# ----------------------------------------------------------------------------- speeds and recall

def speeds(p: Protocol, results: list[dict]) -> dict:
    """(variant, conv, seq_len) -> training tokens/s measured by the throughput phase (one short_conv measured:
    the convolution costs the same under every attention, so its ratio holds for all)."""
    out = {}
    for r in ok(results, "throughput"):
        for row in r["throughput"]["results"]:
            if row["ok"]:
                out.update({(row["variant"], c, row["seq_len"]): row["tokens_per_s"] for c in p.convs})
    return out


def speed_conv(results: list[dict]) -> int | None:
    """The short_conv the throughput phase measured every short_conv's tokens/s with (throughput_jobs); None before
    it has run."""
    return max((r["conv"] for r in ok(results, "throughput")), default=None)


def speed_gpu(results: list[dict]) -> str | None:
    """The GPU(s) the throughput phase measured on, as its throughput.json names them; None before it has run."""
    return ", ".join(sorted({r["throughput"]["hardware"] for r in ok(results, "throughput")})) or None


def recall_runs(p: Protocol, results: list[dict]) -> dict[tuple[str, int, int], dict[float, list[dict]]]:
    """(variant, length, pairs) -> rate -> the finished recall runs of the protocol's seeds at it."""
    runs: dict = {}
    for r in ok(results, "recall"):
        if r["seed"] in p.seeds and r["lr"] in p.recall_lrs:
            runs.setdefault((r["variant"], r["seq_len"], r["pairs"]), {}).setdefault(r["lr"], []).append(r)
    return runs


def recall_best(p: Protocol, results: list[dict]) -> dict[tuple[str, int, int], tuple[float, list[dict]]]:
    """(variant, length, pairs) -> (its rate, the runs at it) for each recall cell whose every rate has run every
    seed: the rate that solved the cell in the most seeds, then in the fewest steps over them (a run that never
    solves it runs to the cap), then the smaller rate. Zoology reports each cell at its best rate: a rate chosen
    on one cell does not carry to another (a rate that solves the easiest cell fastest may never learn the
    hardest within the cap, where a smaller one does)."""
    out = {}
    for cell, by_lr in recall_runs(p, results).items():
        if len(by_lr) == len(p.recall_lrs) and all(len(rs) == len(p.seeds) for rs in by_lr.values()):
            lr = min(by_lr, key=lambda lr: (-solved(by_lr[lr]), sum(r["steps"] for r in by_lr[lr]), lr))
            out[cell] = lr, by_lr[lr]
    return out


def solved(runs: list[dict]) -> int:
    """How many of these recall runs solved their cell."""
    return sum(r["test_accuracy"] >= SOLVED for r in runs)


# ----------------------------------------------------------------------------- the study

def run_study(p: Protocol, runner, out_dir: str) -> tuple[list[Job], bool]:
    """Every phase in turn on runner (study.runner.Runner: run(jobs) -> all done), each from the results of the
    last. Returns (every job planned, whether all finished); it stops at the first phase left unfinished (a time
    limit): the same call later goes on from the results on disk."""
    runs_dir = Path(out_dir)
    planned: list[Job] = []

    def run(jobs: list[Job]) -> bool:
        planned.extend(j for j in jobs if j not in planned)
        return runner.run(jobs)

    def results() -> list[dict]:
        return collect(runs_dir, planned)

    if not run(sweep_jobs(p, out_dir)):
        return planned, False
    while more := next_rates(p, results()):
        if not run(sweep_jobs(p, out_dir, more)):
            return planned, False
    lrs = lr_table(p, chosen_rates(p, results()))
    if not run(grid_jobs(p, out_dir, lrs)):
        return planned, False
    need = cells_needing_seeds(p, results())
    if need and not run(grid_jobs(p, out_dir, lrs, seeds=extra_seeds(p), cells=need)):
        return planned, False
    if p.compute:
        if not run(throughput_jobs(p, out_dir)):
            return planned, False
        if not run(compute_jobs(p, out_dir, lrs, speeds(p, results()))):
            return planned, False
    return planned, run(recall_jobs(p, out_dir))
