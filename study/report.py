"""The study's report from its runs' result.json files: report.md, PNG plots and results.json.

Numbers are means over seeds with their sample standard deviation (n - 1). A difference is called supported
when it exceeds twice its standard error (the seeds' spread over sqrt(n), both sides together), which is
about a 95% test under a normal model with so few seeds, and said to be within noise otherwise.
"""
from __future__ import annotations

import itertools
import json
import math
import statistics
from collections import defaultdict
from pathlib import Path

from data.enwik8 import ENWIK8_SIZE, split_sizes
from model.variants import VARIANTS

QUALITY_FLOOR_BPC = 2.0  # a model of this size that learned anything is well below it on enwik8
# Extrapolation words: the bpc at twice the context over the bpc at the trained context.
HOLDS, DEGRADES = 1.02, 1.25
SOLVED = 0.9  # recall accuracy from which a run counts as having learned the task (chance is 1/128)


def collect(runs_dir: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(runs_dir.glob("*/result.json"))]


def spread(values: list[float]) -> tuple[float, float, int]:
    """(mean, sample std, n); std is 0 for a single value."""
    values = [v for v in values if v is not None]
    if not values:
        return math.nan, math.nan, 0
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0, len(values)


def pm(values: list[float], digits: int = 3) -> str:
    mean, std, n = spread(values)
    if n == 0:
        return "–"
    return f"{mean:.{digits}f} ± {std:.{digits}f}" if n > 1 else f"{mean:.{digits}f} (1 run)"


def differs(a: list[float], b: list[float]) -> tuple[float, float]:
    """(mean(b) - mean(a), its standard error)."""
    (ma, sa, na), (mb, sb, nb) = spread(a), spread(b)
    return mb - ma, math.sqrt(sa * sa / max(na, 1) + sb * sb / max(nb, 1))


def chosen_lrs(results: list[dict], variants, lrs) -> dict[str, float]:
    """Per variant, the sweep's rate with the lowest final val bpc (the only rate when there is no sweep)."""
    if len(lrs) == 1:
        return {v: lrs[0] for v in variants}
    best = {}
    for v in variants:
        runs = [r for r in results if r["phase"] == "sweep" and r["variant"] == v and r["status"] == "ok"]
        if len(runs) == len(lrs):
            best[v] = min(runs, key=lambda r: r["val_bpc"])["lr"]
    return best


def shared_legend(axes) -> None:
    """One legend, on the first plot, of every line the plots drew: in a study still running, the first
    plot's cell may have no runs yet while the others have."""
    lines = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            lines.setdefault(label, handle)
    if lines:
        axes[0].legend(list(lines.values()), list(lines), fontsize=8)


def mean_curve(curves: list[list]) -> list[tuple[int, float, float]]:
    """[(position, mean bpc, std)] over runs whose curves share positions."""
    by_pos = defaultdict(list)
    for curve in curves:
        for pos, bpc in curve:
            by_pos[pos].append(bpc)
    return [(pos, *spread(v)[:2]) for pos, v in sorted(by_pos.items())]


