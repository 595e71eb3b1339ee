"""Gaussian MLP actor-critic for state observations (ManiSkill's PPO baseline architecture).

Actor: obs [B, O] -> tanh MLP -> mean [B, C*D]; a state-independent learned log-std [C*D] (init
`init_logstd`). Critic: a separate tanh MLP obs -> [B, V] with V = 1 (chunk-level values) or C (action-level
values, one per action position of the chunk, as RLinf's action-level value heads). Orthogonal init with gain
sqrt(2), the actor's last layer 0.01*sqrt(2), the critic's last layer 1 (cleanrl / ManiSkill `ppo.py`).

Actions are unbounded Gaussian samples; the env shard clips them to [-1, 1]. Log-probs are of the unclipped
sample, per dimension: [B, C, D] float32 (the granularity reduction happens in tasks.algorithms.granularity).

Export (`save_pretrained` / `from_pretrained`, the directory `policy.model_path` takes; written at every checkpoint
as `checkpoints/global_step_N/hf` by tasks.actor.export): `config.json` ({"family": "mlp", "policy": the MLPConfig
fields, "obs_dim" O, "action_dim" D, "num_values" V, "image_size": null, "obs_normalization": null, "actions":
{"distribution", "clip"}}) and `model.safetensors` (the state dict: actor_mean, critic, actor_logstd [C*D]). The
policy reads the raw state vector (no observation statistics to carry) and its actions need no un-scaling: the
mean and the learned log-std in the weights are all it needs to act; "obs_normalization" and "actions" record that
for a reader of the directory.
"""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributions import Normal

from tasks.algorithms.losses import masked_mean
from tasks.config import PolicyConfig

ACTIVATIONS = {"tanh": nn.Tanh, "relu": nn.ReLU, "gelu": nn.GELU}
CONFIG_NAME, WEIGHTS_NAME = "config.json", "model.safetensors"  # the transformers layout, as the VLAs' exports
ACTION_CLIP = (-1.0, 1.0)  # the env shard clips every executed action to this box (tasks.envs.shard.EnvShard)


def _mlp(sizes: list[int], act: type[nn.Module], last_gain: float) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        lin = nn.Linear(a, b)
        last = i == len(sizes) - 2
        nn.init.orthogonal_(lin.weight, last_gain if last else math.sqrt(2))
        nn.init.zeros_(lin.bias)
        layers += [lin] if last else [lin, act()]
    return nn.Sequential(*layers)


