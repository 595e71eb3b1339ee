"""The multi-rank actor update (`algorithm.num_actor_ranks=2`) wired into the training graph, end to end through
a real local cluster on CPU: 2 logical GPU workers each run one rank of one gloo process group (FSDP2) that lives
across steps; checkpoints carry rank 0's full state; killing one rank's worker as its update starts (a
deterministic kill point, `pipelines.faults.FaultAt`) retries the step from the last checkpoint in a rebuilt group.

Exact resume of a 2-rank run (the group rebuilt in a new generation from the checkpoint, metrics and final weights
equal to the uninterrupted run): tests/pipelines/test_resume.py::test_two_rank_actor_resume_is_exact.
Offline rejection (ranks > actor devices) and the graphs' keys and pinning: tests/pipelines/test_placement.py.
"""
from __future__ import annotations

import math
import time

import pytest
import torch

from pipelines.clusters import start_cluster
from pipelines.config import load_config
from pipelines.faults import FaultAt
from pipelines.runner import Runner
from storage.checkpoints import latest_checkpoint, load_checkpoint

pytestmark = pytest.mark.timeout(600)  # a hang fails the test instead of the suite

RANKS = ["algorithm.num_actor_ranks=2", "cluster.num_gpu_workers=2", "cluster.component_placement.actor=0-1",
         "cluster.dashboard_address=127.0.0.1:0"]
TINY = ["rollout.chunk_steps=4", "rollout.chunk_steps_per_node=4", "env.max_episode_steps=10",
        "policy.hidden_sizes=[32,32]", "runner.save_interval=2", "runner.val_check_interval=3"]


def _history(runner: Runner, key: str) -> list[tuple[int, float]]:
    return [(s, v) for s, v in runner.tracker.get_metric_history(key)]


@pytest.mark.slow  # ~65 s: out of the default suite's 20 min to make room for the compose test (2-rank training end
# to end stays in the default suite: test_resume.py::test_two_rank_actor_resume_is_exact)
def test_killed_rank_worker_is_recovered_from_the_checkpoint(tmp_path):
    """3 steps on 2 ranks, a checkpoint at step 2; rank 1's worker dies as step 3's update starts on it (FaultAt:
    deterministic). Rank 0 is left in (or about to enter) a collective with a dead peer; the runner restarts or
    releases it, rolls back to the step-2 checkpoint and redoes step 3 in group generation 1 on a new port. Also:
    one group serves every step of a generation; the final checkpoint holds rank 0's full state (the final weights
    bit for bit, the optimizer keyed by parameter name); a rank blocked in its task is freed by restarting its
    worker."""
    cfg, _ = load_config(["conf=smoke", f"run_root={tmp_path}", *RANKS, *TINY, "runner.max_steps=3"])
    handle = start_cluster(cfg)
    try:
        said: list[str] = []
        runner = Runner(cfg, handle, echo=said.append)
        assert len(runner.placement.actor_workers) == 2
        victim = runner.placement.actor_workers[1]
        handle.client.register_plugin(FaultAt(victim, f"actor_update_r1-{runner.state.run_id}-2", "kill"),
                                      name="dagrl-test-fault")
        res = runner.run()
        assert res.steps == 3
        assert _history(runner, "train/retries") == [(1, 0.0), (2, 0.0), (3, 1.0)]
        assert _history(runner, "train/actor_ranks") == [(1, 2.0), (2, 2.0), (3, 2.0)]
        # generation 0 built once and reused at step 2; rolled back to the checkpoint of step 2 (nothing to redo
        # before it), step 3 retried in generation 1, rebuilt from the checkpoint's policy and optimizer
        assert _history(runner, "train/group_generation") == [(1, 0.0), (2, 0.0), (3, 1.0)]
        assert _history(runner, "train/group_built") == [(1, 1.0), (2, 0.0), (3, 1.0)]
        assert _history(runner, "train/actor_rebuilt") == [(1, 0.0), (2, 0.0), (3, 1.0)]
        assert _history(runner, "train/weight_version") == [(1, 1.0), (2, 2.0), (3, 3.0)]
        for key in ("train/actor_loss", "train/critic_loss", "train/grad_norm", "time/update"):
            hist = _history(runner, key)
            assert [s for s, _ in hist] == [1, 2, 3] and all(math.isfinite(v) for _, v in hist), key
        assert runner.state.actor_generation == 1
        assert runner.placement.actor_workers[1] != victim  # the restarted worker has a new address
        assert len([m for m in said if "lost during step 3; restoring the actor from the last checkpoint" in m
                    and victim in m]) == 1, said
        assert any("actor process group (generation 0) dropped" in m for m in said), said
        # the checkpoint holds rank 0's full state: the final weights, the optimizer keyed by parameter name
        ckpt = load_checkpoint(latest_checkpoint(res.run_dir))
        assert ckpt["run"]["weight_version"] == 3 and ckpt["run"]["runner"]["step"] == 3
        final = runner.weights.result()
        assert final["version"] == 3 and set(ckpt["policy"]) == set(final["state_dict"])
        for k, v in final["state_dict"].items():
            torch.testing.assert_close(ckpt["policy"][k], v, rtol=0, atol=0, msg=k)
        assert ckpt["optimizer"]["state"] and set(ckpt["optimizer"]["state"]) <= set(final["state_dict"])

        # a rank blocked in its task (as in a collective whose peer hangs without closing its connection) is freed
        # by restarting its worker: the path the runner takes when rank nodes were still processing
        w0 = runner.placement.actor_workers[0]
        blocked = handle.client.submit(time.sleep, 3600, workers=[w0], pure=False)
        while handle.client.processing().get(w0) == []:
            time.sleep(0.1)
        before = runner.watch.worker_ids()[w0]
        t0 = time.monotonic()
        runner.watch.release_groups([w0], runner.state.run_id, runner.state.actor_generation, restart={w0})
        assert time.monotonic() - t0 < 120 and "restarted ['" in said[-1], said[-1]
        handle.client.wait_for_workers(4, timeout=120)
        assert runner.watch.worker_ids().get(w0) != before
        handle.client.cancel(blocked)
    finally:
        handle.close()
