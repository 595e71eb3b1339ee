"""policy.device / policy.dtype / algorithm.offload / env.sim_backend=physx_cuda: offline checks with one-line
errors naming the key; the device helpers; and, with CUDA, a replica computing on the GPU in bf16."""
from __future__ import annotations

import pytest
import torch

from pipelines.config import load_config
from tasks.config import ConfigError, replace_keys
from tasks.device import autocast, policy_device, to_device, to_numpy

HAS_CUDA = torch.cuda.is_available()


def test_defaults_keep_the_cpu_path():
    cfg, _ = load_config([])
    assert (cfg.policy.device, cfg.policy.dtype, cfg.algorithm.offload, cfg.env.sim_backend) == \
        ("cpu", "float32", False, "physx_cpu")
    assert policy_device(cfg) == torch.device("cpu")
    with pytest.raises(ConfigError, match="nothing to move"):  # a no-op with policy.device=cpu: refused
        load_config(["algorithm.offload=true"])


@pytest.mark.parametrize("overrides, key, words", [
    (["policy.device=tpu"], "policy.device", "use one of ['cpu', 'cuda']"),
    (["policy.dtype=float16"], "policy.dtype", "use one of ['float32', 'bfloat16']"),
    (["policy.dtype=bfloat16"], "policy.dtype", "set policy.device=cuda"),
    (["algorithm.offload=true", "algorithm.num_actor_ranks=2", "cluster.num_gpu_workers=2"], "algorithm.offload",
     "algorithm.num_actor_ranks=1"),
    (["env.sim_backend=physx_gpu"], "env.sim_backend", "use one of"),
])
def test_bad_device_settings_are_config_errors(overrides, key, words):
    with pytest.raises(ConfigError) as info:
        load_config(overrides)
    assert info.value.key == key and words in str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.skipif(HAS_CUDA, reason="checks the refusal on a machine without CUDA")
@pytest.mark.parametrize("override, key, fix", [("env.sim_backend=physx_cuda", "env.sim_backend",
                                                 "use env.sim_backend=physx_cpu"),
                                                ("policy.device=cuda", "policy.device", "use policy.device=cpu")])
def test_cuda_settings_are_refused_offline_without_cuda(override, key, fix):
    with pytest.raises(ConfigError) as info:
        load_config([override])
    assert info.value.key == key and "CUDA" in info.value.fix and fix in info.value.fix


def test_autocast_and_conversion_helpers():
    x = torch.randn(4, 8)
    w = torch.randn(8, 3)
    with autocast("float32", torch.device("cpu")):
        assert (x @ w).dtype == torch.float32
    with autocast("bfloat16", torch.device("cpu")):  # the same context on CUDA; here on the CPU's autocast
        y = x @ w
    assert y.dtype == torch.bfloat16
    out = to_numpy(y)
    assert out.dtype.name == "float32" and out.shape == (4, 3)
    obs = {"state": x}
    assert to_device(obs, torch.device("cpu")) is obs


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_replica_acts_on_cuda_in_bf16_and_offloads():
    import numpy as np

    from tasks import resident, rollout
    cfg, _ = load_config(["policy.device=cuda", "policy.dtype=bfloat16", "algorithm.offload=true",
                          "policy.hidden_sizes=[64,64]"])
    from tasks.policies import make_policy
    pol = make_policy(cfg.policy, obs_dim=5, action_dim=3, num_values=1, image_size=None, load=False)
    w = {"version": 0, "state_dict": pol.state_dict()}
    rep = rollout.get_replica(cfg, "gpu-test", w, 5, 3)
    assert next(rep.module.parameters()).device.type == "cuda" and rep.last_sync["bytes"] > 0
    out = rollout._act(rep, rollout.policy_obs(rep.module, np.zeros((16, 5), np.float32), None, ""))
    assert out["actions"].shape == (16, 1, 3) and out["actions"].dtype == np.float32
    before = torch.cuda.memory_allocated()
    rep.offload()
    assert next(rep.module.parameters()).device.type == "cpu" and torch.cuda.memory_allocated() < before
    rollout.get_replica(cfg, "gpu-test", w, 5, 3)  # onload, no new load
    assert next(rep.module.parameters()).device.type == "cuda" and rep.last_sync["bytes"] == 0
    resident.release("gpu-test")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype, tol", [("float32", 1e-4), ("bfloat16", 5e-2)])
def test_actor_update_on_cuda_matches_the_cpu_update(dtype, tol):
    """One PPO update (tasks.actor.entries.actor_update) of the same batch with the same permutation on the CPU and with
    policy.device=cuda: float32 equal up to kernel summation order (1e-4), bf16 autocast within 5e-2; the weights
    handed out are CPU tensors either way."""
    from tasks import resident
    from tasks.actor import entries
    from tests.tasks.test_distributed import _cfg, _initial_weights, _shard
    outs = {}
    for device in ("cpu", "cuda"):
        cfg = replace_keys(_cfg(), {"policy.device": device, "policy.dtype": dtype if device == "cuda" else "float32"})
        w0 = _initial_weights(cfg)
        with torch.random.fork_rng():
            torch.manual_seed(7)
            outs[device] = entries.actor_update(cfg, f"gpu-upd-{device}", w0, _shard(0), _shard(1))
        resident.release(f"gpu-upd-{device}")
    for k, v in outs["cuda"]["state_dict"].items():
        assert v.device.type == "cpu"
        torch.testing.assert_close(v, outs["cpu"]["state_dict"][k], atol=tol, rtol=tol)
    assert not torch.equal(outs["cpu"]["state_dict"]["actor_mean.0.weight"],
                           _initial_weights(_cfg())["state_dict"]["actor_mean.0.weight"])
