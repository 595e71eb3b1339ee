"""The rules that need several sections: batch shapes, the algorithm against env / policy / sft, asynchronous steps
and stages, CUDA on this machine, whole episodes for group estimators. Each raises ConfigError."""
from __future__ import annotations

import os

from tasks.config.batch import batch_plan
from tasks.config.errors import ConfigError
from tasks.config.schema import Config


def cuda_available() -> bool:
    """torch.cuda.is_available() (tasks.device re-exports it)."""
    import torch
    return torch.cuda.is_available()


def check_across(cfg: Config) -> None:
    """The checks that need several sections (batch shapes, the algorithm against env/policy/sft, asynchronous
    steps and stages, CUDA on this machine, whole episodes for group estimators). Raises ConfigError."""
    e, a, r, p = cfg.env, cfg.algorithm, cfg.rollout, cfg.policy
    spec = a.spec  # ConfigError for an unknown algorithm.name, listing the known ones
    rl = spec.rollout  # SFT rolls nothing out: the training envs' and the rollout's shapes are unread
    if rl and r.deterministic and a.actor_loss != "filtered_bc":
        raise ConfigError("rollout.deterministic", r.deterministic,
                          f"deterministic actions carry no log-probs, which algorithm.actor_loss={a.actor_loss} "
                          "needs: set algorithm.actor_loss=filtered_bc or rollout.deterministic=false")
    if rl and e.num_envs % e.num_shards:
        raise ConfigError("env.num_envs", e.num_envs,
                          f"must be divisible by env.num_shards={e.num_shards} (each env shard holds the same "
                          f"number of envs); e.g. env.num_envs={e.num_shards * max(1, e.num_envs // e.num_shards)}")
    if rl and r.inference == "colocated" and r.chunk_steps % r.chunk_steps_per_node:  # disaggregated: one
        raise ConfigError("rollout.chunk_steps_per_node", r.chunk_steps_per_node,  # node per chunk step
                          f"must divide rollout.chunk_steps={r.chunk_steps}")
    if rl and cfg.batch_size % a.num_minibatches:
        raise ConfigError("algorithm.num_minibatches", a.num_minibatches,
                          f"must divide the batch of rollout.chunk_steps*env.num_envs={cfg.batch_size} samples")
    if a.num_actor_ranks != 1 or a.global_batch_size is not None or a.micro_batch_size is not None:
        batch_plan(cfg)  # the RLinf divisibility rules, with the numbers
        if a.num_actor_ranks == 1 and a.global_batch_size is not None:  # one rank: num_minibatches sets the step
            raise ConfigError("algorithm.global_batch_size", a.global_batch_size, "is used by the multi-rank update "
                              "only (algorithm.num_actor_ranks > 1); with one rank leave it null and set "
                              "algorithm.num_minibatches (algorithm.micro_batch_size splits each step's samples)")
        if not spec.rollout:
            raise ConfigError("algorithm.num_actor_ranks", a.num_actor_ranks,
                              f"the {spec.label} update runs on one rank: use 1 with algorithm.name={a.name}")
        # ranks <= the actor's devices (one GPU worker per rank): pipelines.clusters.check_placement / plan_placement
    if a.offload and not spec.rollout:
        raise ConfigError("algorithm.offload", a.offload, f"the {spec.label} update does not offload: use "
                          f"algorithm.offload=false with algorithm.name={a.name}")
    if not spec.estimator:  # sft: the samples come from sft.store
        if not cfg.sft.store:
            raise ConfigError("sft.store", cfg.sft.store, "algorithm.name=sft needs a trajectory store path")
        import os
        if not (os.path.isfile(os.path.join(cfg.sft.store, "zarr.json"))  # a store, or a LeRobot dataset
                or os.path.isfile(os.path.join(cfg.sft.store, "meta", "info.json"))):
            raise ConfigError("sft.store", cfg.sft.store, "no zarr store or LeRobot dataset (meta/info.json) there; "
                                                           "record one with `python -m pipelines.record` first")
        if cfg.sft.value_coef < 0:
            raise ConfigError("sft.value_coef", cfg.sft.value_coef, "use >= 0 (0: no value warm start)")
        if cfg.sft.bc_coef < 0 or (cfg.sft.bc_coef == 0 and not cfg.sft.value_coef > 0):
            raise ConfigError("sft.bc_coef", cfg.sft.bc_coef, "use > 0, or 0 together with sft.value_coef > 0 "
                                                               "(a value-only pass)")
        if cfg.sft.bc_coef == 0 and not getattr(cfg.policy, "value_detach", False):  # a family without it: no
            raise ConfigError("sft.bc_coef", cfg.sft.bc_coef, "a value-only pass must leave the trunk as loaded: "
                                                               "set policy.value_detach=true")
        if cfg.sft.value_coef > 0 and a.reward_type != "chunk_level":
            raise ConfigError("sft.value_coef", cfg.sft.value_coef,
                              "the value warm start fits chunk-level returns: use algorithm.reward_type=chunk_level")
        for key, val in (("sft.batch_size", cfg.sft.batch_size), ("sft.updates_per_step", cfg.sft.updates_per_step),
                         ("sft.num_loaders", cfg.sft.num_loaders)):
            if val < 1:
                raise ConfigError(key, val, "must be >= 1")
    if spec.groups:
        if a.group_size < 2:
            raise ConfigError("algorithm.group_size", a.group_size,
                              f"{spec.label} compares envs within a group: use >= 2 (e.g. 8)")
        if e.num_envs % a.group_size or e.shard_size % a.group_size:
            raise ConfigError("algorithm.group_size", a.group_size,
                              f"must divide env.num_envs={e.num_envs} and the env shard size {e.shard_size} "
                              f"(num_envs / num_shards): a group never straddles env shards")
        if a.filter_rewards and a.rewards_lower_bound > a.rewards_upper_bound:
            raise ConfigError("algorithm.rewards_lower_bound", a.rewards_lower_bound,
                              f"must be <= algorithm.rewards_upper_bound={a.rewards_upper_bound}")
    check_async(cfg)
    check_device(cfg)
    check_whole_episodes(cfg)

