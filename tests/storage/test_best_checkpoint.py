"""storage.checkpoints: the best pointer (best.json + the `best` link), pruning that never removes it, and
sync_best after a resume / rollback. Tiny checkpoints, no cluster, ~1 s."""
import json
import os

import pytest

from storage.checkpoints import (BEST_FILE, BEST_LINK, best_checkpoint, checkpoint_dir, clear_best,
                                 latest_checkpoint, list_checkpoints, mark_best, prune_checkpoints, read_best,
                                 save_checkpoint, sync_best)


def _save(run_dir, step):
    return save_checkpoint(run_dir, step, {"run": {"step": step}})


def _steps(run_dir):
    return [int(p.name.rsplit("_", 1)[1]) for p in list_checkpoints(run_dir)]


def test_mark_best_writes_pointer_and_link(tmp_path):
    _save(tmp_path, 4)
    path = mark_best(tmp_path, 4, 0.625)
    assert path == checkpoint_dir(tmp_path, 4) == best_checkpoint(tmp_path)
    rec = json.loads((tmp_path / "checkpoints" / BEST_FILE).read_text())
    assert rec["step"] == 4 and rec["checkpoint"] == "global_step_4" and rec["value"] == 0.625
    link = tmp_path / "checkpoints" / BEST_LINK
    assert link.is_symlink() and os.readlink(link) == "global_step_4"  # relative: survives moving the run dir
    assert (link / "index.json").is_file()
    # no temp files left behind; the link is not mistaken for a checkpoint
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [BEST_LINK, BEST_FILE, "global_step_4"]
    assert _steps(tmp_path) == [4] and latest_checkpoint(tmp_path).name == "global_step_4"
    # re-pointing replaces both
    _save(tmp_path, 8)
    mark_best(tmp_path, 8, 0.7)
    assert read_best(tmp_path)["step"] == 8 and os.readlink(link) == "global_step_8"


def test_mark_best_refuses_a_missing_checkpoint(tmp_path):
    _save(tmp_path, 2)
    mark_best(tmp_path, 2, 0.5)
    with pytest.raises(ValueError, match="step 3"):
        mark_best(tmp_path, 3, 0.9)
    assert read_best(tmp_path)["step"] == 2  # unchanged


@pytest.mark.parametrize("keep", [0, 1, 2, 3])
def test_prune_never_removes_the_best(tmp_path, keep):
    steps = [0, 4, 8, 12, 16]
    for best in (4, 0, 16, 12):
        for s in steps:
            if not checkpoint_dir(tmp_path, s).exists():
                _save(tmp_path, s)
        mark_best(tmp_path, best, 0.5)
        removed = prune_checkpoints(tmp_path, keep)
        expected = sorted(set(steps[len(steps) - keep:] if keep else []) | {best})
        assert _steps(tmp_path) == expected, (best, keep)
        assert best_checkpoint(tmp_path).name == f"global_step_{best}"
        assert sorted(int(p.name.rsplit("_", 1)[1]) for p in removed) == [s for s in steps if s not in expected]
    # without a pointer pruning keeps exactly the newest `keep`
    clear_best(tmp_path)
    for s in steps:
        if not checkpoint_dir(tmp_path, s).exists():
            _save(tmp_path, s)
    prune_checkpoints(tmp_path, keep)
    assert _steps(tmp_path) == (steps[len(steps) - keep:] if keep else [])


def test_prune_keeps_newest_plus_best_exactly(tmp_path):
    for s in range(0, 24, 4):
        _save(tmp_path, s)
        if s == 4:
            mark_best(tmp_path, 4, 0.6)
        prune_checkpoints(tmp_path, 2)
    assert _steps(tmp_path) == [4, 16, 20]


