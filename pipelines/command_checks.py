"""The checks of one command that need no cluster (`pipelines.config.check_command`): run trains something; record
has its teacher run and its output path (here, so that the one check path imports nothing of the command it
checks). Each raises ConfigError."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

from tasks.config import Config, ConfigError

from pipelines.compose import from_command_line, given_keys  # noqa: F401
from pipelines.saved_config import load_saved_config


def check_command(cfg: Config, command: str = "run", *, require_teacher: bool = True) -> None:
    """The checks of one command that need no cluster (run: the config trains something; record: the teacher,
    the output path: `check_record`). Raises ConfigError."""
    if command == "run":
        if cfg.env.obs_mode == "rgb" and not type(cfg.policy).images:  # a family that reads the state only
            raise ConfigError("policy.name", cfg.policy.name,
                              f"the {cfg.policy.name} reads only the state vector, env.obs_mode=rgb would render "
                              "images for nothing: use policy.name=pi0|pi05|token_vla (or `python -m "
                              "pipelines.record` for a record conf)")
    elif command == "record":
        check_record(cfg, require_teacher=require_teacher)
    else:
        raise ValueError(f"command {command!r}: use 'run' or 'record'")


# The checks of `pipelines.record` that need no cluster: the teacher run, the output path (this module, so that
# the one check path imports nothing of the command it checks).

def resolve_teacher(arg: str, run_root: str) -> tuple[Path, Path]:
    """(run directory, latest checkpoint) of a teacher run given as a directory or a run id.

    Raises:
        ConfigError (key record.teacher): no such run, no config.yaml, or no checkpoint.
    """
    from storage.checkpoints import latest_checkpoint
    from storage.rundir import find_run_dir
    if arg is None:
        raise ConfigError("record.teacher", arg, "name the teacher run: record.teacher=runs/<experiment>/<run_id> "
                                                  "or its run id (or a scripted expert: scripted:libero)")
    p = Path(arg)
    if not p.is_dir():
        try:
            p = find_run_dir(run_root, arg)
        except (FileNotFoundError, ValueError) as exc:
            raise ConfigError("record.teacher", arg, f"no such run directory or run id under {run_root} ({exc})")
    if not (p / "config.yaml").is_file():
        raise ConfigError("record.teacher", arg, f"{p} has no config.yaml: not a dagrl run directory")
    ckpt = latest_checkpoint(p)
    if ckpt is None:
        raise ConfigError("record.teacher", arg, f"{p} has no complete checkpoint yet")
    return p, ckpt


def teacher_config(run_dir: Path) -> Config:
    """The teacher run's resolved config as a `Config` (validated against today's schema; `load_saved_config`)."""
    return load_saved_config(run_dir / "config.yaml")  # older runs: keys removed since are upgraded


def record_output_path(cfg: Config) -> Path:
    """Where `pipelines.record` writes its store: `record.out`, else `<run_root>/demos/<experiment>.zarr`."""
    return Path(cfg.record.out or Path(cfg.run_root) / "demos" / f"{cfg.experiment}.zarr")


def check_record(cfg: Config, *, require_teacher: bool = True) -> None:
    """Every check of a recording that needs no cluster (`check_command`, command "record").
    `require_teacher=False` (pipelines.validate of a record conf without `record.teacher`): everything but the
    teacher's checks. Raises ConfigError (one line, nothing written)."""
    if cfg.env.obs_mode != "rgb":
        raise ConfigError("env.obs_mode", cfg.env.obs_mode, "record with env.obs_mode=rgb (images for a VLA)")
    if cfg.record.num_episodes < 1:
        raise ConfigError("record.num_episodes", cfg.record.num_episodes, "must be >= 1")
    if cfg.record.action_noise < 0:
        raise ConfigError("record.action_noise", cfg.record.action_noise, "must be >= 0 (a std in action units)")
    if record_output_path(cfg).exists():
        raise ConfigError("record.out", str(record_output_path(cfg)),
                          "exists; choose another path (a store is never overwritten)")
    from storage.rundir import store_owner
    busy = store_owner(record_output_path(cfg))  # another recording to it, or a live run reading it (sft.store)
    if busy is not None:
        raise ConfigError("record.out", str(record_output_path(cfg)), busy)
    if cfg.record.teacher is None and not require_teacher:
        return
    from tasks.envs import check_scripted_teacher, is_scripted_teacher
    if is_scripted_teacher(cfg.record.teacher):  # scripted:NAME, e.g. scripted:libero
        check_scripted_teacher(cfg.record.teacher, cfg.env)
        return
    if cfg.record.action_noise:
        raise ConfigError("record.action_noise", cfg.record.action_noise,
                          "applies to scripted teachers (record.teacher=scripted:NAME); a trained teacher samples "
                          "its own noise with record.deterministic=false")
    run_dir, ckpt = resolve_teacher(cfg.record.teacher, cfg.run_root)
    from storage.checkpoints import checkpoint_damage, played_policy_key
    why = checkpoint_damage(ckpt, keys=(played_policy_key(ckpt),))  # offline, before a cluster starts or the store is created
    if why:
        raise ConfigError("record.teacher", cfg.record.teacher, f"{why}; move the damaged checkpoint aside (the "
                                                                f"teacher is the run's newest complete one) or name "
                                                                f"another teacher run")
    tcfg = teacher_config(run_dir)
    if type(tcfg.policy).images or tcfg.env.obs_mode != "state":  # the recorder feeds the teacher state vectors
        raise ConfigError("record.teacher", cfg.record.teacher,
                          f"is a {tcfg.policy.name} run on {tcfg.env.obs_mode} observations; the recorder runs a "
                          f"state-based mlp teacher (e.g. the default job's run)")
    for key in ("env_id", "control_mode"):
        if getattr(tcfg.env, key) != getattr(cfg.env, key):
            raise ConfigError(f"env.{key}", getattr(cfg.env, key),
                              f"the teacher was trained with env.{key}={getattr(tcfg.env, key)}; use the same")


def command_for(overrides: Sequence[str] = ()) -> str:
    """The command an experiment is for, as `pipelines.validate` infers it: "record" when its experiment file sets
    `record.*` keys (conf=pushcube_record), else "run" (then `record.*` on the command line is refused as by run)."""
    where = given_keys(overrides)
    return "record" if any(k.startswith("record.") and not from_command_line(w) for k, w in where.items()) else "run"
