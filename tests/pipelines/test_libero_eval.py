"""The LIBERO evaluation protocol through `python -m pipelines.eval`, on the real simulator.

A tiny random pi0 (save_pretrained in tmp, the LIBERO gripper convention in its config.json) evaluated on
libero_spatial tasks 0 and 1 x their first 2 eval init states (trials 40, 41 of the disjoint split), 5-step
episodes at 32 px: env.eval.num_episodes defaults to the 4 (task, trial) pairs, each once; per-task summaries keyed
by the suite's task ids with their names; every episode's task_id / trial_id follow the eval seed rule; a second
eval of the same weights gives identical per-episode outcomes and an identical filmed episode (the same actions,
frame for frame)."""
from __future__ import annotations

import json

import numpy as np
import pytest

# two evals, each a cluster with two LIBERO env builds and a video env: 207 s for one at load ~11 here
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from pipelines.config import load_config
    from pipelines.graphs import export_env_meta
    from tasks.policies import make_policy
    from tasks.rollout import image_size, num_values
    import torch
    cfg = load_config(["conf=libero_smoke"], components=False)[0]
    torch.manual_seed(0)
    pol = make_policy(cfg.policy, obs_dim=8, action_dim=7, num_values=num_values(cfg), image_size=image_size(cfg),
                      load=False)
    d = tmp_path_factory.mktemp("vla") / "hf"
    pol.save_pretrained(d)
    meta = json.loads((d / "config.json").read_text())
    meta["env"] = export_env_meta(cfg)
    (d / "config.json").write_text(json.dumps(meta))
    return d


def _eval(hf, root, out, capsys):
    from pipelines.eval import main
    words = [str(hf), "conf=libero_smoke", "env.task_ids=[0,1]", "env.num_trials=2", "env.eval.num_envs=2",
             "env.max_episode_steps=5", "runner.eval_videos=1", "runner.eval_video_size=64",
             "cluster.memory_limit=8GiB", f"run_root={root}", "--out", str(out)]
    assert main(words) == 0
    return json.loads((out / "eval.json").read_text()), capsys.readouterr()


def test_libero_protocol_per_task_and_deterministic(hf_dir, tmp_path, capsys):
    import imageio.v3 as iio
    import tasks.envs.libero.adapter as L
    rec, printed = _eval(hf_dir, tmp_path, tmp_path / "a", capsys)
    names = L.task_names("libero_spatial")
    assert rec["summary"]["num_episodes"] == 4 and rec["task_names"] == {"0": names[0], "1": names[1]}
    assert list(rec["per_task"]) == ["0", "1"] and all(s["num_episodes"] == 2 for s in rec["per_task"].values())
    # eval seed eval.seed + u: task task_ids[u % 2], trial (u // 2) of the eval split (the last 10: 40..49)
    base = rec["eval_seed"]
    want = {str(base + u): (u % 2, 40 + u // 2) for u in range(4)}
    assert {s: (e["task_id"], e["trial_id"]) for s, e in rec["episodes"].items()} == want
    for e in rec["episodes"].values():  # 5 policy steps (eval ignores terminations here), sparse 0/1 reward
        assert e["episode_len"] == 5 and e["success_at_end"] <= e["success_once"]
        assert (e["return"] > 0) == e["success_once"] and e["return"] == int(e["return"])
    for t in ("0", "1"):
        assert f"task {t} ({names[int(t)]})" in printed.out
    rec2, _ = _eval(hf_dir, tmp_path, tmp_path / "b", capsys)
    assert rec2["episodes"] == rec["episodes"]
    assert len(rec["videos"]) == 1 and len(rec2["videos"]) == 1
    for va, vb in zip(rec["videos"], rec2["videos"]):
        fa, fb = iio.imread(va), iio.imread(vb)
        # the reset frame + the frames tasks.video.frame_steps samples from the 5 steps; the same episode filmed twice
        assert fa.shape == fb.shape and fa.shape[0] >= 2 and np.array_equal(fa, fb)
        np.testing.assert_array_equal(fa, fb)