def test_best_pointer_to_a_removed_or_incomplete_checkpoint_is_none(tmp_path):
    p = _save(tmp_path, 3)
    mark_best(tmp_path, 3, 0.4)
    (p / "index.json").unlink()  # incomplete now
    assert read_best(tmp_path)["step"] == 3 and best_checkpoint(tmp_path) is None
    (tmp_path / "checkpoints" / BEST_FILE).write_text("{not json")
    assert read_best(tmp_path) is None and best_checkpoint(tmp_path) is None
    assert best_checkpoint(tmp_path / "nowhere") is None


def test_sync_best_after_rollback_and_resume(tmp_path):
    for s in (4, 8, 12):
        _save(tmp_path, s)
    mark_best(tmp_path, 12, 0.7)
    # a rollback to step 8 whose state says the best was step 4: the best of the superseded timeline goes
    assert sync_best(tmp_path, 4, 0.55) == checkpoint_dir(tmp_path, 4)
    assert read_best(tmp_path)["step"] == 4 and read_best(tmp_path)["value"] == 0.55
    assert os.readlink(tmp_path / "checkpoints" / BEST_LINK) == "global_step_4"
    # a state whose best step has no checkpoint (a run from before best checkpoints) or no best at all: no pointer
    assert sync_best(tmp_path, 6, 0.6) is None
    assert read_best(tmp_path) is None and not (tmp_path / "checkpoints" / BEST_LINK).is_symlink()
    mark_best(tmp_path, 8, 0.6)
    assert sync_best(tmp_path, -1, -1.0) is None and read_best(tmp_path) is None
    # a resume whose state agrees with the pointer leaves it as it is
    mark_best(tmp_path, 8, 0.6)
    before = (tmp_path / "checkpoints" / BEST_FILE).read_text()
    assert sync_best(tmp_path, 8, 0.6) == checkpoint_dir(tmp_path, 8)
    assert (tmp_path / "checkpoints" / BEST_FILE).read_text() == before
    # a pointer whose link went missing is repaired
    (tmp_path / "checkpoints" / BEST_LINK).unlink()
    sync_best(tmp_path, 8, 0.6)
    assert os.readlink(tmp_path / "checkpoints" / BEST_LINK) == "global_step_8"


# ----- the runner's use of it (no cluster): the eval decisions are pure functions of eval records
# (tasks.evalstats), the one timeline on disk is the run context's -----

class _FakeClient:
    def __init__(self):
        self.tags = {}

    def set_tag(self, run_id, key, value):
        self.tags[(run_id, key)] = value


def _context(run_dir, step, best_step=-1, best=-1.0, val=False):
    """A RunContext of a run at `step` in `run_dir` (its best eval `best` at `best_step`; a validation split when
    `val`), nothing opened."""
    from types import SimpleNamespace

    from pipelines.runner.context import RunContext
    from pipelines.runner.setup import RunState
    st = RunState(run_id="r1", step=step, best_eval_step=best_step, best_eval_success_once=best)
    cfg = SimpleNamespace(run_root=str(run_dir), env=SimpleNamespace(eval=SimpleNamespace(val_episodes=int(val))))
    ctx = RunContext(cfg, st)
    ctx.run_dir = run_dir
    return ctx


def _best_unmarked(ctx) -> bool:
    from tasks.evalstats import best_unmarked
    return best_unmarked(ctx.state.best(ctx.has_val), ctx.state.step, read_best(ctx.run_dir))


def _outcomes(successes, base=1_000_000):
    from tasks.evalstats import episode_outcomes
    return episode_outcomes([{"seed": base + i, "success_once": bool(s), "success_at_end": bool(s), "return": 0.0,
                              "episode_len": 50} for i, s in enumerate(successes)])


