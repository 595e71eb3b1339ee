"""Killing a worker mid-run: the step is retried on the restarted worker and the run finishes.

An env worker's loss re-creates its shard from the step's seed cursor; the actor worker's loss restores the actor
from the last checkpoint (the run rolls back to that step and redoes the steps after it).
"""
from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from pipelines.cluster import start_cluster
from pipelines.config import load_config
from pipelines.runner import Runner
from storage.trajectories import TrajectoryStore


@pytest.mark.slow  # timing-dependent (where the kill lands); run with `pytest -m slow`
@pytest.mark.parametrize("victim", ["env", "actor"])
def test_killed_worker_is_recovered(tmp_path, victim):
    cfg, _ = load_config(["conf=smoke", f"run_root={tmp_path}", "runner.max_steps=6", "rollout.chunk_steps=40",
                          "rollout.chunk_steps_per_node=20", "runner.save_interval=2", "runner.val_check_interval=6"])
    handle = start_cluster(cfg)
    try:
        runner = Runner(cfg, handle, echo=lambda *a: None)
        pids = handle.client.run(os.getpid)
        addr = runner.placement.shard_workers[1] if victim == "env" else runner.placement.actor_worker
        killed = []

        def killer():
            while runner.state.step < 3:
                time.sleep(0.02)
            time.sleep(0.3)  # inside step 3's rollout
            os.kill(pids[addr], signal.SIGKILL)
            killed.append(runner.state.step)

        threading.Thread(target=killer, daemon=True).start()
        res = runner.run()
        assert killed, "the worker was never killed"
        assert res.steps == 6 and res.env_steps == 6 * 4 * 40
        retries = runner.tracker.get_metric_history("train/retries")
        assert sum(v for _, v in retries) == 1.0
        steps = [s for s, _ in retries]
        if victim == "actor":  # rolled back to the last checkpoint (every 2 steps): at most one step redone
            assert sorted(set(steps)) == [1, 2, 3, 4, 5, 6] and len(steps) in (6, 7) and steps == sorted(steps)
        else:
            assert steps == [1, 2, 3, 4, 5, 6]
        store = TrajectoryStore.open(res.store_path)
        assert store.complete_epochs().tolist() == list(range(6))
        assert runner.placement.shard_workers[1] != addr or victim == "actor"
    finally:
        handle.close()
