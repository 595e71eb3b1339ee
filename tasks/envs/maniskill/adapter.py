"""ManiSkill3 adapter: one `physx_cpu` simulator instance per env (num_envs=1), many instances per process; or,
with `env.sim_backend=physx_cuda`, one GPU simulator instance per env shard holding all its envs
(`ManiSkillBatchedEnv`, num_envs = shard size, batched torch tensors on the GPU; tasks.envs.batched).

Observation (`obs_mode=state`): the env task's flat state vector, float32 [O] (PushCube-v1: O=35 — Panda joint
positions (rad) and velocities (rad/s), gripper/TCP pose (m, quaternion), goal and cube positions (m); see
ManiSkill's `PushCubeEnv._get_obs_extra`). Action (`pd_joint_delta_pos`): float32 [8] in [-1, 1], seven joint
position deltas normalised to ±0.1 rad plus the gripper command. Reward modes: `normalized_dense` (in [0, 1]),
`dense`, `sparse`. `terminated` = success (or failure) as ManiSkill's `evaluate()` reports it; `truncated` = the
TimeLimit (`max_episode_steps`, 50 for PushCube-v1/PickCube-v1).

Determinism (MACHINE.md): `reset(seed=k)` + the same actions gives bit-identical observations and rewards across
processes for envs with the same history, so (seed, actions) replays an episode of a fresh env exactly; an env that
has run earlier episodes keeps solver/contact state across `reset` and can leave that trajectory by up to ~1e-2
after some actions (benchmarks/env_history.py: 5 of 64 episodes of a default run).

`obs_mode=rgb`: the env runs in ManiSkill's state obs mode and the task's camera (`base_camera`, resized by
`sensor_configs` to env.image_size) is rendered only when the shard asks (`render_rgb`), i.e. once per chunk step
rather than at every simulator step: on CPU (lavapipe) one 32-64 px capture costs ~50-65 ms of CPU, 10x a physics
step, nearly all of it the Panda arm's ~136k visual triangles; `env.robot_visual_lod` (tasks.envs.maniskill.mesh_lod) renders
a decimated copy of the arm's visual meshes (0.1: ~10 ms) with the same collision meshes and dynamics.

Instructions: each env task has a fixed natural-language instruction (`INSTRUCTIONS`, else one derived from the
id), the prompt of VLA policies.

GPU simulation (`physx_cuda`, needs CUDA; checked offline): observations, rewards and flags come back as CUDA
tensors [B, ...] and are copied to numpy once per simulator step for the shard's bookkeeping (the policy moves
them back with `policy.device=cuda`). ManiSkill 3.0.1 seeds a partial reset's initial states with the first env's
episode seed (`torch.manual_seed(_episode_seed[0])` in `BaseEnv.reset`), so GPU episodes keep the per-env seed
bookkeeping but are not bit-replayable per (env, seed) as CPU ones are; single envs (the dims probe, replay)
always use the CPU simulator.

Imports of mani_skill/sapien happen inside functions: importing this module is cheap and needs no Vulkan.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from tasks.envs.maniskill.mesh_lod import robot_lod
from tasks.envs.maniskill.vulkan import VulkanMissingError, ensure_vulkan, vulkan_env

if TYPE_CHECKING:
    from tasks.config import EnvConfig

OBS_MODES = ("state", "rgb")  # rgb: the state vector plus the task's camera image (see ManiSkillEnv)
SIM_BACKENDS = ("physx_cpu", "cpu", "physx_cuda")
BATCHED_BACKENDS = ("physx_cuda",)  # one simulator instance per shard (tasks.envs.make_shard)
REWARD_MODES = ("normalized_dense", "dense", "sparse")
GRIPPER_CONVENTION = "open_positive"  # the last action dim: +1 opens the Panda gripper, -1 closes it (LIBERO: the
# reverse, tasks.envs.libero.adapter); recorded in stores and hf/ exports (tasks.envs.gripper_convention)
# a CPU env keeps solver and contact state across `reset` (module docstring, "Determinism"): runner.exact_resume
# starts fresh instances at every checkpoint (tasks.envs.carries_history)
CARRIES_HISTORY = True
REPLAY_MISMATCH_NOTE = ("a ManiSkill MISMATCH whose reset matched can be the training env's history, not damage: the "
                        "run's env had run earlier episodes, whose solver and contact state a fresh env lacks "
                        "(benchmarks/env_history.py)")


def instruction(cfg: EnvConfig) -> str:
    """The env task's instruction (`instruction_for(cfg.env_id)`)."""
    return instruction_for(cfg.env_id)


