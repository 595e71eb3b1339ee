"""Intervals for eval success rates: Wilson's score interval for one rate, Newcombe's paired interval for a gain.

Every eval of a run plays the SAME fixed episodes (episode i: reset seed `env.eval.seed + i`, tasks.seeding), so two
evals of one run are paired data: the gain between them is a difference of paired proportions, whose interval is
much narrower than one treating the evals as independent samples when the outcomes are correlated (most episodes
are solved, or failed, by both policies).

- `wilson_interval(k, n)`: E. B. Wilson (1927), "Probable inference, the law of succession, and statistical
  inference", JASA 22:209-212. Coverage near the nominal level for every p, also at k = 0 or k = n (where the
  Wald interval has width 0).
- `paired_diff_interval(a, b)`: R. G. Newcombe (1998), "Improved confidence intervals for the difference between
  binomial proportions based on paired data", Statistics in Medicine 17:2635-2650, method 10: the Wilson
  intervals of the two marginal rates combined ("square and add") with the phi correlation of the 2x2 table of
  pairs, phi's numerator continuity-corrected as there (and as in Fagerland, Lydersen & Laake 2017, "Statistical
  Analysis of Contingency Tables", ch. 8, whose worked example the tests check).
- `compare_evals(now, before)`: the same for two eval outcome maps (episode seed -> outcome), on their common
  episodes.

Per-episode eval records of a run (`write_eval` / `read_evals`: `<run_dir>/evals/step_<N>.json`, episode seed ->
outcome; a validation split's (env.eval.val_episodes) under `<run_dir>/evals/val/`) let any two evals be compared
later (`compare_evals`). The run's eval decisions are pure functions of them, used by the runner
(pipelines.runner.evals) and `pipelines.eval` alike: an eval's score (`split_metrics`, `check_fixed_episodes`), the
baseline of its gain (`pick_baseline`, `baseline`), the gain (`gain_metrics`), the regression warning
(`regression`, `regression_line`) and the best checkpoint (`improves`, `best_after`, `best_unmarked`). Pure numpy/math/json: nothing of pipelines or storage is imported.
"""
from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

Z95 = 1.959963984540054  # the two-sided 95 % standard normal quantile


