"""Env families (tasks/envs/<name>/): each is a folder with a registered config class, its checks and an adapter,
found through the registry; callers ask the family's capabilities (tasks.envs) instead of branching on its name.
Offline: no simulator is built here."""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

import tasks.envs as E
from tasks.config import ConfigError, EnvConfig
from tasks.config.registry import SELECTORS, families, family_checks, family_class
from tasks.envs.libero.configuration import LiberoEnvConfig
from tasks.envs.maniskill.configuration import ManiSkillEnvConfig

ROOT = Path(__file__).resolve().parents[3]


def _own_keys(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)} - {f.name for f in dataclasses.fields(EnvConfig)}


def test_every_family_is_a_folder_with_config_checks_and_adapter():
    envs = families("env")
    assert set(envs) >= {"maniskill", "libero"}
    for name, cls in envs.items():
        assert issubclass(cls, EnvConfig) and cls().simulator == name  # the selector defaults to the family's name
        folder = ROOT / "tasks" / "envs" / name
        assert {"configuration.py", "checks.py", "adapter.py"} <= {p.name for p in folder.iterdir()}
        assert cls.__module__ == f"tasks.envs.{name}.configuration"
        mod = E.adapter_of(name)
        assert mod.__name__ == f"tasks.envs.{name}.adapter"
        assert mod.GRIPPER_CONVENTION in E.GRIPPER_CONVENTIONS
        for hook in ("SINGLE_ENV", "instruction", "max_episode_steps"):
            assert hasattr(mod, hook), f"{name}'s adapter lacks {hook}"
        rules = E.checks(cls())
        assert rules.__name__ == f"tasks.envs.{name}.checks" and callable(rules.check_config)
        assert family_checks("env", name) == tuple(rules.CHECKS)  # registered with the family


def test_a_family_has_only_its_own_keys():
    """ManiSkill's own keys and LIBERO's are disjoint; each family lacks the other's (a structural refusal)."""
    ms, lib = _own_keys(ManiSkillEnvConfig), _own_keys(LiberoEnvConfig)
    assert ms == {"robot_visual_lod", "fast_step"}
    assert lib == {"task_ids", "num_trials", "num_steps_wait", "trial_split", "eval_trials", "object_state",
                   "instruction_source", "wrist_camera"}
    for key in lib:
        with pytest.raises(TypeError, match=key):
            ManiSkillEnvConfig(**{key: None})
    for key in ms:
        with pytest.raises(TypeError, match=key):
            LiberoEnvConfig(**{key: None})


def test_an_unknown_simulator_names_the_selector_and_the_known_families():
    with pytest.raises(ConfigError, match=r"env\.simulator.*'libero'.*did you mean 'libero'"):
        E.adapter_of("liber")
    assert SELECTORS["env"] == "simulator"
    assert family_class("env", "libero") is LiberoEnvConfig


def test_capabilities_answer_from_the_family_not_its_name():
    import tasks.envs.libero.adapter as L
    ms, lib = ManiSkillEnvConfig(), LiberoEnvConfig(env_id="libero_spatial")
    # offline state / action lengths: LIBERO's proprio state (+ the object-state block), its OSC_POSE action
    assert E.state_dim(lib) == L.OBS_DIM == 8
    assert E.state_dim(dataclasses.replace(lib, object_state=True)) == L.OBS_DIM + L.OBJECT_STATE_DIM == 14
    assert E.action_dim(lib) == L.ACTION_DIM == 7
    assert E.state_dim(ms) is None and E.action_dim(ms) is None  # ManiSkill: known once an env is built
    assert E.state_hint(lib, 14) == "set env.object_state=true" and E.state_hint(lib, 8).endswith("=false")
    assert E.state_hint(lib, 5) == E.state_hint(ms, 8) == "record or train with the same env settings"
    # a CPU ManiSkill env carries solver state across resets; LIBERO clears it (its soft reset)
    assert E.carries_history(ms) and not E.carries_history(lib)
    assert E.env_ids_share_robot(lib) and not E.env_ids_share_robot(ms)
    assert E.is_batched(dataclasses.replace(ms, sim_backend="physx_cuda")) and not E.is_batched(ms)
    assert not E.is_batched(lib)
    # max_episode_steps: the config's value wins; else the family's own limit (LIBERO per suite)
    assert E.max_episode_steps(dataclasses.replace(lib, max_episode_steps=7)) == 7
    assert E.max_episode_steps(LiberoEnvConfig(env_id="libero_10")) == L.SUITE_MAX_STEPS["libero_10"]
    # a single-task simulator has no protocol, no task names and an instruction table of its one prompt
    assert E.protocol_episodes(ms) is None and E.eval_task_names(ms) == {}
    assert E.instructions(ms) == [E.instruction(ms)]
    # memory: measured for LIBERO (first env, then each further one, on the worker's own), unknown for ManiSkill
    import tasks.envs.libero.checks as LC
    assert E.env_worker_memory_gib(lib, 3) == pytest.approx(LC.WORKER_BASE_GIB + LC.FIRST_ENV_GIB
                                                            + 2 * LC.EXTRA_ENV_GIB)
    assert E.env_worker_memory_gib(ms, 3) is None
    assert E.replay_mismatch_note("maniskill") and E.replay_mismatch_note("libero") is None