def test_runner_regression_warning_and_tag(tmp_path):
    from types import SimpleNamespace

    from pipelines.runner.evals import Evaluator
    from pipelines.runner.setup import RunState
    from tasks.evalstats import gain_metrics
    first = _outcomes([1] * 30 + [0] * 18)
    said = []
    tracker = SimpleNamespace(run_id="mlf1", client=_FakeClient())
    st = RunState(run_id="r1", step=8)
    evaluator = Evaluator(None, st, ctx=SimpleNamespace(run_dir=tmp_path, tracker=tracker), sched=None, perf=None,
                          echo=said.append)
    m, c = gain_metrics(_outcomes([1] * 27 + [0] * 21), first)  # -3 of 48: noise
    assert not c.significant_drop and tracker.client.tags == {}
    assert m["eval/gain_success_once"] == pytest.approx(-3 / 48)
    assert m["eval/gain_success_once_ci_low"] < m["eval/gain_success_once"] < 0 < m["eval/gain_success_once_ci_high"]
    st.step = 12
    m, c = gain_metrics(_outcomes([1] * 12 + [0] * 36), first)
    assert c.significant_drop and m["eval/gain_success_once_ci_high"] < 0
    evaluator._warn_regression(c, 0)
    assert len(said) == 1 and "step 12" in said[0] and "vs step 0" in said[0]
    assert tracker.client.tags == {("mlf1", "dagrl.regression"): "step 12"}
    evaluator._warn_regression(c, "run 20261201-1 step 30")  # against the start checkpoint's eval
    assert "vs the start checkpoint's eval (run 20261201-1 step 30)" in said[1]


LAYOUT = {"num_envs": 2, "num_shards": 1, "device": "cpu"}  # an eval layout (tasks.evalstats.eval_layout)


def _sft_run(root, step, outcomes, eval_seed=1_000_000):
    """A finished SFT run dir with an hf export at `step` and its eval record; returns the hf path."""
    from tasks.evalstats import write_eval
    run = root / "sft" / "20261201-0000-sft1"
    hf = run / "checkpoints" / f"global_step_{step}" / "hf"
    hf.mkdir(parents=True)
    write_eval(run, step, outcomes, {"run_id": run.name, "eval_seed": eval_seed, "eval_layout": LAYOUT})
    return hf


def test_runner_baseline_is_step0_else_the_start_checkpoints_eval_else_the_first(tmp_path):
    """tasks.evalstats.baseline (pick_baseline's rule with the start checkpoint's eval, start_checkpoint_eval): the
    rule of the eval gains (and of benchmarks/recipe.py's table)."""
    from tasks.evalstats import OldEvalRecord, baseline, start_checkpoint_eval, write_eval
    sft = _outcomes([1] * 20 + [0] * 28)
    hf = _sft_run(tmp_path, 30, sft)
    now = _outcomes([1] * 30 + [0] * 18)

    def base(model_path, step, run_evals):  # what the runner's eval at `step` pairs with (policy.model_path)
        return baseline(run_evals, start_checkpoint_eval(model_path and str(model_path)), step,
                        warm_start=model_path is not None)

    rec = lambda o, seed=1_000_000: {"eval_seed": seed, "eval_layout": LAYOUT, "episodes": o}  # noqa: E731
    # val_at_start=false: the first eval (step 6) pairs with the SFT run's eval of the checkpoint it started from
    before, label = base(hf, 6, {6: rec(now)})
    assert before == sft and label == "run 20261201-0000-sft1 step 30"
    # the best link resolves to the same checkpoint
    (hf.parent.parent / "best").symlink_to("global_step_30")
    assert base(hf.parent.parent / "best" / "hf", 6, {6: rec(now)})[1] == label
    # a step-0 eval of the run itself comes first; the step-0 eval is nobody's gain
    zero = _outcomes([1] * 25 + [0] * 23)
    assert base(hf, 6, {0: rec(zero), 6: rec(now)}) == (zero, 0)
    assert base(hf, 0, {0: rec(zero)}) is None
    # other episodes (or another eval seed) than the SFT eval's: not paired; the run's first eval from its second on
    other = _outcomes([1] * 30 + [0] * 18, base=2_000_000)
    assert base(hf, 6, {6: rec(other, 2_000_000)}) is None
    assert base(hf, 12, {6: rec(other, 2_000_000), 12: rec(other, 2_000_000)}) == (other, 6)
    assert base(hf, 6, {6: rec(now, 7)}) is None  # same seeds, another eval_seed: refused
    # the same episodes in another eval layout (eval envs / shards): the ODE's noise draws differ: not the same eval
    lay = lambda o, n: {**rec(o), "eval_layout": {**LAYOUT, "num_shards": n}}  # noqa: E731
    assert base(hf, 6, {6: lay(now, 2)}) is None
    assert base(hf, 6, {6: lay(now, 1)}) == (sft, label)
    # an SFT record without a layout (written before 2026-12-04) is refused, naming the upgrade of its run
    write_eval(hf.parent.parent.parent, 30, sft, {"run_id": "sft1", "eval_seed": 1_000_000})
    with pytest.raises(OldEvalRecord, match=r"no eval_layout.*python -m pipelines.upgrade"):
        base(hf, 6, {6: lay(now, 1)})
    # no model_path, or one that is not a run's checkpoint
    assert base(None, 6, {6: rec(now)}) is None
    assert base(tmp_path / "exported_hf", 6, {6: rec(now)}) is None
    # a warm start whose checkpoint has no eval record: its own first eval, from its second eval on
    assert base(tmp_path / "exported_hf", 12, {6: rec(zero), 12: rec(now)}) == (zero, 6)
    # an RL run from scratch (no model_path): no gain at all, neither over its step-0 eval (random weights) nor over
    # its first eval (the rule that read `gain +0.984 ... vs step 10` on such a run)
    assert base(None, 12, {6: rec(zero), 12: rec(now)}) is None
    assert base(None, 6, {0: rec(zero), 6: rec(now)}) is None


