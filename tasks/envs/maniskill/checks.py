"""The ManiSkill family's rules: plain functions that raise ConfigError (tasks.config.registry's `checks`).

`CHECKS` (registered with the family, run at every validation) read the config alone; `COMPONENT_CHECKS` (run by
`tasks.envs.check_components` where the components are checked: run, validate, eval, record) need the machine: a
Vulkan driver. `check_config` is the env section's offline check against ManiSkill's registry
(tasks.envs.check_env_config).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from tasks.config import ConfigError, did_you_mean

if TYPE_CHECKING:
    from tasks.config import Config, EnvConfig


def check_visual_lod(cfg: Config) -> None:
    """env.robot_visual_lod is a fraction of faces in (0, 1]. Raises ConfigError."""
    lod = cfg.env.robot_visual_lod
    if not 0 < lod <= 1:
        raise ConfigError("env.robot_visual_lod", lod, "the fraction of visual-mesh faces kept: use a value in (0, 1] "
                                                       "(1.0: the original meshes; 0.1 renders ~5x cheaper on a CPU)")


def check_vulkan(cfg: Config) -> None:
    """This machine has a Vulkan driver for SAPIEN (tasks.envs.maniskill.vulkan; VulkanMissingError, one line
    with the fix, without one)."""
    from tasks.envs.maniskill.vulkan import vulkan_env
    vulkan_env()


def check_config(env: EnvConfig) -> None:
    """Offline checks of an env config against ManiSkill's registry.

    Raises:
        ConfigError: unknown env id, an env task that needs downloaded assets, an unsupported obs mode or backend,
            GPU simulation without CUDA or without SAPIEN's GPU PhysX library (`physx_gpu_library`).
    """
    from tasks.envs.maniskill.adapter import (BATCHED_BACKENDS, OBS_MODES, REWARD_MODES, SIM_BACKENDS, _registry,
                                              physx_gpu_library)
    if env.obs_mode not in OBS_MODES:
        raise ConfigError("env.obs_mode", env.obs_mode, f"supported: {list(OBS_MODES)}")
    if env.sim_backend not in SIM_BACKENDS:
        raise ConfigError("env.sim_backend", env.sim_backend, f"use one of {list(SIM_BACKENDS)}")
    if env.sim_backend in BATCHED_BACKENDS:
        import torch
        if not torch.cuda.is_available():
            raise ConfigError("env.sim_backend", env.sim_backend, "GPU simulation needs CUDA and this machine has "
                              "none (torch.cuda.is_available() is False): use env.sim_backend=physx_cpu")
    if env.reward_mode not in REWARD_MODES:
        raise ConfigError("env.reward_mode", env.reward_mode, f"use one of {list(REWARD_MODES)}")
    reg = _registry()  # SAPIEN imported (with a Vulkan driver found) from here on
    if env.sim_backend in BATCHED_BACKENDS:
        lib, url = physx_gpu_library()
        if not lib.is_file():
            raise ConfigError("env.sim_backend", env.sim_backend,
                              f"SAPIEN's GPU PhysX needs {lib}, which SAPIEN would download at run time (no "
                              f"downloads at run time): rerun scripts/setup.sh on this machine with network (it "
                              f"fetches the file where torch sees CUDA), or fetch {url} elsewhere and unzip it into "
                              f"{lib.parent}, or use env.sim_backend=physx_cpu")
    if env.env_id not in reg:
        hint = did_you_mean(env.env_id, reg)
        raise ConfigError("env.env_id", env.env_id, f"not a ManiSkill env task; {hint + ' ' if hint else ''}"
                                                    f"(e.g. PushCube-v1, PickCube-v1)")
    if env.robot_visual_lod < 1:
        from tasks.envs.maniskill.mesh_lod import robot_urdf
        if robot_urdf(env.env_id) is None:
            raise ConfigError("env.robot_visual_lod", env.robot_visual_lod,
                              f"{env.env_id}'s robot has no URDF whose visual meshes could be decimated: use 1.0")
    from mani_skill.utils.assets.data import is_data_source_downloaded
    missing = [a for a in (reg[env.env_id].asset_download_ids or []) if not is_data_source_downloaded(a)]
    if missing:
        raise ConfigError("env.env_id", env.env_id,
                          f"needs downloaded assets {missing} (no downloads at run time); pick a task that ships "
                          f"with ManiSkill (PushCube-v1, PickCube-v1, StackCube-v1, PullCube-v1, ...) or run "
                          f"`python -m mani_skill.utils.download_asset {missing[0]}` on a machine with network first")


def inert_keys(cfg: Config, command: str = "run", cuda_count: int = 0) -> list[tuple[str, str]]:
    """ManiSkill's value-dependent keys that do nothing (tasks.config.checks.inert): env.fast_step off the CPU
    simulator."""
    e = cfg.env
    if e.sim_backend == "physx_cpu":
        return []
    return [("env.fast_step", f"chooses how a ManiSkill CPU env (env.sim_backend=physx_cpu) computes its step; "
                              f"env.sim_backend={e.sim_backend} does not read it: drop it")]


CHECKS = (check_visual_lod,)
COMPONENT_CHECKS = (check_vulkan,)
