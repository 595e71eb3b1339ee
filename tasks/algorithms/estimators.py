"""Advantage estimators as registry objects: `algorithm.name` selects one, callers ask it, never the name.

An estimator is a class registered with ``@register_estimator(name)`` (verl's ``@register_adv_est`` style). Its
``spec`` (``tasks.algorithms.specs.EstimatorSpec``, declared in ``tasks.algorithms.specs.ESTIMATORS`` under the same
name: plain data beside this module, which the offline checks of tasks.config read) says what it needs and how it
normalises:

=======  ======  ======  ==============  =============  =====================================================
name     critic  groups  whole episodes  normalisation  advantages
=======  ======  ======  ==============  =============  =====================================================
ppo      yes     no      no              batch          GAE per env (``tasks.algorithms.advantages.gae``)
grpo     no      yes     yes             group          group-relative scores (``tasks.algorithms.grpo``)
rloo     no      yes     yes             batch          score - leave-one-out group mean (``tasks.algorithms.rloo``)
=======  ======  ======  ==============  =============  =====================================================

* critic: the update trains a value function; the estimator reads ``values`` / ``final_values`` /
  ``bootstrap_values`` (so the update checks them for non-finite values) and returns value targets (``returns``).
* groups: envs ``[k*g, (k+1)*g)`` (g = ``algorithm.group_size``) share every reset seed (``tasks.rollout.group_size``)
  and are scored against each other; groups never straddle env shards or pipeline stages (offline checks).
* whole episodes: the estimator scores each env's first episode from the rollout's first chunk step, so rollouts
  must start episodes (``tasks.config.check_whole_episodes``).
* normalisation: ``batch`` = the update normalises the advantages over its whole batch when
  ``algorithm.normalize_advantages`` (``tasks.actor.loop.prepare_update``); ``group`` = already normalised per group
  inside the estimator.

One signature for every estimator, on one env shard's rollout (groups never straddle shards)::

    est.advantages(*, traj, algorithm, num_action_chunks, bad_steps, bad_inputs) -> dict

    traj: the rollout fields as numpy arrays (tasks.rollout.trajectory): rewards [T, B, C] float, terminated /
        truncated [T, B] bool, step_mask [T, B, C] bool; with a critic also values [T, B, V], final_values
        [T, B, V], bootstrap_values [B, V] (V = C for action-level rewards, else 1). Non-finite entries already
        replaced by 0 where ``bad_inputs`` marks them.
    algorithm: tasks.config.AlgorithmConfig (validated).
    num_action_chunks: C.
    bad_steps: [T, B] bool, chunk steps whose obs / actions / log-probs / values / extras were non-finite
        (algorithm.nonfinite=mask; all False otherwise): they leave the loss.
    bad_inputs: {field: [T, B] bool ([B] for bootstrap_values)}: where each field held a non-finite value (mask
        mode; empty when everything is finite).

    returns {"advantages": [T, B] (chunk-level rewards) or [T, B, C] (action-level) float32,
             "returns": same shape (value targets; zeros without a critic),
             "loss_mask": [T, B] bool, the chunk steps that enter the loss,
             "dropped": [T, B] bool, chunk steps it left out of the loss because of non-finite inputs,
             "stats": {metric name: float} for logging}

An unknown or duplicate name is a ValueError listing the known names, as is a name without a spec in
``tasks.algorithms.specs.ESTIMATORS``.
"""

from __future__ import annotations

import numpy as np
import torch

from tasks.algorithms.advantages import from_action_level, gae, to_action_level
from tasks.algorithms.granularity import aggregate_rewards
from tasks.algorithms.grpo import grpo_advantages
from tasks.algorithms.rloo import rloo_advantages
from tasks.algorithms.specs import ESTIMATORS as SPECS
from tasks.algorithms.specs import EstimatorSpec
from tasks.config import AlgorithmConfig

__all__ = ["Estimator", "register_estimator", "get_estimator", "estimator_names", "GAEEstimator", "GRPOEstimator",
           "RLOOEstimator"]


class Estimator:
    """Base of the registered estimators: ``spec`` is set by ``register_estimator``; subclasses implement
    ``advantages`` with the module's one signature."""

    spec: EstimatorSpec

    @property
    def name(self) -> str:
        return self.spec.name

    def advantages(self, *, traj: dict, algorithm: AlgorithmConfig, num_action_chunks: int, bad_steps: np.ndarray,
                   bad_inputs: dict[str, np.ndarray]) -> dict:
        raise NotImplementedError


_ESTIMATORS: dict[str, Estimator] = {}


