"""Reward and log-prob granularity for chunked action policies (RLinf ``reward_type`` / ``logprob_type``).

A policy emits a chunk of C actions of dimension D per environment step.

* ``reward_type``: ``chunk_level`` (one reward per chunk step: the sum over the C actions) or
  ``action_level`` (one reward per action; GAE runs on the unrolled per-action axis).
* ``logprob_type``: ``chunk_level`` (log pi of the whole chunk: sum over executed actions and D),
  ``action_level`` (one log-prob per action: sum over D) or ``token_level`` (one per action dimension).

Advantages must be at least as coarse as log-probs can carry: action-level advantages cannot drive a
chunk-level log-prob (``check_granularity``). Actions after an episode ended mid-chunk are not executed
(``step_mask`` False) and contribute nothing.
"""

from __future__ import annotations

import torch

__all__ = [
    "REWARD_TYPES",
    "LOGPROB_TYPES",
    "check_granularity",
    "aggregate_rewards",
    "reduce_logprobs",
    "expand_advantages",
    "loss_mask_for",
]

REWARD_TYPES: tuple[str, ...] = ("chunk_level", "action_level")
LOGPROB_TYPES: tuple[str, ...] = ("chunk_level", "action_level", "token_level")


def _check_reward_type(reward_type: str) -> None:
    if reward_type not in REWARD_TYPES:
        raise ValueError(f"unknown reward_type {reward_type!r}; valid: {list(REWARD_TYPES)}")


def _check_logprob_type(logprob_type: str) -> None:
    if logprob_type not in LOGPROB_TYPES:
        raise ValueError(f"unknown logprob_type {logprob_type!r}; valid: {list(LOGPROB_TYPES)}")


def check_granularity(reward_type: str, logprob_type: str) -> None:
    """Validate a (reward_type, logprob_type) pair.

    Raises ValueError on unknown names, and for ``reward_type=action_level`` with
    ``logprob_type=chunk_level`` (one advantage per action cannot weight one log-prob per chunk; use
    ``logprob_type`` action_level or token_level).
    """
    _check_reward_type(reward_type)
    _check_logprob_type(logprob_type)
    if reward_type == "action_level" and logprob_type == "chunk_level":
        raise ValueError(
            "reward_type='action_level' needs per-action log-probs but logprob_type='chunk_level'; "
            "set logprob_type to 'action_level' or 'token_level' (or reward_type to 'chunk_level')"
        )


def aggregate_rewards(rewards: torch.Tensor, *, reward_type: str) -> torch.Tensor:
    """Per-action rewards [T, B, C] (any leading dims, C last) -> [T, B] summed over C for
    ``chunk_level``, unchanged [T, B, C] for ``action_level``. Non-executed actions must carry reward 0.
    ValueError on an unknown reward_type or a 0-d input."""
    _check_reward_type(reward_type)
    if rewards.dim() < 1:
        raise ValueError(f"rewards must be [..., C], got shape {tuple(rewards.shape)}")
    if reward_type == "chunk_level":
        return rewards.sum(dim=-1)  # [T, B, C] -> [T, B]
    return rewards


def reduce_logprobs(
    logprobs: torch.Tensor, *, step_mask: torch.Tensor, logprob_type: str
) -> torch.Tensor:
    """Reduce per-dimension log-probs to the requested granularity.

    Args:
        logprobs: [..., C, D] float, log pi of each action dimension (independent dims, so the
            log-prob of an action is the sum over D).
        step_mask: [..., C] bool, actions actually executed; others contribute 0.
        logprob_type: ``chunk_level`` -> [...] (sum over executed actions and D),
            ``action_level`` -> [..., C] (sum over D), ``token_level`` -> [..., C, D].
    Raises:
        ValueError on an unknown logprob_type, ``step_mask.shape != logprobs.shape[:-1]`` or a
        non-bool mask.
    """
    _check_logprob_type(logprob_type)
    if logprobs.dim() < 2:
        raise ValueError(f"logprobs must be [..., C, D], got shape {tuple(logprobs.shape)}")
    if step_mask.dtype != torch.bool:
        raise ValueError(f"step_mask must be bool, got dtype {step_mask.dtype}")
    if tuple(step_mask.shape) != tuple(logprobs.shape[:-1]):
        raise ValueError(
            f"step_mask shape {tuple(step_mask.shape)} must equal logprobs.shape[:-1] "
            f"{tuple(logprobs.shape[:-1])}"
        )
    # [..., C] -> [..., C, 1], broadcast over D; where() so garbage (even NaN) in masked slots is dropped
    masked = torch.where(step_mask.unsqueeze(-1), logprobs, torch.zeros_like(logprobs))  # [..., C, D]
    if logprob_type == "token_level":
        return masked  # [..., C, D]
    per_action = masked.sum(dim=-1)  # [..., C, D] -> [..., C]
    if logprob_type == "action_level":
        return per_action
    return per_action.sum(dim=-1)  # [..., C] -> [...]


