"""2 CPU ranks (gloo, FSDP2) run the one update loop of tasks.actor.loop: critic warm-up, the skip of a non-finite
step on every rank, and the optimizer state moving 1 rank -> 2 ranks -> 1 rank with parameters that have no Adam
state yet (the actor during warm-up).

One spawn of 2 rank processes (~15-25 s on the shared 2-core machine). The reference is the one-rank
`tasks.actor.entries.actor_update` on the same batch (same permutations: `permutation_seed`). Tolerance as in
test_distributed.py: parameters atol = rtol = 1e-5 (2 ranks x 2 micro-batches change only the summation order).
"""
from __future__ import annotations

import copy
import math
import os

import numpy as np
import pytest
import torch

from tasks import resident
from tasks.config import Config, replace_keys
from tasks.actor.distributed import free_port

T, B, C, D, O = 4, 4, 2, 3, 5  # two shards of [T, B] -> N = 32 samples


def _cfg(ranks: bool = True) -> Config:
    return replace_keys(Config(), {
        "rollout.chunk_steps": T, "env.num_envs": 2 * B, "env.num_shards": 2,
        "policy.hidden_sizes": [8, 8], "policy.num_action_chunks": C,
        "algorithm.update_epochs": 2, "algorithm.num_minibatches": 2,  # G = 16 per optimizer step
        "algorithm.target_kl": None, "algorithm.entropy_coef": 0.01, "algorithm.value_clip": 0.2,
        "algorithm.critic_warmup_steps": 2,  # versions 0 and 1 train the critic only
        "algorithm.micro_batch_size": 4 if ranks else None,  # 2 ranks: P = 8 per rank, grad_accum = 2
    })


def _shard(seed: int) -> dict:
    r = np.random.default_rng(seed)
    return {"obs": r.standard_normal((T, B, O)).astype(np.float32),
            "actions": r.standard_normal((T, B, C, D)).astype(np.float32),
            "logprobs": (r.standard_normal((T, B, C, D)) * 0.1 - 1.5).astype(np.float32),
            "values": r.standard_normal((T, B, 1)).astype(np.float32),
            "advantages": r.standard_normal((T, B)).astype(np.float32),
            "returns": r.standard_normal((T, B)).astype(np.float32),
            "step_mask": np.ones((T, B, C), bool), "loss_mask": np.ones((T, B), bool)}


def _initial_weights(cfg: Config) -> dict:
    from tasks.policies import make_policy
    p = make_policy(cfg.policy, obs_dim=O, action_dim=D, seed=cfg.seed)
    return {"version": 0, "state_dict": {k: v.detach().clone() for k, v in p.state_dict().items()}}


def _local_state(st) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    params = [p.to_local().detach().clone() for p in st.policy.parameters()]
    opt = [v.to_local().clone() if hasattr(v, "to_local") else torch.as_tensor(v).clone()
           for p in st.policy.parameters() for v in st.optimizer.state.get(p, {}).values()]
    return params, opt


