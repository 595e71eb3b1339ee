"""Failing cleanly: a run's files vanishing under it, Dask's own worker tracebacks beside
dagrl's one-line reports, the dashboard's identity.json, a resume of a complete run, and the cluster's view on a
loaded machine.

- the writers of a running run (checkpoints, eval records, the trajectory store's driver and worker writes, the
  MLflow store) never re-create a removed run dir: they raise `RunDirGone` / `StoreGone`, and the runner turns any
  failure after such a removal into one line (`RunContext.files_gone`), exit 1 (a real tiny run, slow);
- `/json/identity.json` is JSON although workers report tuple-keyed metrics (`pipelines.dashboard_json`);
- a resume of a run whose checkpoint is at `runner.max_steps` with its final eval recorded is refused offline with
  one line (exit 2), not run to an empty eval "nan [nan, nan] over 0 episodes";
- `pipelines.clusters.cluster_info` lists every worker where `Client.scheduler_info()`'s cache lists none;
  the embedded scheduler's worker-ttl follows `runner.stall_timeout_s`;
- `DriverReportsFilter` keeps Dask's "Compute Failed" / "Worker stream died" records off the console only.
"""
from __future__ import annotations

import json
import logging
import shutil
import sys
from dataclasses import asdict

import numpy as np
import pytest

from storage.rundir import RunDirGone, dir_identity, make_dir_in, new_run_dir, run_dir_gone


# ----- a run's files removed under it: the writers -----

def _store(path):
    from storage.trajectories import FieldSpec, TrajectoryStore
    return TrajectoryStore.create(path, fields={"obs": FieldSpec(shape=(3,), dtype="float32")}, T=2, num_envs=4,
                                  shard_size=2, attrs={"run_id": "r"})


def _everything(root):
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_run_dir_gone_tells_removed_from_replaced_and_intact(tmp_path):
    run = new_run_dir(tmp_path, "exp", "20260101-000000-aaaa")
    ident = dir_identity(run)
    assert run_dir_gone(run, ident) is None
    run.rename(tmp_path / "moved")  # the old directory still exists elsewhere: the new one cannot reuse its inode
    assert "was removed while the run trained" in run_dir_gone(run, ident)
    run.mkdir()
    line = run_dir_gone(run, ident)
    assert "replaced by another directory" in line and "\n" not in line and "runner.resume=20260101-000000-aaaa" \
        in line


@pytest.mark.parametrize("writer", ["checkpoint", "eval", "make_dir_in"])
def test_a_running_runs_writers_do_not_recreate_its_removed_run_dir(tmp_path, writer):
    from storage.checkpoints import save_checkpoint
    from tasks.evalstats import write_eval
    run = new_run_dir(tmp_path, "exp", "20260101-000000-aaaa")
    shutil.rmtree(run)
    before = _everything(tmp_path)
    with pytest.raises(RunDirGone):
        if writer == "checkpoint":
            save_checkpoint(run, 3, {"run": {"step": 3}}, create_run_dir=False)
        elif writer == "eval":
            write_eval(run, 3, {"1": {"success_once": True, "success_at_end": True, "return": 1.0,
                                      "episode_len": 5}}, {"eval_layout": {"num_envs": 1, "num_shards": 1, "device": "cpu"}},
                       split="val", create_run_dir=False)
        else:
            make_dir_in(run, "perf")
    assert _everything(tmp_path) == before and not run.exists()


def test_make_dir_in_makes_only_the_levels_below_its_parent(tmp_path):
    made = make_dir_in(tmp_path, "evals", "val")
    assert made == tmp_path / "evals" / "val" and made.is_dir()
    assert make_dir_in(tmp_path, "evals", "val") == made  # again: exists, fine