class Report:
    def __init__(self, protocol, results: list[dict], jobs: list, hardware: str, command: str, params: int):
        self.p, self.results, self.jobs = protocol, results, jobs
        self.hardware, self.command, self.params = hardware, command, params
        self.ok = [r for r in results if r["status"] == "ok"]
        self.grid = defaultdict(list)  # (variant, seq_len) -> ok grid results
        self.recall = defaultdict(list)  # (variant, seq_len, pairs) -> test accuracies, one per seed
        for r in self.ok:
            if r["phase"] == "grid":
                self.grid[r["variant"], r["seq_len"]].append(r)
            elif r["phase"] == "recall" and "test_accuracy" in r:
                self.recall[r["variant"], r["seq_len"], r["pairs"]].append(r["test_accuracy"])

    def cell(self, variant: str, seq_len: int, key: str) -> list:
        return [r.get(key) for r in self.grid.get((variant, seq_len), [])]

    # ------------------------------------------------------------------ words

    def conclusions(self) -> list[str]:
        p, lines = self.p, []
        short, long = min(p.seq_lens), max(p.seq_lens)
        for v in p.variants:
            label = VARIANTS[v].label
            a, b = self.cell(v, short, "val_bpc"), self.cell(v, long, "val_bpc")
            if len([x for x in a if x is not None]) < 2 or len([x for x in b if x is not None]) < 2:
                lines.append(f"- **{label}**: too few finished seeds at {short:,} and {long:,} to say.")
                continue
            d, se = differs(a, b)
            if d < -2 * se:
                verdict = (f"a longer context helps: val bpc falls by {-d:.3f} from {short:,} to {long:,} bytes "
                           f"({pm(a)} to {pm(b)}), more than twice its standard error ({se:.3f})")
            elif d > 2 * se:
                verdict = (f"a longer context hurts at this budget: val bpc rises by {d:.3f} from {short:,} to "
                           f"{long:,} bytes ({pm(a)} to {pm(b)}; standard error {se:.3f})")
            else:
                verdict = (f"the data does not show that a longer context helps: val bpc {pm(a)} at {short:,} and "
                           f"{pm(b)} at {long:,} bytes differ by {d:+.3f}, within twice the standard error ({se:.3f})")
            curve = mean_curve(self.cell(v, long, "val_bpc_by_position"))
            near = [m for pos, m, _ in curve if pos <= short]
            if curve and near:
                verdict += (f"; within the {long:,}-byte runs, the last positions score {curve[-1][1]:.3f} bpc against "
                            f"{near[-1]:.3f} at position {short:,}, so the model "
                            + ("does use context beyond the shortest length" if curve[-1][1] < near[-1] - 0.01
                               else "gains little from context beyond the shortest length"))
            ratio = self.extrapolation_ratio(v, long)
            if ratio is not None:
                word = "holds" if ratio <= HOLDS else "degrades" if ratio <= DEGRADES else "breaks"
                verdict += f"; evaluated at twice the context it {word} (bpc x{ratio:.2f})"
            lines.append(f"- **{label}**: {verdict}.")
        return lines + [line for t in p.seq_lens if (line := self.between(t))]

    def limits(self) -> list[str]:
        """What the runs cannot say, from how they were made: the budget's trade of samples for context, the
        rate chosen at one context, under-fitting at the long one, the few windows behind the long positions,
        and variants that differ only in how the same function is computed."""
        p = self.p
        short, long = min(p.seq_lens), max(p.seq_lens)
        lines = [f"- Every run has {p.steps} steps of {p.tokens_per_step:,} tokens, so a {long:,}-byte run trains on "
                 f"{max(1, p.tokens_per_step // long):,} sequence(s) a step against {p.tokens_per_step // short:,} at "
                 f"{short:,}: a longer context trades independent samples for context. \"Helps\" and \"hurts\" above "
                 "hold at this budget; they do not say how the attentions compare at convergence, or on a budget "
                 "that grows with the context.",
                 f"- Each attention's learning rate was chosen at {short:,} bytes and kept at every context; the "
                 "longer contexts, with fewer sequences a step, may want another."]
        under = []
        for v in p.variants:
            a, b = self.cell(v, short, "train_bpc"), self.cell(v, long, "train_bpc")
            d, se = differs(a, b)
            if spread(a)[2] > 1 and spread(b)[2] > 1 and d > 2 * se:
                under.append(f"{VARIANTS[v].label} {spread(b)[0]:.2f} against {spread(a)[0]:.2f}")
        if under:
            lines.append(f"- The train bpc rises with the context too ({'; '.join(under)}, at {long:,} and {short:,} "
                         "bytes): the long-context models fit their training data less in the same steps, so their "
                         "higher val bpc is under-fitting, not memorising. The runs do not separate what an attention "
                         "could do with a long context from how fast it learns under this recipe.")
        windows = p.eval_tokens // long
        if p.data_path is None or Path(p.data_path).is_file():
            windows = min(windows, split_sizes(ENWIK8_SIZE if p.data_path is None
                                                else Path(p.data_path).stat().st_size)[1] // long)
        if windows < 32:
            lines.append(f"- At {long:,} bytes the val bpc by position averages {windows} window(s): each position "
                         "past the first few thousand is measured on the same few stretches of text, so the "
                         "curve's shape there also reflects which text lies there.")
        for a, b in itertools.combinations(p.variants, 2):
            if dict(VARIANTS[a].settings)["attention"] == dict(VARIANTS[b].settings)["attention"]:
                gaps = [abs(spread(self.cell(a, t, "val_bpc"))[0] - spread(self.cell(b, t, "val_bpc"))[0])
                        for t in p.seq_lens]
                gaps = [g for g in gaps if not math.isnan(g)]
                if gaps:
                    lrs = [self.lr_of(x) for x in (a, b)]
                    lines.append(f"- {VARIANTS[a].label} and {VARIANTS[b].label} compute the same function; what "
                                 f"separates them (up to {max(gaps):.3f} bpc here) is how it is computed and rounded, "
                                 + (f"the rates the sweep chose ({lrs[0]:g} and {lrs[1]:g}), " if lrs[0] != lrs[1]
                                    else "") + "and the seeds, not a difference in what the model can learn.")
        learned = {v: [a >= SOLVED for (w, _, _), accs in self.recall.items() if w == v for a in accs]
                   for v in p.variants}
        best = max(learned.values(), key=lambda runs: sum(runs) / max(len(runs), 1), default=[])
        if best and sum(best) < 0.75 * len(best):
            lines.append(f"- No attention learns the recall task reliably in {p.recall_steps} steps (the best, "
                         f"{sum(best)} of {len(best)} runs): the probe tells apart an attention that never learns it "
                         "from one that sometimes does, not how well each would recall once trained.")
        return lines

    def lr_of(self, variant: str) -> float | None:
        """The rate the variant's grid runs used."""
        return next((r["lr"] for r in self.results if r["phase"] == "grid" and r["variant"] == variant), None)

    def between(self, seq_len: int) -> str | None:
        """The attentions side by side at one context: the lowest val bpc, and which others are behind it by
        more than twice the standard error of the difference, or within it; None with fewer than two
        attentions of two finished seeds each."""
        cells = {v: [x for x in self.cell(v, seq_len, "val_bpc") if x is not None] for v in self.p.variants}
        cells = {v: xs for v, xs in cells.items() if len(xs) >= 2}
        if len(cells) < 2:
            return None
        best = min(cells, key=lambda v: spread(cells[v])[0])
        behind, within = [], []
        for v, xs in cells.items():
            if v != best:
                d, se = differs(cells[best], xs)
                (behind if d > 2 * se else within).append(f"{VARIANTS[v].label} ({d:+.3f})")
        words = [f"{VARIANTS[best].label} has the lowest val bpc ({pm(cells[best])})"]
        if behind:
            words.append(f"{', '.join(behind)} {'is' if len(behind) == 1 else 'are'} behind by more than twice "
                         "the standard error")
        if within:
            words.append(f"{', '.join(within)} {'is' if len(within) == 1 else 'are'} within it")
        return f"- **At {seq_len:,} bytes**: " + "; ".join(words) + "."

    def sweep_tie(self, variant: str, sweep: list[dict]) -> str | None:
        """Where the sweep's best rate beat the next by less than the std of the grid's seeds at the sweep's
        context, the margin and that std; else None."""
        vals = sorted(r["val_bpc"] for r in sweep if r["variant"] == variant and r["status"] == "ok")
        _, std, n = spread(self.cell(variant, self.p.sweep_seq_len, "val_bpc"))
        if len(vals) < 2 or n < 2 or vals[1] - vals[0] >= std:
            return None
        return f"{VARIANTS[variant].label} by {vals[1] - vals[0]:.3f} bpc (seeds' std {std:.3f})"

    def extrapolation_ratio(self, variant: str, seq_len: int) -> float | None:
        pairs = [(r["extrapolation"]["bpc"], r["val_bpc"]) for r in self.grid.get((variant, seq_len), [])
                 if "extrapolation" in r]
        return statistics.fmean(a / b for a, b in pairs) if pairs else None

    # ------------------------------------------------------------------ tables

    def tables(self) -> list[str]:
        p = self.p
        out = []
        sweep = [r for r in self.results if r["phase"] == "sweep"]
        if sweep:
            lrs = chosen_lrs(self.results, p.variants, p.lrs)
            out += ["## Learning rate, chosen per attention", "",
                    f"Each variant at context {p.sweep_seq_len:,}, seed {p.seeds[0]}, {p.sweep_steps} steps; "
                    "final val bpc per peak learning rate (the grid takes the rate with the lowest).", "",
                    "| variant | " + " | ".join(f"lr {lr:g}" for lr in p.lrs) + " | chosen |",
                    "| --- |" + " ---: |" * (len(p.lrs) + 1)]
            for v in p.variants:
                cells = []
                for lr in p.lrs:
                    r = next((r for r in sweep if r["variant"] == v and r["lr"] == lr), None)
                    cells.append("–" if r is None else f"{r['val_bpc']:.3f}" if r["status"] == "ok" else r["status"])
                out.append(f"| {VARIANTS[v].label} | " + " | ".join(cells) + f" | {lrs.get(v, '–')} |")
            ties = [tie for v in p.variants if (tie := self.sweep_tie(v, sweep))]
            if ties:
                out += ["", "Chosen by less than the spread of the grid's seeds at this context, so at this budget "
                        "the rates tie and the choice is the sweep's seed's: " + "; ".join(ties) + "."]
            out.append("")
        out += ["## Final bpc per attention and context", "",
                f"Mean ± std over seeds {', '.join(map(str, p.seeds))}; val and test over the whole split; train: the "
                "last 5% of steps; gap = val - train (a large one would mean memorising the data).", "",
                "| variant | context | seeds | val bpc | test bpc | train bpc | gap | tokens/s | peak GiB |",
                "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for v in p.variants:
            for t in p.seq_lens:
                runs = self.grid.get((v, t), [])
                gap = [r["val_bpc"] - r["train_bpc"] for r in runs]
                tps, mem = spread(self.cell(v, t, "tokens_per_s"))[0], spread(self.cell(v, t, "peak_mem_gib"))[0]
                out.append(f"| {VARIANTS[v].label} | {t:,} | {len(runs)} | {pm(self.cell(v, t, 'val_bpc'))} | "
                           f"{pm(self.cell(v, t, 'test_bpc'))} | {pm(self.cell(v, t, 'train_bpc'))} | {pm(gap)} | "
                           + ("–" if math.isnan(tps) else f"{tps:,.0f}") + " | "
                           + ("–" if math.isnan(mem) else f"{mem:.2f}") + " |")
        out += ["", "## At twice the trained context", "",
                "Each grid run's checkpoint scored on the val split with windows twice its training context "
                "(`scripts/evaluate.py`); ratio = that bpc over the bpc at the trained context "
                f"(holds <= {HOLDS}, degrades <= {DEGRADES}, breaks above).", "",
                "| variant | trained context | val bpc at context | at twice it | ratio |",
                "| --- | ---: | ---: | ---: | ---: |"]
        for v in p.variants:
            for t in p.seq_lens:
                runs = [r for r in self.grid.get((v, t), []) if "extrapolation" in r]
                ratio = self.extrapolation_ratio(v, t)
                out.append(f"| {VARIANTS[v].label} | {t:,} | {pm([r['val_bpc'] for r in runs])} | "
                           f"{pm([r['extrapolation']['bpc'] for r in runs])} | "
                           + ("–" if ratio is None else f"{ratio:.2f}") + " |")
        if self.p.recall_seq_lens:
            out += ["", "## Associative recall", "",
                    f"Multi-query associative recall (`--task recall`, `{p.recall_config}`): accuracy on the queried "
                    f"values of the test sequences after {p.recall_steps} steps, mean ± std over seeds, and how many "
                    f"seeds learned the task (accuracy >= {SOLVED}; chance is 1/128). Learning it tends to come "
                    "suddenly, at a step that varies with the seed, so the count says more than the mean.", "",
                    "| variant | " + " | ".join(f"T {t:,}, {n} pairs" for t in p.recall_seq_lens
                                             for n in p.recall_pairs) + " |",
                    "| --- |" + " ---: |" * (len(p.recall_seq_lens) * len(p.recall_pairs))]
            for v in p.variants:
                cells = []
                for t in p.recall_seq_lens:
                    for n in p.recall_pairs:
                        acc = self.recall.get((v, t, n), [])
                        cells.append("–" if not acc else
                                     f"{pm(acc)}, {sum(a >= SOLVED for a in acc)}/{len(acc)} learned")
                out.append(f"| {VARIANTS[v].label} | " + " | ".join(cells) + " |")
        return out

    # ------------------------------------------------------------------ plots

    def plots(self, out: Path) -> list[str]:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        from matplotlib.ticker import FuncFormatter

        p, files = self.p, []
        plain = FuncFormatter(lambda value, _: f"{value:,.0f}")
        colors = {v: f"C{i}" for i, v in enumerate(VARIANTS)}
        budget = f"{p.steps} steps x {p.tokens_per_step:,} tokens, seeds {', '.join(map(str, p.seeds))}"

        def save(fig, name, title):
            fig.suptitle(title)
            fig.tight_layout()
            fig.savefig(out / name, dpi=110)
            plt.close(fig)
            files.append(name)

        fig, ax = plt.subplots(figsize=(6.5, 4.5))
        for v in p.variants:
            stats = [(t, *spread(self.cell(v, t, "val_bpc"))) for t in p.seq_lens]
            stats = [s for s in stats if s[3]]
            if stats:
                t, m, s, _ = zip(*stats)
                ax.errorbar(t, m, yerr=s, color=colors[v], label=VARIANTS[v].label, marker="o", capsize=3)
        ax.set_xscale("log", base=2)
        ax.set_xticks(p.seq_lens, [f"{t:,}" for t in p.seq_lens])
        ax.minorticks_off()
        ax.set_xlabel("training context (bytes)")
        ax.set_ylabel("final val bpc (bits per byte; lower is better)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        save(fig, "val_bpc_by_context.png", f"Val bpc against context length (mean ± std over seeds)\n{budget}")

        fig, axes = plt.subplots(1, len(p.seq_lens), figsize=(4.6 * len(p.seq_lens), 4.3), sharey=True, squeeze=False)
        for ax, t in zip(axes[0], p.seq_lens):
            for v in p.variants:
                curve = mean_curve(self.cell(v, t, "val_bpc_by_position"))
                if curve:
                    pos, m, s = zip(*curve)
                    ax.plot(pos, m, color=colors[v], label=VARIANTS[v].label, marker=".")
                    ax.fill_between(pos, [a - b for a, b in zip(m, s)], [a + b for a, b in zip(m, s)],
                                    color=colors[v], alpha=0.2)
            ax.set_xscale("log", base=2)
            ax.xaxis.set_major_formatter(plain)
            ax.set_title(f"trained and scored at {t:,} bytes")
            ax.set_xlabel("position in the context (bytes; bucket end)")
            ax.grid(alpha=0.3)
        axes[0][0].set_ylabel("val bpc in the bucket (mean ± std over seeds)")
        shared_legend(axes[0])
        save(fig, "bpc_by_position.png", f"Val bpc by position in the context: does more context help?\n{budget}")

        fig, axes = plt.subplots(1, len(p.variants), figsize=(4.6 * len(p.variants), 4.3), sharey=True, squeeze=False)
        for ax, v in zip(axes[0], p.variants):
            for i, t in enumerate(p.seq_lens):
                runs = [r for r in self.grid.get((v, t), []) if "extrapolation" in r]
                for key, style, what in (("val_bpc_by_position", "-", "trained context"),
                                         ("extrapolation", "--", "twice it")):
                    curves = [r[key] if key != "extrapolation" else r[key]["bpc_by_position"] for r in runs]
                    curve = mean_curve(curves)
                    if curve:
                        pos, m, _ = zip(*curve)
                        ax.plot(pos, m, style, color=f"C{i}", label=f"{t:,}: {what}")
            ax.set_xscale("log", base=2)
            ax.xaxis.set_major_formatter(plain)
            ax.set_title(VARIANTS[v].label)
            ax.set_xlabel("position in the context (bytes; bucket end)")
            ax.grid(alpha=0.3)
            if ax.has_data():
                ax.legend(fontsize=7)
        axes[0][0].set_ylabel("val bpc in the bucket (mean over seeds)")
        save(fig, "extrapolation.png", "Scored at the trained context (solid) and at twice it (dashed)")

        fig, axes = plt.subplots(1, 2, figsize=(11, 4.3))
        for v in p.variants:
            for ax, key in zip(axes, ("tokens_per_s", "peak_mem_gib")):
                pts = [(t, spread(self.cell(v, t, key))[0]) for t in p.seq_lens if self.grid.get((v, t))]
                if pts:
                    ax.plot(*zip(*pts), color=colors[v], label=VARIANTS[v].label, marker="o")
        for ax, ylabel in zip(axes, ("training tokens/s (median step)", "peak memory (GiB, allocated)")):
            ax.set_xscale("log", base=2)
            ax.set_xticks(p.seq_lens, [f"{t:,}" for t in p.seq_lens])
            ax.minorticks_off()
            ax.set_xlabel("training context (bytes)")
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
            if ax.has_data():
                ax.legend(fontsize=8)
        save(fig, "throughput_memory.png", f"Training throughput and memory ({p.tokens_per_step:,} tokens a step)")

        if self.recall:
            fig, axes = plt.subplots(1, len(p.recall_pairs), figsize=(5 * len(p.recall_pairs), 4.3), sharey=True,
                                     squeeze=False)
            for ax, n in zip(axes[0], p.recall_pairs):
                for v in p.variants:
                    lengths = [t for t in p.recall_seq_lens if (v, t, n) in self.recall]
                    if not lengths:
                        continue
                    stats = [spread(self.recall[v, t, n]) for t in lengths]
                    means, stds = [m for m, _, _ in stats], [sd for _, sd, _ in stats]
                    ax.plot(lengths, means, color=colors[v], label=VARIANTS[v].label, marker="o")
                    ax.fill_between(lengths, [m - sd for m, sd in zip(means, stds)],
                                    [m + sd for m, sd in zip(means, stds)], color=colors[v], alpha=0.15)
                    for t in lengths:  # each seed, since the mean of all-or-nothing runs hides them
                        acc = self.recall[v, t, n]
                        ax.scatter([t] * len(acc), acc, color=colors[v], s=12, alpha=0.5)
                ax.set_xscale("log", base=2)
                ax.set_title(f"{n} key-value pairs")
                ax.set_xlabel("sequence length (bytes)")
                ax.set_ylim(0, 1.02)
                ax.grid(alpha=0.3)
            axes[0][0].set_ylabel("recall accuracy on queried values (mean ± std; dots: seeds)")
            shared_legend(axes[0])
            save(fig, "recall.png", f"Associative recall accuracy ({p.recall_steps} steps, seeds "
                                   f"{', '.join(map(str, p.seeds))})")
        return files

    # ------------------------------------------------------------------ the document

    def write(self, out: Path) -> None:
        out.mkdir(parents=True, exist_ok=True)
        p = self.p
        data = (f"`{p.data_path}` (a local copy; the first 4,154,064 bytes of enwik8 if it is the 4 MB prefix, split "
                "90/5/5 proportionally)" if p.data_path else "enwik8 (the full 100 MB, downloaded and verified; "
                "split 90M/5M/5M)")
        missing = [j.name for j in self.jobs if not any(r["name"] == j.name and r["status"] == "ok" for r in self.results)]
        failed = [r for r in self.results if r["status"] != "ok"]
        floor = [VARIANTS[v].label for v in p.variants
                 if not (spread(self.cell(v, min(p.seq_lens), "val_bpc"))[0] < QUALITY_FLOOR_BPC)]
        lines = ["# Softmax, cosine-sim and fastmax attention as the context grows", "",
                 f"Written by `{self.command}` on {self.hardware}.", "",
                 f"- Data: {data}.",
                 f"- Model: `{p.config}`, {self.params / 1e6:.2f}M parameters; every run {p.steps} steps of "
                 f"{p.tokens_per_step:,} tokens (batch = tokens / context), warmup over the first tenth, cosine decay "
                 "to a tenth of the peak rate; bf16 autocast on GPUs, fp32 on a CPU.",
                 f"- Variants: {', '.join(f'`{v}` ({VARIANTS[v].label})' for v in p.variants)}; contexts "
                 f"{', '.join(f'{t:,}' for t in p.seq_lens)} bytes; seeds {', '.join(map(str, p.seeds))}.",
                 f"- wandb group `{p.wandb_group}` (mode {p.wandb_mode}); every run's result.json is in results.json.",
                 ""]
        if floor:
            lines += [f"**Quality floor not met:** {', '.join(floor)} did not reach val bpc < {QUALITY_FLOOR_BPC} at the "
                      "shortest context: these models have not learned enough for their comparison to mean much.", ""]
        if missing:
            lines += [f"**Incomplete:** {len(missing)} of {len(self.jobs)} runs have no result yet (a later "
                      "`make compare` with the same options goes on): " + ", ".join(missing[:12])
                      + (" ..." if len(missing) > 12 else ""), ""]
        lines += ["## What the data says", "", *self.conclusions(), "", "## What it does not show", "",
                  *self.limits(), "", *self.tables(), ""]
        for name in self.plots(out):
            lines += [f"![{name[:-4].replace('_', ' ')}]({name})", ""]
        if failed:
            lines += ["## Runs that did not finish", "", *[f"- `{r['name']}`: {r['status']}" for r in failed], ""]
        lines += ["## Commands", "", "```bash", self.command,
                  *[" ".join(r["command"]) for r in self.results[:3]], "# ... one per run: results.json", "```", ""]
        (out / "report.md").write_text("\n".join(lines))
        (out / "results.json").write_text(json.dumps({"command": self.command, "hardware": self.hardware,
                                                      "protocol": {k: v for k, v in vars(p).items()},
                                                      "runs": self.results}, indent=1) + "\n")