def test_eval_params_and_store_warnings_read_only_the_familys_keys():
    ms = ManiSkillEnvConfig(obs_mode="rgb", robot_visual_lod=0.25)
    assert E.eval_params(ms) == {"env.robot_visual_lod": 0.25}
    assert E.store_attrs(ms) == {"robot_visual_lod": 0.25}
    assert E.store_warnings(ms, E.store_attrs(ms)) == []  # a store of the same LOD: nothing to say
    (w,) = E.store_warnings(ms, {"robot_visual_lod": 1.0})  # a store recorded with the original meshes
    assert "robot_visual_lod=1.0" in w and "set env.robot_visual_lod=1.0" in w
    assert E.store_warnings(dataclasses.replace(ms, obs_mode="state"), {}) == []  # no images, nothing differs
    lib = LiberoEnvConfig(env_id="libero_spatial", task_ids=[3, 1], num_trials=2)
    assert E.eval_params(lib) == {"env.task_ids": "[3, 1]", "env.num_trials": 2}
    assert E.store_warnings(lib, {}) == []


def test_a_store_rebuilds_the_config_of_its_family():
    """store_attrs -> config_from_store gives back what the family recorded (LIBERO: the seed -> init state
    mapping keys, the eval seed base, the base seed; ManiSkill: the visual LOD of its images)."""
    from dataclasses import replace
    common = dict(env_id="libero_goal", obs_mode="rgb", control_mode="OSC_POSE", reward_mode="sparse")
    lib = LiberoEnvConfig(**common, task_ids=[2, 4], num_trials=3, num_steps_wait=5, trial_split="shared",
                          eval_trials=7, object_state=True, image_size=48, seed=11,
                          eval=replace(EnvConfig().eval, seed=900))
    attrs = {"simulator": "libero", **common, **E.store_attrs(lib), "base_seed": 11}
    back = E.config_from_store("libero", attrs, {}, common)
    assert isinstance(back, LiberoEnvConfig) and back.sim_backend == "cpu"
    for key in ("task_ids", "num_trials", "num_steps_wait", "trial_split", "eval_trials", "object_state",
                "image_size", "seed"):
        assert getattr(back, key) == getattr(lib, key), key
    assert back.eval.seed == 900
    ms_common = dict(env_id="PushCube-v1", obs_mode="rgb", control_mode="pd_joint_delta_pos",
                     reward_mode="normalized_dense")
    ms = E.config_from_store("maniskill", {"robot_visual_lod": 0.5}, {"robot_visual_lod": 0.1}, ms_common)
    assert isinstance(ms, ManiSkillEnvConfig) and ms.robot_visual_lod == 0.5  # the images' LOD over the run's
    # a state store records no LOD: the run's (its replay videos show the arm as the run rendered it), else the
    # family's default (a recording has no run config)
    state_common = {**ms_common, "obs_mode": "state"}
    assert E.config_from_store("maniskill", {}, {"robot_visual_lod": 0.1}, state_common).robot_visual_lod == 0.1
    assert E.config_from_store("maniskill", {}, {}, state_common).robot_visual_lod \
        == ManiSkillEnvConfig().robot_visual_lod
    with pytest.raises(KeyError):  # an image store without it is of an older format: refused before this is asked
        E.config_from_store("maniskill", {}, {"robot_visual_lod": 0.1}, ms_common)


