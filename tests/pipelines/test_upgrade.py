"""`python -m pipelines.upgrade RUN_DIR`: a run directory written in an older format is refused by today's readers
(one line naming the file and the command) and rewritten once by the command into one that resumes.

The older format is written here by hand, from what the deleted readers accepted: a checkpoint index without
`format`, a value pickled whole (kind "pickle", `<key>.pkl.pt`), the torch-only RNG state `rng_torch`, the
optimizer as one process's `optimizer.state_dict()` (integer ids, in parameter order per param group), and a
config.yaml with `algorithm.adv_type` (what algorithm.name implied)."""
from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from pipelines.upgrade import main as upgrade_main
from storage.checkpoints import OldFormat, latest_checkpoint, list_checkpoints, load_checkpoint
from tasks import resident

T, B, C, D, O = 4, 2, 1, 2, 3
RUN = "upgrade-test"


def _int_keyed(opt_state: dict) -> dict:
    """THE (FQN-keyed) optimizer state as the older format held it: ids are positions over the param groups'
    parameters in order (what torch's `Optimizer.state_dict()` writes)."""
    flat = [n for g in opt_state["param_groups"] for n in g["params"]]
    pos = {n: i for i, n in enumerate(flat)}
    return {"state": {pos[n]: v for n, v in opt_state["state"].items()},
            "param_groups": [{**g, "params": [pos[n] for n in g["params"]]} for g in opt_state["param_groups"]]}


def _write_old_checkpoint(path: Path, state: dict) -> None:
    """Rewrite the checkpoint directory `path` (today's `state`, loaded) in the older format, by hand."""
    for f in path.iterdir():
        if f.is_file():
            f.unlink()
    old = {k: v for k, v in state.items() if k not in ("rng", "run")}
    old["optimizer"] = _int_keyed(state["optimizer"])
    keys, files = {}, {}
    for key, value in old.items():
        keys[key] = {"file": f"{key}.pt", "kind": "torch"}
        torch.save(value, path / f"{key}.pt")
    torch.save(state["rng"]["torch"], path / "rng_torch.pkl.pt")  # pickled whole, as before check_loadable
    keys["rng_torch"] = {"file": "rng_torch.pkl.pt", "kind": "pickle"}
    (path / "meta.json").write_text(json.dumps({"run": state["run"]}, indent=1, sort_keys=True))
    keys["run"] = {"file": "meta.json", "kind": "json"}
    for f in sorted(path.iterdir()):
        if f.is_file():
            files[f.name] = {"size": f.stat().st_size, "sha256": hashlib.sha256(f.read_bytes()).hexdigest()}
    (path / "index.json").write_text(json.dumps({"step": int(path.name.rsplit("_", 1)[1]),
                                                 "created_at": "2026-12-01T00:00:00+00:00", "keys": keys,
                                                 "files": files}, indent=1, sort_keys=True))


def _write_old_config(run_dir: Path, adv_type: str) -> None:
    """config.yaml with `algorithm.adv_type` (and its digest, as the run wrote it)."""
    from storage.rundir import write_resolved_config
    d = yaml.safe_load((run_dir / "config.yaml").read_text())
    d["algorithm"]["adv_type"] = adv_type
    write_resolved_config(run_dir, yaml.safe_dump(d, sort_keys=False))


def make_old_format(run_dir: Path, adv_type: str = "gae") -> None:
    """Turn a run directory of today's format into the older one (module docstring)."""
    for ckpt in list_checkpoints(run_dir):
        _write_old_checkpoint(ckpt, load_checkpoint(ckpt))
    _write_old_config(run_dir, adv_type)


# ----- one process: a run directory with one checkpoint of the MLP actor -----------------------------------------
def _cfg():
    from tasks.config import Config
    cfg = Config()
    cfg.rollout.chunk_steps, cfg.env.num_envs, cfg.env.num_shards = T, B, 1
    cfg.policy.hidden_sizes, cfg.policy.num_action_chunks = [8, 8], C
    cfg.algorithm.update_epochs, cfg.algorithm.num_minibatches, cfg.algorithm.target_kl = 2, 2, None
    cfg.algorithm.critic_warmup_steps = 0
    cfg.algorithm.lr_scale = {"critic": 2.0}  # two param groups: the position rule must follow them
    return cfg


