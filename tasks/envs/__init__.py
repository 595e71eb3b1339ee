"""Simulator adapters behind one registry, and the EnvShard that vectorises them.

`make_shard(cfg, ...)` is the only entry point graph nodes use; callers never branch on the simulator name.
The shard owns the episode lifecycle (tasks.envs.shard: the SAME_STEP / DISABLED mode table, `begin_rollout`,
`chunk_step`, the exact-resume cursor `state_dict` / `load_state_dict`); callers make no reset decisions.
"""
from __future__ import annotations

from typing import Callable

from tasks.config import ConfigError, EnvConfig
from tasks.envs.shard import ChunkResult, EnvShard, SingleEnv

_SIMULATORS: dict[str, tuple[str, str]] = {
    # name -> (module, class); modules are imported lazily so heavy simulators stay optional
    "maniskill": ("tasks.envs.maniskill.adapter", "ManiSkillEnv"),
    "libero": ("tasks.envs.libero.adapter", "LiberoEnv"),
}
# name -> class of one instance holding a whole shard, for the module's BATCHED_BACKENDS (GPU simulation)
_BATCHED: dict[str, str] = {"maniskill": "ManiSkillBatchedEnv"}


def _module(simulator: str):
    import importlib
    if simulator not in _SIMULATORS:
        raise ConfigError("env.simulator", simulator, f"known simulators: {sorted(_SIMULATORS)}")
    return importlib.import_module(_SIMULATORS[simulator][0])


def check_env_config(cfg: EnvConfig) -> None:
    """Offline validation of an env config by its adapter. Raises ConfigError."""
    _module(cfg.simulator).check_config(cfg)


GRIPPER_CONVENTIONS = ("open_positive", "close_positive")  # +1 on the last action dim opens / closes the gripper
# stores and checkpoints written before the convention was recorded are ManiSkill's
LEGACY_GRIPPER_CONVENTION = "open_positive"


def gripper_convention(cfg: EnvConfig) -> str:
    """The gripper polarity of cfg's simulator (its adapter's GRIPPER_CONVENTION, one of GRIPPER_CONVENTIONS):
    what stores (`gripper_convention` attr) and hf/ exports (config.json `env.gripper_convention`) record."""
    return _module(cfg.simulator).GRIPPER_CONVENTION


def check_gripper_convention(key: str, value, recorded: str | None, cfg: EnvConfig) -> None:
    """Refuse a policy checkpoint or demo store of the other gripper polarity than cfg's simulator (a policy
    trained on ManiSkill would close LIBERO's gripper where it meant to open it). `recorded` None: written before
    the convention was recorded, i.e. LEGACY_GRIPPER_CONVENTION. Raises ConfigError(key, value, fix)."""
    have, want = recorded or LEGACY_GRIPPER_CONVENTION, gripper_convention(cfg)
    if have != want:
        raise ConfigError(key, value, f"was made with gripper convention {have!r}, env.simulator={cfg.simulator} "
                                      f"uses {want!r} (+1 {'closes' if want == 'close_positive' else 'opens'}): "
                                      f"convert the gripper action (negate it) or use a {cfg.simulator} one")


def store_attrs(cfg: EnvConfig) -> dict:
    """Adapter-specific trajectory store attributes (LIBERO: the seed -> init state mapping keys; else none)."""
    fn = getattr(_module(cfg.simulator), "store_attrs", None)
    return fn(cfg) if fn else {}


def state_dim(cfg: EnvConfig) -> int | None:
    """The length of cfg's state observation when its adapter knows it offline (LIBERO: 8, or 14 with
    env.object_state), else None (ManiSkill: the env task's own state, known once an env is built)."""
    fn = getattr(_module(cfg.simulator), "obs_dim", None)
    return fn(cfg) if fn else None


def instruction(cfg: EnvConfig) -> str:
    """The natural-language instruction of cfg's env task (the VLA prompt of its runs), by its adapter."""
    return _module(cfg.simulator).instruction(cfg)


def instructions(cfg: EnvConfig) -> list[str]:
    """The run's instruction table: index = the `task_id` an env reports (tasks.envs.shard), value = the VLA prompt.
    LIBERO: every task of the suite in its standard order (so a stored task_id is the suite's task id); a
    single-task simulator (ManiSkill): [instruction(cfg)], task_id 0."""
    fn = getattr(_module(cfg.simulator), "instructions", None)
    return list(fn(cfg)) if fn else [instruction(cfg)]