def test_a_family_says_which_store_attrs_an_older_store_lacks():
    """`missing_store_attrs`: an image store of ManiSkill records `robot_visual_lod` (what its images show of the
    arm); one written before the attribute lacks it, valued as recorded: its run's env.robot_visual_lod where the
    run's config has it, else the original meshes (1.0). A state store, one that has it, or a family without the
    hook (LIBERO) lacks nothing."""
    rgb = {"simulator": "maniskill", "obs_mode": "rgb"}
    assert E.missing_store_attrs("maniskill", rgb) == {"robot_visual_lod": 1.0}
    assert E.missing_store_attrs("maniskill", rgb, {"robot_visual_lod": 0.1}) == {"robot_visual_lod": 0.1}
    today = {**rgb, **E.store_attrs(ManiSkillEnvConfig(obs_mode="rgb", robot_visual_lod=0.25))}
    assert E.missing_store_attrs("maniskill", today, {"robot_visual_lod": 0.1}) == {}
    assert E.missing_store_attrs("maniskill", {**rgb, "obs_mode": "state"}) == {}
    assert E.missing_store_attrs("libero", {"simulator": "libero", "obs_mode": "rgb"}) == {}
    with pytest.raises(ConfigError, match="env.simulator"):
        E.missing_store_attrs("mujoco", rgb)


def test_the_family_rules_run_with_every_config_check():
    from tasks.config import Config
    from tasks.config.checks import check_config
    with pytest.raises(ConfigError, match="env.eval.val_episodes.*LIBERO has no validation split"):
        check_config(Config(env=LiberoEnvConfig(env_id="libero_spatial",
                                                eval=dataclasses.replace(EnvConfig().eval, val_episodes=4))))
    with pytest.raises(ConfigError, match="env.robot_visual_lod"):
        check_config(Config(env=ManiSkillEnvConfig(robot_visual_lod=0.0)))


PIPELINES_BRANCH = re.compile(r"simulator\s*[!=]=|[!=]=\s*[\"'](maniskill|libero)[\"']|"
                              r"^\s*(from|import)\s+tasks\.envs\.(maniskill|libero)\b", re.M)


def test_no_caller_in_pipelines_branches_on_the_simulator():
    """pipelines/ asks the env family (tasks.envs) what it needs: no `simulator ==`, no import of one family."""
    hits = [f"{p.relative_to(ROOT)}: {m.group(0).strip()}" for p in sorted((ROOT / "pipelines").rglob("*.py"))
            for m in PIPELINES_BRANCH.finditer(p.read_text())]
    assert hits == []


TOY_CONFIGURATION = '''
from dataclasses import dataclass
from tasks.config.registry import register_family
from tasks.config.schema import EnvConfig
from toysim import checks

@register_family("env", "toysim", checks=checks.CHECKS)
@dataclass(frozen=True)
class ToyEnvConfig(EnvConfig):
    simulator: str = "toysim"
    goal: float = 1.0  # the family's own key
'''
TOY_CHECKS = '''
from tasks.config import ConfigError

def check_config(env):
    pass

def check_goal(cfg):
    if not cfg.env.goal > 0:
        raise ConfigError("env.goal", cfg.env.goal, "use > 0")

CHECKS = (check_goal,)
'''
TOY_ADAPTER = '''
import numpy as np
GRIPPER_CONVENTION = "open_positive"

def instruction(cfg):
    return "reach the goal"

def max_episode_steps(cfg):
    return 3

class ToyEnv:
    """1-D point: obs [x], action [dx]; reward -|goal - x|; success within 0.15 of the goal; 3-step episodes."""
    obs_dim, action_dim = 1, 1

    def __init__(self, cfg):
        self.goal, self.limit = cfg.goal, cfg.max_episode_steps or 3

    def reset(self, seed):
        self.x, self.t = float(seed % 7) / 10, 0
        return np.array([self.x], np.float32)

    def step(self, action):
        self.x += float(action[0]); self.t += 1
        ok = abs(self.goal - self.x) < 0.15
        return np.array([self.x], np.float32), -abs(self.goal - self.x), ok, self.t >= self.limit, ok

    def close(self):
        pass

class ToyBatchedEnv:
    """The same dynamics, B envs in one instance (tasks.envs.batched.BatchedEnv)."""
    obs_dim, action_dim = 1, 1

    def __init__(self, cfg, num_envs):
        self.envs = [ToyEnv(cfg) for _ in range(num_envs)]
        self.num_envs = num_envs

    def reset(self, seeds, env_idx):
        return np.stack([self.envs[i].reset(int(s)) for s, i in zip(seeds, env_idx)])

    def step(self, actions):
        out = [e.step(a) for e, a in zip(self.envs, actions)]
        return tuple(np.asarray([o[k] for o in out], dt) for k, dt in enumerate(
            [np.float32, np.float32, bool, bool, bool]))

    def close(self):
        pass

SINGLE_ENV, BATCHED_ENV, BATCHED_BACKENDS = ToyEnv, ToyBatchedEnv, ("toy_batched",)
'''


