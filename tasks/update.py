"""Advantage and actor-update task functions, and the actor resident on the GPU-resource worker.

Flattening: a trajectory's [T, B, ...] fields become [N = T*B, ...] samples for the update. With
`reward_type=chunk_level` advantages/returns are [N]; with `action_level` they are [N, C] and values [N, C].
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from tasks import resident
from tasks.algorithms import (aggregate_rewards, critic_loss, decoupled_ppo_actor_loss, entropy_bonus,
                              expand_advantages, from_action_level, get_advantage, loss_mask_for, masked_mean,
                              normalize_advantages, ppo_actor_loss, reduce_logprobs, to_action_level)
from tasks.config import Config
from tasks.device import autocast, policy_device, to_device
from tasks.policies import make_policy
from tasks.rollout import image_size, instruction, num_values, policy_obs

SAMPLE_FIELDS = ("obs", "actions", "logprobs", "values", "advantages", "returns", "step_mask", "loss_mask")


def advantages(cfg: Config, traj: dict) -> dict:
    """GAE or GRPO advantages on one shard's trajectory (envs are independent and GRPO groups never straddle
    shards, so shards are too).

    Returns the sample fields [T, B, ...] (advantages/returns [T, B] for chunk-level rewards, [T, B, C] for
    action-level; loss_mask [T, B] bool: the chunk steps that enter the loss), rgb and extras/* when present, and
    `stats` (reward/value/advantage means for logging).
    """
    a = cfg.algorithm
    if a.adv_type == "grpo":
        return _grpo(cfg, traj)
    t = {k: torch.from_numpy(np.asarray(traj[k])) for k in ("rewards", "values", "final_values",
                                                             "terminated", "truncated", "step_mask")}
    boot = torch.from_numpy(traj["bootstrap_values"])  # [B, V]
    values = torch.cat([t["values"], boot[None]])  # [T, B, V] + [1, B, V] -> [T+1, B, V]
    rewards = aggregate_rewards(t["rewards"] * a.reward_scale, reward_type=a.reward_type)
    est = get_advantage(a.adv_type)
    if a.reward_type == "chunk_level":  # [T, B] rewards, [T+1, B, 1] -> [T+1, B] values
        adv, ret = est(rewards=rewards, values=values[..., 0], terminated=t["terminated"],
                       truncated=t["truncated"], final_values=t["final_values"][..., 0], gamma=a.gamma,
                       lam=a.gae_lambda)
    else:  # per-action time axis [T*C, B], back to [T, B, C]
        # V(final_obs) bootstraps the episode's last executed action: the value at position 0 of the next state
        flat = to_action_level(rewards=rewards, values=values, terminated=t["terminated"],
                               truncated=t["truncated"], final_values=t["final_values"][..., 0],
                               step_mask=t["step_mask"])
        adv, ret = est(**flat, gamma=a.gamma, lam=a.gae_lambda)
        C = cfg.policy.num_action_chunks
        adv, ret = from_action_level(adv, num_action_chunks=C), from_action_level(ret, num_action_chunks=C)
    out = _passthrough(traj)
    out.update(advantages=adv.numpy(), returns=ret.numpy(), loss_mask=traj["step_mask"].any(-1))
    out["stats"] = {"rollout/reward_mean": float(t["rewards"].sum(-1).mean()),
                    "rollout/value_mean": float(t["values"].mean()),
                    "rollout/advantage_mean": float(adv.mean()), "rollout/return_mean": float(ret.mean())}
    return out


def _passthrough(traj: dict) -> dict:
    """The trajectory fields the update consumes unchanged (and the rollout's `weight_version`, when known)."""
    return {k: traj[k] for k in traj if k in ("obs", "rgb", "actions", "logprobs", "values", "step_mask",
                                               "weight_version") or k.startswith("extras/")}


def _grpo(cfg: Config, traj: dict) -> dict:
    """GRPO (critic-free): group-relative episode scores broadcast over each env's first episode in the rollout
    (tasks.algorithms.grpo_advantages); `returns` are zeros (no critic is trained)."""
    from tasks.algorithms import grpo_advantages
    a = cfg.algorithm
    rewards = aggregate_rewards(torch.from_numpy(traj["rewards"]) * a.reward_scale, reward_type=a.reward_type)
    res = grpo_advantages(rewards=rewards, terminated=torch.from_numpy(traj["terminated"]),
                          truncated=torch.from_numpy(traj["truncated"]),
                          step_mask=torch.from_numpy(traj["step_mask"]), group_size=a.group_size,
                          filter_rewards=a.filter_rewards, rewards_lower_bound=a.rewards_lower_bound,
                          rewards_upper_bound=a.rewards_upper_bound)
    adv = res["advantages"]
    out = _passthrough(traj)
    out.update(advantages=adv.numpy(), returns=np.zeros_like(adv.numpy()), loss_mask=res["loss_mask"].numpy())
    out["stats"] = {"rollout/reward_mean": float(traj["rewards"].sum(-1).mean()),
                    "rollout/score_mean": float(res["scores"].mean()),
                    "rollout/advantage_mean": float(adv.mean()),
                    "rollout/groups_filtered": float(res["filtered"].float().mean())}
    return out


@dataclass
class Actor:
    """The trainer's resident state: policy, optimizer, weight version."""

    policy: torch.nn.Module
    optimizer: torch.optim.Optimizer
    version: int = 0

    def weights(self) -> dict:
        """Versioned weights for rollout replicas: {"version": int, "state_dict": CPU tensors} (copied off the
        actor's device, so replicas and checkpoints never hold references into it)."""
        return {"version": self.version,
                "state_dict": {k: v.detach().to("cpu", copy=True) for k, v in self.policy.state_dict().items()}}


def _build_actor(cfg: Config, obs_dim: int, action_dim: int, load: bool = True) -> Actor:
    """The actor on `policy.device` (tasks.device.policy_device), float32 master weights (bf16 is autocast)."""
    policy = make_policy(cfg.policy, obs_dim=obs_dim, action_dim=action_dim, num_values=num_values(cfg),
                         seed=cfg.seed, image_size=image_size(cfg), load=load)
    policy.to(policy_device(cfg))
    return Actor(policy, make_optimizer(cfg, policy))


def to_actor_device(data: dict[str, torch.Tensor], policy: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A flattened batch (`_flatten`) on the device of the policy's parameters (a no-op on the CPU)."""
    return to_device(data, next(policy.parameters()).device)


def make_optimizer(cfg: Config, policy: torch.nn.Module) -> torch.optim.Optimizer:
    """The actor's optimizer: Adam(lr=algorithm.lr, eps=1e-5) over `policy.parameters()` (after any sharding);
    with `algorithm.critic_lr` set, the value head's parameters (names starting with `value_head.`) form a second
    group with that learning rate (a fresh critic on a pretrained VLA needs a larger step than the policy)."""
    a = cfg.algorithm
    if a.critic_lr is None:
        return torch.optim.Adam(policy.parameters(), lr=a.lr, eps=1e-5)
    actor, critic = split_critic(policy)
    if not critic:
        raise ValueError(f"algorithm.critic_lr={a.critic_lr}: the {type(policy).__name__} has no value_head")
    return torch.optim.Adam([{"params": actor, "lr": a.lr}, {"params": critic, "lr": a.critic_lr}], eps=1e-5)


def split_critic(policy: torch.nn.Module) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    """(the policy's parameters outside the value head, the value head's: names starting with `value_head.`)."""
    named = list(policy.named_parameters())
    return ([p for n, p in named if not n.startswith("value_head.")],
            [p for n, p in named if n.startswith("value_head.")])


def actor_init(cfg: Config, run_id: str, dims: tuple[int, int], checkpoint: dict | None = None) -> dict:
    """Create the resident actor for env dims (obs_dim, action_dim): fresh (seeded by `cfg.seed`) or from a
    loaded checkpoint dict with keys `policy`, `optimizer`, `run.weight_version`; return its versioned weights."""
    torch.manual_seed(cfg.seed)
    actor = _build_actor(cfg, *dims, load=checkpoint is None)  # a checkpoint overrides policy.model_path
    if checkpoint is not None:
        actor.policy.load_state_dict(checkpoint["policy"])
        actor.optimizer.load_state_dict(checkpoint["optimizer"])
        actor.version = int(checkpoint["run"]["weight_version"])
        _restore_rng(checkpoint)
    resident.put(f"{run_id}/actor", actor)
    return actor.weights()


def actor_state(run_id: str) -> dict:
    """Policy and optimizer state of the resident actor, for a checkpoint (CPU tensors)."""
    actor: Actor = resident.get(f"{run_id}/actor")
    if actor is None:
        raise RuntimeError(f"no resident actor for run {run_id} on this worker")
    return {"policy": {k: v.detach().to("cpu", copy=True) for k, v in actor.policy.state_dict().items()},
            "optimizer": _cpu(actor.optimizer.state_dict()),
            "rng_torch": torch.get_rng_state(), "rng": _rng_state(), "weight_version": actor.version}


def _rng_state() -> dict:
    """This process's torch/numpy/python RNG states, checkpoint-loadable (storage.checkpoints.rng_state)."""
    from storage.checkpoints import rng_state
    return rng_state()


def _restore_rng(checkpoint: dict) -> None:
    """Continue the actor process's RNG streams where the checkpoint's process left them (exact resume: the
    actor's worker also draws the disaggregated policy_infer's exploration noise). Checkpoints from before
    `rng` was saved restore the torch state (`rng_torch`) only."""
    from storage.checkpoints import set_rng_state
    if checkpoint.get("rng") is not None:
        set_rng_state(checkpoint["rng"])
    elif checkpoint.get("rng_torch") is not None:
        torch.set_rng_state(checkpoint["rng_torch"])


def _cpu(obj):
    """A nested state (dicts / lists of tensors) with every tensor copied to the CPU."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cpu(v) for v in obj)
    return obj


def actor_export(run_id: str, checkpoint_path: str) -> str | None:
    """Write the resident actor's policy in the `save_pretrained` layout to `<checkpoint_path>/hf` (policies that
    have one: the VLAs); the directory `policy.model_path` takes. Written to a tmp dir, then renamed."""
    import os
    import shutil
    actor: Actor = resident.get(f"{run_id}/actor")
    if actor is None or not hasattr(actor.policy, "save_pretrained"):
        return None
    final, tmp = os.path.join(checkpoint_path, "hf"), os.path.join(checkpoint_path, ".hf.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    actor.policy.save_pretrained(tmp)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    return final


def _flatten(samples: list[dict]) -> dict[str, torch.Tensor]:
    """Concatenate shards along B, then [T, B, ...] -> [T*B, ...] (SAMPLE_FIELDS, rgb, extras/*)."""
    out = {}
    for k in [k for k in samples[0] if k in SAMPLE_FIELDS or k == "rgb" or k.startswith("extras/")]:
        x = np.concatenate([s[k] for s in samples], axis=1)  # [T, B_total, ...]
        out[k] = torch.from_numpy(x.reshape(-1, *x.shape[2:]))  # [T, B, ...] -> [N, ...]
    return out


def batch_obs(policy: torch.nn.Module, data: dict[str, torch.Tensor], idx: torch.Tensor, instr: str) -> dict:
    """The policy's observation dict for samples `idx` of a flattened batch (state, rgb, prompt), on the batch's
    device (the cached prompt tokens live on the CPU)."""
    obs = policy_obs(policy, data["obs"][idx], data["rgb"][idx] if "rgb" in data else None, instr)
    return to_device(obs, data["obs"].device)


def batch_extras(data: dict[str, torch.Tensor], idx: torch.Tensor) -> dict[str, torch.Tensor]:
    return {k.split("/", 1)[1]: v[idx] for k, v in data.items() if k.startswith("extras/")}


LOSS_METRICS = ("actor_loss", "critic_loss", "entropy", "approx_kl", "clipfrac", "ratio_mean", "explained_variance",
                "loss")


def prepare_update(cfg: Config, data: dict[str, torch.Tensor]) -> dict[str, torch.Tensor | bool]:
    """Per-sample tensors of the PPO loss for a flattened batch (`_flatten`), computed once per update.

    Returns `step_mask` [N, C] bool (GRPO masks steps after the first done), `old_lp` (old log-probs reduced to
    `logprob_type`: [N], [N, C] or [N, C, D]), `lp_mask` (same shape, bool), `adv` (normalised over the whole batch
    unless GRPO, expanded to the log-prob shape), `returns` and `old_values` ([N] or [N, C]), `v_mask` (same shape,
    bool) and `critic` (False for GRPO).
    """
    a, C = cfg.algorithm, cfg.policy.num_action_chunks
    D = data["actions"].shape[-1]
    step_mask = data["step_mask"] & data["loss_mask"][:, None]  # [N, C]; GRPO masks steps after the first done
    old_lp = reduce_logprobs(data["logprobs"], step_mask=step_mask, logprob_type=a.logprob_type)
    lp_mask = loss_mask_for(step_mask, logprob_type=a.logprob_type, action_dim=D)
    adv = data["advantages"]  # [N] or [N, C]
    adv_mask = step_mask.any(-1) if adv.dim() == 1 else step_mask
    if a.normalize_advantages and a.adv_type != "grpo":  # global normalisation (GRPO's are already normalised per group)
        adv = normalize_advantages(adv, adv_mask)
    adv = expand_advantages(adv, logprob_type=a.logprob_type, num_action_chunks=C, action_dim=D)
    old_values = data["values"] if num_values(cfg) > 1 else data["values"][:, 0]  # [N, V] -> [N] or [N, C]
    return {"step_mask": step_mask, "old_lp": old_lp, "lp_mask": lp_mask, "adv": adv, "returns": data["returns"],
            "old_values": old_values, "v_mask": adv_mask, "critic": a.adv_type != "grpo"}


def minibatch_loss(cfg: Config, policy: torch.nn.Module, data: dict[str, torch.Tensor], prep: dict,
                   idx: torch.Tensor, instr: str) -> dict[str, torch.Tensor]:
    """PPO loss terms on samples `idx` (int64 [n]) of a flattened batch: one forward of `policy.evaluate`.

    With `prep["prox_lp"]` set (a stale rollout, `proximal_logprobs`), the decoupled PPO loss: ratio against the
    proximal log-probs, weighted by proximal / behaviour (`tasks.algorithms.decoupled_ppo_actor_loss`).

    Returns 0-d tensors: `actor_loss`, `critic_loss` (0 without a critic), `entropy` (differentiable token-means
    over `lp_mask[idx]` / `v_mask[idx]`), `loss` = actor_loss + value_coef * critic_loss - entropy_coef * entropy
    (differentiable), and the metrics `approx_kl`, `clipfrac`, `ratio_mean` (token-means over `lp_mask[idx]`),
    `explained_variance`.
    """
    a = cfg.algorithm
    step_mask, lp_mask = prep["step_mask"], prep["lp_mask"]
    out = policy.evaluate(batch_obs(policy, data, idx, instr), data["actions"][idx], batch_extras(data, idx))
    new_lp = reduce_logprobs(out["logprobs"], step_mask=step_mask[idx], logprob_type=a.logprob_type)
    if prep.get("prox_lp") is None:  # on-policy: proximal = behaviour log-probs, plain PPO
        pl = ppo_actor_loss(logprobs=new_lp, old_logprobs=prep["old_lp"][idx], advantages=prep["adv"][idx],
                            loss_mask=lp_mask[idx], clip_ratio_low=a.clip_ratio_low,
                            clip_ratio_high=a.clip_ratio_high, dual_clip=a.dual_clip)
    else:  # a stale rollout (runner.max_staleness > 0): decoupled PPO around the update's starting weights
        pl = decoupled_ppo_actor_loss(logprobs=new_lp, proximal_logprobs=prep["prox_lp"][idx],
                                      behaviour_logprobs=prep["old_lp"][idx], advantages=prep["adv"][idx],
                                      loss_mask=lp_mask[idx], clip_ratio_low=a.clip_ratio_low,
                                      clip_ratio_high=a.clip_ratio_high, dual_clip=a.dual_clip)
    vl = critic_loss(values=out["values"], returns=prep["returns"][idx], loss_mask=prep["v_mask"][idx],
                     value_clip=a.value_clip, old_values=prep["old_values"][idx]) if prep["critic"] else \
        {"loss": torch.zeros(()), "explained_variance": torch.zeros(())}
    ent = entropy_bonus(reduce_logprobs(out["entropy"], step_mask=step_mask[idx],
                                        logprob_type=a.logprob_type), lp_mask[idx])
    if prep.get("critic_only"):  # critic warm-up: the policy is not updated yet
        loss = a.value_coef * vl["loss"]
    else:
        loss = pl["loss"] + a.value_coef * vl["loss"] - a.entropy_coef * ent
    return {"actor_loss": pl["loss"], "critic_loss": vl["loss"], "entropy": ent, "approx_kl": pl["approx_kl"],
            "clipfrac": pl["clipfrac"], "ratio_mean": pl["ratio_mean"],
            "explained_variance": vl["explained_variance"], "loss": loss}


def proximal_logprobs(cfg: Config, policy: torch.nn.Module, data: dict[str, torch.Tensor], prep: dict,
                      instr: str) -> torch.Tensor:
    """Log-probs of the batch's actions under `policy` as it is now (before the update's first minibatch),
    reduced like `prep["old_lp"]` (same shape); no grad, in minibatch-sized chunks, in the policy's current mode.
    These are decoupled PPO's proximal log-probs (the trust region's centre) for a rollout made with older weights."""
    N = data["actions"].shape[0]
    chunk = max(1, N // cfg.algorithm.num_minibatches)
    parts = []
    dev = data["obs"].device
    with torch.no_grad(), autocast(cfg.policy.dtype, dev):
        for start in range(0, N, chunk):
            idx = torch.arange(start, min(N, start + chunk))
            out = policy.evaluate(batch_obs(policy, data, idx, instr), data["actions"][idx], batch_extras(data, idx))
            parts.append(reduce_logprobs(out["logprobs"], step_mask=prep["step_mask"][idx],
                                         logprob_type=cfg.algorithm.logprob_type))
    return torch.cat(parts)


def behaviour_version(weights: dict, samples: tuple[dict, ...]) -> int:
    """The oldest weight version the samples were rolled out with (`weights`' version when they do not say)."""
    return min(int(s.get("weight_version", weights["version"])) for s in samples)


def actor_update(cfg: Config, run_id: str, weights: dict, *samples: dict) -> dict:
    """PPO update on the samples of every shard; returns new versioned weights and metrics.

    `weights` are the actor's current weights (version v): the rollout's own with synchronous steps, the previous
    update's output with `runner.max_staleness` > 0. If the resident actor is missing (a fresh worker after a
    loss), it is rebuilt from them with a fresh optimizer and `train/actor_rebuilt` = 1 is reported.

    When the samples were rolled out with an older version than v (their `weight_version`), the proximal
    log-probs are recomputed under the current weights before the first minibatch and the decoupled PPO loss is
    used; otherwise proximal = behaviour and the loss is plain PPO (bit-identical to synchronous steps).
    Logged: `train/behaviour_logprob_mean`, `train/proximal_logprob_mean` (masked means).
    """
    t0 = time.perf_counter()
    a = cfg.algorithm
    data = _flatten(samples)
    N, D = data["actions"].shape[0], data["actions"].shape[-1]
    rebuilt = 0.0

    def rebuild() -> Actor:
        actor = _build_actor(cfg, data["obs"].shape[-1], D, load=False)
        actor.policy.load_state_dict(weights["state_dict"])
        actor.version = weights["version"]
        return actor

    actor, created = resident.get_or_create(f"{run_id}/actor", rebuild)
    if created:
        rebuilt = 1.0
    data = to_actor_device(data, actor.policy)
    prep = prepare_update(cfg, data)
    # critic warm-up (PPO): the first `critic_warmup_steps` updates train the value head only
    prep["critic_only"] = prep["critic"] and weights["version"] < cfg.algorithm.critic_warmup_steps
    instr = instruction(cfg)
    policy, opt = actor.policy, actor.optimizer
    policy.train()
    if behaviour_version(weights, samples) < int(weights["version"]):
        prep["prox_lp"] = proximal_logprobs(cfg, policy, data, prep, instr)
    lp_stats = {"train/behaviour_logprob_mean": float(masked_mean(prep["old_lp"], prep["lp_mask"])),
                "train/proximal_logprob_mean": float(masked_mean(
                    prep["old_lp"] if prep.get("prox_lp") is None else prep["prox_lp"], prep["lp_mask"]))}
    mb = N // a.num_minibatches
    sums: dict[str, float] = {}
    count, epochs_run, stop = 0, 0, False
    for _ in range(a.update_epochs):
        perm = torch.randperm(N)
        for i in range(a.num_minibatches):
            idx = perm[i * mb:(i + 1) * mb]
            with autocast(cfg.policy.dtype, data["obs"].device):
                terms = minibatch_loss(cfg, policy, data, prep, idx, instr)
            loss = terms["loss"]
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gn = torch.nn.utils.clip_grad_norm_(policy.parameters(), a.max_grad_norm)
            opt.step()
            count += 1
            for k, v in [*((k, terms[k]) for k in LOSS_METRICS), ("grad_norm", gn)]:
                sums[k] = sums.get(k, 0.0) + float(torch.as_tensor(v).detach())
            if a.target_kl is not None and float(terms["approx_kl"]) > a.target_kl:
                stop = True
                break
        epochs_run += 1
        if stop:
            break
    policy.eval()
    actor.version = weights["version"] + 1
    metrics = {f"train/{k}": v / max(count, 1) for k, v in sums.items()}
    metrics.update({"train/epochs_run": float(epochs_run), "train/minibatch_updates": float(count),
                    "train/lr": opt.param_groups[0]["lr"], "train/actor_rebuilt": rebuilt,
                    "train/weight_version": float(actor.version), "time/update": time.perf_counter() - t0,
                    **lp_stats})
    out = actor.weights()
    out["metrics"] = metrics
    return out