def store_attrs(cfg: EnvConfig) -> dict:
    """Trajectory store attributes: `robot_visual_lod` of image stores (what the stored images show of the arm)."""
    return {"robot_visual_lod": float(cfg.robot_visual_lod)} if cfg.obs_mode == "rgb" else {}


def missing_store_attrs(attrs: dict, run_env: dict) -> dict:
    """What an image store (`obs_mode` rgb) written before `store_attrs` recorded `robot_visual_lod` (2026-12-02)
    lacks, with what its images show: the LOD of its run's saved env section (`run_env`) where that has the key (the
    config key came three minutes before the store attribute), else 1.0, the original meshes (a recording, or a run
    before the key). {} for a state store or one that has it."""
    if attrs.get("obs_mode") != "rgb" or "robot_visual_lod" in attrs:
        return {}
    return {"robot_visual_lod": float(run_env.get("robot_visual_lod", 1.0))}


def store_warnings(cfg: EnvConfig, attrs: dict) -> list[str]:
    """What differs, harmlessly, between a demo store's images (its `attrs`, which record `robot_visual_lod`: an
    image store without it is refused where it is read, `missing_store_attrs`) and what cfg's envs render: the arm's
    visual LOD."""
    if cfg.obs_mode != "rgb":
        return []
    stored = float(attrs["robot_visual_lod"])
    if stored == cfg.robot_visual_lod:
        return []
    return [f"its images show the arm at robot_visual_lod={stored}, this run renders env.robot_visual_lod="
            f"{cfg.robot_visual_lod} (its evals see slightly different images: README 'Rendering cost'); set "
            f"env.robot_visual_lod={stored} to match"]


def config_from_store(attrs: dict, run_env: dict, cfg: EnvConfig) -> EnvConfig:
    """`cfg` (rebuilt from a store's common attrs) with the robot's visual LOD of the store's images (an image store
    records it: `store_attrs`); a state store records none: the run's saved env section's (`run_env`: replay videos
    show the arm as the run rendered its eval videos), else cfg's own (a recording: no run config)."""
    import dataclasses
    lod = attrs["robot_visual_lod"] if cfg.obs_mode == "rgb" else run_env.get("robot_visual_lod", cfg.robot_visual_lod)
    return dataclasses.replace(cfg, robot_visual_lod=float(lod))


def eval_params(cfg: EnvConfig) -> dict:
    """What an external eval's MLflow params record of the env beyond its id: the robot's visual LOD."""
    return {"env.robot_visual_lod": cfg.robot_visual_lod}


def worker_env(cfg: EnvConfig) -> dict[str, str]:
    """An env worker's environment: the Vulkan ICD SAPIEN loads (tasks.envs.maniskill.vulkan.vulkan_env; raises
    VulkanMissingError without one)."""
    return vulkan_env()


def prepare_process(cfg: EnvConfig) -> None:
    """Find a Vulkan driver (VulkanMissingError without one) and register ManiSkill's env tasks in this process."""
    ensure_vulkan()
    import mani_skill.envs  # noqa: F401


def _registry():
    import mani_skill.envs  # noqa: F401  (registers the env tasks)
    from mani_skill.utils.registration import REGISTERED_ENVS
    return REGISTERED_ENVS


def physx_gpu_library() -> tuple[Path, str]:
    """(the file SAPIEN's GPU PhysX loads, the zip it comes in): `~/.sapien/physx/<version>/libPhysXGpu_64.so` and
    sapien-sim/physx-precompiled's release zip (SAPIEN 3.0's `sapien.physx.enable_gpu` downloads it there when
    the file is missing; x86-64 Linux)."""
    from sapien import physx
    version = physx.version()
    return (Path.home() / ".sapien" / "physx" / version / "libPhysXGpu_64.so",
            f"https://github.com/sapien-sim/physx-precompiled/releases/download/{version}/linux-so.zip")


INSTRUCTIONS = {
    "PushCube-v1": "push the cube to the goal region",
    "PickCube-v1": "pick up the cube and move it to the goal position",
    "StackCube-v1": "stack the red cube on top of the green cube",
    "PullCube-v1": "pull the cube to the goal region",
    "PokeCube-v1": "use the peg to poke the cube to the goal region",
    "LiftPegUpright-v1": "lift the peg upright",
}


def instruction_for(env_id: str) -> str:
    """The natural-language instruction of an env task: a fixed table, else words from the id
    ("RollBall-v1" -> "roll ball")."""
    if env_id in INSTRUCTIONS:
        return INSTRUCTIONS[env_id]
    import re
    name = env_id.split("-v")[0]
    return " ".join(w.lower() for w in re.findall(r"[A-Z][a-z0-9]*|[a-z0-9]+", name))