def test_adding_an_env_family_is_its_folder_and_one_registry_line(tmp_path, monkeypatch):
    """A throwaway family (config, checks, adapter in one folder) works through tasks.envs with no edit elsewhere:
    the registry finds its config class, the family's rule runs with every config check, shards step it, and every
    optional capability has its default."""
    import numpy as np

    from tasks.config import Config, registry
    from tasks.config.checks import check_config
    pkg = tmp_path / "toysim"
    pkg.mkdir()
    for name, text in [("__init__", ""), ("configuration", TOY_CONFIGURATION), ("checks", TOY_CHECKS),
                       ("adapter", TOY_ADAPTER)]:
        (pkg / f"{name}.py").write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))
    for table in ("_CLASSES", "_CHECKS", "MODULES"):  # the registry as it was, after the test
        monkeypatch.setattr(registry, table, {s: dict(d) for s, d in getattr(registry, table).items()})
    registry.MODULES["env"]["toysim"] = "toysim.configuration"  # the one registry line
    cls = family_class("env", "toysim")
    cfg = cls(goal=0.5)
    assert E.adapter(cfg).__name__ == "toysim.adapter" and "toysim" in families("env")
    with pytest.raises(ConfigError, match="env.goal"):
        check_config(Config(env=cls(goal=-1.0)))
    shard = E.make_shard(cfg, shard=0, num_shards=1, num_envs=2, auto_reset=False, ignore_terminations=False,
                         base_seed=3)
    obs = shard.reset_all()  # seeds 3 and 4: x = 0.3, 0.4
    assert np.allclose(obs[:, 0], [0.3, 0.4])
    res = shard.chunk_step(np.full((2, 1, 1), 0.2, np.float32))  # x = 0.5 (the goal), 0.6 (within 0.15: success)
    assert res.terminated.tolist() == [True, True] and res.rewards[:, 0] == pytest.approx([0.0, -0.1], abs=1e-6)
    assert (E.state_dim(cfg), E.action_dim(cfg), E.protocol_episodes(cfg)) == (None, None, None)
    assert E.eval_task_names(cfg) == {}
    assert (E.store_attrs(cfg), E.worker_env(cfg), E.eval_params(cfg), E.store_warnings(cfg, {})) == ({},) * 3 + ([],)
    assert not E.carries_history(cfg) and not E.is_batched(cfg) and E.instructions(cfg) == ["reach the goal"]
    assert E.max_episode_steps(cfg) == 3 and E.gripper_convention(cfg) == "open_positive"
    import dataclasses as dc
    from tasks.envs.batched import BatchedEnvShard
    batched = E.make_shard(dc.replace(cfg, sim_backend="toy_batched"), shard=0, num_shards=1, num_envs=2,
                           auto_reset=False, ignore_terminations=False, base_seed=3)
    assert E.is_batched(dc.replace(cfg, sim_backend="toy_batched"))
    assert isinstance(batched, BatchedEnvShard) and type(batched.env).__name__ == "ToyBatchedEnv"
    np.testing.assert_array_equal(batched.reset_all(), obs)  # the same seeds, the same first observations
    E.prepare_process(cfg)  # nothing to prepare
    E.check_components(Config(env=cfg))  # no component checks: nothing raised
