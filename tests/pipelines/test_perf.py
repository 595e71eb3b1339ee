"""The per-run performance report (pipelines.runner.perf, pipelines.perf) and the runner's profiling keys.

Without a cluster: the critical path against every path of small random graphs, the colocated env_step split, the
summary's partition of the run wall, the profiler wrapper, the keys' validation.

On one embedded cluster (module fixture, tiny rollouts): a run's perf_summary.json against the run's own MLflow
metrics (env steps/s, update samples/s, the update's Dask-measured time against its own timer), its phases adding
up per step and per run, the memory of every process role, the profiles in MLflow; a resume with nothing left to
do still reports the cluster's memory; a rollback after a killed actor sets the progress bar back to the restored
step and is counted in the summary.
"""
from __future__ import annotations

import json
import random
import time

import pytest

from pipelines.runner.perf import (RUN_PHASES, critical_path, format_table, phase_of, read_events,
                                   split_phases, summarize)

pytestmark = pytest.mark.timeout(600)

TINY = ["conf=smoke", "rollout.chunk_steps=4", "rollout.chunk_steps_per_node=2", "env.max_episode_steps=6",
        "policy.hidden_sizes=[32,32]", "runner.pause_timeout_s=3"]


# ----- no cluster -----
def _all_paths(deps: dict[str, set]) -> list[list[str]]:
    """Every chain through `deps` (key -> its dependencies), by enumeration."""
    children = {k: [c for c in deps if k in deps[c]] for k in deps}
    out = []

    def walk(path):
        out.append(path)
        for c in children[path[-1]]:
            walk(path + [c])
    for k in deps:
        walk([k])
    return out


def test_critical_path_is_the_heaviest_chain():
    """Against the brute-force maximum over every chain of random DAGs (and a hand-worked diamond)."""
    deps = {"a": set(), "b": {"a"}, "c": {"a"}, "d": {"b", "c"}}
    assert critical_path(deps, {"a": 1, "b": 5, "c": 2, "d": 1}) == ["a", "b", "d"]
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 9)
        keys = [f"k{i}" for i in range(n)]
        deps = {k: {keys[j] for j in range(i) if rng.random() < 0.4} for i, k in enumerate(keys)}
        w = {k: rng.choice([0.0, rng.random() * 10]) for k in keys}
        got = critical_path(deps, w)
        best = max(sum(w[k] for k in p) for p in _all_paths(deps))
        assert sum(w[k] for k in got) == pytest.approx(best)
        assert all(got[i] in deps[got[i + 1]] for i in range(len(got) - 1))  # a chain of dependencies


def test_phase_of_names_each_node_of_the_graphs():
    rid = "20261201-120000-ab12"
    assert phase_of(f"env_step_s1-{rid}-3-0") == "rollout"
    assert phase_of(f"env_step_s0p1-{rid}-3-2") == "rollout"
    assert phase_of(f"policy_infer_p1-{rid}-3-2") == "inference"
    assert phase_of(f"weights_handle-{rid}-3") == "weight_sync"
    assert phase_of(f"weights_handle_eval-{rid}-3") == phase_of(f"eval_videos-{rid}-3") == "eval"
    assert phase_of(f"actor_update_r1-{rid}-3-retry1") == "update"
    assert phase_of(f"store_s0-{rid}-3") == "store"
    assert phase_of(f"export_pretrained-{rid}-3") == "checkpoint"
    assert phase_of(f"step_metrics-{rid}-3") == "other_tasks"


def test_a_colocated_env_step_is_split_by_its_shards_timers():
    """10 s of Dask compute for a shard whose timers say infer 2, weight load 1 of 8: inference 10*2/8, weight
    sync 10*1/8, rollout the rest; the transfer apart; a node of another phase untouched."""
    times = {"env_step_s1-r-0-0": (10.0, 0.5), "actor_update-r-0": (3.0, 0.0)}
    timing = [{"infer": 0.0, "total": 1.0, "weight_sync": 0.0}, {"infer": 2.0, "total": 8.0, "weight_sync": 1.0}]
    got = split_phases(times, times, timing, colocated=True)
    assert got == pytest.approx({"inference": 2.5, "weight_sync": 1.25, "rollout": 6.25, "transfer": 0.5,
                                 "update": 3.0})
    assert split_phases(times, times, timing, colocated=False)["rollout"] == 10.0  # disaggregated: env only


