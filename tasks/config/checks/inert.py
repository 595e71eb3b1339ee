"""Keys that take no effect (every key a user sets takes effect, or is refused): what stays after the families
became classes (a key a family lacks is unknown for it, refused at composition) is command- and value-dependent:
the keys a command does not read, keys switched off by another key's value. A family adds its own value-dependent
ones through an `inert_keys(cfg, command, cuda_count)` function on its config class."""
from __future__ import annotations

import dataclasses

from tasks.algorithms.specs import ESTIMATOR_KEYS, ESTIMATORS
from tasks.config.schema import Config, RunnerConfig

COMMANDS = ("run", "record")  # pipelines.run (and validate of a training config), pipelines.record


def config_value(cfg: Config, key: str):
    """The value at dotted `key` ('a.b.c'; dict entries by their key, e.g. 'cluster.component_placement.actor').

    Raises:
        KeyError: no such key.
    """
    obj = cfg
    for part in key.split("."):
        if isinstance(obj, dict):
            if part not in obj:
                raise KeyError(key)
            obj = obj[part]
        elif hasattr(obj, part):
            obj = getattr(obj, part)
        else:
            raise KeyError(key)
    return obj


def command_keys(cfg: Config, command: str = "run") -> list[tuple[str, str]]:
    """The keys (or section prefixes) `command` does not read whatever their values, each with why: (key, reason).
    pipelines.record reads the env of the recording, C, record.*, the cluster; pipelines.run everything but
    record.* (docs/reference/config.md's "commands" column is this). Raises ValueError for an unknown command."""
    if command not in COMMANDS:
        raise ValueError(f"command {command!r}: use one of {COMMANDS}")
    out: list[tuple[str, str]] = []

    def off(keys, why: str) -> None:
        out.extend((k, why) for k in keys)

    if command == "record":
        why = ("is not read by pipelines.record (it reads env.*, policy.num_action_chunks, record.*, cluster.*, "
               "runner.progress, runner.pause_timeout_s, runner.stall_timeout_s, experiment, run_root; the "
               "teacher's policy comes from its run): drop it")
        off(["algorithm", "rollout", "sft", "tracking", "storage", "env.eval", "seed"], why)
        off([f"runner.{f.name}" for f in dataclasses.fields(RunnerConfig)
             if f.name not in ("progress", "pause_timeout_s", "stall_timeout_s")], why)  # record's waits: watched
        off([f"policy.{f.name}" for f in dataclasses.fields(cfg.policy) if f.name != "num_action_chunks"], why)
        off(["env.auto_reset"], "a recording runs one whole episode per env and round (auto_reset is always off): "
                                "drop it")
    else:
        off(["record"], "is read by `python -m pipelines.record` only: drop it, or record with pipelines.record")
    return out


