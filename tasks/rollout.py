"""Rollout task functions: env stepping with a resident policy replica, trajectory assembly, evaluation.

A trajectory (one shard, one training step) is a dict of numpy arrays and a few bookkeeping entries; its fields,
shapes, dtypes and meanings are declared once in `tasks.trajectory` (FIELDS, Meta; docs/reference/trajectory.md):
T chunk steps, B envs of the shard, C actions per chunk, D action dim, O obs dim, V value outputs.

`weights` arguments are versioned weights {"version", "state_dict"} or a handle of them (tasks.weights: the
graph passes handles, and a replica fetches the state dict worker to worker only when its version changed).
Replicas compute on `policy.device` in `policy.dtype` (tasks.device); nodes exchange float32 numpy.

Episode lifecycle: the EnvShard owns it (tasks.envs.shard: the mode table). Rollout code calls
`sh.begin_rollout()` at a rollout's first chunk step (env_step's first segment, env_observe) and makes no reset
decision of its own; without auto_reset a finished env idles until the rollout ends, in every path below.

Pipeline stages (`rollout.pipeline_stage_num` = p > 1, disaggregated inference): shard s's B envs are p resident
stage groups of B/p envs (`get_shard(..., stage=j)`: global envs s*B + j*B/p ...), each its own EnvShard, so the
seeds and episode ids of every env are those of p = 1 and the shard's cursor is the stages' cursors end to end
(`join_cursors`). Since no shard resets mid-rollout, p stage groups step exactly the episodes of p = 1.

Exploration noise: colocated, a shard's policy calls draw from the shard's own torch RNG stream
(`EnvShard.policy_rng`), seeded at the shard's creation from (seed, shard part, episode counts) as before and
carried in its cursor, so shards sharing a worker never share draws and a re-created shard continues its stream.
Disaggregated, `policy_infer` draws one batched sample over its group's shards inside a forked RNG seeded from
(seed, each shard's first global env and life chunk-step count, `EnvShard.rng_key`): a function of the shards'
cursors, so a resumed run draws the same noise, and the inference worker's own RNG (the update's) is untouched.
The seed formulas are tasks.seeding's (`shard_policy_seed`, `infer_seed`, `eval_torch_seed`: its table).

Policies see observations as a dict of tensors ({"state", "rgb", "prompt"}): `policy_obs` (tasks.prompts) builds
it, prompts per env by each observation's `task_id`.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import numpy as np
import torch

from tasks import resident, seeding
from tasks import trajectory as tj
from tasks.config import Config
from tasks.device import autocast, policy_device, to_device, to_numpy
from tasks.offload import module_device, move_module
from tasks.envs import EnvShard, make_shard
from tasks.envs.shard import join_cursors, split_cursor
from tasks.policies import make_policy
from tasks.prompts import instructions, policy_obs

STEP_FIELDS = tj.STEP_FIELDS  # the [T, B] fields every trajectory has (tasks.trajectory)
M = tj.Meta  # keys of a trajectory's bookkeeping entries


@dataclass
class Replica:
    """A policy replica resident on a worker, with the weight version it holds."""

    module: torch.nn.Module
    version: int = -1
    dtype: str = "float32"  # policy.dtype: float32 | bfloat16 (autocast)
    last_sync: dict | None = None  # the last get_replica's weight load: {"seconds", "bytes"} (0, 0: none)
    base_key: str | None = None  # the key of the full weights whose frozen tensors it holds (tasks.weights.load_into)
    moved_s: float = 0.0  # seconds moving the module between devices since the last `take_moved` (offload)

    def take_moved(self) -> float:
        s, self.moved_s = self.moved_s, 0.0
        return s

    def offload(self) -> None:
        """Move the module to CPU memory (algorithm.offload: off the device while the update runs)."""
        if module_device(self.module).type != "cpu":
            t0 = time.perf_counter()
            move_module(self.module, "cpu")
            self.moved_s += time.perf_counter() - t0


num_values = tj.num_values  # value outputs per chunk step V: C for action-level rewards, else 1


def env_dims(cfg: Config) -> tuple[int, int]:
    """(obs_dim, action_dim) of the env task, from a throw-away instance cached per process, keyed by the whole
    env section (any env key may decide the lengths: the controller, LIBERO's object_state, a family's own key)."""
    def probe():
        from tasks.envs import make_single_env
        env = make_single_env(cfg.env)
        dims = (env.obs_dim, env.action_dim)
        env.close()
        return dims
    dims, _ = resident.get_or_create(f"dims/{type(cfg.env).__name__}/{sorted(asdict(cfg.env).items())!r}", probe)
    return dims


def get_replica(cfg: Config, run_id: str, weights: dict, obs_dim: int, action_dim: int) -> Replica:
    """The resident policy replica of this worker on `policy.device`, loaded with `weights` (versioned weights
    or a handle, tasks.weights): a load, and for a handle a fetch, only when the version changed. Sets
    `last_sync` to the load's {"seconds" (fetch + load_state_dict), "bytes" (of the state dict)}, zeros without
    a load; moves an offloaded replica back onto its device first. Partial weights (only the trainable tensors)
    load on top of the base weights, which are loaded first when the replica does not hold them
    (tasks.weights.load_into)."""
    from tasks.weights import load_into
    dev = policy_device(cfg)
    rep, _ = resident.get_or_create(f"{run_id}/policy", lambda: Replica(
        make_policy(cfg.policy, obs_dim=obs_dim, action_dim=action_dim, num_values=num_values(cfg),
                    image_size=image_size(cfg), load=False).to(dev), dtype=cfg.policy.dtype))
    if module_device(rep.module).type != dev.type:  # offloaded during the update
        t0 = time.perf_counter()
        move_module(rep.module, dev)
        rep.moved_s += time.perf_counter() - t0
    rep.last_sync = {"seconds": 0.0, "bytes": 0}
    if rep.version != weights["version"]:
        t0 = time.perf_counter()
        nbytes, rep.base_key = load_into(rep.module, weights, rep.base_key)
        rep.module.eval()
        rep.version = weights["version"]
        rep.last_sync = {"seconds": time.perf_counter() - t0, "bytes": nbytes}
    return rep


def image_size(cfg: Config) -> int | None:
    """Camera size the policy sees (pixels), None for state-only observations."""
    return cfg.env.image_size if cfg.env.obs_mode == "rgb" else None


def get_shard(cfg: Config, run_id: str, shard: int, cursor: dict | None, stage: int | None = None) -> EnvShard:
    """The resident training env shard `shard` (or its stage group `stage` of `rollout.pipeline_stage_num`);
    created on first use and continuing the shard's `cursor` exactly (EnvShard.load_state_dict: open episodes
    re-simulated, the policy RNG restored). A fresh shard (no cursor) seeds its policy RNG from (seed, part,
    episode counts)."""
    e = cfg.env
    p = 1 if stage is None else cfg.rollout.pipeline_stage_num
    cursor = split_cursor(cursor, p, stage or 0)  # the stage's envs of the shard's cursor
    counts = (cursor or {}).get("episode_count")
    part = shard if stage is None else shard * p + stage

    def create() -> EnvShard:
        torch.set_num_threads(cfg.cluster.threads_per_worker)
        # stage j of shard s = part s*p+j of num_shards*p equal parts: the same global env indices (seeds) as p=1
        sh = make_shard(e, shard=part, num_shards=e.num_shards * p, num_envs=e.num_envs, auto_reset=e.auto_reset,
                        ignore_terminations=e.ignore_terminations, base_seed=e.seed, episode_count=counts,
                        group_size=group_size(cfg))
        # every worker process starts with torch's same default seed: without this, shards on different workers
        # would draw identical exploration noise
        sh.seed_rng(seeding.shard_policy_seed(cfg.seed, part, counts), policy_device(cfg))
        if cursor is not None:
            sh.load_state_dict(cursor)  # its RNG state, when it has one, replaces the seeded one
        return sh

    sh, _ = resident.get_or_create(f"{run_id}/shard/{shard}" + ("" if stage is None else f"/stage{stage}"), create)
    return sh


def group_size(cfg: Config) -> int:
    """Envs per reset-state group: algorithm.group_size when the estimator scores groups (EstimatorSpec.groups),
    else 1 (also for sft, which has no estimator)."""
    spec = cfg.algorithm.spec
    return cfg.algorithm.group_size if spec is not None and spec.groups else 1


def _values_np(rep: Replica, obs: dict, n: int) -> np.ndarray:
    dev = module_device(rep.module)
    with torch.no_grad(), autocast(rep.dtype, dev):
        return to_numpy(rep.module.values(to_device(obs, dev)).reshape(n, -1))


def _final_values(rep: Replica, res, instr, task_id: np.ndarray, V: int) -> np.ndarray:
    """V(final_obs) [B, V] where the chunk step truncated an episode, else 0 (`task_id` [B]: the episode's task,
    i.e. that of the chunk's observation)."""
    fv = np.zeros((len(res.truncated), V), np.float32)
    if res.truncated.any():
        m = res.truncated
        obs = policy_obs(rep.module, res.final_obs[m], None if res.final_rgb is None else res.final_rgb[m], instr,
                         task_id[m])
        fv[m] = _values_np(rep, obs, int(m.sum()))
    return fv


def _act(rep: Replica, obs: dict, deterministic: bool = False) -> dict[str, np.ndarray]:
    """One policy call -> numpy actions/logprobs/values [B, ...] and extras/<name>."""
    dev = module_device(rep.module)
    with torch.no_grad(), autocast(rep.dtype, dev):
        out = rep.module.act(to_device(obs, dev), deterministic=deterministic)
    B = out["actions"].shape[0]
    res = {"actions": to_numpy(out["actions"]), "logprobs": to_numpy(out["logprobs"]),
           "values": to_numpy(out["values"].reshape(B, -1))}
    for k, v in (out.get("extras") or {}).items():
        res[tj.EXTRAS_PREFIX + k] = to_numpy(v)
    return res


def env_step(cfg: Config, run_id: str, shard: int, weights: dict, num_chunk_steps: int, cursor: dict | None,
             first: bool, prev=None, last: bool = False) -> dict:
    """Colocated rollout segment: `num_chunk_steps` chunk steps of shard `shard`, inference inside.

    `prev` (the previous segment of the same shard) is only a graph dependency that orders segments; `last`
    (the shard's last segment of the step) offloads the replica afterwards with `algorithm.offload`.
    Returns the STEP_FIELDS with a leading [n] axis, and bootstrap_values, episodes, cursor, timing,
    weight_sync, offload_s.
    """
    t0 = time.perf_counter()
    sh = get_shard(cfg, run_id, shard, cursor)
    if first:
        sh.begin_rollout()  # the shard's lifecycle mode decides what a rollout's start means
    fresh = sh.rng_fresh
    if not fresh:  # a replica (re-)created now must not draw from the shard's restored stream
        rep = get_replica(cfg, run_id, weights, sh.obs_dim, sh.action_dim)
    with sh.policy_rng(policy_device(cfg)):  # the shard's own exploration-noise stream
        if fresh:  # as the worker-global seeding of earlier versions: a first replica's init draws from it
            rep = get_replica(cfg, run_id, weights, sh.obs_dim, sh.action_dim)
        seg = _env_step(cfg, run_id, sh, rep, weights, num_chunk_steps, last, t0)
    seg[M.CURSOR] = sh.state_dict()  # after the RNG block: it holds the stream's state after this segment
    return seg


def _env_step(cfg: Config, run_id: str, sh: EnvShard, rep: Replica, weights: dict, num_chunk_steps: int,
              last: bool, t0: float) -> dict:
    sync = rep.last_sync
    instr = instructions(cfg)
    V = num_values(cfg)
    t_env = t_inf = 0.0
    steps: dict[str, list] = {}
    episodes: list[dict] = []
    state, rgb, task = sh.current_obs(), sh.current_rgb(), sh.current_tasks()[0]
    for _ in range(num_chunk_steps):
        ti = time.perf_counter()
        out = _act(rep, policy_obs(rep.module, state, rgb, instr, task), cfg.rollout.deterministic)
        te = time.perf_counter()
        res = sh.chunk_step(out["actions"])
        tf = time.perf_counter()
        final_values = _final_values(rep, res, instr, task, V)
        t_inf += (te - ti) + (time.perf_counter() - tf)
        t_env += tf - te
        record = {"obs": state, "task_id": task, **out, "final_values": final_values,
                  **{k: getattr(res, k) for k in tj.ENV_OUTPUTS}}
        if rgb is not None:
            record["rgb"] = rgb
        for k, v in record.items():
            steps.setdefault(k, []).append(v)
        episodes += res.episodes
        state, rgb, task = res.obs, res.rgb, res.task_id
    bootstrap = _values_np(rep, policy_obs(rep.module, state, rgb, instr, task), sh.num_envs)
    if last and cfg.algorithm.offload:
        rep.offload()
    seg = {k: np.stack(v) for k, v in steps.items()}
    seg.update({"bootstrap_values": bootstrap, M.EPISODES: episodes,
                M.TIMING: {"env": t_env, "infer": t_inf, "total": time.perf_counter() - t0},
                M.WEIGHT_VERSION: int(weights["version"]), M.WEIGHT_SYNC: sync, M.OFFLOAD_S: rep.take_moved()})
    return seg


def step_fields(traj: dict) -> list[str]:
    """The [T, B, ...] fields of a trajectory or segment: STEP_FIELDS, rgb and extras/* when present."""
    return [k for k in traj if tj.is_step_field(k)]


def trajectory(*segments: dict) -> dict:
    """Concatenate a shard's segments along T. Fields as in the module docstring."""
    traj = {k: np.concatenate([s[k] for s in segments]) for k in step_fields(segments[0])}
    traj["bootstrap_values"] = segments[-1]["bootstrap_values"]
    traj[M.EPISODES] = [e for s in segments for e in s[M.EPISODES]]
    traj[M.CURSOR] = segments[-1][M.CURSOR]
    traj[M.TIMING] = {k: sum(s[M.TIMING][k] for s in segments) for k in segments[0][M.TIMING]}
    if M.WEIGHT_VERSION in segments[0]:
        traj[M.WEIGHT_VERSION] = min(s[M.WEIGHT_VERSION] for s in segments)
    _sum_sync(traj, segments)
    return traj


def _sum_sync(traj: dict, parts) -> None:
    """traj[Meta.WEIGHT_SYNC] / [Meta.OFFLOAD_S]: the sums over `parts` (segments, inference outputs, stages) that
    report them; absent when none does."""
    syncs = [p[M.WEIGHT_SYNC] for p in parts if p.get(M.WEIGHT_SYNC) is not None]
    if syncs:
        traj[M.WEIGHT_SYNC] = {"seconds": sum(s["seconds"] for s in syncs), "bytes": sum(s["bytes"] for s in syncs)}
    moved = [p[M.OFFLOAD_S] for p in parts if M.OFFLOAD_S in p]
    if moved:
        traj[M.OFFLOAD_S] = sum(moved)


def evaluate(cfg: Config, run_id: str, shard: int, weights: dict, keep_actions: int = 0,
             split: str = "eval") -> list[dict]:
    """Deterministic evaluation on eval shard `shard`: the same seeds at every call.

    Eval episode i (0 <= i < eval.num_episodes) runs on eval env i % N with reset seed `eval.seed + i`, N =
    eval.num_envs; `split="val"` plays the validation split instead (`EvalConfig.split`: val_episodes episodes from
    env.eval.val_seed, on their own resident shard `<run_id>/eval/val/<shard>`). Torch's RNG is seeded from (the
    split's seed, shard) for the evaluation, so a policy that draws even in deterministic mode (a flow VLA's initial
    noise) scores the same at every call with the same weights.
    Each round is a rollout of the eval shard (auto_reset off: DISABLED mode) run until every env finished.
    Returns the finished-episode dicts of this shard (see EnvShard.chunk_step); those with episode id <
    `keep_actions` also carry "actions", float32 [episode_len, D], the executed (clipped) actions, for videos
    (tasks.video; an env shard without an action log, GPU simulation, gives none).
    """
    ev = cfg.env.eval.split(split)
    n_shards = cfg.env.num_shards
    name = f"{run_id}/eval/{shard}" if split == "eval" else f"{run_id}/eval/{split}/{shard}"
    sh, _ = resident.get_or_create(name, lambda: make_shard(
        cfg.env, shard=shard, num_shards=n_shards, num_envs=ev.num_envs, auto_reset=False,
        ignore_terminations=ev.ignore_terminations, base_seed=ev.seed))
    rep = get_replica(cfg, run_id, weights, sh.obs_dim, sh.action_dim)
    instr = instructions(cfg)
    sh.load_state_dict(None)  # episode 0 of every eval env again
    episodes: list[dict] = []
    rounds = -(-ev.num_episodes // ev.num_envs)
    # deterministic policies may still draw (a flow model's initial noise): the same draws at every evaluation,
    # independent of the worker's training RNG
    with torch.random.fork_rng():
        torch.manual_seed(seeding.eval_torch_seed(ev.seed, shard))
        for _ in range(rounds):
            sh.begin_rollout()
            state, rgb, task = sh.current_obs(), sh.current_rgb(), sh.current_tasks()[0]
            while sh.active.any():
                out = _act(rep, policy_obs(rep.module, state, rgb, instr, task), deterministic=True)
                res = sh.chunk_step(out["actions"])
                for e in res.episodes:
                    log = sh.ep_actions[e["env"] - sh.env_offset] if e["episode_id"] < keep_actions else []
                    if len(log) == e["episode_len"] > 0:  # the whole episode's actions (idle until begin_rollout)
                        e["actions"] = np.stack(log).astype(np.float32)
                episodes += res.episodes
                state, rgb, task = res.obs, res.rgb, res.task_id
    return [e for e in episodes if e["episode_id"] < ev.num_episodes]


# ----- disaggregated inference: env_step and policy_infer are separate nodes, one per chunk step -----

def env_observe(cfg: Config, run_id: str, shard: int, cursor: dict | None, first: bool = True,
                stage: int | None = None, prev=None) -> dict:
    """The observation a rollout starts from, {"obs": [B, O], "rgb": [B,H,W,3] or None}, after
    `EnvShard.begin_rollout` (with `first`). `stage`: a stage group of the shard (pipeline stages); `prev` (the
    previous step's last env node of the same envs) is only a graph dependency that orders steps."""
    sh = get_shard(cfg, run_id, shard, cursor, stage)
    if first:
        sh.begin_rollout()
    return {"obs": sh.current_obs(), "rgb": sh.current_rgb(), "task_id": sh.current_tasks()[0],
            "truncated": np.zeros(sh.num_envs, bool), "final_obs": None, "final_rgb": None,
            "rng_key": sh.rng_key()}


def env_step_chunk(cfg: Config, run_id: str, shard: int, infer_out: list[dict], cursor: dict | None,
                   stage: int | None = None) -> dict:
    """One chunk step of shard `shard` (its stage group `stage` with pipeline stages) with the actions
    `policy_infer` computed for it (disaggregated mode; `infer_out[shard]`: the shard's part of the group)."""
    t0 = time.perf_counter()
    sh = get_shard(cfg, run_id, shard, cursor, stage)
    res = sh.chunk_step(infer_out[shard]["actions"])
    out = {k: getattr(res, k) for k in (*tj.OBSERVATION, *tj.ENV_OUTPUTS, "final_obs", "final_rgb", M.EPISODES)}
    out["prev_task_id"] = infer_out[shard]["task_id"]  # the task of the chunk's observation (its final_obs')
    out[M.CURSOR] = sh.state_dict()
    out["rng_key"] = sh.rng_key()
    out["env_time"] = time.perf_counter() - t0
    return out


def policy_infer(cfg: Config, run_id: str, weights: dict, dims: tuple[int, int], sample: bool,
                 *env_outs: dict) -> list[dict]:
    """Batched inference for an inference group: one forward pass over the observations of its shards.

    Args:
        dims: (obs_dim, action_dim) of the env task (the inference worker hosts no env to ask).
        env_outs: per shard, the latest env output (obs [B, O], truncated [B], final_obs [B, O] or None).
        sample: draw an action chunk (False: values only, for the bootstrap after the last chunk step).

    Returns per shard: actions [B,C,D], logprobs [B,C,D], values [B,V] (when sampling, else only values), and
    final_values [B,V] = V(final_obs) where the previous chunk step truncated an episode.
    """
    t0 = time.perf_counter()
    state = np.concatenate([o["obs"] for o in env_outs])  # [S*B, O]
    rgb = None if env_outs[0]["rgb"] is None else np.concatenate([o["rgb"] for o in env_outs])
    sizes = [len(o["obs"]) for o in env_outs]
    rep = get_replica(cfg, run_id, weights, *dims)
    sync = rep.last_sync
    instr = instructions(cfg)
    task = np.concatenate([o["task_id"] for o in env_outs])  # [S*B]
    V = num_values(cfg)
    obs = policy_obs(rep.module, state, rgb, instr, task)
    if sample:
        devs = _cuda_index(module_device(rep.module))
        with seeding.forked(seeding.infer_seed(cfg.seed, [o.get("rng_key", ()) for o in env_outs]), devs):
            acts = _act(rep, obs, cfg.rollout.deterministic)
    else:
        acts = {"values": _values_np(rep, obs, len(state))}
    if not sample and cfg.algorithm.offload:  # the bootstrap: this group's last inference of the step
        rep.offload()
    moved = rep.take_moved()
    results, start = [], 0
    for o, n in zip(env_outs, sizes):
        r = {k: v[start:start + n] for k, v in acts.items()}
        r["task_id"] = task[start:start + n]  # the prompts' tasks (env_step_chunk passes them back)
        fv = np.zeros((n, V), np.float32)
        if o["final_obs"] is not None and o["truncated"].any():
            m = o["truncated"]
            fobs = policy_obs(rep.module, o["final_obs"][m], None if o["final_rgb"] is None else o["final_rgb"][m],
                              instr, o["prev_task_id"][m])
            fv[m] = _values_np(rep, fobs, int(m.sum()))
        r["final_values"] = fv
        r[M.WEIGHT_VERSION] = int(weights["version"])
        r["infer_time"] = (time.perf_counter() - t0) / len(sizes)
        if not results:  # the node's one load and moves, reported once (with its first shard)
            r[M.WEIGHT_SYNC], r[M.OFFLOAD_S] = sync, moved
        results.append(r)
        start += n
    return results


def _cuda_index(device: torch.device) -> list:
    return [device.index or 0] if device.type == "cuda" else []


def trajectory_disaggregated(cfg: Config, shard: int, first_obs: dict, *parts) -> dict:
    """Assemble one shard's trajectory from T env outputs and T+1 inference outputs (the last: bootstrap).

    parts = (infer_0, env_0, infer_1, env_1, ..., infer_{T-1}, env_{T-1}, infer_T); each infer_t is the group's
    list of per-shard dicts, `shard` indexes into it (position of the shard within its group).
    """
    T = (len(parts) - 1) // 2
    infers, envs = parts[0::2], parts[1::2]
    steps: dict[str, list] = {}
    for t in range(T):
        inf, env = infers[t][shard], envs[t]
        prev = first_obs if t == 0 else envs[t - 1]
        rec = {"obs": prev["obs"], "task_id": prev["task_id"]}
        if prev["rgb"] is not None:
            rec["rgb"] = prev["rgb"]
        rec.update({k: v for k, v in inf.items() if k in tj.POLICY_OUTPUTS or tj.is_extra(k)})
        rec["final_values"] = infers[t + 1][shard]["final_values"]
        for k in tj.ENV_OUTPUTS:
            rec[k] = env[k]
        for k, v in rec.items():
            steps.setdefault(k, []).append(v)
    traj = {k: np.stack(v) for k, v in steps.items()}
    traj["bootstrap_values"] = infers[T][shard]["values"]
    traj[M.EPISODES] = [e for env in envs for e in env[M.EPISODES]]
    traj[M.CURSOR] = envs[-1][M.CURSOR]
    env_t = sum(env["env_time"] for env in envs)
    inf_t = sum(i[shard]["infer_time"] for i in infers)
    traj[M.TIMING] = {"env": env_t, "infer": inf_t, "total": env_t + inf_t}
    traj[M.WEIGHT_VERSION] = min(i[shard][M.WEIGHT_VERSION] for i in infers)
    _sum_sync(traj, [i[shard] for i in infers])
    return traj


def trajectory_stages(cfg: Config, shard: int, num_stages: int, *parts) -> dict:
    """One shard's trajectory from its `num_stages` stage groups: `parts` = per stage, the arguments of
    `trajectory_disaggregated` after `shard` (first_obs, infer_0, env_0, ..., infer_T), stage after stage.
    Step fields are joined along B in stage order (stage j holds envs j*B/p ... of the shard), so the result has
    the layout of a one-stage trajectory; episodes are listed stage after stage; timings are summed."""
    n = len(parts) // num_stages
    trajs = [trajectory_disaggregated(cfg, shard, *parts[j * n:(j + 1) * n]) for j in range(num_stages)]
    out = {k: np.concatenate([t[k] for t in trajs], axis=1) for k in step_fields(trajs[0])}  # p x [T, B/p] -> [T, B]
    out["bootstrap_values"] = np.concatenate([t["bootstrap_values"] for t in trajs])  # p x [B/p, V] -> [B, V]
    out[M.EPISODES] = [e for t in trajs for e in t[M.EPISODES]]
    out[M.CURSOR] = join_cursors([t[M.CURSOR] for t in trajs])
    out[M.TIMING] = {k: sum(t[M.TIMING][k] for t in trajs) for k in trajs[0][M.TIMING]}
    out[M.WEIGHT_VERSION] = min(t[M.WEIGHT_VERSION] for t in trajs)
    _sum_sync(out, trajs)
    return out