def _step(n, wall, path, env_steps=40, rollout_s=1.0, update_s=0.5, epochs=2.0, attempt=0):
    return {"kind": "step", "step": n, "attempt": attempt, "wall_s": wall, "path": path, "busy": path,
            "overhead_s": max(0.0, wall - sum(path.values())), "overlap_s": 0.0, "env_steps": env_steps,
            "rollout_s": rollout_s, "update_s": update_s, "samples": 16, "epochs": epochs, "tasks": 3, "t": 0}


def test_the_summary_partitions_the_run_wall():
    """Two sessions (a resume); the phases (steps' paths and overhead, eval, checkpoint, driver) add up to the
    sum of the sessions' walls; throughputs from their definitions."""
    ev = [{"kind": "session", "t": 100.0}, _step(1, 3.0, {"rollout": 1.5, "update": 0.5}),
          {"kind": "eval", "step": 1, "wall_s": 2.0, "t": 106.0}, {"kind": "retry", "what": "training step", "step": 2,
                                                                    "t": 107.0},
          _step(2, 4.0, {"rollout": 2.0, "store": 1.0}, attempt=1, rollout_s=3.0),
          {"kind": "session_end", "wall_s": 12.0, "t": 112.0},
          {"kind": "session", "t": 200.0}, {"kind": "checkpoint", "step": 2, "wall_s": 1.0, "t": 201.0},
          {"kind": "rollback", "to_step": 2, "t": 201.5}]  # the second session has no end event: up to t=201.5
    s = summarize(ev)
    assert s["wall_s"] == pytest.approx(13.5)
    assert sum(s["phases_s"].values()) == pytest.approx(13.5)
    assert s["phases_s"]["scheduling_overhead"] == pytest.approx(1.0 + 1.0)
    assert s["phases_s"]["driver"] == pytest.approx(13.5 - 7.0 - 2.0 - 1.0)
    assert set(s["phases_s"]) == set(RUN_PHASES)
    assert s["env_steps_per_s"] == pytest.approx(80 / 4.0) and s["env_steps_per_s_wall"] == pytest.approx(80 / 7.0)
    assert s["update_samples_per_s"] == pytest.approx(2 * 16 * 2.0 / 1.0)
    assert s["retries"] == {"total": 1, "by_graph": {"training step": 1}, "rollbacks": 1, "steps_retried": 1}
    assert s["sessions"] == 2 and s["steps"] == 2
    assert "env steps/s 20 (rollout)" in format_table(s)


def test_profiled_writes_a_chrome_trace_of_the_call(tmp_path):
    import torch
    from tasks.profiling import profiled
    out = profiled(str(tmp_path / "p" / "t.json"), torch.matmul, torch.ones(8, 8), torch.ones(8, 8))
    assert torch.equal(out, torch.full((8, 8), 8.0))
    names = {e.get("name") for e in json.loads((tmp_path / "p" / "t.json").read_text())["traceEvents"]}
    assert "aten::matmul" in names


@pytest.mark.parametrize("override,key", [("runner.profile_steps=[0]", "runner.profile_steps"),
                                          ("runner.profile_steps=[4]", "runner.profile_steps"),
                                          ("runner.profile_steps=[1,1]", "runner.profile_steps"),
                                          ("runner.profile_update_step=4", "runner.profile_update_step")])
def test_profile_keys_are_checked(override, key):
    from pipelines.config import load_config
    from tasks.config import ConfigError
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(["conf=smoke", "runner.max_steps=3", override])


# ----- one embedded cluster -----
@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from pipelines.clusters import start_cluster
    from pipelines.config import load_config
    cfg, _ = load_config([*TINY, f"run_root={tmp_path_factory.mktemp('cluster')}"])
    handle = start_cluster(cfg)
    yield handle
    handle.close()


@pytest.fixture(scope="module")
def run_root(tmp_path_factory):
    return tmp_path_factory.mktemp("runs")


def _runner(cluster, root, *overrides):
    from pipelines.config import load_config
    from pipelines.runner import Runner
    cfg, _ = load_config([*TINY, f"run_root={root}", *overrides])
    said: list[str] = []
    return cfg, Runner(cfg, cluster, echo=said.append), said


