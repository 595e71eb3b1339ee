"""Tests for tasks.algorithms.grpo: RLinf-style embodied GRPO advantages and the group/shard check."""

import math
import statistics

import pytest
import torch

from tasks.algorithms import check_groups, grpo_advantages
from tasks.config import ConfigError


def _flags(T, B, term=(), trunc=()):
    terminated = torch.zeros(T, B, dtype=torch.bool)
    truncated = torch.zeros(T, B, dtype=torch.bool)
    for t, b in term:
        terminated[t, b] = True
    for t, b in trunc:
        truncated[t, b] = True
    return terminated, truncated


def test_hand_computed_two_groups_of_two():
    # T=4, B=4 (groups {0,1}, {2,3}), chunk-level rewards [T, B]
    rewards = torch.tensor(
        [
            [1.0, 0.0, 0.0, 0.0],
            [2.0, 1.0, 0.0, 0.0],  # env 0 terminates here: score 1+2 = 3; later rewards do not count
            [5.0, 1.0, 1.0, 0.0],  # env 2 truncated here: score 1
            [5.0, 0.0, 9.0, 0.0],  # env 3 terminates at the last step: score 0; env 1 never done: 2
        ],
        dtype=torch.float64,
    )
    terminated, truncated = _flags(4, 4, term=[(1, 0), (3, 3)], trunc=[(2, 2)])
    step_mask = torch.ones(4, 4, 2, dtype=torch.bool)
    out = grpo_advantages(rewards=rewards, terminated=terminated, truncated=truncated, step_mask=step_mask,
                          group_size=2)
    torch.testing.assert_close(out["scores"], torch.tensor([3.0, 2.0, 1.0, 0.0], dtype=torch.float64))
    torch.testing.assert_close(out["group_mean"], torch.tensor([2.5, 0.5], dtype=torch.float64))
    # unbiased std of {a, a+1} = sqrt((0.25 + 0.25) / (2 - 1)) = sqrt(0.5)
    s = math.sqrt(0.5)
    torch.testing.assert_close(out["group_std"], torch.tensor([s, s], dtype=torch.float64))
    a = 0.5 / (s + 1e-6)
    expected_mask = torch.tensor(
        [[1, 1, 1, 1], [1, 1, 1, 1], [0, 1, 1, 1], [0, 1, 0, 1]], dtype=torch.bool
    )
    assert torch.equal(out["loss_mask"], expected_mask)
    expected_adv = torch.tensor(
        [[a, -a, a, -a], [a, -a, a, -a], [0.0, -a, a, -a], [0.0, -a, 0.0, -a]], dtype=torch.float64
    )
    torch.testing.assert_close(out["advantages"], expected_adv)
    assert out["advantages"].shape == (4, 4) and out["advantages"].dtype == torch.float64
    assert not out["filtered"].any() and out["filtered"].shape == (2,)


def test_all_equal_group_is_exactly_zero():
    rewards = torch.tensor([[0.1, 0.1, 0.1, 1.0], [0.2, 0.2, 0.2, 0.0]])  # [T=2, B=4]
    terminated, truncated = _flags(2, 4)
    step_mask = torch.ones(2, 4, 1, dtype=torch.bool)
    out = grpo_advantages(rewards=rewards, terminated=terminated, truncated=truncated, step_mask=step_mask,
                          group_size=2)
    # group 0 = envs 0, 1 (equal scores): exactly 0 and std 0; group 1 = envs 2, 3 (0.3 vs 1.0)
    assert torch.equal(out["advantages"][:, :2], torch.zeros(2, 2))
    assert out["group_std"][0].item() == 0.0
    assert (out["advantages"][:, 2] < 0).all() and (out["advantages"][:, 3] > 0).all()
    # three identical scores 0.1 whose float mean is not exactly 0.1: still exactly 0
    r3 = torch.full((1, 3), 0.1)
    out3 = grpo_advantages(rewards=r3, terminated=torch.zeros(1, 3, dtype=torch.bool),
                           truncated=torch.zeros(1, 3, dtype=torch.bool),
                           step_mask=torch.ones(1, 3, 1, dtype=torch.bool), group_size=3)
    assert torch.equal(out3["advantages"], torch.zeros(1, 3))


def test_group_size_one_gives_zero_not_nan():
    rewards = torch.randn(3, 4)
    out = grpo_advantages(rewards=rewards, terminated=torch.zeros(3, 4, dtype=torch.bool),
                          truncated=torch.zeros(3, 4, dtype=torch.bool),
                          step_mask=torch.ones(3, 4, 2, dtype=torch.bool), group_size=1)
    assert torch.equal(out["advantages"], torch.zeros(3, 4))
    assert torch.equal(out["group_std"], torch.zeros(4))


