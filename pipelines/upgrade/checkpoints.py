"""The config.yaml and checkpoint rewrites of `python -m pipelines.upgrade` (the older formats: the package's
docstring)."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch

ADV_TYPE_OF = {"ppo": "gae", "grpo": "grpo", "rloo": "rloo"}  # algorithm.name -> the adv_type it implied
CONFIG_FILE = "config.yaml"


class UpgradeError(ValueError):
    """The run directory cannot be upgraded (one line: what and why)."""


# ---------------------------------------------------------------- config.yaml
def upgrade_config_text(text: str, path: str | os.PathLike = CONFIG_FILE) -> str | None:
    """Today's config.yaml text for an older one, or None when it is current (`pipelines.saved_config.old_config_keys`
    finds nothing): `algorithm.adv_type` dropped when it said what algorithm.name selects, and the keys of a family
    section its family lacks dropped (written when every section held every family's keys: they did nothing there).

    Raises:
        UpgradeError: `algorithm.adv_type` names another estimator than `algorithm.name` selects.
    """
    from omegaconf import OmegaConf

    from pipelines.saved_config import old_config_keys
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


def full_cursor(cursor: dict) -> dict:
    """Today's env shard cursor (tasks.envs.shard: `EnvShard.state_dict`) for one of the older format,
    `{"episode_count": [B ints]}` (a shard's per-env count of episodes started): what a shard that starts fresh
    episodes at those counts writes (no open episode, `started` False, no RNG state, a life of 0 chunk steps), so
    the shard built from it does what the older reader did: fresh episodes at those counts at its next rollout, its
    policy RNG seeded as a fresh shard's (tasks.seeding.shard_policy_seed)."""
    counts = [int(k) for k in cursor["episode_count"]]
    B = len(counts)
    return {"episode_count": counts, "seed": [0] * B, "active": [False] * B, "actions": [[] for _ in range(B)],
            "return": [0.0] * B, "episode_len": [0] * B, "success_once": [False] * B,
            "parts": [{"started": False, "chunk_steps": 0, "rng": None}]}


def old_cursors(run: dict | None) -> list[int]:
    """The shards whose cursor in a checkpoint's `run` meta (`{"runner": RunState fields}`) is of the older format
    (`tasks.envs.shard.is_cursor`: not today's)."""
    from tasks.envs.shard import is_cursor
    cursors = ((run or {}).get("runner") or {}).get("cursors") or []
    return [s for s, c in enumerate(cursors) if c is not None and not is_cursor(c)]


NO_INPUTS = "no input fingerprints"  # what `plan` and the resume's refusal call a runner state without `inputs`


def no_inputs(run: dict | None) -> bool:
    """Whether a checkpoint's `run` meta (`{"runner": RunState fields}`) was written before the runner recorded the
    fingerprints of the data it reads from outside its run dir (`RunState.inputs`, since 2026-12-06): its runner
    state has no `inputs` key. Today's writer saves every RunState field (`asdict`), so a run that reads no outside
    data records {}: the two are told apart by the key."""
    runner = (run or {}).get("runner")
    return isinstance(runner, dict) and "inputs" not in runner


def upgrade_checkpoint_state(state: dict, cfg_loader, where: str, old_format: bool = True,
                             inputs: dict | None = None) -> dict:
    """Today's checkpoint state for one of an older format (module docstring); `cfg_loader()` gives the run's
    Config (only called for an integer-keyed optimizer). `old_format` False: a checkpoint of today's format whose
    env shard cursors or runner `inputs` alone are old (only those are rewritten). `inputs`: what a runner state
    without `inputs` records (`pipelines.upgrade.adopted_inputs`).

    Raises:
        UpgradeError: no RNG state; an optimizer that does not fit the run's; a cursor that is neither today's
            nor the older `{"episode_count"}` one; a runner state without `inputs` and no `inputs` given."""
    state = dict(state)
    run = state.get("run")
    if no_inputs(run):
        if inputs is None:
            raise UpgradeError(f"{where}: {NO_INPUTS}, and none to adopt were given; not upgraded")
        run = {**run, "runner": {**run["runner"], "inputs": dict(inputs)}}
        state["run"] = run
    for s in old_cursors(run):
        cursor = run["runner"]["cursors"][s]
        if set(cursor) != {"episode_count"}:
            raise UpgradeError(f"{where}: the cursor of env shard {s} is of no known format (keys {sorted(cursor)}); "
                               f"not upgraded")
        run = {**run, "runner": {**run["runner"], "cursors": list(run["runner"]["cursors"])}}
        run["runner"]["cursors"][s] = full_cursor(cursor)
        state["run"] = run
    if not old_format:
        return state
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


