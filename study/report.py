"""The study's report from its runs' result.json files: report.md, PNG plots and results.json.

What it compares is each run's test bpc from its best-val checkpoint at its trained context (phases.metric).
Differences are paired over seeds (each seed gives every attention the same data order and initial weights),
with t-based 95% intervals and Holm-adjusted p-values over every comparison the report words
(phases.paired_comparisons); a difference is worded as one only where phases.established says so, otherwise
as within noise, or as not established (Holm) where only its unadjusted interval excludes 0. Curves over target
bytes (the same-target context curve) carry a paired bootstrap band over seeds and 64-byte blocks.
"""
from __future__ import annotations

import json
import math
import statistics
from collections import Counter, defaultdict
from pathlib import Path
from typing import NamedTuple

import numpy as np

from data.enwik8 import ENWIK8_SIZE, split_sizes
from lab.cli import fmt
from lab.config import parse_args as parse_train_args
from model.attention import layer_window
from model.diagnostics import QUERIES
from model.variants import VARIANTS
from study.jobs import GRID_PHASES, SAME_SPEED, Protocol, same_speed, speed_ratios
from study.phases import (ALPHA, SOLVED, cell_values, chosen_rates, established, metric, next_rates,
                          paired_comparisons, recall_best, recall_runs, solved, speed_conv, speed_gpu, speeds,
                          sweep_scores)
from study.stats import bootstrap_mean_grouped, fmt_interval, mean_interval, paired

QUALITY_FLOOR_BPC = 2.0  # a model of this size that learned anything is well below it on enwik8
MEMORISING_BPC = 0.02  # a final val bpc this far above the run's best evaluation: it began to memorise
HOLDS = 1.02  # the unseen half "holds" when its bpc is at most this times the trained context's (upper bound)


class ContextUse(NamedTuple):
    """The same target bytes scored with the longest cut within the trained context against the shortest."""
    top: int  # the longest cut
    base: int  # the shortest cut
    diff: float  # bpc at top less bpc at base, mean over seeds
    low: float  # its 95% paired bootstrap band
    high: float
    used: bool  # the band lies below 0: the longer context helps
    words: str


def label(variant: str) -> str:
    return VARIANTS[variant].label


def ci(values: list[float], digits: int = 3) -> str:
    """mean [95% t interval], n — over seeds."""
    values = [v for v in values if v is not None]
    if not values:
        return "–"
    mean, low, high = mean_interval(values)
    if len(values) < 2:
        return f"{mean:.{digits}f} (1 run)"
    return f"{mean:.{digits}f} [{low:.{digits}f}, {high:.{digits}f}]"


def bpc_curve(evaluation: dict, cut: int) -> np.ndarray | None:
    """A run's per-block losses at a same-target cut (windows x blocks, nats), or None where it was not scored."""
    same = (evaluation or {}).get("same_target")
    if not same or cut not in same["cuts"]:
        return None
    return np.asarray(same["block_loss"][same["cuts"].index(cut)], dtype=np.float64)


