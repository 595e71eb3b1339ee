"""Shape suite: a chunked rollout walked to the PPO loss for every (reward_type, logprob_type) pair that
``check_granularity`` allows, with GAE and GRPO advantages, on a hand-built case with exact values.

Pipeline under test (the one tasks/update.py runs):
  rewards [T, B, C] --aggregate_rewards--> [T, B] | [T, B, C]
    --gae (chunk) / to_action_level+gae+from_action_level (action) / grpo_advantages--> adv [T, B] | [T, B, C]
    --loop.flatten--> [N = T*B] | [N, C]        (row n = t*B + b)
  step_mask [N, C] & loss_mask [N, 1]  (GRPO's loss_mask drops the steps after each env's first done)
  logprobs [T, B, C, D] --flatten--> [N, C, D] --reduce_logprobs--> [N] | [N, C] | [N, C, D]
  adv --expand_advantages--> the same shape; step_mask [N, C] --loss_mask_for--> the same shape
  --> ppo_actor_loss(logprobs, old_logprobs, advantages, loss_mask), all one shape.

Hand case: T=2, B=2, C=2, D=2. Env 0 TERMINATES after the first action of chunk step 0 (its second action is
not executed: step_mask False, reward 0, log-prob NaN), then auto-resets and runs chunk step 1 fully. Env 1
never finishes. gamma = 0.5, lam = 1.
"""

import itertools
import math

import numpy as np
import pytest
import torch

from tasks.algorithms import (
    LOGPROB_TYPES,
    REWARD_TYPES,
    aggregate_rewards,
    check_granularity,
    expand_advantages,
    from_action_level,
    gae,
    grpo_advantages,
    loss_mask_for,
    ppo_actor_loss,
    reduce_logprobs,
    to_action_level,
)
from tasks.actor.loop import SAMPLE_FIELDS, flatten
from tasks.trajectory import FIELDS

T, B, C, D = 2, 2, 2, 2
N = T * B
GAMMA, LAM = 0.5, 1.0
NAN = float("nan")
ALLOWED = [(r, lp) for r, lp in itertools.product(REWARD_TYPES, LOGPROB_TYPES)
           if not (r == "action_level" and lp == "chunk_level")]


def _rollout() -> dict[str, torch.Tensor]:
    return {
        "rewards": torch.tensor([[[1.0, 0.0], [0.5, 0.25]],  # t=0: env 0's 2nd action not executed -> 0
                                 [[2.0, 2.0], [0.0, 1.0]]], dtype=torch.float64),  # [T, B, C]
        "terminated": torch.tensor([[True, False], [False, False]]),  # [T, B]
        "truncated": torch.zeros(T, B, dtype=torch.bool),
        "step_mask": torch.tensor([[[True, False], [True, True]],
                                   [[True, True], [True, True]]]),  # [T, B, C]
        # chunk-level values V(s_t) [T+1, B, 1]; row T is the bootstrap value
        "values_chunk": torch.tensor([[[0.5], [1.0]], [[0.0], [0.5]], [[1.0], [2.0]]], dtype=torch.float64),
        # action-level values [T+1, B, C]; 9.0 sits at the non-executed action (garbage); row T uses [..., 0]
        "values_action": torch.tensor([[[0.5, 9.0], [1.0, 0.5]],
                                       [[0.0, 0.0], [0.5, 0.25]],
                                       [[1.0, 0.0], [2.0, 0.0]]], dtype=torch.float64),
        "final_values": torch.zeros(T, B, dtype=torch.float64),
        "logprobs": torch.tensor([[[[-1.0, -2.0], [NAN, NAN]], [[-0.5, -0.25], [-1.0, -1.0]]],
                                  [[[-2.0, -1.0], [-0.5, -0.5]], [[-1.0, -3.0], [-2.0, -2.0]]]],
                                 dtype=torch.float64),  # [T, B, C, D]
    }