def _history(runner, key) -> dict[int, float]:
    return dict(runner.tracker.get_metric_history(key))


@pytest.fixture(scope="module")
def finished(cluster, run_root):
    """A 3-step run: step 2 under performance_report, step 1's update under torch.profiler."""
    cfg, runner, said = _runner(cluster, run_root, "runner.max_steps=3", "runner.val_check_interval=3",
                                "runner.save_interval=3", "runner.profile_steps=[2]", "runner.profile_update_step=1")
    res = runner.run()
    return cfg, runner, said, res


def test_the_summary_agrees_with_the_runs_metrics(finished):
    cfg, runner, said, res = finished
    s = json.loads((res.run_dir / "perf_summary.json").read_text())
    steps = [e for e in read_events(res.run_dir) if e["kind"] == "step"]
    assert [e["step"] for e in steps] == [1, 2, 3] and s["steps"] == 3
    walls = _history(runner, "time/step")
    for e in steps:  # synchronous steps: the critical path's phases and the overhead add up to the step wall
        assert e["wall_s"] == pytest.approx(walls[e["step"]])
        assert 0 < sum(e["path"].values()) <= e["wall_s"]
        assert sum(e["path"].values()) + e["overhead_s"] == pytest.approx(e["wall_s"])
        assert e["path"]["rollout"] > 0 and e["busy"]["update"] > 0
    assert sum(s["phases_s"].values()) == pytest.approx(s["wall_s"])
    assert all(v >= 0 for v in s["phases_s"].values())
    assert s["wall_s"] <= res.wall_s + 1.0  # the session's wall is Runner.run's (the report itself comes after)
    # throughputs, computed here from the run's MLflow metrics
    env_steps = _history(runner, "rollout/env_steps_total")[3]
    rollout = sum(_history(runner, "time/rollout_total_max").values())
    assert env_steps == res.env_steps == s["env_steps"]
    assert s["env_steps_per_s"] == pytest.approx(env_steps / rollout)
    upd, epochs = _history(runner, "time/update"), _history(runner, "train/epochs_run")
    samples = sum(cfg.env.num_envs * cfg.rollout.chunk_steps * epochs[n] for n in upd)
    assert s["update_samples_per_s"] == pytest.approx(samples / sum(upd.values()))
    # Dask's compute of the update nodes holds the update's own timer (which runs inside them)
    assert s["busy_s"]["update"] >= sum(upd.values())
    assert s["evals"] == 1 and s["checkpoints"] == 1 and s["retries"]["total"] == 0
    assert any(line.startswith("perf, whole run (1 session): 3 step(s)") for line in said)


def test_memory_covers_every_process_role(finished, cluster):
    cfg, runner, said, res = finished
    mem = json.loads((res.run_dir / "perf_summary.json").read_text())["memory"]
    roles = mem["roles"]
    assert roles["env_workers"]["processes"] == len(set(runner.placement.env_workers)) == 2
    assert roles["gpu_workers"]["processes"] == 1 and roles["driver"]["processes"] == 1
    total = sum(r["peak_rss_gib"] for r in roles.values())
    assert mem["cluster_peak_rss_gib"] == pytest.approx(total) == pytest.approx(res.peak_rss_gb)
    # each worker is a full Python process with torch: far above the driver alone, and the sum of the peaks is at
    # least the largest simultaneous resident memory the steps logged
    assert roles["env_workers"]["peak_rss_max_gib"] > 0.1
    assert res.peak_rss_gb >= max(_history(runner, "system/rss_total_gb").values()) > roles["driver"]["peak_rss_gib"]


def test_profiles_are_in_the_run_dir_and_mlflow(finished):
    cfg, runner, said, res = finished
    html = res.run_dir / "profile" / "step_2.html"
    assert "Dask Performance Report" in html.read_text()
    trace = json.loads((res.run_dir / "profile" / "update_step_1.json").read_text())
    assert any(str(e.get("name", "")).startswith("aten::") for e in trace["traceEvents"])  # the update's torch ops
    logged = {a.path for a in runner.tracker.client.list_artifacts(runner.tracker.run_id)}
    assert {"perf_summary.json", "profile"} <= logged
    inner = {a.path for a in runner.tracker.client.list_artifacts(runner.tracker.run_id, "profile")}
    assert inner == {"profile/step_2.html", "profile/update_step_1.json"}