def expand_advantages(
    advantages: torch.Tensor, *, logprob_type: str, num_action_chunks: int, action_dim: int
) -> torch.Tensor:
    """Broadcast advantages to the log-prob granularity (C = num_action_chunks, D = action_dim).

    Args:
        advantages: [N] (from ``reward_type=chunk_level``) or [N, C] (from ``action_level``).
        logprob_type: target granularity: ``chunk_level`` -> [N], ``action_level`` -> [N, C],
            ``token_level`` -> [N, C, D]. A chunk advantage is copied to every action / dimension.
    Returns:
        A new contiguous tensor of the target shape.
    Raises:
        ValueError on an unknown logprob_type, advantages that are neither [N] nor [N, C], or [N, C]
        advantages with ``logprob_type=chunk_level`` (reward_type action_level needs per-action
        log-probs).
    """
    _check_logprob_type(logprob_type)
    C, D = num_action_chunks, action_dim
    if C < 1 or D < 1:
        raise ValueError(f"num_action_chunks and action_dim must be >= 1, got {C}, {D}")
    if advantages.dim() == 1:
        N = advantages.shape[0]
        if logprob_type == "chunk_level":
            return advantages.clone()  # [N]
        per_action = advantages.unsqueeze(-1).expand(N, C)  # [N] -> [N, 1] -> [N, C]
    elif advantages.dim() == 2:
        N = advantages.shape[0]
        if advantages.shape[1] != C:
            raise ValueError(
                f"action-level advantages have shape {tuple(advantages.shape)}, expected [N, {C}]"
            )
        if logprob_type == "chunk_level":
            raise ValueError(
                "action-level advantages [N, C] (reward_type='action_level') cannot weight "
                "logprob_type='chunk_level'; use logprob_type 'action_level' or 'token_level'"
            )
        per_action = advantages  # [N, C]
    else:
        raise ValueError(f"advantages must be [N] or [N, C], got shape {tuple(advantages.shape)}")
    if logprob_type == "action_level":
        return per_action.contiguous()  # [N, C]
    return per_action.unsqueeze(-1).expand(N, C, D).contiguous()  # [N, C] -> [N, C, 1] -> [N, C, D]


def loss_mask_for(step_mask: torch.Tensor, *, logprob_type: str, action_dim: int) -> torch.Tensor:
    """Loss mask at the log-prob granularity from step_mask [N, C] bool (any leading dims, C last):
    ``chunk_level`` -> [N] (any action executed), ``action_level`` -> [N, C],
    ``token_level`` -> [N, C, D] (D = action_dim). ValueError on unknown type or non-bool mask."""
    _check_logprob_type(logprob_type)
    if step_mask.dtype != torch.bool:
        raise ValueError(f"step_mask must be bool, got dtype {step_mask.dtype}")
    if step_mask.dim() < 1:
        raise ValueError(f"step_mask must be [N, C], got shape {tuple(step_mask.shape)}")
    if action_dim < 1:
        raise ValueError(f"action_dim must be >= 1, got {action_dim}")
    if logprob_type == "chunk_level":
        return step_mask.any(dim=-1)  # [N, C] -> [N]
    if logprob_type == "action_level":
        return step_mask.clone()  # [N, C]
    # [N, C] -> [N, C, 1] -> [N, C, D]
    return step_mask.unsqueeze(-1).expand(*step_mask.shape, action_dim).contiguous()