def test_filter_rewards_masks_groups_outside_inclusive_bounds():
    # 3 groups of 2, T=1, scores: group means 0.0, 0.5, 1.0 (success-rate style rewards)
    rewards = torch.tensor([[0.0, 0.0, 0.0, 1.0, 1.0, 1.0]])
    term = torch.ones(1, 6, dtype=torch.bool)
    trunc = torch.zeros(1, 6, dtype=torch.bool)
    sm = torch.ones(1, 6, 1, dtype=torch.bool)
    out = grpo_advantages(rewards=rewards, terminated=term, truncated=trunc, step_mask=sm, group_size=2,
                          filter_rewards=True, rewards_lower_bound=0.1, rewards_upper_bound=0.9)
    assert out["filtered"].tolist() == [True, False, True]
    assert out["loss_mask"].tolist() == [[False, False, True, True, False, False]]
    assert out["advantages"][0, [0, 1, 4, 5]].eq(0).all()
    assert out["advantages"][0, 2] < 0 < out["advantages"][0, 3]
    # bounds are inclusive: [0.5, 1.0] keeps the 0.5 and 1.0 groups
    out = grpo_advantages(rewards=rewards, terminated=term, truncated=trunc, step_mask=sm, group_size=2,
                          filter_rewards=True, rewards_lower_bound=0.5, rewards_upper_bound=1.0)
    assert out["filtered"].tolist() == [True, False, False]
    # off: nothing filtered, bounds not needed
    out = grpo_advantages(rewards=rewards, terminated=term, truncated=trunc, step_mask=sm, group_size=2)
    assert not out["filtered"].any() and out["loss_mask"].all()
    # the filter uses the score (rewards up to the first done), not rewards after it
    r2 = torch.tensor([[0.0, 0.0], [5.0, 5.0]])
    t2 = torch.tensor([[True, True], [False, False]])
    out = grpo_advantages(rewards=r2, terminated=t2, truncated=torch.zeros(2, 2, dtype=torch.bool),
                          step_mask=torch.ones(2, 2, 1, dtype=torch.bool), group_size=2, filter_rewards=True,
                          rewards_lower_bound=0.1, rewards_upper_bound=0.9)
    assert out["filtered"].tolist() == [True] and not out["loss_mask"].any()


def test_action_level_rewards_broadcast_and_mid_chunk_end():
    nan = float("nan")
    # T=2, B=2, C=2; env 0 terminates after the FIRST action of chunk step 0 (action 1 not executed)
    rewards = torch.tensor(
        [[[1.0, nan], [0.5, 0.5]],
         [[3.0, 3.0], [0.0, 1.0]]]
    )  # [T, B, C]
    step_mask = torch.tensor([[[True, False], [True, True]], [[True, True], [True, True]]])
    terminated, truncated = _flags(2, 2, term=[(0, 0)])
    out = grpo_advantages(rewards=rewards, terminated=terminated, truncated=truncated, step_mask=step_mask,
                          group_size=2)
    torch.testing.assert_close(out["scores"], torch.tensor([1.0, 2.0]))
    a = 0.5 / (math.sqrt(0.5) + 1e-6)
    expected = torch.tensor([[[-a, 0.0], [a, a]], [[0.0, 0.0], [a, a]]])
    assert out["advantages"].shape == (2, 2, 2)
    torch.testing.assert_close(out["advantages"], expected)
    assert not torch.isnan(out["advantages"]).any()
    # chunk-level rewards from the same rollout give the same per-env advantages
    chunk = torch.where(step_mask, rewards, torch.zeros_like(rewards)).sum(-1)
    out_c = grpo_advantages(rewards=chunk, terminated=terminated, truncated=truncated, step_mask=step_mask,
                            group_size=2)
    torch.testing.assert_close(out_c["advantages"], expected[..., 0].where(out_c["loss_mask"],
                                                                          torch.tensor(0.0)))