@pytest.mark.parametrize("call", ["reserve", "mark_complete", "write_shard"])
def test_a_removed_store_is_not_recreated_by_its_writers(tmp_path, call):
    from storage.trajectories import StoreGone, write_shard
    run = new_run_dir(tmp_path, "exp", "20260101-000000-aaaa")
    store = _store(run / "trajectories.zarr")
    store.reserve(0)
    shutil.rmtree(store.path)
    before = _everything(tmp_path)
    with pytest.raises(StoreGone):
        if call == "reserve":
            store.reserve(1)
        elif call == "mark_complete":
            store.mark_complete(0)
        else:
            write_shard(str(store.path), step=0, shard=1, data={"obs": np.zeros((2, 2, 3), np.float32)})
    assert _everything(tmp_path) == before  # zarr's local store would have made fields/obs/c/0/... again


def test_a_removed_mlflow_store_is_one_line_and_not_recreated(tmp_path):
    from storage.tracking import Tracker, default_tracking_uri
    tracker = Tracker(uri=default_tracking_uri(tmp_path), experiment="exp", run_name="r")
    tracker.log_metrics({"a": 1.0}, step=1)
    assert tracker.store_gone() is None
    (tmp_path / "mlflow.db").unlink()
    line = tracker.store_gone()
    assert line.startswith(f"the MLflow store {tmp_path / 'mlflow.db'}") and "removed" in line and "\n" not in line
    for write in (lambda: tracker.log_metrics({"a": 2.0}, step=2), lambda: tracker.log_text("x", "x.txt"),
                  lambda: tracker.set_terminated("FAILED")):
        with pytest.raises(RunDirGone, match="was removed while the run trained"):
            write()
    assert not (tmp_path / "mlflow.db").exists()


# ----- the dashboard's identity.json -----

class _FakeScheduler:
    """What `Scheduler.identity()` holds after a worker ran tasks: distributed's fine performance metrics keyed by
    tuples (`digests_total_since_heartbeat`), besides plain keys."""

    def identity(self):
        return {"type": "Scheduler", "workers": {"tcp://127.0.0.1:1": {
            "resources": {"CPU": 1}, "metrics": {
                "digests_total_since_heartbeat": {("execute", "env_step_s", "thread-cpu", "seconds"): 0.5,
                                                  "tick-duration": 0.1, ("a", ("b", 2)): 3},
                "task_counts": {"memory": 2}}}}}


def test_identity_json_writes_tuple_keys_as_strings():
    from pipelines.dashboard_json import identity_json
    with pytest.raises(TypeError, match="not tuple"):  # what distributed's own handler does with it (HTTP 500)
        json.dumps(_FakeScheduler().identity())
    doc = json.loads(identity_json(_FakeScheduler()))
    digests = doc["workers"]["tcp://127.0.0.1:1"]["metrics"]["digests_total_since_heartbeat"]
    assert digests == {"execute/env_step_s/thread-cpu/seconds": 0.5, "tick-duration": 0.1, "a/b/2": 3}
    assert doc["workers"]["tcp://127.0.0.1:1"]["resources"] == {"CPU": 1}


def test_the_embedded_scheduler_gets_our_json_routes_and_distributeds_others():
    import dask
    from distributed.http.scheduler import json as theirs

    from pipelines import dashboard_json
    from pipelines.clusters import scheduler_http_routes
    default = dask.config.get("distributed.scheduler.http.routes")
    ours = scheduler_http_routes()
    assert ours == [dashboard_json.__name__ if m == "distributed.http.scheduler.json" else m for m in default]
    assert [u for u, _, _ in dashboard_json.routes] == [u for u, _, _ in theirs.routes]
    handlers = {u: h for u, h, _ in dashboard_json.routes}
    assert handlers["json/identity.json"] is dashboard_json.IdentityJSON
    assert all(handlers[u] is h for u, h, _ in theirs.routes if u != "json/identity.json")


# ----- a resume of a complete run -----

