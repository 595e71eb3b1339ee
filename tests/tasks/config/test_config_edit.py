"""A built config is never changed in place: every section (and every family's class) is a frozen dataclass, and
`tasks.config.replace_key` / `replace_keys` make a changed copy (tasks/config/edit.py)."""
from __future__ import annotations

import dataclasses
import pickle

import pytest

from tasks.config import Config, ConfigError, families, family_class, replace_key, replace_keys
from tasks.config import schema


def test_every_section_and_every_family_is_frozen():
    classes = [c for c in vars(schema).values() if isinstance(c, type) and dataclasses.is_dataclass(c)]
    classes += [c for s in ("policy", "env", "cluster") for c in families(s).values()]
    assert len(classes) > 13
    assert [c.__name__ for c in classes if not c.__dataclass_params__.frozen] == []
    cfg = Config()
    for obj, name in ((cfg, "seed"), (cfg.env, "num_envs"), (cfg.env.eval, "seed"), (cfg.policy, "name"),
                      (cfg.cluster, "kind"), (cfg.algorithm, "lr")):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(obj, name, getattr(obj, name))


def test_replace_key_copies_the_path_and_leaves_the_original():
    cfg = Config()
    before = pickle.dumps(cfg)
    out = replace_key(cfg, "env.eval.num_episodes", cfg.env.eval.num_episodes + 5)
    assert out.env.eval.num_episodes == cfg.env.eval.num_episodes + 5
    assert pickle.dumps(cfg) == before  # the original is as it was
    # the sections on the path are new objects of the same (family) class; the others are shared
    assert out.env is not cfg.env and out.env.eval is not cfg.env.eval and type(out.env) is type(cfg.env)
    assert out.policy is cfg.policy and out.algorithm is cfg.algorithm and out.env.num_envs == cfg.env.num_envs
    # the same change from a section down
    assert replace_key(cfg.env, "eval.num_episodes", 3).eval.num_episodes == 3


def test_replace_keys_applies_in_order_and_takes_whole_sections():
    cfg = Config()
    flow = family_class("policy", "pi0")
    out = replace_keys(cfg, {"policy": flow(), "policy.num_action_chunks": 4, "algorithm.lr": cfg.algorithm.lr / 2,
                             "seed": cfg.seed + 1})
    assert type(out.policy) is flow and out.policy.num_action_chunks == 4  # the later key applies to the new section
    assert (out.algorithm.lr, out.seed) == (cfg.algorithm.lr / 2, cfg.seed + 1)
    assert type(cfg.policy) is family_class("policy", "mlp") and cfg.policy.num_action_chunks == 1
    assert pickle.loads(pickle.dumps(out)) == out  # what a Dask worker receives


def test_a_key_no_section_has_is_one_config_error_with_the_close_ones():
    with pytest.raises(ConfigError) as e:
        replace_key(Config(), "env.num_env", 4)
    assert e.value.key == "env.num_env" and "did you mean 'num_envs'" in str(e.value)
    with pytest.raises(ConfigError) as e:  # a key of another family is not a key of this one
        replace_key(Config(), "policy.num_denoise_steps", 2)
    assert e.value.key == "policy.num_denoise_steps" and "MLPConfig has no key 'num_denoise_steps'" in str(e.value)
    with pytest.raises(ConfigError, match=r"^env.num_envs.x=4: int is not a config section"):
        replace_key(Config(), "env.num_envs.x", 4)