def test_the_command_reports_what_the_run_wrote(finished, run_root, capsys):
    """`python -m pipelines.perf RUN --json` rebuilds, from the events, the summary the run wrote at its end; an
    unknown run is one line and exit 2."""
    from pipelines import perf
    cfg, runner, said, res = finished
    assert perf.main([res.run_id, "--run-root", str(run_root), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == json.loads((res.run_dir / "perf_summary.json").read_text())
    assert perf.main(["20991231-000000-0000", "--run-root", str(run_root)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: no run '20991231-000000-0000'")


def test_a_resume_with_nothing_left_reports_the_cluster(finished, cluster, run_root):
    """runner.resume=<a run stopped after its last step's checkpoint, before its final eval>: no step runs (only
    that eval), yet the summary has a second session and every role's memory, and the printed peak is not 0. A run
    whose final eval is recorded is complete: its resume is refused before anything starts."""
    from tasks.config import ConfigError
    cfg, runner, said, res = finished
    resume = ("runner.max_steps=3", "runner.val_check_interval=3", "runner.save_interval=3",
              f"runner.resume={res.run_id}")
    with pytest.raises(ConfigError, match="is complete already"):
        _runner(cluster, run_root, *resume)
    final = res.run_dir / "evals" / "step_3.json"
    final.rename(final.with_suffix(".json.moved"))  # as if the run had stopped before its final eval
    _, again, said2 = _runner(cluster, run_root, *resume)
    res2 = again.run()
    assert res2.steps == 3 and res2.run_dir == res.run_dir
    s = json.loads((res.run_dir / "perf_summary.json").read_text())
    assert s["sessions"] == 2 and s["steps"] == 3
    assert {"driver", "env_workers", "gpu_workers"} <= set(s["memory"]["roles"])
    assert res2.peak_rss_gb >= s["memory"]["roles"]["env_workers"]["peak_rss_gib"] > 0.1


def test_a_rollback_sets_the_progress_bar_back(cluster, run_root):
    """The actor's worker is killed as step 4's update starts: the run rolls back to the step-2 checkpoint. The
    progress bar is at step 2 when the rollback is announced (it was at 3), at the run's step after every step,
    and the summary counts the retry, the rollback and the redone step 3."""
    from pipelines.faults import FaultAt
    cfg, runner, said = _runner(cluster, run_root, "runner.max_steps=4", "runner.save_interval=2",
                                "runner.val_check_interval=4", "runner.progress=true")
    rid, addr = runner.state.run_id, runner.placement.actor_worker
    seen: list[tuple] = []
    runner.after_step = lambda r: seen.append(("step", r.state.step, r._bar.n))
    runner.echo = lambda msg: (said.append(msg), seen.append(("said", msg, runner._bar and runner._bar.n)))
    cluster.client.register_plugin(FaultAt(addr, f"actor_update-{rid}-3", "kill"), name="dagrl-test-perf-kill")
    try:
        res = runner.run()
    finally:
        cluster.client.unregister_worker_plugin("dagrl-test-perf-kill")
        deadline = time.monotonic() + 120
        while len(cluster.client.scheduler_info(n_workers=-1)["workers"]) < 3 and time.monotonic() < deadline:
            time.sleep(0.5)
    assert res.steps == 4
    rolled = [n for kind, msg, n in seen if kind == "said" and "rolled back" in msg]
    assert rolled == [2], said
    steps = [(s, n) for kind, s, n in seen if kind == "step"]
    assert [s for s, _ in steps] == [1, 2, 3, 3, 4]  # steps 3 and 4 redone after the rollback to step 2
    assert all(s == n for s, n in steps)  # the bar at the run's step after every step
    s = json.loads((res.run_dir / "perf_summary.json").read_text())
    assert s["retries"]["rollbacks"] == 1 and s["retries"]["by_graph"] == {"training step": 1}
    assert s["steps"] == 5 and s["busy_s"].get("retried", 0) > 0  # step 4's lost attempt ran its rollout
