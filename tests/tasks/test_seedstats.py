"""tasks.seedstats: the Student-t interval of a mean over seeds and of paired differences, against hand-computed cases
and the closed forms of the t quantile."""
from __future__ import annotations

import math

import pytest

from tasks.seedstats import paired_difference, t_interval, t_quantile, t_quantile_exact


def test_t_quantile_matches_the_closed_forms():
    # df=1 (Cauchy): t_q = tan(pi (q - 1/2)); df=2: t_q = (2q - 1) / sqrt(2 q (1 - q))
    for q in (0.9, 0.975, 0.995):
        assert t_quantile_exact(q, 1) == pytest.approx(math.tan(math.pi * (q - 0.5)), rel=1e-10)
        assert t_quantile_exact(q, 2) == pytest.approx((2 * q - 1) / math.sqrt(2 * q * (1 - q)), rel=1e-10)
    # a large df tends to the normal quantile 1.959964 (and stays above it)
    assert 1.959964 < t_quantile_exact(0.975, 2000) < 1.962


def test_exact_series_agrees_with_scipy_where_installed():
    stats = pytest.importorskip("scipy.stats")
    for df in (1, 2, 3, 4, 5, 6, 7, 10, 29, 30, 31, 120):
        assert t_quantile_exact(0.975, df) == pytest.approx(stats.t.ppf(0.975, df), abs=1e-8)
        assert t_quantile(0.975, df) == pytest.approx(t_quantile_exact(0.975, df), abs=1e-8)


def test_t_quantile_refuses_bad_arguments():
    for q, df in ((0.4, 3), (1.0, 3), (0.975, 0), (0.975, 2.5)):
        with pytest.raises(ValueError):
            t_quantile(q, df)


def test_interval_of_three_seeds_by_hand():
    # values 0.5, 0.7, 0.9: mean 0.7, sd = sqrt((0.04 + 0 + 0.04) / 2) = 0.2, t_{0.975,2} = 0.95/sqrt(0.04875)
    iv = t_interval([0.5, 0.7, 0.9])
    t2 = 0.95 / math.sqrt(2 * 0.975 * 0.025)
    half = t2 * 0.2 / math.sqrt(3)
    assert (iv.n, iv.mean, iv.sd) == (3, pytest.approx(0.7), pytest.approx(0.2))
    assert (iv.low, iv.high) == (pytest.approx(0.7 - half), pytest.approx(0.7 + half))
    assert iv.text() == f"0.700 [{0.7 - half:.3f}, {0.7 + half:.3f}]"


def test_one_value_has_no_interval_and_nan_values_are_dropped():
    iv = t_interval([0.4, float("nan")])
    assert iv.n == 1 and iv.mean == 0.4 and math.isnan(iv.low) and iv.text() == "0.400 (n=1, no interval)"
    assert t_interval([]).text() == "-"
    same = t_interval([0.3, 0.3, 0.3])  # no spread: a zero-width interval
    assert same.low == same.high == pytest.approx(0.3)


def test_paired_difference_uses_only_shared_seeds():
    a = {"1": 0.5, "2": 0.6, "3": 0.7, "4": 0.1}
    b = {"1": 0.6, "2": 0.8, "3": 0.9, "5": 1.0}
    d = paired_difference(a, b)
    # per-seed differences 0.1, 0.2, 0.2: mean 1/6, sd = sqrt(((1/15)^2 + 2 (1/30)^2) / 2)
    sd = math.sqrt(((0.1 - 1 / 6) ** 2 + 2 * (0.2 - 1 / 6) ** 2) / 2)
    half = t_quantile_exact(0.975, 2) * sd / math.sqrt(3)
    assert d.n == 3 and d.mean == pytest.approx(1 / 6)
    assert (d.low, d.high) == (pytest.approx(1 / 6 - half), pytest.approx(1 / 6 + half))
