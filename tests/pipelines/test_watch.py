"""The stall watch (pipelines.recovery.Recovery._stalled_workers) on scripted scheduler views: no cluster.

Each case is a timeline of looks, one per second, at one placed worker; the expected result says at which look the
watch first reports a stall and of which kind. Bounds: pause_timeout_s=3, stall_timeout_s=10; a task may run up to
max(10 s, 4x the longest finished task of its kind).
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from pipelines import recovery
from pipelines.recovery import Recovery, _kind

W = "tcp://127.0.0.1:1"


def _h(status="running", executing=None, silent_s=0.5):
    return {"name": "env-1", "status": status, "memory": 400 * 2**20, "memory_limit": 3 * 2**30,
            "silent_s": silent_s, "executing": dict(executing or {}), "processing": len(executing or {})}


class Fake(Recovery):
    def __init__(self):
        self.cfg = SimpleNamespace(runner=SimpleNamespace(pause_timeout_s=3.0, stall_timeout_s=10.0),
                                   cluster=SimpleNamespace(memory_limit="3GiB"))
        self.placement = SimpleNamespace(shard_workers=[W], actor_workers=[W], rollout_workers=[W])
        self.client = None
        self.ranks = 1


P, R = "paused", "running"
CASES = {
    # name: (looks, index of the first look reporting a stall or None, its kind)
    "paused past the bound": ([_h(P)] * 5, 3, "paused"),
    "paused below the bound": ([_h(P)] * 3, None, None),
    "a pause broken by running restarts the clock": ([_h(P), _h(P), _h(R), _h(P), _h(P), _h(P), _h(P)], 6, "paused"),
    "a task past stall_timeout_s": ([_h(executing={"actor_update-r-1": t}) for t in (5, 9, 11)], 2, "stuck"),
    "expected time learned from a finished task of the kind":
        ([_h(executing={"env_step_s0-r-0-0": 8.0}), _h(), _h(executing={"env_step_s1-r-1-0": 20.0}),
          _h(executing={"env_step_s1-r-1-0": 31.0}), _h(executing={"env_step_s1-r-1-0": 33.0})], 4, "stuck"),
    "a task of another kind does not raise the bound":
        ([_h(executing={"eval_s0-r-0": 9.0}), _h(), _h(executing={"actor_update-r-1": 11.0})], 2, "stuck"),
    "a worker not heard from": ([_h(silent_s=2), _h(silent_s=11)], 1, "silent"),
    "all fine": ([_h(executing={"actor_update-r-1": 3.0})] * 4, None, None),
}


@pytest.mark.parametrize("name", list(CASES))
def test_stall_watch(monkeypatch, name):
    looks, first, kind = CASES[name]
    fake, clock = Fake(), [0.0]
    monkeypatch.setattr(recovery.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(recovery, "pause_fraction", lambda client, addr: 0.05)
    fake._start_watch()
    got = None
    for i, h in enumerate(looks):
        clock[0] = float(i)
        monkeypatch.setattr(recovery, "worker_health", lambda client, addrs, h=h: {W: h})
        stalls = fake._stalled_workers()
        if stalls and got is None:
            got = (i, stalls[W].kind, stalls[W].line)
    if first is None:
        assert got is None, got
        return
    assert got is not None and got[:2] == (first, kind), got
    line = got[2]
    assert line.startswith(f"dagrl: worker env-1 ({W}) ") and "400 MiB" in line and "3.00 GiB" in line
    fix = {"paused": "cluster.memory_limit", "stuck": "runner.stall_timeout_s", "silent": "runner.stall_timeout_s"}
    assert fix[kind] in line


def test_task_kind():
    assert [_kind(k) for k in ("env_step_s1-run-3-0", "actor_update-run-2-retry1", "eval_s0-run-4",
                               "actor_update_r1-run-0")] == ["env_step_s", "actor_update", "eval_s", "actor_update_r"]
