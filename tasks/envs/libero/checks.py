"""The LIBERO family's rules: plain functions that raise ConfigError (tasks.config.registry's `checks`).

`CHECKS` (registered with the family, run by `tasks.config.checks` at every validation) read the config alone;
`COMPONENT_CHECKS` (run by `tasks.envs.check_components`, where the components are checked: run, validate, eval,
record) read LIBERO's installed files and the run's placement. `check_config` is the env section's offline check
against the installed suite (tasks.envs.check_env_config; every LiberoEnv runs it too).
"""
from __future__ import annotations

import math
import sys
from typing import TYPE_CHECKING

from tasks.config import ConfigError
from tasks.envs.libero.goals import tasks_without_pick_place_goal
from tasks.envs.libero.reset_states import split_trials
from tasks.envs.libero.suites import INSTRUCTION_SOURCES, check_files, suite, task_ids, trial_counts

if TYPE_CHECKING:
    from tasks.config import Config, EnvConfig

OBS_MODES = ("state", "rgb")
SIM_BACKENDS = ("cpu", "mujoco")
CONTROL_MODES = ("OSC_POSE",)
REWARD_MODES = ("sparse",)
TRIAL_SPLITS = ("disjoint", "shared")
# measured peak RSS of LIBERO envs in one process (README "LIBERO"): the first one with its render context, and
# each further one; the worker process itself (torch, dask, a tiny policy) on top
FIRST_ENV_GIB, EXTRA_ENV_GIB, WORKER_BASE_GIB = 2.0, 1.0, 0.8


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


def check_no_val_split(cfg: Config) -> None:
    """LIBERO has no validation split (env.eval.val_episodes must be 0). Raises ConfigError."""
    if cfg.env.eval.val_episodes:
        raise ConfigError("env.eval.val_episodes", cfg.env.eval.val_episodes,
                          "LIBERO has no validation split: a reset seed above env.eval.seed maps to the "
                          "suite's eval init states (tasks.envs.libero.reset_states.reset_state_for_seed), so it "
                          "would replay the eval's episodes; use 0 (the eval's episodes choose checkpoints/best)")


def check_run_placement(cfg: Config) -> None:
    """LIBERO checks that need the whole config: envs moving between tasks (a warning on stderr, they rebuild
    their instance: `check_run`) and the env workers' memory (`check_memory`). Raises ConfigError."""
    from tasks.resident import memory_limit_bytes
    from tasks.rollout import group_size
    e, c = cfg.env, cfg.cluster
    for w in check_run(e.num_envs, group_size(cfg), len(task_ids(e)), e.eval.num_envs):
        print(f"warning: {w}", file=sys.stderr)
    limit = c.memory_limit
    if c.env_workers is None:  # an existing cluster's workers: their number and limits are known once connected
        return
    # an algorithm that rolls nothing out (its spec: SFT): its env workers hold eval envs only
    check_memory(shard_size=e.shard_size if cfg.algorithm.spec.rollout else 0,
                 eval_shard_size=e.eval.num_envs // e.num_shards,
                 num_shards=e.num_shards, num_env_workers=c.env_workers,
                 memory_limit_bytes=memory_limit_bytes(limit), memory_limit=str(limit))


def check_cameras(cfg: Config) -> None:
    """The policy family reads every camera the env renders: env.wrist_camera (2 images per observation, needs
    env.obs_mode=rgb) needs a family whose config declares `cameras` >= 2 (pi0, pi05); the others read "rgb" alone.
    Raises ConfigError (env.wrist_camera)."""
    if cfg.env.wrist_camera and cfg.env.obs_mode != "rgb":
        raise ConfigError("env.wrist_camera", True, "renders a camera image: needs env.obs_mode=rgb (or set "
                                                    "env.wrist_camera=false)")
    from tasks.envs import num_cameras
    have, reads = num_cameras(cfg.env), type(cfg.policy).cameras
    if have > reads:
        raise ConfigError("env.wrist_camera", cfg.env.wrist_camera,
                          f"renders {have} cameras, policy.name={cfg.policy.name} reads {reads} (\"rgb\" only): set "
                          f"env.wrist_camera=false or use a family that reads the wrist camera (policy.name=pi0|pi05)")


CHECKS = (check_no_val_split, check_cameras)
COMPONENT_CHECKS = (check_run_placement,)
