"""tasks.evalstats: Wilson intervals and Newcombe's paired interval (published values, hand-worked cases, coverage by
simulation). Pure numpy, < 2 s."""
import json
import math
import re

import numpy as np
import pytest

from tasks.evalstats import (DamagedEvalRecord, compare_evals, discard_evals_after, episode_outcomes, fmt_gain, fmt_rate,
                             paired_diff_interval, paired_diff_interval_counts, rate_summary, read_evals, regression,
                             regression_line, wilson_interval, write_eval)


@pytest.mark.parametrize("k,n,low,high", [
    # Newcombe (1998), "Two-sided confidence intervals for the single proportion", Table II, method 3 (Wilson)
    (81, 263, 0.2553, 0.3662), (15, 148, 0.0624, 0.1605), (0, 20, 0.0, 0.1611), (1, 29, 0.0061, 0.1718)])
def test_wilson_published_values(k, n, low, high):
    lo, hi = wilson_interval(k, n)
    assert lo == pytest.approx(low, abs=6e-5) and hi == pytest.approx(high, abs=6e-5)


def test_wilson_hand_computed():
    # k=5, n=10, z=2: center = (0.5 + 4/20) / (1 + 4/10) = 0.5; half = 2/1.4 * sqrt(0.025 + 4/400) = 0.26726
    lo, hi = wilson_interval(5, 10, z=2.0)
    half = 2 / 1.4 * math.sqrt(0.025 + 0.01)
    assert (lo, hi) == pytest.approx((0.5 - half, 0.5 + half), abs=1e-12)
    # k=0, n=4, z=2: center = (0 + 0.5) / 2 = 0.25, half = 2/2 * sqrt(4/64) = 0.25 -> [0, 0.5]
    assert wilson_interval(0, 4, z=2.0) == pytest.approx((0.0, 0.5), abs=1e-12)
    assert wilson_interval(4, 4, z=2.0) == pytest.approx((0.5, 1.0), abs=1e-12)


def test_wilson_edges_and_errors():
    assert wilson_interval(0, 0) == (0.0, 1.0)
    for n in (1, 7, 48, 200):
        prev = None
        for k in range(n + 1):
            lo, hi = wilson_interval(k, n)
            assert 0 <= lo <= k / n <= hi <= 1
            if prev is not None:  # monotone in k
                assert lo >= prev[0] and hi >= prev[1]
            prev = (lo, hi)
            assert wilson_interval(n - k, n) == pytest.approx((1 - hi, 1 - lo), abs=1e-12)  # symmetric
    assert wilson_interval(0.4375 * 48, 48) == wilson_interval(21, 48)  # a mean times n
    for bad in [(3, 2), (-1, 5), (1.5, 5), (1, -1)]:
        with pytest.raises(ValueError):
            wilson_interval(*bad)
    # 200 episodes at p ~ 0.44: about +-7 points (the claim); 48: about +-14
    lo, hi = wilson_interval(88, 200)
    assert 0.06 < (hi - lo) / 2 < 0.075
    lo, hi = wilson_interval(21, 48)
    assert 0.12 < (hi - lo) / 2 < 0.15


def test_paired_published_example():
    # Fagerland, Lydersen & Laake (2017) ch. 8: Cavo et al. (2012), table [[59, 6], [16, 80]]:
    # "Newcombe square-and-add CI: estimate = -0.0621 (95% CI -0.1186 to -0.0046)"
    d, lo, hi = paired_diff_interval_counts(59, 6, 16, 80)
    assert (d, lo, hi) == pytest.approx((-0.0621, -0.1186, -0.0046), abs=6e-5)


