"""`python -m pipelines.compare` on MLflow runs created here with known params and metrics (a
tmp sqlite store, no cluster), and once on the real `conf=smoke` run of the session (`smoke_run`). Expected values
are derived from what each test logged: the differing params, the final value (last step), the best (max, or min
for losses) and its earliest step, the newest point of a step logged twice."""
from __future__ import annotations

import math
import re
import socket

import pytest
from mlflow.entities import Metric

from pipelines import compare
from storage.tracking import Tracker, default_tracking_uri, flatten_config

BASE_MS = 1_700_000_000_000

RUN_A, RUN_B, RUN_C = "20260101-000000-aaaa", "20260101-000001-bbbb", "20260101-000002-cccc"
CONFIG_A = {"algorithm": {"lr": 0.001, "gamma": 0.99}, "env": {"num_envs": 4}, "seed": 0}
CONFIG_B = {"algorithm": {"lr": 0.003, "gamma": 0.99}, "env": {"num_envs": 4}, "seed": 1,
            "runner": {"extra": True}}
# {metric: {step: value}}; per run. train/critic_loss only in A (a --metric B lacks); a NaN loss in B.
METRICS_A = {"eval/success_once": {0: 0.25, 3: 0.75, 6: 0.5},
             "train/actor_loss": {1: 0.9, 2: 0.4, 3: 0.6, 4: 0.4, 5: 0.7, 6: 0.8},
             "train/critic_loss": {1: 2.0, 6: 1.0}}
METRICS_B = {"eval/success_once": {0: 0.0, 3: 1.0, 6: 1.0},
             "train/actor_loss": {1: 1.5, 2: float("nan"), 3: 1.2, 4: 1.3, 5: 1.1, 6: 1.4}}
MS_PER_STEP = {RUN_A: 1000, RUN_B: 2500}


def _log(uri: str, experiment: str, run_id: str, config: dict, metrics: dict) -> Tracker:
    t = Tracker(uri=uri, experiment=experiment, run_name=run_id)
    t.log_params(flatten_config(config))
    ms = MS_PER_STEP.get(run_id, 1000)
    pts = [Metric(k, v, BASE_MS + s * ms, s) for k, h in metrics.items() for s, v in h.items()]
    t.client.log_batch(t.run_id, metrics=pts)
    t.set_terminated("FINISHED")
    return t


def _store(root):
    uri = default_tracking_uri(root)
    trackers = {RUN_A: _log(uri, "exp", RUN_A, CONFIG_A, METRICS_A),
                RUN_B: _log(uri, "exp", RUN_B, CONFIG_B, METRICS_B),
                RUN_C: _log(uri, "other", RUN_C, CONFIG_A, METRICS_A)}
    return root, trackers


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """Run root with two runs of experiment `exp` (A, B) and one of `other` (C); read only (a new sqlite store
    costs seconds of schema migrations)."""
    return _store(tmp_path_factory.mktemp("compare_store"))


def _main(capsys, *argv) -> tuple[int, str, list[str]]:
    capsys.readouterr()
    rc = compare.main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, [line for line in out.err.splitlines() if line.strip()]


def _cells(out: str, first: str, second: str) -> list[str]:
    """The cells after the row's `first` and `second` columns (the table splits on 2+ spaces)."""
    lines = out.splitlines()
    for i, line in enumerate(lines):
        cells = re.split(r"\s{2,}", line.strip())
        if cells[:2] == [first, second]:
            return cells[2:]
        if second.startswith("best") and cells[0] == first and i + 1 < len(lines):  # best: the row after final
            nxt = re.split(r"\s{2,}", lines[i + 1].strip())
            if nxt[0] == second:
                return nxt[1:]
    raise AssertionError(f"no row {first!r} {second!r} in\n{out}")


def _final(h: dict) -> str:
    s = max(h)
    return f"{h[s]:.4g} @{s}"


def _best(h: dict, lower: bool) -> str:
    finite = {s: v for s, v in h.items() if not math.isnan(v)}
    b = (min if lower else max)(finite.values())
    return f"{b:.4g} @{min(s for s, v in finite.items() if v == b)}"


def test_two_runs_by_dagrl_id_diff_final_best(store, capsys):
    root, _ = store
    rc, out, err = _main(capsys, RUN_A, RUN_B, "--run-root", str(root))
    assert rc == 0 and err == [], err
    flat_a, flat_b = flatten_config(CONFIG_A), flatten_config(CONFIG_B)
    differ = sorted(k for k in flat_a.keys() | flat_b.keys() if flat_a.get(k) != flat_b.get(k))
    same = len(flat_a.keys() | flat_b.keys()) - len(differ)
    assert f"config: {len(differ)} keys differ, {same} identical" in out
    for k in differ:
        assert _cells(out, k, flat_a.get(k, "-"))[0] == flat_b.get(k, "-"), out
    # default metrics: eval/success_once and train/actor_loss (both runs have them), not critic_loss (A only)
    assert "train/critic_loss" not in out
    for key, lower in (("eval/success_once", False), ("train/actor_loss", True)):
        assert _cells(out, key, "final") == [_final(METRICS_A[key]), _final(METRICS_B[key])], out
        assert _cells(out, key, "best (min)" if lower else "best (max)") == \
            [_best(METRICS_A[key], lower), _best(METRICS_B[key], lower)], out


