"""The input of `python -m pipelines.replay`: a store path, a run directory or a run id resolved to a
trajectories.zarr, the store opened and checked for what replay reads (a damaged one is bad input), and the run's
saved env section next to it. Every failure is a ReplayInputError with one line naming the path and the fix."""
from __future__ import annotations

import contextlib
import os
from pathlib import Path

from tasks import trajectory

STORE_DIR = "trajectories.zarr"
CONFIG_FILE = "config.yaml"

_REQUIRED_FIELDS = trajectory.REPLAY_FIELDS  # the `replay` fields of tasks.trajectory (the index's among them)


class ReplayInputError(Exception):
    """Bad input to the replay command; the message is one line naming the path or id and the fix."""


def resolve_store(arg: str, run_root: str | os.PathLike = "runs") -> Path:
    """The trajectories.zarr path for a store path, a run directory or a run id (under `run_root`)."""
    from storage.rundir import find_run_dir

    p = Path(arg)
    if p.exists():
        if (p / "zarr.json").is_file():
            return p
        if p.is_dir() and (p / STORE_DIR).exists():
            return p / STORE_DIR
        if p.is_dir() and (p / CONFIG_FILE).is_file():
            raise ReplayInputError(f"run directory {p} has no {STORE_DIR} (was storage.save_trajectories false?); "
                                   "replay needs a run that saved trajectories")
        raise ReplayInputError(f"{p} is neither a dagrl trajectory store (a {STORE_DIR} directory) nor a run "
                               f"directory holding one; pass <run_root>/<experiment>/<run_id> or its {STORE_DIR}")
    if os.sep in arg or "/" in arg or arg.endswith(".zarr") or arg in (".", ".."):
        raise ReplayInputError(f"{arg} does not exist; pass an existing {STORE_DIR}, run directory, or a run id "
                               f"(looked up under run_root=DIR)")
    try:
        run_dir = find_run_dir(run_root, arg)
    except (FileNotFoundError, ValueError) as exc:
        raise ReplayInputError(f"{exc}; pass the run directory or its {STORE_DIR}, or set run_root=DIR") from None
    if not (run_dir / STORE_DIR).exists():
        raise ReplayInputError(f"run {arg} ({run_dir}) has no {STORE_DIR} (was storage.save_trajectories false?)")
    return run_dir / STORE_DIR


def open_store(path: Path):
    """The TrajectoryStore at `path`, checked for what replay needs: its replay fields, the attributes that rebuild
    the env, and whole files behind the fields it reads (`read_fields`) at its complete steps.

    Raises:
        ReplayInputError: not a dagrl store, one of an older format (`pipelines.upgrade.store.store_refusal`: the
            fix is `python -m pipelines.upgrade`), a field or attribute missing, or a damaged store (the message
            names the array and chunk file: `storage.trajectories.DamagedStore`).
    """
    from pipelines.upgrade.store import store_refusal
    from storage.trajectories import DamagedStore, TrajectoryStore

    try:
        old = store_refusal(path)
        store = TrajectoryStore.open(path)
    except (FileNotFoundError, ValueError, KeyError) as exc:
        raise ReplayInputError(f"{exc}") from None
    if old is not None:
        raise ReplayInputError(old)
    missing = [f for f in _REQUIRED_FIELDS if f not in store.fields]
    if missing:
        raise ReplayInputError(f"trajectory store {path} lacks fields {missing} needed for replay; it was not "
                               "written by pipelines.run (see tasks.trajectory, docs/reference/trajectory.md)")
    attrs = store.attrs
    need = [k for k in ("env_id", "obs_mode", "control_mode", "reward_mode") if k not in attrs]
    if need:
        raise ReplayInputError(f"trajectory store {path} lacks attributes {need} needed to rebuild the env; "
                               "it was not written by pipelines.run")
    try:
        store.check_files(read_fields(store))  # a missing chunk file would read as zeros: a false MISMATCH
    except DamagedStore as exc:
        raise ReplayInputError(str(exc)) from None
    return store


def read_fields(store) -> list[str]:
    """The fields replay reads: the `replay` fields of tasks.trajectory, and task_id / trial_id."""
    return [*_REQUIRED_FIELDS, "task_id", "trial_id"]


@contextlib.contextmanager
def _reading(store, fields, steps=None):
    """Around reads of `fields` at `steps` (default: the complete steps) of `store`: a read that fails (a garbled
    chunk file: zarr/numcodecs raise their own errors) is traced to the chunk file it failed on.

    Raises:
        ReplayInputError: the files are damaged (`TrajectoryStore.check_files(..., decode=True)` names the array
            and chunk file); any other error is raised as it was.
    """
    from storage.trajectories import DamagedStore
    try:
        yield
    except Exception:
        try:
            store.check_files(fields, steps, decode=True)
        except DamagedStore as exc:
            raise ReplayInputError(str(exc)) from None
        raise


def run_env_settings(store_path: Path) -> tuple[dict, str | None]:
    """`env` section of the run's config.yaml next to the store, read as every saved config is
    (`pipelines.config.load_saved_config`, not re-validated: replay needs the env only), or ({}, a note) when the
    file is absent, not YAML or not a config this version reads."""
    cfg_path = Path(store_path).parent / CONFIG_FILE
    if not cfg_path.is_file():
        return {}, (f"no {CONFIG_FILE} next to the store: assumed sim_backend=physx_cpu, "
                    "ignore_terminations=false")
    import dataclasses

    import yaml

    from pipelines.config import load_saved_config
    from storage.rundir import DamagedRunFile, read_resolved_config
    from tasks.config import ConfigError
    try:
        read_resolved_config(cfg_path)  # a damaged file is refused, never replaced by the assumed defaults
    except DamagedRunFile as exc:
        raise ReplayInputError(str(exc)) from None
    try:
        env = dataclasses.asdict(load_saved_config(cfg_path, validate=False).env)
    except yaml.YAMLError:
        return {}, f"{cfg_path} is not valid YAML: assumed sim_backend=physx_cpu, ignore_terminations=false"
    except ConfigError as exc:
        return {}, (f"{cfg_path} is not a config this version reads ({exc}): assumed sim_backend=physx_cpu, "
                    "ignore_terminations=false")
    return env, None