def test_resume_of_a_run_complete_at_max_steps_is_one_line_exit_2(tmp_path, capsys, monkeypatch):
    """A checkpoint at runner.max_steps whose final eval is recorded: nothing to do, one line naming
    runner.max_steps, exit 2, before any cluster and writing nothing. Without the final eval recorded (a run
    stopped right after its last step) the resume is allowed: it plays that eval."""
    import pipelines.clusters
    from pipelines import run
    from pipelines.config import load_config
    from pipelines.runner.setup import RunState, resolve_resume
    from storage.checkpoints import save_checkpoint
    from tasks.evalstats import write_eval
    monkeypatch.setattr(pipelines.clusters, "start_cluster", lambda cfg: pytest.fail("a cluster was started"))
    cfg, _ = load_config(["conf=smoke", f"run_root={tmp_path}", "runner.max_steps=3"])
    state = RunState(run_id="20260101-000000-beef", step=3, cursors=[None] * cfg.env.num_shards)
    run_dir = new_run_dir(tmp_path, "smoke", state.run_id)
    ckpt = save_checkpoint(run_dir, 3, {"run": {"runner": asdict(state), "experiment": "smoke"}})
    argv = ["conf=smoke", f"run_root={tmp_path}", "runner.max_steps=3", f"runner.resume={state.run_id}"]
    assert resolve_resume(load_config(argv)[0]).state.step == 3  # no final eval yet: allowed
    write_eval(run_dir, 3, {"1": {"success_once": True, "success_at_end": False, "return": 1.0, "episode_len": 5}},
               {"eval_layout": {"num_envs": 1, "num_shards": 1, "device": "cpu"}})
    before = _everything(tmp_path)
    capsys.readouterr()
    assert run.main(argv) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and err[0].startswith("error: runner.max_steps=3: run 20260101-000000-beef is complete "
                                               "already"), err
    assert "above 3" in err[0] and str(ckpt) in err[0] and "nan" not in err[0]
    assert _everything(tmp_path) == before
    assert run.main([*argv[:2], "runner.max_steps=4", argv[3], "--show"]) == 0  # raising max_steps: accepted


# ----- the cluster's view and timeouts on a loaded machine (item 8) -----

def test_cluster_info_asks_the_scheduler_not_the_clients_cache():
    """`Client.scheduler_info(n_workers=-1)` in distributed < 2026.11 refreshed a cache and returned it; the
    client's periodic update (every 2 s) overwrites that cache with an answer listing no worker, and on a loaded
    machine it landed in between, so every placed worker looked lost at once (distributed 2026.11 returns the fetched
    answer instead). Simulated here deterministically, whatever distributed's version: the cache is overwritten right
    after each refresh, and cluster_info must still list every worker."""
    from distributed import Client, LocalCluster

    from pipelines.clusters import cluster_info, wait_for_workers
    with LocalCluster(n_workers=2, processes=False, threads_per_worker=1, dashboard_address=":0") as lc, \
            Client(lc) as client:
        client.wait_for_workers(2)
        real = client._update_scheduler_info

        async def refresh_then_periodic(n_workers=0):
            await real(n_workers=n_workers)
            return await real(n_workers=0)  # the periodic update, landing before the caller reads the cache
        client._update_scheduler_info = refresh_then_periodic
        client.sync(client._update_scheduler_info, n_workers=-1)
        assert client._scheduler_identity["workers"] == {}  # the cache older versions returned: the race
        assert len(cluster_info(client)["workers"]) == 2
        assert wait_for_workers(client, 2, timeout=5) == 2
        assert cluster_info({"workers": {"a": {}}}) == {"workers": {"a": {}}}  # a dict passes through


@pytest.mark.parametrize("stall", [1.0, 100.0, 240.0, 900.0, 3600.0])
def test_the_schedulers_worker_ttl_follows_the_watchs_bound(stall):
    """The scheduler drops a worker it has not heard from for worker-ttl (then "lost"); the watch reports a silent
    worker after runner.stall_timeout_s in its own line. The ttl is never below distributed's 300 s and always
    above the watch's bound, so a slow worker is reported by the watch first and never dropped as lost before."""
    from dask.utils import parse_timedelta

    from pipelines.clusters import scheduler_config
    from pipelines.config import load_config
    cfg, _ = load_config(["conf=smoke", f"runner.stall_timeout_s={stall}"])
    ttl = parse_timedelta(scheduler_config(cfg)["distributed.scheduler.worker-ttl"])
    assert ttl >= 300 and ttl >= stall + 60
    assert ttl == (300 if stall + 60 <= 300 else stall + 60)


