"""Config loading: Hydra composition onto the structured schema, validation errors, and the CLI's exit on them."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pipelines.config import load_config
from tasks.config import Config, ConfigError

REPO = Path(__file__).resolve().parents[2]
GRPO, PPO_VLA, SFT = "conf=pushcube_pi0_grpo", "conf=pushcube_pi0_ppo", "conf=pushcube_pi0_sft"
NO_SFT = "policy.model_path=null"  # the RL experiments require policy.model_path (a random init, explicitly)
def _families_with(key: str) -> str:
    """The policy families that have `key`, as the unknown-key error names them ("a|b|c", sorted)."""
    import dataclasses

    from tasks.config.registry import families
    return "|".join(sorted(n for n, c in families("policy").items() if key in {f.name for f in dataclasses.fields(c)}))


NEEDS_SFT_CHECKPOINT = ("pushcube_pi0_grpo", "pushcube_pi0_ppo", "pushcube_token_grpo", "libero_pi0_grpo",
                        "libero_pi0_ppo", "libero_pi05_ppo")  # RL from an SFT run (the pi0 / pi05 ones: a checkpoint)


@pytest.fixture(autouse=True)
def _cpu_only_machine(monkeypatch):
    """The expectations here are those of a CPU-only machine (logical GPU workers: cluster.num_gpu_workers)."""
    import pipelines.clusters.placement
    monkeypatch.setattr(pipelines.clusters.placement, "_cuda_device_count", lambda: 0)


def test_default_config_composes():
    cfg, dcfg = load_config([])
    assert isinstance(cfg, Config)
    assert cfg.experiment == "pushcube_ppo" and dcfg.experiment == "pushcube_ppo"
    assert (cfg.env.env_id, cfg.env.num_envs, cfg.env.num_shards) == ("PushCube-v1", 64, 2)
    assert cfg.policy.hidden_sizes == [256, 256, 256]
    # derived values
    assert cfg.env.shard_size == 32 and cfg.batch_size == 3200 and cfg.minibatch_size == 400
    assert cfg.num_segments == 1


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
    (["env.num_envs=abc"], "env.num_envs", "give an integer (e.g. env.num_envs=16)"),
    (["runner.progress=maybe"], "runner.progress", "give true or false (e.g. runner.progress=true)"),
    (["algorithm.lr=fast"], "algorithm.lr", "give a number"),
    (["conf=nope"], "conf", f"available: {sorted(p.stem for p in (REPO / 'conf' / 'conf').glob('*.yaml'))}"),
    (["env.num_envs=5"], "env.num_envs", "divisible by env.num_shards=2"),
    (["algorithm.num_minibatches=7"], "algorithm.num_minibatches", "must divide"),
    (["rollout.chunk_steps_per_node=7"], "rollout.chunk_steps_per_node", "must divide rollout.chunk_steps=50"),
    (["algorithm.reward_type=action_level", "algorithm.logprob_type=chunk_level"], "algorithm.logprob_type",
     "per-action log-probs"),
    (["env.env_id=NotAnEnv-v1"], "env.env_id", "not a ManiSkill env task"),
    (["env.env_id=PickSingleYCB-v1"], "env.env_id", "needs downloaded assets"),
    (["policy.name=nope"], "policy.name", "known policies: ['mlp', 'pi0'"),
    (["env.obs_mode=pointcloud"], "env.obs_mode", "supported"),
    (["env.eval.num_envs=3"], "env.eval.num_envs", "divisible by env.num_shards=2"),
    (["runner.max_steps=0"], "runner.max_steps", ">= 1"),
    (["algorithm.gamma=1.5"], "algorithm.gamma", "(0, 1]"),
    (["algorithm.num_minibatches=7"], "algorithm.num_minibatches",
     "must divide the batch of rollout.chunk_steps*env.num_envs=3200 samples"),
    # VLA recipe keys
    (["conf=pushcube_pi0_grpo", "policy.model_path=null", "algorithm.group_size=3"], "algorithm.group_size",
     "must divide env.num_envs=256 and the env shard size 128"),
    (["conf=pushcube_pi0_grpo", "policy.model_path=null", "algorithm.group_size=1"], "algorithm.group_size",
     "use >= 2"),
    # a key removed from the schema is an unknown key (a saved run that has one: tests/pipelines/test_upgrade.py)
    (["conf=pushcube_pi0_grpo", "policy.model_path=null", "algorithm.adv_type=gae"], "algorithm.adv_type",
     "unknown key"),
    (["+algorithm.adv_type=gae"], "algorithm.adv_type", "unknown key"),
    (["algorithm.name=gae"], "algorithm.name", "known: ['ppo', 'grpo', 'rloo', 'sft']"),
    (["conf=pushcube_pi0_sft", "sft.store=/nonexistent.zarr"], "sft.store", "no zarr store or LeRobot dataset"),
    (["conf=pushcube_pi0_ppo", "policy.model_path=/nonexistent"], "policy.model_path",
     "not a save_pretrained checkpoint directory"),
    (["conf=pushcube_pi0_ppo", "policy.model_path=null", "policy.noise_method=flow_ode"], "policy.noise_method",
     "flow_sde or flow_noise"),
    (["conf=pushcube_pi0_ppo", "policy.model_path=null", "env.image_size=4"], "env.image_size", "8..512"),
    (["conf=pushcube_pi0_ppo", "policy.model_path=null", "policy.value_head=max_token"], "policy.value_head",
     "mean_token"),
    (["conf=pushcube_token_grpo", "policy.model_path=null", "env.image_size=36"], "env.image_size",
     "multiple of the tiny preset's patch_size=8"),  # the token VLA's own patches (pi0's processor resizes)
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
    them without `+`; values are strings (device specs are parsed by pipelines.clusters)."""
    cfg, _ = load_config(["cluster.component_placement.actor=0-3", "cluster.component_placement.rollout=2",
                          "cluster.num_gpus=4"], components=False)
    assert cfg.cluster.component_placement == {"actor": "0-3", "env": "", "rollout": "2"}
    assert cfg.cluster.num_gpus == 4
    cfg, _ = load_config([], components=False)
    assert cfg.cluster.component_placement == {"actor": "", "env": "", "rollout": ""} and cfg.cluster.num_gpus is None


def test_missing_vulkan_is_reported_with_the_fix(monkeypatch, tmp_path):
    import tasks.envs.maniskill.vulkan as vk
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


