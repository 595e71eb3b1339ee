"""The step scheduler's store attempts: the attempt id `TrajectoryStore.reserve` returns for a
submission reaches every `store_s` node, so a write of a given-up attempt that runs late (a released task still
executing) does not count for the retry's attempt. No cluster."""
from __future__ import annotations

import numpy as np
import pytest

from pipelines import graphs
from pipelines.clusters import Placement
from pipelines.runner import trajectory_fields
from storage.trajectories import TrajectoryStore
from tasks.config import Config, replace_keys
from tasks.config import check_config

PLACEMENT = Placement(shard_workers=["tcp://10.0.0.1:4001", "tcp://10.0.0.2:4002"],
                      actor_worker="tcp://10.0.0.3:4003")


def _cfg() -> Config:
    cfg = replace_keys(Config(), {"env.num_envs": 4, "env.num_shards": 2, "rollout.chunk_steps": 6,
                                  "rollout.chunk_steps_per_node": 2, "policy.hidden_sizes": [16, 16],
                                  "algorithm.num_minibatches": 2, "algorithm.update_epochs": 2})
    return check_config(cfg)


def test_store_nodes_carry_the_reserved_attempt():
    cfg = _cfg()
    sg = graphs.build_train_step(cfg, run_id="20260101-120000-a1b2", step=3, weights={"version": 0},
                                 cursors=[None, None], placement=PLACEMENT, store_path="/nowhere.zarr",
                                 store_attempt=5)
    tasks = {k: sg.graph.layers[k][k] for k in sg.stores}
    assert sorted(tasks) == ["store_s0-20260101-120000-a1b2-3", "store_s1-20260101-120000-a1b2-3"]
    for s, (key, task) in enumerate(sorted(tasks.items())):
        fn, path, step, shard, _traj, attempt = task
        assert (fn, path, step, shard, attempt) == (graphs._store, "/nowhere.zarr", 3, s, 5)


def test_a_late_write_of_a_given_up_attempt_does_not_count(tmp_path):
    cfg = _cfg()
    T, S = cfg.rollout.chunk_steps, cfg.env.shard_size
    fields = trajectory_fields(cfg, 3, 2)
    store = TrajectoryStore.create(tmp_path / "t.zarr", fields=fields, T=T, num_envs=cfg.env.num_envs,
                                   shard_size=S)
    traj = {name: np.zeros((T, S, *spec.shape), spec.dtype) for name, spec in fields.items()}
    first = store.reserve(0)
    retry = store.reserve(0)  # the step was retried: a new attempt
    assert retry == first + 1
    graphs._store(str(store.path), 0, 0, traj, retry)
    graphs._store(str(store.path), 0, 1, traj, retry)
    graphs._store(str(store.path), 0, 1, traj, first)  # the first attempt's shard-1 task, finishing late
    reopened = TrajectoryStore.open(store.path)
    assert reopened.shards_written(0).tolist() == [True, False]  # shard 1 now holds the old attempt: not whole


def test_env_steps_per_s_counts_an_overlapped_step_from_the_previous_steps_end(monkeypatch):
    """time/step and rollout/env_steps_per_s (the progress bar's env_sps): a synchronous step's own wall time;
    with steps ahead (submitted while the previous one runs) the time since the previous step ended, so two
    overlapping 1.0 s steps that end 0.5 s apart count 0.5 s, not 1.0 s (time/step values add up to the wall)."""
    import types

    from pipelines.runner import scheduler as sch

    clock = {"t": 100.0}
    monkeypatch.setattr(sch.time, "perf_counter", lambda: clock["t"])
    cfg = Config()
    sched = sch.Scheduler(cfg, None, types.SimpleNamespace(step=0, env_steps=0, cursors=None), watch=None,
                          ctx=types.SimpleNamespace(store=None), recovery=None)  # no perf: no perf event
    sched._env_steps_per_step = lambda: 1600

    def finish(t0: float, end: float) -> dict:
        clock["t"] = end
        out = {"metrics": {"train/weight_version": 1.0, "time/rollout_total_max": 0.4, "time/update": 0.3},
               "cursors": None}
        return sched._finish_step(1, None, out, [], 0, t0)

    m = finish(t0=100.0, end=101.0)  # the first step: its own wall time
    assert m["time/step"] == 1.0 and m["rollout/env_steps_per_s"] == 1600.0
    m = finish(t0=101.2, end=102.0)  # synchronous: submitted after the previous end
    assert m["time/step"] == pytest.approx(0.8) and m["rollout/env_steps_per_s"] == pytest.approx(2000.0)
    m = finish(t0=101.5, end=102.5)  # overlapped: submitted at 101.5, the previous ended at 102.0
    assert m["time/step"] == pytest.approx(0.5) and m["rollout/env_steps_per_s"] == pytest.approx(3200.0)
