"""`python -m pipelines.upgrade RUN_DIR` (or a RUN_ID under `run_root=DIR`, or `STORE`): rewrite a run directory (or a recorded trajectory store)
written in an older format, once, into today's.

Readers accept today's format only: an older checkpoint is refused where it is verified or loaded
(storage.checkpoints.OldFormat), an older run config where it is loaded (one without its digest where it is read:
storage.rundir.OldRunFile), env shard cursors of the older format and a runner state without input fingerprints
on resume, an eval record without its layout where it is read (tasks.evalstats.OldEvalRecord), a trajectory
store of an older format where it is opened (storage.trajectories.OldStore) or read
(`pipelines.upgrade.store.store_refusal`: replay, sft.store, resume), each with one line naming the file and this
command. What it rewrites, each only where it is old (the older formats are described here and nowhere else):

  config.yaml           `algorithm.adv_type` dropped: it said what `algorithm.name` selects (ppo: gae, grpo: grpo,
                        rloo: rloo; sft never read it); one that contradicts algorithm.name is refused (the run was
                        not what its config says: nothing is written). The keys of a family section its family
                        lacks (`policy.hidden_sizes` of a flow VLA run: written when every section held every
                        family's keys, they did nothing there) dropped; a run on an existing scheduler (`cluster.address`
                        set, no `cluster.kind`) gets `cluster.kind: address`. The digest `config.yaml.sha256` is
                        (re)written with it; a config.yaml without one (saved before the digest existed, refused
                        where it is read: storage.rundir.OldRunFile) gets it.
  checkpoints/global_step_N/   every complete checkpoint whose index.json lacks `"format": FORMAT`:
      - values pickled whole (index kind "pickle", `<key>.pkl.pt`) become weights-only torch files;
      - a torch-only RNG state (`rng_torch`) becomes THE RNG state `rng` = {"torch": ...} (restoring it restores
        the torch stream only, as before); a checkpoint that has both keeps `rng` and drops `rng_torch`;
      - an integer-keyed optimizer state (one process's `optimizer.state_dict()`) becomes FQN-keyed, mapped by
        position onto the run's optimizer (its config's policy and algorithm.lr / critic_lr / lr_scale groups;
        each state's shape checked against the saved policy's parameter);
      - index.json gets `"format": FORMAT`; every other entry of the directory (hf/) is copied.
      and every checkpoint (of any format) whose runner state holds an env shard cursor of the older format,
      `{"episode_count": [...]}`: it becomes today's cursor of a shard that starts fresh episodes at those counts
      (`checkpoints.full_cursor`: what the older reader did with it); and every one whose runner state has no
      `inputs` (written before the run recorded the fingerprints of its sft.store / policy.model_path, 2026-12-06):
      it records today's (`adopted_inputs`: what the older reader adopted on resume), named in its line.
  trajectories.zarr     (or the STORE given) of an older format: schema version 1, no attempt arrays, no
                        store_id, no simulator / gripper_convention attributes, no attribute its env family records
                        (ManiSkill image stores: robot_visual_lod), no task_id / trial_id fields:
                        written anew in today's format (`pipelines.upgrade.store`, `storage.store_upgrade`: what each
                        becomes) and compared chunk by chunk with the old one before the swap.
  evals/step_N.json     (and evals/val/) without `eval_layout`: the layout of the run's config added
                        (`pipelines.upgrade.evals`), as the runner writes it into every record today.

Atomic, with a backup: everything new is written under RUN_DIR/.upgrade-<stamp>/ and loaded back with today's
readers first; only then is each old item renamed into RUN_DIR/upgrade-backup-<stamp>/ and its new version renamed
into place (renames within one file system). A failure before the swap leaves the run as it was; the backup holds
every replaced file. For a STORE, the staging and backup directories lie beside it (`<store>.upgrade-<stamp>`,
`<store>.upgrade-backup-<stamp>`). It takes the run's (or the store's) owner lock: never beside a live driver or
recording. One line per rewritten file; running it again finds nothing to do. Exit status 0 (upgraded, or nothing to do), 2 (refused:
one line on stderr).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import shutil
import sys
from pathlib import Path

import yaml

from pipelines.upgrade.checkpoints import (ADV_TYPE_OF, CONFIG_FILE, NO_INPUTS, UpgradeError,  # noqa: F401
                                           _optimizer_names, _read_old, fqn_optimizer, full_cursor,
                                           no_inputs, old_cursors, upgrade_checkpoint_state, upgrade_config_text)
from pipelines.upgrade.evals import plan_evals, stage_evals
from pipelines.upgrade.store import STORE_DIR, plan_store, store_refusal


def plan(target: Path) -> dict:
    """What is old at `target` (a run directory, or a trajectory store outside one): {"config": today's
    config.yaml text or None (current or no config: a store), "config_digest": True when config.yaml has no digest
    beside it, "checkpoints": {path: [what is old]} of the complete checkpoints of an older format or holding older
    cursors, "store": [what is old] of the trajectory store, "store_path": the store's path, "evals": [eval record
    files without eval_layout]}.

    Raises:
        UpgradeError: neither a run directory nor a store, or its config cannot be upgraded.
    """
    from storage.checkpoints import FORMAT, list_checkpoints
    cfg_path = target / CONFIG_FILE
    if not cfg_path.is_file():
        if (target / "zarr.json").is_file():  # a recording (record.out): the store alone
            return {"config": None, "config_digest": False, "checkpoints": {}, "store": plan_store(target),
                    "store_path": target, "evals": []}
        raise UpgradeError(f"{target} has no {CONFIG_FILE}: not a dagrl run directory (nor a trajectory store)")
    text = upgrade_config_text(cfg_path.read_text(), cfg_path)
    old = {}
    for p in list_checkpoints(run_dir=target):
        index = json.loads((p / "index.json").read_text())
        what = [f"format {index.get('format', 1)}"] if index.get("format") != FORMAT else []
        meta = json.loads((p / "meta.json").read_text()) if "meta.json" in index.get("files", {}) else {}
        shards = old_cursors(meta.get("run"))
        what += [f"older cursors of shards {shards}"] if shards else []
        what += [NO_INPUTS] if no_inputs(meta.get("run")) else []
        if what:
            old[p] = what
    return {"config": text, "config_digest": not cfg_path.with_name(CONFIG_FILE + ".sha256").is_file(),
            "checkpoints": old, "store": plan_store(target / STORE_DIR), "store_path": target / STORE_DIR,
            "evals": plan_evals(target)}


def adopted_inputs(cfg, run_dir: str | os.PathLike) -> dict[str, str]:
    """What an upgraded checkpoint without `inputs` records: today's fingerprints of the run's outside inputs
    (`pipelines.runner.setup.input_fingerprints` of the run's Config `cfg`), what the older reader adopted on resume.
    `run_dir`: named in the errors.

    Raises:
        UpgradeError: an input the config names (`input_paths`) is missing, a store of an older format (its
            fingerprint changes when it is upgraded: upgrade it first), or one that cannot be fingerprinted."""
    from pipelines.runner.setup import input_fingerprints, input_paths
    why = f"{run_dir}: its checkpoints record no input fingerprints and today's cannot be taken"
    paths = input_paths(cfg)
    missing = [f"{k}={p}" for k, p in paths.items() if not Path(p).is_dir()]
    if missing:
        raise UpgradeError(f"{why}: the run reads {', '.join(missing)}, which is missing; put it back and upgrade "
                           f"again; not upgraded")
    old = store_refusal(paths["sft.store"]) if "sft.store" in paths else None
    if old is not None:
        raise UpgradeError(f"{why} before its sft.store is upgraded: {old}; then upgrade this run; not upgraded")
    try:
        return input_fingerprints(cfg)
    except ValueError as exc:
        raise UpgradeError(f"{why}: {' '.join(str(exc).split())}; not upgraded") from None


def upgrade(target: str | os.PathLike, echo=print) -> Path | None:
    """Rewrite `target` (a run directory, or a trajectory store) into today's format (module docstring). Returns
    the backup directory, or None when there was nothing to do.

    Raises:
        UpgradeError: what cannot be upgraded (nothing in `target` changed).
        storage.locks.LockBusy: a live driver owns the run, or a recording or a run holds the store (nothing changed).
    """
    target = Path(target).resolve()
    todo = plan(target)
    if (todo["config"] is None and not todo["config_digest"] and not todo["checkpoints"] and not todo["store"]
            and not todo["evals"]):
        echo(f"dagrl upgrade: {target} is in today's format: nothing to do")
        return None
    from storage.rundir import lock_run_dir, lock_store
    command = "python -m pipelines.upgrade"
    if todo["store_path"] == target:  # one writer: never beside a live recording or a run reading it
        with lock_store(target, command=command):
            return _rewrite(target, todo, echo, stage=target.with_name(f"{target.name}.upgrade-{_stamp()}"))
    with lock_run_dir(target, command=command):  # one writer: never beside a live driver
        return _rewrite(target, todo, echo, stage=target / f".upgrade-{_stamp()}")


def _stamp() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%S")


def _stage_checkpoints(run_dir: Path, stage: Path, todo: dict) -> None:
    """Today's config.yaml (+ digest), checkpoints and eval records of `run_dir` written under `stage`, each loaded
    back."""
    from storage.checkpoints import load_checkpoint, save_checkpoint
    from storage.rundir import write_resolved_config
    text = todo["config"] if todo["config"] is not None else (run_dir / CONFIG_FILE).read_text()
    write_resolved_config(stage, text)  # config.yaml + its digest
    cfg_cache: list = []

    def cfg_loader():
        if not cfg_cache:
            from pipelines.saved_config import load_saved_config
            cfg_cache.append(load_saved_config(stage / CONFIG_FILE, validate=False))
        return cfg_cache[0]

    from storage.checkpoints import FORMAT
    inputs = None
    if any(NO_INPUTS in what for what in todo["checkpoints"].values()):
        inputs = adopted_inputs(cfg_loader(), run_dir)
        adopted = ", ".join(f"{k}: {v}" for k, v in inputs.items()) or "none: the run reads no outside data"
        for what in todo["checkpoints"].values():  # each rewritten checkpoint's line says what it now records
            if NO_INPUTS in what:
                what[what.index(NO_INPUTS)] = f"{NO_INPUTS}; today's adopted ({adopted})"
    for path in todo["checkpoints"]:
        index, state = _read_old(path)
        new = upgrade_checkpoint_state(state, cfg_loader, str(path), old_format=index.get("format") != FORMAT,
                                       inputs=inputs)
        out = save_checkpoint(stage, int(path.name.rsplit("_", 1)[1]), new)
        listed = set(index["files"]) | {"index.json"}
        for entry in path.iterdir():  # what the index does not hold (hf/): copied
            if entry.name not in listed:
                (shutil.copytree if entry.is_dir() else shutil.copy2)(entry, out / entry.name)
        load_checkpoint(out)  # today's reader takes it
    if todo["evals"]:
        stage_evals(run_dir, stage, todo["evals"], cfg_loader())


def _rewrite(target: Path, todo: dict, echo, stage: Path) -> Path:
    """`upgrade`'s rewrite of `target` as `plan` found it into `stage`, then the swap (the caller holds the lock)."""
    from pipelines.upgrade.store import rewrite as rewrite_store
    is_store = todo["store_path"] == target
    backup = (target.with_name(f"{target.name}.upgrade-backup-{stage.name.rsplit('-', 1)[1]}") if is_store
              else target / f"upgrade-backup-{stage.name.rsplit('-', 1)[1]}")
    stage.mkdir()
    moves: list[tuple[Path, Path, Path, str]] = []  # (live, new, backup, what was old)
    try:
        if not is_store:
            _stage_checkpoints(target, stage, todo)
            if todo["config"] is not None or todo["config_digest"]:
                moves.append((target / CONFIG_FILE, stage / CONFIG_FILE, backup / CONFIG_FILE,
                              "older keys dropped" if todo["config"] is not None else "its digest written"))
                moves.append((target / (CONFIG_FILE + ".sha256"), stage / (CONFIG_FILE + ".sha256"),
                              backup / (CONFIG_FILE + ".sha256"), ""))
            moves += [(p, stage / "checkpoints" / p.name, backup / "checkpoints" / p.name, ", ".join(w))
                      for p, w in todo["checkpoints"].items()]
            moves += [(f, stage / f.relative_to(target), backup / f.relative_to(target), "no eval_layout")
                      for f in todo["evals"]]
        if todo["store"]:
            run_env = None if is_store else (yaml.safe_load((stage / CONFIG_FILE).read_text()) or {}).get("env")
            new = rewrite_store(todo["store_path"], stage, run_env)
            moves.append((todo["store_path"], new, backup / todo["store_path"].name if not is_store else backup,
                          ", ".join(todo["store"])))
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    # the swap: old items into the backup, new ones into place (renames)
    (backup if not is_store else backup.parent).mkdir(parents=True, exist_ok=True)
    if not is_store:
        (backup / "checkpoints").mkdir()
    for live, new, old, what in moves:
        old.parent.mkdir(parents=True, exist_ok=True)
        if live.exists():
            os.rename(live, old)
        os.rename(new, live)
        if what:
            echo(f"dagrl upgrade: {live} rewritten in today's format ({what}); the old one is in {old}")
    shutil.rmtree(stage, ignore_errors=True)
    record = backup / "UPGRADE.json" if not is_store else backup.with_name(backup.name + ".json")
    record.write_text(json.dumps(
        {"target": str(target), "at": stage.name.rsplit("-", 1)[1], "config": todo["config"] is not None,
         "checkpoints": {p.name: w for p, w in todo["checkpoints"].items()}, "store": todo["store"],
         "evals": [str(f.relative_to(target)) for f in todo["evals"]]}, indent=1))
    return backup


def resolve_target(arg: str, run_root: str | os.PathLike = "runs") -> Path:
    """The directory `arg` names: an existing path as given, else a run id looked up as `<run_root>/*/<arg>`
    (storage.rundir.find_run_dir, as pipelines.eval, replay and record take run ids).

    Raises:
        UpgradeError: neither a path nor a run id under `run_root` (with close matches, or the experiments that
            share the id)."""
    from storage.rundir import find_run_dir
    if Path(arg).exists() or "/" in arg or os.sep in arg:
        return Path(arg)
    try:
        return find_run_dir(run_root, arg)
    except (FileNotFoundError, ValueError) as exc:
        raise UpgradeError(f"{arg} is no path; {exc}") from None


def main(argv: list[str] | None = None) -> int:
    from pipelines.cli import ArgumentParser, parse_words, version
    ap = ArgumentParser(prog="python -m pipelines.upgrade", description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", help="a run directory (<run_root>/<experiment>/<run_id>), its run id (looked up under "
                                    "run_root=DIR, default runs), or a recorded trajectory store (record.out)")
    ap.add_argument("--run-root", default="runs", help=argparse.SUPPRESS)  # run_root=DIR (pipelines.cli.as_flags)
    ap.add_argument("--version", action="version", version=version())
    args = parse_words(ap, argv, ("run_root",))  # run_root=DIR, the spelling of every command (--run-root DIR too)
    if isinstance(args, int):
        return args
    from storage.locks import LockBusy
    try:
        upgrade(resolve_target(args.run_dir, args.run_root))
    except (UpgradeError, LockBusy, OSError) as exc:
        print(f"dagrl upgrade: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    return 0