def default_max_episode_steps(env_id: str) -> int:
    """The registered env task's own episode limit (50 for PushCube-v1)."""
    return int(_registry()[env_id].max_episode_steps)


def max_episode_steps(cfg: EnvConfig) -> int:
    """Policy steps of an episode: env.max_episode_steps, else the env task's own limit."""
    return int(cfg.max_episode_steps or default_max_episode_steps(cfg.env_id))


def _make_kwargs(cfg: EnvConfig, sim_backend: str, num_envs: int) -> tuple[dict, tuple[int, int, int] | None]:
    """`gym.make` keyword arguments for a ManiSkill instance of `num_envs` envs (state obs; the camera sized to
    env.image_size for obs_mode=rgb) and the image shape (H, W, 3) or None. Checks Vulkan, registers the env tasks
    and quiets ManiSkill's logger ("sapien_cuda not found, falling back" on CPU).

    Raises VulkanMissingError (ensure_vulkan)."""
    ensure_vulkan()
    import logging
    import mani_skill.envs  # noqa: F401
    for name in ("mani_skill", "mani_skill "):  # ManiSkill 3.0.1 names its logger with a trailing space
        logging.getLogger(name).setLevel(logging.ERROR)
    kwargs = dict(obs_mode="state", control_mode=cfg.control_mode, reward_mode=cfg.reward_mode,
                  sim_backend=sim_backend, render_mode=None, num_envs=num_envs)
    if cfg.max_episode_steps:
        kwargs["max_episode_steps"] = cfg.max_episode_steps
    if cfg.obs_mode != "rgb":
        return kwargs, None
    kwargs["sensor_configs"] = dict(width=cfg.image_size, height=cfg.image_size)
    return kwargs, (cfg.image_size, cfg.image_size, 3)


def capture_rgb(base):
    """The task camera's RGB image of the current state(s), a uint8 torch tensor [B, H, W, 3], `base` the unwrapped
    ManiSkill env (state obs mode: it renders on request only).

    ManiSkill's own sensor path (`_get_obs_sensor_data`) in state obs mode also reads back depth; the same steps
    (hide the task's hidden objects, update the render scene, capture every sensor) with the RGB read-back only
    give the same pixels for ~3 ms less per capture here. The camera is `base_camera`, else the first sensor.
    """
    for obj in base._hidden_objects:
        obj.hide_visual()
    base.scene.update_render(update_sensors=True, update_human_render_cameras=False)
    base.capture_sensor_data()
    sensors = base.scene.sensors
    cam = sensors["base_camera"] if "base_camera" in sensors else next(iter(sensors.values()))
    return cam.get_obs(rgb=True, depth=False, position=False, segmentation=False)["rgb"]


class ManiSkillEnv:
    """One ManiSkill env instance implementing `tasks.envs.shard.SingleEnv` (numpy in, numpy out).

    `render_size` (pixels): also create ManiSkill's human render camera (`render_mode="rgb_array"`, square
    `render_size` frames) for `render_frame`; the dynamics are those of the same instance without it (the camera
    only observes), so (seed, actions) of an episode replays on it exactly.
    """

    def __init__(self, cfg: EnvConfig, render_size: int | None = None):
        import gymnasium as gym
        kwargs, self.image_shape = _make_kwargs(cfg, "physx_cpu", 1)  # physx_cuda: ManiSkillBatchedEnv
        if render_size:
            kwargs.update(render_mode="rgb_array",
                          human_render_camera_configs=dict(width=int(render_size), height=int(render_size)))
        self.instruction = instruction_for(cfg.env_id)
        try:
            with robot_lod(cfg.env_id, cfg.robot_visual_lod):
                self.env = gym.make(cfg.env_id, **kwargs)
        except RuntimeError as exc:  # SAPIEN without a usable Vulkan device
            if "vk::" in str(exc) or "Vulkan" in str(exc):
                from tasks.envs.maniskill.vulkan import FIX
                raise VulkanMissingError(f"Vulkan failed in SAPIEN ({exc}): {FIX}") from None
            raise
        self.obs_dim = int(np.prod(self.env.observation_space.shape[1:]))
        self.action_dim = int(np.prod(self.env.action_space.shape[1:] or self.env.action_space.shape))
        from tasks.envs.maniskill.fast_step import fast_step_for
        self._fast_step = fast_step_for(self.env) if cfg.fast_step else None  # env.fast_step
        self.fps = float(getattr(self.env.unwrapped, "control_freq", 20) or 20)  # actions per second (videos)

    def reset(self, seed: int) -> np.ndarray:
        obs, _ = self.env.reset(seed=seed)
        return obs.reshape(-1).cpu().numpy().astype(np.float32, copy=False)

    def step(self, action: np.ndarray):
        if self._fast_step is not None:  # the same values as env.step (tasks.envs.maniskill.fast_step)
            return self._fast_step(action)
        import torch
        obs, r, term, trunc, info = self.env.step(torch.from_numpy(action).reshape(1, -1))
        return (obs.reshape(-1).cpu().numpy().astype(np.float32, copy=False), float(r.reshape(-1)[0]),
                bool(term.reshape(-1)[0]), bool(trunc.reshape(-1)[0]), bool(info["success"].reshape(-1)[0]))

    def render_rgb(self) -> np.ndarray:
        """The camera image of the current state, uint8 [H, W, 3] (obs_mode=rgb only; `capture_rgb`), on the host:
        with a CUDA render device (SAPIEN picks one on a GPU machine) the camera's tensor is on the GPU."""
        return capture_rgb(self.env.unwrapped).reshape(self.image_shape).cpu().numpy()

    def render_frame(self) -> np.ndarray:
        """The human render camera's view of the current state, uint8 [S, S, 3] with S = `render_size`.

        Raises:
            RuntimeError: the env was created without `render_size`.
        """
        if self.env.unwrapped.render_mode != "rgb_array":
            raise RuntimeError("render_frame needs an env created with render_size (render_mode='rgb_array')")
        img = self.env.render()
        img = img.cpu().numpy() if hasattr(img, "cpu") else np.asarray(img)
        return np.ascontiguousarray(img.reshape(img.shape[-3:])[..., :3]).astype(np.uint8)

    def close(self) -> None:
        self.env.close()


