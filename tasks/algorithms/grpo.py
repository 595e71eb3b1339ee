"""GRPO for embodied rollouts: group-relative, critic-free advantages (RLinf ``adv_type: grpo``).

Shapes: T = chunk steps, B = envs, C = actions per chunk, g = ``group_size``, G = B // g groups.

Envs ``[k*g, (k+1)*g)`` form group k: they start from the same reset state (same seed / reset_state_id), so
their episode scores are comparable. Each env's score is the sum of its rewards up to and including its
FIRST done (``terminated | truncated``) inside the rollout; an env that never finishes contributes all T
chunk steps. Only that first episode is trained on: the loss mask keeps the chunk steps up to and including
the first done, so the part of a rollout after an auto-reset (a new episode with no score) is dropped.

Semantics follow RLinf (read at RLinf/RLinf, ``rlinf/algorithms/utils.py::calculate_scores`` and
``preprocess_embodied_advantages_inputs``, ``rlinf/algorithms/advantages.py::compute_grpo_advantages``
registered as "grpo", ``rlinf/utils/metric_utils.py::compute_loss_mask``, and the reward filter in
``rlinf/workers/actor/fsdp_actor_worker.py::_process_received_rollout_batch``):

* score: RLinf sums chunk rewards backwards and zeroes the running sum at every done, which leaves the sum
  from step 0 to the first done; same here.
* std: ``torch.std`` with its default Bessel correction (unbiased, divisor g-1), eps added to the std (not
  to the variance): ``A = (score - mean) / (std + eps)``.
* advantages are the per-env value broadcast over the episode's chunk steps, multiplied by the loss mask.
* loss mask: RLinf's ``compute_loss_mask`` is ``cumsum(dones) == 0`` on the done flags shifted by one step,
  i.e. steps up to and including the first done.
* ``filter_rewards``: RLinf MASKS the groups (``loss_mask = reward_filter_mask & loss_mask``), it does not
  edit the advantages; a group is kept iff ``lower <= mean(score) <= upper`` (both bounds inclusive). The
  returned ``loss_mask`` here already has the filtered groups removed, and advantages are 0 outside it.

Two deliberate differences, both for groups whose scores are a tie (std = 0):
* their advantages are exactly 0 (RLinf divides a rounding residue of ``score - mean`` by 1e-6, which can be
  a spurious +-1e-10..1e-4 instead of 0). A tie is scores equal up to rounding relative to their magnitude
  (``tasks.algorithms.ties.is_tie``: spread <= 64 * eps(dtype) * max|score|), not only bit-equal ones: float32
  ``[25, 25, 25, nextafter(25)]`` is a tie (it gave advantages ``[0, 0, 0, 0.908]``), ``[1, 1, 1, 1.001]`` is not;
* ``group_size = 1`` gives advantages 0 and std 0 (RLinf's unbiased std of one sample is NaN, so every
  advantage would be NaN).

Non-finite rewards (``algorithm.nonfinite``): a NaN/inf reward inside an env's scored episode is a ValueError
naming the env and chunk step, unless the caller leaves that env out with ``env_mask`` (mask mode: the env leaves
its group's mean/std and the loss mask; the group's statistics are those of its remaining members, and a group
with fewer than 2 remaining members gets advantages 0 and std 0, as ``group_size = 1``). Non-finite rewards
outside the scored part (after the first done, or in actions that were not executed) are never read.
"""

from __future__ import annotations

import torch

from tasks.algorithms.ties import is_tie
from tasks.config import ConfigError

__all__ = ["grpo_advantages", "check_groups"]


def _check_bool(name: str, x: torch.Tensor, shape: tuple[int, ...]) -> None:
    if x.dtype != torch.bool:
        raise ValueError(f"{name} must be a bool tensor, got dtype {x.dtype}")
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(x.shape)}, expected {tuple(shape)}")