class MLPPolicy(nn.Module):
    """Gaussian MLP actor-critic.

    Args:
        cfg: policy config (hidden_sizes, activation, init_logstd, num_action_chunks C).
        obs_dim: O. action_dim: D. num_values: 1 (chunk-level values) or C (action-level values).

    Raises:
        ValueError: unknown activation.
    """

    def __init__(self, cfg: PolicyConfig, obs_dim: int, action_dim: int, num_values: int = 1):
        super().__init__()
        if cfg.activation not in ACTIVATIONS:
            raise ValueError(f"policy.activation={cfg.activation!r}: use one of {sorted(ACTIVATIONS)}")
        act = ACTIVATIONS[cfg.activation]
        self.cfg, self.obs_dim = cfg, obs_dim
        self.C, self.D, self.num_values = cfg.num_action_chunks, action_dim, num_values
        self.actor_mean = _mlp([obs_dim, *cfg.hidden_sizes, self.C * self.D], act, 0.01 * math.sqrt(2))
        self.critic = _mlp([obs_dim, *cfg.hidden_sizes, num_values], act, 1.0)
        self.actor_logstd = nn.Parameter(torch.full((self.C * self.D,), float(cfg.init_logstd)))

    def _dist(self, obs: torch.Tensor) -> Normal:
        mean = self.actor_mean(obs).view(-1, self.C, self.D)  # [B, C*D] -> [B, C, D]
        std = self.actor_logstd.exp().view(self.C, self.D).expand_as(mean)
        return Normal(mean, std)

    needs_prompt = False

    def values(self, obs: dict[str, torch.Tensor]) -> torch.Tensor:
        """obs {"state": [B, O]} -> values [B] (num_values=1) or [B, C]."""
        v = self.critic(obs["state"])
        return v.squeeze(-1) if self.num_values == 1 else v

    @torch.no_grad()
    def act(self, obs: dict[str, torch.Tensor], deterministic: bool = False) -> dict[str, torch.Tensor]:
        """Sample an action chunk.

        Args:
            obs: {"state": float32 [B, O]} (other keys are ignored).
            deterministic: return the mean (eval); log-probs are then those of the mean.

        Returns:
            actions [B, C, D], logprobs [B, C, D], values [B] or [B, C] (all float32), extras {} (none needed).
        """
        dist = self._dist(obs["state"])
        actions = dist.mean if deterministic else dist.sample()
        return {"actions": actions, "logprobs": dist.log_prob(actions), "values": self.values(obs), "extras": {}}

    def evaluate(self, obs: dict[str, torch.Tensor], actions: torch.Tensor,
                 extras: dict | None = None) -> dict[str, torch.Tensor]:
        """Recompute under the current parameters (differentiable).

        Args:
            obs: {"state": float32 [N, O]}; actions: float32 [N, C, D] (unclipped samples from `act`).

        Returns:
            logprobs [N, C, D], entropy [N, C, D], values [N] or [N, C].
        """
        dist = self._dist(obs["state"])
        return {"logprobs": dist.log_prob(actions), "entropy": dist.entropy(), "values": self.values(obs)}

    def sft_loss(self, obs: dict[str, torch.Tensor], actions: torch.Tensor,
                 mask: torch.Tensor | None = None) -> torch.Tensor:
        """Behaviour cloning: negative log-likelihood of demonstrated actions [N, C, D], summed over the chunk's
        actions (with `mask` [N, C] bool: the set ones) and averaged over the samples (with a mask: those with one
        set; 0 if none) (scalar)."""
        lp = self._dist(obs["state"]).log_prob(actions)  # [N, C, D]
        if mask is None:
            return -lp.sum((-2, -1)).mean()
        return masked_mean(torch.where(mask, -lp.sum(-1), 0.0).sum(-1), mask.any(-1))

    # ------------------------------------------------------------------------------------------- export
    def checkpoint_config(self) -> dict:
        """The export's config.json: the family, its config (`dataclasses.asdict`), the lengths the weights were
        built for and what acting needs besides the weights (module docstring)."""
        return {"family": "mlp", "policy": dataclasses.asdict(self.cfg), "obs_dim": self.obs_dim,
                "action_dim": self.D, "num_values": self.num_values, "image_size": None,
                "obs_normalization": None,  # the raw state vector is the input: no statistics
                "actions": {"distribution": "gaussian: mean of actor_mean, state-independent std exp(actor_logstd)",
                            "clip": list(ACTION_CLIP)}}

    def save_pretrained(self, path: str | Path) -> None:
        """Write config.json (`checkpoint_config`) and model.safetensors (the state dict, float32 as trained)
        into directory `path` (created)."""
        from safetensors.torch import save_model
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        (path / CONFIG_NAME).write_text(json.dumps(self.checkpoint_config(), indent=2, sort_keys=True))
        save_model(self, str(path / WEIGHTS_NAME))

    @classmethod
    def from_pretrained(cls, path: str | Path, **policy_overrides: Any) -> "MLPPolicy":
        """Rebuild the policy saved in the local directory `path` by `save_pretrained`, weights restored exactly
        (strict load). `policy_overrides` replace MLPConfig fields that do not change the weights' shapes.

        Raises:
            FileNotFoundError: no config.json or model.safetensors in `path`.
            ValueError: the directory holds another family's checkpoint, or weights of other shapes.
        """
        from safetensors.torch import load_model

        from tasks.config import family_class
        path = Path(path)
        for name in (CONFIG_NAME, WEIGHTS_NAME):
            if not (path / name).is_file():
                raise FileNotFoundError(f"{path / name} not found (an mlp export: config.json + model.safetensors)")
        meta = json.loads((path / CONFIG_NAME).read_text())
        if meta.get("family") != "mlp":
            raise ValueError(f"{path} holds a {meta.get('family')!r} checkpoint, not 'mlp'")
        config_class = family_class("policy", "mlp")
        fields = {f.name for f in dataclasses.fields(config_class)}
        policy = {k: v for k, v in meta["policy"].items() if k in fields}
        policy.update(policy_overrides, model_path=str(path))
        model = cls(config_class(**policy), meta["obs_dim"], meta["action_dim"], meta["num_values"])
        try:
            load_model(model, str(path / WEIGHTS_NAME), strict=True)
        except RuntimeError as exc:
            raise ValueError(f"{path / WEIGHTS_NAME} does not fit its config.json ({str(exc).splitlines()[0]})") \
                from None
        return model