def test_an_experiment_name_takes_all_its_runs_and_png(store, capsys, tmp_path):
    import matplotlib.image
    root, trackers = store
    png = tmp_path / "cmp.png"
    rc, out, err = _main(capsys, "exp", "--run-root", str(root), "--metric", "train/actor_loss", "--png", str(png))
    assert rc == 0 and err == [], err
    header = [line for line in out.splitlines() if line.split()[:1] == ["metric"]][0]
    assert RUN_A in header and RUN_B in header and RUN_C not in out  # C is in experiment `other`
    assert trackers[RUN_A].run_id in out and trackers[RUN_B].run_id in out
    assert "eval/success_once" not in out.split("metrics")[1]  # only the chosen metric
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    img = matplotlib.image.imread(png)
    assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100


def test_summaries_step_and_wall_time(store):
    """The plotted points: one per step, the wall-time axis from the logged timestamps."""
    from mlflow.tracking import MlflowClient
    root, trackers = store
    client = MlflowClient(default_tracking_uri(root))
    pts = compare.history(client, trackers[RUN_B].run_id, "eval/success_once")
    assert [(s, v) for s, v, _ in pts] == sorted(METRICS_B["eval/success_once"].items())
    assert [(t - BASE_MS) / 1000 for _, _, t in pts] == [s * MS_PER_STEP[RUN_B] / 1000 for s, _, _ in pts]
    s = compare.summarize(compare.history(client, trackers[RUN_B].run_id, "train/actor_loss"), "train/actor_loss")
    finite = {k: v for k, v in METRICS_B["train/actor_loss"].items() if not math.isnan(v)}
    assert s.lower_is_better and s.best == min(finite.values()) and s.final_step == max(finite)


def test_a_step_logged_twice_reads_its_newest_point(tmp_path, capsys):
    uri = default_tracking_uri(tmp_path)
    t = _log(uri, "exp", RUN_A, CONFIG_A, METRICS_A)
    t.client.log_batch(t.run_id, metrics=[Metric("eval/success_once", 0.125, BASE_MS + 10 ** 6, 6)])
    rc, out, _ = _main(capsys, RUN_A, "--run-root", str(tmp_path), "--metric", "eval/success_once")
    assert rc == 0
    assert _cells(out, "eval/success_once", "final") == ["0.125 @6"]


def test_a_resumed_run_is_read_from_its_newest_timeline(tmp_path, capsys):
    """After a rollback (Tracker.fork) the dagrl run id names the new MLflow run, and the superseded MLflow run id
    is followed to it."""
    root, trackers = _store(tmp_path)
    old = trackers[RUN_A].run_id
    new = trackers[RUN_A].fork(3)  # keeps the points with step <= 3
    kept = {s: v for s, v in METRICS_A["eval/success_once"].items() if s <= 3}
    for name in (RUN_A, old):
        rc, out, _ = _main(capsys, name, "--run-root", str(root), "--metric", "eval/success_once")
        assert rc == 0 and new in out and old not in out.split("MLflow run ")[1].split(",")[0], out
        assert _cells(out, "eval/success_once", "final") == [_final(kept)]


def _one_error(rc, err, *words):
    assert rc == 2 and len(err) == 1 and err[0].startswith("error: "), err
    for w in words:
        assert w in err[0], (w, err)


def test_unknown_run_names_close_matches(store, capsys):
    root, _ = store
    typo = RUN_A[:-1] + "b"
    rc, _, err = _main(capsys, RUN_A, typo, f"run_root={root}")  # the documented spelling (--run-root: the same)
    _one_error(rc, err, f"RUN={typo!r}", RUN_A, "run_root=DIR")


def test_unknown_metric_names_the_run(store, capsys):
    root, _ = store
    rc, _, err = _main(capsys, RUN_A, RUN_B, "--run-root", str(root), "--metric", "train/critic_loss")
    _one_error(rc, err, "--metric='train/critic_loss'", f"run {RUN_B}")


def test_unreadable_stores(tmp_path, capsys):
    rc, _, err = _main(capsys, RUN_A, "--run-root", str(tmp_path / "nowhere"))
    _one_error(rc, err, "run_root", "no database file", str(tmp_path / "nowhere" / "mlflow.db"))
    assert not (tmp_path / "nowhere").exists()  # reading never creates a store
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rc, _, err = _main(capsys, RUN_A, "--tracking-uri", f"http://127.0.0.1:{port}")
    _one_error(rc, err, "tracking.uri", f"http://127.0.0.1:{port}/health")


