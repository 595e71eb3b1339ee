"""Graph builders: one training step (and the init / eval / checkpoint graphs) as a Dask HighLevelGraph.

Builders are pure: they return a graph of task tuples and compute nothing (tests/pipelines/test_graphs.py proves
it). Each node is its own layer so it carries its own annotations: stateful nodes (env shards, the actor) are
pinned to the worker holding the state with `allow_other_workers=False`; the rest need no restriction.

Keys are readable and unique per run and step; the dashboard's task stream groups by the prefix before the first
dash-number, so it shows `env_step_s0`, `trajectory_s0`, `store_s0`, `advantages_s0`, `actor_update`, ...

One training step, colocated inference (policy replica inside the env_step nodes; `rollout.chunk_steps_per_node`
chunk steps per node so each node carries seconds of work against ~15 ms of scheduling):

    weights(v) ─┬─> env_step_s{s}-…-0 ─> env_step_s{s}-…-1 ─> … ─> trajectory_s{s} ─┬─> store_s{s} (zarr region)
                │                                                                └─> advantages_s{s} ─┐
                └──────────────────────────────────────────────────────────────────> actor_update ◄───┘ -> weights(v+1)
                                                                       step_metrics ◄─ (trajectories, update)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dask.highlevelgraph import HighLevelGraph, MaterializedLayer

from pipelines.cluster import Placement
from tasks import rollout, update
from tasks.config import Config


@dataclass
class GraphBuilder:
    """Accumulates nodes (one layer each) with their annotations and dependencies."""

    layers: dict[str, MaterializedLayer] = field(default_factory=dict)
    deps: dict[str, set] = field(default_factory=dict)

    def add(self, key: str, fn, *args, deps: tuple[str, ...] = (), worker: str | None = None,
            resources: dict | None = None) -> str:
        annotations: dict[str, Any] = {}
        if worker is not None:
            annotations.update(workers=[worker], allow_other_workers=False)
        if resources:
            annotations["resources"] = resources
        self.layers[key] = MaterializedLayer({key: (fn, *args)}, annotations=annotations or None)
        self.deps[key] = {d for d in deps if d in self.layers}
        return key

    def graph(self) -> HighLevelGraph:
        return HighLevelGraph(dict(self.layers), dict(self.deps))


@dataclass
class StepGraph:
    graph: HighLevelGraph
    update: str  # key of actor_update: new weights + train metrics
    metrics: str  # key of step_metrics
    stores: list[str]  # keys of store_s{s}: written zarr regions


def _store(path: str, epoch: int, shard: int, traj: dict) -> dict:
    from storage.trajectories import write_shard
    return write_shard(path, epoch=epoch, shard=shard, data={k: traj[k] for k in (*rollout.STEP_FIELDS, "rgb") if k in traj})


def step_metrics(update_out: dict, *parts: dict) -> dict:
    """Merge a step's metrics: update metrics, advantage stats (mean over shards), episodes, timings, cursors."""
    n = len(parts) // 2
    trajs, advs = parts[:n], parts[n:]
    m = dict(update_out["metrics"])
    for key in advs[0]["stats"]:
        m[key] = sum(a["stats"][key] for a in advs) / n
    episodes = [e for t in trajs for e in t["episodes"]]
    for k in ("success_once", "success_at_end", "return", "episode_len"):
        if episodes:
            m[f"env/{k}"] = sum(float(e[k]) for e in episodes) / len(episodes)
    m["env/num_episodes"] = float(len(episodes))
    for k in ("env", "infer", "total"):
        m[f"time/rollout_{k}_max"] = max(t["timing"][k] for t in trajs)
    return {"metrics": m, "cursors": [t["cursor"] for t in trajs], "episodes": episodes}