def _rank_main(rank: int, world: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    from tasks.actor import loop
    from tasks.actor.distributed import actor_state_rank, actor_update_rank, group_specs
    cfg, samples = _cfg(), [_shard(0), _shard(1)]
    s1 = torch.load(os.path.join(out_dir, "s1.pt"), weights_only=False)  # a ONE-rank checkpoint, in warm-up
    spec = group_specs(world, "127.0.0.1", port, 0, timeout_s=120)[rank]
    res = {"metrics": []}
    weights = {"version": 1, "state_dict": s1["policy"], "optimizer": s1["optimizer"]}
    for call in range(2):  # version 1 (warm-up), version 2 (actor and critic)
        out = actor_update_rank(cfg, "run", spec, weights, *samples)
        res["metrics"].append(out["metrics"])
        if rank == 0:
            res[f"state_dict{call}"] = out["state_dict"]
        weights = {"version": out["version"]}
    state = actor_state_rank("run")
    if rank == 0:
        res["optimizer"] = state["optimizer"]
    # a NaN loss on rank 1 only: every rank must skip every step (rank 0 alone sees finite numbers)
    st = resident.get("run/actor_group")
    before = _local_state(st)
    if rank == 1:
        plain = loop.minibatch_loss

        def poisoned(*args, **kwargs):
            terms = plain(*args, **kwargs)
            return {**terms, "critic_loss": terms["critic_loss"] * float("nan")}
        loop.minibatch_loss = poisoned
    out = actor_update_rank(cfg, "run", spec, weights, *samples)
    after = _local_state(st)
    res["nan_metrics"] = out["metrics"]
    res["nan_unchanged"] = all(torch.equal(x, y) for a, b in zip(before, after) for x, y in zip(a, b)) and \
        [len(a) for a in before] == [len(a) for a in after]
    resident.release("run/")
    torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.fixture(scope="module")
def reference():
    """One rank: update v0 (warm-up) -> checkpoint S1 -> v1 (warm-up) -> v2; the states along the way."""
    from tasks.actor import entries, state
    cfg, samples = _cfg(ranks=False), [_shard(0), _shard(1)]
    w = _initial_weights(cfg)
    outs, s1 = [], None
    for v in range(3):
        w = entries.actor_update(cfg, "ref-integrity", w, *samples)
        outs.append(w)
        actor = resident.get("ref-integrity/actor")
        if v == 0:
            s1 = {"policy": w["state_dict"], "optimizer": copy.deepcopy(state.optimizer_state(actor.policy,
                                                                                               actor.optimizer))}
    final_opt = copy.deepcopy(state.optimizer_state(actor.policy, actor.optimizer))
    resident.release("ref-integrity/")
    return {"outs": outs, "s1": s1, "optimizer": final_opt}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, reference):
    import time

    import torch.multiprocessing as mp
    out = str(tmp_path_factory.mktemp("dist_integrity"))
    torch.save(reference["s1"], os.path.join(out, "s1.pt"))
    port = free_port("127.0.0.1")
    ctx = mp.get_context("spawn")
    t0 = time.perf_counter()
    procs = [ctx.Process(target=_rank_main, args=(r, 2, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=240)
    for p in procs:
        if p.is_alive():
            p.kill()
    assert [p.exitcode for p in procs] == [0, 0], "a rank process failed (its traceback is in the captured stderr)"
    res = [torch.load(os.path.join(out, f"rank{r}.pt"), weights_only=False) for r in range(2)]
    print(f"2-rank spawn + 3 updates: {time.perf_counter() - t0:.1f} s")
    return res


def test_s1_has_no_actor_state(reference):
    """The premise: a checkpoint in warm-up holds Adam state for the critic only."""
    assert reference["s1"]["optimizer"]["state"] and all(n.startswith("critic.")
                                                        for n in reference["s1"]["optimizer"]["state"])


def test_warmup_on_two_ranks_trains_only_the_critic_as_one_rank(two_ranks, reference):
    (r0, r1) = two_ranks
    s1, ref = reference["s1"]["policy"], reference["outs"][1]["state_dict"]
    got = r0["state_dict0"]
    for k in got:
        if k.startswith("critic."):
            assert not torch.equal(got[k], s1[k]), k  # trained
            torch.testing.assert_close(got[k], ref[k], atol=1e-5, rtol=1e-5)
        else:
            assert torch.equal(got[k], s1[k]), k  # the actor is left as it was, bit for bit
    assert r0["metrics"][0]["train/critic_only"] == 1.0 == r1["metrics"][0]["train/critic_only"]


def test_one_rank_checkpoint_resumes_on_two_ranks_and_back(two_ranks, reference):
    """After warm-up the actor's first Adam steps must start at step 0, as in the one-rank run (with a zero-step
    state made up on load, Adam's bias correction would shrink them visibly)."""
    from tasks.actor import entries, state
    (r0, _r1) = two_ranks
    ref = reference["outs"][2]["state_dict"]
    for k, v in r0["state_dict1"].items():
        torch.testing.assert_close(v, ref[k], atol=1e-5, rtol=1e-5, msg=lambda m, k=k: f"{k}: {m}")
    # rank 0's full optimizer state (2 ranks) is the one-rank run's: same names, steps, values
    opt, ref_opt = r0["optimizer"], reference["optimizer"]
    assert set(opt["state"]) == set(ref_opt["state"])
    for n, s in opt["state"].items():
        assert float(s["step"]) == float(ref_opt["state"][n]["step"]), n
        torch.testing.assert_close(s["exp_avg_sq"], ref_opt["state"][n]["exp_avg_sq"], atol=1e-6, rtol=1e-4)
    # ... and loads back on one rank exactly
    cfg = _cfg(ranks=False)
    entries.actor_init(cfg, "back", (O, D), checkpoint={"policy": r0["state_dict1"], "optimizer": opt,
                                                        "rng": state.rng_state(), "run": {"weight_version": 3}})
    actor = resident.get("back/actor")
    try:
        again = state.optimizer_state(actor.policy, actor.optimizer)
        assert again["param_groups"] == opt["param_groups"] and set(again["state"]) == set(opt["state"])
        for n, s in opt["state"].items():
            for k, v in s.items():
                assert torch.equal(torch.as_tensor(v), torch.as_tensor(again["state"][n][k])), (n, k)
    finally:
        resident.release("back/")


def test_nan_on_one_rank_makes_every_rank_skip(two_ranks):
    for r in two_ranks:
        m = r["nan_metrics"]
        assert m["train/skipped_updates"] == 4.0 and m["train/minibatch_updates"] == 0.0  # 2 epochs x 2 steps
        assert math.isnan(m["train/critic_loss"])
        assert r["nan_unchanged"]  # this rank's shards of parameters and optimizer state, bit for bit
