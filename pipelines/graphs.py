"""Graph builders: one training step (and the init / eval / checkpoint graphs) as a Dask HighLevelGraph.

Builders are pure: they return a graph of task tuples and compute nothing (tests/pipelines/test_graphs.py proves
it). Each node is its own layer so it carries its own annotations: stateful nodes (env shards, the actor) are
pinned to the worker holding the state with `allow_other_workers=False`; the rest need no restriction.

Keys are readable and unique per run and step; the dashboard's task stream groups by the prefix before the first
dash-number, so it shows `env_step_s0`, `trajectory_s0`, `store_s0`, `advantages_s0`, `actor_update`, ...

One training step, colocated inference (policy replica inside the env_step nodes; `rollout.chunk_steps_per_node`
chunk steps per node so each node carries seconds of work against ~15 ms of scheduling):

    weights(v) ─┬─> env_step_s{s}-…-0 ─> env_step_s{s}-…-1 ─> … ─┬─> trajectory_s{s} ─> store_s{s} (zarr region)
                │                                                └─> advantages_s{s} ─┐
                └──────────────────────────────────────────────────────────────────> actor_update ◄───┘ -> weights(v+1)
                                                                       step_metrics ◄─ (trajectories, update)

The advantages take the shard's env_step outputs themselves (not its trajectory node: one Dask hop less on the
way to the update); the store writes may be submitted apart, once the driver has reserved the store's step
(`build_step_store`, as the runner does).

With `algorithm.num_actor_ranks` = R > 1 the update is R nodes `actor_update_r{r}` (tasks.actor.distributed: one
torch.distributed group living across steps), rank r pinned to `placement.actor_workers[r]`, all in the step's
graph so they run together; rank 0's output is the new weights, the others' feed `step_metrics` so that a failed
rank fails the step. Checkpoints read the state with one `actor_state_r{r}` node per rank (a collective too).

Asynchronous steps (`runner.max_staleness` = k > 0, pipelines.runner): step n+1's graph is submitted while step n's
runs. Its rollout takes older weights (`weights`), its update the previous update's output (`update_weights`),
and its first env node per shard (stage) depends on step n's last one (`after` = `StepGraph.last_env` of step n),
which orders the stateful shards across graphs.

Pipeline stages (`rollout.pipeline_stage_num` = p > 1, disaggregated): per chunk step one `policy_infer_p{j}` node
per stage group j (the j-th B/p envs of every shard) and one `env_step_s{s}p{j}` node per shard and stage, so the
p chains interleave: while stage j's envs step on the env workers, stage j+1's inference runs on the GPU worker.
Disaggregated inference runs on the rollout's GPU workers (`cluster.component_placement.rollout`, default: the
actor's): stage j's policy_infer nodes on rollout worker j mod n.

Weights (tasks.weights): when `weights` is a Future (the runner's), a `weights_handle` node on the actor's worker
turns it into a handle (version, key, size; no tensors) and the rollout nodes take the handle (or the
`update_handle` of the step that made the weights, passed as `weights_handle`: no node then): a replica pulls
the state dict worker to worker, and only when its version changed. `step_metrics` likewise takes the update's
handle (`update_handle`), so the new weights never leave the actor's worker except to replicas that need them.
With `algorithm.offload` the update node runs `tasks.actor.entries.actor_update_offload` (same key).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dask.highlevelgraph import HighLevelGraph, MaterializedLayer

from pipelines.clusters import Placement
from tasks import rollout, seeding, trajectory, video, weights as weights_mod
from tasks.step_metrics import step_metrics, step_metrics_ranks
from tasks.actor import distributed, entries
from tasks.config import Config


STEP_PRIORITY = 1  # Dask priority of the nodes on a training step's critical path that would otherwise queue
# behind side work (stores) on the same worker


@dataclass
class GraphBuilder:
    """Accumulates nodes (one layer each) with their annotations and dependencies."""

    layers: dict[str, MaterializedLayer] = field(default_factory=dict)
    deps: dict[str, set] = field(default_factory=dict)

    def add(self, key: str, fn, *args, deps: tuple[str, ...] = (), worker: str | None = None,
            resources: dict | None = None, priority: int | None = None) -> str:
        """Add node `key` = fn(*args) after `deps`; `worker` pins it, `resources` are Dask resources, `priority`
        Dask's annotation (higher runs first among a worker's ready tasks)."""
        annotations: dict[str, Any] = {}
        if worker is not None:
            annotations.update(workers=[worker], allow_other_workers=False)
        if resources:
            annotations["resources"] = resources
        if priority is not None:
            annotations["priority"] = priority
        self.layers[key] = MaterializedLayer({key: (fn, *args)}, annotations=annotations or None)
        self.deps[key] = {d for d in deps if d in self.layers}
        return key

    def graph(self) -> HighLevelGraph:
        return HighLevelGraph(dict(self.layers), dict(self.deps))


@dataclass
class StepGraph:
    graph: HighLevelGraph
    update: str  # key of actor_update (rank 0's actor_update_r0 with R > 1): new weights + train metrics
    metrics: str  # key of step_metrics
    stores: list[str]  # keys of store_s{s}: written zarr regions
    ranks: list[str] = field(default_factory=list)  # keys of actor_update_r{r} (empty with one rank)
    last_env: list[str] = field(default_factory=list)  # per shard (x stage), the rollout's last env node
    trajs: list[str] = field(default_factory=list)  # per shard, the trajectory node (what `build_step_store` writes)
    handle: str | None = None  # key of update_handle: the new weights' handle (a later step's `weights_handle`)


@dataclass
class InitGraph:
    graph: HighLevelGraph
    dims: str  # key of (obs_dim, action_dim)
    weights: str  # key of the initial versioned weights {"version", "state_dict"} (what rollouts take)
    actor_weights: str  # key of the weights the actor ranks build from (+ "optimizer" on restore); = weights, R = 1
    port: str | None  # key of a free port on rank 0's worker (the group's master_port); None with one rank


def _store(path: str, step: int, shard: int, traj: dict, attempt: int | None = None) -> dict:
    from storage.trajectories import write_shard
    return write_shard(path, step=step, shard=shard, data=trajectory.stored_part(traj), attempt=attempt)


def build_train_step(cfg: Config, *, run_id: str, step: int, weights, cursors: list[dict | None],
                     placement: Placement, store_path: str | None,
                     dims: tuple[int, int] | None = None, attempt: int = 0,
                     group: list[dict] | None = None, actor_weights=None, update_weights=None,
                     after: list | None = None, store_attempt: int | None = None,
                     profile_trace: str | None = None, weights_handle=None) -> StepGraph:
    """One training step's graph. `weights` is a Future (or value) of the versioned weights to roll out with.

    Args:
        cursors: per shard, the seed cursor to re-create a shard from if its worker lost it (None at start).
        store_path: zarr store to write trajectories to (None: not stored).
        dims: (obs_dim, action_dim); needed by disaggregated inference only.
        attempt: retry number of this step (keys of a retry differ from those of the failed attempt).
        group: with `algorithm.num_actor_ranks` > 1, each rank's process-group spec (`distributed.group_specs`).
        actor_weights: what the ranks take as `weights` (default `weights`): {"version"} suffices while their
            group lives; a (re)built group needs "state_dict" (+ "optimizer" on restore: the init graph's).
        update_weights: the weights the (one-rank) update starts from (default `weights`); asynchronous steps
            pass the previous update's output (a Future), which also orders the updates.
        after: per shard (x stage), a Future (or key) of the previous step's last env node (`StepGraph.last_env`)
            that this rollout's first env node must follow (asynchronous steps); None: no ordering needed.
        store_attempt: the store attempt id `TrajectoryStore.reserve(step)` returned for this submission; each
            `store_s{s}` write records it (None: the step's latest attempt when the write starts), so a write of
            a given-up attempt that runs late does not count for the retry's attempt.
        profile_trace: run the update node (rank 0's) under torch.profiler and write a Chrome trace JSON there
            (tasks.profiling.profiled; `runner.profile_update_step`); None: not profiled.
        weights_handle: a Future of the handle of `weights` (the `StepGraph.handle` of the step that made them):
            the rollout takes it and the graph has no `weights_handle` node (one Dask hop, ~6 ms, less before
            the rollout starts); None: the node makes the handle.
    """
    g = GraphBuilder()
    tag = _step_tag(run_id, step, attempt)
    advs, stores, last, segments = [], [], [], []
    full_weights = weights
    weights = weights_handle if weights_handle is not None else \
        _weights_handle(g, "weights_handle", tag, weights, placement)
    if cfg.rollout.inference == "colocated":
        trajs = _colocated_rollout(g, cfg, tag, run_id, weights, cursors, placement, after, last, segments)
    else:
        if dims is None:
            raise ValueError("disaggregated inference needs the env dims (obs_dim, action_dim)")
        trajs = _disaggregated_rollout(g, cfg, tag, run_id, weights, cursors, placement, dims, after, last)
    if store_path is not None:
        stores = _store_nodes(g, tag, store_path, step, trajs, store_attempt)
    for s, traj in enumerate(trajs):
        # the update waits for the advantages, nothing waits for the store: on the shard's worker (where both run,
        # next to the trajectory) the advantages go first (measured: a store of ~20 ms ran first in half the steps)
        # colocated: from the shard's env_step segments, not its trajectory node (one Dask hop, ~4 ms, less
        # between the rollout's end and the update; the trajectory is concatenated twice, ~0.3 ms)
        fn, src, deps = (_segment_advantages, segments[s], segments[s]) if segments else \
            (entries.advantages, traj, (traj,))
        advs.append(g.add(f"advantages_s{s}-{tag}", fn, cfg, src, s, deps=tuple(deps), priority=STEP_PRIORITY))
    R = cfg.algorithm.num_actor_ranks
    if R == 1:
        fn = entries.actor_update_offload if cfg.algorithm.offload else entries.actor_update
        upd = g.add(f"actor_update-{tag}", *_profiled(profile_trace, fn), cfg, run_id,
                    full_weights if update_weights is None else update_weights, *advs, deps=tuple(advs),
                    worker=placement.actor_worker, resources={"GPU": 1})
        h = _weights_handle(g, "update_handle", tag, upd, placement)
        met = g.add(f"step_metrics-{tag}", step_metrics, h, *trajs, *advs, deps=(h, *trajs, *advs))
        return StepGraph(g.graph(), upd, met, stores, last_env=last, trajs=trajs, handle=h)
    if update_weights is not None:
        raise ValueError("update_weights (asynchronous steps) is wired for the one-rank update only")
    ranks = _rank_nodes(g, "actor_update", tag, R, group, placement, distributed.actor_update_rank, cfg, run_id,
                        full_weights if actor_weights is None else actor_weights, *advs, deps=tuple(advs),
                        profile_trace=profile_trace)
    h = _weights_handle(g, "update_handle", tag, ranks[0], placement, worker=placement.actor_workers[0])
    met = g.add(f"step_metrics-{tag}", step_metrics_ranks, R - 1, h, *ranks[1:], *trajs, *advs,
                deps=(h, *ranks[1:], *trajs, *advs))
    return StepGraph(g.graph(), ranks[0], met, stores, ranks, last_env=last, trajs=trajs, handle=h)


def _step_tag(run_id: str, step: int, attempt: int) -> str:
    """The suffix of every key of training step `step`'s graph: `{run_id}-{step}`, `-retry{attempt}` after a loss."""
    return f"{run_id}-{step}" + (f"-retry{attempt}" if attempt else "")


def _store_nodes(g: GraphBuilder, tag: str, store_path: str, step: int, trajs: list, store_attempt) -> list[str]:
    """Per shard s a `store_s{s}-{tag}` node writing trajectory `trajs[s]` (a key of `g`, or a Future) to the
    store's step `step` (pipelines.graphs._store)."""
    return [g.add(f"store_s{s}-{tag}", _store, store_path, step, s, traj, store_attempt, deps=(traj,))
            for s, traj in enumerate(trajs)]


def build_step_store(*, run_id: str, step: int, attempt: int, store_path: str, trajs: list,
                     store_attempt: int) -> tuple[HighLevelGraph, list[str]]:
    """The store writes of a training step submitted apart from its graph (`build_train_step` with
    `store_path=None`): the same `store_s{s}-{tag}` nodes, each taking shard s's trajectory from `trajs[s]` (the
    Futures of `StepGraph.trajs`). The scheduler submits them once `TrajectoryStore.reserve(step)` has returned
    `store_attempt`, after the step's trajectories are done, so the reserve runs during the update instead of
    before the graph goes out. Returns (graph, the store keys in shard order)."""
    g = GraphBuilder()
    keys = _store_nodes(g, _step_tag(run_id, step, attempt), store_path, step, trajs, store_attempt)
    return g.graph(), keys


def _weights_handle(g: GraphBuilder, name: str, tag: str, weights, placement: Placement, worker: str | None = None):
    """A `{name}-{tag}` node turning versioned weights held under a key (a Future's, or a node of this graph)
    into a handle (tasks.weights.handle), pinned to the actor's worker (`worker`) where they are; weights given
    as a value (tests, the synchronous scheduler) are returned unchanged."""
    key = weights if isinstance(weights, str) else getattr(weights, "key", None)
    if key is None:
        return weights
    return g.add(f"{name}-{tag}", weights_mod.handle, weights, weights_mod.KeyName(key), deps=(key,),
                 worker=worker or placement.actor_worker)


def _rank_nodes(g: GraphBuilder, name: str, tag: str, R: int, group: list[dict] | None, placement: Placement,
                fn, *args, deps: tuple[str, ...] = (), profile_trace: str | None = None) -> list[str]:
    """One node `{name}_r{r}-{tag}` per actor rank: `fn(*args[:2], group[r], *args[2:])`, pinned to
    rank r's GPU worker (distinct workers: two ranks in one process would deadlock in their first collective);
    rank 0's under torch.profiler when `profile_trace` is given (`_profiled`)."""
    if group is None or len(group) != R:
        raise ValueError(f"algorithm.num_actor_ranks={R} needs {R} group specs (distributed.group_specs), got "
                         f"{None if group is None else len(group)}")
    if len(placement.actor_workers) < R:
        raise ValueError(f"algorithm.num_actor_ranks={R} needs {R} actor workers, the placement has "
                         f"{len(placement.actor_workers)}")
    return [g.add(f"{name}_r{r}-{tag}", *_profiled(profile_trace if r == 0 else None, fn), *args[:2], group[r],
                  *args[2:], deps=deps, worker=placement.actor_workers[r], resources={"GPU": 1}) for r in range(R)]


def _profiled(trace: str | None, fn) -> tuple:
    """The head of a node's task tuple: `(fn,)`, or `(tasks.profiling.profiled, trace, fn)` to run `fn` under
    torch.profiler and write its Chrome trace to `trace` (the key, and so the phase, stay those of `fn`'s node)."""
    if trace is None:
        return (fn,)
    from tasks.profiling import profiled
    return (profiled, trace, fn)


def _segment_advantages(cfg: Config, segments: list[dict], shard: int) -> dict:
    """tasks.actor.entries.advantages of the trajectory that shard `shard`'s env_step `segments` make
    (tasks.rollout.trajectory)."""
    return entries.advantages(cfg, rollout.trajectory(*segments), shard)


def _colocated_rollout(g: GraphBuilder, cfg: Config, tag: str, run_id: str, weights, cursors, placement,
                       after: list | None, last: list[str], segments: list | None = None) -> list[str]:
    """Per shard a chain of env_step nodes, each running `chunk_steps_per_node` chunk steps with inference inside;
    shard s's first node follows `after[s]` when given. Appends each shard's last node to `last` and its list of
    env_step nodes to `segments` (when given)."""
    out = []
    nseg, per = cfg.num_segments, cfg.rollout.chunk_steps_per_node
    for s in range(cfg.env.num_shards):
        prev, segs = (None if after is None else after[s]), []
        for k in range(nseg):
            key = f"env_step_s{s}-{tag}-{k}"
            g.add(key, rollout.env_step, cfg, run_id, s, weights, per, cursors[s], k == 0, prev, k == nseg - 1,
                  deps=tuple(d for d in (prev, weights) if isinstance(d, str)), worker=placement.shard_workers[s],
                  resources={"CPU": 1})
            segs.append(key)
            prev = key
        last.append(prev)
        if segments is not None:
            segments.append(segs)
        out.append(g.add(f"trajectory_s{s}-{tag}", rollout.trajectory, *segs, deps=tuple(segs)))
    return out


def _disaggregated_rollout(g: GraphBuilder, cfg: Config, tag: str, run_id: str, weights, cursors, placement,
                           dims: tuple[int, int], after: list | None, last_env: list[str]) -> list[str]:
    """Per stage group (p = `rollout.pipeline_stage_num`; one group of all shards when p = 1) a policy_infer node
    per chunk step on a rollout worker (stage j on `placement.rollout_workers[j % n]`: the devices of
    `cluster.component_placement.rollout`, by default the actor's) and an env_step node per shard per chunk step on
    the shard's worker:
    p * T * (S + 1) nodes, for policies whose inference outweighs the ~15 ms a node costs. Stage groups are
    independent chains, so one group's inference overlaps another's env stepping. Shard s's first env node of stage
    j follows `after[j * S + s]` when given; the last ones are appended to `last_env` in that order."""
    S, T, p = cfg.env.num_shards, cfg.rollout.chunk_steps, cfg.rollout.pipeline_stage_num
    rollout_ws = placement.rollout_workers  # `cluster.component_placement.rollout` (default: with the actor)
    parts: list[list] = [[] for _ in range(S)]  # per shard: its stages' trajectory_disaggregated arguments
    for j in range(p):
        sj = "" if p == 1 else f"p{j}"  # p = 1: today's keys and arguments
        gpu = rollout_ws[j % len(rollout_ws)]  # stage j's policy_infer nodes: rollout device j mod n
        stage = () if p == 1 else (j,)
        last = []
        for s in range(S):
            prev = None if after is None else after[j * S + s]
            extra = (True, j if p > 1 else None, prev) if (p > 1 or prev is not None) else ()
            last.append(g.add(f"env_observe_s{s}{sj}-{tag}", rollout.env_observe, cfg, run_id, s, cursors[s], *extra,
                              deps=(prev,) if isinstance(prev, str) else (), worker=placement.shard_workers[s],
                              resources={"CPU": 1}))
        chain: list[list[str]] = [[key] for key in last]
        for t in range(T + 1):
            inf = g.add(f"policy_infer{'' if p == 1 else '_' + sj}-{tag}-{t}", rollout.policy_infer, cfg, run_id,
                        weights, dims, t < T, *last, deps=(*last, *((weights,) if isinstance(weights, str) else ())),
                        worker=gpu, resources={"GPU": 1})
            for s in range(S):
                chain[s].append(inf)
            if t == T:
                break
            last = [g.add(f"env_step_s{s}{sj}-{tag}-{t}", rollout.env_step_chunk, cfg, run_id, s, inf, cursors[s],
                          *stage, deps=(inf,), worker=placement.shard_workers[s], resources={"CPU": 1})
                    for s in range(S)]
            for s in range(S):
                chain[s].append(last[s])
        for s in range(S):
            parts[s].append(chain[s])
            last_env.append(chain[s][-2])  # [-1] is the bootstrap inference
    if p == 1:
        return [g.add(f"trajectory_s{s}-{tag}", rollout.trajectory_disaggregated, cfg, s, *parts[s][0],
                      deps=tuple(parts[s][0])) for s in range(S)]
    return [g.add(f"trajectory_s{s}-{tag}", rollout.trajectory_stages, cfg, s, p, *(k for c in parts[s] for k in c),
                  deps=tuple(k for c in parts[s] for k in c)) for s in range(S)]


def build_init(cfg: Config, *, run_id: str, placement: Placement, checkpoint_path: str | None,
               tag: str = "") -> InitGraph:
    """Probe env dims on an env worker, create the resident actor (fresh or from a checkpoint).

    With `algorithm.num_actor_ranks` > 1 nothing is made resident here: `actor_init` on rank 0's worker returns
    the weights the ranks build their group from in the first step (`distributed.initial_weights`, with the
    checkpoint's optimizer on restore), `weights` strips them to what rollouts take, and `free_port` picks the
    group's port on rank 0's worker.
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
    if cfg.algorithm.num_actor_ranks == 1:
        # its own key as the base of partial weights (tasks.weights): the scheduler keeps this node's future
        w = g.add(f"actor_init-{run_id_tag}", entries.actor_init, cfg, run_id, dims, ckpt,
                  weights_mod.KeyName(f"actor_init-{run_id_tag}"), deps=deps, worker=placement.actor_worker,
                  resources={"GPU": 1})
        return InitGraph(g.graph(), dims, w, w, None)
    full = g.add(f"actor_init-{run_id_tag}", distributed.initial_weights, cfg, dims, ckpt, deps=deps,
                 worker=placement.actor_worker)
    w = g.add(f"weights-{run_id_tag}", _rollout_weights, full, deps=(full,), worker=placement.actor_worker)
    port = g.add(f"free_port-{run_id_tag}", distributed.free_port, worker=placement.actor_worker)
    return InitGraph(g.graph(), dims, w, full, port)


def _rollout_weights(weights: dict) -> dict:
    """{"version", "state_dict"} of versioned weights (drops the optimizer state rollouts do not need)."""
    return {"version": weights["version"], "state_dict": weights["state_dict"]}


def eval_video_count(cfg: Config) -> int:
    """How many episodes each evaluation films: `runner.eval_videos`, at most `env.eval.num_episodes`, none with
    GPU simulation (no action log to replay; tasks.video)."""
    from tasks.envs import is_batched
    if is_batched(cfg.env):
        return 0
    return min(cfg.runner.eval_videos, cfg.env.eval.num_episodes)


def films_eval(cfg: Config, step: int, last: bool = False) -> bool:
    """Whether the training run's eval at `step` films (`eval_video_count(cfg)` episodes): at steps that are
    multiples of `runner.eval_video_interval` (step 0 included), at `runner.max_steps`, and when `last` (the
    runner's eval after the run's last step, whatever ended it: max_steps, max_env_steps, the wall-time limit)."""
    r = cfg.runner
    return eval_video_count(cfg) > 0 and (step % r.eval_video_interval == 0 or step == r.max_steps or last)


def build_eval(cfg: Config, *, run_id: str, step: int, weights, placement: Placement,
               attempt: int = 0, video_dir: str | None = None, split: str = "eval",
               ema: bool = False) -> tuple[HighLevelGraph, list[str]]:
    """Deterministic evaluation on every eval shard with the given weights; returns (graph, keys): the shards'
    episode-list keys, then, with `video_dir` and `eval_video_count(cfg)` > 0, the key of one `eval_videos` node
    (tasks.video.eval_videos: the first episodes' mp4s written under `video_dir`, on shard 0's env worker, after
    every shard's eval). `split="val"`: the validation split's episodes (`EvalConfig.split`; nodes `val_s<k>-...`,
    no videos). `ema`: play the run's resident actor's averaged weights (`algorithm.ema_decay`; an
    `eval_weights_<split>` node on the actor's worker) instead of `weights`."""
    g = GraphBuilder()
    tag = f"{run_id}-{step}" + (f"-retry{attempt}" if attempt else "")
    if ema:  # the actor's average (tasks.actor.entries.actor_eval_weights), read where it lives after `weights`'
        # update;
        # the eval nodes take it as a dependency (a handle would point at a result the graph releases at once)
        key = weights if isinstance(weights, str) else getattr(weights, "key", None)
        weights = g.add(f"eval_weights_{split}-{tag}", entries.actor_eval_weights, run_id, weights,
                        deps=(key,) if key else (), worker=placement.actor_worker)
    else:
        weights = _weights_handle(g, f"weights_handle_{split}", tag, weights, placement)
    n_video = eval_video_count(cfg) if video_dir and split == "eval" else 0
    keys = [g.add(f"{split}_s{s}-{tag}", rollout.evaluate, cfg, run_id, s, weights, n_video, split,
                  deps=(weights,) if isinstance(weights, str) else (),
                  worker=placement.shard_workers[s], resources={"CPU": 1}) for s in range(cfg.env.num_shards)]
    if n_video:
        keys.append(g.add(f"eval_videos-{tag}", video.eval_videos, cfg, run_id, video_dir, step, *keys,
                          deps=tuple(keys), worker=placement.shard_workers[0], resources={"CPU": 1}))
    return g.graph(), keys


def build_checkpoint(*, run_id: str, step: int, run_dir: str, meta: dict, placement: Placement,
                     attempt: int = 0, cfg: Config | None = None, group: list[dict] | None = None,
                     weights=None, dims: tuple[int, int] | None = None) -> tuple[HighLevelGraph, str]:
    """Fetch the resident actor's state on its worker and write an atomic checkpoint with `meta` (runner state).

    With `cfg.algorithm.num_actor_ranks` > 1: one `actor_state_r{r}` node per rank (a collective; `group`,
    `weights`, `dims` let the ranks rebuild a group restored since the last update); rank 0's full state is
    written in the same format (tasks.actor.state: policy, FQN-keyed optimizer, rng; run.weight_version).
    """
    g = GraphBuilder()
    tag = f"{run_id}-{step}" + (f"-retry{attempt}" if attempt else "")
    R = 1 if cfg is None else cfg.algorithm.num_actor_ranks
    if R == 1:
        state = g.add(f"actor_state-{tag}", entries.actor_state, run_id, worker=placement.actor_worker)
        key = g.add(f"checkpoint-{tag}", _save_checkpoint, run_dir, step, state, meta, deps=(state,),
                    worker=placement.actor_worker)
    else:
        states = _rank_nodes(g, "actor_state", tag, R, group, placement, distributed.actor_state_rank, run_id, cfg,
                             weights, dims)
        key = g.add(f"checkpoint-{tag}", _save_checkpoint_ranks, run_dir, step, meta, *states, deps=tuple(states),
                    worker=placement.actor_worker)
    key = g.add(f"export_pretrained-{tag}", _export, run_id, key, export_env_meta(cfg), deps=(key,),
                worker=placement.actor_worker)
    return g.graph(), key


def export_env_meta(cfg: Config) -> dict:
    """What an hf/ export records of the env it was trained on (config.json `env`): simulator, env_id, control mode
    and the gripper convention (pipelines.config.check_model_path refuses a mismatch, also for an hf dir copied
    out of its run)."""
    from tasks.envs import gripper_convention
    return {"simulator": cfg.env.simulator, "env_id": cfg.env.env_id, "control_mode": cfg.env.control_mode,
            "gripper_convention": gripper_convention(cfg.env)}


def _export(run_id: str, checkpoint_path: str, env_meta: dict | None = None) -> str:
    entries.actor_export(run_id, checkpoint_path, env_meta)
    return checkpoint_path


def build_sft_step(cfg: Config, *, run_id: str, step: int, weights, placement: Placement,
                   attempt: int = 0, profile_trace: str | None = None) -> tuple[HighLevelGraph, str, str]:
    """One SFT step: `sft.num_loaders` data nodes (env workers) each draw a share of the step's
    `sft.updates_per_step` minibatches from the store; `sft_update` on the actor takes the gradient steps.

    Returns (graph, key of the new versioned weights, key of the step's metrics). `profile_trace`: as in
    `build_train_step`, for the sft_update node.
    """
    from tasks import demos
    g = GraphBuilder()
    tag = f"{run_id}-{step}" + (f"-retry{attempt}" if attempt else "")
    n, L = cfg.sft.updates_per_step, cfg.sft.num_loaders
    shares = [n // L + (1 if r < n % L else 0) for r in range(L)]
    loads = [g.add(f"sft_load_r{r}-{tag}", demos.sft_load, cfg, seeding.sft_load_seed(cfg.seed, step, r), k,
                   worker=placement.shard_workers[r % len(placement.shard_workers)], resources={"CPU": 1})
             for r, k in enumerate(shares) if k]
    upd = g.add(f"sft_update-{tag}", *_profiled(profile_trace, demos.sft_update), cfg, run_id, weights, *loads,
                deps=tuple(loads), worker=placement.actor_worker, resources={"GPU": 1})
    met = g.add(f"step_metrics-{tag}", _metrics_of, upd, deps=(upd,), worker=placement.actor_worker)
    return g.graph(), upd, met


def _metrics_of(update_out: dict) -> dict:
    return update_out["metrics"]


def _save_checkpoint_ranks(run_dir: str, step: int, meta: dict, state: dict, *others: dict) -> str:
    """Write rank 0's state (`others`: the other ranks' empty results, kept so that every rank's node must finish)."""
    return _save_checkpoint(run_dir, step, state, meta)


def _save_checkpoint(run_dir: str, step: int, state: dict, meta: dict) -> str:
    from storage.checkpoints import save_checkpoint
    meta = {**meta, "weight_version": state["weight_version"]}  # THE actor state (tasks.actor.state) + `run`
    return str(save_checkpoint(run_dir, step, {**{k: v for k, v in state.items() if k != "weight_version"},
                                               "run": meta}, create_run_dir=False))
