"""study/stats.py against hand-computed examples and scipy: the paired t interval and test, Holm's adjustment,
the bootstrap intervals (one run and several seeds) and the t interval of a plain mean."""
import math

import numpy as np
import pytest
from scipy import stats

from study.stats import (Paired, bootstrap_mean, bootstrap_mean_grouped, fmt_interval, holm, mean_interval,
                         paired)


def test_paired_matches_a_hand_computed_example_and_scipy():
    a = {1: 1.0, 2: 1.0, 3: 1.0}
    b = {1: 1.1, 2: 1.2, 3: 1.3}  # diffs b - a: 0.1, 0.2, 0.3
    p = paired(a, b)
    assert p.n == 3
    assert p.mean == pytest.approx(0.2)
    assert p.std == pytest.approx(0.1)
    assert p.se == pytest.approx(0.1 / math.sqrt(3))
    # t_{0.975, 2} = 4.30265, so the half width is 4.30265 * 0.057735 = 0.248414.
    assert p.low == pytest.approx(-0.048414, abs=1e-6)
    assert p.high == pytest.approx(0.448414, abs=1e-6)
    assert p.t == pytest.approx(0.2 / (0.1 / math.sqrt(3)))
    seeds = sorted(a)
    assert p.p == pytest.approx(stats.ttest_rel([b[s] for s in seeds], [a[s] for s in seeds]).pvalue)
    assert not p.excludes_zero
    assert p.t == pytest.approx(3.464, abs=1e-3)
    assert not p.under(3.0) and p.under(4.0)
    assert fmt_interval(p) == "+0.200 [-0.048, +0.448], n=3"


def test_paired_sign_is_b_minus_a_and_the_level_widens_the_interval():
    a = {s: 1.0 for s in range(5)}
    b = {s: 1.0 - 0.04 - 0.01 * s for s in range(5)}  # b is better (lower bpc) on every seed
    p95, p99 = paired(a, b), paired(a, b, level=0.99)
    assert p95.mean == pytest.approx(-0.06)
    assert p95.high < 0 and p95.excludes_zero
    assert p99.mean == p95.mean and p99.low < p95.low and p99.high > p95.high
    assert paired(b, a).mean == pytest.approx(0.06)


def test_paired_ignores_seeds_present_in_only_one_dict():
    a = {1: 1.0, 2: 1.0, 3: 1.0, 7: 100.0}
    b = {0: -50.0, 1: 1.1, 2: 1.2, 3: 1.3}
    p = paired(a, b)
    assert p.n == 3
    assert p.mean == pytest.approx(0.2)
    assert p.std == pytest.approx(0.1)


@pytest.mark.parametrize("a, b, n, mean", [({1: 1.0}, {1: 1.5}, 1, 0.5), ({1: 1.0}, {2: 1.5}, 0, math.nan),
                                           ({}, {}, 0, math.nan)])
def test_paired_with_fewer_than_two_seeds_gives_nan_not_an_exception(a, b, n, mean):
    p = paired(a, b)
    assert p.n == n
    assert p.mean == pytest.approx(mean, nan_ok=True)
    for value in (p.std, p.se, p.low, p.high, p.t, p.p):
        assert math.isnan(value)
    assert not p.excludes_zero
    assert p.under()
    assert fmt_interval(p) == f"n={n}, no interval"


def test_paired_with_no_spread():
    same = paired({1: 0.0, 2: 0.0, 3: 0.0}, {1: 0.5, 2: 0.5, 3: 0.5})
    assert (same.std, same.se, same.p, same.t) == (0.0, 0.0, 0.0, math.inf)
    assert same.low == same.high == 0.5
    assert same.excludes_zero and not same.under()
    lower = paired({1: 0.5, 2: 0.5}, {1: 0.0, 2: 0.0})
    assert (lower.t, lower.p, lower.low, lower.high) == (-math.inf, 0.0, -0.5, -0.5)
    nothing = paired({1: 1.0, 2: 2.0}, {1: 1.0, 2: 2.0})
    assert (nothing.mean, nothing.p, nothing.low, nothing.high) == (0.0, 1.0, 0.0, 0.0)
    assert not nothing.excludes_zero and nothing.under()


def test_paired_with_a_nan_value_claims_nothing():
    p = paired({1: 1.0, 2: 1.0, 3: 1.0}, {1: 1.1, 2: math.nan, 3: 1.3})
    assert math.isnan(p.mean) and math.isnan(p.p)
    assert not p.excludes_zero and p.under()


def test_fmt_interval_example():
    p = Paired(n=5, mean=-0.0412, std=0.017, se=0.0076, low=-0.0623, high=-0.0201, t=-5.4, p=0.006)
    assert fmt_interval(p) == "-0.041 [-0.062, -0.020], n=5"
    assert fmt_interval(p, digits=2) == "-0.04 [-0.06, -0.02], n=5"


def test_holm_matches_a_hand_computed_example():
    # Sorted: 0.005 * 4 = 0.02, 0.01 * 3 = 0.03, 0.03 * 2 = 0.06, 0.04 * 1 = 0.04 -> 0.06 (monotone).
    assert holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert holm([0.5, 0.6]) == pytest.approx([1.0, 1.0])  # capped at 1
    assert holm([0.04]) == pytest.approx([0.04])
    assert holm([]) == []