def grpo_advantages(
    *,
    rewards: torch.Tensor,
    terminated: torch.Tensor,
    truncated: torch.Tensor,
    step_mask: torch.Tensor,
    group_size: int,
    eps: float = 1e-6,
    filter_rewards: bool = False,
    rewards_lower_bound: float | None = None,
    rewards_upper_bound: float | None = None,
    env_mask: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Group-relative advantages of one shard's rollout (groups must not straddle shards: ``check_groups``).

    Args (all keyword-only):
        rewards: float, either [T, B] chunk-level rewards (already summed over the chunk, as
            ``aggregate_rewards(..., reward_type="chunk_level")`` returns) or [T, B, C] per-action rewards
            (``reward_type=action_level``); entries where ``step_mask`` is False are ignored.
        terminated, truncated: [T, B] bool, per chunk step; both end the episode (no bootstrap in GRPO).
        step_mask: [T, B, C] bool, actions actually executed.
        group_size: g >= 1 consecutive envs per group; B % g must be 0.
        eps: added to the group std.
        filter_rewards: drop (mask out) the groups whose mean score is outside
            [rewards_lower_bound, rewards_upper_bound]; both bounds are then required.
        env_mask: [B] bool or None (all True): envs taking part. An env with False is out of its group's
            statistics and out of the loss (its score is reported as 0); its rewards are never read. A group
            with no member left is neither scored nor filtered (group_mean = group_std = 0).

    Formula (per env b in group k)::

        first_b   = first t with terminated|truncated, else T-1
        loss_mask[t, b] = t <= first_b   (and group k not filtered)
        score_b   = sum_{t <= first_b} r[t, b]          (r summed over executed actions if [T, B, C])
        n_k       = members b of group k with env_mask[b]
        mean_k, std_k = mean, unbiased std of the scores of those members
                    (std_k = 0 if their scores are a tie, ``is_tie``, or n_k < 2; mean_k = 0 if n_k = 0)
        A_b       = 0 if std_k = 0, else (score_b - mean_k) / (std_k + eps)
        advantages[t, b] = A_b if loss_mask[t, b] else 0
        (per-action rewards: advantages[t, b, c] = A_b if loss_mask[t, b] and step_mask[t, b, c] else 0)

    Returns:
        dict of
          advantages [T, B] (chunk-level rewards) or [T, B, C] (per-action rewards), rewards' float dtype;
          scores [B]; loss_mask [T, B] bool; group_mean [G]; group_std [G];
          filtered [G] bool (True = group removed by filter_rewards; all False when it is off).
    Raises:
        ValueError: wrong shapes or dtypes, group_size < 1, B % group_size != 0, eps < 0,
            filter_rewards without both bounds (or with lower > upper), or a non-finite reward in the scored
            episode of an env that ``env_mask`` keeps (names the env and chunk step).
    """
    if not rewards.is_floating_point():
        raise ValueError(f"rewards must be a floating-point tensor, got dtype {rewards.dtype}")
    if rewards.dim() not in (2, 3):
        raise ValueError(f"rewards must be [T, B] or [T, B, C], got shape {tuple(rewards.shape)}")
    T, B = rewards.shape[:2]
    if step_mask.dim() != 3:
        raise ValueError(f"step_mask must be [T, B, C], got shape {tuple(step_mask.shape)}")
    C = step_mask.shape[2]
    _check_bool("terminated", terminated, (T, B))
    _check_bool("truncated", truncated, (T, B))
    _check_bool("step_mask", step_mask, (T, B, C))
    if rewards.dim() == 3 and rewards.shape[2] != C:
        raise ValueError(f"rewards has shape {tuple(rewards.shape)}, expected [T, B, C] = {(T, B, C)}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be an int >= 1, got {group_size!r}")
    if B % group_size:
        raise ValueError(
            f"B={B} envs cannot be split into groups of group_size={group_size} (B % group_size = "
            f"{B % group_size}); use a group_size dividing the shard's env count"
        )
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    if filter_rewards:
        if rewards_lower_bound is None or rewards_upper_bound is None:
            raise ValueError("filter_rewards=True needs rewards_lower_bound and rewards_upper_bound")
        if rewards_lower_bound > rewards_upper_bound:
            raise ValueError(
                f"rewards_lower_bound={rewards_lower_bound} > rewards_upper_bound={rewards_upper_bound}"
            )
    g, G = group_size, B // group_size

    done = terminated | truncated  # [T, B]
    done_before = done.long().cumsum(dim=0) - done.long()  # [T, B] dones strictly before t
    loss_mask = done_before == 0  # [T, B] steps up to and including the first done

    if env_mask is None:
        env_mask = torch.ones(B, dtype=torch.bool, device=rewards.device)
    _check_bool("env_mask", env_mask, (B,))
    zeros = torch.zeros_like(rewards)
    if rewards.dim() == 3:  # [T, B, C] -> [T, B], executed actions only (where(): NaN cannot leak)
        executed = step_mask
    else:
        executed = step_mask.any(-1)  # [T, B]
    scored = executed & (loss_mask & env_mask.unsqueeze(0)).view(T, B, *([1] * (rewards.dim() - 2)))
    bad = scored & ~torch.isfinite(rewards)  # [T, B] or [T, B, C]
    if bool(bad.any()):
        t, b = (int(i) for i in bad.nonzero()[0][:2])
        raise ValueError(f"rewards: {int(bad.sum())} non-finite value(s) in scored GRPO episodes, first at env b={b}, "
                         f"chunk step t={t} (value {float(rewards[bad][0])}); leave such envs out with env_mask "
                         f"(algorithm.nonfinite=mask)")
    if rewards.dim() == 3:
        chunk_rewards = torch.where(step_mask, rewards, zeros).sum(dim=-1)  # [T, B, C] -> [T, B]
    else:
        chunk_rewards = rewards  # [T, B]
    loss_mask = loss_mask & env_mask.unsqueeze(0)  # [T, B] & [1, B]: masked-out envs leave the loss
    scores = torch.where(loss_mask, chunk_rewards, torch.zeros_like(chunk_rewards)).sum(dim=0)  # [B]

    grouped = scores.view(G, g)  # [B] -> [G, g], consecutive envs
    member = env_mask.view(G, g)  # [G, g]
    n = member.sum(dim=-1)  # [G] members left
    if bool(member.all()):  # every env takes part: the plain formulas (RLinf's)
        group_mean = grouped.mean(dim=-1)  # [G]
        group_std = grouped.std(dim=-1) if g > 1 else torch.zeros_like(group_mean)  # [G], unbiased (divisor g-1)
    else:  # statistics over the members only
        nf = n.to(grouped.dtype)
        group_mean = torch.where(member, grouped, 0).sum(-1) / nf.clamp(min=1)  # [G], 0 for an empty group
        dev = torch.where(member, grouped - group_mean.unsqueeze(-1), 0)  # [G, g]
        group_std = ((dev ** 2).sum(-1) / (nf - 1).clamp(min=1)).sqrt()  # [G], unbiased over the members
    all_equal = is_tie(grouped, member=member, dim=-1)  # [G]; also fewer than 2 members: no spread to normalise by
    group_std = torch.where(all_equal, torch.zeros_like(group_std), group_std)
    env_adv = (grouped - group_mean.unsqueeze(-1)) / (group_std.unsqueeze(-1) + eps)  # [G, g]
    env_adv = torch.where(all_equal.unsqueeze(-1) | ~member, torch.zeros_like(env_adv), env_adv).reshape(B)  # [B]

    if filter_rewards:
        keep = (group_mean >= rewards_lower_bound) & (group_mean <= rewards_upper_bound)  # [G]
        filtered = ~keep & (n > 0)
        loss_mask = loss_mask & keep.repeat_interleave(g).unsqueeze(0)  # [T, B] & [1, B]
    else:
        filtered = torch.zeros(G, dtype=torch.bool, device=rewards.device)

    if rewards.dim() == 2:
        adv = env_adv.unsqueeze(0).expand(T, B)  # [B] -> [T, B]
        advantages = torch.where(loss_mask, adv, torch.zeros_like(adv))
    else:
        adv = env_adv.view(1, B, 1).expand(T, B, C)  # [B] -> [T, B, C]
        mask = loss_mask.unsqueeze(-1) & step_mask  # [T, B, 1] & [T, B, C]
        advantages = torch.where(mask, adv, torch.zeros_like(adv))
    return {
        "advantages": advantages.contiguous(),
        "scores": scores,
        "loss_mask": loss_mask,
        "group_mean": group_mean,
        "group_std": group_std,
        "filtered": filtered,
    }


def check_groups(num_envs: int, num_shards: int, group_size: int) -> None:
    """Offline check that GRPO groups tile the env shards.

    Envs are split evenly into ``num_shards`` shards of ``num_envs // num_shards``; a group of
    ``group_size`` consecutive envs must sit inside one shard, since each shard's advantages are computed
    on its own (a graph node per shard).

    Raises:
        ConfigError (key ``algorithm.group_size``): group_size < 1, num_envs % group_size != 0, or
            shard_size % group_size != 0; key ``env.num_shards`` when num_shards < 1 or does not divide
            num_envs. Messages carry the numbers and a fix.
    """
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ConfigError("algorithm.group_size", group_size, "must be an integer >= 1 (envs per GRPO group)")
    if num_shards < 1 or num_envs % num_shards:
        raise ConfigError("env.num_shards", num_shards,
                          f"must be >= 1 and divide env.num_envs={num_envs} to split envs into equal shards")
    if num_envs % group_size:
        raise ConfigError(
            "algorithm.group_size", group_size,
            f"env.num_envs={num_envs} is not a multiple of group_size={group_size} "
            f"({num_envs} % {group_size} = {num_envs % group_size}); use a group_size dividing {num_envs}")
    shard_size = num_envs // num_shards
    if shard_size % group_size:
        raise ConfigError(
            "algorithm.group_size", group_size,
            f"env shards hold {shard_size} envs (env.num_envs={num_envs} / env.num_shards={num_shards}) and "
            f"{shard_size} % {group_size} = {shard_size % group_size}, so a group would straddle two shards; "
            f"use a group_size dividing {shard_size}, or env.num_shards such that num_envs/num_shards is a "
            f"multiple of {group_size}")