# ----- Dask's worker tracebacks beside dagrl's one line -----

def test_reported_failures_stay_off_the_console_and_in_the_workers_log():
    import io

    from pipelines.worker_preload import DriverReportsFilter
    console_out, kept = io.StringIO(), []
    console = logging.StreamHandler(console_out)
    console.addFilter(DriverReportsFilter())
    keeper = logging.Handler()
    keeper.emit = kept.append
    log = logging.getLogger("test-dagrl-failing-cleanly.distributed")
    log.propagate = False
    log.handlers = [console, keeper]

    def rec(name, msg, exc=None):
        return logging.LogRecord(name, logging.ERROR, __file__, 1, msg, None,
                                 (type(exc), exc, None) if exc is not None else None)
    cases = [(rec("distributed.worker", "Compute Failed\nKey: x"), False),
             (rec("distributed.worker", "Worker stream died during communication: tcp://a", ConnectionResetError()),
              False),
             (rec("distributed.worker", "Worker stream died during communication: tcp://a", ValueError("bug")), True),
             (rec("distributed.worker", "Failed to communicate with scheduler during heartbeat.",
                  __import__("distributed").comm.CommClosedError("in <TCP (closed)>: ConnectionResetError")), False),
             (rec("distributed.worker", "Unexpected exception during heartbeat. Closing worker.", KeyError("x")),
              True),
             (rec("distributed.worker", "some other worker error"), True),
             (rec("distributed.core", "Exception while handling op gather"), True)]
    for record, shown in cases:
        log.handle(record)
        assert (record.getMessage() in console_out.getvalue()) == shown, record.getMessage()
    assert len(kept) == len(cases)  # the worker's own log (non-stream handler) keeps every one


# ----- a real tiny run whose run dir is removed mid-run -----

@pytest.mark.slow
@pytest.mark.timeout(600)
def test_run_dir_removed_mid_run_is_one_line_exit_1_nothing_recreated(tmp_path, capfd, monkeypatch):
    """`conf=smoke` for 3 steps; after step 1 the hook first reads the dashboard's /json/identity.json (a worker
    ran tasks just before: tuple-keyed metrics; it answered 500 before), then removes the run directory. The run
    ends with exit 1 and ONE line naming the directory (it ended in a ~60-line KeyError traceback and re-created
    part of the directory); nothing of the run dir comes back, and no worker prints Dask's "Compute Failed" beside
    the line (stderr read at the file descriptor: the workers' output too)."""
    import urllib.request

    import pipelines.runner
    from pipelines import run
    seen = {}
    original = pipelines.runner.Runner.run

    def hook(r):
        if r.state.step != 1:
            return
        url = r.handle.dashboard_link.replace("/status", "/json/identity.json")
        with urllib.request.urlopen(url, timeout=60) as answer:
            seen["status"], seen["doc"] = answer.status, json.loads(answer.read())
        seen["run_dir"] = r.run_dir
        shutil.rmtree(r.run_dir)

    def run_with_hook(self):
        self.after_step = hook
        return original(self)
    monkeypatch.setattr(pipelines.runner.Runner, "run", run_with_hook)
    capfd.readouterr()
    rc = run.main(["conf=smoke", f"run_root={tmp_path}", "runner.max_steps=3", "runner.progress=false",
                   "cluster.dashboard_address=127.0.0.1:0"])
    err = [ln for ln in capfd.readouterr().err.splitlines() if ln.strip()]  # the workers' stderr included
    assert seen["status"] == 200 and len(seen["doc"]["workers"]) == seen["doc"]["n_workers"] > 0
    assert rc == 1, err
    assert err == [f"error: the run directory {seen['run_dir']} was removed while the run trained; the run stopped "
                   f"and wrote nothing more (nothing was re-created there): restore the directory and resume with "
                   f"runner.resume={seen['run_dir'].name}, or start a new run"], err
    assert not seen["run_dir"].exists()


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
