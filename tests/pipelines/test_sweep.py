"""Sweeps (`python -m pipelines.run -m ...`, pipelines.sweep) and their report (`python -m pipelines.compare --sweep`,
pipelines.sweep_report): the grid Hydra's multirun defines, the refusal outside -m, the MLflow tags, a failed job that
does not stop the others, the report's statistics against hand-computed t intervals, and one real two-job sweep on
one reused embedded cluster (cluster tier)."""
from __future__ import annotations

import json
import math

import pytest
from mlflow.entities import Metric

from pipelines import compare, run, sweep
from storage.tracking import SWEEP_TAG, SWEPT_TAG_PREFIX, Tracker, default_tracking_uri, flatten_config
from tasks.config import ConfigError
from tasks.seedstats import t_quantile_exact


@pytest.fixture
def no_cluster(monkeypatch):
    import pipelines.clusters

    def refuse(cfg):
        raise AssertionError("a cluster was started")
    monkeypatch.setattr(pipelines.clusters, "start_cluster", refuse)


# ----- the grid -----
def test_grid_is_the_cartesian_product_first_key_slowest():
    jobs, keys = sweep.expand(["conf=smoke", "seed=1,2,3", "algorithm.lr=1e-4,3e-4", "+x=range(1,3)"])
    assert keys == ["seed", "algorithm.lr", "x"]
    assert len(jobs) == 3 * 2 * 2 and [j.index for j in jobs] == list(range(12))
    want = [(s, lr, x) for s in ("1", "2", "3") for lr in ("1e-4", "3e-4") for x in ("1", "2")]
    assert [tuple(j.swept.values()) for j in jobs] == want  # values as typed (Hydra itself prints 0.0001)
    assert jobs[5].overrides == ["conf=smoke", "seed=2", "algorithm.lr=1e-4", "+x=2"]  # fixed overrides kept, in place
    assert len({tuple(j.overrides) for j in jobs}) == len(jobs)


def test_no_swept_key_is_one_job_and_quoted_commas_are_one_value():
    jobs, keys = sweep.expand(["conf=smoke", "experiment='a,b'"])
    assert keys == [] and len(jobs) == 1 and jobs[0].overrides == ["conf=smoke", "experiment='a,b'"]
    jobs, keys = sweep.expand(["experiment='a,b',c"])  # Hydra splits a list with quotes itself
    assert keys == ["experiment"] and [j.swept["experiment"] for j in jobs] == ["'a,b'", "c"]


@pytest.mark.parametrize("words, key", [(["run_root=a,b"], "run_root"), (["runner.resume=x,y"], "runner.resume"),
                                        (["seed=1,2", "seed=3,4"], "seed")])
def test_keys_that_cannot_be_swept_are_refused(words, key):
    with pytest.raises(ConfigError) as err:
        sweep.expand(words)
    assert err.value.key == key


def test_comma_outside_multirun_keeps_its_refusal_and_names_m(capsys, no_cluster, tmp_path):
    rc = run.main(["conf=smoke", "seed=1,2", f"run_root={tmp_path}"])
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert rc == 2 and len(err) == 1 and err[0].startswith("error: seed='1,2'") and " -m " in err[0], err
    assert not any(tmp_path.iterdir())


def test_a_bad_job_fails_the_sweep_before_anything_runs(capsys, no_cluster, tmp_path):
    rc = run.main(["-m", "conf=smoke", f"run_root={tmp_path}", "seed=1,2", "env.num_envs=4,-1"])
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert rc == 2 and len(err) == 1 and err[0].startswith("error: sweep job 1 (seed=1 env.num_envs=-1)"), err
    assert not (tmp_path / "sweeps").exists()


def test_job_tags_name_the_sweep_and_each_swept_value():
    jobs, _ = sweep.expand(["seed=1,2", "algorithm.lr=1e-4"])
    assert sweep.job_tags("S", jobs[1]) == {SWEEP_TAG: "S", sweep.JOB_TAG: "1", f"{SWEPT_TAG_PREFIX}seed": "2"}


def test_sweep_tags_follow_a_rollback_into_the_new_mlflow_run(sweep_store):
    t = Tracker(uri=default_tracking_uri(sweep_store), experiment="forked", run_name="r1")  # not sweep S1's runs
    t.set_tags({SWEEP_TAG: "S", f"{SWEPT_TAG_PREFIX}seed": "3"})
    old = t.run_id
    new = t.fork(0)
    tags = t.client.get_run(new).data.tags
    assert new != old and tags[SWEEP_TAG] == "S" and tags[f"{SWEPT_TAG_PREFIX}seed"] == "3"


