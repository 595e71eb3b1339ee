"""Each section's own rules, as functions of the schema (the sections hold data only). Each raises ConfigError
naming the key, the value and the fix."""
from __future__ import annotations

import os

from tasks.config.errors import ConfigError
from tasks.config.schema import (ACTOR_LOSSES, DEVICES, DTYPES, SEED_LIMIT, AlgorithmConfig, EnvConfig,
                                 EvalConfig, PolicyConfig, RolloutConfig, RunnerConfig)


def check_seed(key: str, value: int) -> None:
    """`value` (a seed at `key`) is in [0, SEED_LIMIT), else ConfigError: the simulators and numpy take reset seeds
    as unsigned 32-bit integers, reset seeds are the seed plus episode offsets (tasks.seeding), and -1 marks an idle
    env in trajectory stores."""
    if not 0 <= value < SEED_LIMIT:
        raise ConfigError(key, value, f"use a seed in 0..{SEED_LIMIT - 1} (reset seeds are this plus episode offsets, "
                                      f"taken as unsigned 32-bit integers)")


def positive(section, prefix: str, names: list[str]) -> None:
    """Each of `names` (fields of `section`, a config section at dotted `prefix`) is >= 1, else ConfigError."""
    for name in names:
        value = getattr(section, name)
        if value < 1:
            raise ConfigError(f"{prefix}.{name}", value, "must be >= 1")


def check_eval(e: EvalConfig) -> None:
    """This section's own values. Raises ConfigError (env.eval.*)."""
    positive(e, "env.eval", ["num_envs", "num_episodes"])
    check_seed("env.eval.seed", e.seed)
    if e.val_episodes < 0:
        raise ConfigError("env.eval.val_episodes", e.val_episodes,
                          "use 0 (no validation split) or the number of validation episodes (e.g. 200)")
    if e.val_episodes:
        check_seed("env.eval.val_seed", e.val_seed)
        if e.val_seed < e.seed + e.num_episodes and e.seed < e.val_seed + e.val_episodes:
            raise ConfigError("env.eval.val_seed", e.val_seed,
                              f"its episodes (reset seeds {e.val_seed}..{e.val_seed + e.val_episodes - 1})"
                              f" overlap the eval's ({e.seed}..{e.seed + e.num_episodes - 1}): use a "
                              f"val_seed >= {e.seed + e.num_episodes} (e.g. 2000000)")


def check_env(e: EnvConfig) -> None:
    """This section's own values (the simulator's task and modes: tasks.envs.check_env_config). Raises
    ConfigError (env.*)."""
    positive(e, "env", ["num_envs", "num_shards"])
    check_seed("env.seed", e.seed)
    check_eval(e.eval)
    if not (e.max_episode_steps is None or e.max_episode_steps > 0):
        raise ConfigError("env.max_episode_steps", e.max_episode_steps,
                          "must be >= 1 or null (the env task's own limit)")
    if e.obs_mode == "rgb" and not 8 <= e.image_size <= 512:
        raise ConfigError("env.image_size", e.image_size, "use 8..512 pixels (e.g. 64)")


def check_policy(p: PolicyConfig) -> None:
    """The keys every policy family has (the family's own: its checks.py, registered with it). Raises ConfigError
    (policy.*)."""
    positive(p, "policy", ["num_action_chunks"])
    if p.model_path is not None and not os.path.isfile(os.path.join(p.model_path, "config.json")):
        raise ConfigError("policy.model_path", p.model_path,
                          "not a save_pretrained checkpoint directory (no config.json there); use the "
                          "`hf` directory an SFT or RL run writes next to its checkpoints, or null")
    if p.device not in DEVICES:
        raise ConfigError("policy.device", p.device, f"use one of {list(DEVICES)}")
    if p.dtype not in DTYPES:
        raise ConfigError("policy.dtype", p.dtype, f"use one of {list(DTYPES)}")
    if p.dtype == "bfloat16" and p.device != "cuda":
        raise ConfigError("policy.dtype", p.dtype, "bfloat16 autocast is for CUDA: set policy.device=cuda "
                          "(on a machine with CUDA) or policy.dtype=float32")