# ---------------------------------------------------------------- hand-computed advantages [T, B(, C)]
# chunk-level GAE on r = [[1, .75], [4, 1]], V = [[.5, 1], [0, .5]], bootstrap [1, 2]:
#   env 0: t=1 delta = 4 + .5*1 - 0 = 4.5;     t=0 terminated: delta = 1 - .5 = .5 (recursion cut)
#   env 1: t=1 delta = 1 + .5*2 - .5 = 1.5;    t=0 delta = .75 + .5*.5 - 1 = 0, A = 0 + .5*1.5 = .75
GAE_CHUNK = [[0.5, 0.75], [4.5, 1.5]]
# action-level GAE on the unrolled axis (t*C + c), done flag at env 0's last executed action (position 0):
#   env 0: r = [1, 0, 2, 2], V = [.5, 9, 0, 0 | 1]: A3 = 2 + .5 - 0 = 2.5, A2 = 2 + .5*2.5 = 3.25,
#          A1 = (0 + 0 - 9) + .5*3.25 = -7.375 (not executed: garbage, masked), A0 = 1 - .5 = .5 (terminated)
#   env 1: r = [.5, .25, 0, 1], V = [1, .5, .5, .25 | 2]: A3 = 1 + 1 - .25 = 1.75,
#          A2 = (.125 - .5) + .875 = .5, A1 = (.25 + .25 - .5) + .25 = .25, A0 = (.5 + .25 - 1) + .125 = -.125
GAE_ACTION = [[[0.5, -7.375], [-0.125, 0.25]], [[3.25, 2.5], [0.5, 1.75]]]
# GRPO (group_size 2 = both envs): scores env 0 = 1 (terminated at t=0), env 1 = .75 + 1 = 1.75;
#   mean 1.375, unbiased std = .375*sqrt(2), A = -+.375 / (std + 1e-6); env 0's chunk step 1 is after its
#   first done: loss_mask False, advantage 0.
_A = 0.375 / (0.375 * math.sqrt(2.0) + 1e-6)
GRPO_CHUNK = [[-_A, _A], [0.0, _A]]
GRPO_ACTION = [[[-_A, 0.0], [_A, _A]], [[0.0, 0.0], [_A, _A]]]
GRPO_LOSS_MASK = [[True, True], [False, True]]