def test_cli_show_prints_the_resolved_config(tmp_path, capsys, monkeypatch):
    """In this process (`python -m pipelines.run` itself: the test above): `main` is what the module runs."""
    from pipelines.run import main
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    assert main(["conf=smoke", "--show", "env.num_envs=8"]) == 0
    out = capsys.readouterr().out
    assert "experiment: smoke" in out and "num_envs: 8" in out
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
    # seeds: numpy and the simulators take reset seeds (seed + episode offsets) as unsigned 32-bit; a negative
    # env.seed passed the check and failed on the workers at step 1, a large env.eval.seed at the first eval
    ("env.seed=-3", "env.seed"),
    ("env.seed=4294967295", "env.seed"),
    ("env.eval.seed=4294967295", "env.eval.seed"),
    ("env.eval.seed=-1", "env.eval.seed"),
    ("seed=-2", "seed"),
    ("env.eval.val_episodes=-1", "env.eval.val_episodes"),
    ("env.eval.val_seed=4294967295", "env.eval.val_seed"),  # checked with a validation split (below: 0 episodes)
])
def test_out_of_range_values_name_the_key(override, key):
    extra = ["env.eval.val_episodes=10"] if key == "env.eval.val_seed" else []
    with pytest.raises(ConfigError) as err:
        load_config([override, *extra], components=False)
    assert str(err.value).startswith(key + "=") and "\n" not in str(err.value)


@pytest.mark.parametrize("val_seed,overlap", [
    (1_000_063, True),  # the default job's eval: seeds 1000000..1000063
    (999_991, True),  # 10 episodes 999991..1000000: the eval's first seed
    (999_990, False),  # 999990..999999: just below
    (1_000_064, False),  # just above
    (2_000_000, False),
])
def test_a_validation_split_must_not_overlap_the_eval(val_seed, overlap):
    """env.eval.val_seed's episodes [val_seed, val_seed + val_episodes) and the eval's [seed, seed + num_episodes)
    are disjoint, else a one-line error naming env.eval.val_seed and both seed ranges."""
    args = ["env.eval.val_episodes=10", f"env.eval.val_seed={val_seed}"]
    if not overlap:
        cfg, _ = load_config(args, components=False)
        assert cfg.env.eval.split("val").seed == val_seed and cfg.env.eval.split("val").num_episodes == 10
        assert cfg.env.eval.split("eval") is cfg.env.eval
        return
    with pytest.raises(ConfigError) as err:
        load_config(args, components=False)
    msg = str(err.value)
    assert msg.startswith(f"env.eval.val_seed={val_seed}") and "1000000..1000063" in msg and "\n" not in msg


def test_libero_refuses_a_validation_split():
    with pytest.raises(ConfigError) as err:
        load_config(["conf=libero_smoke", "env.eval.val_episodes=10"], components=False)
    assert str(err.value).startswith("env.eval.val_episodes=10") and "eval init states" in str(err.value)


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
        rc = main(["conf=smoke", f"run_root={tmp_path}", "cluster.kind=address",
                   f"cluster.address=tcp://127.0.0.1:{port}", "cluster.connect_timeout_s=2"])
        assert rc == 2 and time.monotonic() - t0 < 30
        err = capsys.readouterr().err.strip().splitlines()
        errors = [line for line in err if line.startswith("error:")]
        assert len(errors) == 1 and err[-1] == errors[0] and errors[0].startswith("error: cluster.address=")
        assert "Traceback" not in "".join(err)
        # smoke.yaml's local-cluster keys are switched off by cluster.kind=address: one note each, not silence
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


# ----- every key a user sets takes effect, or is refused -----

def _fake_sft_store(path: Path, C: int = 5, image: int = 32, gripper_convention: str | None = None,
                    obs_dim: int = 3) -> Path:
    """A one-step trajectory store with what `check_sft_store` reads: C-action chunks, rgb images, an obs_dim-D
    state, a success, task_id 0 / trial_id -1, and the `simulator` and `gripper_convention` attrs a recording
    writes (`gripper_convention` None: ManiSkill's store; "close_positive": a LIBERO one)."""
    import numpy as np

    from storage.trajectories import FieldSpec, TrajectoryStore, write_shard
    fields = {"obs": FieldSpec((obs_dim,), "float32"), "rgb": FieldSpec((image, image, 3), "uint8"),
              "task_id": FieldSpec((), "int64"), "trial_id": FieldSpec((), "int64"),
              "actions": FieldSpec((C, 8), "float32"), "rewards": FieldSpec((C,), "float32"),
              "step_mask": FieldSpec((C,), "bool"), "terminated": FieldSpec((), "bool"),
              "truncated": FieldSpec((), "bool"), "success": FieldSpec((), "bool"),
              "episode_id": FieldSpec((), "int64"), "episode_seed": FieldSpec((), "int64")}
    sim = "libero" if gripper_convention == "close_positive" else "maniskill"
    lod = {"robot_visual_lod": 1.0} if sim == "maniskill" else {}  # ManiSkill's images: the original meshes
    st = TrajectoryStore.create(path, fields=fields, T=2, num_envs=2, shard_size=2,
                                attrs={"simulator": sim, "gripper_convention": gripper_convention or "open_positive",
                                       **lod})
    st.reserve(0)
    data = {k: np.zeros((2, 2, *f.shape), f.dtype) for k, f in fields.items()}
    data["trial_id"][:] = -1
    data["step_mask"][:] = True
    data["success"][1] = data["truncated"][1] = True
    data["episode_id"][:] = [0, 1]
    write_shard(str(path), step=0, shard=0, data=data)
    st.mark_complete(0)
    return path


# ----- "did you mean" (tasks.config.close_matches: the one mechanism, env ids' too) -----