def check_algorithm(a: AlgorithmConfig) -> None:
    """This section's own values (the estimator against env/policy/sft: checks.across). Raises
    ConfigError (algorithm.*)."""
    positive(a, "algorithm", ["update_epochs", "num_minibatches"])
    for key, val, ok in [("algorithm.reward_type", a.reward_type, ("chunk_level", "action_level")),
                         ("algorithm.logprob_type", a.logprob_type,
                          ("chunk_level", "action_level", "token_level"))]:
        if val not in ok:
            raise ConfigError(key, val, f"use one of {list(ok)}")
    if a.actor_loss not in ACTOR_LOSSES:
        raise ConfigError("algorithm.actor_loss", a.actor_loss, f"use one of {list(ACTOR_LOSSES)}")
    if a.reward_type == "action_level" and a.logprob_type == "chunk_level":
        raise ConfigError("algorithm.logprob_type", a.logprob_type,
                          "action_level rewards need per-action log-probs: set algorithm.logprob_type="
                          "action_level or token_level (or algorithm.reward_type=chunk_level)")
    if not 0.0 < a.gamma <= 1.0:
        raise ConfigError("algorithm.gamma", a.gamma, "must be in (0, 1]")
    if not 0.0 <= a.gae_lambda <= 1.0:
        raise ConfigError("algorithm.gae_lambda", a.gae_lambda, "must be in [0, 1]")
    if a.clip_ratio_low <= 0 or a.clip_ratio_high <= 0:
        raise ConfigError("algorithm.clip_ratio_low/high", (a.clip_ratio_low, a.clip_ratio_high),
                          "both must be > 0")
    if a.dual_clip is not None and a.dual_clip <= 1.0:
        raise ConfigError("algorithm.dual_clip", a.dual_clip, "must be > 1 (or null to disable)")
    for key, val, ok, fix in [
        ("algorithm.lr", a.lr, a.lr > 0, "must be > 0"),
        ("algorithm.max_grad_norm", a.max_grad_norm, a.max_grad_norm > 0, "must be > 0"),
        ("algorithm.reward_scale", a.reward_scale, a.reward_scale > 0, "must be > 0"),
        ("algorithm.entropy_coef", a.entropy_coef, a.entropy_coef >= 0, "must be >= 0"),
        ("algorithm.value_coef", a.value_coef, a.value_coef >= 0, "must be >= 0"),
        ("algorithm.value_clip", a.value_clip, a.value_clip is None or a.value_clip > 0, "must be > 0 or null"),
        ("algorithm.target_kl", a.target_kl, a.target_kl is None or a.target_kl > 0, "must be > 0 or null"),
        ("algorithm.critic_lr", a.critic_lr, a.critic_lr is None or a.critic_lr > 0, "must be > 0 or null"),
        ("algorithm.lr_anneal_steps", a.lr_anneal_steps, a.lr_anneal_steps is None or a.lr_anneal_steps >= 1,
         "must be >= 1 (updates until the learning rate reaches 0) or null (constant)"),
        ("algorithm.critic_warmup_steps", a.critic_warmup_steps, a.critic_warmup_steps >= 0, "must be >= 0"),
        *((f"algorithm.lr_scale.{k}", v, v >= 0, "must be >= 0 (0 freezes those parameters)")
          for k, v in a.lr_scale.items()),
    ]:
        if not ok:
            raise ConfigError(key, val, fix)
    if a.offload and a.num_actor_ranks > 1:
        raise ConfigError("algorithm.offload", a.offload, "offload is wired for the one-rank update: use "
                          "algorithm.num_actor_ranks=1 or algorithm.offload=false")
    if not 0.0 <= a.ema_decay < 1.0:
        raise ConfigError("algorithm.ema_decay", a.ema_decay, "must be in [0, 1) (0: no averaged weights)")
    if a.ema_decay and a.num_actor_ranks > 1:
        raise ConfigError("algorithm.ema_decay", a.ema_decay, "averaged weights are kept by the one-rank "
                          "update: use algorithm.num_actor_ranks=1 or algorithm.ema_decay=0")
    _check_nonfinite(a)


