"""The README's VLA recipe in miniature, end to end on the real simulator through a real local cluster:
a state teacher (conf=smoke) -> `pipelines.record` (rgb images, chunks of C=5) -> SFT of pi0 tiny
(`algorithm.name=sft`) -> PPO and GRPO from its `hf/` checkpoint (`policy.model_path`).

Sizes are cut to the bone (4 envs, 16 px images, 10-step episodes, 1-2 steps per run): this checks the plumbing
and the stored values, not learning (the README reports the measured learning numbers).
"""
from __future__ import annotations

import math

import numpy as np
import pytest
from mlflow import MlflowClient

from pipelines import record as record_cli
from pipelines.run import main as run_main
from storage.checkpoints import latest_checkpoint
from storage.tracking import default_tracking_uri
from storage.trajectories import TrajectoryStore

SMALL_ENV = ["env.num_envs=4", "env.num_shards=2", "env.image_size=16", "env.max_episode_steps=10",
             "env.eval.num_envs=2", "env.eval.num_episodes=2", "cluster.dashboard_address=127.0.0.1:0",
             "runner.progress=false"]
RECORD_ENV = [o for o in SMALL_ENV if not o.startswith("env.eval.")]  # pipelines.record does not evaluate


def _metric(root, experiment, key):
    client = MlflowClient(tracking_uri=default_tracking_uri(root))
    run = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])[0]
    return run, [(m.step, m.value) for m in sorted(client.get_metric_history(run.info.run_id, key),
                                                   key=lambda m: m.step)]


@pytest.fixture(scope="module")
def one_cluster(reused_clusters):
    """Every command of this module runs on one embedded cluster of the shared layout (tests/conftest.py
    `reused_clusters`: each command's own cluster start and close are what is left out)."""
    with reused_clusters():
        yield


@pytest.fixture(scope="module")
def recipe(built_once, smoke_run, one_cluster):
    """The teacher is the suite's one conf=smoke run (tests/conftest.py `smoke_run`: a state mlp run with a
    checkpoint); then record, SFT, PPO and GRPO through their CLIs, once for the session (`built_once`: the xdist
    processes share it; the tests read it)."""
    teacher = next(p for p in (smoke_run / "smoke").iterdir() if p.is_dir())

    def build(root):
        store = root / "demos.zarr"
        assert record_cli.main(["conf=pushcube_record", f"run_root={root}", f"record.teacher={teacher}",
                                f"record.out={store}", "record.num_episodes=8", *RECORD_ENV]) == 0
        assert run_main(["conf=pushcube_pi0_sft", f"run_root={root}", f"sft.store={store}", "sft.only_success=false",
                         "sft.updates_per_step=3", "sft.batch_size=8", "runner.max_steps=2",
                         "sft.value_coef=1.0", "policy.value_detach=true",  # a value warm start for PPO's critic
                         "runner.val_check_interval=2", *(o for o in SMALL_ENV if not o.startswith("env.num_envs="))]) == 0
        hf = latest_checkpoint(next(p for p in (root / "pushcube_pi0_sft").iterdir() if p.is_dir())) / "hf"
        for conf in ("pushcube_pi0_ppo", "pushcube_pi0_grpo"):
            assert run_main([f"conf={conf}", f"run_root={root}", f"policy.model_path={hf}", "runner.max_steps=1",
                             "rollout.chunk_steps=2", "rollout.chunk_steps_per_node=2",
                             *(["algorithm.group_size=2"] if conf.endswith("grpo") else []), *SMALL_ENV]) == 0

    root = built_once("vla_recipe", build)
    sft_dir = next(p for p in (root / "pushcube_pi0_sft").iterdir() if p.is_dir())
    return root, root / "demos.zarr", latest_checkpoint(sft_dir) / "hf", teacher


