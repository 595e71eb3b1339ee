"""GAE and the chunk-level <-> action-level time-axis conversion.

Shapes: T = chunk steps, B = envs, C = actions per chunk (num_action_chunks).

``terminated`` and ``truncated`` stay separate: a terminated step bootstraps from 0, a truncated step
bootstraps from ``V(final_obs)`` (``final_values``). Both end the GAE recursion.

``gae`` is the math of the ``ppo`` estimator; the estimator registry (what each one needs, how it normalises,
one signature) is ``tasks.algorithms.estimators``.
"""

from __future__ import annotations

import torch

__all__ = [
    "gae",
    "to_action_level",
    "from_action_level",
]


def _check_shape(name: str, x: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(x.shape)}, expected {tuple(shape)}")


def _check_bool(name: str, x: torch.Tensor) -> None:
    if x.dtype != torch.bool:
        raise ValueError(f"{name} must be a bool tensor, got dtype {x.dtype}")


def _check_float(name: str, x: torch.Tensor) -> None:
    if not x.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")


def gae(
    *,
    rewards: torch.Tensor,
    values: torch.Tensor,
    terminated: torch.Tensor,
    truncated: torch.Tensor,
    final_values: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised Advantage Estimation (Schulman et al. 2016, "High-Dimensional Continuous Control
    Using Generalized Advantage Estimation", eq. 16), with termination and truncation kept apart.

    Args (all keyword-only):
        rewards: [T, B] float, reward received after step t.
        values: [T+1, B] float, V(s_t); ``values[T]`` is V of the observation after the last step.
            After an auto-reset ``values[t+1]`` is V of the *new* episode's first observation.
        terminated: [T, B] bool, the episode ended at step t in a terminal state (bootstrap 0).
        truncated: [T, B] bool, the episode was cut at step t (time limit); bootstrap from
            ``final_values[t]``. If both flags are set, termination wins.
        final_values: [T, B] float, V(final_obs) of the episode truncated at step t; read only where
            ``truncated & ~terminated`` (elsewhere it may hold anything, NaN included).
        gamma: discount in [0, 1].
        lam: GAE lambda in [0, 1].

    Formula::

        next_value_t = 0                 if terminated_t
                     = final_values[t]   if truncated_t and not terminated_t
                     = values[t+1]       otherwise
        delta_t = r_t + gamma * next_value_t - values[t]
        A_t     = delta_t + gamma * lam * (1 - done_t) * A_{t+1},   done = terminated | truncated
        returns = A + values[:T]

    Non-finite inputs (NaN/inf rewards or values) are not an error here (the caller, ``tasks.actor.entries.advantages``,
    checks them per ``algorithm.nonfinite``); they propagate exactly along the dependencies of the formula and no
    further: to A_t and returns_t of the steps of the SAME episode at or before them (within the rollout), never
    across a done (the recursion is cut with ``where``, not by multiplying with 0), never to other envs. So
    ``~isfinite(advantages)`` is exactly the set of samples whose advantage is undefined.

    Returns:
        (advantages [T, B], returns [T, B]) in the promoted float dtype of rewards/values/final_values.
    Raises:
        ValueError on shape mismatch, non-bool flags, non-float inputs or gamma/lam outside [0, 1].
    """
    _check_float("rewards", rewards)
    _check_float("values", values)
    _check_float("final_values", final_values)
    _check_bool("terminated", terminated)
    _check_bool("truncated", truncated)
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [T, B], got shape {tuple(rewards.shape)}")
    T, B = rewards.shape
    _check_shape("values", values, (T + 1, B))
    _check_shape("terminated", terminated, (T, B))
    _check_shape("truncated", truncated, (T, B))
    _check_shape("final_values", final_values, (T, B))
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma}")
    if not 0.0 <= lam <= 1.0:
        raise ValueError(f"lam must be in [0, 1], got {lam}")

    dtype = torch.promote_types(torch.promote_types(rewards.dtype, values.dtype), final_values.dtype)
    rewards, values, final_values = rewards.to(dtype), values.to(dtype), final_values.to(dtype)

    zeros = torch.zeros_like(rewards)
    # torch.where (not multiplication) so NaN in unused final_values cannot leak in.
    next_values = torch.where(truncated, final_values, values[1:])  # [T, B]
    next_values = torch.where(terminated, zeros, next_values)  # [T, B]
    deltas = rewards + gamma * next_values - values[:-1]  # [T, B]

    done = terminated | truncated  # [T, B]

    advantages = torch.empty_like(rewards)
    running = torch.zeros(B, dtype=dtype, device=rewards.device)  # A_{t+1}, [B]
    for t in range(T - 1, -1, -1):
        # where() (not `* not_done`): at a done the next episode's A is dropped, even if it is NaN (0 * NaN = NaN)
        running = deltas[t] + gamma * lam * torch.where(done[t], zeros[t], running)
        advantages[t] = running
    returns = advantages + values[:-1]
    return advantages, returns


def to_action_level(
    *,
    rewards: torch.Tensor,
    values: torch.Tensor,
    terminated: torch.Tensor,
    truncated: torch.Tensor,
    final_values: torch.Tensor,
    step_mask: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """Unroll a chunked rollout onto a per-action time axis (RLinf ``reward_type: action_level``).

    Action c of chunk step t gets time index ``t*C + c``. The done flags (and ``final_values``) of chunk
    step t are placed at the LAST EXECUTED action of that chunk, index ``step_mask[t, b].sum() - 1``;
    all other positions get False / 0. Actions after an episode ended mid-chunk are not executed: their
    rewards are forced to 0 and their advantages are garbage that the loss mask (``step_mask``) drops.

    Args (keyword-only):
        rewards: [T, B, C] float, per-action rewards.
        values: [T+1, B, C] float, per-action values; the bootstrap row is ``values[T, :, 0]``.
        terminated, truncated: [T, B] bool, per chunk step.
        final_values: [T, B] float, V(final_obs) for truncated chunk steps.
        step_mask: [T, B, C] bool, actions actually executed; must be a prefix per chunk
            (True...True False...False). An empty chunk (no action executed: an idle env without
            auto_reset, tasks.envs.shard) must carry no done flag; its positions get reward 0, no done,
            and advantages that the loss mask drops (the recursion never crosses the done before them).

    Returns:
        dict with rewards [T*C, B], values [T*C+1, B], terminated [T*C, B], truncated [T*C, B],
        final_values [T*C, B], ready for ``gae``.
    Raises:
        ValueError on shape/dtype mismatch, a step_mask that is not a prefix, or a done flag on a chunk
        step that executed no action.
    """
    _check_float("rewards", rewards)
    _check_float("values", values)
    _check_float("final_values", final_values)
    for name, flag in (("terminated", terminated), ("truncated", truncated), ("step_mask", step_mask)):
        _check_bool(name, flag)
    if rewards.dim() != 3:
        raise ValueError(f"rewards must be [T, B, C], got shape {tuple(rewards.shape)}")
    T, B, C = rewards.shape
    _check_shape("values", values, (T + 1, B, C))
    _check_shape("terminated", terminated, (T, B))
    _check_shape("truncated", truncated, (T, B))
    _check_shape("final_values", final_values, (T, B))
    _check_shape("step_mask", step_mask, (T, B, C))

    n_exec = step_mask.sum(dim=-1)  # [T, B] number of executed actions per chunk
    if bool(((n_exec == 0) & (terminated | truncated)).any()):
        raise ValueError("step_mask has a chunk with no executed action but a done flag; an episode ends at "
                         "an executed action")
    positions = torch.arange(C, device=step_mask.device)  # [C]
    prefix = positions.view(1, 1, C) < n_exec.unsqueeze(-1)  # [T, B, C]
    if not torch.equal(prefix, step_mask):
        raise ValueError("step_mask must be a prefix per chunk (executed actions first, then none)")

    last = n_exec - 1  # [T, B] index of the last executed action
    at_last = positions.view(1, 1, C) == last.unsqueeze(-1)  # [T, B, C] one-hot of the last action

    def unroll(x: torch.Tensor) -> torch.Tensor:
        # [T, B, C] -> [T, C, B] -> [T*C, B]
        return x.permute(0, 2, 1).reshape(T * C, B)

    rewards_a = torch.where(step_mask, rewards, torch.zeros_like(rewards))  # [T, B, C]
    term_a = at_last & terminated.unsqueeze(-1)  # [T, B, 1] & [T, B, C] -> [T, B, C]
    trunc_a = at_last & truncated.unsqueeze(-1)  # [T, B, C]
    fv = final_values.unsqueeze(-1).expand(T, B, C)  # [T, B] -> [T, B, C]
    fv_a = torch.where(at_last, fv, torch.zeros_like(fv))  # [T, B, C]
    values_a = torch.cat(
        [unroll(values[:T]), values[T, :, 0].unsqueeze(0)],  # [T*C, B] ++ [1, B]
        dim=0,
    )  # [T*C+1, B]
    return {
        "rewards": unroll(rewards_a),
        "values": values_a,
        "terminated": unroll(term_a),
        "truncated": unroll(trunc_a),
        "final_values": unroll(fv_a),
    }


def from_action_level(x: torch.Tensor, *, num_action_chunks: int) -> torch.Tensor:
    """Fold a per-action time axis back into chunks: x [T*C, B] -> [T, B, C] (inverse of the unroll
    in ``to_action_level``; C = ``num_action_chunks``). ValueError if x is not 2-D or T*C % C != 0."""
    C = num_action_chunks
    if C < 1:
        raise ValueError(f"num_action_chunks must be >= 1, got {C}")
    if x.dim() != 2 or x.shape[0] % C != 0:
        raise ValueError(f"x must be [T*C, B] with C={C} dividing dim 0, got shape {tuple(x.shape)}")
    TC, B = x.shape
    # [T*C, B] -> [T, C, B] -> [T, B, C]
    return x.reshape(TC // C, C, B).permute(0, 2, 1).contiguous()
