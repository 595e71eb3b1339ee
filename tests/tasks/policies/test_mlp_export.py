"""The mlp family's `hf/` export (tasks.policies.mlp.model: save_pretrained / from_pretrained, written by
tasks.actor.export.write_export at every checkpoint): the directory `policy.model_path` takes rebuilds a policy that
acts exactly as the one exported, from its own config.json (family, config, lengths) and model.safetensors."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from tasks.actor.export import write_export
from tasks.config import ConfigError
from tasks.policies import make_policy
from tasks.policies.mlp.configuration import MLPConfig

O, D = 35, 8  # PushCube-v1's state and pd_joint_delta_pos action lengths


def _trained(cfg: MLPConfig, seed: int = 0) -> torch.nn.Module:
    """An mlp whose every parameter, the log-std included, moved off its initialisation (as training moves them)."""
    pol = make_policy(cfg, obs_dim=O, action_dim=D, seed=seed, load=False)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in pol.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    return pol


def test_export_load_round_trip_acts_as_the_source(tmp_path):
    """make_policy(model_path=export) holds the source's tensors exactly, so on the same observations its
    deterministic actions (the eval's), its log-probs of the same sampled actions (mean and log-std) and its values
    are equal; a fresh policy of the same config is not (the load is what makes them equal)."""
    cfg = MLPConfig(hidden_sizes=[32, 16], activation="relu", init_logstd=-1.5)
    src = _trained(cfg)
    hf = write_export(src, str(tmp_path / "hf"), {"simulator": "maniskill", "env_id": "PushCube-v1"})
    meta = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (meta["family"], meta["obs_dim"], meta["action_dim"], meta["num_values"]) == ("mlp", O, D, 1)
    assert meta["policy"]["hidden_sizes"] == [32, 16] and meta["policy"]["activation"] == "relu"
    assert meta["obs_normalization"] is None and meta["actions"]["clip"] == [-1.0, 1.0]
    assert meta["env"]["env_id"] == "PushCube-v1"
    assert {p.name for p in (tmp_path / "hf").iterdir()} == {"config.json", "model.safetensors", "dagrl_files.json"}

    loaded = make_policy(replace(cfg, model_path=hf), obs_dim=O, action_dim=D, seed=123)
    fresh = make_policy(cfg, obs_dim=O, action_dim=D, seed=123, load=False)
    own, got = src.state_dict(), loaded.state_dict()
    assert own.keys() == got.keys() and all(torch.equal(own[k], got[k]) for k in own)
    obs = {"state": torch.randn(64, O, generator=torch.Generator().manual_seed(7))}
    a, b = src.act(obs, deterministic=True), loaded.act(obs, deterministic=True)
    assert torch.equal(a["actions"], b["actions"]) and torch.equal(a["values"], b["values"])
    sampled = src.act(obs)["actions"]
    assert torch.equal(src.evaluate(obs, sampled)["logprobs"], loaded.evaluate(obs, sampled)["logprobs"])
    assert not torch.equal(fresh.act(obs, deterministic=True)["actions"], a["actions"])


def test_from_pretrained_rebuilds_from_the_directory_alone(tmp_path):
    """`from_pretrained` needs no config of its own: sizes, activation and lengths come from config.json."""
    from tasks.policies.mlp.model import MLPPolicy
    src = _trained(MLPConfig(hidden_sizes=[8], activation="gelu", num_action_chunks=2), seed=3)
    src.save_pretrained(tmp_path / "hf")
    got = MLPPolicy.from_pretrained(tmp_path / "hf")
    assert got.cfg.hidden_sizes == [8] and got.cfg.activation == "gelu" and (got.C, got.D) == (2, D)
    assert all(torch.equal(v, got.state_dict()[k]) for k, v in src.state_dict().items())


def test_a_load_into_other_sizes_names_model_path(tmp_path):
    """Past the offline checks (a directory without the keys they compare), the load itself refuses tensors of
    other shapes with ConfigError(policy.model_path)."""
    src = _trained(MLPConfig(hidden_sizes=[16]))
    hf = write_export(src, str(tmp_path / "hf"))
    with pytest.raises(ConfigError) as e:
        make_policy(MLPConfig(hidden_sizes=[32], model_path=hf), obs_dim=O, action_dim=D)
    assert e.value.key == "policy.model_path" and "tensor shapes differ" in str(e.value)
    with pytest.raises(ConfigError) as e:  # another state length (another env): the first layer's shape
        make_policy(MLPConfig(hidden_sizes=[16], model_path=hf), obs_dim=O + 1, action_dim=D)
    assert e.value.key == "policy.model_path"
