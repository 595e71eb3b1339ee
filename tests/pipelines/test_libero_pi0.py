"""LIBERO with a pi0 checkpoint, end to end through the real simulator: a tiny random pi0 made
here with LIBERO's dims (8-D state, 7-D actions; a plain transformers directory in tmp, as a downloaded checkpoint
is), and a tiny pi0.5 alike, runs the eval protocol (`pipelines.eval`) and two PPO steps of conf=libero_pi0_ppo
(conf=libero_pi05_ppo), both with the agentview and the wrist camera (env.wrist_camera) at 32 px on libero_spatial
task 0 (task 1 too for the eval), episodes cut short (10 policy steps after the 10 wait steps). The run stores both
cameras per chunk step in the trajectory field `rgb` [2, 32, 32, 3], they differ (two views), and `pipelines.replay`
re-simulates its stored episodes bit for bit."""
from __future__ import annotations

import json

import numpy as np
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

# the tiny model on the CPU: conf=libero_pi0_ppo's keys otherwise (two cameras, 10 wait steps, PPO). The tiny
# byte-level tokenizer spends a token per character of LIBERO's instructions (up to ~100; a real checkpoint's
# PaliGemma tokenizer ~20, within pi0's 48)
TINY = ["policy.device=cpu", "policy.dtype=float32", "env.image_size=32", "cluster.dashboard_address=127.0.0.1:0"]
PROMPT = {"pi0": 128, "pi05": 256}  # pi0.5's prompt holds the discretised state too (~4 tokens a dimension)


def _tiny(family: str) -> list[str]:
    return [f"conf=libero_{family}_ppo", *TINY, f"policy.max_prompt_len={PROMPT[family]}"]


@pytest.fixture(scope="module", params=["pi0", "pi05"])
def hf_dir(request, tmp_path_factory):
    """A directory written by transformers alone, as a downloaded checkpoint is (config.json with model_type pi0,
    model.safetensors, the processor's files with LIBERO's 8-D state and 7-D action statistics): a tiny random pi0
    whose chunk (10 actions) is longer than the env executes (C=5), as pi0's 50. Returns (family, directory)."""
    import torch
    from tasks.policies.pi0.library import model_class, preset_config
    from tasks.policies.pi0.processor import new_processor
    family = request.param
    probe = preset_config(family, "tiny", chunk_size=10, num_steps=4)
    # the processor's pad length: pi0 pads the state to max_state_dim, PI05Processor the actions to max_action_dim
    pad = getattr(probe, "max_state_dim", None) or probe.max_action_dim
    proc = new_processor(family, image_size=32, patch_size=8, obs_dim=8, action_dim=7, max_state_dim=pad,
                         chunk_size=10)
    proc.actions_mean, proc.actions_std = [0.0] * 7, [0.5] * 7  # the checkpoint's normalisation (not identity)
    torch.manual_seed(0)
    lib = model_class(family)(preset_config(family, "tiny", chunk_size=10, num_steps=4,
                                            vocab_size=len(proc.tokenizer), image_token_id=proc.image_token_id))
    d = tmp_path_factory.mktemp(family) / f"{family}_libero"
    lib.save_pretrained(str(d))
    proc.save_pretrained(str(d))
    meta = json.loads((d / "config.json").read_text())
    assert meta["model_type"] == family and "family" not in meta  # nothing of dagrl's in it
    return family, d


def test_eval_protocol_of_a_pi0_checkpoint_with_two_cameras(hf_dir, tmp_path):
    from pipelines.eval import main
    out = tmp_path / "eval"
    family, d = hf_dir
    words = [str(d), *_tiny(family), "env.task_ids=[0,1]", "env.num_trials=1",
             "env.eval.num_envs=2", "env.max_episode_steps=10", "env.num_envs=2", "env.num_shards=1",
             "cluster.num_env_workers=1", "cluster.memory_limit=8GiB", f"run_root={tmp_path}", "--out", str(out)]
    assert main(words) == 0
    rec = json.loads((out / "eval.json").read_text())
    # one eval init state per task (trial 40 of the disjoint split), each once; 10 policy steps (ignore_terminations)
    assert rec["summary"]["num_episodes"] == 2 and list(rec["per_task"]) == ["0", "1"]
    base = rec["eval_seed"]
    assert {s: (e["task_id"], e["trial_id"]) for s, e in rec["episodes"].items()} == {str(base): (0, 40),
                                                                                       str(base + 1): (1, 40)}
    assert all(e["episode_len"] == 10 for e in rec["episodes"].values())


def test_ppo_steps_of_a_pi0_checkpoint_store_both_cameras_and_replay(hf_dir, tmp_path):
    from pipelines.replay import replay
    from pipelines.run import main
    from storage.trajectories import TrajectoryStore
    family, d = hf_dir
    words = [*_tiny(family), f"policy.model_path={d}", "env.task_ids=[0]",
             "env.max_episode_steps=10", "env.num_envs=2", "env.num_shards=1", "env.eval.num_envs=1",
             "env.eval.num_episodes=1", "rollout.chunk_steps=2", "rollout.chunk_steps_per_node=2",
             "algorithm.num_minibatches=1", "algorithm.update_epochs=1", "runner.max_steps=2",
             "runner.val_check_interval=2", "runner.save_interval=2", "cluster.num_env_workers=1",
             "cluster.memory_limit=8GiB", f"run_root={tmp_path}"]
    assert main(words) == 0
    run_dir = next(p for p in (tmp_path / f"libero_{family}_ppo").iterdir() if p.is_dir())
    st = TrajectoryStore.open(run_dir / "trajectories.zarr")
    assert tuple(st.fields["rgb"].shape) == (2, 32, 32, 3)  # (agentview, wrist) per chunk step
    steps = st.complete_steps()
    assert len(steps) == 2
    rgb = st.read("rgb", steps)  # [S, T, B, 2, 32, 32, 3] or [S*T, B, ...]
    rgb = np.asarray(rgb).reshape(-1, 2, 32, 32, 3)
    assert (rgb[:, 0] != rgb[:, 1]).any(axis=(1, 2, 3)).all()  # two views in every sample
    rep = replay(run_dir / "trajectories.zarr", num_episodes=2, progress=False)
    assert rep["all_verified"]
    for r in rep["episodes"]:
        assert r["max_abs_obs_diff"] == 0.0 and r["max_abs_reward_diff"] == 0.0, r
