"""`python -m pipelines.upgrade RUN_DIR`: rewrite a run directory written in an older format, once, into today's.

Readers accept today's format only: an older checkpoint is refused where it is verified or loaded
(storage.checkpoints.OldFormat), an older run config where it is loaded, each with one line naming the file and
this command. What it rewrites, each only where it is old (the older formats are described here and nowhere else):

  config.yaml           `algorithm.adv_type` dropped: it said what `algorithm.name` selects (ppo: gae, grpo: grpo,
                        rloo: rloo; sft never read it); one that contradicts algorithm.name is refused (the run was
                        not what its config says: nothing is written). The keys of a family section its family
                        lacks (`policy.hidden_sizes` of a flow VLA run: written when every section held every
                        family's keys, they did nothing there) dropped; a run on an existing scheduler (`cluster.address`
                        set, no `cluster.kind`) gets `cluster.kind: address`. The digest `config.yaml.sha256` is
                        (re)written with it.
  checkpoints/global_step_N/   every complete checkpoint whose index.json lacks `"format": FORMAT`:
      - values pickled whole (index kind "pickle", `<key>.pkl.pt`) become weights-only torch files;
      - a torch-only RNG state (`rng_torch`) becomes THE RNG state `rng` = {"torch": ...} (restoring it restores
        the torch stream only, as before); a checkpoint that has both keeps `rng` and drops `rng_torch`;
      - an integer-keyed optimizer state (one process's `optimizer.state_dict()`) becomes FQN-keyed, mapped by
        position onto the run's optimizer (its config's policy and algorithm.lr / critic_lr / lr_scale groups;
        each state's shape checked against the saved policy's parameter);
      - index.json gets `"format": FORMAT`; every other entry of the directory (hf/) is copied.

Atomic, with a backup: everything new is written under RUN_DIR/.upgrade-<stamp>/ and loaded back with today's
readers first; only then is each old item renamed into RUN_DIR/upgrade-backup-<stamp>/ and its new version renamed
into place (renames within one file system). A failure before the swap leaves the run as it was; the backup holds
every replaced file. Running it again finds nothing to do. Exit status 0 (upgraded, or nothing to do), 2 (refused:
one line on stderr).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

import torch

ADV_TYPE_OF = {"ppo": "gae", "grpo": "grpo", "rloo": "rloo"}  # algorithm.name -> the adv_type it implied
CONFIG_FILE = "config.yaml"


class UpgradeError(ValueError):
    """The run directory cannot be upgraded (one line: what and why)."""


# ---------------------------------------------------------------- config.yaml
def upgrade_config_text(text: str, path: str | os.PathLike = CONFIG_FILE) -> str | None:
    """Today's config.yaml text for an older one, or None when it is current (`pipelines.compose.old_config_keys`
    finds nothing): `algorithm.adv_type` dropped when it said what algorithm.name selects, and the keys of a family
    section its family lacks dropped (written when every section held every family's keys: they did nothing there).

    Raises:
        UpgradeError: `algorithm.adv_type` names another estimator than `algorithm.name` selects.
    """
    from omegaconf import OmegaConf

    from pipelines.compose import old_config_keys
    d = OmegaConf.to_container(OmegaConf.create(text))
    cluster = d.get("cluster") or {}
    if "kind" not in cluster and cluster.get("address"):  # a run on an existing scheduler, before cluster.kind
        cluster["kind"] = "address"
    old = old_config_keys(d)
    if not old:
        return None
    algo = d.get("algorithm") or {}
    if "algorithm.adv_type" in old:
        adv, name = algo["adv_type"], algo.get("name", "ppo")
        if name in ADV_TYPE_OF and adv != ADV_TYPE_OF[name]:
            raise UpgradeError(f"{path}: algorithm.adv_type={adv!r} but algorithm.name={name} uses "
                               f"{ADV_TYPE_OF[name]}: the run was not what its config says; not upgraded")
    for key in old:
        section, name = key.split(".", 1)
        d[section].pop(name, None)
    return OmegaConf.to_yaml(OmegaConf.create(d))


# ---------------------------------------------------------------- checkpoints
def _read_old(path: Path) -> tuple[dict, dict]:
    """(index, state) of a checkpoint of any format, its files verified against the index (sha256)."""
    index = json.loads((path / "index.json").read_text())
    for name, info in index["files"].items():
        f = path / name
        if not f.is_file() or hashlib.sha256(f.read_bytes()).hexdigest() != info["sha256"]:
            raise UpgradeError(f"checkpoint {path}: file {name} is missing or damaged (sha256 differs from "
                               f"index.json); not upgraded")
    meta = json.loads((path / "meta.json").read_text()) if "meta.json" in index["files"] else {}
    state = {}
    for key, entry in index["keys"].items():
        if entry["kind"] == "json":
            state[key] = meta[key]
        else:  # "pickle": our own files of the older format, verified above
            state[key] = torch.load(path / entry["file"], map_location="cpu",
                                    weights_only=entry["kind"] != "pickle")
    return index, state


def _plain_rng(rng: dict) -> dict:
    """An RNG state with numpy's / python's tuples of the pickled format as the lists and dicts of today's."""
    import numpy as np
    out = dict(rng)
    n = out.get("numpy")
    if isinstance(n, tuple):  # np.random.get_state(): ("MT19937", key[624], pos, has_gauss, gauss)
        out["numpy"] = {"bit_generator": str(n[0]), "key": np.asarray(n[1]).tolist(), "pos": int(n[2]),
                        "has_gauss": int(n[3]), "gauss": float(n[4])}
    p = out.get("python")
    if isinstance(p, tuple):  # random.getstate(): (version, (625 ints), gauss)
        out["python"] = [int(p[0]), [int(x) for x in p[1]], p[2]]
    if isinstance(out.get("torch"), torch.Tensor):
        out["torch"] = out["torch"].clone()
    return out


def _optimizer_names(cfg, policy_state: dict) -> list[list[str]]:
    """The parameter names of each param group of the run's optimizer (tasks.actor.optim.make_optimizer on its
    policy, built without weights on the meta device: names and order do not depend on the env's dims)."""
    from tasks.actor.optim import make_optimizer
    from tasks.policies import make_policy
    from tasks.rollout import image_size, num_values
    with torch.device("meta"):
        policy = make_policy(cfg.policy, obs_dim=1, action_dim=1, num_values=num_values(cfg),
                             image_size=image_size(cfg), load=False)
    opt = make_optimizer(cfg, policy)
    names = {p: n for n, p in policy.named_parameters()}
    groups = [[names[p] for p in g["params"]] for g in opt.param_groups]
    unknown = sorted({n for g in groups for n in g} - set(policy_state))
    if unknown:
        raise UpgradeError(f"the run's policy has parameters its checkpoint lacks ({unknown[:4]}): not this run's "
                           f"checkpoint; not upgraded")
    return groups


def fqn_optimizer(state: dict, groups: list[list[str]], policy_state: dict, where: str) -> dict:
    """An integer-keyed optimizer state (`optimizer.state_dict()` of one process) keyed by parameter name: id i of
    group j is the i-th name of the run's optimizer's group j (the position rule torch's own state_dict uses).

    Raises:
        UpgradeError: group sizes differ from the run's optimizer, or a state's shape differs from its parameter's.
    """
    saved = state["param_groups"]
    if [len(g["params"]) for g in saved] != [len(g) for g in groups]:
        raise UpgradeError(f"{where}: optimizer param_groups of sizes {[len(g['params']) for g in saved]}, the run's "
                           f"optimizer has {[len(g) for g in groups]}; not upgraded")
    pos = {i: n for g, names in zip(saved, groups) for i, n in zip(g["params"], names)}
    out = {pos[i]: v for i, v in state["state"].items()}
    for n, v in out.items():
        avg = v.get("exp_avg") if isinstance(v, dict) else None
        if isinstance(avg, torch.Tensor) and tuple(avg.shape) != tuple(policy_state[n].shape):
            raise UpgradeError(f"{where}: optimizer state of {n} has shape {tuple(avg.shape)}, the parameter "
                               f"{tuple(policy_state[n].shape)}; not upgraded")
    return {"state": out, "param_groups": [{**g, "params": names} for g, names in zip(saved, groups)]}


def upgrade_checkpoint_state(state: dict, cfg_loader, where: str) -> dict:
    """Today's checkpoint state for one of an older format (module docstring); `cfg_loader()` gives the run's
    Config (only called for an integer-keyed optimizer)."""
    state = dict(state)
    rng_torch = state.pop("rng_torch", None)
    if state.get("rng") is None:
        if rng_torch is None:
            raise UpgradeError(f"{where}: no RNG state (rng or rng_torch); not upgraded")
        state["rng"] = {"torch": rng_torch}
    state["rng"] = _plain_rng(state["rng"])
    opt = state.get("optimizer")
    if opt is not None:
        ids = [i for g in opt.get("param_groups", []) for i in g["params"]]
        if not all(isinstance(i, str) for i in ids) or not all(isinstance(k, str) for k in opt.get("state", {})):
            state["optimizer"] = fqn_optimizer(opt, _optimizer_names(cfg_loader(), state["policy"]),
                                               state["policy"], where)
    return state


# ---------------------------------------------------------------- the command
def plan(run_dir: Path) -> dict:
    """What is old in `run_dir`: {"config": today's config.yaml text or None (current), "config_digest": True when
    config.yaml has no digest beside it, "checkpoints": [paths of the complete older-format checkpoints]}.

    Raises:
        UpgradeError: not a run directory, or its config cannot be upgraded.
    """
    from storage.checkpoints import FORMAT, list_checkpoints
    cfg_path = run_dir / CONFIG_FILE
    if not cfg_path.is_file():
        raise UpgradeError(f"{run_dir} has no {CONFIG_FILE}: not a dagrl run directory")
    text = upgrade_config_text(cfg_path.read_text(), cfg_path)
    old = [p for p in list_checkpoints(run_dir)
           if json.loads((p / "index.json").read_text()).get("format") != FORMAT]
    return {"config": text, "config_digest": not cfg_path.with_name(CONFIG_FILE + ".sha256").is_file(),
            "checkpoints": old}


def upgrade(run_dir: str | os.PathLike, echo=print) -> Path | None:
    """Rewrite `run_dir` into today's format (module docstring). Returns the backup directory, or None when there
    was nothing to do.

    Raises:
        UpgradeError: what cannot be upgraded (nothing in `run_dir` changed).
        storage.locks.LockBusy: a live driver owns the run (nothing changed).
    """
    run_dir = Path(run_dir).resolve()
    todo = plan(run_dir)
    if todo["config"] is None and not todo["config_digest"] and not todo["checkpoints"]:
        echo(f"dagrl upgrade: {run_dir} is in today's format: nothing to do")
        return None
    from storage.rundir import lock_run_dir
    with lock_run_dir(run_dir, command="python -m pipelines.upgrade"):  # one writer: never beside a live driver
        return _rewrite(run_dir, todo, echo)


def _rewrite(run_dir: Path, todo: dict, echo) -> Path:
    """`upgrade`'s rewrite of `run_dir` as `plan` found it (the caller holds the run's owner lock)."""
    from storage.checkpoints import load_checkpoint, save_checkpoint
    from storage.rundir import write_resolved_config
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%S")
    stage, backup = run_dir / f".upgrade-{stamp}", run_dir / f"upgrade-backup-{stamp}"
    stage.mkdir()
    try:
        text = todo["config"] if todo["config"] is not None else (run_dir / CONFIG_FILE).read_text()
        write_resolved_config(stage, text)  # config.yaml + its digest
        cfg_cache: list = []

        def cfg_loader():
            if not cfg_cache:
                from pipelines.compose import load_saved_config
                cfg_cache.append(load_saved_config(stage / CONFIG_FILE, validate=False))
            return cfg_cache[0]

        for path in todo["checkpoints"]:
            _, state = _read_old(path)
            new = upgrade_checkpoint_state(state, cfg_loader, str(path))
            out = save_checkpoint(stage, int(path.name.rsplit("_", 1)[1]), new)
            index = json.loads((path / "index.json").read_text())
            listed = set(index["files"]) | {"index.json"}
            for entry in path.iterdir():  # what the index does not hold (hf/): copied
                if entry.name not in listed:
                    (shutil.copytree if entry.is_dir() else shutil.copy2)(entry, out / entry.name)
            load_checkpoint(out)  # today's reader takes it
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    # the swap: old items into the backup, new ones into place (renames)
    backup.mkdir()
    (backup / "checkpoints").mkdir()
    moves = [(run_dir / CONFIG_FILE, stage / CONFIG_FILE, backup / CONFIG_FILE),
             (run_dir / (CONFIG_FILE + ".sha256"), stage / (CONFIG_FILE + ".sha256"),
              backup / (CONFIG_FILE + ".sha256"))]
    moves += [(p, stage / "checkpoints" / p.name, backup / "checkpoints" / p.name) for p in todo["checkpoints"]]
    for live, new, old in moves:
        if live.exists():
            os.rename(live, old)
        os.rename(new, live)
    shutil.rmtree(stage, ignore_errors=True)
    (backup / "UPGRADE.json").write_text(json.dumps(
        {"run_dir": str(run_dir), "at": stamp, "config": todo["config"] is not None,
         "checkpoints": [p.name for p in todo["checkpoints"]]}, indent=1))
    echo(f"dagrl upgrade: {run_dir} rewritten in today's format ({len(todo['checkpoints'])} checkpoint(s)"
         f"{', config.yaml' if todo['config'] is not None else ''}); the replaced files are in {backup}")
    return backup


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pipelines.upgrade", description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", help="a run directory (<run_root>/<experiment>/<run_id>)")
    args = ap.parse_args(argv)
    from storage.locks import LockBusy
    try:
        upgrade(args.run_dir)
    except (UpgradeError, LockBusy, OSError) as exc:
        print(f"dagrl upgrade: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