def build_train_step(cfg: Config, *, run_id: str, step: int, weights, cursors: list[dict | None],
                     placement: Placement, store_path: str | None,
                     dims: tuple[int, int] | None = None, attempt: int = 0) -> StepGraph:
    """One training step's graph. `weights` is a Future (or value) of the versioned weights to roll out with.

    Args:
        cursors: per shard, the seed cursor to re-create a shard from if its worker lost it (None at start).
        store_path: zarr store to write trajectories to (None: not stored).
        dims: (obs_dim, action_dim); needed by disaggregated inference only.
        attempt: retry number of this step (keys of a retry differ from those of the failed attempt).
    """
    g = GraphBuilder()
    tag = f"{run_id}-{step}" + (f"-retry{attempt}" if attempt else "")
    advs, stores = [], []
    if cfg.rollout.inference == "colocated":
        trajs = _colocated_rollout(g, cfg, tag, run_id, weights, cursors, placement)
    else:
        if dims is None:
            raise ValueError("disaggregated inference needs the env dims (obs_dim, action_dim)")
        trajs = _disaggregated_rollout(g, cfg, tag, run_id, weights, cursors, placement, dims)
    for s, traj in enumerate(trajs):
        if store_path is not None:
            stores.append(g.add(f"store_s{s}-{tag}", _store, store_path, step, s, traj, deps=(traj,)))
        advs.append(g.add(f"advantages_s{s}-{tag}", update.advantages, cfg, traj, deps=(traj,)))
    upd = g.add(f"actor_update-{tag}", update.actor_update, cfg, run_id, weights, *advs, deps=tuple(advs),
                worker=placement.actor_worker, resources={"GPU": 1})
    met = g.add(f"step_metrics-{tag}", step_metrics, upd, *trajs, *advs, deps=(upd, *trajs, *advs))
    return StepGraph(g.graph(), upd, met, stores)


def _colocated_rollout(g: GraphBuilder, cfg: Config, tag: str, run_id: str, weights, cursors, placement) -> list[str]:
    """Per shard a chain of env_step nodes, each running `chunk_steps_per_node` chunk steps with inference inside."""
    out = []
    nseg, per = cfg.num_segments, cfg.rollout.chunk_steps_per_node
    for s in range(cfg.env.num_shards):
        prev, segs = None, []
        for k in range(nseg):
            key = f"env_step_s{s}-{tag}-{k}"
            g.add(key, rollout.env_step, cfg, run_id, s, weights, per, cursors[s], k == 0, prev,
                  deps=(prev,) if prev else (), worker=placement.shard_workers[s], resources={"CPU": 1})
            segs.append(key)
            prev = key
        out.append(g.add(f"trajectory_s{s}-{tag}", rollout.trajectory, *segs, deps=tuple(segs)))
    return out


def _disaggregated_rollout(g: GraphBuilder, cfg: Config, tag: str, run_id: str, weights, cursors, placement,
                           dims: tuple[int, int]) -> list[str]:
    """A policy_infer node per chunk step on the actor's worker (one inference group of all shards) and an
    env_step node per shard per chunk step on the shard's worker: T * (S + 1) nodes, for policies whose
    inference outweighs the ~15 ms a node costs."""
    S, T = cfg.env.num_shards, cfg.rollout.chunk_steps
    gpu = placement.actor_worker
    last = [g.add(f"env_observe_s{s}-{tag}", rollout.env_observe, cfg, run_id, s, cursors[s],
                  worker=placement.shard_workers[s], resources={"CPU": 1}) for s in range(S)]
    first = list(last)
    chain: list[list[str]] = [[] for _ in range(S)]
    for t in range(T + 1):
        inf = g.add(f"policy_infer-{tag}-{t}", rollout.policy_infer, cfg, run_id, weights, dims, t < T, *last,
                    deps=tuple(last), worker=gpu, resources={"GPU": 1})
        for s in range(S):
            chain[s].append(inf)
        if t == T:
            break
        last = [g.add(f"env_step_s{s}-{tag}-{t}", rollout.env_step_chunk, cfg, run_id, s, inf, cursors[s],
                      deps=(inf,), worker=placement.shard_workers[s], resources={"CPU": 1}) for s in range(S)]
        for s in range(S):
            chain[s].append(last[s])
    return [g.add(f"trajectory_s{s}-{tag}", rollout.trajectory_disaggregated, cfg, s, first[s], *chain[s],
                  deps=(first[s], *chain[s])) for s in range(S)]


