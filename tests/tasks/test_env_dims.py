"""tasks.rollout.env_dims caches the env task's (obs_dim, action_dim) per process, keyed by the whole env section:
two env configs that differ in any key (here LIBERO's object_state, which lengthens the state vector) get their
own probe, and the same config is probed once."""
from __future__ import annotations

import dataclasses

import tasks.envs
from tasks import resident
from tasks.config import Config
from tasks.config.registry import family_class
from tasks.rollout import env_dims


class _Probe:
    def __init__(self, env_cfg):
        self.obs_dim = 9 + 20 * bool(getattr(env_cfg, "object_state", False))
        self.action_dim = 7

    def close(self):
        pass


def test_env_dims_probe_once_per_distinct_env_section(monkeypatch):
    built = []

    def make_single_env(env_cfg):
        built.append(env_cfg)
        return _Probe(env_cfg)

    monkeypatch.setattr(tasks.envs, "make_single_env", make_single_env)
    monkeypatch.setattr(resident, "_registry", lambda reg={}: reg)  # a fresh per-test registry
    libero = family_class("env", "libero")
    plain = Config(env=libero())
    with_objects = Config(env=dataclasses.replace(libero(), object_state=True))
    assert env_dims(plain) == (9, 7)
    assert env_dims(with_objects) == (29, 7)  # not the cached (9, 7) of the config without object state
    assert env_dims(plain) == (9, 7)
    assert len(built) == 2
