"""The actor resident on its worker (`Actor`: policy, optimizer, weight version) and its exponential moving average
of the weights (`algorithm.ema_decay` > 0: what evals play and exports write).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tasks import resident, seeding
from tasks.actor.optim import make_optimizer
from tasks.config import Config
from tasks.device import policy_device
from tasks.policies import make_policy
from tasks.rollout import image_size, num_values


EMA_VERSION = "ema:{}"  # the version of the averaged weights of weight version v (a replica reloads on a change)


@dataclass
class Actor:
    """The trainer's resident state: policy, optimizer, weight version, and with `algorithm.ema_decay` > 0 the
    exponential moving average of the policy's state dict (`ema`: CPU float32 copies, key for key)."""

    policy: torch.nn.Module
    optimizer: torch.optim.Optimizer
    version: int = 0
    ema: dict | None = None
    base_key: str | None = None  # Dask key of the run's initial full weights (tasks.weights' partial weights)

    def weights(self) -> dict:
        """Versioned weights for rollout replicas: {"version": int, "state_dict": CPU tensors} (copied off the
        actor's device, so replicas and checkpoints never hold references into it)."""
        return {"version": self.version,
                "state_dict": {k: v.detach().to("cpu", copy=True) for k, v in self.policy.state_dict().items()}}

    def sync_weights(self) -> dict:
        """What an update hands the rollout replicas: partial weights (tasks.weights.partial: the trainable tensors
        on top of the full weights under `base_key`) when the policy ships only part of its state (its
        `sync_state()` capability returns a dict: frozen parameters) and the base's key is known; else `weights()`."""
        sync_state = getattr(self.policy, "sync_state", None)
        part = sync_state() if sync_state is not None and self.base_key is not None else None
        if part is None:
            return self.weights()
        from tasks.weights import partial
        return partial(self.version, part, self.base_key)

    def eval_weights(self) -> dict:
        """The weights evals and exports use: the average {"version": "ema:<v>", "state_dict": copies} when kept
        (its own version, so a replica that held the trained weights of v reloads, and back), else `weights()`."""
        if self.ema is None:
            return self.weights()
        return {"version": EMA_VERSION.format(self.version),
                "state_dict": {k: v.clone() for k, v in self.ema.items()}}


def ema_start(cfg: Config, actor: Actor, saved: dict | None = None) -> None:
    """Start the actor's average (`algorithm.ema_decay` > 0; else none): from `saved` (a checkpoint's
    `policy_ema`), else from the policy's current weights (the run's initial weights, or those a lost actor is
    rebuilt from)."""
    if not cfg.algorithm.ema_decay:
        actor.ema = None
        return
    src = saved if saved is not None else actor.policy.state_dict()
    actor.ema = {k: v.detach().to("cpu", copy=True) for k, v in src.items()}


@torch.no_grad()
def ema_update_(ema: dict, state: dict, decay: float) -> dict:
    """In place, key for key: ema <- decay * ema + (1 - decay) * state for floating-point entries (buffers
    included), a copy for the others (step counters); `state` is moved to `ema`'s device and dtype. Computed as
    a lerp, so an entry equal in both (a frozen parameter) stays bit for bit. Returns `ema`.
    Polyak averaging as an exponential moving average (openpi's `ema_decay`)."""
    for k, v in state.items():
        e = ema[k]
        v = v.detach().to(e.device)
        if e.is_floating_point():
            e.lerp_(v.to(e.dtype), 1.0 - decay)
        else:
            e.copy_(v)
    return ema


def ema_step(actor: Actor, decay: float) -> None:
    """One step of the actor's average after an update (`ema_update_` with the policy's state dict; the average
    lives on CPU in the policy's dtypes whatever the actor's device). No-op without one."""
    if actor.ema is not None:
        ema_update_(actor.ema, actor.policy.state_dict(), decay)


def build_actor(cfg: Config, obs_dim: int, action_dim: int, load: bool = True) -> Actor:
    """The actor on `policy.device` (tasks.device.policy_device), float32 master weights (bf16 is autocast)."""
    policy = make_policy(cfg.policy, obs_dim=obs_dim, action_dim=action_dim, num_values=num_values(cfg),
                         seed=seeding.model_init_seed(cfg.seed), image_size=image_size(cfg), load=load)
    policy.to(policy_device(cfg))
    return Actor(policy, make_optimizer(cfg, policy))


class ActorMissing(RuntimeError):
    """The run's actor is not resident on the worker asked for it (that worker process was restarted since the
    actor was built or restored there: its weights and optimizer state are gone)."""


def resident_actor(run_id: str) -> Actor:
    """The run's actor resident on this worker.

    Raises ActorMissing when this worker holds none (the worker process was restarted since)."""
    actor = resident.get(f"{run_id}/actor")
    if actor is None:
        raise ActorMissing(f"no resident actor for run {run_id} on this worker")
    return actor