def test_record_stores_teacher_chunks_with_images(recipe):
    _, store, _, _ = recipe
    st = TrajectoryStore.open(store)
    assert st.complete_steps().tolist() == [0, 1]  # 8 episodes = 2 rounds of 4 envs
    assert st.T == 2  # 10-step episodes in chunks of 5
    rgb, actions, mask = st.read("rgb"), st.read("actions"), st.read("step_mask")
    assert rgb.shape == (2, 2, 4, 16, 16, 3) and rgb.dtype == np.uint8 and rgb.std() > 5
    assert actions.shape == (2, 2, 4, 5, 8) and mask.all()  # ignore_terminations: every action executed
    assert np.abs(actions).max() <= 1.0 and np.abs(actions).mean() > 0  # the teacher's clipped actions
    assert st.attrs["episodes"] == 8 and 0 <= st.attrs["successful_episodes"] <= 8
    assert not record_cli.partial_path(store).exists()  # written there, renamed once complete
    # the episode ids of a round are the envs' first/second episodes: g + k * num_envs
    np.testing.assert_array_equal(st.read("episode_id")[:, 0], [[0, 1, 2, 3], [4, 5, 6, 7]])


def test_an_interrupted_recording_leaves_no_store_at_its_output_and_is_refused_as_sft_store(recipe, tmp_path,
                                                                                          monkeypatch, capsys):
    """Interrupted after its first round (a Ctrl-C landing in the driver's bookkeeping): exit 130, nothing at
    record.out (before: a half-written store there, which sft.store took); the partial store is refused as
    sft.store naming the fix; the same command again replaces the partial store and completes."""
    from pipelines.config import check_sft_store
    from tasks.config import Config, ConfigError, replace_key
    _, _, _, teacher = recipe
    out = tmp_path / "demos.zarr"
    argv = ["conf=pushcube_record", f"run_root={tmp_path}", f"record.teacher={teacher}", f"record.out={out}",
            "record.num_episodes=8", *RECORD_ENV]
    real = TrajectoryStore.mark_complete

    def interrupted_in_round_1(self, step, **kw):
        if step == 1:
            raise KeyboardInterrupt
        return real(self, step, **kw)
    monkeypatch.setattr(TrajectoryStore, "mark_complete", interrupted_in_round_1)
    assert record_cli.main(argv) == 130
    partial = record_cli.partial_path(out)
    assert not out.exists() and TrajectoryStore.open(partial).complete_steps().tolist() == [0]
    cfg = replace_key(Config(), "sft.store", str(partial))
    with pytest.raises(ConfigError, match="is a recording that did not finish .* record again"):
        check_sft_store(cfg)
    monkeypatch.setattr(TrajectoryStore, "mark_complete", real)
    capsys.readouterr()
    assert record_cli.main(argv) == 0
    assert f"removing {partial}" in capsys.readouterr().out
    assert not partial.exists() and TrajectoryStore.open(out).attrs["episodes"] == 8


def test_sft_logs_a_loss_and_writes_a_pretrained_checkpoint(recipe):
    root, _, hf, _ = recipe
    run, loss = _metric(root, "pushcube_pi0_sft", "train/sft_loss")
    assert run.info.status == "FINISHED" and [s for s, _ in loss] == [1, 2]
    assert all(math.isfinite(v) and v > 0 for _, v in loss)
    _, vloss = _metric(root, "pushcube_pi0_sft", "train/critic_loss")  # the value warm start
    assert [s for s, _ in vloss] == [1, 2] and all(math.isfinite(v) and v > 0 for _, v in vloss)
    _, ev = _metric(root, "pushcube_pi0_sft", "eval/success_once")
    assert [s for s, _ in ev] == [2]
    assert (hf / "config.json").is_file() and (hf / "model.safetensors").is_file()
    assert not (root / "pushcube_pi0_sft" / run.info.run_name / "trajectories.zarr").exists()


