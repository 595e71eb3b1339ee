"""Broken workers mid-run, at deterministic points (`pipelines.faults.FaultAt`: the fault happens when a given task
starts on a given worker, once), so these run in the default suite and cannot flake on where a kill lands.

- a killed env worker: its shard is re-created from the step's seed cursor and the step retried;
- a killed actor worker: the actor is restored from the last checkpoint (the run rolls back to that step and redoes
  the steps after it);
- a paused env worker (memory): detected within `runner.pause_timeout_s`, one line naming it, its memory and the
  key to change; the step is retried on the healthy workers;
- every env worker paused: no healthy placement; the run stops with a checkpoint of the last finished step and
  RunStalled naming the resume command;
- the issue's input, `DASK_DISTRIBUTED__WORKER__MEMORY__PAUSE=0.05 python -m pipelines.run conf=smoke`: every worker
  is paused from the start; exit 1 with one line instead of a hang.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipelines.cluster import start_cluster
from pipelines.config import load_config
from pipelines.faults import FaultAt
from pipelines.recovery import RunStalled
from pipelines.runner import Runner
from storage.checkpoints import latest_checkpoint, load_checkpoint
from storage.trajectories import TrajectoryStore

pytestmark = pytest.mark.timeout(300)  # a hang fails the test instead of the suite

BASE = ["conf=smoke", "runner.pause_timeout_s=3"]


def _env_steps(cfg, steps: int) -> int:
    return steps * cfg.env.num_envs * cfg.rollout.chunk_steps * cfg.policy.num_action_chunks


def _newest(history) -> dict:
    """step -> the newest value logged at that step (a rolled-back step may be logged again)."""
    return dict(history)


def _inject(runner, faults: list[tuple[str, str, str]]) -> None:
    """Install one FaultAt per (worker address, task key, action)."""
    for i, (addr, key, action) in enumerate(faults):
        runner.client.register_plugin(FaultAt(addr, key, action), name=f"dagrl-test-fault-{i}")


def _start(tmp_path, *overrides):
    cfg, _ = load_config([*BASE, f"run_root={tmp_path}", *overrides])
    handle = start_cluster(cfg)
    said: list[str] = []
    try:
        return cfg, handle, Runner(cfg, handle, echo=said.append), said
    except BaseException:
        handle.close()
        raise


# victim, runner overrides, the task at which the victim dies ({rid}: run id), newest train/retries per step
KILLS = [
    # shard 1's worker dies as step 2's first env node starts: the shard is re-created from the step's cursor
    ("env", ["runner.max_steps=3", "runner.save_interval=3", "runner.val_check_interval=3"],
     "env_step_s1-{rid}-1-0", {1: 0.0, 2: 1.0, 3: 0.0}),
    # the actor's worker dies as step 4's update starts: rolled back to the step-2 checkpoint, steps 3, 4 redone
    ("actor", ["runner.max_steps=4", "runner.save_interval=2", "runner.val_check_interval=4"],
     "actor_update-{rid}-3", {1: 0.0, 2: 0.0, 3: 1.0, 4: 0.0}),
]


@pytest.mark.parametrize("victim,overrides,key,retries", KILLS, ids=[k[0] for k in KILLS])
def test_killed_worker_is_recovered(tmp_path, victim, overrides, key, retries):
    cfg, handle, runner, said = _start(tmp_path, *overrides)
    try:
        rid = runner.state.run_id
        addr = runner.placement.shard_workers[1] if victim == "env" else runner.placement.actor_worker
        _inject(runner, [(addr, key.format(rid=rid), "kill")])
        res = runner.run()
        n = cfg.runner.max_steps
        assert res.steps == n and res.env_steps == _env_steps(cfg, n)
        lost = [m for m in said if "lost during step" in m]
        assert len(lost) == 1 and addr in lost[0], said
        if victim == "env":
            assert "lost during step 1; retrying" in lost[0]
            assert addr not in runner.placement.shard_workers  # the restarted worker has a new address
        else:
            assert "lost during step 3; restoring the actor from the last checkpoint" in lost[0]
            assert runner.placement.actor_worker != addr
        assert _newest(runner.tracker.get_metric_history("train/retries")) == retries
        versions = _newest(runner.tracker.get_metric_history("train/weight_version"))
        assert versions == {s: float(s) for s in range(1, n + 1)}
        assert TrajectoryStore.open(res.store_path).complete_steps().tolist() == list(range(n))
        assert load_checkpoint(latest_checkpoint(res.run_dir))["run"]["runner"]["step"] == n
    finally:
        handle.close()


def test_paused_env_worker_is_left_out(tmp_path):
    """Shard 1's worker pauses for memory as step 2's first env node starts: within pause_timeout_s the run names it
    (one line: worker, state, memory, the keys to change) and retries step 2 with both shards on the other worker."""
    cfg, handle, runner, said = _start(tmp_path, "runner.max_steps=3", "runner.save_interval=3",
                                       "runner.val_check_interval=3")
    try:
        rid = runner.state.run_id
        addr, other = runner.placement.shard_workers[1], runner.placement.shard_workers[0]
        assert addr != other
        _inject(runner, [(addr, f"env_step_s1-{rid}-1-0", "pause")])
        res = runner.run()
        assert res.steps == 3 and res.env_steps == _env_steps(cfg, 3)
        lines = [m for m in said if "paused for memory" in m]
        assert len(lines) == 1, said
        name = handle.client.scheduler_info(n_workers=-1)["workers"][addr]["name"]
        assert f"worker {name} ({addr}) paused for memory" in lines[0]
        assert "cluster.memory_limit" in lines[0] and "DASK_DISTRIBUTED__WORKER__MEMORY__PAUSE" in lines[0]
        assert "process memory" in lines[0] and "pause fraction 1e-09" in lines[0]
        assert any(f"retrying without ['{addr}']" in m for m in said), said
        assert runner.placement.shard_workers == [other, other]
        assert _newest(runner.tracker.get_metric_history("train/retries")) == {1: 0.0, 2: 1.0, 3: 0.0}
        assert TrajectoryStore.open(res.store_path).complete_steps().tolist() == [0, 1, 2]
    finally:
        handle.close()


def test_no_healthy_placement_stops_with_a_checkpoint(tmp_path):
    """Both env workers pause as step 3's env nodes start: no placement is left, the actor is healthy, so the run
    writes a checkpoint of step 2 (the last finished one) and raises RunStalled with the resume command."""
    cfg, handle, runner, said = _start(tmp_path, "runner.max_steps=3", "runner.save_interval=3",
                                       "runner.val_check_interval=3")
    try:
        rid, shards = runner.state.run_id, list(runner.placement.shard_workers)
        _inject(runner, [(shards[s], f"env_step_s{s}-{rid}-2-0", "pause") for s in (0, 1)])
        with pytest.raises(RunStalled) as err:
            runner.run()
        msg = str(err.value)
        assert msg.startswith("stopped at step 2: no healthy placement without the paused worker(s)"), msg
        assert all(a in msg for a in shards), msg
        assert f"runner.resume={rid}" in msg and "global_step_2" in msg
        ckpt = latest_checkpoint(runner.run_dir)
        assert ckpt is not None and ckpt.name == "global_step_2" and str(ckpt) in msg
        assert load_checkpoint(ckpt)["run"]["runner"]["step"] == 2
        paused = [m for m in said if "paused for memory" in m]
        assert len(paused) == 1 and any(a in paused[0] for a in shards), said
    finally:
        handle.close()


def test_memory_paused_cluster_exits_with_one_line(tmp_path):
    """The issue's input: every worker pauses at start-up (pause fraction 0.05 of 3 GiB is below any worker's
    memory); the init graph's wait reports it and the run exits 1 with one `error:` line, no hang."""
    env = {**os.environ, "DASK_DISTRIBUTED__WORKER__MEMORY__PAUSE": "0.05"}
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "pipelines.run", "conf=smoke", f"run_root={tmp_path}",
                           "runner.pause_timeout_s=3"], env=env, capture_output=True, text=True, timeout=240,
                          cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 1, proc.stderr[-2000:]
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "the init graph" in errors[0] and "no checkpoint of this run exists yet" in errors[0]
    paused = [ln for ln in proc.stdout.splitlines() if "paused for memory" in ln]
    assert len(paused) == 1 and "pause fraction 0.05" in paused[0] and "cluster.memory_limit" in paused[0]
    assert time.monotonic() - t0 < 200