def _traj(seed: int) -> dict:
    r = np.random.default_rng(seed)
    f = np.float32
    return {"obs": r.standard_normal((T, B, O)).astype(f), "actions": r.standard_normal((T, B, C, D)).astype(f),
            "logprobs": (r.standard_normal((T, B, C, D)) * 0.1 - 1.0).astype(f),
            "values": r.standard_normal((T, B, 1)).astype(f), "final_values": np.zeros((T, B, 1), f),
            "rewards": r.standard_normal((T, B, C)).astype(f), "terminated": np.zeros((T, B), bool),
            "truncated": np.zeros((T, B), bool), "step_mask": np.ones((T, B, C), bool),
            "bootstrap_values": r.standard_normal((B, 1)).astype(f)}


@pytest.fixture
def old_run(tmp_path):
    """(run dir in the older format, cfg, the weights after 2 updates, the weights of a 3rd update from there)."""
    from pipelines.config import to_yaml
    from storage.checkpoints import save_checkpoint
    from storage.rundir import write_resolved_config
    from tasks.actor.entries import actor_init, actor_state, actor_update, advantages
    cfg = _cfg()
    run_dir = tmp_path / "smoke" / "run-1"
    write_resolved_config(run_dir, to_yaml(cfg))
    w = actor_init(cfg, RUN, (O, D))
    for v in range(2):
        w = actor_update(cfg, RUN, w, advantages(cfg, _traj(v)))
    state = actor_state(RUN)
    save_checkpoint(run_dir, 2, {**{k: v for k, v in state.items() if k != "weight_version"},
                                 "run": {"weight_version": state["weight_version"], "runner": {"step": 2}}})
    w3 = actor_update(cfg, RUN, w, advantages(cfg, _traj(2)))  # the uninterrupted third update
    resident.release(f"{RUN}/")
    make_old_format(run_dir)
    yield run_dir, cfg, w, w3
    resident.release(f"{RUN}/")


def test_an_old_run_is_refused_in_one_line_naming_the_file_and_the_command(old_run):
    run_dir = old_run[0]
    ckpt = latest_checkpoint(run_dir)
    with pytest.raises(OldFormat) as exc:
        load_checkpoint(ckpt, keys=("run",))
    msg = str(exc.value)
    assert "\n" not in msg and str(ckpt / "index.json") in msg
    assert f"`python -m pipelines.upgrade {run_dir}`" in msg