def inert_keys(cfg: Config, command: str = "run", cuda_count: int = 0) -> list[tuple[str, str]]:
    """The keys that do nothing for this config under `command`, each with why and the fix: (key, reason).

    A key is a dotted key or a section prefix ('sft' covers 'sft.store', ...). Only keys a user SET (given on the
    command line or in the experiment file; pipelines.config.given_keys) are refused for being here; schema
    defaults are not. `cuda_count`: CUDA devices of the machine (the embedded cluster ignores
    `cluster.num_gpu_workers` when there are some). Placement entries (`cluster.component_placement.*`) are
    checked by pipelines.clusters.placement.check_placement_effect, which knows the devices.
    """
    if command not in COMMANDS:
        raise ValueError(f"command {command!r}: use one of {COMMANDS}")
    e, p, a, r, c = cfg.env, cfg.policy, cfg.algorithm, cfg.rollout, cfg.cluster
    out: list[tuple[str, str]] = []

    def off(keys, why: str) -> None:
        out.extend((k, why) for k in keys)

    out.extend(command_keys(cfg, command))  # per command: the keys it never reads

    # ----- env -----
    if e.obs_mode != "rgb":
        off(["env.image_size"], f"sizes the camera image of env.obs_mode=rgb; env.obs_mode={e.obs_mode} renders "
                                f"none: drop it or set env.obs_mode=rgb")

    # ----- the families' own (their config class's `inert_keys`, if any: value-dependent keys of the family) -----
    for section in (e, p, c):
        fn = getattr(type(section), "inert_keys", None)
        if fn is not None:
            out.extend(fn(cfg, command, cuda_count))

    spec = a.spec
    # ----- algorithm, rollout, runner, storage, sft -----
    if command == "run":
        rl = spec.rollout
        if not rl:
            why = ("is not read by algorithm.name=sft (behaviour cloning from sft.store: no rollouts, no PPO/GRPO "
                   "loss; it reads algorithm.lr/max_grad_norm/critic_lr, sft.*, env.eval.* for evaluation): drop it")
            off([f"algorithm.{k}" for k in ("group_size", "filter_rewards", "rewards_lower_bound",
                                            "rewards_upper_bound", "gae_lambda", "reward_type", "logprob_type",
                                            "clip_ratio_low", "clip_ratio_high", "dual_clip", "value_clip",
                                            "entropy_coef", "value_coef", "update_epochs", "num_minibatches",
                                            "normalize_advantages", "target_kl", "critic_warmup_steps",
                                            "lr_anneal_steps", "global_batch_size", "micro_batch_size",
                                            "nonfinite")], why)
            off(["rollout", "storage", "runner.max_env_steps", "env.num_envs", "env.auto_reset",
                 "env.ignore_terminations", "env.seed"],
                "is not read by algorithm.name=sft: SFT steps roll nothing out (the samples come from sft.store; "
                "evaluation uses env.eval.*): drop it")
            if not cfg.sft.value_coef > 0:
                off(["algorithm.gamma", "algorithm.reward_scale", "algorithm.critic_lr"],
                    "is read by the SFT value warm start only (sft.value_coef > 0), sft.value_coef=0: drop it")
        else:
            off(["sft"], f"is read by algorithm.name=sft only (algorithm.name={a.name}): drop it")
        if spec.estimator:  # the estimator's keys (EstimatorSpec.keys): those of other estimators do nothing
            for k in ESTIMATOR_KEYS:
                if k not in spec.keys:
                    readers = "|".join(s.name for s in ESTIMATORS.values() if k in s.keys)
                    off([f"algorithm.{k}"], f"is read by algorithm.name={readers} only (algorithm.name={a.name}: "
                                            f"{spec.summary}): drop it")
            if "filter_rewards" in spec.keys and not a.filter_rewards:
                off(["algorithm.rewards_lower_bound", "algorithm.rewards_upper_bound"],
                    "bounds the group filter of algorithm.filter_rewards=true, which is off: drop it or set "
                    "algorithm.filter_rewards=true")
        if a.num_actor_ranks > 1 and a.global_batch_size is not None:
            off(["algorithm.num_minibatches"], "with algorithm.num_actor_ranks > 1 and algorithm.global_batch_size "
                                               "set, the optimizer steps come from global_batch_size: drop one")
        if a.offload and p.device == "cpu":
            off(["algorithm.offload"], "moves the actor and the rollout replicas off their CUDA device between the "
                                       "phases; with policy.device=cpu there is nothing to move: drop it (or set "
                                       "policy.device=cuda)")
        if rl and r.inference == "colocated":
            off(["rollout.pipeline_stage_num"], "splits disaggregated inference into stages; with "
                                                "rollout.inference=colocated inference runs inside the env_step nodes: "
                                                "drop it or set rollout.inference=disaggregated")
        if rl and r.inference == "disaggregated":
            off(["rollout.chunk_steps_per_node"], "sets the length of the colocated env_step nodes; with "
                                                  "rollout.inference=disaggregated every chunk step is one env_step "
                                                  "node: drop it or set rollout.inference=colocated")

    if command == "run":
        if e.sim_backend == "physx_cuda":
            off(["runner.eval_videos", "runner.eval_video_size", "runner.eval_video_interval"],
                "films eval episodes by replaying their actions on the CPU simulator; GPU simulation "
                "(env.sim_backend=physx_cuda) keeps no action log and is not replayable there: drop it")
        elif cfg.runner.eval_videos == 0:
            off(["runner.eval_video_size", "runner.eval_video_interval"],
                "sizes or spaces the eval videos, and runner.eval_videos=0 films none: drop it or set "
                "runner.eval_videos")

    # ----- cluster: each kind's own (`inert_keys` of pipelines/clusters/<kind>.py's class, run above) -----
    return out


def inert_reason(key: str, inert: list[tuple[str, str]]) -> str | None:
    """The reason of the first entry of `inert` (from `inert_keys`) that is `key` or a section above it, else None."""
    for k, why in inert:
        if key == k or key.startswith(k + "."):
            return why
    return None


def unchecked_notes(cfg: Config, command: str = "run") -> list[str]:
    """Keys set for a whole cluster that this config does not read, each as one `note:` line (not refused: a
    cluster group file or a user's habit sets them for every experiment): `cluster.gpu_memory_gib` with a policy
    family that has no offline memory plan (`memory_plan` of its config class; pi0 and pi05 have one)."""
    gib, p = cfg.cluster.gpu_memory_gib, cfg.policy
    if command != "run" or gib is None or type(p).memory_plan:
        return []
    from tasks.config.registry import families
    have = ", ".join(sorted(n for n, c in families("policy").items() if c.memory_plan))
    return [f"note: cluster.gpu_memory_gib={gib} is not checked for policy.name={p.name}: that family has no offline "
            f"memory plan (the families with one: {have})"]
