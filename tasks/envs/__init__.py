"""Env families behind one registry, and the EnvShard that vectorises them.

A family is a folder, `tasks/envs/<name>/` (maniskill, libero): `configuration.py` (its config class, registered
by name with `tasks.config.registry.register_family("env", name, checks=...)`, selected by `env.simulator`),
`checks.py` (its rules) and `adapter.py` (the simulator behind `tasks.envs.shard.SingleEnv`). The functions here
find a family's adapter through the registry (`adapter(cfg)`: the `adapter` module beside the registered config
class) and ask it what callers need: callers never branch on the simulator name. An adapter module provides
`SINGLE_ENV` (its SingleEnv class), `GRIPPER_CONVENTION`, `instruction(cfg)` and `max_episode_steps(cfg)`, and
may provide the optional hooks below (a hook missing means the default each function here states); the checks
module provides `check_config(env)`, `CHECKS` and `COMPONENT_CHECKS`.

`make_shard(cfg, ...)` is the only entry point graph nodes use. The shard owns the episode lifecycle
(tasks.envs.shard: the SAME_STEP / DISABLED mode table, `begin_rollout`, `chunk_step`, the exact-resume cursor
`state_dict` / `load_state_dict`); callers make no reset decisions.
"""
from __future__ import annotations

import importlib
from types import ModuleType
from typing import Callable

from tasks.config import ConfigError, EnvConfig
from tasks.envs.scripted import (SCRIPTED_PREFIX, SCRIPTED_TEACHERS, check_scripted_teacher,  # noqa: F401
                                 is_scripted_teacher, make_scripted_teacher)
from tasks.envs.shard import ChunkResult, EnvShard, SingleEnv


def adapter_of(simulator: str) -> ModuleType:
    """The adapter module of env family `simulator` (`tasks/envs/<name>/adapter.py` beside its registered config
    class), imported on first use so heavy simulators stay optional.

    Raises:
        ConfigError: env.simulator names no registered family (the known ones listed, with a did-you-mean).
    """
    from tasks.config.registry import family_class
    package = family_class("env", simulator).__module__.rsplit(".", 1)[0]
    return importlib.import_module(f"{package}.adapter")


def adapter(cfg: EnvConfig) -> ModuleType:
    """The adapter module of cfg's env family (`adapter_of(cfg.simulator)`)."""
    return adapter_of(cfg.simulator)


def _hook(cfg: EnvConfig, name: str):
    return getattr(adapter(cfg), name, None)


def checks(cfg: EnvConfig) -> ModuleType:
    """The rules module of cfg's env family (`tasks/envs/<name>/checks.py`: `check_config(env)`, `CHECKS`,
    `COMPONENT_CHECKS`)."""
    return importlib.import_module(f"{adapter(cfg).__name__.rsplit('.', 1)[0]}.checks")


def check_env_config(cfg: EnvConfig) -> None:
    """Offline validation of an env section against its simulator (the family's `checks.check_config`: env task,
    modes, files). Raises ConfigError."""
    checks(cfg).check_config(cfg)


def check_components(cfg) -> None:
    """The env family's checks of a whole run config (`tasks.config.Config`) that need the simulator installed:
    the family's `checks.check_config` of the env section, then its `checks.COMPONENT_CHECKS` (ManiSkill: a
    Vulkan driver; LIBERO: envs moving between tasks, the env workers' memory). Run by every command that starts
    components (run, validate, eval, record). Raises ConfigError (or the family's own error: VulkanMissingError)."""
    check_env_config(cfg.env)
    for check in getattr(checks(cfg.env), "COMPONENT_CHECKS", ()):
        check(cfg)


GRIPPER_CONVENTIONS = ("open_positive", "close_positive")  # +1 on the last action dim opens / closes the gripper
# hf/ exports written before the convention was recorded are ManiSkill's (a trajectory store always carries it: an
# older one lacking it is refused until `python -m pipelines.upgrade` adds its simulator's)
LEGACY_GRIPPER_CONVENTION = "open_positive"


def gripper_convention(cfg: EnvConfig) -> str:
    """The gripper polarity of cfg's simulator (its adapter's GRIPPER_CONVENTION, one of GRIPPER_CONVENTIONS):
    what stores (`gripper_convention` attr) and hf/ exports (config.json `env.gripper_convention`) record."""
    return adapter(cfg).GRIPPER_CONVENTION


