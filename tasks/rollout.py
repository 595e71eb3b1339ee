"""Rollout task functions: env stepping with a resident policy replica, trajectory assembly, evaluation.

Shapes: T chunk steps, B envs of the shard, C actions per chunk, D action dim, O obs dim, V value outputs
(1 for chunk-level values, C for action-level). A trajectory (one shard, one training step) is a dict of numpy:
  obs [T,B,O] f32, actions [T,B,C,D] f32 (unclipped samples), logprobs [T,B,C,D] f32, values [T,B,V] f32,
  final_values [T,B,V] f32 (V(final_obs) where the episode was truncated at t, else 0), bootstrap_values [B,V] f32
  (V of the observation after the last chunk step), rewards [T,B,C] f32, terminated [T,B] bool,
  truncated [T,B] bool, step_mask [T,B,C] bool, success [T,B] bool, episode_seed [T,B] i64, episode_id [T,B] i64,
plus "episodes" (finished-episode metrics), "cursor" (shard seed cursor) and "timing" (seconds).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from tasks import resident
from tasks.config import Config
from tasks.envs import EnvShard, make_shard
from tasks.policies import make_policy

STEP_FIELDS = ("obs", "actions", "logprobs", "values", "final_values", "rewards", "terminated", "truncated",
               "step_mask", "success", "episode_seed", "episode_id")


@dataclass
class Replica:
    """A policy replica resident on a worker, with the weight version it holds."""

    module: torch.nn.Module
    version: int = -1


def num_values(cfg: Config) -> int:
    """Value outputs per chunk step: C for action-level rewards, else 1."""
    return cfg.policy.num_action_chunks if cfg.algorithm.reward_type == "action_level" else 1


def env_dims(cfg: Config) -> tuple[int, int]:
    """(obs_dim, action_dim) of the env task, from a throw-away instance cached per process."""
    def probe():
        from tasks.envs import make_single_env
        env = make_single_env(cfg.env)
        dims = (env.obs_dim, env.action_dim)
        env.close()
        return dims
    dims, _ = resident.get_or_create(f"dims/{cfg.env.simulator}/{cfg.env.env_id}/{cfg.env.obs_mode}/"
                                     f"{cfg.env.control_mode}", probe)
    return dims


def get_replica(cfg: Config, run_id: str, weights: dict, obs_dim: int, action_dim: int) -> Replica:
    """The resident policy replica of this worker, loaded with `weights` (a load only when the version changed)."""
    rep, _ = resident.get_or_create(f"{run_id}/policy", lambda: Replica(
        make_policy(cfg.policy, obs_dim=obs_dim, action_dim=action_dim, num_values=num_values(cfg))))
    if rep.version != weights["version"]:
        rep.module.load_state_dict(weights["state_dict"])
        rep.module.eval()
        rep.version = weights["version"]
    return rep


def get_shard(cfg: Config, run_id: str, shard: int, cursor: dict | None) -> EnvShard:
    """The resident training env shard `shard`; created (continuing `cursor`) on first use."""
    e = cfg.env

    def create() -> EnvShard:
        torch.set_num_threads(cfg.cluster.threads_per_worker)
        # every worker process starts with torch's same default seed: without this, shards on different workers
        # would draw identical exploration noise
        torch.manual_seed(cfg.seed * 100_003 + shard * 7_919 + int(sum((cursor or {}).get("episode_count", []))))
        return make_shard(e, shard=shard, num_shards=e.num_shards, num_envs=e.num_envs, auto_reset=e.auto_reset,
                          ignore_terminations=e.ignore_terminations, base_seed=e.seed,
                          episode_count=(cursor or {}).get("episode_count"))

    sh, _ = resident.get_or_create(f"{run_id}/shard/{shard}", create)
    return sh


def env_step(cfg: Config, run_id: str, shard: int, weights: dict, num_chunk_steps: int, cursor: dict | None,
             first: bool, prev=None) -> dict:
    """Colocated rollout segment: `num_chunk_steps` chunk steps of shard `shard`, inference inside.

    `prev` (the previous segment of the same shard) is only a graph dependency that orders segments.
    Returns the STEP_FIELDS with a leading [n] axis, and bootstrap_values, episodes, cursor, timing.
    """
    t0 = time.perf_counter()
    sh = get_shard(cfg, run_id, shard, cursor)
    if first and not cfg.env.auto_reset:
        sh.reset_all()  # without auto_reset every rollout starts from fresh episodes (RLinf)
    rep = get_replica(cfg, run_id, weights, sh.obs_dim, sh.action_dim)
    t_env = t_inf = 0.0
    steps: dict[str, list] = {k: [] for k in STEP_FIELDS}
    episodes: list[dict] = []
    obs = sh.current_obs()
    for _ in range(num_chunk_steps):
        ti = time.perf_counter()
        out = rep.module.act(torch.from_numpy(obs))
        actions = out["actions"].numpy()
        te = time.perf_counter()
        res = sh.chunk_step(actions)
        tf = time.perf_counter()
        final_values = np.zeros((sh.num_envs, num_values(cfg)), np.float32)
        if res.truncated.any():  # V(final_obs) bootstraps truncated episodes only
            with torch.no_grad():
                fv = rep.module.values(torch.from_numpy(res.final_obs[res.truncated]))
            final_values[res.truncated] = fv.reshape(int(res.truncated.sum()), -1).numpy()
        t_inf += (te - ti) + (time.perf_counter() - tf)
        t_env += tf - te
        for k, v in (("obs", obs), ("actions", actions), ("logprobs", out["logprobs"].numpy()),
                     ("values", out["values"].reshape(sh.num_envs, -1).numpy()), ("final_values", final_values),
                     ("rewards", res.rewards), ("terminated", res.terminated), ("truncated", res.truncated),
                     ("step_mask", res.step_mask), ("success", res.success), ("episode_seed", res.episode_seed),
                     ("episode_id", res.episode_id)):
            steps[k].append(v)
        episodes += res.episodes
        obs = res.obs
    with torch.no_grad():
        bootstrap = rep.module.values(torch.from_numpy(obs)).reshape(sh.num_envs, -1).numpy()
    seg = {k: np.stack(v) for k, v in steps.items()}
    seg.update(bootstrap_values=bootstrap, episodes=episodes, cursor=sh.state_dict(),
               timing={"env": t_env, "infer": t_inf, "total": time.perf_counter() - t0})
    return seg


def trajectory(*segments: dict) -> dict:
    """Concatenate a shard's segments along T. Fields as in the module docstring."""
    traj = {k: np.concatenate([s[k] for s in segments]) for k in STEP_FIELDS}
    traj["bootstrap_values"] = segments[-1]["bootstrap_values"]
    traj["episodes"] = [e for s in segments for e in s["episodes"]]
    traj["cursor"] = segments[-1]["cursor"]
    traj["timing"] = {k: sum(s["timing"][k] for s in segments) for k in segments[0]["timing"]}
    return traj


