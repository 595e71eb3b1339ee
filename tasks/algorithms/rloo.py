"""RLOO for embodied rollouts: critic-free advantages with a leave-one-out group baseline (Kool et al. 2019, "Buy
4 REINFORCE Samples, Get a Baseline for Free!"; Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style
Optimization for Learning from Human Feedback in LLMs"; verl's ``compute_rloo_outcome_advantage``).

Shapes: T = chunk steps, B = envs, C = actions per chunk, g = ``group_size``, G = B // g groups.

Groups, scores and the loss mask are GRPO's (``tasks.algorithms.grpo``: envs ``[k*g, (k+1)*g)`` share every reset
seed; an env's score is the sum of its rewards up to and including its first done; only that first episode is
trained on). The advantage of env b in group k is its score minus the mean score of the OTHER members::

    A_b = score_b - (sum_{j in k, j != b} score_j) / (n_k - 1)        (n_k = members of group k left by env_mask)

broadcast over the chunk steps of its scored episode; 0 when n_k < 2 (no other member to compare with) and when the
group's scores are a tie (``tasks.algorithms.ties.is_tie``: equal up to rounding relative to their magnitude, e.g.
float32 1000 and 1000 + 1 ulp): their differences are rounding noise, which the update's batch normalisation
(``algorithm.normalize_advantages``) would otherwise scale up to full-size advantages of random sign. There is no
division by a group std here.
"""

from __future__ import annotations

import torch

from tasks.algorithms.grpo import grpo_advantages
from tasks.algorithms.ties import is_tie

__all__ = ["rloo_advantages"]


def rloo_advantages(
    *,
    rewards: torch.Tensor,
    terminated: torch.Tensor,
    truncated: torch.Tensor,
    step_mask: torch.Tensor,
    group_size: int,
    env_mask: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Leave-one-out advantages of one shard's rollout (groups must not straddle shards).

    Args (keyword-only): as ``grpo_advantages`` (rewards [T, B] chunk-level or [T, B, C] per-action float;
    terminated, truncated [T, B] bool; step_mask [T, B, C] bool; group_size g >= 1 dividing B; env_mask [B] bool or
    None: envs taking part, the others are out of their group's baseline and of the loss).

    Returns:
        dict of advantages [T, B] or [T, B, C] (rewards' float dtype; 0 outside the loss mask and, per action, at
        actions not executed), scores [B], loss_mask [T, B] bool, baseline [B] (the leave-one-out mean; 0 where
        A is 0 by rule).
    Raises:
        ValueError: as ``grpo_advantages`` (shapes, dtypes, group_size, a non-finite reward in a scored episode of
            an env that env_mask keeps).
    """
    res = grpo_advantages(rewards=rewards, terminated=terminated, truncated=truncated, step_mask=step_mask,
                          group_size=group_size, env_mask=env_mask)
    scores, loss_mask = res["scores"], res["loss_mask"]  # [B], [T, B]
    B = scores.shape[0]
    T = loss_mask.shape[0]
    g, G = group_size, B // group_size
    member = (torch.ones(B, dtype=torch.bool, device=scores.device) if env_mask is None else env_mask).view(G, g)
    grouped = torch.where(member, scores.view(G, g), torch.zeros_like(scores.view(G, g)))  # [G, g]
    n = member.sum(dim=-1, keepdim=True)  # [G, 1] members left
    others = grouped.sum(dim=-1, keepdim=True) - grouped  # [G, g] sum of the other members' scores
    ok = member & (n >= 2) & ~is_tie(scores.view(G, g), member=member, dim=-1).unsqueeze(-1)  # [G, g]
    baseline = torch.where(ok, others / (n - 1).clamp(min=1).to(scores.dtype), torch.zeros_like(others))
    env_adv = torch.where(ok, grouped - baseline, torch.zeros_like(grouped)).reshape(B)  # [B]
    if rewards.dim() == 2:
        adv = env_adv.unsqueeze(0).expand(T, B)  # [B] -> [T, B]
        advantages = torch.where(loss_mask, adv, torch.zeros_like(adv))
    else:
        C = step_mask.shape[2]
        adv = env_adv.view(1, B, 1).expand(T, B, C)  # [B] -> [T, B, C]
        advantages = torch.where(loss_mask.unsqueeze(-1) & step_mask, adv, torch.zeros_like(adv))
    return {"advantages": advantages.contiguous(), "scores": scores, "loss_mask": loss_mask,
            "baseline": baseline.reshape(B)}