@pytest.mark.parametrize("experiment", ["pushcube_pi0_ppo", "pushcube_pi0_grpo"])
def test_rl_from_the_sft_checkpoint_starts_at_its_eval_and_updates(recipe, experiment):
    root, _, _, _ = recipe
    run, ev = _metric(root, experiment, "eval/success_once")
    assert run.info.status == "FINISHED"
    assert [s for s, _ in ev] == [0, 1]  # runner.val_at_start: the SFT policy's own score first
    _, kl = _metric(root, experiment, "train/approx_kl")
    assert len(kl) == 1 and math.isfinite(kl[0][1])
    _, crit = _metric(root, experiment, "train/critic_loss")
    if experiment.endswith("grpo"):  # critic-free
        assert crit[0][1] == 0.0
    else:
        assert crit[0][1] > 0.0
    run_dir = root / experiment / run.info.run_name
    st = TrajectoryStore.open(run_dir / "trajectories.zarr")
    assert st.read("rgb").shape == (1, 2, 4, 16, 16, 3)
    if experiment.endswith("grpo"):  # groups of 2 envs share their reset seed
        seeds = st.read("episode_seed")[0, 0]
        assert seeds[0] == seeds[1] and seeds[2] == seeds[3] and seeds[0] != seeds[2]


def test_token_vla_trains_through_the_pipeline(tmp_path, one_cluster):
    """The OpenVLA-OFT-style policy through the same graph (state obs, conf=smoke): stored action tokens reach the
    update, whose first minibatch ratio is exactly 1 (the behaviour log-probs are recomputed exactly)."""
    assert run_main(["conf=smoke", "policy.name=token_vla", "policy.num_action_chunks=2", "rollout.chunk_steps=6",
                     "rollout.chunk_steps_per_node=3", "algorithm.num_minibatches=2", "algorithm.update_epochs=1",
                     f"run_root={tmp_path}", "cluster.dashboard_address=127.0.0.1:0", "runner.progress=false"]) == 0
    run, ratio = _metric(tmp_path, "smoke", "train/ratio_mean")
    assert run.info.status == "FINISHED" and len(ratio) == 3
    _, kl = _metric(tmp_path, "smoke", "train/approx_kl")
    assert all(math.isfinite(v) and v >= 0 for _, v in kl)
    run_dir = tmp_path / "smoke" / run.info.run_name
    assert (latest_checkpoint(run_dir) / "hf" / "model.safetensors").is_file()
    st = TrajectoryStore.open(run_dir / "trajectories.zarr")
    lp = st.read("logprobs")
    assert lp.shape == (3, 6, 4, 2, 8) and (lp <= 0).all()  # token log-probs of a categorical


def test_artifacts_that_do_not_fit_the_config_are_rejected_offline(recipe, capsys):
    """model_path's saved config and the SFT store are checked before any worker starts (one line, exit 2)."""
    from pipelines.config import load_config
    from tasks.config import ConfigError
    root, store, hf, teacher = recipe
    cases = [(["conf=pushcube_pi0_ppo", f"policy.model_path={hf}", "env.image_size=32"], "image_size=16"),
             (["conf=pushcube_pi0_ppo", f"policy.model_path={hf}", "env.image_size=16",
               "policy.num_action_chunks=4"], "num_action_chunks=5"),
             (["conf=pushcube_pi0_ppo", f"policy.model_path={hf}", "env.image_size=16", "policy.name=token_vla"],
              "'pi0' checkpoint"),
             (["conf=pushcube_pi0_sft", f"sft.store={store}", "env.image_size=32"], "16 px images"),
             (["conf=pushcube_pi0_sft", f"sft.store={store}", "env.image_size=16", "policy.num_action_chunks=2"],
              "action chunks of 5")]
    for overrides, words in cases:
        with pytest.raises(ConfigError) as info:
            load_config(overrides)
        assert words in str(info.value) and "\n" not in str(info.value), str(info.value)
    # record: the teacher must be a state mlp run, and an existing store is never overwritten (with the valid
    # teacher that recorded it: the existing store alone is refused)
    vla_run = next(p for p in (root / "pushcube_pi0_ppo").iterdir() if p.is_dir())
    capsys.readouterr()
    assert record_cli.main(["conf=pushcube_record", f"run_root={root}", f"record.teacher={vla_run}",
                            f"record.out={root / 'x.zarr'}", *RECORD_ENV]) == 2
    assert "error: record.teacher=" in capsys.readouterr().err
    assert record_cli.main(["conf=pushcube_record", f"run_root={root}", f"record.teacher={teacher}",
                            f"record.out={store}", *RECORD_ENV]) == 2
    assert "error: record.out=" in capsys.readouterr().err
    assert not (root / "x.zarr").exists()