def check_rollout(r: RolloutConfig) -> None:
    """This section's own values. Raises ConfigError (rollout.*)."""
    positive(r, "rollout", ["chunk_steps", "chunk_steps_per_node"])
    if r.inference not in ("colocated", "disaggregated"):
        raise ConfigError("rollout.inference", r.inference, "use 'colocated' or 'disaggregated'")
    p = r.pipeline_stage_num
    if p < 1:
        raise ConfigError("rollout.pipeline_stage_num", p, "must be >= 1")
    if p > 1 and r.inference != "disaggregated":
        raise ConfigError("rollout.pipeline_stage_num", p, "pipelines inference against env stepping across "
                          "nodes: set rollout.inference=disaggregated (colocated nodes run inference inline)")


def check_runner(n: RunnerConfig) -> None:
    """This section's own values. Raises ConfigError (runner.*)."""
    positive(n, "runner", ["max_steps", "val_check_interval", "save_interval"])
    for key, val, ok, fix in [
        ("runner.max_wall_time_s", n.max_wall_time_s, n.max_wall_time_s is None or n.max_wall_time_s > 0,
         "must be > 0 or null"),
        ("runner.max_env_steps", n.max_env_steps, n.max_env_steps is None or n.max_env_steps > 0,
         "must be >= 1 or null"),
        ("runner.keep_checkpoints", n.keep_checkpoints, n.keep_checkpoints >= 1, "must be >= 1"),
        ("runner.max_retries", n.max_retries, n.max_retries >= 0, "must be >= 0"),
        ("runner.pause_timeout_s", n.pause_timeout_s, n.pause_timeout_s > 0,
         "must be > 0 (seconds a placed worker may stay paused for memory)"),
        ("runner.stall_timeout_s", n.stall_timeout_s, n.stall_timeout_s > 0,
         "must be > 0 (seconds a task may execute, at least, before the step counts as stalled)"),
        ("runner.eval_videos", n.eval_videos, n.eval_videos >= 0,
         "must be >= 0 (the eval episodes filmed per evaluation; 0: none)"),
        ("runner.eval_video_size", n.eval_video_size, 64 <= n.eval_video_size <= 1024,
         "must be in [64, 1024] (pixels of the square video frames)"),
        ("runner.eval_video_interval", n.eval_video_interval, n.eval_video_interval >= 1,
         "must be >= 1 (evals at steps that are multiples of it are filmed, and the last step's; 1: every eval)"),
        ("runner.stop_on_eval_success", n.stop_on_eval_success,
         n.stop_on_eval_success is None or 0 < n.stop_on_eval_success <= 1, "must be in (0, 1] or null"),
    ]:
        if not ok:
            raise ConfigError(key, val, fix)
    if n.resume is not None and not n.resume:
        raise ConfigError("runner.resume", n.resume, "use a run id, 'latest', or null")
    if n.max_staleness < 0:
        raise ConfigError("runner.max_staleness", n.max_staleness, "must be >= 0 (0: synchronous steps)")
    bad = [s for s in n.profile_steps if not 1 <= s <= n.max_steps]
    if bad or len(set(n.profile_steps)) != len(n.profile_steps):
        raise ConfigError("runner.profile_steps", list(n.profile_steps),
                          f"use distinct training steps in 1..runner.max_steps={n.max_steps} (the first step is "
                          f"1), e.g. [1,{min(2, n.max_steps)}]; [] profiles none")
    if n.profile_update_step is not None and not 1 <= n.profile_update_step <= n.max_steps:
        raise ConfigError("runner.profile_update_step", n.profile_update_step,
                          f"use a training step in 1..runner.max_steps={n.max_steps} (the first step is 1), "
                          f"or null")


def _check_nonfinite(a: AlgorithmConfig) -> None:
    """algorithm.nonfinite (read by tasks.update.advantages)."""
    if a.nonfinite not in ("error", "mask"):
        raise ConfigError("algorithm.nonfinite", a.nonfinite,
                          "use 'error' (stop at a NaN/inf, naming where) or 'mask' (drop those samples from the "
                          "loss and count them as rollout/nonfinite_*)")