def check_gripper_convention(key: str, value, recorded: str | None, cfg: EnvConfig) -> None:
    """Refuse a policy checkpoint or demo store of the other gripper polarity than cfg's simulator (a policy
    trained on ManiSkill would close LIBERO's gripper where it meant to open it). `recorded` None: an hf/ export
    written before the convention was recorded, i.e. LEGACY_GRIPPER_CONVENTION. Raises ConfigError(key, value, fix)."""
    have, want = recorded or LEGACY_GRIPPER_CONVENTION, gripper_convention(cfg)
    if have != want:
        raise ConfigError(key, value, f"was made with gripper convention {have!r}, env.simulator={cfg.simulator} "
                                      f"uses {want!r} (+1 {'closes' if want == 'close_positive' else 'opens'}): "
                                      f"convert the gripper action (negate it) or use a {cfg.simulator} one")


def store_attrs(cfg: EnvConfig) -> dict:
    """Adapter-specific trajectory store attributes (hook `store_attrs(cfg)`; LIBERO: the seed -> init state
    mapping keys; ManiSkill: the robot's visual LOD of image stores); default none."""
    fn = _hook(cfg, "store_attrs")
    return fn(cfg) if fn else {}


def store_warnings(cfg: EnvConfig, attrs: dict) -> list[str]:
    """What differs, harmlessly, between a demo store (its `attrs`) and what cfg's envs give (hook
    `store_warnings(cfg, attrs)`; ManiSkill: the arm's visual LOD of the stored images); default none."""
    fn = _hook(cfg, "store_warnings")
    return list(fn(cfg, attrs)) if fn else []


def missing_store_attrs(simulator: str, attrs: dict, run_env: dict | None = None) -> dict:
    """The family attributes (`store_attrs`) a trajectory store of env family `simulator` (its `attrs`) lacks, a
    store written before the family recorded them, each with the value its data was recorded with (hook
    `missing_store_attrs(attrs, run_env)`; `run_env`: the saved env section of the store's run, {} for a recording;
    ManiSkill: `robot_visual_lod` of an image store); default none. Readers refuse a store that lacks any
    (`pipelines.upgrade.store.store_refusal`, keys only); `python -m pipelines.upgrade` adds them.

    Raises:
        ConfigError: `simulator` names no registered family.
    """
    fn = getattr(adapter_of(simulator), "missing_store_attrs", None)
    return dict(fn(attrs, run_env or {})) if fn else {}


def env_worker_memory_gib(cfg: EnvConfig, envs_per_worker: int) -> float | None:
    """Estimated peak memory (GiB) of an env worker holding `envs_per_worker` envs of cfg's simulator, the worker
    process included, where it is measured (hook `worker_memory_gib(envs_per_worker)`; LIBERO: ~2 GiB for the
    first env, 1 GiB each further one); None where it is not."""
    fn = _hook(cfg, "worker_memory_gib")
    return float(fn(envs_per_worker)) if fn else None


def config_from_store(simulator: str, attrs: dict, run_env: dict, common: dict) -> EnvConfig:
    """The env config that rebuilds a trajectory store's env: family `simulator`'s config class with the `common`
    keys (ids, modes, flags every family has), then its adapter's hook `config_from_store(attrs, run_env, cfg)`
    (what the store's attrs and the run's saved `env` section add; default nothing). Raises ConfigError for an
    unknown simulator."""
    from tasks.config.registry import family_class
    cfg = family_class("env", simulator)(simulator=simulator, **common)
    fn = getattr(adapter_of(simulator), "config_from_store", None)
    return fn(attrs, run_env, cfg) if fn else cfg


def state_dim(cfg: EnvConfig) -> int | None:
    """The length of cfg's state observation when its adapter knows it offline (hook `obs_dim(cfg)`; LIBERO: 8,
    or 14 with env.object_state), else None (ManiSkill: the env task's own state, known once an env is built)."""
    fn = _hook(cfg, "obs_dim")
    return fn(cfg) if fn else None