class Report:
    def __init__(self, protocol: Protocol, results: list[dict], jobs: list, hardware: str, command: str,
                 params: int):
        self.p, self.results, self.jobs = protocol, results, jobs
        self.hardware, self.command, self.params = hardware, command, params
        self.grid = defaultdict(list)  # (variant, conv, seq_len) -> ok grid and added-seed results
        for r in results:
            if r["phase"] in GRID_PHASES and r["status"] == "ok":
                self.grid[r["variant"], r["conv"], r["seq_len"]].append(r)
        self.tests = paired_comparisons(protocol, results)
        self.speed = speeds(protocol, results)  # (variant, conv, seq_len) -> the throughput phase's tokens/s
        self.speed_conv = speed_conv(results)  # the short_conv those were measured with, for every short_conv
        self.speed_gpu = speed_gpu(results)

    def runs(self, v: str, c: int, t: int) -> list[dict]:
        return self.grid.get((v, c, t), [])

    # ------------------------------------------------------------------ statistics

    def test(self, a: tuple, b: tuple) -> dict | None:
        return next((t for t in self.tests if t["a"] == a and t["b"] == b), None)

    @staticmethod
    def words(test: dict, lower: str, higher: str) -> str:
        """The difference b - a in words: `lower` where b is lower beyond noise (Holm-adjusted), `higher` where it
        is higher; else within noise, or not established (Holm) where only the unadjusted interval excludes 0;
        always with its interval."""
        d = test["diff"]
        if d.n < 2:
            return f"not measured ({d.n} paired seed(s))"
        if established(test):
            verdict = lower if d.mean < 0 else higher
        else:
            verdict = "not established (Holm)" if d.excludes_zero else "within noise"
        return f"{verdict}: {d.mean:+.3f} bpc [{d.low:+.3f}, {d.high:+.3f}] (n={d.n}, Holm p = {test['holm']:.3g})"

    def same_target(self, v: str, c: int, t: int, cut: int, base: int) -> tuple[float, float, float, float] | None:
        """For the runs of (v, c, t): (mean bpc at cut, bpc at cut - bpc at base, its 95% bootstrap band), paired
        over seeds and 64-byte blocks of the same target bytes; None without two scored runs' curves."""
        groups, at_cut = [], []
        for r in self.runs(v, c, t):
            x, y = bpc_curve(r.get("evaluation"), cut), bpc_curve(r.get("evaluation"), base)
            if x is not None and y is not None:
                groups.append(((x - y) / math.log(2)).ravel())
                at_cut.append(x.mean() / math.log(2))
        if not groups:
            return None
        low, high = bootstrap_mean_grouped(groups)
        return statistics.fmean(at_cut), statistics.fmean(float(g.mean()) for g in groups), low, high

    def cells(self) -> list[dict]:
        """Each grid cell's test bpc (mean and 95% t interval over its seeds; None where undefined) and tokens/s
        (measured with the short_conv results.json's tokens_per_s_conv names), as results.json records them for the
        docs' table (bench/tables.py, which does no statistics)."""
        p, out = self.p, []
        for v in p.variants:
            for c in p.convs:
                for t in p.seq_lens:
                    values = [m for m in map(metric, self.runs(v, c, t)) if m is not None]
                    out.append({"variant": v, "conv": c, "seq_len": t, "seeds": len(values),
                                "test_bpc": [None if math.isnan(x) else x for x in mean_interval(values)],
                                "tokens_per_s": self.speed.get((v, c, t))})
        return out

    def trained_on(self) -> str:
        """The GPUs the finished runs trained on, with their counts: a resumed study may span machines."""
        gpus = Counter(r.get("gpu") or "not recorded" for r in self.results if r["status"] == "ok")
        return ", ".join(f"{name} ({n} run{'s' if n > 1 else ''})" for name, n in gpus.most_common()) or "none yet"

    def memorising(self) -> list[dict]:
        """Grid runs whose final val bpc is more than MEMORISING_BPC above their best evaluation."""
        return [r for runs in self.grid.values() for r in runs
                if r["val_bpc"] - r["best_val_bpc"] > MEMORISING_BPC]

    # ------------------------------------------------------------------ words

    def reference_table(self) -> list[str]:
        """The study's answer at a glance: every attention's test bpc less the reference's, per short_conv and
        context, established ones in bold; the words below give each interval."""
        p = self.p
        out = [f"Test bpc less {label(p.reference)}'s, paired over seeds (below 0: better); **bold**: established "
               f"(Holm p < {ALPHA} and the 95% interval excludes 0).", "",
               "| attention | short_conv | " + " | ".join(f"{t:,}" for t in p.seq_lens) + " |",
               "| --- | ---: |" + " ---: |" * len(p.seq_lens)]
        for v in [v for v in p.variants if v != p.reference]:
            for c in p.convs:
                cells = []
                for t in p.seq_lens:
                    test = self.test((p.reference, c, t), (v, c, t))
                    d = test["diff"] if test else None
                    cells.append("–" if d is None or d.n < 2 else
                                 f"**{d.mean:+.3f}**" if established(test) else f"{d.mean:+.3f}")
                out.append(f"| {label(v)} | {c} | " + " | ".join(cells) + " |")
        return out + [""]

    def conclusions(self) -> list[str]:
        p, lines = self.p, []
        short, long = min(p.seq_lens), max(p.seq_lens)
        for c in p.convs:
            for t in p.seq_lens:
                parts = [f"{label(v)} {self.words(test, 'lower than ' + p.reference, 'higher than ' + p.reference)}"
                         for v in p.variants if v != p.reference and (test := self.test((p.reference, c, t), (v, c, t)))]
                if parts:
                    lines.append(f"- **{t:,} bytes, short_conv {c}** (test bpc against {label(p.reference)}): "
                                 + "; ".join(parts) + ".")
        if len(p.convs) > 1:
            a, b = min(p.convs), max(p.convs)
            for v in p.variants:
                parts = [f"{t:,}: {self.words(test, 'helps', 'hurts')}" for t in p.seq_lens
                         if (test := self.test((v, a, t), (v, b, t)))]
                lines.append(f"- **short_conv {b} against {a}, {label(v)}**: " + "; ".join(parts) + ".")
        if short != long:
            for v in p.variants:
                for c in p.convs:
                    test = self.test((v, c, short), (v, c, long))
                    lines.append(f"- **{label(v)}, short_conv {c}, trained at {long:,} against {short:,} bytes**: "
                                 + self.words(test, "the longer context is better", "the longer context is worse")
                                 + ".")
        lines += self.context_words()
        return lines

    def context_use(self, v: str, c: int) -> ContextUse | None:
        """Whether (v, c) trained at the longest context uses it, from the same target bytes at the longest cut
        within it against the shortest cut; None unscored."""
        p = self.p
        long = max(p.seq_lens)
        base = min(p.cuts_for(long))
        top = max(c for c in p.cuts_for(long) if c <= long)
        s = self.same_target(v, c, long, top, base)
        if s is None:
            return None
        _, d, low, high = s
        uses = ("uses it: the same bytes score lower" if high < 0 else
                "does not use it beyond noise" if low <= 0 else "scores them worse with more context")
        return ContextUse(top, base, d, low, high, high < 0, uses)

    def context_words(self) -> list[str]:
        """Whether each attention uses its long context: the same target bytes scored with the context cut to
        256 bytes against the longest cut within the trained context; and the unseen half."""
        p, lines = self.p, []
        long = max(p.seq_lens)
        for v in p.variants:
            for c in p.convs:
                use = self.context_use(v, c)
                if use is None:
                    continue
                top, base, d, low, high, _, uses = use
                line = (f"- **{label(v)}, short_conv {c}, trained at {long:,}**: with {top:,} bytes of context "
                        f"instead of {base:,}, it {uses} ({d:+.3f} bpc [{low:+.3f}, {high:+.3f}])")
                unseen = self.same_target(v, c, long, 2 * long, long)
                if unseen is not None:
                    at_long = self.same_target(v, c, long, long, base)
                    ratio = unseen[0] / at_long[0]
                    upper = (at_long[0] + unseen[3]) / at_long[0]
                    word = "holds" if upper <= HOLDS else "degrades"
                    line += (f"; on the unseen half (context {2 * long:,}) it {word}: x{ratio:.2f} "
                             f"({unseen[1]:+.3f} bpc [{unseen[2]:+.3f}, {unseen[3]:+.3f}])")
                lines.append(line + ".")
        return lines

    def limits(self) -> list[str]:
        p = self.p
        short, long = min(p.seq_lens), max(p.seq_lens)
        lines = [f"- Every run trains on {p.epochs:g} epochs of the train split ({p.steps} steps of "
                 f"{p.tokens_per_step:,} tokens), so a {long:,}-byte run sees {max(1, p.tokens_per_step // long):,} "
                 f"sequence(s) a step against {p.tokens_per_step // short:,} at {short:,}: a longer context trades "
                 "independent samples for context. The comparisons hold at this budget, not at convergence."]
        if p.data_path is not None:
            lines.append(f"- A pilot: {p.train_bytes:,} train bytes, not enwik8's {split_sizes(ENWIK8_SIZE)[0]:,}. "
                         "Its bpc is not comparable with published enwik8 results (Transformer-XL's 12 layers, 41M "
                         "parameters: 1.06 on the full data); the same command without --data-path runs the study "
                         "on the full enwik8 with the budget scaled to it.")
        windows = split_sizes(p.train_bytes * 100 // 90)[2] // p.window  # the data's size from its train split's
        if p.test_windows:
            windows = min(windows, p.test_windows)
        lines.append(f"- The same-target curves score the last {p.targets:,} bytes of each {p.window:,}-byte test "
                     f"window: {windows} window(s) here, {windows * p.targets:,} target bytes per run.")
        return lines

    # ------------------------------------------------------------------ tables

    def rate_table(self) -> list[str]:
        p = self.p
        if len(p.lrs) == 1:
            return [f"Every run at peak rate {p.lrs[0]:g} (no sweep).", ""]
        scores, chosen, pending = sweep_scores(p, self.results), chosen_rates(p, self.results), next_rates(p, self.results)
        rates = sorted({lr for tried in scores.values() for lr in tried} | set(p.lrs))
        out = [f"Seed {p.sweep_seed} (not a grid seed), the whole budget; best val bpc per peak rate. A best rate at "
               "the edge of those tried adds the next one beyond it; **edge** marks a choice still there.", "",
               "| variant | short_conv | context | " + " | ".join(f"{lr:g}" for lr in rates) + " | chosen |",
               "| --- | ---: | ---: |" + " ---: |" * (len(rates) + 1)]
        for v in p.variants:
            for c in p.convs:
                for t in p.swept_seq_lens:
                    tried = scores.get((v, c, t), {})
                    pick = chosen.get((v, c, t))
                    edge = pick is not None and len(tried) > 1 and pick in (min(tried), max(tried))
                    note = "–" if pick is None else f"{pick:g}" + (" **edge**" if edge else "")
                    if (v, c, t) in pending:
                        note += " (extending)"
                    out.append(f"| {label(v)} | {c} | {t:,} | " + " | ".join(fmt(tried.get(lr), ".3f") for lr in rates)
                               + f" | {note} |")
        return out + ["", "A context between the swept ones takes the rate of the nearer (log scale).", ""]

    def main_table(self) -> list[str]:
        p = self.p
        conv = (f", with short_conv {self.speed_conv} for every short_conv: the convolution costs the same under "
                "every attention" if len(p.convs) > 1 and self.speed_conv is not None else "")
        out = ["Mean [95% t interval] over seeds. test: the best-val checkpoint on the test split in windows of the "
               "trained context; sliding: every test byte once with at least 3/4 of the context before it (the "
               "literature's evaluation); best val: the lowest periodic val bpc; final val and train: the end of "
               f"the run (train over its last 5% of steps). tokens/s: the throughput phase, alone on one "
               f"{self.speed_gpu or 'GPU'} (compiled{conv}).", "",
               "| variant | short_conv | context | seeds | test bpc | sliding test bpc | best val | final val | train | "
               "tokens/s |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for v in p.variants:
            for c in p.convs:
                for t in p.seq_lens:
                    runs = self.runs(v, c, t)
                    sliding = [(r.get("evaluation") or {}).get("sliding", {}).get("bpc") for r in runs]
                    out.append(f"| {label(v)} | {c} | {t:,} | {len(runs)} | {ci([metric(r) for r in runs])} | "
                               f"{ci(sliding)} | {ci([r['best_val_bpc'] for r in runs])} | "
                               f"{ci([r['val_bpc'] for r in runs])} | {ci([r['train_bpc'] for r in runs])} | "
                               f"{fmt(self.speed.get((v, c, t)), ',.0f')} |")
        return out + [""]

    def test_table(self) -> list[str]:
        out = ["Test bpc of b - a, paired over the seeds both have; p: the paired t-test; Holm: adjusted over all "
               f"{len(self.tests)} comparisons. A difference is worded above only where Holm p < {ALPHA} and the "
               "interval excludes 0.", "", "| comparison (b - a) | n | difference [95%] | p | Holm p |",
               "| --- | ---: | ---: | ---: | ---: |"]
        for t in self.tests:
            d = t["diff"]
            out.append(f"| {t['what']} | {d.n} | {fmt(d.mean, '+.3f')} [{fmt(d.low, '+.3f')}, {fmt(d.high, '+.3f')}] "
                       f"| {fmt(d.p, '.3g')} | {fmt(t['holm'], '.3g')} |")
        return out + [""]

    def context_table(self) -> list[str]:
        p = self.p
        out = [f"The same {p.targets:,} target bytes of each {p.window:,}-byte test window, scored with the context "
               "cut to each length (each byte sees between 3/4 of the cut and the cut), from the best-val "
               "checkpoint; mean over seeds, and in brackets the difference from the shortest cut with its 95% "
               "paired bootstrap band (seeds, then 64-byte blocks). Cuts past the trained context are the unseen "
               "part (RoPE extends).", ""]
        cuts = list(p.cuts_for(max(p.seq_lens)))
        out += ["| variant | short_conv | trained at | " + " | ".join(f"{c:,}" for c in cuts) + " |",
                "| --- | ---: | ---: |" + " --- |" * len(cuts)]
        for v in p.variants:
            for c in p.convs:
                for t in p.seq_lens:
                    base = min(p.cuts_for(t))
                    cells = []
                    for cut in cuts:
                        s = self.same_target(v, c, t, cut, base) if cut in p.cuts_for(t) else None
                        cells.append("–" if s is None else f"{s[0]:.3f}" if cut == base else
                                     f"{s[0]:.3f} ({s[1]:+.3f} [{s[2]:+.3f}, {s[3]:+.3f}])")
                    out.append(f"| {label(v)} | {c} | {t:,} | " + " | ".join(cells) + " |")
        return out + [""]

    def compute_table(self) -> list[str]:
        p = self.p
        runs = defaultdict(list)
        for r in self.results:
            if r["phase"] == "compute" and r["status"] == "ok" and metric(r) is not None:
                runs[r["variant"], r["conv"], r["seq_len"]].append(r)
        # The throughput phase measures one short_conv for all, so a (variant, context) is listed once.
        same = sorted({(p.variants.index(v), t, ratio) for (v, _, t), ratio in
                       speed_ratios(p, self.speed).items() if same_speed(ratio)})
        if not runs and not same:
            return []
        out = ["## Equal compute", "",
               f"Each attention's steps scaled by its tokens/s over {label(p.reference)}'s at that context (the "
               f"throughput phase), so every run trains as long as {label(p.reference)}'s equal-token run; the "
               f"difference is paired with {label(p.reference)}'s grid runs of the same seeds.", ""]
        if same:
            out += [f"Within {SAME_SPEED:.0%} of {label(p.reference)}'s tokens/s, so not run again (the grid's "
                    "comparison stands for equal compute): " + ", ".join(f"{label(p.variants[i])} at {t:,} "
                                                                         f"(x{ratio:.3f})" for i, t, ratio in same)
                    + ".", ""]
        if runs:
            out += ["| variant | short_conv | context | steps | test bpc | "
                    f"difference from {label(p.reference)} [95%] |",
                    "| --- | ---: | ---: | ---: | ---: | ---: |"]
        for (v, c, t), rs in sorted(runs.items(), key=lambda kv: (p.variants.index(kv[0][0]), kv[0][1], kv[0][2])):
            diff = paired(cell_values(self.results, p.reference, c, t), {r["seed"]: metric(r) for r in rs})
            out.append(f"| {label(v)} | {c} | {t:,} | {rs[0]['steps']} | {ci([metric(r) for r in rs])} | "
                       f"{fmt_interval(diff)} |")
        return out + [""]

    def block_groups(self, v: str) -> list[tuple[str, list[int], int]]:
        """A variant's blocks by the attention they run, as (what, layers, window): one group, or for Based's
        hybrid its full-context blocks and its sliding-window softmax ones (model.attention.layer_window), whose
        weights differ in kind and would mislead averaged together."""
        cfg, _ = parse_train_args(["--config", self.p.config, *VARIANTS[v].flags(), *self.p.extra])
        groups = defaultdict(list)
        for layer in range(cfg.n_layer):
            groups[layer_window(cfg, layer)].append(layer)
        if len(groups) == 1:
            return [("", list(range(cfg.n_layer)), 0)]
        return [(f"its {cfg.attention} blocks" if w == 0 else f"its {w}-byte sliding-window softmax blocks",
                 layers, w) for w, layers in sorted(groups.items())]

    def concentration(self, v: str, c: int, t: int) -> list[tuple[str, int, dict]]:
        """(what, window, {max_weight, entropy, entropy_uniform}) per block group of v (block_groups), means over its
        layers' heads and the runs' seeds; [] without diagnostics. The logs keep only the model-wide mean of the
        uniform entropy: a windowed block's is log(window) where every query measured (a sequence's last QUERIES)
        sees a whole window, and the full-context blocks' is what remains of the mean; None where not."""
        stats = [r["attention"] for r in self.runs(v, c, t) if "max_weight_heads" in r.get("attention", {})]
        if not stats:
            return []
        groups = self.block_groups(v)
        layers = sum(len(g[1]) for g in groups)
        windowed = sum(len(g[1]) * math.log(g[2]) for g in groups if g[2])
        full = sum(len(g[1]) for g in groups if not g[2])
        whole_windows = t - QUERIES + 1 >= max(g[2] for g in groups)  # the first row measured sees a window
        out = []
        for what, group, window in groups:
            def mean(key: str) -> float:
                return statistics.fmean(h for s in stats for layer in group for h in s[key][layer])
            uniform = (None if windowed and not whole_windows else math.log(window) if window else
                       statistics.fmean((layers * s["entropy_uniform"] - windowed) / full for s in stats))
            out.append((what, window, {"max_weight": mean("max_weight_heads"), "entropy": mean("entropy_heads"),
                                       "entropy_uniform": uniform}))
        return out

    def concentration_table(self) -> list[str]:
        p = self.p
        rows = [f"| {label(v)}{', ' + what if what else ''} | {c} | {t:,} | "
                + " | ".join(fmt(stats[k], ".3f") for k in CONCENTRATION) + " |"
                for v in p.variants for c in p.convs for t in p.seq_lens
                for what, _, stats in self.concentration(v, c, t)]
        if not rows:
            return []
        return ["## How concentrated each attention's weights are", "",
                "At the final evaluation, over the last queries of a val window (model/diagnostics.py): each head's "
                "largest weight in a row and its weights' entropy (nats), averaged over queries, then over heads and "
                "layers (and seeds); uniform: the entropy of equal weights on every visible key. A hybrid's "
                "blocks are shown by the attention they run.", "",
                "| variant | short_conv | context | " + " | ".join(CONCENTRATION.values()) + " |",
                "| --- | ---: | ---: |" + " ---: |" * len(CONCENTRATION), *rows, ""]

    def fastmax_words(self) -> list[str]:
        """Issue 57's question of fastmax at long context: which of the studied fastmax variants (a short
        convolution, Based's sliding-window hybrid) uses the long context, by the same-target curve, beside how
        far its fastmax blocks' weights concentrate. In the hybrid only the fastmax blocks see past the window
        (shorter than the shortest cut), so a gain from a longer cut is theirs."""
        p = self.p
        long = max(p.seq_lens)
        family = [v for v in p.variants if dict(VARIANTS[v].settings).get("attention") == "fastmax"]
        parts, using = [], []
        for v in family:
            for c in p.convs:
                use = self.context_use(v, c)
                blocks = next((stats for _, window, stats in self.concentration(v, c, long) if not window), None)
                if use is None or blocks is None:
                    continue
                top, base, d, low, high, _, uses = use
                uniform = blocks["entropy_uniform"]
                parts.append(f"{label(v)}, short_conv {c}: {uses} ({d:+.3f} bpc [{low:+.3f}, {high:+.3f}] from "
                             f"{base:,} to {top:,} bytes), its fastmax weights' largest {blocks['max_weight']:.3f}"
                             + (f" (equal weights: {math.exp(-uniform):.1e})" if uniform is not None else ""))
                if use.used:
                    using.append(f"{label(v)} with short_conv {c}")
        if not parts:
            return []
        verdict = (f"Of these, {' and '.join(using)} use{'s' if len(using) == 1 else ''} the long context." if using
                   else "None of these lets fastmax use the long context by this measure.")
        return ["## Fastmax at long context", "",
                f"Trained at {long:,} bytes, the same target bytes scored with the context cut from the shortest to "
                "the longest cut within it (the table above), and how far the fastmax blocks' weights concentrate "
                "(the table below): " + "; ".join(parts) + ".", "", verdict, ""]

    def recall_table(self) -> list[str]:
        p = self.p
        if not p.recall_cells:
            return []
        best = recall_best(p, self.results)
        t0, n0 = p.recall_cells[0]
        cell = f"the easiest cell ({t0:,} bytes, {n0} pairs)"
        easiest = recall_runs(p, self.results).get((p.reference, t0, n0), {})
        failing = {lr for lr, runs in easiest.items() if solved(runs) < len(runs)}  # cannot solve it every seed
        if (p.reference, t0, n0) in best or len(failing) == len(p.recall_lrs):
            _, runs = best.get((p.reference, t0, n0), (None, []))
            if solved(runs) == len(p.seeds):
                verdict = (f"{label(p.reference)} solved {cell} in every seed at its best rate: the probe can tell "
                           "the attentions apart.")
            else:
                verdict = (f"**The probe is invalid**: at no rate did {label(p.reference)} solve {cell} in every "
                           "seed, so a failure here does not tell the attentions apart.")
        else:  # an incomplete study's report
            finished = sum(map(len, easiest.values()))
            verdict = (f"Not settled yet: {finished} of {len(p.recall_lrs) * len(p.seeds)} of "
                       f"{label(p.reference)}'s runs of {cell} have finished; the probe tells the attentions apart "
                       "only if it solves it in every seed at some rate.")
        edges = (min(p.recall_lrs), max(p.recall_lrs))
        out = ["## Associative recall", "",
               f"Multi-query associative recall (`--task recall`, `{p.recall_config}`), Zoology's protocol: every "
               f"cell and seed at each rate of {', '.join(f'{lr:g}' for lr in p.recall_lrs)}, every run ending once "
               f"its val accuracy reaches {p.stop_accuracy:g}, or at {p.recall_steps} steps. Cells: the seeds that "
               f"solved it (test accuracy >= {SOLVED}) at the cell's best rate (in parentheses: the most seeds, then "
               "the fewest steps; **edge**: the smallest or largest rate tried, a sweep not extended); chance is "
               "1/128.",
               "", verdict, "",
               "| variant | " + " | ".join(f"{t:,} bytes, {n} pairs" for t, n in p.recall_cells) + " |",
               "| --- |" + " ---: |" * len(p.recall_cells)]
        for v in p.variants:
            cells = []
            for t, n in p.recall_cells:
                if (v, t, n) not in best:
                    cells.append("–")
                    continue
                lr, runs = best[v, t, n]
                edge = ", **edge**" if lr in edges else ""
                cells.append(f"{solved(runs)}/{len(runs)} ({lr:g}{edge})" if solved(runs) else f"0/{len(runs)}")
            out.append(f"| {label(v)} | " + " | ".join(cells) + " |")
        return out + [""]

    # ------------------------------------------------------------------ plots

    def plots(self, out: Path) -> list[str]:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        p, files = self.p, []
        colors = {v: f"C{i}" for i, v in enumerate(VARIANTS)}
        styles = {c: s for c, s in zip(p.convs, ("-", "--", ":", "-."))}

        def save(fig, name, title):
            fig.suptitle(title)
            fig.tight_layout()
            fig.savefig(out / name, dpi=110)
            plt.close(fig)
            files.append(name)

        fig, ax = plt.subplots(figsize=(7, 4.5))
        for v in p.variants:
            for c in p.convs:
                stats = [(t, *mean_interval([metric(r) for r in self.runs(v, c, t)])) for t in p.seq_lens
                         if self.runs(v, c, t)]
                if stats:
                    t, m, lo, hi = zip(*stats)
                    err = [[a - b if not math.isnan(b) else 0 for a, b in zip(m, lo)],
                           [b - a if not math.isnan(b) else 0 for a, b in zip(m, hi)]]
                    ax.errorbar(t, m, yerr=err, color=colors[v], linestyle=styles[c], marker="o", capsize=3,
                                label=f"{label(v)}, conv {c}")
        ax.set_xscale("log", base=2)
        ax.set_xticks(p.seq_lens, [f"{t:,}" for t in p.seq_lens])
        ax.minorticks_off()
        ax.set_xlabel("training context (bytes)")
        ax.set_ylabel("test bpc, best-val checkpoint (lower is better)")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
        save(fig, "test_bpc_by_context.png", f"Test bpc against context (mean, 95% t interval over seeds)\n"
                                             f"{p.epochs:g} epochs x {p.train_bytes:,} bytes per run")

        # The change from the shortest cut, not the bpc itself: the attentions' levels differ by up to 1.5 bpc
        # (the main table has them), their gains from context by hundredths, which a shared level axis hides.
        long = max(p.seq_lens)
        base = min(p.cuts_for(long))
        fig, axes = plt.subplots(1, len(p.convs), figsize=(5.5 * len(p.convs), 4.3), squeeze=False)
        for ax, c in zip(axes[0], p.convs):
            for v in p.variants:
                pts = [(cut, s) for cut in p.cuts_for(long) if (s := self.same_target(v, c, long, cut, base))]
                if pts:
                    cut, s = zip(*pts)
                    ax.plot(cut, [x[1] for x in s], color=colors[v], marker="o", label=label(v))
                    ax.fill_between(cut, [x[2] for x in s], [x[3] for x in s], color=colors[v], alpha=0.2)
            ax.axhline(0, color="black", linewidth=0.8)
            ax.axvline(long, color="grey", linewidth=0.8)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("context cut (bytes); right of the line: unseen")
            ax.set_title(f"short_conv {c}, trained at {long:,}")
            ax.grid(alpha=0.3)
        axes[0][0].set_ylabel(f"bpc less the {base:,}-byte cut's, same target bytes\n(below 0: the context helps; "
                              "band: 95% paired bootstrap)")
        if axes[0][0].get_legend_handles_labels()[0]:  # the context line alone takes no legend
            axes[0][0].legend(fontsize=7)
        save(fig, "same_target_context.png", "Does more context help on the same bytes?")

        if self.speed:
            fig, ax = plt.subplots(figsize=(6.5, 4.3))
            for v in p.variants:
                pts = [(t, self.speed[v, p.convs[-1], t]) for t in p.seq_lens if (v, p.convs[-1], t) in self.speed]
                if pts:
                    ax.plot(*zip(*pts), color=colors[v], marker="o", label=label(v))
            ax.set_xscale("log", base=2)
            ax.set_xticks(p.seq_lens, [f"{t:,}" for t in p.seq_lens])
            ax.minorticks_off()
            ax.set_xlabel("training context (bytes)")
            ax.set_ylabel("training tokens/s")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
            save(fig, "throughput.png", f"Training throughput ({p.tokens_per_step:,} tokens a step, compiled)")
        return files

    # ------------------------------------------------------------------ the document

    def write(self, out: Path) -> None:
        out.mkdir(parents=True, exist_ok=True)
        p = self.p
        data = (f"`{p.data_path}`: its train split is {p.train_bytes:,} bytes (90/5/5 split)" if p.data_path else
                "enwik8, the full 100 MB, downloaded and verified (split 90M/5M/5M)")
        pilot = ([f"**A pilot on a local copy of {p.train_bytes * 100 // 90:,} bytes**, not the full enwik8: the "
                  "same `make compare` on a machine with internet runs it on the full file, with each run's budget "
                  f"({p.epochs:g} epochs) scaled to its 90M train bytes.", ""] if p.data_path else [])
        missing = [j.name for j in self.jobs if not any(r["name"] == j.name and r["status"] == "ok" for r in self.results)]
        failed = [r for r in self.results if r["status"] != "ok"]
        # A cell without runs yet is incomplete, not below the floor (NaN >= floor is False).
        floor = [f"{label(v)} (short_conv {c})" for v in p.variants for c in p.convs
                 if mean_interval([metric(r) for r in self.runs(v, c, min(p.seq_lens))])[0] >= QUALITY_FLOOR_BPC]
        lines = ["# Softmax, cosine-sim and fastmax attention as the context grows", "",
                 f"Written by `{self.command}` on {self.hardware}; the runs trained on {self.trained_on()}.", "",
                 *pilot,
                 f"- Data: {data}.",
                 f"- Model: `{p.config}`, {self.params / 1e6:.2f}M parameters; every enwik8 run {p.epochs:g} epochs "
                 f"= {p.steps} steps of {p.tokens_per_step:,} tokens (batch = tokens / context), warmup over the "
                 f"first tenth, cosine decay to a tenth of the peak rate, {p.evals} evaluations, the best-val "
                 "checkpoint kept; bf16 autocast on GPUs.",
                 f"- Factors: attention ({', '.join(f'`{v}`' for v in p.variants)}) x short_conv "
                 f"({', '.join(map(str, p.convs))}) x context ({', '.join(f'{t:,}' for t in p.seq_lens)} bytes) x "
                 f"seeds ({', '.join(map(str, p.seeds))}, up to {p.max_seeds} where a difference is not settled: "
                 "under 3 standard errors, or not established after Holm's correction); a seed gives every "
                 "attention the same data order and initial weights.",
                 f"- wandb group `{p.wandb_group}` (mode {p.wandb_mode}); every run's result.json is in results.json.",
                 ""]
        if floor:
            lines += [f"**Quality floor not met:** {', '.join(floor)} did not reach test bpc < {QUALITY_FLOOR_BPC} at "
                      "the shortest context: these models have not learned enough for their comparison to mean much.",
                      ""]
        if missing:
            lines += [f"**Incomplete:** {len(missing)} of {len(self.jobs)} planned runs have no result yet (the same "
                      "`make compare` goes on; later phases are planned from these): " + ", ".join(missing[:8])
                      + (" ..." if len(missing) > 8 else ""), ""]
        memo = self.memorising()
        lines += ["## What the data says", "", *self.reference_table(), *self.conclusions(), "",
                  "## What it does not show", "", *self.limits(), "", "## Memorising", "",
                  (f"{len(memo)} grid run(s) ended more than {MEMORISING_BPC} bpc above their best evaluation (they "
                   "began to memorise the train split): " + ", ".join(f"`{r['name']}` ({r['best_val_bpc']:.3f} at "
                   f"step {r['best_step']}, {r['val_bpc']:.3f} at the end)" for r in memo[:6])
                   + ". Every comparison uses the best-val checkpoint." if memo else
                   f"No grid run ended more than {MEMORISING_BPC} bpc above its best evaluation."), "",
                  "## Learning rates", "", *self.rate_table(), "## Test bpc per attention, short_conv and context",
                  "", *self.main_table(), "## Paired differences", "", *self.test_table(),
                  "## Does each attention use its context?", "", *self.context_table(), *self.compute_table(),
                  *self.fastmax_words(), *self.concentration_table(), *self.recall_table()]
        for name in self.plots(out):
            lines += [f"![{name[:-4].replace('_', ' ')}]({name})", ""]
        if failed:
            lines += ["## Runs that did not finish", "", *[f"- `{r['name']}`: {r['status']}" for r in failed], ""]
        lines += ["## Commands", "", "```bash", self.command,
                  *[" ".join(c) for r in self.results[:1] for c in r["commands"]], "# ... every run's: results.json",
                  "```", ""]
        (out / "report.md").write_text("\n".join(lines))
        (out / "results.json").write_text(json.dumps(
            {"command": self.command, "hardware": self.hardware, "protocol": p.record(), "planned": len(self.jobs),
             "missing": len(missing), "trained_on": self.trained_on(), "cells": self.cells(),
             "tokens_per_s_conv": self.speed_conv, "tokens_per_s_gpu": self.speed_gpu,
             "runs": self.results}, indent=1) + "\n")


# The concentration diagnostics the report shows (the keys train.py logs as val/attn/<key>): key -> header.
CONCENTRATION = {"max_weight": "largest weight", "entropy": "entropy", "entropy_uniform": "uniform"}
