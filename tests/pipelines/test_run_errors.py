"""What `python -m pipelines.run` prints and returns when a run cannot go on:

- a `runner.resume` that cannot be honoured (no such run, no checkpoint, another shard layout, a changed training
  key) is found OFFLINE by `pipelines.runner.setup.resolve_resume`: exit 2, one line `error: ...`, no cluster;
- a non-finite action (a policy emitting NaN, injected on the workers) stops the step inside the env shard's task:
  exit 1, one line `error: training step 1: non-finite actions ...`, no traceback.
"""
from __future__ import annotations

import sys
from dataclasses import asdict

import pytest

from pipelines import run
from pipelines.runner.setup import RunState, resolve_resume
from storage.checkpoints import save_checkpoint
from storage.rundir import new_run_dir
from tasks.config import ConfigError


@pytest.fixture
def no_cluster(monkeypatch):
    """Fail the test if anything starts a cluster."""
    import pipelines.clusters

    def refuse(cfg):
        raise AssertionError("a cluster was started")
    monkeypatch.setattr(pipelines.clusters, "start_cluster", refuse)


def _checkpointed_run(root, num_shards: int, mlflow_run_id: str | None = None) -> str:
    state = RunState(run_id="20260101-000000-beef", mlflow_run_id=mlflow_run_id, step=2,
                     cursors=[None] * num_shards)
    run_dir = new_run_dir(root, "smoke", state.run_id)
    save_checkpoint(run_dir, 2, {"run": {"runner": asdict(state), "experiment": "smoke"}})
    return state.run_id


def _run_err(capsys, *argv) -> tuple[int, list[str]]:
    capsys.readouterr()  # only what the command prints
    rc = run.main(["conf=smoke", *argv])
    return rc, [line for line in capsys.readouterr().err.splitlines() if line.strip()]


@pytest.mark.parametrize("case, key", [("unknown", "runner.resume"), ("latest_none", "runner.resume"),
                                       ("no_checkpoint", "runner.resume"), ("shards", "env.num_shards")])
def test_bad_resume_exits_2_with_one_line_before_any_cluster(tmp_path, capsys, no_cluster, case, key):
    resume = {"unknown": "19990101-000000-dead", "latest_none": "latest", "no_checkpoint": "latest",
              "shards": None}[case]
    if case == "no_checkpoint":
        new_run_dir(tmp_path, "smoke", "20260101-000000-cafe")  # started, ended before its first checkpoint
    if case == "shards":
        resume = _checkpointed_run(tmp_path, num_shards=7)  # the smoke config has another shard count
    rc, err = _run_err(capsys, f"run_root={tmp_path}", f"runner.resume={resume}")
    assert rc == 2 and len(err) == 1 and err[0].startswith(f"error: {key}"), err


def test_changed_training_key_vs_the_resumed_runs_params_is_refused_offline(tmp_path, capsys, no_cluster):
    from pipelines.config import load_config, to_dict
    from storage.tracking import Tracker, default_tracking_uri, flatten_config
    cfg, _ = load_config(["conf=smoke", f"run_root={tmp_path}"])
    tracker = Tracker(uri=default_tracking_uri(tmp_path.resolve()), experiment="smoke", run_name="old")
    tracker.log_params(flatten_config(to_dict(cfg)))
    tracker.set_terminated("KILLED")
    run_id = _checkpointed_run(tmp_path, cfg.env.num_shards, mlflow_run_id=tracker.run_id)
    lr = cfg.algorithm.lr
    rc, err = _run_err(capsys, f"run_root={tmp_path}", f"runner.resume={run_id}", f"algorithm.lr={lr * 2}")
    assert rc == 2 and len(err) == 1 and err[0].startswith("error: algorithm.lr"), err
    # a runner.* key may change; resolve_resume then reports it (it goes to an artifact, not the params)
    cfg2, _ = load_config(["conf=smoke", f"run_root={tmp_path}", f"runner.resume={run_id}", "runner.max_steps=9"])
    res = resolve_resume(cfg2)
    assert res.state.step == 2 and res.changed == {"runner.max_steps": "9", "runner.resume": run_id}  # flattened params are str
    with pytest.raises(ConfigError):
        resolve_resume(load_config(["conf=smoke", f"run_root={tmp_path}", f"runner.resume={run_id}",
                                    f"algorithm.lr={lr * 2}"])[0])


class NaNActions:
    """Worker plugin: every policy call on the worker returns NaN actions (a broken policy)."""

    name = "test-nan-actions"

    def setup(self, worker) -> None:
        from tasks import rollout
        orig = rollout._act

        def act(rep, obs, deterministic=False):
            out = orig(rep, obs, deterministic)
            out["actions"] = out["actions"] * float("nan")
            return out
        rollout._act = act


@pytest.mark.timeout(300)
def test_nan_policy_stops_with_one_line_naming_the_step(tmp_path, capsys, monkeypatch):
    import cloudpickle
    from distributed.diagnostics.plugin import WorkerPlugin
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    plugin = type("NaNActionsPlugin", (NaNActions, WorkerPlugin), {})
    original = run._train

    def train(cfg, handle):  # pipelines.run's training on the fresh cluster: first break its policy
        handle.client.register_plugin(plugin(), name=NaNActions.name)
        return original(cfg, handle)
    monkeypatch.setattr(run, "_train", train)
    rc, err = _run_err(capsys, f"run_root={tmp_path}", "runner.max_steps=2", "runner.val_at_start=false",
                       "runner.progress=false")
    assert rc == 1, err
    assert len(err) == 1 and err[0].startswith("error: training step 1: non-finite actions"), err


def test_damaged_newest_checkpoint_is_refused_offline_naming_the_file_and_the_intact_one(tmp_path, capsys,
                                                                                        no_cluster):
    """A resume whose newest checkpoint has a damaged file (same size, other bytes: only sha256 sees it) used to
    pass the offline check, start the cluster, fork the MLflow run, grow the store and rewrite config.yaml, and
    then fail in the actor with a traceback (fresh-clone check). Now: exit 2, one line naming the file and the
    newest intact checkpoint, before anything starts; moving the damaged one aside resumes from that one."""
    run_id = _checkpointed_run(tmp_path, num_shards=1)
    run_dir = tmp_path / "smoke" / run_id
    state = RunState(run_id=run_id, step=4, cursors=[None])
    newest = save_checkpoint(run_dir, 4, {"run": {"runner": asdict(state), "experiment": "smoke"},
                                          "policy": {"w": __import__("torch").ones(64)}})
    f = newest / "policy.pt"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    rc, err = _run_err(capsys, f"run_root={tmp_path}", f"runner.resume={run_id}", "env.num_shards=1")
    assert rc == 2 and len(err) == 1 and err[0].startswith("error: runner.resume"), err
    assert "policy.pt is corrupt" in err[0] and "global_step_2" in err[0] and "mv " in err[0], err[0]
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before  # nothing written
    newest.rename(newest.with_name(newest.name + ".damaged"))  # the fix the message gives
    cfg = __import__("pipelines.config", fromlist=["load_config"]).load_config(
        ["conf=smoke", f"run_root={tmp_path}", f"runner.resume={run_id}", "env.num_shards=1"])[0]
    assert resolve_resume(cfg).state.step == 2