def test_paired_hand_worked():
    # identical outcomes, a = d = 5, n = 10: diff 0; A = ad - bc = 25 > n/2 -> A' = 20; marginals 5*5*5*5 -> phi
    # = 20/25 = 0.8; Wilson(5, 10) = [0.23659, 0.76341] (p - l = u - p = 0.26341):
    # low = -sqrt(2 (1 - 0.8)) * 0.26341 = -0.16660, high = +0.16660
    d, lo, hi = paired_diff_interval([1] * 5 + [0] * 5, [1] * 5 + [0] * 5)
    l, u = wilson_interval(5, 10)
    assert l == pytest.approx(0.23659, abs=1e-5)
    assert d == 0 and lo == pytest.approx(-math.sqrt(0.4) * 0.26341, abs=1e-4) and hi == pytest.approx(-lo)
    # the same table with the order of episodes shuffled: the same interval (only the 2x2 table counts)
    rng = np.random.default_rng(0)
    now = rng.integers(0, 2, 50)
    before = rng.integers(0, 2, 50)
    perm = rng.permutation(50)
    assert paired_diff_interval(now, before) == pytest.approx(paired_diff_interval(now[perm], before[perm]))
    # swapping the evals negates the interval
    d1, l1, h1 = paired_diff_interval(now, before)
    d2, l2, h2 = paired_diff_interval(before, now)
    assert (d2, l2, h2) == pytest.approx((-d1, -h1, -l1))
    # pairing narrows the interval when outcomes are correlated: 40 shared successes of 100, 10 more in `now`
    d, lo, hi = paired_diff_interval_counts(40, 10, 0, 50)
    wn, wb = wilson_interval(50, 100), wilson_interval(40, 100)
    unpaired_low = 0.1 - math.sqrt((0.5 - wn[0]) ** 2 + (wb[1] - 0.4) ** 2)  # Newcombe's independent method 10
    assert d == pytest.approx(0.1) and unpaired_low < 0 < lo < d < hi


def test_paired_edges_and_errors():
    assert paired_diff_interval([], []) == (0.0, -1.0, 1.0)
    assert paired_diff_interval_counts(0, 0, 0, 0) == (0.0, -1.0, 1.0)
    d, lo, hi = paired_diff_interval([1, 1, 1], [0, 0, 0])
    assert d == 1 and -1 <= lo < 1 and hi == 1
    for bad in [([1, 0], [1]), ([2, 0], [1, 0]), ([[1]], [[1]])]:
        with pytest.raises(ValueError):
            paired_diff_interval(*bad)
    with pytest.raises(ValueError):
        paired_diff_interval_counts(-1, 0, 0, 1)
    # every table of n = 12: the interval holds the estimate and stays in [-1, 1]
    n = 12
    for a in range(n + 1):
        for b in range(n + 1 - a):
            for c in range(n + 1 - a - b):
                d, lo, hi = paired_diff_interval_counts(a, b, c, n - a - b - c)
                assert -1 <= lo <= d <= hi <= 1 and d == pytest.approx((b - c) / n)


@pytest.mark.parametrize("probs,n", [((0.35, 0.20, 0.10, 0.35), 200),  # p_now 0.55, p_before 0.45: gain +0.10
                                     ((0.40, 0.04, 0.04, 0.52), 200),  # no gain, strongly correlated
                                     ((0.20, 0.10, 0.15, 0.55), 48)])  # a loss of 0.05 on 48 episodes
def test_paired_coverage_by_simulation(probs, n):
    rng = np.random.default_rng(1234)
    true = probs[1] - probs[2]
    reps = 3000
    tables = rng.multinomial(n, probs, size=reps)
    hits = sum(lo <= true <= hi for _, lo, hi in (paired_diff_interval_counts(*map(int, t)) for t in tables))
    cov = hits / reps
    assert 0.93 <= cov <= 0.975, cov  # nominal 0.95 (Newcombe: method 10 is close to nominal, slightly above)


def test_wilson_coverage_by_simulation():
    rng = np.random.default_rng(7)
    for p, n in [(0.44, 200), (0.1, 48), (0.7, 48)]:
        ks = rng.binomial(n, p, size=3000)
        cov = np.mean([lo <= p <= hi for lo, hi in (wilson_interval(int(k), n) for k in ks)])
        assert 0.92 <= cov <= 0.98, (p, n, cov)


def test_compare_evals_pairs_by_seed():
    before = {"100": {"success_once": True}, "101": {"success_once": False}, "102": {"success_once": False},
              "103": {"success_once": True}}
    now = {101: {"success_once": True}, 102: {"success_once": True}, 100: {"success_once": True},
           999: {"success_once": False}}  # int keys, a seed the other eval lacks (ignored)
    c = compare_evals(now, before)
    assert c.n == 3 and c.now == 1.0 and c.before == pytest.approx(1 / 3) and c.diff == pytest.approx(2 / 3)
    assert (c.diff, c.low, c.high) == pytest.approx(paired_diff_interval([1, 1, 1], [1, 0, 0]))
    assert compare_evals({}, before).n == 0
    drop = compare_evals({str(i): {"success_once": i >= 150} for i in range(200)},
                         {str(i): {"success_once": i >= 80} for i in range(200)})
    assert drop.diff == pytest.approx(-0.35) and drop.significant_drop and not drop.significant_gain