def _loop_grpo(rewards, terminated, truncated, group_size, eps, lo=None, hi=None):
    """Plain-python reference: RLinf's backward score loop (reset the running sum at every done),
    statistics.stdev (unbiased), then per-element broadcast with the first-done mask."""
    T, B = len(rewards), len(rewards[0])
    scores = [0.0] * B
    for t in reversed(range(T)):
        for b in range(B):
            if terminated[t][b] or truncated[t][b]:
                scores[b] = 0.0
            scores[b] += rewards[t][b]
    mask = [[True] * B for _ in range(T)]
    for b in range(B):
        seen = False
        for t in range(T):
            mask[t][b] = not seen
            seen = seen or terminated[t][b] or truncated[t][b]
    adv_env = [0.0] * B
    for k in range(B // group_size):
        grp = scores[k * group_size:(k + 1) * group_size]
        mean = sum(grp) / group_size
        if lo is not None and not (lo <= mean <= hi):
            for b in range(k * group_size, (k + 1) * group_size):
                for t in range(T):
                    mask[t][b] = False
        if len(set(grp)) == 1:
            continue
        std = statistics.stdev(grp)
        for i, s in enumerate(grp):
            adv_env[k * group_size + i] = (s - mean) / (std + eps)
    adv = [[adv_env[b] if mask[t][b] else 0.0 for b in range(B)] for t in range(T)]
    return adv, scores, mask


@pytest.mark.parametrize("seed,group_size,filt", [(0, 4, False), (1, 2, False), (2, 3, True), (3, 6, True)])
def test_matches_plain_loop_on_random_rollouts(seed, group_size, filt):
    g = torch.Generator().manual_seed(seed)
    T, B = 12, 12
    rewards = (torch.rand(T, B, generator=g, dtype=torch.float64) < 0.3).to(torch.float64)
    terminated = torch.rand(T, B, generator=g) < 0.1
    truncated = torch.rand(T, B, generator=g) < 0.05
    sm = torch.ones(T, B, 3, dtype=torch.bool)
    lo, hi = (0.5, 2.0) if filt else (None, None)
    out = grpo_advantages(rewards=rewards, terminated=terminated, truncated=truncated, step_mask=sm,
                          group_size=group_size, filter_rewards=filt, rewards_lower_bound=lo,
                          rewards_upper_bound=hi)
    adv, scores, mask = _loop_grpo(rewards.tolist(), terminated.tolist(), truncated.tolist(), group_size,
                                   1e-6, lo, hi)
    torch.testing.assert_close(out["scores"], torch.tensor(scores, dtype=torch.float64))
    assert out["loss_mask"].tolist() == mask
    torch.testing.assert_close(out["advantages"], torch.tensor(adv, dtype=torch.float64))


def test_errors():
    T, B = 2, 6
    ok = dict(rewards=torch.zeros(T, B), terminated=torch.zeros(T, B, dtype=torch.bool),
              truncated=torch.zeros(T, B, dtype=torch.bool), step_mask=torch.ones(T, B, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"B=6.*group_size=4"):
        grpo_advantages(**ok, group_size=4)
    with pytest.raises(ValueError, match="group_size"):
        grpo_advantages(**ok, group_size=0)
    with pytest.raises(ValueError, match="needs rewards_lower_bound"):
        grpo_advantages(**ok, group_size=2, filter_rewards=True)
    with pytest.raises(ValueError, match="rewards_lower_bound=1.0 > rewards_upper_bound=0.0"):
        grpo_advantages(**ok, group_size=2, filter_rewards=True, rewards_lower_bound=1.0,
                        rewards_upper_bound=0.0)
    with pytest.raises(ValueError, match="terminated has shape"):
        grpo_advantages(**{**ok, "terminated": torch.zeros(T, B + 1, dtype=torch.bool)}, group_size=2)
    with pytest.raises(ValueError, match="truncated must be a bool"):
        grpo_advantages(**{**ok, "truncated": torch.zeros(T, B)}, group_size=2)
    with pytest.raises(ValueError, match="floating-point"):
        grpo_advantages(**{**ok, "rewards": torch.zeros(T, B, dtype=torch.long)}, group_size=2)
    with pytest.raises(ValueError, match=r"expected \[T, B, C\]"):
        grpo_advantages(**{**ok, "rewards": torch.zeros(T, B, 3)}, group_size=2)


def test_check_groups():
    check_groups(32, 2, 8)  # shards of 16 hold two groups each
    check_groups(32, 4, 1)
    with pytest.raises(ConfigError, match="must be an integer >= 1") as e:
        check_groups(32, 2, 0)
    assert e.value.key == "algorithm.group_size" and e.value.value == 0
    with pytest.raises(ConfigError, match=r"env.num_envs=30 is not a multiple of group_size=4") as e:
        check_groups(30, 2, 4)
    assert e.value.key == "algorithm.group_size"
    with pytest.raises(ConfigError, match=r"shards hold 8 envs .*num_envs=32 / env.num_shards=4.*8 % 16 = 8"):
        check_groups(32, 4, 16)
    with pytest.raises(ConfigError, match=r"shards hold 12 envs.*12 % 8 = 4.*straddle") as e:
        check_groups(24, 2, 8)
    assert e.value.key == "algorithm.group_size" and e.value.value == 8
    with pytest.raises(ConfigError) as e:
        check_groups(30, 4, 2)
    assert e.value.key == "env.num_shards"
