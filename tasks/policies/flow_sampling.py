"""The RL sampling of flow-matching VLAs (piRL's Flow-SDE and Flow-Noise), shared by every flow family
(pi0, pi05): pure functions of a velocity field, independent of the network that gives it.

Flow convention (pi0 / openpi / transformers' `PI0ForConditionalGeneration.sample_actions`): x_t = t * noise +
(1 - t) * action, t = 1 is pure noise, t = 0 the action; the network predicts v = dx_t/dt = noise - action.
Inference integrates from t = 1 to t = 0 on the grid t_k = 1 + k * dt, dt = -1/K, k = 0..K (exactly as
`sample_actions` computes it, in float64 then float32), Euler: x_{k+1} = x_k + dt * v(x_k, t_k) = x_k - delta v,
delta = 1/K.

Stochastic transitions (piRL, Chen et al. 2025, "piRL: Online RL Fine-tuning for Flow-based VLA Models"; RLinf's
openpi integration), each a Gaussian N(mean, std^2) per element:
  deterministic (ODE):  mean = x - delta v, std = 0
  Flow-SDE:             sigma_k = a sqrt(t_k / (1 - t_k)), a = noise level, the t = 1 endpoint clamped as RLinf does
                        (1 - t_0 replaced by 1 - t_1 = delta: sigma_0 = a sqrt(K));
                        mean = x - delta [v + sigma^2 / (2 t) (x + (1 - t) v)]  (the SDE with the ODE's marginals;
                        RLinf writes it x0_hat (1 - t + delta) + x1_hat (t - delta - sigma^2 delta / (2 t)) with
                        x0_hat = x - t v, x1_hat = x + (1 - t) v: the same expression expanded),
                        std = sqrt(delta) sigma_k. At a = 0 the mean is the ODE's bit for bit.
                        ONE step index k* ~ U{0..K-1} per sample is stochastic, the others deterministic (piRL's
                        ODE-SDE mix; RLinf draws one index per batch, here one per sample); log-prob = that
                        transition's.
  Flow-Noise:           mean = the Euler mean, std = a learned head on the expert's features (`NoiseStdHead`),
                        EVERY step stochastic; log-prob = the MEAN over the K transitions (RLinf's joint_logprob; a
                        sum would make log-ratios K times larger and PPO's clipping K times tighter).
`sample_chain` (act) and `chain_logprobs` (evaluate) are the two halves: with unchanged parameters the second
returns the first's log-probs exactly (ratio = 1).
"""
from __future__ import annotations

import math
from typing import Callable

import torch
from torch import nn

LOG_2PI = math.log(2.0 * math.pi)
NOISE_METHODS = ("flow_sde", "flow_noise")

# velocity(x [N, C, A] float32, t [N] float32) -> (v [N, C, A], expert features [N, C, W]) for the same N rows
Velocity = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def time_grid(num_steps: int, device=None) -> torch.Tensor:
    """[K + 1] float32: t_k = 1 + k * (-1/K) for k < K (computed in float64 as transformers' `sample_actions`
    does), then t_K = 0."""
    dt = -1.0 / num_steps
    return torch.tensor([1.0 + k * dt for k in range(num_steps)] + [0.0], dtype=torch.float32, device=device)


def sde_sigmas(num_steps: int, noise_level: float, device=None) -> torch.Tensor:
    """[K] Flow-SDE sigma_k = a sqrt(t_k / (1 - t_k)), with 1 - t_0 clamped to 1 - t_1 (RLinf)."""
    t = time_grid(num_steps, device)
    denom = 1.0 - torch.where(t == 1.0, t[1], t)
    return (noise_level * torch.sqrt(t / denom))[:-1]


def gaussian_logprob(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """Elementwise log N(x; mean, std^2); 0 where std == 0 (a deterministic step carries no density)."""
    safe = torch.where(std > 0, std, torch.ones_like(std))
    lp = -0.5 * ((x - mean) / safe) ** 2 - torch.log(safe) - 0.5 * LOG_2PI
    return torch.where(std > 0, lp, torch.zeros_like(lp))


def gaussian_entropy(std: torch.Tensor) -> torch.Tensor:
    """Elementwise 0.5 log(2 pi e std^2); 0 where std == 0."""
    safe = torch.where(std > 0, std, torch.ones_like(std))
    ent = 0.5 * (LOG_2PI + 1.0) + torch.log(safe)
    return torch.where(std > 0, ent, torch.zeros_like(ent))


class NoiseStdHead(nn.Module):
    """Flow-Noise's learned std: expert features [N, C, W_e] -> MLP (tanh, hidden 128, 64) -> [N, C, A] std in
    [std_min, std_max]: log-variance = log min^2 + (log max^2 - log min^2) (tanh(out) + 1) / 2 (RLinf
    ExploreNoiseNet). The last layer starts at zero: the initial std is sqrt(min * max) everywhere."""

    def __init__(self, width: int, action_dim: int, std_min: float, std_max: float):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(width, 128), nn.Tanh(), nn.Linear(128, 64), nn.Tanh(),
                                 nn.Linear(64, action_dim))
        nn.init.zeros_(self.mlp[-1].weight)
        nn.init.zeros_(self.mlp[-1].bias)
        self.register_buffer("logvar_min", torch.tensor(2.0 * math.log(std_min)), persistent=False)
        self.register_buffer("logvar_max", torch.tensor(2.0 * math.log(std_max)), persistent=False)

    def forward(self, feats: torch.Tensor) -> torch.Tensor:
        u = (torch.tanh(self.mlp(feats.float())) + 1.0) / 2.0
        return torch.exp(0.5 * (self.logvar_min + (self.logvar_max - self.logvar_min) * u))