def test_formats():
    assert fmt_rate(0.4375, 0.3, 0.58, 48) == "0.438 [0.30, 0.58] over 48 episodes"
    assert fmt_rate(0.5, 0.25, 0.75) == "0.500 [0.25, 0.75]"
    assert fmt_gain(0.125, 0.03, 0.22) == "+0.125 [+0.03, +0.22]"
    assert fmt_gain(-0.1, -0.2, 0.01) == "-0.100 [-0.20, +0.01]"


def _episodes(successes, base=1000):
    return [{"seed": base + i, "episode_id": i, "success_once": bool(s), "success_at_end": bool(s) and i % 2 == 0,
             "return": float(i), "episode_len": 50} for i, s in enumerate(successes)]


def test_episode_outcomes_and_summary():
    eps = _episodes([1, 0, 1, 1])[::-1]  # any order: keyed and sorted by seed
    out = episode_outcomes(eps)
    assert list(out) == ["1000", "1001", "1002", "1003"]
    assert out["1001"] == {"success_once": False, "success_at_end": False, "return": 1.0, "episode_len": 50}
    summ = rate_summary(out)
    assert summ["num_episodes"] == 4 and summ["success_once"] == 0.75 and summ["success_at_end"] == 0.5
    assert (summ["success_once_ci_low"], summ["success_once_ci_high"]) == wilson_interval(3, 4)
    assert (summ["success_at_end_ci_low"], summ["success_at_end_ci_high"]) == wilson_interval(2, 4)
    with pytest.raises(ValueError, match="seed 1000 occurs twice"):
        episode_outcomes(eps + eps[-1:])


LAYOUT = {"eval_layout": {"num_envs": 4, "num_shards": 1, "device": "cpu"}}  # what the runner writes (eval_layout)


def test_eval_records_write_read_discard(tmp_path):
    for step, succ in [(0, [0, 0, 1, 0]), (4, [1, 0, 1, 0]), (8, [1, 1, 1, 0])]:
        write_eval(tmp_path, step, episode_outcomes(_episodes(succ)), {"run_id": "r", **LAYOUT})
    write_eval(tmp_path, 4, episode_outcomes(_episodes([1, 1, 1, 1])), LAYOUT)  # a redone step replaces its record
    recs = read_evals(tmp_path)
    assert list(recs) == [0, 4, 8]
    assert recs[4]["summary"]["success_once"] == 1.0 and recs[0]["run_id"] == "r" and recs[8]["step"] == 8
    assert not [p for p in (tmp_path / "evals").iterdir() if p.name.startswith(".")]  # no temporary file left
    bad = tmp_path / "evals" / "step_9.json"
    bad.write_text("{truncated")  # damaged after it was written: never skipped silently
    with pytest.raises(DamagedEvalRecord, match=rf"eval record {re.escape(str(bad))} is damaged .*mv "):
        read_evals(tmp_path)
    assert discard_evals_after(tmp_path, 4) == [8, 9]  # superseded records go by name, a damaged one too
    assert list(read_evals(tmp_path)) == [0, 4]
    assert read_evals(tmp_path / "none") == {}


