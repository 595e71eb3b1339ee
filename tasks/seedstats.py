"""Statistics over seeds: the mean of a few runs' values with a Student-t interval, and paired differences.

A learning result is a mean over seeds with a 95 % interval (README "Evaluation"); with n seeds the interval of the
mean is `mean +- t_{1-alpha/2, n-1} * s / sqrt(n)` (s: the sample standard deviation, ddof=1), the textbook
one-sample t interval (e.g. NIST/SEMATECH e-Handbook of Statistical Methods, 7.2.2.1). Paired differences over the
same seeds are the t interval of the per-seed differences (ibid. 7.3.1, "paired samples"): the seed's common part
cancels, so a real difference shows with fewer seeds than two independent intervals would need.

The Student-t quantile is scipy's (`scipy.stats.t.ppf`) when scipy is importable, else the exact closed form below
(`t_quantile_exact`): for an integer number of degrees of freedom the two-sided probability A(t|v) = P(|T| <= t) is
a finite trigonometric series (Abramowitz & Stegun, Handbook of Mathematical Functions, 26.7.3 and 26.7.4), inverted
by bisection to 1e-12. Pure Python; nothing here imports torch or anything of ours.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class Interval:
    """The mean of `n` values with its two-sided Student-t interval [`low`, `high`] at `level` (NaN bounds when
    n < 2: one value has no spread to estimate; everything NaN when n == 0). `sd`: the sample standard deviation
    (ddof=1; NaN when n < 2). Units: those of the values."""

    mean: float
    low: float
    high: float
    n: int
    sd: float
    level: float = 0.95

    def text(self, fmt: str = ".3f") -> str:
        """`0.620 [0.512, 0.728]`, `0.620 (n=1, no interval)` or `-` (no value)."""
        if self.n == 0:
            return "-"
        if self.n < 2:
            return f"{self.mean:{fmt}} (n=1, no interval)"
        return f"{self.mean:{fmt}} [{self.low:{fmt}}, {self.high:{fmt}}]"


def _two_sided_prob(t: float, df: int) -> float:
    """A(t|df) = P(|T| <= t) for Student's T with integer `df` >= 1 and t >= 0 (Abramowitz & Stegun 26.7.3 for odd
    df, 26.7.4 for even df; theta = arctan(t / sqrt(df)))."""
    theta = math.atan(t / math.sqrt(df))
    c2, s = math.cos(theta) ** 2, math.sin(theta)
    if df % 2 == 1:  # 26.7.3: 2/pi * (theta + sin(theta) * (cos + 2/3 cos^3 + 2*4/(3*5) cos^5 + ...)), to cos^(df-2)
        if df == 1:
            return 2 * theta / math.pi
        term, total = math.cos(theta), math.cos(theta)
        for k in range(3, df - 1, 2):  # the coefficient grows by (k-1)/k: 2/3, 2*4/(3*5), ...
            term *= c2 * (k - 1) / k
            total += term
        return 2 / math.pi * (theta + s * total)
    term, total = 1.0, 1.0  # 26.7.4: sin(theta) * (1 + 1/2 cos^2 + 1*3/(2*4) cos^4 + ...), to cos^(df-2)
    for k in range(2, df - 1, 2):
        term *= c2 * (k - 1) / k
        total += term
    return s * total


def t_quantile_exact(q: float, df: int) -> float:
    """The `q` quantile (0.5 < q < 1) of Student's t with integer `df` >= 1, from the exact series of
    `_two_sided_prob` (A&S 26.7.3-4) inverted by bisection (absolute error < 1e-12). E.g. df=2, q=0.975:
    0.95 / sqrt(2 * 0.975 * 0.025) = 4.302653 (the closed form for df=2: t = (2q-1) / sqrt(2q(1-q))).

    Raises:
        ValueError: q outside (0.5, 1) or df not a positive integer."""
    if not 0.5 < q < 1:
        raise ValueError(f"q={q}: a quantile above the median, 0.5 < q < 1")
    if int(df) != df or df < 1:
        raise ValueError(f"df={df}: a positive integer (n - 1 for n values)")
    target, lo, hi = 2 * q - 1, 0.0, 1.0
    while _two_sided_prob(hi, int(df)) < target:
        hi *= 2
    while hi - lo > 1e-12 * max(1.0, hi):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _two_sided_prob(mid, int(df)) < target else (lo, mid)
    return (lo + hi) / 2


def t_quantile(q: float, df: int) -> float:
    """The `q` quantile of Student's t with `df` degrees of freedom: scipy's when importable, else
    `t_quantile_exact` (same value to ~1e-9). Raises ValueError as `t_quantile_exact`."""
    if not (0.5 < q < 1 and int(df) == df and df >= 1):
        return t_quantile_exact(q, df)  # raises its ValueError
    try:
        from scipy.stats import t as student_t
    except ImportError:
        return t_quantile_exact(q, df)
    return float(student_t.ppf(q, df))


def t_interval(values: Sequence[float], level: float = 0.95) -> Interval:
    """Mean of `values` (finite floats; NaN entries are dropped) with the two-sided Student-t interval at `level`:
    mean +- t_{(1+level)/2, n-1} * sd / sqrt(n) (NIST/SEMATECH 7.2.2.1). n < 2: NaN bounds."""
    xs = [float(v) for v in values if not math.isnan(float(v))]
    n = len(xs)
    if n == 0:
        return Interval(math.nan, math.nan, math.nan, 0, math.nan, level)
    mean = sum(xs) / n
    if n < 2:
        return Interval(mean, math.nan, math.nan, 1, math.nan, level)
    sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1))
    half = t_quantile((1 + level) / 2, n - 1) * sd / math.sqrt(n)
    return Interval(mean, mean - half, mean + half, n, sd, level)


def paired_difference(a: dict, b: dict, level: float = 0.95) -> Interval:
    """The t interval of b[s] - a[s] over the keys (seeds) both dicts hold with finite values (NIST/SEMATECH 7.3.1,
    paired samples). `a`, `b`: {seed: value}. n = the number of shared seeds."""
    shared = [s for s in a if s in b and not (math.isnan(a[s]) or math.isnan(b[s]))]
    return t_interval([b[s] - a[s] for s in shared], level)