def test_holm_is_monotone_in_the_raw_order_and_never_below_the_raw_p():
    p = np.random.default_rng(3).uniform(0, 0.2, size=40).tolist()
    adjusted = holm(p)
    order = np.argsort(p)
    assert np.all(np.diff(np.array(adjusted)[order]) >= 0)
    assert all(q >= r for q, r in zip(adjusted, p))
    assert max(adjusted) <= 1.0


def test_holm_leaves_nan_as_nan_and_does_not_count_it():
    adjusted = holm([0.01, math.nan, 0.04, math.nan])
    assert math.isnan(adjusted[1]) and math.isnan(adjusted[3])
    assert adjusted[0] == pytest.approx(0.02) and adjusted[2] == pytest.approx(0.04)  # m = 2, not 4
    assert all(math.isnan(q) for q in holm([math.nan, math.nan]))


def test_bootstrap_covers_the_true_mean_and_agrees_with_normal_theory():
    true_mean = 0.3
    x = np.random.default_rng(11).normal(true_mean, 1.0, size=4000)
    low, high = bootstrap_mean(x, reps=10_000, seed=0)
    assert low < true_mean < high
    half = stats.norm.ppf(0.975) * x.std(ddof=1) / math.sqrt(len(x))
    assert (high - low) == pytest.approx(2 * half, rel=0.1)
    assert (low + high) / 2 == pytest.approx(x.mean(), abs=0.1 * half)
    narrow = bootstrap_mean(x, reps=10_000, seed=0, level=0.5)
    assert low < narrow[0] < narrow[1] < high


def test_bootstrap_is_deterministic_under_its_seed():
    x = np.random.default_rng(5).exponential(size=300)
    assert bootstrap_mean(x, reps=2000, seed=7) == bootstrap_mean(x, reps=2000, seed=7)
    assert bootstrap_mean(x, reps=2000, seed=7) != bootstrap_mean(x, reps=2000, seed=8)
    groups = [x[:100], x[100:250] + 0.5, x[250:]]
    assert bootstrap_mean_grouped(groups, reps=2000, seed=7) == bootstrap_mean_grouped(groups, reps=2000, seed=7)
    assert bootstrap_mean_grouped(groups, reps=2000, seed=7) != bootstrap_mean_grouped(groups, reps=2000, seed=8)


def test_bootstrap_of_many_blocks_is_drawn_in_chunks_without_changing_its_answer():
    x = np.random.default_rng(2).normal(size=50_000)  # 500 x 50,000 draws exceed one chunk
    low, high = bootstrap_mean(x, reps=500, seed=1)
    assert high - low == pytest.approx(2 * stats.norm.ppf(0.975) * x.std(ddof=1) / math.sqrt(len(x)), rel=0.15)
    assert (low, high) == bootstrap_mean(x, reps=500, seed=1)


def test_grouped_bootstrap_of_one_group_is_bootstrap_mean():
    x = np.random.default_rng(4).normal(size=500)
    assert bootstrap_mean_grouped([x], reps=3000, seed=9) == bootstrap_mean(x, reps=3000, seed=9)
    assert bootstrap_mean_grouped([x, []], reps=3000, seed=9) == bootstrap_mean(x, reps=3000, seed=9)


def test_grouped_bootstrap_carries_the_spread_between_seeds():
    rng = np.random.default_rng(6)
    offsets = [-0.3, -0.1, 0.0, 0.1, 0.3]  # seeds disagree far more than the within-run noise allows
    groups = [rng.normal(0.05 + o, 0.2, size=800) for o in offsets]
    low, high = bootstrap_mean_grouped(groups, reps=4000, seed=0)
    pooled_low, pooled_high = bootstrap_mean(np.concatenate(groups), reps=4000, seed=0)
    assert high - low > 5 * (pooled_high - pooled_low)
    assert low < np.mean([g.mean() for g in groups]) < high
    # Every group weighs the same: a large group does not pull the centre towards itself.
    uneven = [rng.normal(0.0, 0.01, size=5000), rng.normal(1.0, 0.01, size=50)]
    low, high = bootstrap_mean_grouped(uneven, reps=4000, seed=0)
    assert low < 0.5 < high


def test_bootstrap_of_nothing_is_nan():
    for interval in (bootstrap_mean([]), bootstrap_mean_grouped([]), bootstrap_mean_grouped([[], []])):
        assert all(math.isnan(v) for v in interval)
    with pytest.raises(ValueError):
        bootstrap_mean(np.zeros((3, 4)))


def test_mean_interval_matches_a_hand_computed_example():
    mean, low, high = mean_interval([1.0, 2.0, 3.0])
    # sd 1, se 0.57735, t_{0.975, 2} = 4.30265: half width 2.48414.
    assert mean == pytest.approx(2.0)
    assert low == pytest.approx(2.0 - 2.48414, abs=1e-5) and high == pytest.approx(2.0 + 2.48414, abs=1e-5)
    assert mean_interval([1.0, 2.0, 3.0], level=0.99)[1] < low
    mean, low, high = mean_interval([1.5])
    assert mean == 1.5 and math.isnan(low) and math.isnan(high)
    assert all(math.isnan(v) for v in mean_interval([]))
