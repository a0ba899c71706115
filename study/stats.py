"""The statistics the study's report words its claims with.

Runs of the same seed share their data order and initialisation, so two variants (or two contexts) are
compared seed by seed: paired() gives the mean paired difference with its t interval and test, and holm()
adjusts the p-values of a family of such comparisons. With few seeds the interval is wide; within one run,
bootstrap_mean() and bootstrap_mean_grouped() give an interval for a paired difference measured on many
blocks of the same evaluation bytes (e.g. the same targets scored with two context lengths).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy import stats

# Index entries drawn at once by the bootstrap: bounds its memory (reps x blocks can be 10^4 x 10^5)
# without changing its draws, since the chunk size is fixed.
_CHUNK = 1 << 22


@dataclass(frozen=True)
class Paired:
    """A paired comparison over seeds: the difference is b - a, one value per seed present in both."""

    n: int
    mean: float
    std: float  # sample standard deviation (n - 1)
    se: float  # std / sqrt(n)
    low: float  # two-sided t interval at the level paired() was given
    high: float
    t: float  # mean / se
    p: float  # two-sided p-value of the paired t-test

    @property
    def excludes_zero(self) -> bool:
        """Whether the interval lies on one side of zero (False without an interval: nan compares False)."""
        return self.low > 0 or self.high < 0

    def under(self, k: float = 3.0) -> bool:
        """Whether the difference is under k standard errors, i.e. too small to call with these seeds.

        True for an exactly zero difference, and without a standard error (fewer than two seeds, or a nan
        value): then there is nothing to claim.
        """
        if self.mean == 0:
            return True
        return not abs(self.mean) >= k * self.se  # written so that nan compares as under


def paired(a: dict, b: dict, level: float = 0.95) -> Paired:
    """The paired difference b - a over the seeds present in both a and b (seed -> value), in sorted order.

    Fewer than two seeds give nan for everything but n and mean, rather than an exception, so that a
    report over a partial study still renders.
    """
    seeds = sorted(set(a) & set(b))
    d = np.array([b[s] - a[s] for s in seeds], dtype=float)
    n = len(d)
    nan = math.nan
    if n == 0:
        return Paired(0, nan, nan, nan, nan, nan, nan, nan)
    mean = float(d.mean())
    if n == 1:
        return Paired(1, mean, nan, nan, nan, nan, nan, nan)
    std = float(d.std(ddof=1))
    se = std / math.sqrt(n)
    if se == 0:
        # Every seed gave the same difference: no spread to test against. A nonzero difference is then
        # certain and a zero one is no evidence at all; the t formula would give 0/0 or x/0.
        if mean == 0:
            return Paired(n, mean, std, se, mean, mean, 0.0, 1.0)
        return Paired(n, mean, std, se, mean, mean, math.copysign(math.inf, mean), 0.0)
    half = float(stats.t.ppf(0.5 + level / 2, n - 1)) * se
    t = mean / se
    p = float(2 * stats.t.sf(abs(t), n - 1))
    return Paired(n, mean, std, se, mean - half, mean + half, t, p)


def holm(pvalues: list[float]) -> list[float]:
    """Holm-Bonferroni adjusted p-values, in the input order.

    The k-th smallest p becomes max over j <= k of min(1, (m - j + 1) * p_(j)), so the adjusted values keep
    the order of the raw ones. nan (a comparison that could not be made) stays nan and is not counted in m:
    it cannot be rejected, so it costs the others nothing.
    """
    p = np.asarray(pvalues, dtype=float)
    adjusted = np.full(p.shape, math.nan)
    tested = np.flatnonzero(~np.isnan(p))
    order = tested[np.argsort(p[tested], kind="stable")]
    m = len(order)
    scaled = np.minimum(1.0, (m - np.arange(m)) * p[order])
    adjusted[order] = np.maximum.accumulate(scaled)
    return adjusted.tolist()


def _resampled_means(x: np.ndarray, count: int, rng: np.random.Generator) -> np.ndarray:
    """count means of x, each over len(x) entries of x drawn with replacement."""
    n = len(x)
    rows = max(1, _CHUNK // n)
    return np.concatenate([x[rng.integers(0, n, size=(min(rows, count - start), n))].mean(axis=1)
                           for start in range(0, count, rows)])


def _percentiles(means: np.ndarray, level: float) -> tuple[float, float]:
    low, high = np.quantile(means, [(1 - level) / 2, (1 + level) / 2])
    return float(low), float(high)


def bootstrap_mean(diffs, reps: int = 10_000, seed: int = 0, level: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of diffs (1-D: per-block paired differences of one run).

    The blocks are resampled as units, so the interval holds as long as blocks, not bytes, are roughly
    independent; blocks of 64 bytes keep most of a byte's dependence on its neighbours inside one block.
    """
    x = np.asarray(diffs, dtype=float)
    if x.ndim != 1:
        raise ValueError(f"diffs must be 1-D, got shape {x.shape}")
    if len(x) == 0:
        return math.nan, math.nan
    return _percentiles(_resampled_means(x, reps, np.random.default_rng(seed)), level)


def bootstrap_mean_grouped(diffs_by_group: list, reps: int = 10_000, seed: int = 0,
                           level: float = 0.95) -> tuple[float, float]:
    """Two-level paired bootstrap of the mean of group means (a group: one seed's per-block differences).

    Each replicate draws the groups with replacement, then the blocks within each drawn group, and takes the
    mean of those groups' means, so the interval carries the spread between seeds as well as within a run.
    Every group weighs the same whatever its number of blocks. Empty groups are left out.
    """
    groups = [np.asarray(g, dtype=float) for g in diffs_by_group]
    if any(g.ndim != 1 for g in groups):
        raise ValueError("every group of diffs must be 1-D")
    groups = [g for g in groups if len(g)]
    if len(groups) <= 1:
        # Drawing one group out of one is no choice at all: this is bootstrap_mean, draw for draw.
        return bootstrap_mean(groups[0] if groups else [], reps, seed, level)
    rng = np.random.default_rng(seed)
    chosen = rng.integers(0, len(groups), size=(reps, len(groups)))
    means = np.empty(chosen.shape)
    # One pass per group (not per replicate): every slot that drew group g gets a fresh resampled mean of g.
    for g, x in enumerate(groups):
        where = chosen == g
        if where.any():
            means[where] = _resampled_means(x, int(where.sum()), rng)
    return _percentiles(means.mean(axis=1), level)


def mean_interval(values: list[float], level: float = 0.95) -> tuple[float, float, float]:
    """(mean, low, high): a two-sided t interval of a plain mean over seeds; nan bounds for fewer than two."""
    x = np.asarray(values, dtype=float)
    if len(x) == 0:
        return math.nan, math.nan, math.nan
    mean = float(x.mean())
    if len(x) < 2:
        return mean, math.nan, math.nan
    half = float(stats.t.ppf(0.5 + level / 2, len(x) - 1)) * float(x.std(ddof=1)) / math.sqrt(len(x))
    return mean, mean - half, mean + half


def fmt_interval(p: Paired, digits: int = 3) -> str:
    """A paired difference as the report prints it, signed like its other differences, e.g.
    "-0.041 [-0.062, -0.020], n=5"."""
    if math.isnan(p.low) or math.isnan(p.high):
        return f"n={p.n}, no interval"
    return f"{p.mean:+.{digits}f} [{p.low:+.{digits}f}, {p.high:+.{digits}f}], n={p.n}"