def test_runner_best_unmarked_and_one_timeline(tmp_path):
    from tasks.evalstats import read_evals, write_eval
    for s in (0, 4, 8):
        _save(tmp_path, s)
        write_eval(tmp_path, s, _outcomes([1, 0]), {"eval_layout": LAYOUT})
    ctx = _context(tmp_path, 8, best_step=8, best=0.5)
    assert _best_unmarked(ctx)  # a new best at this step, not marked yet
    mark_best(tmp_path, 8, 0.5)
    assert not _best_unmarked(ctx)
    ctx.state.step = 9
    assert not _best_unmarked(ctx)  # the best is at another step
    # a rollback / resume to step 4 whose state's best is step 0: the evals after 4 and the best at 8 go
    ctx.state.step, ctx.state.best_eval_step, ctx.state.best_eval_success_once = 4, 0, 0.5
    ctx.one_timeline_on_disk()
    assert list(read_evals(tmp_path)) == [0, 4] and read_best(tmp_path)["step"] == 0
    # a restored state without a best (rolled back to a fresh start): no pointer
    ctx.state.step, ctx.state.best_eval_step = 0, -1
    ctx.one_timeline_on_disk()
    assert list(read_evals(tmp_path)) == [0] and read_best(tmp_path) is None


def test_runner_with_a_validation_split_marks_the_validation_best(tmp_path):
    """env.eval.val_episodes > 0: `checkpoints/best` follows the validation split's best (RunState.best), not the
    eval's; a rollback / resume to step k drops both splits' records after k and re-points at the state's
    validation best."""
    from tasks.evalstats import read_evals, write_eval
    for s in (0, 4, 8):
        _save(tmp_path, s)
        write_eval(tmp_path, s, _outcomes([1, 0]), {"eval_layout": LAYOUT})
        write_eval(tmp_path, s, _outcomes([1, 1], base=2_000_000), {"eval_layout": LAYOUT}, split="val")
    # the eval's best is step 8 (0.9), the validation's step 4 (0.7): only the validation's marks best
    ctx = _context(tmp_path, 8, best_step=8, best=0.9, val=True)
    ctx.state.best_val_step, ctx.state.best_val_success_once = 4, 0.7
    assert not _best_unmarked(ctx)  # the eval's new best at this step is not the checkpoint's choice
    ctx.state.step = 4
    assert _best_unmarked(ctx)
    ctx.state.step = 8
    ctx.one_timeline_on_disk()  # a resume at 8: nothing dropped, best -> the validation's step 4
    rec = read_best(tmp_path)
    assert (rec["step"], rec["value"], rec["metric"]) == (4, 0.7, "val/success_once")
    assert list(read_evals(tmp_path)) == list(read_evals(tmp_path, "val")) == [0, 4, 8]
    # a rollback to step 0 whose state's validation best is step 0: records after 0 go in both splits
    ctx.state.step, ctx.state.best_val_step, ctx.state.best_val_success_once = 0, 0, 0.5
    ctx.one_timeline_on_disk()
    assert list(read_evals(tmp_path)) == list(read_evals(tmp_path, "val")) == [0]
    assert read_best(tmp_path)["step"] == 0
    # without a validation split the pointer follows the state's eval best
    ctx.cfg.env.eval.val_episodes = 0
    ctx.state.best_eval_step, ctx.state.best_eval_success_once = 0, 0.5
    ctx.one_timeline_on_disk()
    rec = read_best(tmp_path)
    assert (rec["step"], rec["value"], rec["metric"]) == (0, 0.5, "eval/success_once")


