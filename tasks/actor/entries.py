"""The actor's task functions, as the training graph calls them (pipelines.graphs): `advantages` per shard, then
`actor_init` / `actor_update` (or `actor_update_offload`) / `actor_state` / `actor_eval_weights` / `actor_export` on
the actor's worker, where the `Actor` is resident (tasks.actor.actor). The multi-rank counterparts are
tasks.actor.distributed's.

The one-rank update is THE update loop (tasks.actor.loop.run_update) as a world of one; its state in a checkpoint
is THE state format (tasks.actor.state.actor_state_dict), the same as rank 0's of the sharded actor.
"""
from __future__ import annotations

import time

import numpy as np
import torch

from tasks import resident, seeding
from tasks import trajectory as tj
from tasks.actor.actor import Actor, build_actor, ema_start, ema_step, resident_actor
from tasks.actor.export import write_export
from tasks.actor.loop import behaviour_version, flatten, one_rank_plan, run_update, to_actor_device
from tasks.actor.nonfinite import finite, nonfinite_metrics, report, screen_inputs
from tasks.actor.state import actor_state_dict, load_model_state, load_optimizer_state, set_rng_state
from tasks.algorithms import get_estimator
from tasks.config import Config


def advantages(cfg: Config, traj: dict, shard: int | None = None) -> dict:
    """The advantages of one shard's trajectory by the estimator `algorithm.name` selects
    (tasks.algorithms.estimators: GAE per env, GRPO per group; envs are independent and groups never straddle
    shards, so shards are too). `shard` only names the shard in errors.

    Returns the sample fields [T, B, ...] (advantages/returns [T, B] for chunk-level rewards, [T, B, C] for
    action-level; loss_mask [T, B] bool: the chunk steps that enter the loss), rgb and extras/* when present,
    `stats` (reward/value/advantage means for logging) and `nonfinite` ({field: count}, tasks.actor.nonfinite;
    all finite: {"dropped": 0.0}).

    Raises:
        NonFiniteError: a NaN/inf where the math reads it, with algorithm.nonfinite=error (tasks.actor.nonfinite).
    """
    bad_steps, found = screen_inputs(cfg, traj, shard)
    if found:  # mask mode: nothing non-finite goes further; the chunk steps are dropped by the estimator
        traj = {k: (finite(v) if isinstance(v, np.ndarray) else v) for k, v in traj.items()}
    res = get_estimator(cfg.algorithm.name).advantages(traj=traj, algorithm=cfg.algorithm,
                                                       num_action_chunks=cfg.policy.num_action_chunks,
                                                       bad_steps=bad_steps, bad_inputs=found)
    out = _passthrough(traj)
    out.update(advantages=res["advantages"], returns=res["returns"], loss_mask=res["loss_mask"])
    out["stats"] = res["stats"]
    out["nonfinite"] = report(found, res["dropped"])
    return out


def _passthrough(traj: dict) -> dict:
    """The trajectory fields the update consumes unchanged (and the rollout's `weight_version`, when known)."""
    return {k: traj[k] for k in traj if k in tj.PASSTHROUGH or k == tj.Meta.WEIGHT_VERSION or tj.is_extra(k)}


def actor_init(cfg: Config, run_id: str, dims: tuple[int, int], checkpoint: dict | None = None,
               base_key=None) -> dict:
    """Create the resident actor for env dims (obs_dim, action_dim): fresh (seeded by `cfg.seed`) or from a
    loaded checkpoint (THE state format, tasks.actor.state: `policy`, `optimizer`, `rng`[, `policy_ema`], plus
    `run.weight_version`), continuing the process's RNG streams where the checkpoint's process left them (exact
    resume: the actor's worker also draws the disaggregated policy_infer's exploration noise). Returns its
    versioned weights (full). `base_key`: the Dask key (tasks.weights.KeyName or str) this node's output is held
    under: the actor's updates then hand out partial weights on top of it (`Actor.sync_weights`); None: full."""
    torch.manual_seed(seeding.model_init_seed(cfg.seed))
    actor = build_actor(cfg, *dims, load=checkpoint is None)  # a checkpoint overrides policy.model_path
    if checkpoint is None:
        from tasks.demo_index import set_demo_stats
        set_demo_stats(cfg, actor.policy)  # q01 / q99, state standardisation from sft.store (SFT from scratch)
    else:
        load_model_state(actor.policy, checkpoint["policy"])
        load_optimizer_state(actor.policy, actor.optimizer, checkpoint["optimizer"])  # 1 or R ranks wrote it
        actor.version = int(checkpoint["run"]["weight_version"])
        set_rng_state(checkpoint["rng"])
    # the average continues from the checkpoint's; a checkpoint without one (a run resumed with ema_decay > 0 is
    # refused when its params differ: this is a new run starting from another run's checkpoint) starts it here
    ema_start(cfg, actor, (checkpoint or {}).get("policy_ema"))
    actor.base_key = getattr(base_key, "key", base_key)
    resident.put(f"{run_id}/actor", actor)
    return actor.weights()


def actor_eval_weights(run_id: str, weights: dict) -> dict:
    """The weights an eval plays (`Actor.eval_weights`: the average with `algorithm.ema_decay` > 0), read on the
    actor's worker; `weights` (the step's versioned weights, a graph dependency) only orders this after the
    update that made them.

    Raises ActorMissing when this worker holds no actor of the run (the average is lost with it)."""
    return resident_actor(run_id).eval_weights()


