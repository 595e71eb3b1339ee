"""Adapter-only weight sync with 2 FSDP actor ranks (tasks.actor.distributed.sync_weights_rank), through
the whole graph on the embedded cluster: pi0 tiny with rank-4 LoRA on 2 logical GPU workers (one gloo group), 2
colocated env shards.

Rank 0 gathers only the trainable tensors (adapters and heads) from the shards and hands them out as partial weights
on top of the generation's init weights (the init graph's `weights-<run>-g0`, which the runner keeps): step 1's
replicas load the base (the init's full weights, one per shard's worker), step 2's only the trainable tensors; after
the run every replica (it played the final eval on the last weights) equals the actor's full weights, tensor for
tensor, as the final checkpoint holds them (rank 0's full state, `actor_state_rank`). Sizes come from the policy
itself (`sync_state`, `state_dict`); nothing is pasted. The one-rank counterpart:
tests/pipelines/test_pi0_rl.py::test_lora_run_syncs_only_the_adapters (and, per tensor, tests/tasks/policies/
test_pi0_sync.py)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("peft")
pytest.importorskip("transformers")

from tests.pipelines.test_pi0_rl import LAYOUTS, SMALL, _metrics  # noqa: E402

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(900)]


def _replica(run_id: str) -> dict:
    """On a worker: its rollout replica's weight version, base key and state dict (CPU copies); {} without one."""
    from tasks import resident
    rep = resident.get(f"{run_id}/policy")
    if rep is None:
        return {}
    return {"version": rep.version, "base_key": rep.base_key,
            "state": {k: v.detach().to("cpu", copy=True) for k, v in rep.module.state_dict().items()}}


def test_two_rank_lora_run_ships_only_the_trainable_tensors_and_replicas_equal_the_actor(tmp_path):
    from pipelines.clusters import start_cluster
    from pipelines.config import load_config
    from pipelines.runner import Runner
    from storage.checkpoints import latest_checkpoint, load_checkpoint
    from tasks import rollout
    from tasks.policies import make_policy
    from tasks.weights import state_dict_nbytes
    args = [*SMALL, *LAYOUTS["ranks2"], "policy=pi0_tiny", "policy.lora_rank=4", "runner.max_steps=2",
            f"run_root={tmp_path}"]
    cfg, _ = load_config(args)
    handle = start_cluster(cfg)
    try:
        runner = Runner(cfg, handle, echo=lambda *a, **k: None)
        res = runner.run()
        assert res.steps == 2
        final = runner.weights.result()  # rank 0's output of step 2
        ckpt = load_checkpoint(latest_checkpoint(res.run_dir))  # rank 0's full state after step 2
        reps = handle.client.run(_replica, runner.state.run_id, workers=sorted(set(runner.placement.shard_workers)))
    finally:
        handle.close()
    assert ckpt["run"]["weight_version"] == 2 and final["version"] == 2
    obs_dim, action_dim = rollout.env_dims(cfg)
    pol = make_policy(cfg.policy, obs_dim=obs_dim, action_dim=action_dim, num_values=rollout.num_values(cfg),
                      image_size=rollout.image_size(cfg), load=False)
    trainable = {n for n, p in pol.named_parameters() if p.requires_grad}
    full, part = state_dict_nbytes(pol.state_dict()), state_dict_nbytes(pol.sync_state())
    # rank 0 handed out the trainable tensors alone, on top of the generation's init weights, with the actor's values
    assert final["partial"] and final["base_key"] == f"weights-{runner.state.run_id}-g0"
    assert set(final["state_dict"]) == trainable and state_dict_nbytes(final["state_dict"]) == part
    for k, v in final["state_dict"].items():
        assert torch.equal(v, ckpt["policy"][k]), k
    # every replica holds the base once and the newest trainable tensors: the actor's full weights, bit for bit
    assert len(reps) == len(set(runner.placement.shard_workers)) and all(reps.values())
    for addr, rep in reps.items():
        assert rep["version"] == 2 and rep["base_key"] == final["base_key"], addr
        assert rep["state"].keys() == ckpt["policy"].keys()
        for k, v in ckpt["policy"].items():
            assert torch.equal(rep["state"][k], v), (addr, k)
    # the bytes the replicas loaded: step 1 the base (a full state dict per shard's replica), step 2 the trainable
    # tensors only; before partial weights on R ranks every step cost the full state dict
    replicas = cfg.env.num_shards  # colocated: one replica per shard's worker
    mb = dict(_metrics(tmp_path, ["system/weight_sync_mb"])["system/weight_sync_mb"])
    assert mb[1] == pytest.approx(replicas * full / 1e6, rel=1e-6)
    assert mb[2] == pytest.approx(replicas * part / 1e6, rel=1e-6) and part < full / 5