def evaluate(cfg: Config, run_id: str, shard: int, weights: dict) -> list[dict]:
    """Deterministic evaluation on eval shard `shard`: the same seeds at every call.

    Eval episode i (0 <= i < eval.num_episodes) runs on eval env i % N with reset seed `eval.seed + i`,
    N = eval.num_envs. Returns the finished-episode dicts of this shard (see EnvShard.chunk_step).
    """
    ev = cfg.env.eval
    n_shards = cfg.env.num_shards
    sh, _ = resident.get_or_create(f"{run_id}/eval/{shard}", lambda: make_shard(
        cfg.env, shard=shard, num_shards=n_shards, num_envs=ev.num_envs, auto_reset=False,
        ignore_terminations=ev.ignore_terminations, base_seed=ev.seed))
    rep = get_replica(cfg, run_id, weights, sh.obs_dim, sh.action_dim)
    sh.episode_count[:] = 0
    episodes: list[dict] = []
    rounds = -(-ev.num_episodes // ev.num_envs)
    for _ in range(rounds):
        obs = sh.reset_all()
        while sh.active.any():
            out = rep.module.act(torch.from_numpy(obs), deterministic=True)
            res = sh.chunk_step(out["actions"].numpy())
            episodes += res.episodes
            obs = res.obs
    return [e for e in episodes if e["episode_id"] < ev.num_episodes]


# ----- disaggregated inference: env_step and policy_infer are separate nodes, one per chunk step -----

def env_observe(cfg: Config, run_id: str, shard: int, cursor: dict | None, first: bool = True) -> dict:
    """The observation a rollout starts from, {"obs": [B, O]} (resets first without auto_reset)."""
    sh = get_shard(cfg, run_id, shard, cursor)
    if first and not cfg.env.auto_reset:
        sh.reset_all()
    return {"obs": sh.current_obs(), "truncated": np.zeros(sh.num_envs, bool), "final_obs": None}


def env_step_chunk(cfg: Config, run_id: str, shard: int, infer_out: list[dict], cursor: dict | None) -> dict:
    """One chunk step of shard `shard` with the actions `policy_infer` computed for it (disaggregated mode)."""
    t0 = time.perf_counter()
    sh = get_shard(cfg, run_id, shard, cursor)
    res = sh.chunk_step(infer_out[shard]["actions"])
    out = {k: getattr(res, k) for k in ("obs", "rewards", "terminated", "truncated", "step_mask", "success",
                                        "final_obs", "episode_seed", "episode_id", "episodes")}
    out["cursor"] = sh.state_dict()
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
    obs = np.concatenate([o["obs"] for o in env_outs])  # [S*B, O]
    sizes = [len(o["obs"]) for o in env_outs]
    rep = get_replica(cfg, run_id, weights, *dims)
    V = num_values(cfg)
    with torch.no_grad():
        if sample:
            out = rep.module.act(torch.from_numpy(obs))
            acts = {"actions": out["actions"].numpy(), "logprobs": out["logprobs"].numpy(),
                    "values": out["values"].reshape(len(obs), V).numpy()}
        else:
            acts = {"values": rep.module.values(torch.from_numpy(obs)).reshape(len(obs), V).numpy()}
        results, start = [], 0
        for o, n in zip(env_outs, sizes):
            r = {k: v[start:start + n] for k, v in acts.items()}
            fv = np.zeros((n, V), np.float32)
            if o["final_obs"] is not None and o["truncated"].any():
                fv[o["truncated"]] = rep.module.values(torch.from_numpy(o["final_obs"][o["truncated"]])) \
                    .reshape(-1, V).numpy()
            r["final_values"] = fv
            r["infer_time"] = (time.perf_counter() - t0) / len(sizes)
            results.append(r)
            start += n
    return results


def trajectory_disaggregated(cfg: Config, shard: int, first_obs: dict, *parts) -> dict:
    """Assemble one shard's trajectory from T env outputs and T+1 inference outputs (the last: bootstrap).

    parts = (infer_0, env_0, infer_1, env_1, ..., infer_{T-1}, env_{T-1}, infer_T); each infer_t is the group's
    list of per-shard dicts, `shard` indexes into it (position of the shard within its group).
    """
    T = (len(parts) - 1) // 2
    infers, envs = parts[0::2], parts[1::2]
    steps: dict[str, list] = {k: [] for k in STEP_FIELDS}
    for t in range(T):
        inf, env = infers[t][shard], envs[t]
        steps["obs"].append(first_obs["obs"] if t == 0 else envs[t - 1]["obs"])
        for k in ("actions", "logprobs", "values"):
            steps[k].append(inf[k])
        steps["final_values"].append(infers[t + 1][shard]["final_values"])
        for k in ("rewards", "terminated", "truncated", "step_mask", "success", "episode_seed", "episode_id"):
            steps[k].append(env[k])
    traj = {k: np.stack(v) for k, v in steps.items()}
    traj["bootstrap_values"] = infers[T][shard]["values"]
    traj["episodes"] = [e for env in envs for e in env["episodes"]]
    traj["cursor"] = envs[-1]["cursor"]
    env_t = sum(env["env_time"] for env in envs)
    inf_t = sum(i[shard]["infer_time"] for i in infers)
    traj["timing"] = {"env": env_t, "infer": inf_t, "total": env_t + inf_t}
    return traj