def actor_state(run_id: str) -> dict:
    """The resident actor's state for a checkpoint, in THE format (tasks.actor.state.actor_state_dict: policy,
    FQN-keyed optimizer, rng, weight_version[, policy_ema]; CPU tensors), the same as rank 0's of the sharded actor.

    Raises ActorMissing when this worker holds no actor of the run."""
    actor = resident_actor(run_id)
    return actor_state_dict(actor.policy, actor.optimizer, actor.version, actor.ema)


def actor_export(run_id: str, checkpoint_path: str, env_meta: dict | None = None) -> str | None:
    """Write the resident actor's policy to `<checkpoint_path>/hf` (:func:`write_export`; policies that have a
    `save_pretrained`: every family), its averaged weights when kept (`algorithm.ema_decay`). Returns the directory,
    or None without an actor or such a policy."""
    import os
    actor: Actor | None = resident.get(f"{run_id}/actor")
    if actor is None or not hasattr(actor.policy, "save_pretrained"):
        return None
    policy = actor.policy
    if actor.ema is not None:  # the export is what the evals scored: the average, in a copy of the module
        import copy
        policy = copy.deepcopy(policy).to("cpu")
        policy.load_state_dict(actor.ema)
    return write_export(policy, os.path.join(checkpoint_path, "hf"), env_meta)


def actor_update(cfg: Config, run_id: str, weights: dict, *samples: dict) -> dict:
    """PPO update on the samples of every shard; returns new versioned weights and metrics (`run_update`: the
    same loop as the multi-rank update, as a world of one).

    `weights` are the actor's current weights (version v): the rollout's own with synchronous steps, the previous
    update's output with `runner.max_staleness` > 0. If the resident actor is missing (a fresh worker after a
    loss), it is rebuilt from them with a fresh optimizer and `train/actor_rebuilt` = 1 is reported.

    When the samples were rolled out with an older version than v (their `weight_version`), the proximal
    log-probs are recomputed under the current weights before the first minibatch and the decoupled PPO loss is
    used; otherwise proximal = behaviour and the loss is plain PPO (bit-identical to synchronous steps).
    Logged: `train/behaviour_logprob_mean`, `train/proximal_logprob_mean` (masked means), the counts of
    tasks.actor.loop and tasks.actor.nonfinite (`train/skipped_updates`, `train/empty_minibatches`,
    `rollout/nonfinite_*`).
    """
    t0 = time.perf_counter()
    data = flatten(samples)
    N, D = data["actions"].shape[0], data["actions"].shape[-1]
    rebuilt = 0.0

    def rebuild() -> Actor:
        actor = build_actor(cfg, data["obs"].shape[-1], D, load=False)
        if weights.get("partial"):  # the base's full weights, then the trainable tensors (tasks.weights)
            from tasks.weights import fetch_key
            load_model_state(actor.policy, fetch_key(weights["base_key"])["state_dict"])
            actor.policy.load_sync_state(weights["state_dict"])
            actor.base_key = weights["base_key"]
        else:
            load_model_state(actor.policy, weights["state_dict"])
        actor.version = weights["version"]
        return actor

    actor, created = resident.get_or_create(f"{run_id}/actor", rebuild)
    if created:
        rebuilt = 1.0
        ema_start(cfg, actor)  # the lost average restarts from the weights the actor is rebuilt from
    data = to_actor_device(data, actor.policy)
    metrics = run_update(cfg, actor.policy, actor.optimizer, data, version=int(weights["version"]),
                         behaviour=behaviour_version(weights, samples), plan=one_rank_plan(cfg, N))
    ema_step(actor, cfg.algorithm.ema_decay)
    actor.version = weights["version"] + 1
    metrics.update({"train/actor_rebuilt": rebuilt, "train/weight_version": float(actor.version),
                    "time/update": time.perf_counter() - t0, **nonfinite_metrics(samples)})
    out = actor.sync_weights()  # partial when the policy has frozen parameters (tasks.weights)
    out["metrics"] = metrics
    return out


def actor_update_offload(cfg, run_id: str, weights: dict, *samples: dict) -> dict:
    """`actor_update` between an onload and an offload of the resident actor (algorithm.offload).

    The actor's compute device is recorded on first use (`{run_id}/actor_device`: where `actor_update` trains
    it); before the update the actor is moved there, after it back to CPU memory. Adds the offload metrics
    (tasks.offload's docstring: time/offload, system/actor_device_mb_*_offload) to the update's output.
    """
    from tasks.offload import module_device, offload, onload
    key = f"{run_id}/actor"
    actor = resident.get(key)
    onload_s = 0.0
    if actor is not None:
        home = resident.get(f"{run_id}/actor_device") or module_device(actor.policy)
        resident.put(f"{run_id}/actor_device", home)
        onload_s = onload(actor.policy, actor.optimizer, home)
    out = actor_update(cfg, run_id, weights, *samples)
    actor = resident.get(key)  # actor_update may have rebuilt it
    home = resident.get(f"{run_id}/actor_device") or module_device(actor.policy)
    resident.put(f"{run_id}/actor_device", home)
    res = offload(actor.policy, actor.optimizer, home)
    m = out["metrics"]
    m["time/offload"] = onload_s + res["seconds"]
    m["system/actor_device_mb_before_offload"] = res["device_mb_before"]
    m["system/actor_device_mb_after_offload"] = res["device_mb_after"]
    for k in ("cuda_allocated_mb_before", "cuda_allocated_mb_after"):
        if k in res:
            m[f"system/{k}_offload"] = res[k]
    return out
