"""The update's integrity on one rank (tasks.actor): non-finite rollout values are an error or masked and counted
(algorithm.nonfinite), a step with a non-finite loss or gradient is never applied (PPO and SFT), critic warm-up
trains the critic only, every random draw is a function of (seed, version, rank), and the optimizer state (with
parameters that have no state yet) survives a save/load exactly. All on the CPU MLP, seconds in all."""
from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch

from tasks import resident
from tasks.actor.entries import actor_init, actor_update, advantages
from tasks.actor.loop import flatten, prepare_update
from tasks.actor.nonfinite import NonFiniteError
from tasks.actor.state import load_optimizer_state, optimizer_state, rng_state
from tasks.config import Config, replace_key, replace_keys
from tasks.config import check_config

T, B, C, D, O = 4, 2, 1, 2, 3  # the issue's [4, 2] rollout
NAN = float("nan")


def _cfg(**algo) -> Config:
    return replace_keys(Config(), {
        "rollout.chunk_steps": T, "env.num_envs": B, "env.num_shards": 1,
        "policy.hidden_sizes": [8, 8], "policy.num_action_chunks": C,
        "algorithm.update_epochs": 2, "algorithm.num_minibatches": 2, "algorithm.target_kl": None,
        **{f"algorithm.{k}": v for k, v in algo.items()}})


def _traj(seed: int = 0) -> dict:
    """One shard's rollout output (tasks.rollout.trajectory fields), no done inside the rollout."""
    r = np.random.default_rng(seed)
    f = np.float32
    return {"obs": r.standard_normal((T, B, O)).astype(f), "actions": r.standard_normal((T, B, C, D)).astype(f),
            "logprobs": (r.standard_normal((T, B, C, D)) * 0.1 - 1.0).astype(f),
            "values": r.standard_normal((T, B, 1)).astype(f), "final_values": np.zeros((T, B, 1), f),
            "rewards": r.standard_normal((T, B, C)).astype(f), "terminated": np.zeros((T, B), bool),
            "truncated": np.zeros((T, B), bool), "step_mask": np.ones((T, B, C), bool),
            "bootstrap_values": r.standard_normal((B, 1)).astype(f), "weight_version": 3}


# ----- non-finite rollout values: error or mask ---------------------------------------------------------------
def test_one_nan_reward_is_an_error_naming_field_shard_env_and_step():
    traj = _traj()
    traj["rewards"][2, 1, 0] = NAN
    with pytest.raises(NonFiniteError, match=r"non-finite rewards: 1 value\(s\) in the rollout of shard 0 \(weights "
                                             r"v3\), first at env 1, chunk step 2, action 0: .*algorithm.nonfinite=mask"):
        advantages(_cfg(), traj, shard=0)


@pytest.mark.parametrize("field, index, dropped", [
    # field[index] = NaN -> chunk steps (t, b) that leave the loss, from the dependencies of GAE (no done here)
    ("rewards", (2, 1, 0), {(0, 1), (1, 1), (2, 1)}),  # A_t for t <= 2 of env 1 sums delta_2
    ("values", (0, 0, 0), {(0, 0)}),  # V(s_0) enters delta_0 only (and return_0)
    ("values", (3, 1, 0), {(0, 1), (1, 1), (2, 1), (3, 1)}),  # V(s_3) enters delta_2 (bootstrap) and delta_3
    ("bootstrap_values", (0, 0), {(0, 0), (1, 0), (2, 0), (3, 0)}),
    ("obs", (1, 0, 2), {(1, 0)}),  # an input of that sample's forward pass only
    ("logprobs", (3, 1, 0, 1), {(3, 1)}),
    ("actions", (0, 1, 0, 0), {(0, 1)}),
])
def test_mask_mode_drops_exactly_the_dependent_samples_and_counts_them(field, index, dropped):
    cfg = _cfg(nonfinite="mask")
    clean = advantages(cfg, _traj())
    traj = _traj()
    traj[field][index] = NAN
    out = advantages(cfg, traj, shard=0)
    got = {(t, b) for t in range(T) for b in range(B) if not out["loss_mask"][t, b]}
    assert got == dropped
    assert out["nonfinite"] == {field: 1.0, "dropped": float(len(dropped))}
    keep = out["loss_mask"]
    np.testing.assert_array_equal(out["advantages"][keep], clean["advantages"][keep])  # the rest untouched
    for k in ("obs", "actions", "logprobs", "values", "advantages", "returns"):  # nothing non-finite goes on
        assert np.isfinite(out[k]).all(), k
    # the example: the normalised advantages are finite for all 8 samples, normalised over the kept ones
    prep = prepare_update(cfg, flatten([out]))
    adv = prep["adv"].reshape(T, B)
    assert torch.isfinite(adv).all()
    kept = adv[torch.from_numpy(keep)]
    assert abs(float(kept.mean())) < 1e-5 and abs(float(kept.std(unbiased=False)) - 1.0) < 1e-4
    assert (adv[~torch.from_numpy(keep)] == 0).all()