def _advantages(estimator: str, reward_type: str, ro: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages [T, B] or [T, B, C] and the chunk steps that enter the loss, loss_mask [T, B] bool
    (GAE: every step with an executed action; GRPO: each env's first episode, grpo_advantages' loss_mask)."""
    rewards = aggregate_rewards(ro["rewards"], reward_type=reward_type)  # [T, B] | [T, B, C]
    step_mask = ro["step_mask"]
    if estimator == "grpo":
        out = grpo_advantages(rewards=rewards, terminated=ro["terminated"], truncated=ro["truncated"],
                              step_mask=step_mask, group_size=2)
        assert out["loss_mask"].tolist() == GRPO_LOSS_MASK
        return out["advantages"], out["loss_mask"]
    if reward_type == "chunk_level":
        adv, _ = gae(rewards=rewards, values=ro["values_chunk"][..., 0], terminated=ro["terminated"],
                     truncated=ro["truncated"], final_values=ro["final_values"], gamma=GAMMA, lam=LAM)
        return adv, step_mask.any(-1)
    flat = to_action_level(rewards=rewards, values=ro["values_action"], terminated=ro["terminated"],
                           truncated=ro["truncated"], final_values=ro["final_values"], step_mask=step_mask)
    adv, _ = gae(**flat, gamma=GAMMA, lam=LAM)  # [T*C, B]
    return from_action_level(adv, num_action_chunks=C), step_mask.any(-1)  # [T, B, C]


def _train_batch(adv: torch.Tensor, loss_mask: torch.Tensor, ro: dict) -> dict[str, torch.Tensor]:
    """One shard's sample fields through the real tasks.actor.loop.flatten, then the step mask the update uses:
    step_mask [N, C] & loss_mask [N, 1] (the chunk steps that enter the loss)."""
    fields = {
        "obs": np.zeros((T, B, 3), np.float32),
        "task_id": np.zeros((T, B), np.int64),  # one task: every sample prompted with instruction 0
        "actions": np.zeros((T, B, C, D), np.float32),
        "logprobs": ro["logprobs"].numpy(),
        "values": np.zeros((T, B, 1)),
        "advantages": adv.numpy(),
        "returns": np.zeros(tuple(adv.shape)),
        "step_mask": ro["step_mask"].numpy(),
        "loss_mask": loss_mask.numpy(),
    }
    always = [f.name for f in FIELDS if f.name in SAMPLE_FIELDS and not f.when]  # rgb: only with env.obs_mode=rgb
    assert set(always) <= set(fields), f"update consumes new fields: {set(always) - set(fields)}"
    data = flatten([{k: fields[k] for k in always}])
    lm = data["loss_mask"] if "loss_mask" in data else loss_mask.reshape(N)  # [T, B] -> [N]
    data["step_mask"] = data["step_mask"] & lm[:, None]  # [N, C] & [N, 1]
    return data


@pytest.mark.parametrize("reward_type,logprob_type", ALLOWED)
@pytest.mark.parametrize("estimator", ["gae", "grpo"])
def test_rollout_to_ppo_loss_shapes_and_values(estimator, reward_type, logprob_type):
    check_granularity(reward_type, logprob_type)
    ro = _rollout()
    adv, loss_mask = _advantages(estimator, reward_type, ro)
    expected_adv = {("gae", "chunk_level"): GAE_CHUNK, ("gae", "action_level"): GAE_ACTION,
                    ("grpo", "chunk_level"): GRPO_CHUNK, ("grpo", "action_level"): GRPO_ACTION}
    adv_shape = (T, B) if reward_type == "chunk_level" else (T, B, C)
    assert adv.shape == adv_shape
    ref = torch.tensor(expected_adv[estimator, reward_type], dtype=torch.float64)
    torch.testing.assert_close(adv, ref)

    data = _train_batch(adv, loss_mask, ro)
    assert data["logprobs"].shape == (N, C, D) and data["step_mask"].shape == (N, C)
    assert data["advantages"].shape == ((N,) if reward_type == "chunk_level" else (N, C))
    # row n = t*B + b
    torch.testing.assert_close(data["advantages"], ref.reshape(N, *ref.shape[2:]))

    sm = data["step_mask"]
    old_lp = reduce_logprobs(data["logprobs"], step_mask=sm, logprob_type=logprob_type)
    lp_mask = loss_mask_for(sm, logprob_type=logprob_type, action_dim=D)
    a = expand_advantages(data["advantages"], logprob_type=logprob_type, num_action_chunks=C, action_dim=D)
    target = {"chunk_level": (N,), "action_level": (N, C), "token_level": (N, C, D)}[logprob_type]
    assert old_lp.shape == lp_mask.shape == a.shape == target
    assert lp_mask.dtype == torch.bool and not torch.isnan(old_lp).any()

    # values of the masks and log-probs (rows: (t0,e0), (t0,e1), (t1,e0), (t1,e1))
    grpo = estimator == "grpo"
    row_ok = [True, True, not grpo, True]  # GRPO drops env 0's second episode
    act_ok = [[True, False], [True, True], [not grpo, not grpo], [True, True]]
    if logprob_type == "chunk_level":
        assert lp_mask.tolist() == row_ok
        torch.testing.assert_close(old_lp, torch.tensor([-3.0, -2.75, -4.0 if not grpo else 0.0, -8.0],
                                                        dtype=torch.float64))
    elif logprob_type == "action_level":
        assert lp_mask.tolist() == act_ok
        lp = [[-3.0, 0.0], [-0.75, -2.0], [-3.0, -1.0], [-4.0, -4.0]]
        if grpo:
            lp[2] = [0.0, 0.0]
        torch.testing.assert_close(old_lp, torch.tensor(lp, dtype=torch.float64))
    else:
        assert lp_mask.tolist() == [[[m, m] for m in row] for row in act_ok]
        torch.testing.assert_close(old_lp[0], torch.tensor([[-1.0, -2.0], [0.0, 0.0]], dtype=torch.float64))
        torch.testing.assert_close(old_lp[3], ro["logprobs"][1, 1])

    # expanded advantages: a chunk advantage is copied to every action / dimension
    a_rows = a.reshape(N, -1)  # [N, ...] -> [N, C or C*D or 1]
    flat_ref = ref.reshape(N, -1)  # [N, 1] (chunk) or [N, C] (action)
    if reward_type == "chunk_level":
        torch.testing.assert_close(a_rows, flat_ref.expand_as(a_rows))
    elif logprob_type == "action_level":
        torch.testing.assert_close(a, flat_ref)
    else:
        torch.testing.assert_close(a, flat_ref.unsqueeze(-1).expand(N, C, D))

    # the loss the update computes: at ratio 1 the clipped surrogate is -masked_mean(A); masked garbage
    # (the -7.375 advantage, the NaN log-probs) must not leak in
    new_lp = old_lp.clone().requires_grad_(True)
    out = ppo_actor_loss(logprobs=new_lp, old_logprobs=old_lp, advantages=a, loss_mask=lp_mask,
                         clip_ratio_low=0.2, clip_ratio_high=0.2)
    expected_loss = -a[lp_mask].mean()
    torch.testing.assert_close(out["loss"], expected_loss)
    out["loss"].backward()
    assert torch.isfinite(new_lp.grad).all()
    assert torch.equal(new_lp.grad[~lp_mask], torch.zeros_like(new_lp.grad[~lp_mask]))


@pytest.mark.parametrize("estimator", ["gae", "grpo"])
def test_action_level_rewards_with_chunk_level_logprobs_is_refused(estimator):
    with pytest.raises(ValueError, match="action_level.*chunk_level"):
        check_granularity("action_level", "chunk_level")
    ro = _rollout()
    adv, loss_mask = _advantages(estimator, "action_level", ro)
    data = _train_batch(adv, loss_mask, ro)
    with pytest.raises(ValueError, match="cannot weight"):
        expand_advantages(data["advantages"], logprob_type="chunk_level", num_action_chunks=C, action_dim=D)


def test_every_pair_is_either_allowed_or_refused():
    for reward_type, logprob_type in itertools.product(REWARD_TYPES, LOGPROB_TYPES):
        if (reward_type, logprob_type) in ALLOWED:
            check_granularity(reward_type, logprob_type)
        else:
            with pytest.raises(ValueError):
                check_granularity(reward_type, logprob_type)
    assert len(ALLOWED) == 5