class ManiSkillBatchedEnv:
    """One ManiSkill GPU simulator instance with `num_envs` envs (`tasks.envs.batched.BatchedEnv`): batched
    torch tensors on the simulator's CUDA device inside, numpy at the interface. Layouts as ManiSkillEnv's, with a
    leading [B]."""

    def __init__(self, cfg: EnvConfig, num_envs: int):
        import gymnasium as gym
        kwargs, self.image_shape = _make_kwargs(cfg, cfg.sim_backend, num_envs)
        self.instruction = instruction_for(cfg.env_id)
        with robot_lod(cfg.env_id, cfg.robot_visual_lod):
            self.env = gym.make(cfg.env_id, **kwargs)
        base = self.env.unwrapped
        self.device = base.device
        self.num_envs = int(base.num_envs)
        self.obs_dim = int(np.prod(base.single_observation_space.shape))
        self.action_dim = int(np.prod(base.single_action_space.shape))
        self._seeds = np.zeros(self.num_envs, np.int64)  # the seed each env's episode was reset with
        self._started = False

    def reset(self, seeds: np.ndarray, env_idx: np.ndarray) -> np.ndarray:
        """Reset envs `env_idx` with `seeds` (the first call resets every env: ManiSkill builds the scene then)."""
        import torch
        env_idx = np.asarray(env_idx, np.int64)
        self._seeds[env_idx] = seeds
        if not self._started or len(env_idx) == self.num_envs:
            obs, _ = self.env.reset(seed=self._seeds.tolist())
            self._started = True
        else:  # partial reset; the other envs keep their state (their seeds are passed unchanged)
            obs, _ = self.env.reset(seed=self._seeds.tolist(),
                                    options={"env_idx": torch.as_tensor(env_idx, device=self.device)})
        return self._np(obs).reshape(self.num_envs, -1)[env_idx].astype(np.float32, copy=False)

    def step(self, actions: np.ndarray):
        import torch
        obs, r, term, trunc, info = self.env.step(torch.as_tensor(actions, device=self.device))
        B = self.num_envs
        return (self._np(obs).reshape(B, -1).astype(np.float32, copy=False), self._np(r).reshape(B).astype(np.float32),
                self._np(term).reshape(B).astype(bool), self._np(trunc).reshape(B).astype(bool),
                self._np(info["success"]).reshape(B).astype(bool))

    def render_rgb(self) -> np.ndarray:
        """Camera images of the current states, uint8 [B, H, W, 3] (obs_mode=rgb only; `capture_rgb`)."""
        return self._np(capture_rgb(self.env.unwrapped)).reshape(self.num_envs, *self.image_shape)

    @staticmethod
    def _np(x) -> np.ndarray:
        return x.detach().cpu().numpy() if hasattr(x, "detach") else np.asarray(x)

    def close(self) -> None:
        self.env.close()


SINGLE_ENV, BATCHED_ENV = ManiSkillEnv, ManiSkillBatchedEnv  # tasks.envs.make_single_env / make_shard