def num_cameras(cfg: EnvConfig) -> int:
    """Camera images per observation of cfg's env (hook `num_cameras(cfg)`; LIBERO: 2 with env.wrist_camera);
    default 1 with obs_mode=rgb, 0 without images. With K > 1 the env's images are uint8 [K, H, W, 3] per env
    (cameras in the order of tasks.prompts.CAMERA_KEYS), one camera's are [H, W, 3]."""
    if cfg.obs_mode != "rgb":
        return 0
    fn = _hook(cfg, "num_cameras")
    return int(fn(cfg)) if fn else 1


def action_dim(cfg: EnvConfig) -> int | None:
    """The action length of cfg's env when its adapter knows it offline (hook `action_dim(cfg)`; LIBERO: 7), else
    None (ManiSkill: the controller's, known once an env is built: tasks.rollout.env_dims)."""
    fn = _hook(cfg, "action_dim")
    return fn(cfg) if fn else None


def state_hint(cfg: EnvConfig, other_dim: int) -> str:
    """The fix for a checkpoint or store that reads an `other_dim`-D state where cfg's env gives another (hook
    `state_hint(cfg, other_dim)`; LIBERO: env.object_state makes the 8- or 14-D state)."""
    fn = _hook(cfg, "state_hint")
    return (fn(cfg, other_dim) if fn else None) or "record or train with the same env settings"


def env_ids_share_robot(cfg: EnvConfig) -> bool:
    """Whether a checkpoint trained on another env task of cfg's simulator reads the same state and writes the same
    actions (adapter's ENV_IDS_SHARE_ROBOT; LIBERO's suites: True, so a libero_90 checkpoint fine-tunes on
    libero_10); default False."""
    return bool(getattr(adapter(cfg), "ENV_IDS_SHARE_ROBOT", False))


def carries_history(cfg: EnvConfig) -> bool:
    """Whether an env instance's dynamics depend on the episodes it ran before (adapter's CARRIES_HISTORY;
    ManiSkill's CPU envs keep solver and contact state across `reset`), so an exactly resumable run must start
    fresh instances where a resumed one would (runner.exact_resume); default False."""
    return bool(getattr(adapter(cfg), "CARRIES_HISTORY", False))


def worker_env(cfg: EnvConfig) -> dict[str, str]:
    """Environment variables an env worker process needs for cfg's simulator (hook `worker_env(cfg)`; ManiSkill:
    the Vulkan ICD SAPIEN loads); default none. Raises the adapter's error when the machine lacks what it needs."""
    fn = _hook(cfg, "worker_env")
    return dict(fn(cfg)) if fn else {}


def prepare_process(cfg: EnvConfig) -> None:
    """Make this process ready to build cfg's envs (hook `prepare_process(cfg)`; ManiSkill: find a Vulkan driver,
    register the env tasks), so a missing driver shows before any work. Raises the adapter's error."""
    fn = _hook(cfg, "prepare_process")
    if fn:
        fn(cfg)


def is_batched(cfg: EnvConfig) -> bool:
    """Whether one simulator instance holds a shard's envs (the adapter's BATCHED_BACKENDS, e.g. ManiSkill's
    `physx_cuda`): such episodes keep no action log and are not replayed (eval videos)."""
    return cfg.sim_backend in getattr(adapter(cfg), "BATCHED_BACKENDS", ())


def protocol_episodes(cfg: EnvConfig) -> int | None:
    """The episodes of the simulator's own evaluation protocol (hook `protocol_episodes(cfg)`; LIBERO: every
    selected task x every eval init state), else None (the eval runs env.eval.num_episodes)."""
    fn = _hook(cfg, "protocol_episodes")
    return fn(cfg) if fn else None


def eval_task_names(cfg: EnvConfig) -> dict[str, str]:
    """{task_id: name} of the selected tasks (hook `eval_task_names(cfg)`; LIBERO: the suite's task names); {} for
    a single-task simulator."""
    fn = _hook(cfg, "eval_task_names")
    return fn(cfg) if fn else {}


def eval_params(cfg: EnvConfig) -> dict:
    """The env keys an external eval records as MLflow params beyond env_id and env.eval.* (hook
    `eval_params(cfg)`; ManiSkill: the robot's visual LOD; LIBERO: the task subset)."""
    fn = _hook(cfg, "eval_params")
    return fn(cfg) if fn else {}