def build_init(cfg: Config, *, run_id: str, placement: Placement, checkpoint_path: str | None,
               tag: str = "") -> tuple[HighLevelGraph, str, str]:
    """Probe env dims on an env worker, create the resident actor (fresh or from a checkpoint).

    Returns (graph, key of (obs_dim, action_dim), key of the initial versioned weights).
    """
    g = GraphBuilder()
    run_id_tag = f"{run_id}{'-' + tag if tag else ''}"
    dims = g.add(f"env_spec-{run_id_tag}", rollout.env_dims, cfg, worker=placement.shard_workers[0])
    deps: tuple[str, ...] = (dims,)
    ckpt = None
    if checkpoint_path is not None:
        from storage.checkpoints import load_checkpoint
        ckpt = g.add(f"load_checkpoint-{run_id_tag}", load_checkpoint, checkpoint_path, worker=placement.actor_worker)
        deps += (ckpt,)
    w = g.add(f"actor_init-{run_id_tag}", update.actor_init, cfg, run_id, dims, ckpt, deps=deps,
              worker=placement.actor_worker, resources={"GPU": 1})
    return g.graph(), dims, w


def build_eval(cfg: Config, *, run_id: str, step: int, weights, placement: Placement,
               attempt: int = 0) -> tuple[HighLevelGraph, list[str]]:
    """Deterministic evaluation on every eval shard with the given weights; returns (graph, episode-list keys)."""
    g = GraphBuilder()
    tag = f"{run_id}-{step}" + (f"-retry{attempt}" if attempt else "")
    keys = [g.add(f"eval_s{s}-{tag}", rollout.evaluate, cfg, run_id, s, weights,
                  worker=placement.shard_workers[s], resources={"CPU": 1}) for s in range(cfg.env.num_shards)]
    return g.graph(), keys


def build_checkpoint(*, run_id: str, step: int, run_dir: str, meta: dict, placement: Placement,
                     attempt: int = 0) -> tuple[HighLevelGraph, str]:
    """Fetch the resident actor's state on its worker and write an atomic checkpoint with `meta` (runner state)."""
    g = GraphBuilder()
    tag = f"{run_id}-{step}" + (f"-retry{attempt}" if attempt else "")
    state = g.add(f"actor_state-{tag}", update.actor_state, run_id, worker=placement.actor_worker)
    key = g.add(f"checkpoint-{tag}", _save_checkpoint, run_dir, step, state, meta, deps=(state,),
                worker=placement.actor_worker)
    key = g.add(f"export_pretrained-{tag}", _export, run_id, key, deps=(key,), worker=placement.actor_worker)
    return g.graph(), key


def _export(run_id: str, checkpoint_path: str) -> str:
    update.actor_export(run_id, checkpoint_path)
    return checkpoint_path


def build_sft_step(cfg: Config, *, run_id: str, step: int, weights, placement: Placement,
                   attempt: int = 0) -> tuple[HighLevelGraph, str, str]:
    """One SFT step: `sft.num_loaders` data nodes (env workers) each draw a share of the step's
    `sft.updates_per_step` minibatches from the store; `sft_update` on the actor takes the gradient steps.

    Returns (graph, key of the new versioned weights, key of the step's metrics).
    """
    from tasks import demos
    g = GraphBuilder()
    tag = f"{run_id}-{step}" + (f"-retry{attempt}" if attempt else "")
    n, L = cfg.sft.updates_per_step, cfg.sft.num_loaders
    shares = [n // L + (1 if r < n % L else 0) for r in range(L)]
    loads = [g.add(f"sft_load_r{r}-{tag}", demos.sft_load, cfg, cfg.seed * 1_000_003 + step * 101 + r, k,
                   worker=placement.shard_workers[r % len(placement.shard_workers)], resources={"CPU": 1})
             for r, k in enumerate(shares) if k]
    upd = g.add(f"sft_update-{tag}", demos.sft_update, cfg, run_id, weights, *loads, deps=tuple(loads),
                worker=placement.actor_worker, resources={"GPU": 1})
    met = g.add(f"step_metrics-{tag}", _metrics_of, upd, deps=(upd,), worker=placement.actor_worker)
    return g.graph(), upd, met


def _metrics_of(update_out: dict) -> dict:
    return update_out["metrics"]


def _save_checkpoint(run_dir: str, step: int, state: dict, meta: dict) -> str:
    from storage.checkpoints import save_checkpoint
    meta = {**meta, "weight_version": state["weight_version"]}
    return str(save_checkpoint(run_dir, step, {"policy": state["policy"], "optimizer": state["optimizer"],
                                               "rng_torch": state["rng_torch"], "run": meta}))