SCRIPTED_PREFIX = "scripted:"
# `record.teacher=scripted:NAME`: NAME -> (the simulator it drives, module, class of its per-shard teacher)
SCRIPTED_TEACHERS: dict[str, tuple[str, str, str]] = {"libero": ("libero", "tasks.envs.libero.expert", "ShardExpert")}


def is_scripted_teacher(spec) -> bool:
    """Whether a `record.teacher` value names a scripted expert (`scripted:NAME`) rather than a trained run."""
    return isinstance(spec, str) and spec.startswith(SCRIPTED_PREFIX)


def check_scripted_teacher(spec: str, cfg: EnvConfig) -> None:
    """Offline checks of `record.teacher=scripted:NAME` against cfg's env: a known NAME, its simulator, and the
    expert's own task checks (its module's `check_tasks(cfg)`). Raises ConfigError (record.teacher / env.*)."""
    import importlib
    name = spec[len(SCRIPTED_PREFIX):]
    if name not in SCRIPTED_TEACHERS:
        raise ConfigError("record.teacher", spec, f"no scripted expert {name!r}; known: "
                                                  f"{[SCRIPTED_PREFIX + k for k in SCRIPTED_TEACHERS]}, or a run "
                                                  f"directory / run id of a trained teacher")
    sim, module, _ = SCRIPTED_TEACHERS[name]
    if cfg.simulator != sim:
        raise ConfigError("record.teacher", spec, f"drives env.simulator={sim}, this env is {cfg.simulator}: "
                                                  f"use an env={sim}_* conf or a trained teacher run")
    importlib.import_module(module).check_tasks(cfg)


def make_scripted_teacher(spec: str, shard: EnvShard, action_noise: float = 0.0):
    """The per-shard scripted teacher of `record.teacher=scripted:NAME` (`act(shard)` -> float32 [B, 1, D]);
    `action_noise`: record.action_noise."""
    import importlib
    _, module, cls = SCRIPTED_TEACHERS[spec[len(SCRIPTED_PREFIX):]]
    return getattr(importlib.import_module(module), cls)(shard, action_noise=action_noise)


def max_episode_steps(cfg: EnvConfig) -> int:
    """Policy steps of an episode of cfg's env: `env.max_episode_steps`, else the adapter's default (LIBERO: per
    suite; ManiSkill: the registered env's)."""
    if cfg.max_episode_steps:
        return int(cfg.max_episode_steps)
    mod = _module(cfg.simulator)
    if hasattr(mod, "max_episode_steps"):
        return int(mod.max_episode_steps(cfg))
    return int(mod.default_max_episode_steps(cfg.env_id))


def make_single_env(cfg: EnvConfig, render_size: int | None = None) -> SingleEnv:
    """One simulator instance of `cfg`'s env task. `render_size` (pixels): an instance that also renders square
    frames of that size (`render_frame()`, uint8 [S, S, 3]) for videos; same dynamics.

    Raises:
        ConfigError: an unknown simulator, or `render_size` for a simulator whose adapter cannot render.
    """
    cls = getattr(_module(cfg.simulator), _SIMULATORS[cfg.simulator][1])
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
    mod = _module(cfg.simulator)
    if cfg.sim_backend in getattr(mod, "BATCHED_BACKENDS", ()):  # one simulator instance holds the shard's envs
        from tasks.envs.batched import BatchedEnvShard
        return BatchedEnvShard(getattr(mod, _BATCHED[cfg.simulator])(cfg, size), env_offset=shard * size,
                               num_envs_total=num_envs, base_seed=base_seed, auto_reset=auto_reset,
                               ignore_terminations=ignore_terminations, episode_count=episode_count,
                               seed_fn=seed_fn, group_size=group_size)
    envs = [make_single_env(cfg) for _ in range(size)]
    return EnvShard(envs, env_offset=shard * size, num_envs_total=num_envs, base_seed=base_seed,
                    auto_reset=auto_reset, ignore_terminations=ignore_terminations, episode_count=episode_count,
                    seed_fn=seed_fn, group_size=group_size)


__all__ = ["ChunkResult", "EnvShard", "SingleEnv", "check_env_config", "check_gripper_convention", "gripper_convention",
           "instruction", "instructions", "state_dim", "store_attrs", "make_shard", "make_single_env", "is_scripted_teacher",
           "check_scripted_teacher", "make_scripted_teacher", "max_episode_steps"]
