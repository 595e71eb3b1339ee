"""The advantage estimator registry (tasks.algorithms.estimators) and the specs declared beside it
(tasks.algorithms.specs.ESTIMATORS): lookup and its errors, both tables naming the same estimators, hand-computed cases
through the one signature, and callers asking the estimator instead of the name."""

import dataclasses
import math

import numpy as np
import pytest

import tasks.algorithms.estimators as est_mod
import tasks.algorithms.specs as specs_mod
import tasks.config as config_mod
from tasks.algorithms import Estimator, estimator_names, get_estimator, register_estimator
from tasks.algorithms.specs import ESTIMATORS, SFT, EstimatorSpec
from tasks.config import Config, ConfigError, replace_keys


def test_every_spec_has_an_estimator_and_back():
    assert estimator_names() == sorted(ESTIMATORS)
    for name, spec in ESTIMATORS.items():
        est = get_estimator(name)
        assert isinstance(est, Estimator) and est.spec is spec and est.name == name
        assert spec.normalisation in specs_mod.NORMALISATIONS
        assert set(spec.keys) <= set(specs_mod.ESTIMATOR_KEYS)
        assert all(k in config_mod.AlgorithmConfig.__dataclass_fields__ for k in spec.keys)


def test_unknown_duplicate_and_undeclared_names_list_the_known_ones(monkeypatch):
    monkeypatch.setattr(est_mod, "_ESTIMATORS", dict(est_mod._ESTIMATORS))
    with pytest.raises(ValueError, match=r"unknown advantage estimator 'gae'; known: \['grpo', 'ppo', 'rloo'\]"):
        get_estimator("gae")
    with pytest.raises(ValueError, match=r"'ppo' is already registered; known: \['grpo', 'ppo', 'rloo'\]"):
        register_estimator("ppo")(type("Again", (Estimator,), {}))
    with pytest.raises(ValueError, match=r"'dummy' has no EstimatorSpec in tasks.algorithms.specs.ESTIMATORS \(known: "
                                         r"\['grpo', 'ppo', 'rloo'\]\)"):
        register_estimator("dummy")(type("Dummy", (Estimator,), {}))
    spec = dataclasses.replace(ESTIMATORS["grpo"], name="dummy")
    monkeypatch.setitem(specs_mod.ESTIMATORS, "dummy", spec)
    monkeypatch.setattr(est_mod, "SPECS", specs_mod.ESTIMATORS)
    cls = register_estimator("dummy")(type("Dummy", (Estimator,), {}))
    assert isinstance(get_estimator("dummy"), cls) and get_estimator("dummy").spec is spec
    assert estimator_names() == ["dummy", "grpo", "ppo", "rloo"]


def test_algorithm_name_selects_the_spec():
    a = Config().algorithm
    assert a.spec is ESTIMATORS["ppo"]
    a = dataclasses.replace(a, name="grpo")
    assert a.spec is ESTIMATORS["grpo"]
    a = dataclasses.replace(a, name="sft")  # an algorithm like the others: its spec says it has no estimator and rolls nothing out
    assert a.spec is SFT and not a.spec.estimator and not a.spec.rollout and not a.spec.critic
    assert "sft" not in ESTIMATORS and "sft" not in estimator_names()
    a = dataclasses.replace(a, name="gae")
    with pytest.raises(ConfigError, match=r"algorithm.name='gae': known: \['ppo', 'grpo', 'rloo', 'sft'\]"):
        a.spec


def _traj(rewards, **kw):
    """A rollout of T chunk steps, B envs, C=1 action per chunk, no done unless given."""
    r = np.asarray(rewards, np.float32)[..., None]  # [T, B] -> [T, B, 1]
    T, B = r.shape[:2]
    t = {"rewards": r, "terminated": np.zeros((T, B), bool), "truncated": np.zeros((T, B), bool),
         "step_mask": np.ones((T, B, 1), bool)}
    t.update(kw)
    return t


def _call(name, traj, **algo):
    a = dataclasses.replace(Config().algorithm, name=name, **algo)
    T, B = traj["terminated"].shape
    return get_estimator(name).advantages(traj=traj, algorithm=a, num_action_chunks=1,
                                          bad_steps=np.zeros((T, B), bool), bad_inputs={})


def test_ppo_estimator_hand_computed():
    """T=2, B=1, gamma=0.5, lambda=1: delta_1 = 2 + 0.5*1 - 0.25 = 2.25, delta_0 = 1 + 0.5*0.25 - 0.5 = 0.625,
    A_1 = 2.25, A_0 = 0.625 + 0.5*2.25 = 1.75; returns = A + V."""
    traj = _traj([[1.0], [2.0]], values=np.array([[[0.5]], [[0.25]]], np.float32),
                 final_values=np.zeros((2, 1, 1), np.float32), bootstrap_values=np.array([[1.0]], np.float32))
    out = _call("ppo", traj, gamma=0.5, gae_lambda=1.0)
    np.testing.assert_allclose(out["advantages"], [[1.75], [2.25]], rtol=1e-6)
    np.testing.assert_allclose(out["returns"], [[2.25], [2.5]], rtol=1e-6)
    assert out["loss_mask"].all() and not out["dropped"].any()


