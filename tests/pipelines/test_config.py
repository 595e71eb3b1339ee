"""Config loading: Hydra composition onto the structured schema, validation errors, and the CLI's exit on them."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipelines.config import load_config
from tasks.config import Config, ConfigError

REPO = Path(__file__).resolve().parents[2]


def test_default_config_composes():
    cfg, dcfg = load_config([])
    assert isinstance(cfg, Config)
    assert cfg.experiment == "pushcube_ppo" and dcfg.experiment == "pushcube_ppo"
    assert (cfg.env.env_id, cfg.env.num_envs, cfg.env.num_shards) == ("PushCube-v1", 32, 2)
    assert cfg.policy.hidden_sizes == [256, 256, 256]
    # derived values
    assert cfg.env.shard_size == 16 and cfg.batch_size == 3200 and cfg.minibatch_size == 400
    assert cfg.num_segments == 2


def test_conf_smoke_selects_the_smoke_experiment():
    cfg, _ = load_config(["conf=smoke"])
    assert cfg.experiment == "smoke"
    assert (cfg.env.num_envs, cfg.rollout.chunk_steps, cfg.runner.max_steps) == (4, 10, 3)
    assert cfg.cluster.dashboard_address == "127.0.0.1:0"


def test_overrides_are_typed():
    cfg, _ = load_config(["conf=smoke", "env.num_envs=8", "algorithm.gamma=0.95", "runner.resume=latest",
                          "policy.hidden_sizes=[32,32]"], components=False)
    assert cfg.env.num_envs == 8 and isinstance(cfg.env.num_envs, int)
    assert cfg.algorithm.gamma == 0.95 and cfg.runner.resume == "latest"
    assert cfg.policy.hidden_sizes == [32, 32]


@pytest.mark.parametrize("overrides, key, words", [
    (["env.foo=1"], "env.foo", "unknown key"),
    (["+bar=1"], "bar", "unknown key"),
    (["+env.foo=1"], "env.foo", "unknown key"),
    (["env.num_envs=abc"], "env.num_envs", "wrong type"),
    (["conf=nope"], "conf", "available: ['pickcube_ppo', 'pushcube_flow_grpo', 'pushcube_flow_ppo', 'pushcube_flow_sft', 'pushcube_ppo', 'pushcube_record', 'smoke']"),
    (["env.num_envs=5"], "env.num_envs", "divisible by env.num_shards=2"),
    (["algorithm.num_minibatches=7"], "algorithm.num_minibatches", "must divide"),
    (["rollout.chunk_steps_per_node=7"], "rollout.chunk_steps_per_node", "must divide rollout.chunk_steps=100"),
    (["algorithm.reward_type=action_level", "algorithm.logprob_type=chunk_level"], "algorithm.logprob_type",
     "per-action log-probs"),
    (["env.env_id=NotAnEnv-v1"], "env.env_id", "not a ManiSkill env task"),
    (["env.env_id=PickSingleYCB-v1"], "env.env_id", "needs downloaded assets"),
    (["policy.name=nope"], "policy.name", "known policies: ['flow_vla'"),
    (["env.obs_mode=pointcloud"], "env.obs_mode", "supported"),
    (["env.eval.num_envs=3"], "env.eval.num_envs", "divisible by env.num_shards=2"),
    (["runner.max_steps=0"], "runner.max_steps", ">= 1"),
    (["algorithm.gamma=1.5"], "algorithm.gamma", "(0, 1]"),
    (["algorithm.num_minibatches=7"], "algorithm.num_minibatches",
     "must divide the batch of rollout.chunk_steps*env.num_envs=3200 samples"),
    # VLA recipe keys
    (["conf=pushcube_flow_grpo", "algorithm.group_size=3"], "algorithm.group_size",
     "must divide env.num_envs=128 and the env shard size 64"),
    (["conf=pushcube_flow_grpo", "algorithm.group_size=1"], "algorithm.group_size", "use >= 2"),
    (["conf=pushcube_flow_grpo", "algorithm.adv_type=gae"], "algorithm.adv_type", "uses adv_type=grpo"),
    (["conf=pushcube_flow_sft", "sft.store=/nonexistent.zarr"], "sft.store", "no zarr store there"),
    (["conf=pushcube_flow_ppo", "policy.model_path=/nonexistent"], "policy.model_path",
     "not a save_pretrained checkpoint directory"),
    (["conf=pushcube_flow_ppo", "policy.noise_method=flow_ode"], "policy.noise_method", "flow_sde or flow_noise"),
    (["conf=pushcube_flow_ppo", "env.image_size=4"], "env.image_size", "8..512"),
    (["conf=pushcube_flow_ppo", "policy.value_head=max_token"], "policy.value_head", "mean_token"),
    (["conf=pushcube_flow_ppo", "env.image_size=36"], "env.image_size", "multiple of the tiny preset's patch_size=8"),
    (["algorithm.num_actor_ranks=2", "algorithm.micro_batch_size=3"], "algorithm.micro_batch_size", "must divide"),
    (["algorithm.global_batch_size=800"], "algorithm.global_batch_size",
     "used by the multi-rank update only (algorithm.num_actor_ranks > 1)"),
])
def test_bad_input_is_a_one_line_config_error_naming_the_key(overrides, key, words):
    if "PickSingleYCB-v1" in overrides[0]:
        from mani_skill.utils.assets.data import is_data_source_downloaded
        if is_data_source_downloaded("ycb"):
            pytest.skip("YCB assets are downloaded on this machine")
    with pytest.raises(ConfigError) as info:
        load_config(overrides)
    msg = str(info.value)
    assert "\n" not in msg
    assert msg.startswith(f"{key}="), msg
    assert info.value.key == key
    assert words in msg


def test_component_placement_overrides_need_no_plus():
    """`cluster.component_placement` has the keys actor, env, rollout (empty: the defaults), so Hydra overrides
    them without `+`; values are strings (device specs are parsed by pipelines.cluster)."""
    cfg, _ = load_config(["cluster.component_placement.actor=0-3", "cluster.component_placement.rollout=2",
                          "cluster.num_gpus=4"], components=False)
    assert cfg.cluster.component_placement == {"actor": "0-3", "env": "", "rollout": "2"}
    assert cfg.cluster.num_gpus == 4
    cfg, _ = load_config([], components=False)
    assert cfg.cluster.component_placement == {"actor": "", "env": "", "rollout": ""} and cfg.cluster.num_gpus is None


def test_missing_vulkan_is_reported_with_the_fix(monkeypatch, tmp_path):
    import tasks.envs.vulkan as vk
    monkeypatch.setattr(vk, "PROJECT_ICD", tmp_path / "nope" / "lvp_icd.json")
    monkeypatch.setattr(vk, "SYSTEM_ICD_DIRS", ())
    monkeypatch.delenv("VK_ICD_FILENAMES", raising=False)
    monkeypatch.delenv("VK_DRIVER_FILES", raising=False)
    with pytest.raises(vk.VulkanMissingError, match="scripts/setup.sh"):
        load_config([])
    # components=False skips the driver check (offline schema validation only)
    cfg, _ = load_config([], components=False)
    assert cfg.experiment == "pushcube_ppo"


def _cli(args, cwd):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")}
    env["PYTHONPATH"] = str(REPO)
    return subprocess.run([sys.executable, "-m", "pipelines.run", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120)


def test_cli_bad_config_exits_2_with_one_line_and_writes_nothing(tmp_path):
    run_root = tmp_path / "runs"
    proc = _cli(["env.num_envs=5", f"run_root={run_root}"], cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: env.num_envs=5: must be divisible by env.num_shards=2")
    assert "Traceback" not in proc.stderr + proc.stdout
    assert not run_root.exists()
    assert list(tmp_path.iterdir()) == []  # nothing in the working directory either (no Hydra outputs/, no mlruns)


def test_cli_show_prints_the_resolved_config(tmp_path):
    proc = _cli(["conf=smoke", "--show", "env.num_envs=8"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "experiment: smoke" in proc.stdout and "num_envs: 8" in proc.stdout
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("override,key", [
    ("runner.max_wall_time_s=-5", "runner.max_wall_time_s"),
    ("algorithm.lr=0", "algorithm.lr"),
    ("policy.hidden_sizes=[]", "policy.hidden_sizes"),
    ("runner.max_retries=-1", "runner.max_retries"),
    ("env.num_shards=0", "env.num_shards"),
    ("runner.stop_on_eval_success=1.5", "runner.stop_on_eval_success"),
    ("cluster.num_gpus=0", "cluster.num_gpus"),
    ("+cluster.component_placement.critic=0", "cluster.component_placement.critic"),
])
def test_out_of_range_values_name_the_key(override, key):
    with pytest.raises(ConfigError) as err:
        load_config([override], components=False)
    assert str(err.value).startswith(key + "=") and "\n" not in str(err.value)


def test_cluster_address_that_never_answers_fails_fast(tmp_path, capsys):
    """A port that accepts TCP but is no Dask scheduler: one-line error within the timeout, exit 2."""
    import socket
    import time

    from pipelines.run import main
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(5)
    port = srv.getsockname()[1]
    try:
        t0 = time.monotonic()
        rc = main(["conf=smoke", f"run_root={tmp_path}", f"cluster.address=tcp://127.0.0.1:{port}",
                   "cluster.connect_timeout_s=2"])
        assert rc == 2 and time.monotonic() - t0 < 30
        err = capsys.readouterr().err.strip().splitlines()
        errors = [line for line in err if line.startswith("error:")]
        assert len(errors) == 1 and err[-1] == errors[0] and errors[0].startswith("error: cluster.address=")
        assert "Traceback" not in "".join(err)
        # smoke.yaml's local-cluster keys are switched off by cluster.address: one note each, not silence
        assert all(line.startswith("note: cluster.") and "conf/conf/smoke.yaml" in line for line in err[:-1])
        assert len(err) == 3
        assert not any(tmp_path.iterdir())
    finally:
        srv.close()


def test_run_refuses_a_record_conf_and_prints_help(capsys):
    from pipelines.run import main
    assert main(["conf=pushcube_record"]) == 2  # an rgb env with the state-only mlp: a record conf, not training
    assert "pipelines.record" in capsys.readouterr().err
    assert main(["--help"]) == 0
    assert "python -m pipelines.run" in capsys.readouterr().out