def test_mask_mode_ignores_values_that_are_never_read():
    cfg = _cfg(nonfinite="mask")
    traj = _traj()
    traj["step_mask"][3, 0, 0] = False  # not executed: its reward/log-prob/action are never read
    traj["rewards"][3, 0, 0] = traj["logprobs"][3, 0, 0, 0] = NAN
    traj["final_values"][1, 1, 0] = NAN  # no truncation there: V(final_obs) is not read
    out = advantages(cfg, traj)
    assert out["nonfinite"] == {"dropped": 0.0}
    assert advantages(_cfg(), traj)["nonfinite"] == {"dropped": 0.0}  # and no error in error mode


def test_grpo_mask_mode_leaves_the_env_out_of_its_group():
    cfg = _cfg(nonfinite="mask", name="grpo", group_size=2)
    traj = _traj()
    traj["rewards"][1, 0, 0] = NAN
    out = advantages(cfg, traj)
    assert not out["loss_mask"][:, 0].any() and out["loss_mask"][:, 1].all()
    assert (out["advantages"] == 0).all()  # one member left: no spread (group_size 1 semantics)
    assert out["nonfinite"] == {"rewards": 1.0, "dropped": 4.0}


# ----- a step with a non-finite loss or gradient is never applied -----------------------------------------------
def _snapshot(actor) -> tuple[dict, dict]:
    return ({k: v.clone() for k, v in actor.policy.state_dict().items()},
            copy.deepcopy(optimizer_state(actor.policy, actor.optimizer)))


def _assert_same_state(a: tuple[dict, dict], b: tuple[dict, dict]) -> None:
    pa, oa = a
    pb, ob = b
    assert pa.keys() == pb.keys() and all(torch.equal(pa[k], pb[k]) for k in pa)
    assert oa["param_groups"] == ob["param_groups"] and oa["state"].keys() == ob["state"].keys()
    for n in oa["state"]:
        for k, v in oa["state"][n].items():
            assert torch.equal(v, ob["state"][n][k]), (n, k)


@pytest.fixture
def run_id():
    yield "integrity"
    resident.release("integrity/")


def _trained_actor(cfg, run_id):
    w = actor_init(cfg, run_id, (O, D))
    samples = [advantages(cfg, _traj())]
    w = actor_update(cfg, run_id, w, *samples)  # Adam has state now: a skip must leave it untouched too
    return w, samples, resident.get(f"{run_id}/actor")


def test_nan_gradient_skips_every_step_and_changes_nothing(run_id):
    cfg = _cfg()
    w, samples, actor = _trained_actor(cfg, run_id)
    before = _snapshot(actor)
    hook = actor.policy.critic[0].weight.register_hook(lambda g: g * NAN)  # one gradient made NaN
    try:
        out = actor_update(cfg, run_id, w, *samples)
    finally:
        hook.remove()
    m = out["metrics"]
    assert m["train/skipped_updates"] == 4.0 and m["train/minibatch_updates"] == 0.0  # 2 epochs x 2 minibatches
    assert math.isnan(m["train/actor_loss"]) and math.isnan(m["train/grad_norm"])  # nothing applied: NaN, logged
    _assert_same_state(before, _snapshot(actor))
    assert all(torch.equal(v, before[0][k]) for k, v in out["state_dict"].items())


def test_nan_in_one_sample_skips_exactly_the_minibatches_holding_it(run_id):
    cfg = _cfg()
    w, samples, actor = _trained_actor(cfg, run_id)
    bad = dict(samples[0])
    bad["returns"] = bad["returns"].copy()
    bad["returns"][1, 0] = NAN  # reaches the critic loss of the one minibatch per epoch that draws it
    out = actor_update(cfg, run_id, w, bad)
    m = out["metrics"]
    assert m["train/skipped_updates"] == 2.0 and m["train/minibatch_updates"] == 2.0
    assert math.isfinite(m["train/actor_loss"])
    assert all(torch.isfinite(v).all() for v in actor.policy.state_dict().values())


def test_sft_update_skips_a_nan_gradient(run_id):
    from tasks.demos import sft_update
    cfg = _cfg(name="sft")
    w = actor_init(cfg, run_id, (O, D))
    r = np.random.default_rng(0)
    batches = [{"obs": r.standard_normal((4, O)).astype(np.float32),
                "actions": r.standard_normal((4, C, D)).astype(np.float32),
                "task_id": np.zeros(4, np.int64)} for _ in range(3)]  # every stored sample names its task
    w = sft_update(cfg, run_id, w, batches)
    actor = resident.get(f"{run_id}/actor")
    before = _snapshot(actor)
    hook = actor.policy.actor_mean[0].weight.register_hook(lambda g: g * NAN)
    try:
        out = sft_update(cfg, run_id, w, batches)
    finally:
        hook.remove()
    assert out["metrics"]["train/skipped_updates"] == 3.0 and out["metrics"]["train/minibatch_updates"] == 0.0
    assert math.isnan(out["metrics"]["train/sft_loss"])
    _assert_same_state(before, _snapshot(actor))