def test_grpo_estimator_hand_computed():
    """One group of 2 envs, episode scores 1 and 3 (sum over T=2): mean 2, unbiased std sqrt(2):
    A = -+1 / (sqrt(2) + 1e-6), on every chunk step of the (only) episode; no critic: returns 0."""
    out = _call("grpo", _traj([[0.5, 1.0], [0.5, 2.0]]), group_size=2)
    a = 1 / (math.sqrt(2) + 1e-6)
    np.testing.assert_allclose(out["advantages"], [[-a, a], [-a, a]], rtol=1e-6)
    assert (out["returns"] == 0).all() and out["loss_mask"].all()


def test_rloo_estimator_hand_computed():
    """One group of 3 envs with episode scores 1, 2, 6 (T=1): leave-one-out baselines (2+6)/2 = 4, (1+6)/2 = 3.5,
    (1+2)/2 = 1.5, so A = -3, -1.5, 4.5 (no std division; they sum to 0 as g/(g-1) * (score - mean) does)."""
    out = _call("rloo", _traj([[1.0, 2.0, 6.0]]), group_size=3)
    np.testing.assert_allclose(out["advantages"], [[-3.0, -1.5, 4.5]], rtol=1e-6)
    assert (out["returns"] == 0).all() and out["loss_mask"].all()


def test_rloo_masks_like_grpo_and_drops_members_it_cannot_compare():
    """Two groups of 2 (T=2). Env 0 ends at t=0, so t=1 (a new episode) is not scored: score 1. Mask mode, a NaN
    reward in env 3's scored episode: env 3 leaves its group, env 2 has no other member left -> A = 0 for both and
    env 3 is dropped. Group 0: scores 1 and 1 + 3 = 4 -> A = 1 - 4 = -3 and 4 - 1 = 3."""
    r = np.array([[1.0, 1.0, 5.0, np.nan], [7.0, 3.0, 5.0, 1.0]], np.float32)
    term = np.zeros((2, 4), bool)
    term[0, 0] = True
    traj = _traj(np.nan_to_num(r), terminated=term)
    bad = {"rewards": np.isnan(r)}
    a = dataclasses.replace(Config().algorithm, name="rloo", group_size=2)
    out = get_estimator("rloo").advantages(traj=traj, algorithm=a, num_action_chunks=1,
                                           bad_steps=np.zeros((2, 4), bool), bad_inputs=bad)
    np.testing.assert_allclose(out["advantages"], [[-3.0, 3.0, 0.0, 0.0], [0.0, 3.0, 0.0, 0.0]], rtol=1e-6)
    assert out["loss_mask"].tolist() == [[True, True, True, False], [False, True, True, False]]
    assert out["dropped"].tolist() == [[False, False, False, True], [False, False, False, True]]


def test_update_asks_the_estimator_not_the_name(monkeypatch):
    """tasks.actor reads only the spec: a critic-free estimator's values are not checked for non-finite values,
    and its advantages are left as they are when its normalisation is per group (and normalised over the batch
    when it is "batch")."""
    import torch
    from tasks.actor import entries, loop

    spec = EstimatorSpec(name="const", advantage="const", label="CONST", summary="test", critic=False,
                         groups=False, whole_episodes=False, normalisation="group", keys=())
    monkeypatch.setitem(specs_mod.ESTIMATORS, "const", spec)
    monkeypatch.setattr(est_mod, "SPECS", specs_mod.ESTIMATORS)
    monkeypatch.setattr(est_mod, "_ESTIMATORS", dict(est_mod._ESTIMATORS))

    @register_estimator("const")
    class Const(Estimator):
        def advantages(self, *, traj, algorithm, num_action_chunks, bad_steps, bad_inputs):
            T, B = traj["terminated"].shape
            adv = np.arange(T * B, dtype=np.float32).reshape(T, B)
            return {"advantages": adv, "returns": np.zeros_like(adv), "loss_mask": np.ones((T, B), bool),
                    "dropped": np.zeros((T, B), bool), "stats": {"rollout/x": 1.0}}

    T, B = 2, 2
    cfg = replace_keys(Config(), {"algorithm.name": "const", "policy.num_action_chunks": 1})
    traj = _traj(np.ones((T, B)), obs=np.zeros((T, B, 3), np.float32), actions=np.zeros((T, B, 1, 2), np.float32),
                 logprobs=np.zeros((T, B, 1, 2), np.float32), values=np.full((T, B, 1), np.nan, np.float32),
                 final_values=np.zeros((T, B, 1), np.float32), bootstrap_values=np.zeros((B, 1), np.float32))
    out = entries.advantages(cfg, traj, shard=0)  # NaN values: not read without a critic, so no error
    assert out["stats"] == {"rollout/x": 1.0} and out["nonfinite"] == {"dropped": 0.0}
    prep = loop.prepare_update(cfg, loop.flatten([out]))
    assert torch.equal(prep["adv"], torch.arange(4, dtype=torch.float32)) and prep["critic"] is False
    monkeypatch.setitem(specs_mod.ESTIMATORS, "const", dataclasses.replace(spec, normalisation="batch"))
    monkeypatch.setattr(Const, "spec", specs_mod.ESTIMATORS["const"])
    prep = loop.prepare_update(cfg, loop.flatten([out]))
    x = torch.arange(4, dtype=torch.float64)
    torch.testing.assert_close(prep["adv"].double(), (x - x.mean()) / (x.std(unbiased=False) + 1e-8), atol=1e-5, rtol=1e-5)