def _typo(name: str) -> str:
    return name[:len(name) // 2] + name[len(name) // 2 + 1:]  # the middle character dropped


def _schema_leaves(node=None, prefix=""):
    """The schema's leaf keys, walked from the dataclasses themselves (not from pipelines.config)."""
    import dataclasses
    node = Config() if node is None else node
    for f in dataclasses.fields(node):
        key = f"{prefix}.{f.name}" if prefix else f.name
        value = getattr(node, f.name)
        if dataclasses.is_dataclass(value):
            yield from _schema_leaves(value, key)
        else:
            yield key


def test_every_schema_key_with_a_typo_gets_itself_suggested():
    """For every key of the schema: a typo in its last part is matched among its section's keys, a typo in its
    first part among the full dotted keys; the suggestion is the key itself (it may come with equally close
    ones), and the fix stays one line."""
    from pipelines.config import unknown_key_fix
    leaves = list(_schema_leaves())
    assert len(leaves) > 100
    checked = 0
    for key in leaves:
        *parents, name = key.split(".")
        typos = [".".join([*parents, _typo(name)])] if len(name) >= 4 else []
        if parents and len(parents[0]) >= 4:
            typos.append(".".join([_typo(parents[0]), *parents[1:], name]))
        for typo in typos:
            if typo in leaves:
                continue
            fix = unknown_key_fix(typo)
            said = fix.split("did you mean ", 1)[1].split("?", 1)[0].split(" or ") if "did you mean" in fix else []
            assert key in said and "\n" not in fix, (typo, fix)
            checked += 1
    assert checked > 150


@pytest.mark.parametrize("override, key, meant", [
    ("runner.max_step=3", "runner.max_step", "runner.max_steps"),
    ("runer.max_steps=3", "runer.max_steps", "runner.max_steps"),  # OmegaConf names `runer`: the typed key is kept
    ("env.evl.num_envs=3", "env.evl.num_envs", "env.eval.num_envs"),
    ("+algorithm.gama=0.9", "algorithm.gama", "algorithm.gamma"),
])
def test_unknown_key_error_names_the_typed_key_and_the_meant_one(override, key, meant):
    from tasks.config import config_value
    with pytest.raises(ConfigError) as info:
        load_config(["conf=smoke", override], components=False)
    assert info.value.key == key and str(info.value.value) == override.split("=", 1)[1]
    assert f"did you mean {meant}?" in info.value.fix and "\n" not in str(info.value), str(info.value)
    config_value(Config(), meant)  # a real key
    load_config(["conf=smoke", override.lstrip("+").replace(key, meant)], components=False)  # and it composes


@pytest.mark.parametrize("overrides, key, words", [
    (["conf=pushcube_flow_grpo"], "conf", "use conf=pushcube_pi0_grpo"),
    (["conf=pushcube_flow_ppo"], "conf", "use conf=pushcube_pi0_ppo"),
    (["conf=libero_flow_sft"], "conf", "use conf=libero_pi0_sft"),
    (["conf=pushcube_ppo", "policy=flow_vla_tiny"], "policy", "use policy=pi0_tiny"),
    (["conf=pushcube_ppo", "policy=flow_vla_tiny_critic"], "policy", "use policy=pi0_tiny"),
    (["conf=pushcube_ppo", "env=pushcube_vla", "policy.name=flow_vla"], "policy.name",
     "the flow_vla family was retired: use pi0 (policy.name=pi0; the tiny preset: policy=pi0_tiny)"),
])
def test_a_retired_family_or_option_is_refused_in_one_line_naming_its_replacement(overrides, key, words):
    """tasks.config.registry.RETIRED / pipelines.compose.RETIRED_OPTIONS: what replaced it, not the list of
    what exists."""
    with pytest.raises(ConfigError) as info:
        load_config(overrides, components=False)
    msg = str(info.value)
    assert info.value.key == key and words in msg and "\n" not in msg and "available" not in msg, msg


def test_an_old_run_of_a_retired_family_is_refused_naming_its_replacement(tmp_path):
    """A run directory written when flow_vla existed: its config.yaml's policy.name is refused in one line."""
    import yaml

    from pipelines.saved_config import load_saved_config
    from storage.rundir import write_resolved_config
    cfg, _ = load_config(["conf=pushcube_ppo", "env=pushcube_vla", "policy=pi0_tiny"], components=False)
    from pipelines.config import to_yaml
    text = yaml.safe_load(to_yaml(cfg))
    text["policy"] = {"name": "flow_vla", "preset": "tiny", "use_state": True}
    write_resolved_config(tmp_path, yaml.safe_dump(text))
    with pytest.raises(ConfigError) as info:
        load_saved_config(tmp_path / "config.yaml")
    assert info.value.key == "policy.name" and "the flow_vla family was retired: use pi0" in str(info.value)


def test_unknown_names_suggest_close_ones_only():
    from pipelines.config import CONF_DIR
    from tasks.config import close_matches
    with pytest.raises(ConfigError) as info:
        load_config(["conf=pushcube_pi0_grp"], components=False)
    assert info.value.key == "conf" and "did you mean 'pushcube_pi0_grpo'?" in info.value.fix
    assert "available: [" in info.value.fix  # the whole list stays (one line)
    with pytest.raises(ConfigError) as info:
        load_config(["policy=token_vla_tin"], components=False)
    said = info.value.fix.split("did you mean ", 1)[1].split("?", 1)[0]
    assert said == "'token_vla_tiny' or 'token_vla_tiny_critic'"  # the names it is a prefix of
    assert all((CONF_DIR / "policy" / f"{n.strip(chr(39))}.yaml").is_file() for n in said.split(" or "))
    with pytest.raises(ConfigError) as info:
        load_config(["+zzzzqq=1"], components=False)
    assert "did you mean" not in info.value.fix  # nothing close: no guess
    # the rule: prefixes first, else difflib matches within 0.1 of the best, at most n
    assert close_matches("ab", ["abc", "xab", "abd"]) == ["abc", "abd"]
    assert close_matches("max_stpes", ["max_steps", "max_env_steps", "seed"]) == ["max_steps"]
    assert close_matches("zzz", ["max_steps"]) == []
    assert close_matches("a", ["a1", "a2", "a3", "a4"], n=2) == ["a1", "a2"]


def test_env_id_typo_gets_did_you_mean_from_the_same_helper():
    with pytest.raises(ConfigError) as info:
        load_config(["env.env_id=PushCubbe-v1"])
    assert info.value.key == "env.env_id" and "did you mean 'PushCube-v1'?" in info.value.fix


# ----- an experiment's required keys (`???`) -----

@pytest.mark.parametrize("name", NEEDS_SFT_CHECKPOINT)
def test_rl_from_sft_experiments_require_policy_model_path_offline(name, tmp_path, capsys):
    """Without policy.model_path the RL-from-SFT experiments are refused by the one check path (validate and run
    alike, one line, exit 2, nothing written); given (a path, or null for random weights) they compose."""
    from pipelines import run, validate
    for main in (validate.main, run.main):
        assert main([f"conf={name}", f"run_root={tmp_path / 'runs'}"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: policy.model_path='???': "), err
        assert f"experiment {name} " in err[0] and "policy.model_path=<SFT run>/checkpoints/global_step_N/hf" in err[0]
    assert not (tmp_path / "runs").exists()
    with pytest.raises(ConfigError) as info:
        load_config([f"conf={name}"], components=False)  # also without the components' checks
    assert info.value.key == "policy.model_path"
    cfg, _ = load_config([f"conf={name}", NO_SFT], components=False)
    assert cfg.policy.model_path is None
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")  # the schema's check: a save_pretrained directory
    cfg, _ = load_config([f"conf={name}", f"policy.model_path={tmp_path / 'hf'}"], components=False)
    assert cfg.policy.model_path == str(tmp_path / "hf")


def test_experiments_that_require_a_key_are_exactly_the_rl_from_sft_ones():
    """Which shipped experiments write `???` (and for which keys): the RL experiments that start from an SFT run."""
    from pipelines.config import CONF_DIR, MISSING, _file_values
    required = {p.stem: sorted(k for k, v in _file_values(p, "").items() if v == MISSING)
                for p in sorted((CONF_DIR / "conf").glob("*.yaml"))}
    assert {n: ks for n, ks in required.items() if ks} == {n: ["policy.model_path"] for n in NEEDS_SFT_CHECKPOINT}


@pytest.fixture(scope="module")
def sft_store(tmp_path_factory):
    """A ManiSkill demo store; its sibling `libero_demos.zarr` is a LIBERO one (close_positive gripper)."""
    path = _fake_sft_store(tmp_path_factory.mktemp("sft") / "demos.zarr")
    _fake_sft_store(path.with_name("libero_demos.zarr"), gripper_convention="close_positive", obs_dim=LIBERO_OBS)
    return path


LIBERO_OBS = 14  # the state of the shipped LIBERO experiments (env.object_state: tasks.envs.libero.adapter.obs_dim)


def test_a_libero_store_of_the_other_state_length_is_refused_naming_the_fix(sft_store):
    """A store recorded with env.object_state=false (8-D state) for a run with it true (14-D), and back."""
    from pipelines.config import load_config
    flag = "false" if LIBERO_OBS == 14 else "true"
    with pytest.raises(ConfigError, match=f"stores a {LIBERO_OBS}-D state.*set env.object_state="
                                          f"{'true' if flag == 'false' else 'false'}") as e:
        load_config(["conf=libero_pi0_sft", f"sft.store={sft_store.with_name('libero_demos.zarr')}",
                     f"env.object_state={flag}"])
    assert e.value.key == "sft.store"


@pytest.mark.parametrize("damage", ["truncated_metadata", "corrupt_chunk", "missing_mask_chunks",
                                    "missing_complete_flags"])
def test_a_damaged_sft_store_is_one_config_error_naming_it(tmp_path, damage):
    """A half-copied or corrupted store (found by a fresh-clone check: a raw JSONDecodeError / zstd traceback, or a
    store with deleted chunk files read as fill values and reported as 'no successful episode')."""
    import shutil

    from pipelines.config import load_config
    from storage.trajectories import TrajectoryStore
    path = _fake_sft_store(tmp_path / "demos.zarr")
    TrajectoryStore.open(path).update_attrs(episodes=2)
    if damage == "truncated_metadata":
        meta = path / "zarr.json"
        meta.write_text(meta.read_text()[:20])
        want = rf"group metadata \({re.escape(str(meta))}\) cannot be read \(JSONDecodeError.*re-record it"
    elif damage == "corrupt_chunk":
        chunks = [f for f in (path / "fields" / "step_mask").rglob("*") if f.is_file() and f.name != "zarr.json"]
        assert chunks
        for f in chunks:
            f.write_bytes(b"\x28\xb5\x2f\xfd garbage, not a zstd frame")
        want = r"fields/step_mask chunk file \S+ \(step 0, envs 0-1\) cannot be decoded .*re-record it"
    elif damage == "missing_mask_chunks":
        shutil.rmtree(path / "fields" / "step_mask" / "c")
        want = r"fields/step_mask.*chunk file .*missing.*re-record it"
    else:
        shutil.rmtree(path / "steps" / "complete" / "c")
        want = "lists 2 episodes but no step is marked complete.*re-record it"
    with pytest.raises(ConfigError, match=want) as e:
        load_config(["conf=pushcube_pi0_sft", f"sft.store={path}"])
    assert e.value.key == "sft.store" and "\n" not in str(e.value)


def test_the_sft_memory_estimate_is_what_a_data_worker_loads(tmp_path):
    """`sft_dataset_bytes` = the bytes of the samples `tasks.demos._dataset` holds (here with the value pass: every
    executed chunk step, plus its bc flag and return) + one step's largest field (read one step at a time)."""
    from pipelines.config import load_config
    from storage.trajectories import TrajectoryStore
    from tasks import resident
    from tasks.demo_index import sft_dataset_bytes
    from tasks.demos import _dataset
    path = _fake_sft_store(tmp_path / "demos.zarr")
    cfg, _ = load_config(["conf=pushcube_pi0_sft", f"sft.store={path}", "sft.value_coef=1.0"])
    resident.release("sft_data/")
    try:
        data = _dataset(cfg)
    finally:
        resident.release("sft_data/")
    st = TrajectoryStore.open(path)
    M = len(data["actions"])
    assert M == 4 and set(data) == {"obs", "rgb", "task_id", "actions", "bc", "returns"}  # 2 chunk steps x 2 envs
    one_step = st.T * st.num_envs * 32 * 32 * 3  # the rgb field of one step, the largest
    assert sft_dataset_bytes(str(path), M) == sum(v.nbytes for v in data.values()) + one_step


def test_a_store_too_large_for_the_sft_workers_memory_is_refused_with_the_limit_that_fits(tmp_path):
    """A 36-step RL run's store used as sft.store had the SFT data workers killed on every retry of step 1 (3 GiB
    limit; a quadratic helper then, `tasks.demos.rows_in` now); the samples plus the worker's own measured ~1 GiB
    are now checked against Dask's pause fraction of cluster.memory_limit before the cluster starts."""
    import dask

    from pipelines.config import load_config
    path = _fake_sft_store(tmp_path / "demos.zarr")
    args = ["conf=pushcube_pi0_sft", f"sft.store={path}"]
    with dask.config.set({"distributed.worker.memory.pause": 0.8}):
        with pytest.raises(ConfigError, match=r"its 4 chunk steps .*more than 80% of cluster.memory_limit=1200MiB "
                                              r"\(Dask's memory pause fraction\); set cluster.memory_limit=2GiB") as e:
            load_config([*args, "cluster.memory_limit=1200MiB"])
        assert e.value.key == "sft.store"
        load_config([*args, "cluster.memory_limit=2GiB"])  # the limit the error names fits
        load_config([*args, "cluster.memory_limit=auto"])  # unknown offline: not checked


TWO_GPUS = "cluster.num_gpu_workers=2"
# (overrides, the key the error must name, words of its reason); "{store}" -> a valid sft.store
INERT = [
    # policy: keys of another policy family (unknown for the chosen family, naming it) / noise method / no critic
    (["policy.noise_method=flow_sde"], "policy.noise_method", "unknown key for policy.name=mlp"),
    (["policy.num_denoise_steps=8"], "policy.num_denoise_steps",
     f"a key of policy.name={_families_with('num_denoise_steps')}:"),
    (["policy.action_bins=128"], "policy.action_bins", "a key of policy.name=token_vla"),
    (["policy.temperature=0.5"], "policy.temperature", "a key of policy.name=token_vla"),
    (["policy.normalize_actions=true"], "policy.normalize_actions", "unknown key for policy.name=mlp"),
    ([SFT, "sft.store={store}", "policy.name=token_vla", "policy.normalize_actions=true"], "policy.normalize_actions",
     "none of the current VLA families"),
    (["policy.preset=pi0"], "policy.preset", f"a key of policy.name={_families_with('preset')}:"),
    (["+policy.sizes.patch_size=4"], "policy.sizes.patch_size", "unknown key for policy.name=mlp"),
    (["policy.value_head=first_token"], "policy.value_head", f"a key of policy.name={_families_with('value_head')}:"),
    ([PPO_VLA, NO_SFT, "policy.hidden_sizes=[8]"], "policy.hidden_sizes", "unknown key for policy.name=pi0"),
    ([PPO_VLA, NO_SFT, "policy.init_logstd=-1"], "policy.init_logstd", "a key of policy.name=mlp"),
    ([PPO_VLA, NO_SFT, "policy.noise_level=0.3"], "policy.noise_level", "flow_sde"),
    ([PPO_VLA, NO_SFT, "policy.noise_method=flow_sde", "policy.noise_std_max=0.2"], "policy.noise_std_max",
     "flow_noise"),
    (["conf=pushcube_token_grpo", NO_SFT, "policy.critic_state=true"], "policy.critic_state", "does not train"),
    ([GRPO, NO_SFT, "policy.value_detach=true"], "policy.value_detach", "does not train"),
    # env
    (["env.image_size=32"], "env.image_size", "obs_mode=rgb"),
    (["conf=libero_smoke", "env.robot_visual_lod=0.1"], "env.robot_visual_lod", "unknown key for env.simulator=libero"),
    (["conf=libero_smoke", "env.fast_step=false"], "env.fast_step", "a key of env.simulator=maniskill"),
    (["env.instruction_source=bddl"], "env.instruction_source", "unknown key for env.simulator=maniskill"),
    # algorithm: keys of another algorithm, a switched-off option, a no-op device setting
    ([GRPO, NO_SFT, "algorithm.gamma=0.9"], "algorithm.gamma", "critic-free"),
    ([GRPO, NO_SFT, "algorithm.gae_lambda=0.9"], "algorithm.gae_lambda", "critic-free"),
    ([GRPO, NO_SFT, "algorithm.value_coef=1.0"], "algorithm.value_coef", "critic-free"),
    ([GRPO, NO_SFT, "algorithm.value_clip=0.2"], "algorithm.value_clip", "critic-free"),
    ([GRPO, NO_SFT, "algorithm.critic_lr=0.001"], "algorithm.critic_lr", "critic-free"),
    ([GRPO, NO_SFT, "algorithm.critic_warmup_steps=2"], "algorithm.critic_warmup_steps", "critic-free"),
    ([GRPO, NO_SFT, "algorithm.normalize_advantages=false"], "algorithm.normalize_advantages",
     "within each group"),
    ([GRPO, NO_SFT, "algorithm.rewards_upper_bound=0.9"], "algorithm.rewards_upper_bound",
     "filter_rewards=true"),
    (["algorithm.group_size=4"], "algorithm.group_size", "algorithm.name=grpo|rloo only"),
    ([GRPO, NO_SFT, "algorithm.name=rloo", "algorithm.filter_rewards=true"], "algorithm.filter_rewards",
     "grpo only"),
    (["algorithm.filter_rewards=true"], "algorithm.filter_rewards", "grpo only"),
    (["algorithm.offload=true"], "algorithm.offload", "policy.device=cpu"),
    (["algorithm.num_actor_ranks=2", TWO_GPUS, "cluster.component_placement.actor=0-1",
      "algorithm.global_batch_size=800", "algorithm.num_minibatches=4"], "algorithm.num_minibatches",
     "global_batch_size"),
    # rollout
    (["rollout.pipeline_stage_num=1"], "rollout.pipeline_stage_num", "inference=colocated"),
    (["rollout.inference=disaggregated", "rollout.chunk_steps_per_node=20"], "rollout.chunk_steps_per_node",
     "disaggregated"),
    # sections of another algorithm / command
    (["sft.batch_size=8"], "sft.batch_size", "algorithm.name=sft only"),
    (["record.num_episodes=4"], "record.num_episodes", "pipelines.record` only"),
    ([SFT, "sft.store={store}", "rollout.inference=disaggregated"], "rollout.inference", "roll nothing out"),
    ([SFT, "sft.store={store}", "env.num_envs=8"], "env.num_envs", "roll nothing out"),
    ([SFT, "sft.store={store}", "storage.save_trajectories=false"], "storage.save_trajectories", "roll nothing"),
    ([SFT, "sft.store={store}", "runner.max_env_steps=100"], "runner.max_env_steps", "roll nothing out"),
    ([SFT, "sft.store={store}", "algorithm.clip_ratio_low=0.1"], "algorithm.clip_ratio_low", "algorithm.name=sft"),
    ([SFT, "sft.store={store}", "algorithm.update_epochs=2"], "algorithm.update_epochs", "algorithm.name=sft"),
    ([SFT, "sft.store={store}", "algorithm.nonfinite=mask"], "algorithm.nonfinite", "algorithm.name=sft"),
    (["cluster.kind=address", "cluster.address=tcp://10.0.0.1:8786", "cluster.start_timeout_s=30"],
     "cluster.start_timeout_s", "unknown key for cluster.kind=address"),
    ([SFT, "sft.store={store}", "sft.value_coef=0", "algorithm.reward_scale=0.5"], "algorithm.reward_scale",
     "sft.value_coef > 0"),
    # cluster: the embedded cluster's keys with a remote one, and the other way round
    (["cluster.connect_timeout_s=5"], "cluster.connect_timeout_s", "unknown key for cluster.kind=local"),
    (["cluster.kind=address", "cluster.address=tcp://10.0.0.1:8786", "cluster.memory_limit=4GiB"],
     "cluster.memory_limit", "existing cluster"),
    (["cluster.num_gpus=1", TWO_GPUS], "cluster.num_gpu_workers", "cluster.num_gpus=1"),
    # placement entries that do nothing
    (["cluster.component_placement.rollout=0"], "cluster.component_placement.rollout", "inference=colocated"),
    ([TWO_GPUS, "cluster.component_placement.actor=0-1"], "cluster.component_placement.actor",
     "algorithm.num_actor_ranks=1 uses 1"),
    ([TWO_GPUS, "rollout.inference=disaggregated", "cluster.component_placement.rollout=all"],
     "cluster.component_placement.rollout", "pipeline_stage_num=1"),
    ([SFT, "sft.store={store}", "cluster.component_placement.rollout=0"], "cluster.component_placement.rollout",
     "rolls nothing out"),
]


def _fill(overrides, store):
    return [o.replace("{store}", str(store)) for o in overrides]


def test_a_familys_value_dependent_key_that_does_nothing_is_refused():
    """ManiSkill's env.fast_step is read by its CPU simulator only (the family's own `inert_keys`); offline, since
    GPU simulation needs CUDA on this machine."""
    with pytest.raises(ConfigError) as info:
        load_config(["env.sim_backend=physx_cuda", "env.fast_step=false"], components=False, notes=[])
    assert info.value.key == "env.fast_step" and "env.sim_backend=physx_cuda does not read it" in str(info.value)


@pytest.mark.parametrize("overrides, key, words", INERT, ids=[c[1] + "-" + str(i) for i, c in enumerate(INERT)])
def test_a_set_key_that_does_nothing_is_refused_naming_it(overrides, key, words, sft_store):
    with pytest.raises(ConfigError) as info:
        load_config(_fill(overrides, sft_store), notes=[])
    msg = str(info.value)
    assert info.value.key == key and msg.startswith(f"{key}=") and "\n" not in msg, msg
    assert words in msg, msg


@pytest.mark.parametrize("overrides, key", [
    (["seed=3"], "seed"),
    (["algorithm.lr=0.1"], "algorithm.lr"),
    (["policy.name=pi0"], "policy.name"),
    (["env.eval.num_envs=4"], "env.eval.num_envs"),
    (["env.auto_reset=true"], "env.auto_reset"),
    (["runner.max_steps=3"], "runner.max_steps"),
    (["cluster.component_placement.actor=0"], "cluster.component_placement.actor"),
])
def test_record_refuses_keys_it_does_not_read(overrides, key, tmp_path):
    with pytest.raises(ConfigError) as info:  # record.out: the default path may hold a user's earlier recording
        load_config(["conf=pushcube_record", f"record.out={tmp_path / 'r.zarr'}", *overrides], command="record",
                    require_teacher=False, notes=[])
    assert info.value.key == key and "record" in info.value.fix


def test_experiment_keys_switched_off_by_the_command_line_are_notes_not_silence():
    notes: list[str] = []
    cfg, _ = load_config(["conf=smoke", "rollout.inference=disaggregated"], notes=notes)
    assert cfg.rollout.inference == "disaggregated"
    assert len(notes) == 1 and notes[0].startswith("note: rollout.chunk_steps_per_node=5 (set in "
                                                   "conf/conf/smoke.yaml) does nothing")
    notes.clear()
    # a policy group file's flow_noise std bounds are its defaults for that method, silent under flow_sde (from the
    # command line or an experiment file: conf=libero_pi0_grpo selects it); set explicitly they are still refused
    load_config([PPO_VLA, NO_SFT, "policy.noise_method=flow_sde"], notes=notes)
    cfg, _ = load_config(["conf=libero_pi0_grpo", NO_SFT], notes=notes, components=False)
    assert cfg.policy.noise_method == "flow_sde" and notes == []
    with pytest.raises(ConfigError, match="policy.noise_std_min.*flow_sde uses policy.noise_level"):
        load_config([PPO_VLA, NO_SFT, "policy.noise_method=flow_sde", "policy.noise_std_min=0.1"], notes=notes)


def test_given_keys_are_the_command_line_and_the_experiment_file():
    from pipelines.config import COMMAND_LINE, given_keys
    g = given_keys(["conf=smoke", "env.num_envs=8", "+cluster.component_placement={actor\\,env: all}"])
    assert g["env.num_envs"] == COMMAND_LINE and g["cluster.component_placement.actor,env"] == COMMAND_LINE
    assert g["rollout.chunk_steps_per_node"] == "conf/conf/smoke.yaml" and "conf" not in g
    assert "algorithm.entropy_coef" not in g and "policy.name" not in g  # a schema default is never "set"
    # a group file's keys count as set by the experiment that chose it (conf/conf/smoke.yaml: override /algorithm)
    assert g["algorithm.gamma"] == "conf/algorithm/ppo.yaml (chosen by conf/conf/smoke.yaml)"
    assert g["algorithm.update_epochs"] == "conf/conf/smoke.yaml"  # the experiment's own value wins over its group's
    assert given_keys([])["env.num_envs"] == "conf/conf/pushcube_ppo.yaml"  # the default experiment
    assert given_keys([])["policy.hidden_sizes"] == "conf/policy/mlp.yaml (chosen by conf/conf/pushcube_ppo.yaml)"


def test_group_chosen_on_the_command_line_replaces_the_experiments():
    from pipelines.config import from_command_line, given_keys, group_choices
    ov = ["conf=pushcube_ppo", "env=pickcube", "policy=pi0_tiny", "env.obs_mode=rgb"]  # pi0 reads images
    assert group_choices(ov)["policy"] == ("pi0_tiny", "the command line")
    assert group_choices(ov)["algorithm"] == ("ppo", "conf/conf/pushcube_ppo.yaml")
    g = given_keys(ov)
    assert from_command_line(g["policy.noise_method"]) and from_command_line(g["env.env_id"])
    assert "policy.hidden_sizes" not in g  # conf/policy/mlp.yaml is not composed any more
    cfg, _ = load_config(ov, components=False)
    assert (cfg.env.env_id, cfg.policy.name, cfg.policy.num_action_chunks) == ("PickCube-v1", "pi0", 5)
    assert cfg.env.num_envs == 64 and cfg.algorithm.name == "ppo"  # the rest is still conf=pushcube_ppo's
    # a key of a group file chosen on the command line that does nothing is an error, naming the file
    with pytest.raises(ConfigError, match=r"policy.value_head=.*conf/policy/token_vla_tiny_critic.yaml \(chosen on "
                                          r"the command line\).*critic-free"):
        load_config(["conf=pushcube_token_grpo", "policy.model_path=null", "policy=token_vla_tiny_critic"],
                    components=False)
    with pytest.raises(ConfigError, match=r"env='nope': no conf/env/nope.yaml; available: \[.*'pickcube'"):
        load_config(["env=nope"], components=False)


# The golden file of resolved configs (tests/pipelines/resolved_configs.json) is replaced by invariants: every
# shipped experiment validates without notes (test_every_experiment_validates_without_notes below), every key is
# read by some code path (tests/pipelines/test_keys_read.py), seeds are distinct where they must be
# (tests/tasks/test_seed_invariants.py).


def test_group_files_hold_their_groups_keys_only():
    """Every conf/GROUP/*.yaml is a section of the schema (default package GROUP; no `# @package` line) or, with
    `# @package _global_` as its first line, sections of the schema (a preset that states what it needs of other
    sections: conf/algorithm/grpo.yaml's env.auto_reset, a policy preset's update settings), and composes alone;
    nested defaults name files of the same group."""
    import dataclasses
    from omegaconf import OmegaConf
    from pipelines.config import CONF_DIR, GROUPS, compose
    sections = {f.name for f in dataclasses.fields(Config)}
    for group in GROUPS:
        files = sorted((CONF_DIR / group).glob("*.yaml"))
        assert files, group
        for f in files:
            text = f.read_text()
            if text.startswith("# @package _global_\n"):
                assert set(OmegaConf.load(f)) - {"defaults"} <= sections, f
            else:
                assert "@package" not in text, f
            for entry in OmegaConf.load(f).get("defaults", []):
                assert entry == "_self_" or (CONF_DIR / group / f"{entry}.yaml").is_file(), (f, entry)
            if not f.stem.startswith("_"):  # an include (`_NAME.yaml`) composes through the presets naming it
                compose(["conf=pushcube_ppo", f"{group}={f.stem}"])


# ----- one check path: validate == run -----

BAD = [
    ["env.obs_mode=rgb"],  # rgb with the state-only mlp (was checked by run only)
    ["policy.noise_method=flow_sde"],
    ["cluster.component_placement.rollout=0"],
    [TWO_GPUS, "cluster.component_placement.actor=0,1"],
    [TWO_GPUS, 'cluster.component_placement.actor="0,1"'],
    ["record.num_episodes=4"],
    ["conf=pushcube_record"],  # run refuses a record experiment; validate checks it for pipelines.record
    ["env.num_envs=5"],
    ["cluster.num_gpus=0"],
    ["conf=pushcube_pi0_grpo"],  # policy.model_path: the experiment's `???`, required
]


@pytest.mark.parametrize("overrides", BAD, ids=[" ".join(b) for b in BAD])
def test_validate_and_run_give_the_same_error_and_run_writes_nothing(overrides, tmp_path, capsys, monkeypatch):
    from pipelines import run, validate
    monkeypatch.chdir(tmp_path)
    root = tmp_path / "runs"
    args = [*overrides, f"run_root={root}"]
    rc_run = run.main(args)
    err_run = capsys.readouterr().err.strip().splitlines()
    assert rc_run == 2 and len(err_run) == 1 and err_run[0].startswith("error: "), err_run
    assert not root.exists() and list(tmp_path.iterdir()) == []
    rc_val = validate.main(args)
    err_val = capsys.readouterr().err.strip().splitlines()
    if overrides == ["conf=pushcube_record"]:  # validate: the record command's checks, which pass
        assert rc_val == 0
        return
    assert rc_val == 2 and err_val == err_run


@pytest.mark.parametrize("case", ["run_root_under_a_file", "tracking_scheme", "record_out_under_a_file"])
def test_validate_checks_where_the_command_would_write(case, tmp_path, capsys, monkeypatch):
    """validate said ok where run refused (run_root under a file, an unknown tracking scheme): its docstring
    promises run's checks. Now the same one line (and record.out's directory for a record config)."""
    from pipelines import run, validate
    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("")
    args = {"run_root_under_a_file": ["conf=smoke", f"run_root={tmp_path / 'afile' / 'runs'}"],
            "tracking_scheme": ["conf=smoke", f"run_root={tmp_path / 'runs'}", "tracking.uri=ftp://x"],
            "record_out_under_a_file": ["conf=pushcube_record", f"record.out={tmp_path / 'afile' / 'd.zarr'}"],
            }[case]
    key = {"run_root_under_a_file": "run_root", "tracking_scheme": "tracking.uri",
           "record_out_under_a_file": "record.out"}[case]
    assert validate.main(args) == 2
    err_val = capsys.readouterr().err.strip().splitlines()
    assert len(err_val) == 1 and err_val[0].startswith(f"error: {key}="), err_val
    if case != "record_out_under_a_file":  # run gives the very same line
        assert run.main(args) == 2
        assert capsys.readouterr().err.strip().splitlines() == err_val


# ----- the sweep: every shipped experiment validates -----

EXPERIMENTS = sorted(p.stem for p in (REPO / "conf" / "conf").glob("*.yaml"))


def _required(name: str, sft_store) -> list[str]:
    """The keys an experiment requires on the command line (its `???` keys), as a test gives them; a recording
    writes into the test's tmp dir (its default path under runs/ may hold a user's earlier recording, refused)."""
    store = sft_store.with_name("libero_demos.zarr") if name.startswith("libero") else sft_store
    # a random pi0 (NO_SFT) prompts with the tiny byte-level tokenizer: LIBERO's instructions take up to 90 tokens
    # there (a checkpoint's PaliGemma tokenizer ~20, within pi0's 48; the offline prompt check refuses 48)
    return ([f"sft.store={store}"] if name.endswith("_sft") else []) + \
        ([NO_SFT] if name in NEEDS_SFT_CHECKPOINT else []) + \
        (["policy.max_prompt_len=128"] if name.startswith("libero_pi0_") else []) + \
        ([f"record.out={sft_store.with_name(name + '.zarr')}"] if name.endswith("_record") else [])


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_every_experiment_validates_without_notes(name, sft_store, capsys):
    from pipelines import validate
    assert validate.main([f"conf={name}", *_required(name, sft_store)]) == 0, capsys.readouterr().err
    out = capsys.readouterr()
    assert out.out.startswith("ok: ") and out.err == ""


# ----- command-line values with commas, lists and dict keys -----

@pytest.mark.parametrize("override, key, fix, works", [
    ("cluster.component_placement.actor=0,1", "cluster.component_placement.actor",
     "cluster.component_placement.actor='\"0,1\"'", 'cluster.component_placement.actor="0,1"'),
    ("cluster.component_placement.env=0-1,3", "cluster.component_placement.env", "'0-1\\,3'",
     "cluster.component_placement.env=0-1\\,3"),
    ("policy.hidden_sizes=32,32", "policy.hidden_sizes", "policy.hidden_sizes=[32,32]", "policy.hidden_sizes=[32,32]"),
    ("env.num_envs=4,8", "env.num_envs", "takes one value, an integer (e.g. env.num_envs=16)", "env.num_envs=8"),
    ("cluster.component_placement.actor,env=all", "cluster.component_placement.actor,env",
     "'+cluster.component_placement={actor\\,env: all}'", "+cluster.component_placement={actor\\,env: all}"),
    ('cluster.component_placement={"actor,env,rollout": all}', "cluster.component_placement",
     "{actor\\,env\\,rollout: all}", "+cluster.component_placement={actor\\,env\\,rollout: all}"),
    ("cluster.component_placement={actor\\,env\\,rollout: all}", "cluster.component_placement.actor,env,rollout",
     "+cluster.component_placement={actor\\,env\\,rollout: VALUE}",
     "+cluster.component_placement={actor\\,env\\,rollout: all}"),
    ("policy.sizes.patch_size=4", "policy.sizes.patch_size", "+policy.sizes.patch_size=VALUE",
     "+policy.sizes.patch_size=4"),
])
def test_cli_values_with_commas_give_the_key_and_a_quoting_that_works(override, key, fix, works):
    from pipelines.config import compose
    with pytest.raises(ConfigError) as info:
        compose([override])
    assert info.value.key == key and fix in info.value.fix and "\n" not in str(info.value), str(info.value)
    compose([works])  # the suggested form (as the shell passes it) composes


# ----- params reach MLflow intact -----

PLACEMENTS = [[], ["+cluster.component_placement={actor\\,env\\,rollout: all}"],
              ["+cluster.component_placement={actor: 0, env\\,rollout: all}"],
              [TWO_GPUS, "cluster.component_placement.actor=0", "cluster.component_placement.env=0-1",
               "rollout.inference=disaggregated", "cluster.component_placement.rollout=1"],
              ["policy.hidden_sizes=[" + ",".join(["64"] * 1500) + "]"]]  # a value longer than MLflow's 6000


def test_params_of_every_experiment_and_placement_reach_mlflow_intact(tmp_path, sft_store):
    from pipelines.config import to_dict
    from storage.tracking import Tracker, flatten_config, unflatten_values
    tracker = None
    cases = [[f"conf={n}", *_required(n, sft_store)] for n in EXPERIMENTS]
    cases += [["conf=smoke", *p] for p in PLACEMENTS]
    for overrides in cases:
        cfg, _ = load_config(overrides, command="record" if overrides[0].endswith("_record") else "run",
                             require_teacher=False, notes=[])
        flat = flatten_config(to_dict(cfg))
        tracker = Tracker(uri=f"sqlite:///{tmp_path / 'mlflow.db'}", experiment="params")
        assert tracker.log_params(flat) == len(flat)
        logged = tracker.client.get_run(tracker.run_id).data.params
        assert logged == flat, overrides
        values = unflatten_values(logged)  # back to config keys and whole values
        for key, value in values.items():
            from tasks.config import config_value
            v = config_value(cfg, key)
            assert value == (json.dumps(v) if isinstance(v, list) else "{}" if v == {} else str(v)), key
    assert "cluster.component_placement.actor,env,rollout" in values or True


def test_num_gpu_workers_is_refused_where_cuda_devices_decide():
    """On a machine with CUDA devices the embedded cluster starts one GPU worker per device: a set
    cluster.num_gpu_workers would do nothing there (cluster.num_gpus chooses fewer)."""
    from tasks.config import inert_keys, inert_reason
    cfg, _ = load_config(["cluster.num_gpu_workers=2"], components=False)  # CPU-only: logical GPU workers
    assert inert_reason("cluster.num_gpu_workers", inert_keys(cfg, "run", cuda_count=0)) is None
    why = inert_reason("cluster.num_gpu_workers", inert_keys(cfg, "run", cuda_count=1))
    assert why is not None and "cluster.num_gpus" in why


@pytest.mark.parametrize("overrides", [["conf=smoke"], ["conf=smoke", "rollout.inference=disaggregated"],
                                       ["conf=smoke", "rollout.inference=disaggregated", "env.num_envs=8",
                                        "rollout.pipeline_stage_num=2"], ["conf=smoke", "storage.save_trajectories=false"]])
def test_validate_counts_the_nodes_the_step_graph_has(overrides):
    """`pipelines.validate`'s node count is that of the graph `pipelines.graphs.build_train_step` builds (weights as
    a key of a runner Future: with the weights_handle node)."""
    import re

    from pipelines import graphs
    from pipelines.clusters import plan_placement
    from pipelines.validate import describe
    cfg, _ = load_config(overrides, components=False, notes=[])
    cluster = {"workers": {"tcp://127.0.0.1:1": {"name": "env-0", "resources": {"CPU": 1}},
                           "tcp://127.0.0.1:2": {"name": "gpu-0", "resources": {"GPU": 1}}}}
    sg = graphs.build_train_step(cfg, run_id="r", step=0, weights="w0", cursors=[None] * cfg.env.num_shards,
                                 placement=plan_placement(cfg, cluster), store_path=None if not
                                 cfg.storage.save_trajectories else "/nonexistent.zarr", dims=(3, 2))
    stated = int(re.search(r"graph: (\d+) nodes per step", describe(cfg)).group(1))
    assert stated == len(sg.graph.layers)


@pytest.mark.parametrize("overrides", [
    ["conf=smoke", "rollout.inference=disaggregated", "rollout.chunk_steps=7"],  # chunk_steps_per_node unread
    [SFT, "sft.store={store}", "env.num_shards=3", "env.eval.num_envs=3"],  # env.num_envs unread by SFT
])
def test_keys_that_do_nothing_are_not_validated_either(overrides, sft_store):
    """A default the chosen mode never reads cannot make a config invalid (chunk_steps_per_node=5 does not divide
    7, env.num_envs=16 is not divisible by 3: both unread here)."""
    load_config(_fill(overrides, sft_store), notes=[])


# ----- saved run configs: one loader (record's teacher, replay's env) -----

def test_saved_configs_load_through_one_path(tmp_path):
    from pipelines.config import load_saved_config, to_yaml
    from pipelines.replay import run_env_settings
    cfg, _ = load_config(["conf=pushcube_ppo", "env.sim_backend=physx_cpu", "env.auto_reset=false"], components=False)
    from storage.rundir import write_resolved_config
    run = tmp_path / "run"
    write_resolved_config(run, to_yaml(cfg))  # with its digest, as a run writes it
    assert load_saved_config(run / "config.yaml") == cfg
    env, note = run_env_settings(run / "trajectories.zarr")
    assert note is None and (env["sim_backend"], env["auto_reset"], env["ignore_terminations"]) == ("physx_cpu", False, True)
    write_resolved_config(run, to_yaml(cfg).replace("num_envs: 32", "num_envz: 32"))
    with pytest.raises(ConfigError, match="num_envz"):
        load_saved_config(run / "config.yaml")
    env, note = run_env_settings(run / "trajectories.zarr")  # replay falls back to the defaults, with a note
    assert env == {} and "is not a config this version reads" in note and "num_envz" in note


def test_sft_store_of_another_robot_visual_lod_warns_naming_the_fix(sft_store):
    """A store recorded with the original meshes (robot_visual_lod attr 1.0) and an SFT run rendering its evals
    at 0.1: a warning with the matching setting; the same setting: none."""
    import warnings
    with pytest.warns(UserWarning, match=r"robot_visual_lod=1\.0.*env\.robot_visual_lod=0\.1.*set env\.robot_visual_lod=1\.0"):
        load_config([SFT, f"sft.store={sft_store}", "env.robot_visual_lod=0.1"], notes=[])
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        load_config([SFT, f"sft.store={sft_store}"], notes=[])


def test_an_image_store_without_its_robot_visual_lod_is_refused_naming_the_upgrade(sft_store, tmp_path):
    """An image store recorded before ManiSkill stores recorded robot_visual_lod is of an older format: refused as
    sft.store in one line naming the store and `python -m pipelines.upgrade STORE` (never read as 1.0)."""
    import shutil

    import zarr
    old = tmp_path / "old_demos.zarr"
    shutil.copytree(sft_store, old)
    g = zarr.open_group(str(old), mode="r+")
    attrs = {k: v for k, v in g.attrs.asdict().items() if k != "robot_visual_lod"}
    g.attrs.clear()
    g.attrs.update({**attrs, "obs_mode": "rgb"})
    with pytest.raises(ConfigError) as e:
        load_config([SFT, f"sft.store={old}"], notes=[])
    msg = str(e.value)
    assert e.value.key == "sft.store" and "\n" not in msg
    assert "no robot_visual_lod attribute" in msg and f"`python -m pipelines.upgrade {old}`" in msg


@pytest.mark.parametrize("record_conf, sft_conf", [("pushcube_record", "pushcube_pi0_sft"),
                                                   ("pushcube_record", "pushcube_token_sft"),
                                                   ("libero_record", "libero_pi0_sft")])
def test_sft_conf_reads_the_store_its_record_conf_writes_under_any_run_root(tmp_path, monkeypatch, record_conf,
                                                                            sft_conf):
    """The recipe's step 3 takes step 2's output without naming it, also with another run_root (the SFT confs
    named runs/demos/... relative to the working directory while record writes under run_root: a fresh-clone check
    recorded with run_root=X and the SFT conf found no store)."""
    from pipelines.config import record_output_path
    monkeypatch.chdir(tmp_path)
    root = str(tmp_path / "elsewhere")
    rec, _ = load_config([f"conf={record_conf}", f"run_root={root}"], components=False, command="record",
                         require_teacher=False)
    with pytest.raises(ConfigError) as err:  # nothing recorded yet: the error names where it looked
        load_config([f"conf={sft_conf}", f"run_root={root}"], components=False)
    assert str(err.value).startswith(f"sft.store='{record_output_path(rec)}'"), str(err.value)