# ----- critic warm-up, randomness rule, optimizer state --------------------------------------------------------
def test_critic_warmup_trains_only_the_critic(run_id):
    cfg = _cfg(critic_warmup_steps=1)
    w0 = actor_init(cfg, run_id, (O, D))
    samples = [advantages(cfg, _traj())]
    w1 = actor_update(cfg, run_id, w0, *samples)
    assert w1["metrics"]["train/critic_only"] == 1.0
    for k, v in w1["state_dict"].items():
        assert torch.equal(v, w0["state_dict"][k]) == (not k.startswith("critic.")), k
    w2 = actor_update(cfg, run_id, w1, *samples)  # version 1: warm-up over, the actor trains
    assert w2["metrics"]["train/critic_only"] == 0.0
    assert not torch.equal(w2["state_dict"]["actor_mean.0.weight"], w1["state_dict"]["actor_mean.0.weight"])


def test_update_draws_depend_on_seed_and_version_only(run_id):
    cfg = _cfg()
    outs = []
    for seed in (0, 123):
        w = actor_init(cfg, run_id, (O, D))
        torch.manual_seed(seed)  # whatever the process's stream holds
        state = torch.get_rng_state()
        outs.append(actor_update(cfg, run_id, w, advantages(cfg, _traj())))
        assert torch.equal(torch.get_rng_state(), state)  # the update neither consumed nor moved it
        resident.release(f"{run_id}/")
    for k in outs[0]["state_dict"]:
        assert torch.equal(outs[0]["state_dict"][k], outs[1]["state_dict"][k]), k


@pytest.mark.parametrize("legacy", [False, True])
def test_optimizer_state_round_trip_keeps_stateless_params_stateless(run_id, legacy):
    """Resume in warm-up: the actor's parameters have no Adam state when saved; after loading they must have
    none either, so the first actor step after warm-up is the uninterrupted run's (bit for bit). `legacy`: the
    older, integer-keyed format (one process's `optimizer.state_dict()`) is refused on load and resumes the same
    once `pipelines.upgrade` has keyed it by name."""
    from pipelines.upgrade import _optimizer_names, fqn_optimizer
    cfg = _cfg(critic_warmup_steps=1)
    w0 = actor_init(cfg, run_id, (O, D))
    samples = [advantages(cfg, _traj())]
    w1 = actor_update(cfg, run_id, w0, *samples)
    actor = resident.get(f"{run_id}/actor")
    saved = optimizer_state(actor.policy, actor.optimizer)
    assert set(saved["state"]) == {n for n, _ in actor.policy.named_parameters() if n.startswith("critic.")}
    opt = copy.deepcopy(saved)
    if legacy:
        old = copy.deepcopy(actor.optimizer.state_dict())
        with pytest.raises(ValueError, match=r"not keyed by parameter name .*python -m pipelines.upgrade"):
            load_optimizer_state(actor.policy, actor.optimizer, old)
        opt = fqn_optimizer(old, _optimizer_names(cfg, w1["state_dict"]), w1["state_dict"], "test")
    ckpt = {"policy": w1["state_dict"], "run": {"weight_version": 1}, "rng": rng_state(), "optimizer": opt}
    uninterrupted = actor_update(cfg, run_id, w1, *samples)
    resident.release(f"{run_id}/")
    w1b = actor_init(cfg, run_id, (O, D), checkpoint=ckpt)
    resumed_actor = resident.get(f"{run_id}/actor")
    assert not resumed_actor.optimizer.state[resumed_actor.policy.actor_logstd]  # no state, as when saved
    resumed = actor_update(cfg, run_id, w1b, *samples)
    for k in uninterrupted["state_dict"]:
        assert torch.equal(uninterrupted["state_dict"][k], resumed["state_dict"][k]), k


def test_optimizer_state_of_another_layout_is_refused(run_id):
    cfg = _cfg()
    actor_init(cfg, run_id, (O, D))
    actor = resident.get(f"{run_id}/actor")
    saved = optimizer_state(actor.policy, actor.optimizer)
    saved["param_groups"][0]["params"] = saved["param_groups"][0]["params"][1:]
    with pytest.raises(ValueError, match="param_groups name other parameters"):
        load_optimizer_state(actor.policy, actor.optimizer, saved)


def test_nonfinite_mode_is_checked_offline():
    from tasks.config import ConfigError
    cfg = replace_key(Config(), "algorithm.nonfinite", "ignore")
    with pytest.raises(ConfigError, match=r"algorithm.nonfinite='ignore': use 'error' .* or 'mask'"):
        check_config(cfg)