def register_estimator(name: str):
    """Class decorator: register an instance of the decorated ``Estimator`` subclass under ``name``, with the spec
    ``tasks.algorithms.specs.ESTIMATORS[name]``.

    Raises:
        ValueError: ``name`` is already registered, or has no spec in tasks.algorithms.specs.ESTIMATORS (both list
            the known names).
    """

    def decorator(cls: type[Estimator]) -> type[Estimator]:
        if name in _ESTIMATORS:
            raise ValueError(f"advantage estimator {name!r} is already registered; known: {sorted(_ESTIMATORS)}; "
                             f"pick another name")
        if name not in SPECS:
            raise ValueError(f"advantage estimator {name!r} has no EstimatorSpec in tasks.algorithms.specs.ESTIMATORS "
                             f"(known: {sorted(SPECS)}); declare what it needs and how it normalises there first")
        cls.spec = SPECS[name]
        _ESTIMATORS[name] = cls()
        return cls

    return decorator


def get_estimator(name: str) -> Estimator:
    """The estimator registered as ``name`` (= algorithm.name). ValueError listing the known names if unknown."""
    try:
        return _ESTIMATORS[name]
    except KeyError:
        raise ValueError(f"unknown advantage estimator {name!r}; known: {sorted(_ESTIMATORS)}") from None


def estimator_names() -> list[str]:
    """Sorted names of the registered estimators."""
    return sorted(_ESTIMATORS)


@register_estimator("ppo")
class GAEEstimator(Estimator):
    """GAE per env (``gae``) on chunk-level rewards, or on the per-action time axis (``to_action_level``) for
    action-level rewards. Mask mode: the bad inputs are set to NaN so that exactly the advantages / returns they
    make undefined (every earlier step of the same episode, never across a done) come out non-finite; those chunk
    steps and ``bad_steps`` leave the loss, and their advantages / returns are set to 0."""

    def advantages(self, *, traj, algorithm, num_action_chunks, bad_steps, bad_inputs):
        a, found = algorithm, bad_inputs
        t = {k: torch.from_numpy(np.asarray(traj[k])) for k in ("rewards", "values", "final_values",
                                                                 "terminated", "truncated", "step_mask")}
        boot = torch.from_numpy(traj["bootstrap_values"])  # [B, V]
        values = torch.cat([t["values"], boot[None]])  # [T, B, V] + [1, B, V] -> [T+1, B, V]
        raw = {k: torch.from_numpy(np.asarray(v)) for k, v in found.items()}  # (mask mode) where inputs were bad
        gae_rewards = t["rewards"]
        if "rewards" in found or "values" in found or "final_values" in found or "bootstrap_values" in found:
            # GAE on NaN at the bad inputs, so that exactly the advantages they make undefined come out non-finite
            nan = torch.tensor(float("nan"))
            if "rewards" in raw:
                gae_rewards = torch.where(raw["rewards"].unsqueeze(-1) & t["step_mask"], nan, gae_rewards)
            if "values" in raw:
                values[:-1] = torch.where(raw["values"].unsqueeze(-1), nan, values[:-1])
            if "final_values" in raw:
                t["final_values"] = torch.where(raw["final_values"].unsqueeze(-1), nan, t["final_values"])
            if "bootstrap_values" in raw:
                values[-1] = torch.where(raw["bootstrap_values"].unsqueeze(-1), nan, values[-1])
        # rewards of actions that were not executed are never read (0 there)
        step_rewards = torch.where(t["step_mask"], gae_rewards, torch.zeros_like(gae_rewards))
        rewards = aggregate_rewards(step_rewards * a.reward_scale, reward_type=a.reward_type)
        if a.reward_type == "chunk_level":  # [T, B] rewards, [T+1, B, 1] -> [T+1, B] values
            adv, ret = gae(rewards=rewards, values=values[..., 0], terminated=t["terminated"],
                           truncated=t["truncated"], final_values=t["final_values"][..., 0], gamma=a.gamma,
                           lam=a.gae_lambda)
        else:  # per-action time axis [T*C, B], back to [T, B, C]
            # V(final_obs) bootstraps the episode's last executed action: the value at position 0 of the next state
            flat = to_action_level(rewards=rewards, values=values, terminated=t["terminated"],
                                   truncated=t["truncated"], final_values=t["final_values"][..., 0],
                                   step_mask=t["step_mask"])
            adv, ret = gae(**flat, gamma=a.gamma, lam=a.gae_lambda)
            C = num_action_chunks
            adv, ret = from_action_level(adv, num_action_chunks=C), from_action_level(ret, num_action_chunks=C)
        loss_mask = traj["step_mask"].any(-1)  # [T, B]
        dropped = np.zeros_like(loss_mask)
        if found:  # mask mode: the chunk steps with bad inputs or an undefined advantage / return leave the loss
            undefined = ~(torch.isfinite(adv) & torch.isfinite(ret))
            undefined = undefined.reshape(*undefined.shape[:2], -1).any(-1).numpy()  # [T, B]
            dropped = loss_mask & (bad_steps | undefined)
            loss_mask = loss_mask & ~dropped
            adv = torch.where(torch.isfinite(adv), adv, torch.zeros_like(adv))
            ret = torch.where(torch.isfinite(ret), ret, torch.zeros_like(ret))
        stats = {"rollout/reward_mean": float(t["rewards"].sum(-1).mean()),
                 "rollout/value_mean": float(t["values"].mean()),
                 "rollout/advantage_mean": float(adv.mean()), "rollout/return_mean": float(ret.mean())}
        return {"advantages": adv.numpy(), "returns": ret.numpy(), "loss_mask": loss_mask, "dropped": dropped,
                "stats": stats}


