"""What a training step reports: the `step_metrics` node's merge of the update's metrics, the advantage statistics
and the rollout's episodes, timings and cursors (pipelines.graphs wires it after the update). Plain Python on the
task outputs: importable and testable without Dask.
"""
from __future__ import annotations

from tasks import trajectory


def step_metrics(update_out: dict, *parts: dict) -> dict:
    """Merge a step's metrics: update metrics, advantage stats (mean over shards), episodes (`env/*`; with several
    tasks among them also `env/task_<id>/*`: num_episodes, success_once, success_at_end, return), timings, cursors,
    weight sync (`time/weight_sync`: the slowest replica load, s; `system/weight_sync_mb`: MB loaded into replicas).
    `update_out` is the update's output or its handle (tasks.weights.handle: no tensors). `timing`: per shard the
    rollout's own seconds {"env", "infer", "total", "weight_sync"} (pipelines.runner.perf splits a colocated
    env_step node's Dask-measured time with them)."""
    M = trajectory.Meta
    n = len(parts) // 2
    trajs, advs = parts[:n], parts[n:]
    m = dict(update_out["metrics"])
    for key in advs[0]["stats"]:
        m[key] = sum(a["stats"][key] for a in advs) / n
    episodes = [e for t in trajs for e in t[M.EPISODES]]
    for k in ("success_once", "success_at_end", "return", "episode_len"):
        if episodes:
            m[f"env/{k}"] = sum(float(e[k]) for e in episodes) / len(episodes)
    m["env/num_episodes"] = float(len(episodes))
    tasks = sorted({int(e.get("task_id", 0)) for e in episodes})
    if len(tasks) > 1:  # a multi-task run (LIBERO): per task too, by the suite's task id
        for t in tasks:
            es = [e for e in episodes if int(e.get("task_id", 0)) == t]
            m[f"env/task_{t}/num_episodes"] = float(len(es))
            for k in ("success_once", "success_at_end", "return"):
                m[f"env/task_{t}/{k}"] = sum(float(e[k]) for e in es) / len(es)
    if all(M.WEIGHT_VERSION in t for t in trajs):  # behaviour weights vs the weights the update started from
        behaviour = min(t[M.WEIGHT_VERSION] for t in trajs)
        m["train/behaviour_version"] = float(behaviour)
        m["train/staleness"] = float(update_out["version"] - 1 - behaviour)
    for k in ("env", "infer", "total"):
        m[f"time/rollout_{k}_max"] = max(t[M.TIMING][k] for t in trajs)
    syncs = [t[M.WEIGHT_SYNC] for t in trajs if t.get(M.WEIGHT_SYNC) is not None]
    if syncs:  # each replica's load is reported by one shard of its worker: max over shards = max over workers
        m["time/weight_sync"] = max(s["seconds"] for s in syncs)
        m["system/weight_sync_mb"] = sum(s["bytes"] for s in syncs) / 1e6
    if any(M.OFFLOAD_S in t for t in trajs):
        m["time/offload_replica_max"] = max(t.get(M.OFFLOAD_S, 0.0) for t in trajs)
    timing = [{**t[M.TIMING], "weight_sync": (t.get(M.WEIGHT_SYNC) or {}).get("seconds", 0.0)} for t in trajs]
    return {"metrics": m, "cursors": [t[M.CURSOR] for t in trajs], "episodes": episodes, "timing": timing}


def step_metrics_ranks(num_others: int, rank0: dict, *rest: dict) -> dict:
    """`step_metrics` of a multi-rank update: `rest` = the other ranks' outputs, then trajectories and advantages.
    Checks every rank reached rank 0's weight version; `time/update` is the slowest rank's."""
    others, parts = rest[:num_others], rest[num_others:]
    for o in others:
        if o["version"] != rank0["version"]:
            raise RuntimeError(f"actor rank {o.get('rank')} reached weight version {o['version']}, rank 0 "
                               f"{rank0['version']}: the ranks diverged")
    out = step_metrics(rank0, *parts)
    out["metrics"]["time/update"] = max(m["metrics"]["time/update"] for m in (rank0, *others))
    return out