def test_smoke_run_with_a_validation_split(tmp_path, capsys):
    """conf=smoke with env.eval.val_episodes: every eval is followed by the validation split's (its own fixed
    seeds, disjoint from the eval's), `checkpoints/best` is the first step of the highest validation rate,
    `eval/selected_success_once` is that step's eval rate, `val/*` in MLflow. ~60-90 s under load."""
    from mlflow import MlflowClient

    from pipelines.run import main
    from storage.tracking import default_tracking_uri
    from tasks.evalstats import read_evals
    n, nv = 4, 6
    assert main(["conf=smoke", f"run_root={tmp_path}", "cluster.dashboard_address=127.0.0.1:0",
                 "runner.val_at_start=true", "runner.val_check_interval=1", "runner.save_interval=3",
                 "runner.keep_checkpoints=1", f"env.eval.num_episodes={n}", "env.eval.num_envs=2",
                 f"env.eval.val_episodes={nv}", "env.eval.val_seed=3000000"]) == 0
    out = capsys.readouterr().out
    run_dir = next(p for p in (tmp_path / "smoke").iterdir() if p.is_dir())
    ev, val = read_evals(run_dir), read_evals(run_dir, "val")
    assert list(ev) == list(val) == [0, 1, 2, 3]
    for r in val.values():
        assert list(r["episodes"]) == [str(3_000_000 + i) for i in range(nv)] and r["eval_seed"] == 3_000_000
    rate = lambda r: sum(e["success_once"] for e in r["episodes"].values()) / len(r["episodes"])  # noqa: E731
    v = {s: rate(r) for s, r in val.items()}
    chosen = max(v, key=lambda s: (v[s], -s))
    rec = read_best(run_dir)
    assert (rec["step"], rec["metric"]) == (chosen, "val/success_once") and rec["value"] == pytest.approx(v[chosen])
    assert _steps(run_dir) == sorted({chosen, 3})
    client = MlflowClient(tracking_uri=default_tracking_uri(tmp_path))
    run = client.search_runs([client.get_experiment_by_name("smoke").experiment_id])[0]
    hist = {k: {m.step: m.value for m in client.get_metric_history(run.info.run_id, k)}
            for k in ("val/success_once", "val/best_success_once", "eval/selected_success_once",
                      "eval/best_success_once", "val/num_episodes")}
    for s in range(4):
        assert hist["val/success_once"][s] == pytest.approx(v[s]) and hist["val/num_episodes"][s] == nv
        assert hist["val/best_success_once"][s] == pytest.approx(max(v[k] for k in v if k <= s))
        upto = max((k for k in v if k <= s), key=lambda k: (v[k], -k))
        assert hist["eval/selected_success_once"][s] == pytest.approx(rate(ev[upto]))
    assert hist["eval/best_success_once"][3] == pytest.approx(max(rate(r) for r in ev.values()))
    assert f"validation success_once" in out and f"checkpoints/best: step {chosen}" in out


