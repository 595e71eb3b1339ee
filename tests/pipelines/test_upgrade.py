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
    from tasks.config import Config, replace_keys
    return replace_keys(Config(), {
        "rollout.chunk_steps": T, "env.num_envs": B, "env.num_shards": 1,
        "policy.hidden_sizes": [8, 8], "policy.num_action_chunks": C,
        "algorithm.update_epochs": 2, "algorithm.num_minibatches": 2, "algorithm.target_kl": None,
        "algorithm.critic_warmup_steps": 0,
        "algorithm.lr_scale": {"critic": 2.0},  # two param groups: the position rule must follow them
    })


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


def test_a_run_id_is_looked_up_under_run_root(tmp_path, capsys):
    """`python -m pipelines.upgrade RUN_ID --run-root R` upgrades R/<experiment>/RUN_ID, as eval, replay and record
    take run ids (storage.rundir.find_run_dir); an id that is no run is refused in one line with the close ones."""
    from pipelines.config import load_saved_config, to_yaml
    from storage.rundir import write_resolved_config
    from tasks.config import Config
    d = yaml.safe_load(to_yaml(Config()))
    d["policy"]["preset"] = "tiny"  # a key of the older format: the upgrade drops it
    run_dir = tmp_path / "runs" / "smoke" / "20261207-101010-abcd"
    write_resolved_config(run_dir, yaml.safe_dump(d, sort_keys=False))
    assert upgrade_main(["20261207-101010-abc", "--run-root", str(tmp_path / "runs")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "close matches: 20261207-101010-abcd (smoke)" in err
    assert upgrade_main([run_dir.name, "--run-root", str(tmp_path / "runs")]) == 0
    assert not hasattr(load_saved_config(run_dir / "config.yaml", validate=False).policy, "preset")


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

    from storage.trajectories import OldStore, TrajectoryStore
    from tasks.evalstats import OldEvalRecord, read_evals

    def downgrade_then_upgrade(handle):
        (run_dir,) = {p.parent for p in (tmp_path / "p").rglob("config.yaml") if (p.parent / "checkpoints").is_dir()}
        make_old_format(run_dir)
        _make_old_store(run_dir / "trajectories.zarr")  # and the store and eval records (their older layouts)
        for f in (run_dir / "evals").rglob("step_*.json"):
            f.write_text(json.dumps({k: v for k, v in json.loads(f.read_text()).items() if k != "eval_layout"}))
        with pytest.raises(OldFormat, match="python -m pipelines.upgrade"):
            load_checkpoint(latest_checkpoint(run_dir), keys=("run",))
        with pytest.raises(OldStore, match="python -m pipelines.upgrade"):
            TrajectoryStore.open(run_dir / "trajectories.zarr")
        with pytest.raises(OldEvalRecord, match="python -m pipelines.upgrade"):
            read_evals(run_dir)
        assert upgrade_main([str(run_dir)]) == 0

    mu = resume_matches_uninterrupted(tmp_path, ["conf=smoke", "policy.hidden_sizes=[32,32]", *TINY], k=1, n=2,
                                      before_resume=downgrade_then_upgrade)
    assert sorted(mu["train/weight_version"]) == [1, 2]
    # the upgraded store, resumed into, holds what the uninterrupted run's store holds (step 0 copied by the
    # upgrade, step 1 written into it by the resumed run)
    (u,), (p,) = ([TrajectoryStore.open(z) for z in (tmp_path / d).rglob("trajectories.zarr")
                   if "upgrade-backup" not in str(z)] for d in "up")  # the old store is kept in the backup
    assert u.complete_steps().tolist() == p.complete_steps().tolist() == [0, 1]
    assert u.fields == p.fields and {k: v for k, v in u.attrs.items() if k not in ("run_id", "created_at", "store_id")} \
        == {k: v for k, v in p.attrs.items() if k not in ("run_id", "created_at", "store_id")}
    for name in u.fields:
        np.testing.assert_array_equal(u.read(name, [0, 1]), p.read(name, [0, 1]), err_msg=name)


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


# ----- the run's trajectory store and env shard cursors ----------------------------------------------------------
def _current_store(path: Path, steps: int = 2, image_size: int | None = None, attrs: dict | None = None) -> dict:
    """A store as `pipelines.run` writes it (tasks.trajectory's stored fields, the run attrs of a ManiSkill run,
    task_id 0 / trial_id -1 as the shard reports them for ManiSkill), `steps` complete steps and a half-written
    one; `image_size`: an image store (`rgb` field, obs_mode rgb; its family attrs are `attrs`' to give). Returns
    {field: [N, T, B, ...]} of what was written (the half-written step's unwritten shard: None)."""
    from storage.trajectories import TrajectoryStore, clear_cache, write_shard
    from tasks import trajectory
    dims = trajectory.Dims(obs_dim=O, action_dim=D, num_action_chunks=C, num_values=1, image_size=image_size)
    fields = trajectory.zarr_schema(dims)
    st = TrajectoryStore.create(path, fields=fields, T=T, num_envs=2 * B, shard_size=B, attrs={
        "run_id": RUN, "env_id": "PushCube-v1", "simulator": "maniskill",
        "obs_mode": "state" if image_size is None else "rgb",
        "control_mode": "pd_joint_delta_pos", "reward_mode": "normalized_dense", "base_seed": 0,
        "gripper_convention": "open_positive", **(attrs or {})})
    r, written = np.random.default_rng(7), {}
    for n in range(steps + 1):
        a = st.reserve(n)
        for s in range(2 if n < steps else 1):
            d = {k: (r.integers(0, 256, (T, B, *f.shape)) if f.dtype == "uint8"
                     else r.standard_normal((T, B, *f.shape)) * 3).astype(f.dtype) for k, f in fields.items()}
            d["task_id"][:], d["trial_id"][:] = 0, -1
            write_shard(str(path), step=n, shard=s, data=d, attempt=a)
            written[(n, s)] = d
        if n < steps:
            st.mark_complete(n, weight_version=n + 1)
    clear_cache()
    return written


def _make_old_store(path: Path) -> None:
    """The store in the oldest layout dagrl wrote, by hand: schema version 1 (per-step group `epochs`), no attempt
    arrays, no store_id, no simulator / gripper_convention attrs, no task_id / trial_id fields."""
    import shutil

    import zarr
    g = zarr.open_group(str(path), mode="r+")
    for name in ("attempt", "shard_attempt"):
        del g["steps"][name]
    for name in ("task_id", "trial_id"):
        del g["fields"][name]
    layout = g.attrs["layout"]
    layout["fields"] = {k: v for k, v in layout["fields"].items() if k not in ("task_id", "trial_id")}
    attrs = {k: v for k, v in g.attrs.asdict().items() if k not in ("store_id", "simulator", "gripper_convention")}
    g.attrs.clear()
    g.attrs.update({**attrs, "layout": layout, "schema_version": 1})
    shutil.move(path / "steps", path / "epochs")


def _old_cursor_checkpoint(run_dir: Path, counts: list[int]) -> Path:
    """A checkpoint (today's format otherwise) whose runner state holds the older cursor {"episode_count"}."""
    from storage.checkpoints import save_checkpoint
    return save_checkpoint(run_dir, 2, {"run": {"weight_version": 2, "runner": {
        "run_id": RUN, "step": 2, "cursors": [{"episode_count": counts}, None]}}})


def _old_evals(run_dir: Path, cfg) -> dict:
    """Eval records (eval at steps 0, 2; val at 2) as the runner writes them for `cfg`, then without `eval_layout`
    (the older format). Returns {(split, step): the record as written}."""
    from tasks.evalstats import _eval_files, episode_outcomes, eval_layout, write_eval
    out = {}
    for split, step in (("eval", 0), ("eval", 2), ("val", 2)):
        outcomes = episode_outcomes([{"seed": 1000 + i, "success_once": i % 2 == 0, "success_at_end": i == 0,
                                      "return": float(i), "episode_len": 5 + i} for i in range(4)])
        path = write_eval(run_dir, step, outcomes, {"run_id": RUN, "eval_seed": 1000,
                                                    "eval_layout": eval_layout(cfg)}, split=split)
        out[(split, step)] = json.loads(path.read_text())
    for split in ("eval", "val"):
        for f in _eval_files(run_dir, split).values():
            rec = json.loads(f.read_text())
            del rec["eval_layout"]
            f.write_text(json.dumps(rec, indent=0))
    return out


@pytest.fixture
def old_store_run(tmp_path):
    """(run dir with an old store, a checkpoint with an old cursor and eval records without their layout, what the
    current writers wrote: store data, counts, eval records)."""
    from pipelines.config import to_yaml
    from storage.rundir import write_resolved_config
    from tasks.config import Config
    run_dir = tmp_path / "smoke" / "run-2"
    write_resolved_config(run_dir, to_yaml(Config()))
    written = _current_store(run_dir / "trajectories.zarr")
    counts = [3, 5]
    _old_cursor_checkpoint(run_dir, counts)
    _make_old_store(run_dir / "trajectories.zarr")
    evals = _old_evals(run_dir, Config())
    return run_dir, written, counts, evals


def test_an_old_store_and_old_cursors_are_refused_then_upgraded_to_what_the_writer_writes(old_store_run, capsys):
    from pipelines.runner.setup import RunState, _check_formats
    from pipelines.upgrade.store import store_refusal
    from storage.trajectories import OldStore, TrajectoryStore
    from tasks.config import ConfigError
    from tasks.envs.shard import EnvShard, is_cursor
    from tasks.evalstats import OldEvalRecord, read_evals
    from tests.pipelines.test_graphs import FakeEnv
    run_dir, written, counts, evals = old_store_run
    store = run_dir / "trajectories.zarr"
    fix = f"`python -m pipelines.upgrade {run_dir}`"
    # refused: the store where it is opened, the cursors and the store on resume; one line each, naming the file
    with pytest.raises(OldStore) as exc:
        TrajectoryStore.open(store)
    assert "\n" not in str(exc.value) and str(store) in str(exc.value) and fix in str(exc.value)
    ckpt = latest_checkpoint(run_dir)
    state = RunState(**load_checkpoint(ckpt, keys=("run",))["run"]["runner"])
    with pytest.raises(ConfigError) as exc:
        _check_formats("latest", run_dir, ckpt, state)
    assert str(ckpt / "meta.json") in str(exc.value) and "cursors of shards [0]" in str(exc.value)
    assert fix in str(exc.value)
    with pytest.raises(ValueError, match="older format"):
        EnvShard([FakeEnv(), FakeEnv()], env_offset=0, num_envs_total=4, base_seed=0, auto_reset=True,
                 ignore_terminations=False).load_state_dict(state.cursors[0])
    for split in ("eval", "val"):
        with pytest.raises(OldEvalRecord) as exc:
            read_evals(run_dir, split)
        assert "\n" not in str(exc.value) and "no eval_layout" in str(exc.value) and fix in str(exc.value)
    # upgraded: one line per rewritten file (the checkpoint, the store); a second upgrade finds nothing to do
    capsys.readouterr()
    assert upgrade_main([str(run_dir)]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 5 and str(ckpt) in out[0] and "older cursors of shards [0]" in out[0]
    assert all("no eval_layout" in line for line in out[1:4])
    assert str(store) in out[4] and "schema version 1" in out[4] and "no task_id field" in out[4]
    # the eval records: what the runner writes (its layout is the run config's)
    for split in ("eval", "val"):
        assert read_evals(run_dir, split) == {step: rec for (sp, step), rec in evals.items() if sp == split}
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    assert upgrade_main([str(run_dir)]) == 0
    assert "nothing to do" in capsys.readouterr().out
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == before
    # read: the cursor is what a shard that has not started, at those counts, writes (no RNG state drawn yet)
    state = RunState(**load_checkpoint(latest_checkpoint(run_dir), keys=("run",))["run"]["runner"])
    _check_formats("latest", run_dir, latest_checkpoint(run_dir), state)
    fresh = EnvShard([FakeEnv(), FakeEnv()], env_offset=0, num_envs_total=4, base_seed=0, auto_reset=True,
                     ignore_terminations=False, episode_count=counts)
    assert is_cursor(state.cursors[0]) and state.cursors[0] == fresh.state_dict() and state.cursors[1] is None
    fresh.load_state_dict(state.cursors[0])  # what the older reader did: fresh episodes at those counts
    assert fresh.needs_reset and fresh.episode_count.tolist() == counts and fresh.rng_state is None
    # the store: today's reader takes it, with every value the current writer wrote (task_id 0, trial_id -1)
    assert store_refusal(store) is None
    st = TrajectoryStore.open(store)
    assert st.attrs["simulator"] == "maniskill" and st.attrs["gripper_convention"] == "open_positive"
    assert st.complete_steps().tolist() == [0, 1] and st.step_scalar("weight_version").tolist() == [1, 2, -1]
    assert [st.attempt(n) for n in range(3)] == [1, 1, 1] and st.shards_written(2).tolist() == [True, False]
    for (n, s), d in written.items():
        for name, want in d.items():
            if n < 2:
                got = st.read(name, [n])[0][:, s * B:(s + 1) * B]
            else:  # the half-written step: not complete, so read around the verified reader
                import zarr
                got = zarr.open_group(str(store), mode="r")[f"fields/{name}"][n, :, s * B:(s + 1) * B]
            np.testing.assert_array_equal(got, want, err_msg=f"{name} step {n} shard {s}")
    assert (next(run_dir.glob("upgrade-backup-*")) / "trajectories.zarr" / "epochs").is_dir()  # the old one kept


def test_a_store_whose_trials_cannot_be_recovered_is_not_upgraded(old_store_run, capsys):
    """A LIBERO store without trial_id: the init state of each episode was not recorded; nothing is guessed."""
    import zarr
    run_dir = old_store_run[0]
    zarr.open_group(str(run_dir / "trajectories.zarr"), mode="r+").attrs["simulator"] = "libero"
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    assert upgrade_main([str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no trial_id field" in err and "re-record it" in err
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == before
    assert not list(run_dir.glob("upgrade-backup-*")) and not list(run_dir.glob(".upgrade-*"))


def test_upgrade_of_a_store_beside_a_live_owner_is_refused_and_changes_nothing(old_store_run, tmp_path, capsys):
    """Its run's live driver (the run's owner lock), or for a recording outside a run a live recording (the store's
    lock): refused in one line naming the holder, every file left as it was."""
    import shutil

    from tests.storage.test_locks import _holder, _listing, _stop
    run_dir = old_store_run[0]
    record = tmp_path / "demos.zarr"
    shutil.copytree(run_dir / "trajectories.zarr", record)
    for kind, path, target in (("run", run_dir, run_dir), ("write", record, record)):
        holder = _holder(kind, path)
        try:
            before = _listing(target)
            assert upgrade_main([str(target)]) == 2
            err = capsys.readouterr().err.strip()
            assert "\n" not in err and f"pid {holder.pid}" in err, err
            assert _listing(target) == before
        finally:
            _stop(holder)
    assert upgrade_main([str(record)]) == 0  # the recording, once its owner is gone
    assert f"{record} rewritten" in capsys.readouterr().out


# ----- the three fallbacks that were read as today's: an image store's LOD, the config digest, input fingerprints -
@pytest.mark.parametrize("where", ["recording", "run"])
def test_an_image_store_without_its_robot_visual_lod_is_refused_then_upgraded(tmp_path, capsys, where):
    """A ManiSkill image store written before its adapter recorded `robot_visual_lod` (tasks.envs.maniskill.adapter
    `store_attrs`): refused where it is read (the readers' `store_refusal`; replay) in one line naming the store and
    the upgrade, never read as 1.0; the upgrade adds what its images show (a recording: the original meshes, 1.0; a
    run's store: its config's env.robot_visual_lod), keeps every chunk, and a second upgrade finds nothing to do."""
    from pipelines.config import to_yaml
    from pipelines.replay_input import ReplayInputError, open_store
    from pipelines.upgrade.store import store_refusal
    from storage.rundir import write_resolved_config
    from storage.trajectories import TrajectoryStore
    from tasks.config import Config, replace_keys
    if where == "run":
        target = tmp_path / "smoke" / "run-3"
        cfg = replace_keys(Config(), {"env.obs_mode": "rgb", "env.image_size": 4, "env.robot_visual_lod": 0.1})
        write_resolved_config(target, to_yaml(cfg))
        store, want = target / "trajectories.zarr", 0.1
    else:
        target = store = tmp_path / "demos.zarr"
        want = 1.0
    written = _current_store(store, image_size=4)  # obs_mode rgb, no robot_visual_lod: the older format
    line = store_refusal(store)
    assert "\n" not in line and str(store) in line and "no robot_visual_lod attribute" in line
    assert f"`python -m pipelines.upgrade {target}`" in line
    with pytest.raises(ReplayInputError, match="no robot_visual_lod attribute"):
        open_store(store)
    capsys.readouterr()
    assert upgrade_main([str(target)]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and f"{store} rewritten" in out[0] and "no robot_visual_lod attribute" in out[0]
    st = TrajectoryStore.open(store)
    assert store_refusal(store) is None and st.attrs["robot_visual_lod"] == want
    for (n, s), d in written.items():
        if n < 2:
            np.testing.assert_array_equal(st.read("rgb", [n])[0][:, s * B:(s + 1) * B], d["rgb"])
    before = {p: p.read_bytes() for p in store.rglob("*") if p.is_file()}
    assert upgrade_main([str(target)]) == 0
    assert "nothing to do" in capsys.readouterr().out
    assert {p: p.read_bytes() for p in store.rglob("*") if p.is_file()} == before


def test_a_config_without_its_digest_is_refused_then_upgraded(tmp_path, capsys):
    """A run's config.yaml saved before the digest existed (no config.yaml.sha256): refused where it is read
    (storage.rundir.OldRunFile) in one line naming the file and the upgrade; the upgrade writes the digest (the
    text unchanged, the old file in the backup) and a second upgrade finds nothing to do."""
    from pipelines.config import load_saved_config, to_yaml
    from storage.rundir import OldRunFile, read_resolved_config
    from tasks.config import Config, ConfigError
    run_dir = tmp_path / "smoke" / "run-4"
    run_dir.mkdir(parents=True)
    text = to_yaml(Config())
    (run_dir / "config.yaml").write_text(text)  # as a run wrote it before the digest
    with pytest.raises(OldRunFile) as exc:
        read_resolved_config(run_dir / "config.yaml")
    assert "\n" not in str(exc.value) and f"`python -m pipelines.upgrade {run_dir}`" in str(exc.value)
    with pytest.raises(ConfigError, match="older format"):
        load_saved_config(run_dir / "config.yaml", validate=False)
    capsys.readouterr()
    assert upgrade_main([str(run_dir)]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and "config.yaml rewritten" in out[0] and "its digest written" in out[0]
    assert read_resolved_config(run_dir / "config.yaml") == text
    assert (next(run_dir.glob("upgrade-backup-*")) / "config.yaml").read_text() == text
    assert load_saved_config(run_dir / "config.yaml", validate=False) == Config()
    assert upgrade_main([str(run_dir)]) == 0
    assert "nothing to do" in capsys.readouterr().out


@pytest.mark.parametrize("reads", ["weights", "nothing"])
def test_a_checkpoint_without_input_fingerprints_is_refused_on_resume_then_records_todays(tmp_path, capsys, reads):
    """A checkpoint whose runner state has no `inputs` (written before the run recorded the fingerprints of the
    data it reads from outside its run dir) is refused by the resume in one line naming its meta.json and the
    upgrade (it was adopting today's silently); a run that reads nothing records {} and is not refused. The upgrade
    records today's fingerprints and says so in its line; the resume's checks then pass; a second upgrade finds
    nothing to do."""
    from pipelines.config import to_yaml
    from pipelines.runner.setup import RunState, _check_inputs, _check_recorded_inputs, input_fingerprints, \
        resolve_resume
    from storage.checkpoints import save_checkpoint
    from storage.exports import directory_fingerprint
    from storage.rundir import write_resolved_config
    from tasks.config import Config, ConfigError, replace_keys
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "w.bin").write_bytes(b"\x01" * 100)
    cfg = replace_keys(Config(), {"run_root": str(tmp_path / "runs"), "runner.resume": "run-5",
                                  "policy.model_path": str(hf) if reads == "weights" else None})
    want = {"policy.model_path": directory_fingerprint(hf)} if reads == "weights" else {}
    assert input_fingerprints(cfg) == want
    run_dir = tmp_path / "runs" / "smoke" / "run-5"
    write_resolved_config(run_dir, to_yaml(cfg))
    runner = {"run_id": "run-5", "step": 2, "cursors": [None] * cfg.env.num_shards}  # no `inputs`
    ckpt = save_checkpoint(run_dir, 2, {"run": {"weight_version": 2, "runner": runner}})
    with pytest.raises(ConfigError) as exc:
        resolve_resume(cfg)
    msg = str(exc.value)
    assert exc.value.key == "runner.resume" and "\n" not in msg
    assert str(ckpt / "meta.json") in msg and "no input fingerprints" in msg
    assert f"`python -m pipelines.upgrade {run_dir}`" in msg
    _check_recorded_inputs("run-5", ckpt, {**runner, "inputs": {}})  # today's form of "reads nothing": not refused
    capsys.readouterr()
    assert upgrade_main([str(run_dir)]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and str(ckpt) in out[0] and "no input fingerprints; today's adopted" in out[0]
    assert (f"policy.model_path: {want['policy.model_path']}" if want else "the run reads no outside data") in out[0]
    saved = load_checkpoint(latest_checkpoint(run_dir), keys=("run",))["run"]["runner"]
    assert saved == {**runner, "inputs": want}
    _check_recorded_inputs("run-5", ckpt, saved)
    assert _check_inputs(cfg, RunState(**saved)) == want
    assert upgrade_main([str(run_dir)]) == 0
    assert "nothing to do" in capsys.readouterr().out


def test_a_checkpoint_without_input_fingerprints_whose_input_is_gone_is_not_upgraded(tmp_path, capsys):
    """Today's fingerprint of an input that is not there cannot be taken: refused in one line, nothing changed."""
    from pipelines.config import to_yaml
    from storage.checkpoints import save_checkpoint
    from storage.rundir import write_resolved_config
    from tasks.config import Config, replace_key
    gone = tmp_path / "hf"
    run_dir = tmp_path / "runs" / "smoke" / "run-6"
    write_resolved_config(run_dir, to_yaml(replace_key(Config(), "policy.model_path", str(gone))))
    save_checkpoint(run_dir, 2, {"run": {"weight_version": 2, "runner": {"run_id": "run-6", "step": 2}}})
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    capsys.readouterr()
    assert upgrade_main([str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"policy.model_path={gone}, which is missing" in err
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == before
    assert not list(run_dir.glob("upgrade-backup-*")) and not list(run_dir.glob(".upgrade-*"))