@pytest.mark.parametrize("damage", ["truncated", "empty", "not a record", "another step", "no episodes"])
def test_damaged_eval_record_is_one_line_naming_the_file(tmp_path, damage):
    """Issue 47 item 2: every kind of damage to a record read back (truncated by a copy, emptied, replaced) is one
    line naming that file and the fix; the whole records beside it are not enough to hide it."""
    write_eval(tmp_path, 0, episode_outcomes(_episodes([1, 0])), LAYOUT)
    path = write_eval(tmp_path, 4, episode_outcomes(_episodes([1, 1])), LAYOUT)
    text = path.read_text()
    rec = json.loads(text)
    path.write_text({"truncated": text[: len(text) // 2], "empty": "", "not a record": "[1, 2]",
                     "another step": json.dumps({**rec, "step": 5}),
                     "no episodes": json.dumps({k: v for k, v in rec.items() if k != "episodes"})}[damage])
    with pytest.raises(DamagedEvalRecord) as err:
        read_evals(tmp_path)
    msg = str(err.value)
    assert "\n" not in msg and str(path) in msg and "restore it" in msg and f"mv {path} {path}.damaged" in msg


def test_regression_decision_and_line():
    first = episode_outcomes(_episodes([1] * 30 + [0] * 18))  # 0.625 on 48
    same = episode_outcomes(_episodes([1] * 30 + [0] * 18))
    assert regression(same, first) is None
    slight = episode_outcomes(_episodes([1] * 26 + [0] * 22))  # -4 points: within noise
    assert regression(slight, first) is None
    worse = episode_outcomes(_episodes([1] * 15 + [0] * 33))  # the 15 lost episodes were all solved before
    c = regression(worse, first)
    assert c is not None and c.diff == pytest.approx(-15 / 48) and c.high < 0
    line = regression_line(12, 0, c)
    assert "\n" not in line and line.startswith("dagrl: warning: eval regressed")
    assert f"step 12 {fmt_rate(15 / 48, *wilson_interval(15, 48))}" in line
    assert f"step 0 {fmt_rate(30 / 48, *wilson_interval(30, 48))}" in line
    assert fmt_gain(c.diff, c.low, c.high) in line and "48 paired episodes" in line
    # a gain is never a regression
    assert regression(first, worse) is None


class _ToyEnv:
    """A SingleEnv whose episodes end (truncated) after 5-7 steps, successful for seeds divisible by 4."""

    obs_dim, action_dim, image_shape = 3, 2, None

    def reset(self, seed):
        self.seed, self.t = int(seed), 0
        return np.full(3, seed % 7, np.float32)

    def step(self, action):
        self.t += 1
        return np.full(3, self.t, np.float32), 0.1, False, self.t >= 5 + self.seed % 3, self.seed % 4 == 0

    def close(self):
        pass


@pytest.mark.parametrize("conf", ["pushcube_pi0_grpo", "pushcube_pi0_ppo", "pushcube_pi0_sft"])
def test_vla_confs_eval_200_fixed_episodes(conf, monkeypatch, tmp_path):
    """env.eval.num_episodes=200 (and 203: not a multiple of eval.num_envs) with the VLA confs: every eval plays
    exactly the episodes with reset seeds env.eval.seed + i, i < num_episodes, the same at every call (the real
    tasks.rollout.evaluate per eval shard, on toy envs and a zero policy: no simulator, no model)."""
    from types import SimpleNamespace

    from pipelines.config import load_config
    from tasks import rollout
    from tasks.envs import EnvShard

    def toy_shard(cfg_env, *, shard, num_shards, num_envs, auto_reset, ignore_terminations, base_seed, **_):
        size = num_envs // num_shards
        return EnvShard([_ToyEnv() for _ in range(size)], env_offset=shard * size, num_envs_total=num_envs,
                        base_seed=base_seed, auto_reset=auto_reset, ignore_terminations=ignore_terminations)

    monkeypatch.setattr(rollout, "make_shard", toy_shard)
    monkeypatch.setattr(rollout, "get_replica", lambda *a, **k: SimpleNamespace(module=None))
    monkeypatch.setattr(rollout, "policy_obs", lambda module, state, rgb, instr, task_id=None: state)
    for n in (200, 203):
        (tmp_path / "demos.zarr").mkdir(exist_ok=True)
        (tmp_path / "demos.zarr" / "zarr.json").write_text("{}")  # the SFT conf's store check only
        extra = [f"sft.store={tmp_path / 'demos.zarr'}"] if conf.endswith("sft") else ["policy.model_path=null"]
        cfg, _ = load_config([f"conf={conf}", f"env.eval.num_episodes={n}", *extra], components=False)
        C = cfg.policy.num_action_chunks
        monkeypatch.setattr(rollout, "_act", lambda rep, obs, deterministic=False: {
            "actions": np.zeros((len(obs), C, 2), np.float32)})
        ev = cfg.env.eval
        seen = []
        for call in range(2):  # two evals: the same episodes (the eval shards are reused, as on the workers)
            eps = [e for s in range(cfg.env.num_shards)
                   for e in rollout.evaluate(cfg, f"test-{conf}-{n}", s, {"version": 0})]
            outcomes = episode_outcomes(eps)
            assert list(outcomes) == [str(ev.seed + i) for i in range(n)]
            assert sorted(e["episode_id"] for e in eps) == list(range(n))
            seen.append(outcomes)
        assert seen[0] == seen[1]
        assert rate_summary(seen[0])["success_once"] == pytest.approx(sum((ev.seed + i) % 4 == 0 for i in range(n)) / n)


def test_a_non_finite_eval_value_is_never_the_best():
    """checkpoints/best follows `improves`: a finite value strictly above the best so far; NaN (no episodes) and
    +-inf (a diverged figure) never replace it, and a finite value replaces a non-finite best."""
    from tasks.evalstats import improves
    assert improves(0.5, -1.0) and improves(0.75, 0.5) and not improves(0.5, 0.5) and not improves(0.25, 0.5)
    for bad in (math.nan, math.inf, -math.inf):
        assert not improves(bad, -1.0) and not improves(bad, 0.5)
        assert improves(0.0, bad)


# ----- the eval decisions as pure functions of eval records (the runner's and pipelines.eval's) -----
def _finished(spec, base=1_000_000):
    """Finished-episode dicts from (success_once, success_at_end, return, episode_len) tuples, seeds base + i."""
    return [{"seed": base + i, "success_once": so, "success_at_end": se, "return": r, "episode_len": n}
            for i, (so, se, r, n) in enumerate(spec)]


def test_split_metrics_are_the_means_and_wilson_intervals_of_the_episodes():
    from tasks.evalstats import split_metrics
    eps = _finished([(True, False, 2.0, 10), (True, True, 4.0, 20), (False, False, 0.0, 30), (True, True, 6.0, 40)])
    m, outcomes = split_metrics(eps, "val")
    # 3 of 4 succeed once, 2 of 4 at the end; returns 2, 4, 0, 6 -> 3; lengths 10..40 -> 25
    assert (m["val/success_once"], m["val/success_at_end"], m["val/return"], m["val/episode_len"]) == (0.75, 0.5, 3, 25)
    assert (m["val/success_once_ci_low"], m["val/success_once_ci_high"]) == wilson_interval(3, 4)
    assert (m["val/success_at_end_ci_low"], m["val/success_at_end_ci_high"]) == wilson_interval(2, 4)
    assert m["val/num_episodes"] == 4.0 and list(outcomes) == [str(1_000_000 + i) for i in range(4)]
    assert outcomes == episode_outcomes(eps)
    with pytest.raises(ValueError, match="occurs twice"):
        split_metrics(eps + eps[:1])


def test_check_fixed_episodes_names_the_missing_and_unexpected_seeds():
    from tasks.evalstats import check_fixed_episodes
    outcomes = {str(100 + i): {} for i in range(4)}
    check_fixed_episodes(outcomes, 100, 4, what="eval at step 2", key="env.eval.seed")  # exactly seeds 100..103
    with pytest.raises(RuntimeError) as exc:
        check_fixed_episodes({**outcomes, "107": {}}, 101, 4, what="eval at step 2", key="env.eval.seed")
    assert str(exc.value) == ("eval at step 2: expected the 4 episodes with seeds env.eval.seed + i = 101..104; "
                              "missing ['104'], unexpected ['100', '107']")


def test_gain_metrics_are_the_paired_difference_and_its_interval():
    from tasks.evalstats import gain_metrics
    before = episode_outcomes(_finished([(True, True, 0.0, 1)] * 5 + [(False, False, 0.0, 1)] * 5))
    now = episode_outcomes(_finished([(True, True, 0.0, 1)] * 8 + [(False, False, 0.0, 1)] * 2))
    m, c = gain_metrics(now, before)
    # pairs: 5 both succeed, 3 only now, 0 only before, 2 neither: +3 of 10
    assert c.diff == pytest.approx(0.3) and (c.diff, c.low, c.high) == paired_diff_interval_counts(5, 3, 0, 2)
    assert m == {"eval/gain_success_once": c.diff, "eval/gain_success_once_ci_low": c.low,
                 "eval/gain_success_once_ci_high": c.high}


def test_best_after_keeps_the_first_step_of_the_highest_finite_value():
    from tasks.evalstats import best_after
    best = (-1.0, -1)
    for step, value in enumerate([0.25, 0.5, 0.5, math.nan, 0.25, math.inf, 0.75]):
        best = best_after(value, best, step)
        assert best == {0: (0.25, 0), 1: (0.5, 1), 2: (0.5, 1), 3: (0.5, 1), 4: (0.5, 1), 5: (0.5, 1),
                        6: (0.75, 6)}[step]


def test_best_unmarked_only_at_the_best_step_and_until_marked():
    from tasks.evalstats import best_unmarked
    best = (8, 0.5, "eval/success_once")
    assert best_unmarked(best, 8, None)  # a new best at this step, nothing marked
    assert not best_unmarked(best, 9, None)  # the best is at another step
    assert not best_unmarked(best, 8, {"step": 8, "value": 0.5, "metric": "eval/success_once"})  # marked already
    assert best_unmarked(best, 8, {"step": 4, "value": 0.4, "metric": "eval/success_once"})  # an older best marked
    assert best_unmarked(best, 8, {"step": 8, "value": 0.5, "metric": "val/success_once"})  # marked by another split
    assert not best_unmarked((-1, -1.0, "eval/success_once"), 0, None)  # no eval yet: nothing to mark