def replay_mismatch_note(simulator: str) -> str | None:
    """What a replay MISMATCH whose reset matched can mean for family `simulator` (adapter's
    REPLAY_MISMATCH_NOTE; ManiSkill: the training env's history), or None."""
    return getattr(adapter_of(simulator), "REPLAY_MISMATCH_NOTE", None)


def instruction(cfg: EnvConfig) -> str:
    """The natural-language instruction of cfg's env task (the VLA prompt of its runs), by its adapter."""
    return adapter(cfg).instruction(cfg)


def instructions(cfg: EnvConfig) -> list[str]:
    """The run's instruction table: index = the `task_id` an env reports (tasks.envs.shard), value = the VLA prompt.
    LIBERO: every task of the suite in its standard order (so a stored task_id is the suite's task id); a
    single-task simulator (ManiSkill): [instruction(cfg)], task_id 0."""
    fn = _hook(cfg, "instructions")
    return list(fn(cfg)) if fn else [instruction(cfg)]


def max_episode_steps(cfg: EnvConfig) -> int:
    """Policy steps of an episode of cfg's env: `env.max_episode_steps`, else the adapter's default (LIBERO: per
    suite; ManiSkill: the registered env's)."""
    if cfg.max_episode_steps:
        return int(cfg.max_episode_steps)
    return int(adapter(cfg).max_episode_steps(cfg))


def make_single_env(cfg: EnvConfig, render_size: int | None = None) -> SingleEnv:
    """One simulator instance of `cfg`'s env task. `render_size` (pixels): an instance that also renders square
    frames of that size (`render_frame()`, uint8 [S, S, 3]) for videos; same dynamics.

    Raises:
        ConfigError: an unknown simulator, or `render_size` for a simulator whose adapter cannot render.
    """
    cls = adapter(cfg).SINGLE_ENV
    if not render_size:
        return cls(cfg)
    if not hasattr(cls, "render_frame"):
        raise ConfigError("env.simulator", cfg.simulator, "its adapter renders no frames for videos: set "
                          "runner.eval_videos=0")
    return cls(cfg, render_size=render_size)


def make_shard(cfg: EnvConfig, *, shard: int, num_shards: int, num_envs: int, auto_reset: bool,
               ignore_terminations: bool, base_seed: int, episode_count=None,
               seed_fn: Callable[[int, int], int] | None = None, group_size: int = 1) -> EnvShard:
    """Create env shard `shard` of `num_shards` splitting `num_envs` envs evenly (`episode_count`: per-env counts
    to continue; a full cursor is loaded afterwards with `EnvShard.load_state_dict`)."""
    size = num_envs // num_shards
    if is_batched(cfg):  # one simulator instance (the adapter's BATCHED_ENV) holds the shard's envs
        from tasks.envs.batched import BatchedEnvShard
        return BatchedEnvShard(adapter(cfg).BATCHED_ENV(cfg, size), env_offset=shard * size,
                               num_envs_total=num_envs, base_seed=base_seed, auto_reset=auto_reset,
                               ignore_terminations=ignore_terminations, episode_count=episode_count,
                               seed_fn=seed_fn, group_size=group_size)
    envs = [make_single_env(cfg) for _ in range(size)]
    return EnvShard(envs, env_offset=shard * size, num_envs_total=num_envs, base_seed=base_seed,
                    auto_reset=auto_reset, ignore_terminations=ignore_terminations, episode_count=episode_count,
                    seed_fn=seed_fn, group_size=group_size)


__all__ = ["ChunkResult", "EnvShard", "SingleEnv", "action_dim", "adapter", "adapter_of", "carries_history",
           "check_components", "check_env_config", "check_gripper_convention", "check_scripted_teacher", "checks",
           "config_from_store", "env_ids_share_robot", "env_worker_memory_gib", "eval_params", "eval_task_names",
           "gripper_convention", "instruction", "instructions", "is_batched", "is_scripted_teacher",
           "make_scripted_teacher", "make_shard", "make_single_env", "max_episode_steps", "prepare_process",
           "protocol_episodes", "replay_mismatch_note", "state_dim", "state_hint", "store_attrs", "store_warnings",
           "worker_env"]