def flow_transition(x: torch.Tensor, v: torch.Tensor, feats: torch.Tensor, k: torch.Tensor, stochastic: torch.Tensor,
                    *, num_steps: int, noise_level: float, noise_head: nn.Module | None):
    """The Gaussian of denoising step k: (mean [N, C, A], std [N, C, A]) from x, v [N, C, A] (float32).

    Args:
        feats: the expert's features [N, C, W] (read by `noise_head` only). k: int64 [N] step indices in [0, K).
        stochastic: bool [N]; False rows take the deterministic Euler step (std 0).
        noise_head: None for Flow-SDE (noise level `noise_level`), the learned std for Flow-Noise.
    """
    K = num_steps
    grid = time_grid(K, x.device)
    t = grid[k][:, None, None]  # [N, 1, 1]
    delta = 1.0 / K
    ode_mean = x - delta * v
    if noise_head is None:  # flow_sde
        sigma = sde_sigmas(K, noise_level, x.device)[k][:, None, None]
        sde_mean = x - delta * (v + sigma ** 2 / (2.0 * t) * (x + (1.0 - t) * v))
        std = (math.sqrt(delta) * sigma).expand_as(x)
        mean = torch.where(stochastic[:, None, None], sde_mean, ode_mean)
    else:  # flow_noise
        std, mean = noise_head(feats), ode_mean
    std = torch.where(stochastic[:, None, None], std, torch.zeros_like(std))
    return mean, std


def sample_chain(velocity: Velocity, x: torch.Tensor, *, num_steps: int, noise_level: float,
                 noise_head: nn.Module | None, deterministic: bool):
    """Integrate the flow from x = x_1 [B, C, A] (t = 1) to x_0 in K steps, drawing from the global torch RNG.

    Returns:
        (x_0 [B, C, A], chain [B, K+1, C, A] (x at t_0 = 1 .. t_K = 0), logp [B, C, A] (Flow-SDE: the stochastic
        step's; Flow-Noise: the mean over the K steps; 0 when deterministic), denoise_idx int64 [B] (Flow-SDE's
        stochastic step; -1 when deterministic or Flow-Noise, where every step is stochastic)).
    """
    B, dev, K = x.shape[0], x.device, num_steps
    if noise_head is None and not deterministic:
        denoise_idx = torch.randint(0, K, (B,), device=dev)
    else:
        denoise_idx = torch.full((B,), -1, dtype=torch.long, device=dev)
    grid = time_grid(K, dev)
    chain, logp = [x], torch.zeros_like(x)
    for k in range(K):
        kk = torch.full((B,), k, dtype=torch.long, device=dev)
        v, feats = velocity(x, grid[kk])
        if deterministic:
            stochastic = torch.zeros(B, dtype=torch.bool, device=dev)
        elif noise_head is None:
            stochastic = denoise_idx == k
        else:
            stochastic = torch.ones(B, dtype=torch.bool, device=dev)
        mean, std = flow_transition(x, v.float(), feats, kk, stochastic, num_steps=K, noise_level=noise_level,
                                    noise_head=noise_head)
        x = mean + std * torch.randn_like(mean)
        logp = logp + gaussian_logprob(x, mean, std)
        chain.append(x)
    if noise_head is not None and not deterministic:
        logp = logp / K  # flow_noise: mean over the K stochastic transitions
    return x, torch.stack(chain, dim=1), logp, denoise_idx


def chain_logprobs(velocity: Velocity, chain: torch.Tensor, denoise_idx: torch.Tensor, *, num_steps: int,
                   noise_level: float, noise_head: nn.Module | None):
    """Differentiable log-probs and entropies of stored chains [N, K+1, C, A] under the current velocity.

    Flow-SDE: the one stochastic transition per sample (`denoise_idx` [N], one velocity pass of N rows); Flow-Noise:
    all K transitions, averaged (K passes). Returns (logp [N, C, A], entropy [N, C, A]).

    Raises:
        ValueError: a Flow-SDE chain without its stochastic step (denoise_idx < 0: a deterministic sample).
    """
    N, dev, K = chain.shape[0], chain.device, num_steps
    idx = denoise_idx.long()
    grid = time_grid(K, dev)
    ones = torch.ones(N, dtype=torch.bool, device=dev)
    rows = torch.arange(N, device=dev)
    if noise_head is None:
        if (idx < 0).any():
            raise ValueError("flow_sde evaluate needs the stochastic step index (denoise_idx >= 0)")
        steps = [(chain[rows, idx], chain[rows, idx + 1], idx)]
    else:
        steps = [(chain[:, k], chain[:, k + 1], torch.full((N,), k, dtype=torch.long, device=dev)) for k in range(K)]
    logp = ent = 0.0
    for x, x_next, k in steps:
        v, feats = velocity(x, grid[k])
        mean, std = flow_transition(x, v.float(), feats, k, ones, num_steps=K, noise_level=noise_level,
                                    noise_head=noise_head)
        logp = logp + gaussian_logprob(x_next, mean, std)  # [N, C, A]
        ent = ent + gaussian_entropy(std)
    return logp / len(steps), ent / len(steps)
