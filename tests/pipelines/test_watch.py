"""The stall watch (pipelines.runner.watcher.Watcher._stalled_workers) on scripted scheduler views: no cluster.

Each case is a timeline of looks, one per second, at one placed worker; the expected result says at which look the
watch first reports a stall and of which kind. Bounds: pause_timeout_s=3, stall_timeout_s=10; a task may run up to
max(10 s, 4x the longest finished task of its kind).
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from pipelines.runner import watcher
from pipelines.runner.watcher import Watcher, _kind

W = "tcp://127.0.0.1:1"


def _h(status="running", executing=None, silent_s=0.5):
    return {"name": "env-1", "status": status, "memory": 400 * 2**20, "memory_limit": 3 * 2**30,
            "silent_s": silent_s, "executing": dict(executing or {}), "processing": len(executing or {})}


def Fake():
    cfg = SimpleNamespace(runner=SimpleNamespace(pause_timeout_s=3.0, stall_timeout_s=10.0),
                          cluster=SimpleNamespace(memory_limit="3GiB"))
    placement = SimpleNamespace(shard_workers=[W], actor_workers=[W], rollout_workers=[W])
    return Watcher(cfg, None, placement, placed_ids={W: W})


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
    monkeypatch.setattr(watcher.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(watcher, "pause_fraction", lambda client, addr: 0.05)
    fake._start_watch()
    got = None
    for i, h in enumerate(looks):
        clock[0] = float(i)
        monkeypatch.setattr(watcher, "worker_health", lambda client, addrs, h=h: {W: h})
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


# ----- the recovery decision (Watcher.plan_recovery) on a scripted cluster: no cluster -----
E1, E2, A = "tcp://e:1", "tcp://e:2", "tcp://a:1"


def _planner(monkeypatch, live: dict, placeable=lambda workers: True):
    """A Watcher over env workers E1, E2 and actor worker A whose cluster lists `live` ({address: status}); the
    placement it plans is the sorted tuple of the workers it was given (a ConfigError when `placeable` says no)."""
    from tasks.config import ConfigError
    cfg = SimpleNamespace(runner=SimpleNamespace(pause_timeout_s=3.0, stall_timeout_s=10.0),
                          cluster=SimpleNamespace(memory_limit="3GiB"))
    placement = SimpleNamespace(shard_workers=[E1, E2], actor_workers=[A], rollout_workers=[])
    w = Watcher(cfg, None, placement, placed_ids={E1: E1, E2: E2, A: A})
    restarted = []
    w.restart = lambda workers: (restarted.extend(workers), [])[1]
    info = {"workers": {a: {"status": s, "name": a} for a, s in live.items()}}
    monkeypatch.setattr(watcher, "rejoin", lambda cfg: (len(live), 1.0))  # every worker of the cluster is back
    monkeypatch.setattr(watcher, "wait_for_workers", lambda client, n, timeout: len(live))
    monkeypatch.setattr(watcher, "cluster_info", lambda client: info)

    def plan(cfg, info):
        if not placeable(set(info["workers"])):
            raise ConfigError("cluster.num_env_workers", 2, "give the cluster more env workers")
        return tuple(sorted(info["workers"]))
    monkeypatch.setattr(watcher, "plan_placement", plan)
    return w, restarted


def test_plan_recovery_restarts_the_stuck_leaves_the_paused_out_and_keeps_the_actor(monkeypatch):
    w, restarted = _planner(monkeypatch, {E1: "paused", E2: "running", A: "running", "tcp://e:3": "running"})
    w._watch["stalls"] = {E1: watcher.Stall(E1, "paused", "..."), E2: watcher.Stall(E2, "stuck", "...")}
    plan = w.plan_recovery({E1, E2}, set(), run_id="r", generation=0)
    assert restarted == [E2]  # the stuck worker gets a fresh process; the paused one is only left out
    assert plan.paused == {E1} and not plan.actor_lost and plan.stalled
    assert plan.placement == (A, E2, "tcp://e:3")  # the live, running workers but the paused one
    assert w._watch["stalls"] == {}  # consumed: the next wait starts clean


@pytest.mark.parametrize("lost,busy", [({A}, set()), ({E1}, {A})])
def test_plan_recovery_loses_the_actor_with_its_worker_or_a_busy_rank(monkeypatch, lost, busy):
    w, restarted = _planner(monkeypatch, {E1: "running", E2: "running", A: "running"})
    plan = w.plan_recovery(lost, busy, run_id="r", generation=0)
    assert plan.actor_lost and plan.paused == set() and not plan.stalled and restarted == []


def test_plan_recovery_without_a_healthy_placement_is_the_give_up_line(monkeypatch):
    w, _ = _planner(monkeypatch, {E1: "paused", E2: "running", A: "running"}, placeable=lambda ws: E1 in ws)
    w._watch["stalls"] = {E1: watcher.Stall(E1, "paused", "...")}
    with pytest.raises(watcher.NoPlacement) as exc:
        w.plan_recovery({E1}, set(), run_id="r", generation=0)
    # the actor's worker is healthy (its checkpoint can be written); the fix is the pause's, not the placement's
    # (the cluster could hold the run with every worker healthy)
    assert exc.value.actor_healthy
    assert exc.value.failed == f"worker ? ({E1}) paused for memory: no healthy placement without the paused " \
                               f"worker(s) ['{E1}']"
    assert exc.value.fix.startswith("raise cluster.memory_limit (now 3GiB) or the pause fraction")