class _GroupEstimator(Estimator):
    """Critic-free estimators that score each env's first episode against its group (``_group`` gives the
    advantages); ``returns`` are zeros (no critic is trained). Mask mode: an env whose scored episode holds a
    non-finite reward leaves its group (``env_mask``); ``bad_steps`` leave the loss."""

    def _group(self, a: AlgorithmConfig, *, rewards: torch.Tensor, traj: dict, env_mask: torch.Tensor) -> dict:
        """{"advantages": tensor, "loss_mask": [T, B] bool tensor, "stats": {...}} of the group math."""
        raise NotImplementedError

    def advantages(self, *, traj, algorithm, num_action_chunks, bad_steps, bad_inputs):
        a, found = algorithm, bad_inputs
        done = traj["terminated"] | traj["truncated"]  # [T, B]
        first_episode = (np.cumsum(done, 0) - done) == 0  # [T, B] up to and including the first done
        bad_env = (found["rewards"] & first_episode).any(0) if "rewards" in found else np.zeros(done.shape[1], bool)
        rewards = aggregate_rewards(torch.from_numpy(traj["rewards"]) * a.reward_scale, reward_type=a.reward_type)
        res = self._group(a, rewards=rewards, traj=traj, env_mask=torch.from_numpy(~bad_env))
        adv, loss_mask = res["advantages"], res["loss_mask"].numpy()
        in_loss = first_episode & traj["step_mask"].any(-1)  # [T, B] trained on without non-finite values
        dropped = in_loss & (bad_env[None] | bad_steps)
        if bad_steps.any():
            loss_mask = loss_mask & ~bad_steps
            zero = torch.from_numpy(bad_steps).view(*bad_steps.shape, *([1] * (adv.dim() - 2)))
            adv = torch.where(zero, torch.zeros_like(adv), adv)
        stats = {"rollout/reward_mean": float(traj["rewards"].sum(-1).mean()),
                 "rollout/score_mean": res["stats"]["rollout/score_mean"],
                 "rollout/advantage_mean": float(adv.mean()),
                 **{k: v for k, v in res["stats"].items() if k != "rollout/score_mean"}}
        return {"advantages": adv.numpy(), "returns": np.zeros_like(adv.numpy()), "loss_mask": loss_mask,
                "dropped": dropped, "stats": stats}


def _group_inputs(traj: dict) -> dict:
    return {"terminated": torch.from_numpy(traj["terminated"]), "truncated": torch.from_numpy(traj["truncated"]),
            "step_mask": torch.from_numpy(traj["step_mask"])}


@register_estimator("grpo")
class GRPOEstimator(_GroupEstimator):
    """GRPO (``grpo_advantages``): group-relative episode scores, (score - group mean) / (group std + eps),
    broadcast over each env's first episode in the rollout; ``algorithm.filter_rewards`` masks groups."""

    def _group(self, a, *, rewards, traj, env_mask):
        res = grpo_advantages(rewards=rewards, **_group_inputs(traj), group_size=a.group_size,
                              filter_rewards=a.filter_rewards, rewards_lower_bound=a.rewards_lower_bound,
                              rewards_upper_bound=a.rewards_upper_bound, env_mask=env_mask)
        return {"advantages": res["advantages"], "loss_mask": res["loss_mask"],
                "stats": {"rollout/score_mean": float(res["scores"].mean()),
                          "rollout/groups_filtered": float(res["filtered"].float().mean())}}


@register_estimator("rloo")
class RLOOEstimator(_GroupEstimator):
    """RLOO (``rloo_advantages``): the episode score minus the mean score of the other members of its group,
    broadcast over each env's first episode in the rollout; normalised over the batch by the update."""

    def _group(self, a, *, rewards, traj, env_mask):
        res = rloo_advantages(rewards=rewards, **_group_inputs(traj), group_size=a.group_size, env_mask=env_mask)
        return {"advantages": res["advantages"], "loss_mask": res["loss_mask"],
                "stats": {"rollout/score_mean": float(res["scores"].mean())}}