def test_help_and_bad_arguments(capsys, store, tmp_path):
    rc, out, _ = _main(capsys, "--help")
    assert rc == 0 and out.strip() == compare.__doc__.strip() and "Examples:" in out
    rc, _, err = _main(capsys, "--run-root", "x")
    _one_error(rc, err, "RUN", "--help")
    root, _ = store
    rc, _, err = _main(capsys, RUN_A, "--run-root", str(root), "--png", str(tmp_path / "no" / "dir" / "x.png"))
    _one_error(rc, err, "--png")


def test_the_real_smoke_run(smoke_run, capsys, tmp_path):
    """The session's `conf=smoke` run (shared with tests/test_end_to_end.py): by experiment name, its own values
    read back from MLflow, and a PNG."""
    from mlflow.tracking import MlflowClient

    from storage.tracking import unflatten_values
    client = MlflowClient(default_tracking_uri(smoke_run))
    exp = client.get_experiment_by_name("smoke")
    (run,) = client.search_runs([exp.experiment_id])
    png = tmp_path / "smoke.png"
    rc, out, err = _main(capsys, "smoke", "--run-root", str(smoke_run), "--png", str(png))
    assert rc == 0 and err == [], err
    assert f"config: 0 keys differ, {len(unflatten_values(run.data.params))} identical" in out
    for key in ("eval/success_once", "train/actor_loss"):
        h = {m.step: m.value for m in sorted(client.get_metric_history(run.info.run_id, key),
                                             key=lambda m: m.timestamp)}
        assert _cells(out, key, "final") == [_final(h)], out
    assert png.stat().st_size > 0


def test_default_metrics_rule_and_best_direction():
    """Default metrics are taken only where every run logged them; none shared is an error naming the fix."""
    from types import SimpleNamespace as NS

    def run(*keys):
        return NS(data=NS(metrics=dict.fromkeys(keys, 0.0)))
    sft = run("eval/success_once", "train/sft_loss", "train/lr")
    ppo = run("eval/success_once", "train/actor_loss", "train/critic_loss", "train/lr")
    assert compare.default_metrics([ppo]) == ["eval/success_once", "train/actor_loss"]
    assert compare.default_metrics([sft]) == ["eval/success_once", "train/sft_loss"]
    assert compare.default_metrics([ppo, sft]) == ["eval/success_once", "train/lr"]  # no loss in both: first train/
    with pytest.raises(compare.CompareError, match="--metric"):
        compare.default_metrics([run("env/return"), run("env/return", "train/lr")])
    assert [compare.lower_is_better(k) for k in ("train/actor_loss", "train/approx_kl", "time/step",
                                                 "system/rss_mb", "eval/success_once", "env/return")] == \
        [True, True, True, True, False, False]


def test_diverged_values_read_as_inf_and_are_never_best(tmp_path, capsys):
    """MLflow's SQL store keeps +-inf as +-float max: compare prints them as inf/-inf and never
    ranks them best; the best is the extreme of the finite values, nan when no value is finite."""
    import sys
    from mlflow.tracking import MlflowClient
    inf = math.inf
    metrics = {"train/actor_loss": {1: 0.5, 2: -inf, 3: 0.7, 4: inf},  # min: -inf must not win
               "eval/success_once": {0: 0.25, 1: inf, 2: float("nan"), 3: 0.5},  # max: inf must not win
               "train/critic_loss": {1: inf, 2: -inf}}  # nothing finite
    t = _log(default_tracking_uri(tmp_path), "exp", RUN_A, CONFIG_A, metrics)
    raw = {m.step: m.value for m in MlflowClient(default_tracking_uri(tmp_path)).get_metric_history(
        t.run_id, "train/actor_loss")}
    assert raw[2] == -sys.float_info.max and raw[4] == sys.float_info.max  # what the store gives back
    rc, out, err = _main(capsys, RUN_A, "--run-root", str(tmp_path), "--metric", "train/actor_loss",
                         "--metric", "eval/success_once", "--metric", "train/critic_loss")
    assert rc == 0 and err == [], err
    assert _cells(out, "train/actor_loss", "final") == ["inf @4"], out
    assert _cells(out, "train/actor_loss", "best (min)") == ["0.5 @1"], out
    assert _cells(out, "eval/success_once", "best (max)") == ["0.5 @3"], out
    assert _cells(out, "train/critic_loss", "final") == ["-inf @2"], out
    assert _cells(out, "train/critic_loss", "best (min)") == ["nan @2"], out
    assert "1.798e+308" not in out