def test_upgrade_rewrites_the_run_once_into_one_that_resumes_exactly(old_run, capsys):
    from storage.rundir import read_resolved_config
    from tasks.actor.entries import actor_init, actor_update, advantages
    from tasks.actor.state import STATE_KEYS
    run_dir, cfg, w2, w3 = old_run
    before = {p.relative_to(run_dir): p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    assert upgrade_main([str(run_dir)]) == 0
    ckpt = load_checkpoint(latest_checkpoint(run_dir))  # today's reader takes it
    assert set(ckpt) == {*STATE_KEYS, "run"} - {"weight_version"}
    assert set(ckpt["rng"]) == {"torch"}  # the torch-only RNG state, as it was
    assert all(isinstance(k, str) for k in ckpt["optimizer"]["state"])
    text = read_resolved_config(run_dir / "config.yaml")  # its digest matches
    assert "adv_type" not in yaml.safe_load(text)["algorithm"]
    # the backup holds every replaced file, byte for byte
    backup = next(run_dir.glob("upgrade-backup-*"))
    for rel, data in before.items():
        assert (backup / rel).read_bytes() == data, rel
    assert not list(run_dir.glob(".upgrade-*"))  # no staging left
    # it resumes: the actor restored from the upgraded checkpoint takes the uninterrupted run's third step
    w = actor_init(cfg, RUN, (O, D), checkpoint=ckpt)
    assert w["version"] == 2
    for k in w2["state_dict"]:
        assert torch.equal(w["state_dict"][k], w2["state_dict"][k]), k
    resumed = actor_update(cfg, RUN, w, advantages(cfg, _traj(2)))
    for k in w3["state_dict"]:
        assert torch.equal(resumed["state_dict"][k], w3["state_dict"][k]), k
    # once: a second run finds nothing to do and changes nothing
    capsys.readouterr()
    now = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    assert upgrade_main([str(run_dir)]) == 0
    assert "nothing to do" in capsys.readouterr().out
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == now


def test_a_contradicting_adv_type_is_refused_and_nothing_changes(old_run, capsys):
    run_dir = old_run[0]
    _write_old_config(run_dir, "grpo")  # algorithm.name=ppo implied gae
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    assert upgrade_main([str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert "algorithm.adv_type='grpo' but algorithm.name=ppo uses gae" in err and err.count("\n") == 1
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == before


def test_a_config_holding_another_familys_keys_is_refused_then_upgraded(tmp_path):
    """A run config written when every policy section held every family's keys: an MLP run's `policy.preset` (a
    VLA key that did nothing there) is refused by the one loader of saved configs, and dropped by the upgrade."""
    from pipelines.config import load_saved_config, to_yaml
    from storage.rundir import write_resolved_config
    from tasks.config import Config, ConfigError
    d = yaml.safe_load(to_yaml(Config()))
    assert d["policy"]["name"] == "mlp" and "preset" not in d["policy"]
    d["policy"]["preset"] = "tiny"
    write_resolved_config(tmp_path, yaml.safe_dump(d, sort_keys=False))
    with pytest.raises(ConfigError, match=r"policy.preset.*older format.*python -m pipelines.upgrade"):
        load_saved_config(tmp_path / "config.yaml", validate=False)
    assert upgrade_main([str(tmp_path)]) == 0
    cfg = load_saved_config(tmp_path / "config.yaml", validate=False)
    assert cfg.policy.name == "mlp" and not hasattr(cfg.policy, "preset")


def test_an_optimizer_of_another_layout_is_refused(old_run, capsys):
    """The position rule needs the run's own param groups: a checkpoint whose groups differ is not guessed at."""
    run_dir = old_run[0]
    ckpt = latest_checkpoint(run_dir)
    opt = torch.load(ckpt / "optimizer.pt", weights_only=True)
    bad = copy.deepcopy(opt)
    bad["param_groups"] = [{**bad["param_groups"][0],
                            "params": [i for g in bad["param_groups"] for i in g["params"]]}]
    torch.save(bad, ckpt / "optimizer.pt")
    index = json.loads((ckpt / "index.json").read_text())
    f = ckpt / "optimizer.pt"
    index["files"]["optimizer.pt"] = {"size": f.stat().st_size, "sha256": hashlib.sha256(f.read_bytes()).hexdigest()}
    (ckpt / "index.json").write_text(json.dumps(index))
    assert upgrade_main([str(run_dir)]) == 2
    assert "optimizer param_groups of sizes" in capsys.readouterr().err
    assert not list(run_dir.glob("upgrade-backup-*")) and not list(run_dir.glob(".upgrade-*"))


# ----- a real run: refused on resume until upgraded, then the resume equals the uninterrupted run ----------------
@pytest.mark.cluster
def test_an_upgraded_old_run_resumes_step_for_step(tmp_path):
    """conf=smoke made tiny (tests/pipelines/test_resume.py): run P is stopped after 1 step, rewritten in the older
    format, refused, upgraded, and resumed to 2 steps; its metrics and final state equal the uninterrupted run's."""
    from tests.pipelines.test_resume import TINY, resume_matches_uninterrupted

    def downgrade_then_upgrade(handle):
        (run_dir,) = {p.parent for p in (tmp_path / "p").rglob("config.yaml") if (p.parent / "checkpoints").is_dir()}
        make_old_format(run_dir)
        with pytest.raises(OldFormat, match="python -m pipelines.upgrade"):
            load_checkpoint(latest_checkpoint(run_dir), keys=("run",))
        assert upgrade_main([str(run_dir)]) == 0

    mu = resume_matches_uninterrupted(tmp_path, ["conf=smoke", "policy.hidden_sizes=[32,32]", *TINY], k=1, n=2,
                                      before_resume=downgrade_then_upgrade)
    assert sorted(mu["train/weight_version"]) == [1, 2]


def test_upgrade_beside_a_live_driver_is_refused_and_changes_nothing(old_run, capsys):
    """The upgrade is one more writer of the run: it takes the run's owner lock, so a live driver's run (here a
    process holding that lock) is refused in one line naming the holder, with every file left as it was."""
    from pipelines.upgrade import main
    from tests.storage.test_locks import _holder, _listing, _stop
    run_dir = old_run[0]
    holder = _holder("run", run_dir)
    try:
        before = _listing(run_dir)
        assert main([str(run_dir)]) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and f"pid {holder.pid}" in err
        assert _listing(run_dir) == before
    finally:
        _stop(holder)