def check_device(cfg: Config) -> None:
    """policy.device=cuda needs CUDA here when the cluster kind's workers run here (`WORKERS_HERE`)."""
    p = cfg.policy
    if p.device == "cuda" and type(cfg.cluster).WORKERS_HERE and not cuda_available():
        raise ConfigError("policy.device", p.device, "no CUDA device on this machine (torch.cuda.is_available() "
                          "is False): use policy.device=cpu")

def check_async(cfg: Config) -> None:
    """runner.max_staleness and rollout.pipeline_stage_num against the update and the env shards."""
    e, r, a, k = cfg.env, cfg.rollout, cfg.algorithm, cfg.runner.max_staleness
    if k > 0 and a.num_actor_ranks > 1:
        raise ConfigError("runner.max_staleness", k, "asynchronous steps are wired for the one-rank update only: "
                          "use algorithm.num_actor_ranks=1 or runner.max_staleness=0")
    spec = a.spec
    if k > 0 and not spec.rollout:
        raise ConfigError("runner.max_staleness", k, f"{spec.label} steps roll nothing out: use 0 with "
                                                     f"algorithm.name={a.name}")
    if k > 0 and a.ema_decay:
        raise ConfigError("algorithm.ema_decay", a.ema_decay, "an eval reads the average after its step's update; "
                          "with runner.max_staleness > 0 a later update may have moved it already: use "
                          "runner.max_staleness=0 or algorithm.ema_decay=0")
    p = r.pipeline_stage_num
    if e.shard_size % p:
        raise ConfigError("rollout.pipeline_stage_num", p,
                          f"must divide the env shard size {e.shard_size} (env.num_envs / env.num_shards)")
    if p > 1 and spec.groups and (e.shard_size // p) % a.group_size:
        raise ConfigError("rollout.pipeline_stage_num", p,
                          f"a stage group of {e.shard_size // p} envs must hold whole {spec.label} groups of "
                          f"algorithm.group_size={a.group_size}")


def check_whole_episodes(cfg: Config) -> None:
    """An estimator with `whole_episodes` (EstimatorSpec; GRPO) scores each env's FIRST episode of a rollout against
    its group, so that episode must start at the rollout's first chunk step in every env (tasks.envs.shard, lifecycle
    modes). Offline check (no env needed).

    Accepted: env.auto_reset=false (DISABLED: every rollout starts new episodes in every env; episodes still open
    at its end are cut and consume their seeds), or auto_reset=true with episodes aligned to rollouts:
    env.ignore_terminations=true (episodes end only at the time limit), env.max_episode_steps = k *
    policy.num_action_chunks, and rollout.chunk_steps a multiple of k (every rollout starts at an episode start).

    Raises:
        ConfigError: key env.auto_reset (such an estimator whose rollouts can start mid-episode), naming the fix.
    """
    e, C, T, spec = cfg.env, cfg.policy.num_action_chunks, cfg.rollout.chunk_steps, cfg.algorithm.spec
    if not spec.whole_episodes or not e.auto_reset:
        return
    L = e.max_episode_steps
    if e.ignore_terminations and L is not None and L % C == 0 and T % (L // C) == 0:
        return
    raise ConfigError("env.auto_reset", True,
                      f"{spec.label} scores each env's first episode of a rollout, and with auto_reset=true a rollout "
                      "can start mid-episode: set env.auto_reset=false (every rollout starts new episodes; open ones "
                      "are cut), or align episodes with rollouts: env.ignore_terminations=true, env.max_episode_steps"
                      f"=k*policy.num_action_chunks (C={C}) and rollout.chunk_steps (={T}) a multiple of k")