# ----- running the jobs: a failure does not stop the others; Ctrl-C stops the sweep -----
class _FakeHandle:
    client, cluster, dashboard_link = None, None, "-"

    def close(self):
        pass


def _fake_train(outcomes, seen):
    """A `train` for run_sweep: job i (by its seed) prints/raises/returns what `outcomes` says; records tags."""
    import sys

    def train(cfg, handle, tags=None, record=None):
        seen.append(dict(tags))
        what = outcomes.get(cfg.seed, 0)
        record.update(run_id=f"run-{cfg.seed}", run_dir="d", mlflow_run_id="m")
        if isinstance(what, Exception):
            raise what
        if what == 1:
            print("error: training step 1: boom", file=sys.stderr)
        return what
    return train


def test_a_failed_job_is_listed_and_the_others_run(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(sweep.ClusterPool, "start", lambda self, cfg: _FakeHandle())
    seen: list = []
    rc = sweep.run_sweep(["conf=smoke", f"run_root={tmp_path}", "seed=1,2,3,4"],
                         train=_fake_train({2: 1, 3: RuntimeError("bad\nsecond line")}, seen))
    out = capsys.readouterr().out
    assert rc == 1 and [t[f"{SWEPT_TAG_PREFIX}seed"] for t in seen] == ["1", "2", "3", "4"]
    (path,) = (tmp_path / "sweeps").glob("*/sweep.json")
    rec = json.loads(path.read_text())
    assert rec["status"] == "failed" and rec["swept_keys"] == ["seed"]
    assert [j["status"] for j in rec["jobs"]] == ["finished", "failed", "failed", "finished"]
    assert rec["jobs"][1]["reason"] == "error: training step 1: boom"
    assert rec["jobs"][2]["reason"] == "error: RuntimeError: bad" and rec["jobs"][3]["run_id"] == "run-4"
    assert "job 1 seed=2: failed run run-2" in out and f"--sweep {path.parent.name}" in out


def test_ctrl_c_stops_the_sweep_after_the_job_in_flight(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(sweep.ClusterPool, "start", lambda self, cfg: _FakeHandle())
    seen: list = []
    rc = sweep.run_sweep(["conf=smoke", f"run_root={tmp_path}", "seed=1,2,3"], train=_fake_train({1: 130}, seen))
    (path,) = (tmp_path / "sweeps").glob("*/sweep.json")
    rec = json.loads(path.read_text())
    assert rc == 130 and len(seen) == 1 and rec["status"] == "interrupted"
    assert [j["status"] for j in rec["jobs"]] == ["interrupted", "not run", "not run"]


# ----- the report -----
BASE_MS = 1_700_000_000_000
# {lr: {seed: {step: success_once}}}; the steps 1 s apart
CURVES = {"1e-4": {"1": {0: 0.0, 2: 0.5, 4: 0.5}, "2": {0: 0.0, 2: 0.25, 4: 0.75}, "3": {0: 0.0, 2: 0.5, 4: 0.25}},
          "3e-4": {"1": {0: 0.0, 2: 0.75, 4: 1.0}, "2": {0: 0.25, 2: 1.0, 4: 1.0}, "3": {0: 0.0, 2: 0.5, 4: 0.5}}}


@pytest.fixture(scope="module")
def sweep_store(tmp_path_factory):
    root = tmp_path_factory.mktemp("sweep_store")
    uri = default_tracking_uri(root)
    for lr, seeds in CURVES.items():
        for seed, pts in seeds.items():
            t = Tracker(uri=uri, experiment="smoke", run_name=f"r-{lr}-{seed}")
            t.log_params(flatten_config({"seed": int(seed), "algorithm": {"lr": float(lr)}}))
            t.set_tags({SWEEP_TAG: "S1", f"{SWEPT_TAG_PREFIX}seed": seed, f"{SWEPT_TAG_PREFIX}algorithm.lr": lr})
            start = t.client.get_run(t.run_id).info.start_time
            t.client.log_batch(t.run_id, metrics=[Metric("eval/success_once", v, start + 1000 * s, s)
                                                  for s, v in pts.items()])
            t.set_terminated("FINISHED")
    return root


def _interval(values):
    n = len(values)
    m = sum(values) / n
    sd = math.sqrt(sum((v - m) ** 2 for v in values) / (n - 1))
    h = t_quantile_exact(0.975, n - 1) * sd / math.sqrt(n)
    return f"{m:.3f} [{m - h:.3f}, {m + h:.3f}]"


def test_report_groups_by_non_seed_keys_with_hand_computed_intervals(sweep_store, capsys, tmp_path):
    rc = compare.main(["--sweep", "S1", "--run-root", str(sweep_store), "--threshold", "0.75",
                       "--png", str(tmp_path / "c.png")])
    out = capsys.readouterr().out
    assert rc == 0, out
    final = {lr: [pts[4] for pts in seeds.values()] for lr, seeds in CURVES.items()}
    best = {lr: [max(pts.values()) for pts in seeds.values()] for lr, seeds in CURVES.items()}
    for lr in CURVES:
        assert f"algorithm.lr={lr}: 3 seed(s) (1, 2, 3)" in out
        assert f"final eval/success_once" in out and _interval(final[lr]) in out
        assert _interval(best[lr]) in out
    # threshold 0.75: lr 1e-4 reached by seed 2 only (step 4, 4 s): one value, no interval; 3e-4 by seeds 1, 2
    assert "4.0 (n=1, no interval) (1 of 3 reached; 2 never)" in out
    lines = out.splitlines()
    steps_3e4 = [ln for ln in lines if "steps to 0.75" in ln][1]
    assert steps_3e4.split()[3] == f"{(2 + 2) / 2:.1f}" and "(2 of 3 reached; 1 never)" in steps_3e4
    # paired: final(3e-4) - final(1e-4) per seed
    diffs = [b - a for a, b in zip(final["1e-4"], final["3e-4"])]
    m = sum(diffs) / 3
    sd = math.sqrt(sum((d - m) ** 2 for d in diffs) / 2)
    h = t_quantile_exact(0.975, 2) * sd / math.sqrt(3)
    assert f"final [algorithm.lr=3e-4] - [algorithm.lr=1e-4]: {m:+.3f} [{m - h:+.3f}, {m + h:+.3f}] over 3" in out
    assert (tmp_path / "c.png").stat().st_size > 0


def test_report_of_an_unknown_sweep_is_one_line(sweep_store, capsys):
    rc = compare.main(["--sweep", "nope", "--run-root", str(sweep_store)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("error: --sweep='nope'"), err


# ----- one real sweep (cluster tier): two jobs on one embedded cluster -----
@pytest.mark.cluster
@pytest.mark.fresh_cluster  # it counts the sweep's own cluster starts
def test_real_two_job_sweep_reuses_one_cluster(tmp_path, capsys, monkeypatch):
    started = []
    real = sweep.ClusterPool.start

    def counting(self, cfg):
        h = real(self, cfg)
        started.append(self.started)
        return h
    monkeypatch.setattr(sweep.ClusterPool, "start", counting)
    rc = run.main(["-m", "conf=smoke", "runner.max_steps=2", f"run_root={tmp_path}", "seed=1,2",
                   "cluster.dashboard_address=127.0.0.1:0"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert started == [1, 1]  # the second job got the first one's cluster
    (path,) = (tmp_path / "sweeps").glob("*/sweep.json")
    rec = json.loads(path.read_text())
    assert [j["status"] for j in rec["jobs"]] == ["finished", "finished"]
    from mlflow.tracking import MlflowClient
    client = MlflowClient(default_tracking_uri(tmp_path))
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()],
                              filter_string=f"tags.`{SWEEP_TAG}` = '{rec['sweep_id']}'")
    assert sorted(r.data.tags[f"{SWEPT_TAG_PREFIX}seed"] for r in runs) == ["1", "2"]
    assert sorted(r.data.params["seed"] for r in runs) == ["1", "2"]
    assert {r.data.tags["dagrl.run_id"] for r in runs} == {j["run_id"] for j in rec["jobs"]}
    assert compare.main(["--sweep", rec["sweep_id"], "--run-root", str(tmp_path)]) == 0
    assert "(all runs): 2 seed(s) (1, 2)" in capsys.readouterr().out


def test_tag_run_makes_an_outside_run_part_of_a_sweep(sweep_store, tmp_path, capsys):
    uri = default_tracking_uri(sweep_store)
    t = Tracker(uri=uri, experiment="recipe_rl", run_name="20260101-000000-abcd")
    t.client.log_batch(t.run_id, metrics=[Metric("eval/success_once", 0.5, 0, 3)])
    assert sweep.tag_run(uri, "20260101-000000-abcd", "R", {"teacher": "a", "seed": "1"}) == 1
    assert sweep.tag_run(uri, "no-such-run", "R", {"seed": "1"}) == 0
    assert sweep.tag_run(default_tracking_uri(tmp_path), "x", "R", {}) == 0  # no store there: nothing, no error
    assert not (tmp_path / "mlflow.db").exists()
    assert compare.main(["--sweep", "R", "--run-root", str(sweep_store)]) == 0
    assert "teacher=a: 1 seed(s) (1)" in capsys.readouterr().out
