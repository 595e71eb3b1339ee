"""Tests for tasks.algorithms.granularity (RLinf reward_type / logprob_type semantics)."""

import itertools

import pytest
import torch

from tasks.algorithms.granularity import (
    LOGPROB_TYPES,
    REWARD_TYPES,
    aggregate_rewards,
    check_granularity,
    expand_advantages,
    loss_mask_for,
    reduce_logprobs,
)


def test_aggregate_rewards_chunk_level_sums_over_actions():
    rewards = torch.tensor([[[1.0, 2.0, 0.5], [0.0, -1.0, 0.0]]])  # [T=1, B=2, C=3]
    out = aggregate_rewards(rewards, reward_type="chunk_level")
    torch.testing.assert_close(out, torch.tensor([[3.5, -1.0]]))
    assert aggregate_rewards(rewards, reward_type="action_level") is rewards
    with pytest.raises(ValueError, match="chunk_level"):
        aggregate_rewards(rewards, reward_type="token_level")


def _hand_logprobs():
    nan = float("nan")
    logprobs = torch.tensor(
        [[
            [[-1.0, -2.0], [nan, -4.0]],  # env 0: 2nd action not executed (NaN must not leak)
            [[-0.5, -0.5], [-1.0, -1.5]],  # env 1: both executed
        ]]
    )  # [T=1, B=2, C=2, D=2]
    step_mask = torch.tensor([[[True, False], [True, True]]])  # [1, 2, 2]
    return logprobs, step_mask


def test_reduce_logprobs_hand_case_all_granularities():
    logprobs, step_mask = _hand_logprobs()
    token = reduce_logprobs(logprobs, step_mask=step_mask, logprob_type="token_level")
    torch.testing.assert_close(
        token, torch.tensor([[[[-1.0, -2.0], [0.0, 0.0]], [[-0.5, -0.5], [-1.0, -1.5]]]])
    )
    action = reduce_logprobs(logprobs, step_mask=step_mask, logprob_type="action_level")
    torch.testing.assert_close(action, torch.tensor([[[-3.0, 0.0], [-1.0, -2.5]]]))
    chunk = reduce_logprobs(logprobs, step_mask=step_mask, logprob_type="chunk_level")
    torch.testing.assert_close(chunk, torch.tensor([[-3.0, -3.5]]))


def test_reduce_logprobs_gradient_skips_masked_actions():
    logprobs, step_mask = _hand_logprobs()
    logprobs = torch.nan_to_num(logprobs).requires_grad_()
    reduce_logprobs(logprobs, step_mask=step_mask, logprob_type="chunk_level").sum().backward()
    expected = step_mask.unsqueeze(-1).expand(1, 2, 2, 2).float()
    torch.testing.assert_close(logprobs.grad, expected)


def test_reduce_logprobs_rejects_mismatch():
    logprobs, step_mask = _hand_logprobs()
    with pytest.raises(ValueError, match="step_mask"):
        reduce_logprobs(logprobs, step_mask=step_mask[..., :1], logprob_type="action_level")
    with pytest.raises(ValueError, match="bool"):
        reduce_logprobs(logprobs, step_mask=step_mask.float(), logprob_type="action_level")
    with pytest.raises(ValueError, match="token_level"):
        reduce_logprobs(logprobs, step_mask=step_mask, logprob_type="chunk")


@pytest.mark.parametrize("reward_type,logprob_type", list(itertools.product(REWARD_TYPES, LOGPROB_TYPES)))
def test_expand_and_mask_shapes_for_every_combination(reward_type, logprob_type):
    N, C, D = 5, 3, 2
    g = torch.Generator().manual_seed(0)
    adv = torch.randn(N, generator=g) if reward_type == "chunk_level" else torch.randn(N, C, generator=g)
    step_mask = torch.ones(N, C, dtype=torch.bool)
    step_mask[1, 2] = False
    step_mask[3, 1:] = False
    logprobs = torch.randn(N, C, D, generator=g)
    lp = reduce_logprobs(logprobs, step_mask=step_mask, logprob_type=logprob_type)
    mask = loss_mask_for(step_mask, logprob_type=logprob_type, action_dim=D)
    assert mask.shape == lp.shape
    assert mask.dtype == torch.bool

    if reward_type == "action_level" and logprob_type == "chunk_level":
        with pytest.raises(ValueError, match="logprob_type"):
            check_granularity(reward_type, logprob_type)
        with pytest.raises(ValueError, match="reward_type"):
            expand_advantages(adv, logprob_type=logprob_type, num_action_chunks=C, action_dim=D)
        return

    check_granularity(reward_type, logprob_type)
    out = expand_advantages(adv, logprob_type=logprob_type, num_action_chunks=C, action_dim=D)
    assert out.shape == lp.shape
    # values are copies of the source advantage at the right index
    if reward_type == "chunk_level":
        src = adv.view(N, *([1] * (out.dim() - 1))).expand_as(out)
    else:
        src = adv if out.dim() == 2 else adv.unsqueeze(-1).expand(N, C, D)
    torch.testing.assert_close(out, src)
    out.add_(1.0)  # a real tensor, not a broadcast view
    if logprob_type == "chunk_level":
        torch.testing.assert_close(mask, torch.ones(N, dtype=torch.bool))
    elif logprob_type == "action_level":
        assert torch.equal(mask, step_mask)
    else:
        assert torch.equal(mask[:, :, 0], step_mask) and torch.equal(mask[:, :, 1], step_mask)


def test_loss_mask_chunk_level_any_executed():
    step_mask = torch.tensor([[True, False], [False, False]])
    assert loss_mask_for(step_mask, logprob_type="chunk_level", action_dim=4).tolist() == [True, False]


def test_expand_advantages_rejects_bad_shapes():
    with pytest.raises(ValueError, match=r"\[N, 3\]"):
        expand_advantages(torch.zeros(4, 2), logprob_type="action_level", num_action_chunks=3, action_dim=2)
    with pytest.raises(ValueError, match="advantages"):
        expand_advantages(torch.zeros(4, 3, 2), logprob_type="token_level", num_action_chunks=3, action_dim=2)


def test_check_granularity_names_and_fix():
    with pytest.raises(ValueError, match="action_level' or 'token_level"):
        check_granularity("action_level", "chunk_level")
    with pytest.raises(ValueError, match="reward_type"):
        check_granularity("step_level", "chunk_level")
    with pytest.raises(ValueError, match="logprob_type"):
        check_granularity("chunk_level", "dim_level")
