"""benchmarks/throughput.py's machine bound and actor-thread rule (the arithmetic its report prints), no runs."""
import os

import pytest

from tasks.config import Config, replace_key


@pytest.fixture(scope="module")
def tp(load_benchmark):
    return load_benchmark("throughput")


def test_machine_bound_adds_the_update_cpu_to_the_raw_simulator(tp):
    # 1600 env steps at 1657 steps/s on 2 cores = 0.966 s wall = 1.931 CPU-s; + 0.84 CPU-s update = 2.771 CPU-s
    # over 2 cores = 1.386 s per step -> 1155 steps/s (benchmarks/README.md's hand arithmetic for 2026-11-29)
    assert tp.machine_bound(1600, 1657.0, 0.84, 2) == pytest.approx(1600 / ((1600 / 1657 * 2 + 0.84) / 2))
    assert round(tp.machine_bound(1600, 1657.0, 0.84, 2)) == 1155
    assert tp.machine_bound(1600, 1657.0, 0.0, 2) == pytest.approx(1657.0)  # no update: the raw rate itself
    # more cores share the same update CPU time: the bound rises towards raw
    assert tp.machine_bound(1600, 1657.0, 0.84, 16) > tp.machine_bound(1600, 1657.0, 0.84, 2)


def test_actor_threads_follow_the_cluster_rule(tp, monkeypatch):
    cfg = Config()
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert tp.actor_threads(cfg) == 1  # 2 cores - 2 env workers, at least 1
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    assert tp.actor_threads(cfg) == 14
    cfg = replace_key(cfg, "cluster.actor_threads", 2)
    assert tp.actor_threads(cfg) == 2


def _mlflow_db(path, steps: dict[int, dict], log_times: dict[int, float]) -> None:
    """A minimal MLflow sqlite store: the metrics table read_pipeline_metrics queries (timestamps in ms)."""
    import sqlite3
    con = sqlite3.connect(path / "mlflow.db")
    con.execute("CREATE TABLE metrics (key TEXT, value REAL, timestamp INTEGER, step INTEGER)")
    for step, m in steps.items():
        for key, value in m.items():
            con.execute("INSERT INTO metrics VALUES (?, ?, ?, ?)", (key, value, int(log_times[step] * 1000), step))
    con.commit()
    con.close()


def _step(step: int, wall: float, **extra) -> dict:
    return {"rollout/env_steps_per_s": 1600 / wall, "rollout/env_steps_total": 1600.0 * step, "time/step": wall,
            "time/rollout_total_max": 0.5, "time/update": 0.3, "train/minibatch_updates": 64.0, **extra}


def test_overlapping_steps_are_measured_over_the_window_not_per_step(tp, tmp_path):
    """With steps ahead each step takes 1.0 s from submission to end but one ends every 0.5 s: 1600 env steps per
    0.5 s = 3200 env steps/s, not the per-step 1600 / 1.0."""
    n = tp.WARMUP_STEPS + 6
    _mlflow_db(tmp_path, {s: _step(s, 1.0) for s in range(1, n + 1)}, {s: 10.0 + 0.5 * s for s in range(1, n + 1)})
    m = tp.read_pipeline_metrics(str(tmp_path))
    assert m["overlapped"] and m["steps_per_s"] == pytest.approx(3200.0)


def test_synchronous_steps_keep_the_per_step_median(tp, tmp_path):
    walls = [1.0, 0.8, 1.0, 4.0, 1.0, 1.0, 1.0, 1.0]  # one slow step does not move the median
    steps = {s: _step(s, w, **{"time/overhead_share": 0.05}) for s, w in enumerate(walls, start=1)}
    times, t = {}, 0.0
    for s, w in enumerate(walls, start=1):
        t += w
        times[s] = t
    _mlflow_db(tmp_path, steps, times)
    m = tp.read_pipeline_metrics(str(tmp_path))
    assert not m["overlapped"] and m["steps_per_s"] == pytest.approx(1600.0)