def test_smoke_run_keeps_the_best_and_writes_eval_records(tmp_path, capsys):
    """One small cluster run (conf=smoke, evals at steps 0..3, keep_checkpoints=1): every eval's per-episode record
    on the same fixed seeds, the intervals in MLflow and the echo lines, the best checkpoint kept besides the
    newest. ~60-90 s under load."""
    from mlflow import MlflowClient

    from pipelines.run import main
    from storage.tracking import default_tracking_uri
    from tasks.evalstats import fmt_rate, read_evals, wilson_interval
    n = 4
    assert main(["conf=smoke", f"run_root={tmp_path}", "cluster.dashboard_address=127.0.0.1:0",
                 "runner.val_at_start=true", "runner.val_check_interval=1", "runner.save_interval=3",
                 "runner.keep_checkpoints=1", f"env.eval.num_episodes={n}", "env.eval.num_envs=2"]) == 0
    out = capsys.readouterr().out
    run_dir = next(p for p in (tmp_path / "smoke").iterdir() if p.is_dir())
    recs = read_evals(run_dir)
    assert list(recs) == [0, 1, 2, 3]
    for r in recs.values():  # the same fixed episodes at every eval: seeds env.eval.seed + i
        assert list(r["episodes"]) == [str(1_000_000 + i) for i in range(n)]
    rates = {s: sum(e["success_once"] for e in r["episodes"].values()) / n for s, r in recs.items()}
    best_step = max(rates, key=lambda s: (rates[s], -s))  # the first eval reaching the maximum
    client = MlflowClient(tracking_uri=default_tracking_uri(tmp_path))
    run = client.search_runs([client.get_experiment_by_name("smoke").experiment_id])[0]
    hist = {k: {m.step: m.value for m in client.get_metric_history(run.info.run_id, k)}
            for k in ("eval/success_once", "eval/success_once_ci_low", "eval/success_once_ci_high",
                      "eval/success_at_end_ci_low", "eval/best_success_once")}
    assert sorted(hist["eval/success_once"]) == [0, 1, 2, 3]
    for s, p in rates.items():
        assert hist["eval/success_once"][s] == pytest.approx(p)
        lo, hi = wilson_interval(round(p * n), n)
        assert (hist["eval/success_once_ci_low"][s], hist["eval/success_once_ci_high"][s]) == pytest.approx((lo, hi))
    assert f"dagrl: eval before training: success_once {fmt_rate(rates[0], *wilson_interval(round(rates[0] * n), n), n)}" in out
    assert f"dagrl: eval at step 3: success_once {fmt_rate(rates[3], *wilson_interval(round(rates[3] * n), n), n)}" in out
    # the best eval's step is checkpointed and marked; pruning kept it besides the newest (step 3)
    assert read_best(run_dir)["step"] == best_step and read_best(run_dir)["value"] == pytest.approx(rates[best_step])
    assert _steps(run_dir) == sorted({best_step, 3})
    assert (run_dir / "checkpoints" / "best" / "index.json").is_file()
    state = __import__("storage.checkpoints", fromlist=["load_checkpoint"]).load_checkpoint(
        best_checkpoint(run_dir), keys=("run",))
    assert state["run"]["runner"]["step"] == best_step and state["run"]["runner"]["best_eval_step"] == best_step