def wilson_interval(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson's (1927) score interval for a binomial proportion.

    Args:
        successes: k, an int in [0, n] (a float equal to an int is accepted: a mean times n).
        n: the number of trials, >= 0.
        z: the normal quantile (1.96: 95 %).

    Returns:
        (low, high) floats in [0, 1]; (0.0, 1.0) for n = 0 (no data: every rate is possible).

    Raises:
        ValueError: n < 0, k outside [0, n], a non-integer k, or z <= 0.
    """
    n_i = int(n)
    if n_i != n or n_i < 0:
        raise ValueError(f"n must be an int >= 0, got {n!r}")
    k = float(successes)
    if abs(k - round(k)) > 1e-6 * max(1, n_i):
        raise ValueError(f"successes must be an integer count, got {successes!r}")
    k = round(k)
    if not 0 <= k <= n_i:
        raise ValueError(f"successes must be in [0, n={n_i}], got {successes!r}")
    if not z > 0:
        raise ValueError(f"z must be > 0, got {z!r}")
    if n_i == 0:
        return 0.0, 1.0
    p = k / n_i
    z2 = z * z
    denom = 1.0 + z2 / n_i
    center = (p + z2 / (2 * n_i)) / denom
    half = z / denom * math.sqrt(p * (1 - p) / n_i + z2 / (4 * n_i * n_i))
    low, high = max(0.0, center - half), min(1.0, center + half)
    if k == 0:  # exact bounds (the formula gives them up to rounding)
        low = 0.0
    if k == n_i:
        high = 1.0
    return low, high


def _binary(x, name: str) -> np.ndarray:
    a = np.asarray(x)
    if a.ndim != 1:
        raise ValueError(f"{name} must be a 1-d sequence of 0/1 outcomes, got shape {a.shape}")
    if a.size and not np.isin(a.astype(float), (0.0, 1.0)).all():
        raise ValueError(f"{name} must hold only 0/1 (or False/True) outcomes")
    return a.astype(bool)


def paired_diff_interval(now: Sequence, before: Sequence, z: float = Z95) -> tuple[float, float, float]:
    """Newcombe's (1998, method 10) interval for p_now - p_before on paired binary outcomes.

    Args:
        now, before: 1-d sequences of the same length n of 0/1 outcomes; element i of both is the same episode.
        z: the normal quantile (1.96: 95 %).

    Returns:
        (diff, low, high): diff = mean(now) - mean(before); low <= diff <= high, both in [-1, 1]. With n = 0:
        (0.0, -1.0, 1.0).

    With the 2x2 table of pairs a = both succeed, b = only `now`, c = only `before`, d = neither, the Wilson
    intervals (l1, u1) of p1 = (a+b)/n and (l2, u2) of p2 = (a+c)/n, and the correlation estimate
    phi = A' / sqrt((a+b)(c+d)(a+c)(b+d)) with A = ad - bc corrected as in Newcombe (1998): A' = A - n/2 when
    A > n/2, 0 when 0 <= A <= n/2, A when A < 0 (phi = 0 when a marginal total is 0):
        low  = diff - sqrt((p1-l1)^2 - 2 phi (p1-l1)(u2-p2) + (u2-p2)^2)
        high = diff + sqrt((u1-p1)^2 - 2 phi (u1-p1)(p2-l2) + (p2-l2)^2)

    Raises:
        ValueError: lengths differ, or an outcome is not 0/1.
    """
    x, y = _binary(now, "now"), _binary(before, "before")
    if x.shape != y.shape:
        raise ValueError(f"paired outcomes need the same episodes: now has {x.size}, before {y.size}")
    n = int(x.size)
    if n == 0:
        return 0.0, -1.0, 1.0
    a = int(np.sum(x & y))
    b = int(np.sum(x & ~y))
    c = int(np.sum(~x & y))
    d = n - a - b - c
    return paired_diff_interval_counts(a, b, c, d, z)


def paired_diff_interval_counts(a: int, b: int, c: int, d: int, z: float = Z95) -> tuple[float, float, float]:
    """`paired_diff_interval` from the 2x2 table of pairs (ints >= 0): a = both succeed, b = only the first
    (`now`), c = only the second (`before`), d = neither. Returns (diff, low, high) for p1 - p2,
    p1 = (a+b)/n, p2 = (a+c)/n. Raises ValueError for a negative count."""
    if min(a, b, c, d) < 0:
        raise ValueError(f"counts must be >= 0, got {(a, b, c, d)}")
    n = a + b + c + d
    if n == 0:
        return 0.0, -1.0, 1.0
    p1, p2 = (a + b) / n, (a + c) / n
    l1, u1 = wilson_interval(a + b, n, z)
    l2, u2 = wilson_interval(a + c, n, z)
    marg = float(a + b) * (c + d) * (a + c) * (b + d)
    A = a * d - b * c  # phi's numerator, continuity-corrected towards 0 when positive (Newcombe 1998)
    if marg == 0 or 0 <= A <= n / 2:
        phi = 0.0
    else:
        phi = (A - n / 2 if A > 0 else A) / math.sqrt(marg)
    diff = p1 - p2
    dl = (p1 - l1) ** 2 - 2 * phi * (p1 - l1) * (u2 - p2) + (u2 - p2) ** 2
    du = (u1 - p1) ** 2 - 2 * phi * (u1 - p1) * (p2 - l2) + (p2 - l2) ** 2
    low = diff - math.sqrt(max(dl, 0.0))
    high = diff + math.sqrt(max(du, 0.0))
    return diff, max(-1.0, low), min(1.0, high)


def fmt_rate(p: float, low: float, high: float, n: int | None = None) -> str:
    """`0.438 [0.30, 0.58]` (and ` over 48 episodes` with `n`): how every success rate is printed."""
    s = f"{p:.3f} [{low:.2f}, {high:.2f}]"
    return s if n is None else f"{s} over {n} episodes"


def fmt_gain(diff: float, low: float, high: float) -> str:
    """`+0.125 [+0.03, +0.22]`: a gain (difference of rates) with its interval."""
    return f"{diff:+.3f} [{low:+.2f}, {high:+.2f}]"


@dataclass(frozen=True)
class Comparison:
    """`compare_evals`' answer: the paired gain of `key` between two evals on their common episodes."""

    key: str
    n: int  # common episodes
    now: float  # success rate of the later eval on them
    before: float
    diff: float  # now - before
    low: float
    high: float

    @property
    def significant_drop(self) -> bool:
        """The whole interval lies below 0 (a regression at the interval's level)."""
        return self.n > 0 and self.high < 0

    @property
    def significant_gain(self) -> bool:
        return self.n > 0 and self.low > 0


def compare_evals(now: Mapping, before: Mapping, key: str = "success_once", z: float = Z95) -> Comparison:
    """The paired gain of `key` between two evals' per-episode outcomes.

    Args:
        now, before: {episode seed (int or str) -> {"success_once": bool, "success_at_end": bool, ...}}, as
            written to a run's `evals/step_N.json` ("episodes"); only seeds in both are paired.
        key: the outcome compared.

    Returns:
        Comparison (n = 0 when no seed is common: diff 0, interval [-1, 1]).
    """
    common = sorted(set(map(str, now)) & set(map(str, before)), key=lambda s: (len(s), s))
    nowm = {str(k): v for k, v in now.items()}
    befm = {str(k): v for k, v in before.items()}
    x = [bool(nowm[s][key]) for s in common]
    y = [bool(befm[s][key]) for s in common]
    diff, low, high = paired_diff_interval(x, y, z)
    n = len(common)
    return Comparison(key, n, float(np.mean(x)) if n else 0.0, float(np.mean(y)) if n else 0.0, diff, low, high)


# ----- per-episode eval records of a run: <run_dir>/evals/step_<N>.json (the validation split's: evals/val/) -----
EVALS_DIR = "evals"
OUTCOMES = ("success_once", "success_at_end", "return", "episode_len")
RATES = ("success_once", "success_at_end")


def _evals_dir(run_dir, split: str) -> Path:
    """`<run_dir>/evals` for split "eval", `<run_dir>/evals/<split>` for another (the validation split, "val")."""
    d = Path(run_dir) / EVALS_DIR
    return d if split == "eval" else d / split


def episode_outcomes(episodes: Sequence[Mapping]) -> dict[str, dict]:
    """{str(reset seed): {"success_once": bool, "success_at_end": bool, "return": float, "episode_len": int}} from
    the finished-episode dicts of an eval (tasks.envs.shard.EnvShard: keys "seed" and OUTCOMES), sorted by seed.

    Raises:
        ValueError: two episodes share a seed (an eval plays each fixed episode once)."""
    out: dict[int, dict] = {}
    for e in episodes:
        s = int(e["seed"])
        if s in out:
            raise ValueError(f"eval episode seed {s} occurs twice")
        out[s] = {"success_once": bool(e["success_once"]), "success_at_end": bool(e["success_at_end"]),
                  "return": float(e["return"]), "episode_len": int(e["episode_len"])}
    return {str(s): out[s] for s in sorted(out)}


def rate_summary(outcomes: Mapping[str, Mapping], z: float = Z95) -> dict[str, float]:
    """{"success_once", "success_once_ci_low", "success_once_ci_high", the same for success_at_end, "num_episodes"}
    (floats) from an outcome map (`episode_outcomes`); Wilson intervals."""
    n = len(outcomes)
    out: dict[str, float] = {"num_episodes": float(n)}
    for key in RATES:
        k = sum(bool(o[key]) for o in outcomes.values())
        lo, hi = wilson_interval(k, n, z)
        out[key], out[f"{key}_ci_low"], out[f"{key}_ci_high"] = (k / n if n else float("nan")), lo, hi
    return out


def write_eval(run_dir, step: int, outcomes: Mapping[str, Mapping], extra: Mapping | None = None,
               split: str = "eval", create_run_dir: bool = True):
    """Write `<run_dir>/evals/step_<step>.json` (split "val": `evals/val/step_<step>.json`) atomically: {"step",
    "summary": rate_summary, "episodes": outcomes, **extra}; an existing file of that step (a redone step) is
    replaced. Returns its path. `create_run_dir=False` (a running run's evals): `run_dir` must exist and is never
    made again (raises storage.rundir.RunDirGone when it is not there)."""
    d = _evals_dir(run_dir, split)
    if create_run_dir:
        d.mkdir(parents=True, exist_ok=True)
    else:
        from storage.rundir import make_dir_in
        make_dir_in(run_dir, *d.relative_to(Path(run_dir)).parts)
    rec = {"step": int(step), **dict(extra or {}), "summary": rate_summary(outcomes), "episodes": dict(outcomes)}
    from storage.rundir import write_text_atomic
    return write_text_atomic(d / f"step_{int(step)}.json", json.dumps(rec, indent=0, sort_keys=False))


class DamagedEvalRecord(ValueError):
    """An eval record (`<run_dir>/evals/step_<N>.json`) that cannot be read back: `write_eval` writes each one whole
    (atomically), so a truncated, garbled or unreadable one was damaged after it was written. The message is one line
    naming the file, what is wrong and the fix."""


class OldEvalRecord(DamagedEvalRecord):
    """An eval record of an older format: no `eval_layout` (written before 2026-12-04). The message is one line naming
    the file and the fix, `python -m pipelines.upgrade RUN_DIR` (which adds the layout of the run's config)."""


def _eval_files(run_dir, split: str) -> dict[int, Path]:
    """{step: path} of the eval record files of a run's split (by name only, nothing read), ascending steps."""
    d = _evals_dir(run_dir, split)
    if not d.is_dir():
        return {}
    found = {int(m.group(1)): f for f in d.iterdir() if (m := re.match(r"^step_(\d+)\.json$", f.name))}
    return dict(sorted(found.items()))


def read_evals(run_dir, split: str = "eval", upto: int | None = None) -> dict[int, dict]:
    """Every eval record of a run's split ({step: record}, ascending steps; `upto`: those of steps <= upto only,
    the others not opened), each checked to be whole: a JSON
    object whose "step" is the step of its name and that holds "summary" and "episodes" (a record dropped silently
    would move a run's baseline, best or regression check to another eval), and of today's format (its
    `eval_layout`).

    Raises:
        DamagedEvalRecord: a record file unreadable, not valid JSON (e.g. truncated) or not a whole record (names
            the file and the fix: restore it, or move it aside to drop that eval).
        OldEvalRecord: a record without `eval_layout` (names the file and `python -m pipelines.upgrade RUN_DIR`).
    """
    found: dict[int, dict] = {}
    for step, f in _eval_files(run_dir, split).items():
        if upto is not None and step > upto:
            continue
        try:
            rec = json.loads(f.read_text())
            if not isinstance(rec, dict) or int(rec["step"]) != step or not isinstance(rec["summary"], dict) \
                    or not isinstance(rec["episodes"], dict):
                raise ValueError(f"not a whole eval record of step {step} (its \"step\", \"summary\" or "
                                 f"\"episodes\" is missing or wrong)")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            why = " ".join(f"{type(exc).__name__}: {exc}".split())[:200]
            raise DamagedEvalRecord(f"eval record {f} is damaged ({why}); eval records are written whole, so it was "
                                    f"cut or changed since: restore it from a copy, or move it aside (mv {f} "
                                    f"{f}.damaged) and that eval is no longer counted") from None
        if "eval_layout" not in rec:
            raise OldEvalRecord(f"eval record {f} is of an older format (no eval_layout): rewrite its run once with "
                                f"`python -m pipelines.upgrade {Path(run_dir)}`")
        found[step] = rec
    return found


def discard_evals_after(run_dir, step: int) -> list[int]:
    """Remove the eval records of steps > `step`, of every split (a rollback or resume to `step`: those evals belong
    to a superseded timeline; found by name, so a damaged one goes too); returns the removed steps (of either split,
    ascending)."""
    gone: set[int] = set()
    for split in ("eval", "val"):
        for s, f in _eval_files(run_dir, split).items():
            if s > step:
                f.unlink(missing_ok=True)
                gone.add(s)
    return sorted(gone)


def start_checkpoint_eval(model_path) -> tuple[str, dict] | None:
    """The eval record of the checkpoint a run starts from, when its run evaluated it: for `policy.model_path` =
    `<run_dir>/checkpoints/global_step_<N>/hf` (or `<run_dir>/checkpoints/best/hf`, the link resolved to its
    global_step_<N>), the record `<run_dir>/evals/step_<N>.json` (`write_eval`).

    Returns (label, record) with label `run <run dir name> step <N>`, or None: no model_path, not a run's
    checkpoint (e.g. an exported hf dir elsewhere), or that step has no eval record.

    Raises:
        DamagedEvalRecord: an eval record of that run is damaged (`read_evals`)."""
    if not model_path:
        return None
    try:
        hf = Path(model_path).resolve()
    except OSError:
        return None
    ckpt = hf.parent if hf.name == "hf" else hf
    m = re.match(r"^global_step_(\d+)$", ckpt.name)
    if m is None or ckpt.parent.name != "checkpoints":
        return None
    run_dir, step = ckpt.parent.parent, int(m.group(1))
    rec = read_evals(run_dir).get(step)
    return None if rec is None else (f"run {run_dir.name} step {step}", rec)


def eval_layout(cfg) -> dict:
    """How a run's eval episodes are laid out: {"num_envs": env.eval.num_envs, "num_shards": env.num_shards,
    "device": policy.device}, written into every eval record. A policy that draws even when deterministic (a flow
    VLA's initial noise) draws per eval shard from `seeding.eval_torch_seed(eval.seed, shard)` over a batch of its
    envs, on its device's generator, so the same weights on the same episodes score the same only in the same
    layout (measured on LIBERO: one checkpoint 0.65 with 1 eval shard, 0.75 with 2, over the same 20 episodes)."""
    return {"num_envs": int(cfg.env.eval.num_envs), "num_shards": int(cfg.env.num_shards),
            "device": str(cfg.policy.device)}


def pick_baseline(run_evals: Mapping[int, Mapping], start: Mapping | None) -> tuple[str, int | None] | None:
    """Which eval a run's eval gains pair against (the same rule for the runner's `eval/gain_*` and
    benchmarks/recipe.py's table).

    Args:
        run_evals: the run's eval records so far, {step: record} (`read_evals`, the current eval included).
        start: the eval record of the checkpoint the run started from (`start_checkpoint_eval`), or None.

    Returns:
        ("run", 0) when the run evaluated its start (step 0: runner.val_at_start); else ("start", None) when
        `start` played exactly the run's episodes with the same `eval_seed` and `eval_layout` (then the
        deterministic eval of the same weights on the same episodes is the same eval: measured, 200 of 200 episodes
        identical, issue 11); else
        ("run", first step) once the run has two evals; else None (nothing to pair with yet)."""
    if 0 in run_evals:
        return "run", 0
    if start is not None and run_evals:
        first = run_evals[min(run_evals)]
        if (start["eval_seed"] == first["eval_seed"] and start["eval_layout"] == first["eval_layout"]
                and set(map(str, start.get("episodes", {}))) == set(map(str, first.get("episodes", {})))):
            return "start", None
    if len(run_evals) > 1:
        return "run", min(run_evals)
    return None


def improves(value: float, best: float) -> bool:
    """Whether an eval's `value` (higher is better, e.g. success_once) replaces `best` as the run's best (the choice
    of `checkpoints/best`): only a finite value strictly above `best`, or any finite value when `best` is not finite.
    A non-finite value (NaN: no episodes; +-inf: a diverged figure) is never the best."""
    value = float(value)
    return math.isfinite(value) and (not math.isfinite(float(best)) or value > float(best))


def regression(now: Mapping[str, Mapping], first: Mapping[str, Mapping], key: str = "success_once",
               z: float = Z95) -> Comparison | None:
    """The paired comparison of eval `now` against the run's first eval when it is a significant drop (the whole
    interval of now - first below 0), else None. Both are outcome maps (`episode_outcomes`)."""
    c = compare_evals(now, first, key, z)
    return c if c.significant_drop else None


def regression_line(step_now: int, step_first: int | str, c: Comparison) -> str:
    """One warning line naming both evals with their Wilson intervals and the paired interval of the change.
    `step_first`: the baseline's step in this run, or a label (`start_checkpoint_eval`'s, e.g. "run X step 30")."""
    lo_n, hi_n = wilson_interval(round(c.now * c.n), c.n)
    lo_f, hi_f = wilson_interval(round(c.before * c.n), c.n)
    return (f"dagrl: warning: eval regressed significantly: {c.key} at step {step_now} "
            f"{fmt_rate(c.now, lo_n, hi_n)} vs {eval_label(step_first)} {fmt_rate(c.before, lo_f, hi_f)} over {c.n} "
            f"paired episodes: change {fmt_gain(c.diff, c.low, c.high)} (Newcombe 95 % interval entirely below 0)")


def eval_label(step_or_label: int | str) -> str:
    """`step N` for a step of this run, else `the start checkpoint's eval (<label>)`."""
    if isinstance(step_or_label, int):
        return f"step {step_or_label}"
    return f"the start checkpoint's eval ({step_or_label})"


# ----- the eval decisions of a run (pure functions of eval records; the runner and pipelines.eval use them) -----
def split_metrics(episodes: Sequence[Mapping], split: str = "eval") -> tuple[dict[str, float], dict[str, dict]]:
    """What one eval of split `split` ("eval" or "val") scores, from its finished-episode dicts (keys "seed" and
    OUTCOMES): (metrics, outcomes). metrics: `<split>/<outcome>` (the means over the episodes of every OUTCOMES
    key: success rates in [0, 1], return, episode_len in chunk steps), `<split>/<rate>_ci_low` / `_ci_high` (the
    Wilson 95 % interval of each of RATES) and `<split>/num_episodes`, floats; outcomes: `episode_outcomes`.

    Raises:
        ValueError: two episodes share a seed (`episode_outcomes`)."""
    outcomes = episode_outcomes(episodes)
    m = {f"{split}/{k}": float(np.mean([e[k] for e in episodes])) for k in OUTCOMES}
    summary = rate_summary(outcomes)
    for key in RATES:
        m[f"{split}/{key}_ci_low"], m[f"{split}/{key}_ci_high"] = summary[f"{key}_ci_low"], summary[f"{key}_ci_high"]
    m[f"{split}/num_episodes"] = float(len(episodes))
    return m, outcomes


def check_fixed_episodes(outcomes: Mapping, seed: int, n: int, *, what: str, key: str) -> None:
    """An eval played exactly its fixed episodes: the seeds `seed + i`, i < n (what makes two evals paired).

    Raises:
        RuntimeError: `<what>: expected the n episodes with seeds <key> + i = ...; missing [...], unexpected [...]`
            (a bug: evals would not be paired)."""
    expected = {str(seed + i) for i in range(n)}
    if set(map(str, outcomes)) != expected:
        got = set(map(str, outcomes))
        missing, extra = sorted(expected - got, key=int), sorted(got - expected, key=int)
        raise RuntimeError(f"{what}: expected the {n} episodes with seeds {key} + i = {seed}..{seed + n - 1}; "
                           f"missing {missing[:5]}, unexpected {extra[:5]}")


def baseline(run_evals: Mapping[int, Mapping], start: tuple[str, Mapping] | None,
             step: int, *, warm_start: bool) -> tuple[dict, int | str] | None:
    """The eval that the run's eval at `step` pairs its gain against (`pick_baseline`'s rule): (its outcome map,
    its label: a step of this run, or the start checkpoint's label), or None when there is nothing to pair with,
    the eval at `step` is the baseline itself, or the run did not start from a checkpoint (`warm_start` False:
    no `policy.model_path`; a gain of an RL run from scratch over its own first eval says nothing of what training
    from a start did, so such a run reports no gain and no regression).

    Args:
        run_evals: {step: record} of the run's evals (its timeline), the one at `step` included.
        start: `start_checkpoint_eval(policy.model_path)`: (label, record), or None.
        warm_start: the run's weights started from a checkpoint (`policy.model_path` set; a resumed run keeps its
            config's)."""
    if not warm_start:
        return None
    base = pick_baseline(run_evals, None if start is None else start[1])
    if base is None or base == ("run", step):
        return None
    if base[0] == "start":
        return dict(start[1]["episodes"]), start[0]
    return dict(run_evals[base[1]]["episodes"]), base[1]


def gain_metrics(outcomes: Mapping, before: Mapping, key: str = "success_once") -> tuple[dict[str, float], Comparison]:
    """The paired gain of an eval (`outcomes`) over its baseline (`before`), both outcome maps: (`eval/gain_<key>`,
    `_ci_low`, `_ci_high`: the difference of rates in [-1, 1] and its Newcombe 95 % interval; the Comparison, whose
    `significant_drop` is the regression warning's test)."""
    c = compare_evals(outcomes, before, key)
    return {f"eval/gain_{key}": c.diff, f"eval/gain_{key}_ci_low": c.low, f"eval/gain_{key}_ci_high": c.high}, c


def best_after(value: float, best: tuple[float, int], step: int) -> tuple[float, int]:
    """The run's best (value, step) after an eval scoring `value` at `step` (`improves`: the first step of the
    highest finite value; a non-finite value never)."""
    return (float(value), int(step)) if improves(value, best[0]) else (best[0], best[1])


def best_unmarked(best: tuple[int, float, str], step: int, marked: Mapping | None) -> bool:
    """Whether a checkpoint of `step` must be written and marked best: the best eval (`best` = (step, value,
    metric), `RunState.best`) is at `step` and the marked best (`marked`, storage.checkpoints.read_best's record:
    "step", "value", "metric"; None: none marked) is not that one."""
    best_step, value, metric = best
    if best_step != step:
        return False
    return marked is None or int(marked["step"]) != step or marked.get("value") != value \
        or marked.get("metric") != metric
