"""The two-stage composition (pipelines.compose_values: group choices composed once, value overrides applied to a
copy by Hydra's own function) gives what one Hydra composition of every override gives: the same DictConfig (values,
unresolved interpolations, struct mode) and, for bad input, the same error line."""
from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from pipelines.compose import _compose
from tasks.config import ConfigError

CASES = [
    [],
    ["conf=smoke"],
    ["conf=pushcube_ppo", "algorithm.lr=1e-4", "seed=3"],
    ["conf=smoke", "policy=pi0_tiny", "policy.num_action_chunks=2"],
    ["policy.num_action_chunks=2", "conf=smoke", "policy=pi0_tiny"],  # a value before the group choice it edits
    ["conf=smoke", "env=pushcube_vla", "algorithm=grpo", "env.num_envs=8"],
    ["conf=smoke", "algorithm=grpo_vla"],
    ["conf=smoke", "runner.max_steps=7", "runner.max_steps=9"],  # the last wins
    ["conf=smoke", "env.num_envs=${runner.max_steps}"],  # an interpolation stays one
    ["conf=smoke", "runner.resume=null"],
    ["conf=smoke", "+algorithm.lr_scale={actor.head: 0.5}"],
    ["conf=smoke", "++runner.max_steps=4"],
    ["conf=smoke", "++brand_new.key=1"],
    ["conf=smoke", "~runner.val_check_interval"],  # a schema key: refused
    ["conf=smoke", "+algorithm.lr_scale={a: 0.5, b: 2}", "~algorithm.lr_scale.a"],  # a dict's entry: deleted
    ["conf=smoke", "experiment=renamed"],
    ["conf=libero_smoke", "env.task_ids=[0,2]"],
    ["conf=smoke", "cluster=slurm", "cluster.queue=gpu"],
    # bad input: the same error either way
    ["conf=smoke", "runner.max_stepz=3"],
    ["conf=smoke", "runner.max_steps=three"],
    ["conf=smoke", "+runner.max_steps=4"],
    ["conf=smoke", "~runner.no_such_key"],
    ["conf=nope"],
    ["conf=smoke", "policy=nope"],
    ["conf=smoke", "runner.max_steps=[1,"],
    ["conf=smoke", "policy@x=mlp"],
]


def _outcome(overrides, in_two_stages):
    try:
        dcfg = _compose(overrides, in_two_stages=in_two_stages)
    except ConfigError as exc:
        return "error", str(exc)
    return OmegaConf.to_container(dcfg, resolve=False), OmegaConf.is_struct(dcfg)


@pytest.mark.parametrize("overrides", CASES, ids=lambda o: " ".join(o) or "defaults")
def test_two_stages_compose_what_one_hydra_composition_does(overrides):
    two, one = _outcome(overrides, True), _outcome(overrides, False)
    assert two == one


def test_the_bad_cases_are_refused_and_the_good_ones_edit_what_they_name():
    """The comparison above is not between two failures or two copies of the defaults."""
    assert _outcome(["conf=smoke", "runner.max_stepz=3"], True)[0] == "error"
    good, struct = _outcome(["conf=pushcube_ppo", "algorithm.lr=1e-4", "seed=3"], True)
    assert struct and good["algorithm"]["lr"] == 1e-4 and good["seed"] == 3
    deleted, _ = _outcome(["conf=smoke", "+algorithm.lr_scale={a: 0.5, b: 2}", "~algorithm.lr_scale.a"], True)
    assert deleted["algorithm"]["lr_scale"] == {"b": 2.0}
    moved, _ = _outcome(["policy.num_action_chunks=2", "conf=smoke", "policy=pi0_tiny"], True)
    assert moved["policy"]["name"] == "pi0" and moved["policy"]["num_action_chunks"] == 2


def _keys(d, prefix=""):
    out = set()
    for k, v in d.items():
        out |= _keys(v, f"{prefix}{k}.") if isinstance(v, dict) and v else {f"{prefix}{k}"}
    return out


def test_the_params_check_reads_the_keys_to_dict_gives():
    """`check_params` checks MLflow's param names on `dataclasses.asdict(cfg)` (cheap) instead of `to_dict` (the
    dict the run logs): both must hold the same keys, for an experiment of each policy family and env family, with a
    dict-valued key."""
    import dataclasses

    from pipelines.compose import to_config, to_dict
    for name in ("smoke", "pushcube_token_grpo", "pushcube_pi0_grpo", "libero_pi05_ppo"):
        overrides = [f"conf={name}", "policy.model_path=null", "+algorithm.lr_scale={a.b: 0.5}"]
        cfg = to_config(_compose(overrides), validate=False)
        assert _keys(dataclasses.asdict(cfg)) == _keys(to_dict(cfg)), name
        assert "algorithm.lr_scale.a.b" in _keys(to_dict(cfg))
