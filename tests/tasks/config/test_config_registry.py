"""The family registry (tasks.config.registry) and families as config classes: a family is a dataclass subclassing its
section's base, registered by name; a key it lacks is an unknown key for it, refused naming the family."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch

from tasks.config import (SELECTORS, Config, ConfigError, PolicyConfig, check_config, families, family_class,
                          register_family, replace_key)
from tasks.config import registry
from tasks.config.registry import RETIRED
from tasks.config.schema import ClusterConfig, EnvConfig

BASES = {"policy": PolicyConfig, "env": EnvConfig, "cluster": ClusterConfig}


@pytest.mark.parametrize("section", sorted(SELECTORS))
def test_every_family_is_a_dataclass_of_its_base_named_by_its_selector(section):
    found = families(section)
    assert set(registry.MODULES[section]) <= set(found)
    for name, cls in found.items():
        assert issubclass(cls, BASES[section]) and dataclasses.is_dataclass(cls), name
        assert getattr(cls(), SELECTORS[section]) == name  # the selector's default is the family's name
        base_keys = {f.name for f in dataclasses.fields(BASES[section])}
        assert base_keys <= {f.name for f in dataclasses.fields(cls)}  # every family has the base's keys


def test_a_config_defaults_to_the_default_families():
    cfg = Config()
    for section, name in registry.DEFAULTS.items():
        assert type(getattr(cfg, section)) is family_class(section, name)


def test_policy_families_hold_their_own_keys_only():
    mlp, flow, token = (family_class("policy", n) for n in ("mlp", "pi0", "token_vla"))
    keys = {c: {f.name for f in dataclasses.fields(c)} for c in (mlp, flow, token)}
    assert {"hidden_sizes", "activation", "init_logstd"} <= keys[mlp]
    assert not keys[mlp] & {"preset", "sizes", "value_head", "num_denoise_steps", "action_bins", "temperature"}
    assert "hidden_sizes" not in keys[flow] and "action_bins" not in keys[flow]
    assert "noise_method" not in keys[token] and "hidden_sizes" not in keys[token]
    shared = {"preset", "sizes", "use_state", "normalize_state", "normalize_actions", "max_prompt_len", "value_head",
              "value_detach", "critic_state"}  # the VLA base
    assert shared <= keys[token]
    assert {"preset", "max_prompt_len", "value_head", "value_detach", "noise_method"} <= keys[flow]


def test_an_unknown_family_names_the_selector_the_known_ones_and_a_close_one():
    with pytest.raises(ConfigError) as e:
        family_class("policy", "token_vl")
    assert e.value.key == "policy.name" and "'token_vla'" in str(e.value) and "did you mean 'token_vla'" in str(e.value)
    with pytest.raises(ConfigError) as e:
        family_class("env", "maniskil")
    assert e.value.key == "env.simulator" and "did you mean 'maniskill'" in str(e.value)


def test_register_refuses_what_cannot_be_a_family():
    with pytest.raises(ValueError, match="unknown config section"):
        register_family("algorithm", "x")
    with pytest.raises(ValueError, match="not a dataclass"):
        register_family("policy", "x")(type("X", (), {}))

    @dataclass
    class Loose:  # a family's config is frozen, as every section
        name: str = "x"
    with pytest.raises(ValueError, match=r"Loose must be @dataclass\(frozen=True\)"):
        register_family("policy", "x")(Loose)

    @dataclass(frozen=True)
    class Misnamed(PolicyConfig):
        name: str = "other"
    with pytest.raises(ValueError, match="must default to 'x'"):
        register_family("policy", "x")(Misnamed)

    @dataclass(frozen=True)
    class AnotherMLP(PolicyConfig):
        name: str = "mlp"
    with pytest.raises(ValueError, match="registered already"):
        register_family("policy", "mlp")(AnotherMLP)


def test_the_mlp_rules_know_the_models_activations():
    from tasks.policies.mlp.checks import ACTIVATIONS
    from tasks.policies.mlp.model import ACTIVATIONS as MODEL_ACTIVATIONS
    assert sorted(ACTIVATIONS) == sorted(MODEL_ACTIVATIONS)


def test_a_retired_family_is_refused_in_one_line_naming_its_replacement():
    """RETIRED: a config naming a retired family (a command line, an old run's config.yaml) is told what replaces
    it, not given the list of known families."""
    for section, retired in RETIRED.items():
        for name, replacement in retired.items():
            with pytest.raises(ConfigError) as e:
                family_class(section, name)
            msg = str(e.value)
            assert e.value.key == f"{section}.{SELECTORS[section]}" and "\n" not in msg
            assert f"the {name} family was retired: use {replacement}" in msg and "known" not in msg
            assert name not in families(section)
    assert "policy.name=pi0" in RETIRED["policy"]["flow_vla"] and "policy=pi0_tiny" in RETIRED["policy"]["flow_vla"]


@pytest.mark.parametrize("name", ["mlp", "pi0", "token_vla"])
def test_each_policy_familys_defaults_pass_and_its_rules_run_from_check_config(name):
    cfg = Config(policy=family_class("policy", name)())
    if name == "pi0":  # pi0 reads camera images
        cfg = replace_key(cfg, "env.obs_mode", "rgb")
    check_config(cfg)
    bad = {"mlp": ("hidden_sizes", []), "pi0": ("noise_method", "sde"), "token_vla": ("temperature", 0.0)}[name]
    cfg = replace_key(cfg, f"policy.{bad[0]}", bad[1])
    with pytest.raises(ConfigError) as e:
        check_config(cfg)
    assert e.value.key == f"policy.{bad[0]}"


# ----- adding a family is local: a throwaway policy family (config, rule, model) and one registration -----

@pytest.fixture
def scratch_registry(monkeypatch):
    """The registry as it is, restored after the test (a family registered inside stays inside)."""
    monkeypatch.setattr(registry, "_CLASSES", {s: dict(v) for s, v in registry._CLASSES.items()})
    monkeypatch.setattr(registry, "_CHECKS", {s: dict(v) for s, v in registry._CHECKS.items()})


class LinearPolicy(torch.nn.Module):
    """The throwaway family's model: one linear map from the state to the mean action chunk."""

    def __init__(self, cfg, obs_dim, action_dim, num_values=1):
        super().__init__()
        self.cfg, self.C, self.D = cfg, cfg.num_action_chunks, action_dim
        self.linear = torch.nn.Linear(obs_dim, self.C * action_dim, bias=cfg.bias)


def _check_scale(cfg):
    if not cfg.policy.scale > 0:
        raise ConfigError("policy.scale", cfg.policy.scale, "use > 0")


def _register_linear():
    @register_family("policy", "linear_test", checks=(_check_scale,))
    @dataclass(frozen=True)
    class LinearConfig(PolicyConfig):
        name: str = "linear_test"
        scale: float = 1.0
        bias: bool = True
        model: ClassVar[str] = f"{__name__}:LinearPolicy"
        images: ClassVar[bool] = False
    return LinearConfig


def test_a_new_policy_family_is_one_class_one_rule_one_registration(scratch_registry):
    from pipelines.config import load_config
    from tasks.policies import make_policy
    cls = _register_linear()
    cfg = load_config(["policy.name=linear_test", "policy.scale=2.0", "policy.bias=false"], components=False)[0]
    assert type(cfg.policy) is cls and cfg.policy.scale == 2.0 and cfg.policy.bias is False
    policy = make_policy(cfg.policy, obs_dim=5, action_dim=3)
    assert isinstance(policy, LinearPolicy) and policy.linear.bias is None
    assert policy.linear.weight.shape == (cfg.policy.num_action_chunks * 3, 5)
    with pytest.raises(ConfigError) as e:  # its rule runs with every check
        load_config(["policy.name=linear_test", "policy.scale=0"], components=False)
    assert e.value.key == "policy.scale"
    with pytest.raises(ConfigError) as e:  # another family's key is unknown for it, naming the family
        load_config(["policy.name=linear_test", "policy.hidden_sizes=[4]"], components=False)
    assert e.value.key == "policy.hidden_sizes" and "unknown key for policy.name=linear_test" in str(e.value)
    assert "a key of policy.name=mlp" in str(e.value)
    with pytest.raises(ConfigError) as e:  # and its key for another family
        load_config(["policy.scale=2.0"], components=False)
    assert e.value.key == "policy.scale" and "unknown key for policy.name=mlp" in str(e.value)
