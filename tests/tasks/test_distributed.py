"""tasks.actor.distributed: batch-size checks, and 2 CPU ranks (gloo, FSDP2) against the single-process update.

One spawn of 2 rank processes (module fixture, ~10-20 s on the shared 2-core machine) runs 4 updates on the same
batch: calls 1-3 in generation 0 (one process group, reused), then generation 1 on a new port rebuilt from the
full policy + optimizer state (`actor_state_rank`), as after a lost rank. The reference is
`tasks.actor.entries.actor_update` (one process, no torch.distributed: the same loop, `tasks.actor.loop.run_update`, as a world
of one), which draws the same permutations (`permutation_seed(cfg, version)`). Tolerance: parameters atol = rtol = 1e-5 (the split changes only the float summation order:
2 ranks x 2 micro-batches of 4 samples vs one minibatch of 16); linear metrics rtol 1e-4, atol 1e-6.
"""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from tasks import resident
from tasks.config import Config, ConfigError, replace_key, replace_keys
from tasks.actor.distributed import RankState, _join, free_port
from tasks.actor.loop import permutation_seed
from tasks.config import batch_plan, check_batch_sizes

T, B, C, D, O = 4, 4, 2, 3, 5  # two shards of [T, B] -> N = 32 samples
CALLS = 4  # 1-3: generation 0; 4: generation 1 (rebuilt from the saved state on a new port)


def _cfg() -> Config:
    return replace_keys(Config(), {
        "rollout.chunk_steps": T, "env.num_envs": 2 * B, "env.num_shards": 2,
        "policy.hidden_sizes": [8, 8], "policy.num_action_chunks": C,
        "algorithm.update_epochs": 2, "algorithm.num_minibatches": 2,  # G = 16 per optimizer step
        "algorithm.target_kl": None, "algorithm.entropy_coef": 0.01, "algorithm.value_clip": 0.2,
        "algorithm.micro_batch_size": 4,  # 2 ranks: P = 8 per rank, grad_accum = 2
    })


def _shard(seed: int) -> dict:
    """One shard's advantages output [T, B, ...] with partial masks (the loss weighting must handle them)."""
    r = np.random.default_rng(seed)
    sm = np.ones((T, B, C), bool)
    sm[1, 0, 1] = False
    sm[2, 3, :] = False
    lm = np.ones((T, B), bool)
    lm[3, 1] = False
    return {"obs": r.standard_normal((T, B, O)).astype(np.float32),
            "actions": r.standard_normal((T, B, C, D)).astype(np.float32),
            "logprobs": (r.standard_normal((T, B, C, D)) * 0.1 - 1.5).astype(np.float32),
            "values": r.standard_normal((T, B, 1)).astype(np.float32),
            "advantages": r.standard_normal((T, B)).astype(np.float32),
            "returns": r.standard_normal((T, B)).astype(np.float32), "step_mask": sm, "loss_mask": lm}


def _initial_weights(cfg: Config) -> dict:
    from tasks.policies import make_policy
    p = make_policy(cfg.policy, obs_dim=O, action_dim=D, seed=cfg.seed)
    return {"version": 0, "state_dict": {k: v.detach().clone() for k, v in p.state_dict().items()}}


def _rank_main(rank: int, world: int, ports: list[int], out_dir: str) -> None:
    """A rank process: CALLS updates (the group of generation 0 reused, then generation 1); results to files."""
    torch.set_num_threads(1)
    import torch.distributed as dist

    from tasks.actor.distributed import actor_state_rank, actor_update_rank, group_inits, group_specs
    cfg, samples = _cfg(), [_shard(0), _shard(1)]
    weights = _initial_weights(cfg)
    res = {"inits": [], "metrics": [], "state_dicts": [], "local_numel": None}
    for call in range(CALLS):
        gen = 0 if call < 3 else 1
        if call == 3:  # a rebuilt group: policy + optimizer from rank 0's full state, shared through a file
            state = actor_state_rank("run")
            if rank == 0:
                torch.save(state, os.path.join(out_dir, "state.pt"))
            dist.barrier()
            state = torch.load(os.path.join(out_dir, "state.pt"), weights_only=False)
            weights = {"version": state["weight_version"], "state_dict": state["policy"],
                       "optimizer": state["optimizer"]}
        spec = group_specs(world, "127.0.0.1", ports[gen], gen, timeout_s=120)[rank]
        out = actor_update_rank(cfg, "run", spec, weights, *samples)
        res["inits"].append(group_inits())
        res["metrics"].append(out["metrics"])
        if rank == 0:
            res["state_dicts"].append(out["state_dict"])
        st = resident.get("run/actor_group")
        res["local_numel"] = sum(p.to_local().numel() for p in st.policy.parameters())
        weights = {"version": out["version"], "state_dict": weights["state_dict"]}  # read only on a rebuild
    resident.release("run/")
    torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    import time

    import torch.multiprocessing as mp
    out = str(tmp_path_factory.mktemp("dist"))
    ports = [free_port("127.0.0.1"), free_port("127.0.0.1")]
    ctx = mp.get_context("spawn")
    t0 = time.perf_counter()
    procs = [ctx.Process(target=_rank_main, args=(r, 2, ports, out)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=240)
    for p in procs:
        if p.is_alive():
            p.kill()
    assert [p.exitcode for p in procs] == [0, 0], "a rank process failed (its traceback is in the captured stderr)"
    res = [torch.load(os.path.join(out, f"rank{r}.pt"), weights_only=False) for r in range(2)]
    return res, time.perf_counter() - t0


@pytest.fixture(scope="module")
def reference():
    """tasks.actor.entries.actor_update CALLS times on the same batch, same permutations."""
    from tasks.actor import entries
    cfg, samples = _cfg(), [_shard(0), _shard(1)]
    weights, outs = _initial_weights(cfg), []
    with torch.random.fork_rng():
        for _ in range(CALLS):
            torch.manual_seed(permutation_seed(cfg, weights["version"]))  # no effect: the update seeds its own draws
            weights = entries.actor_update(cfg, "ref-dist", weights, *samples)
            outs.append(weights)
    resident.release("ref-dist/")
    return outs


def test_two_ranks_equal_single_process_update(two_ranks, reference):
    (r0, r1), seconds = two_ranks
    print(f"2-rank spawn + {CALLS} updates: {seconds:.1f} s")
    for call, (ref, got) in enumerate(zip(reference, r0["state_dicts"])):
        assert ref["state_dict"].keys() == got.keys()
        for k in got:
            torch.testing.assert_close(got[k], ref["state_dict"][k], atol=1e-5, rtol=1e-5,
                                       msg=lambda m, k=k, call=call: f"call {call + 1}, {k}: {m}")
        # the update moved the parameters (the comparison is not vacuous)
        init = _initial_weights(_cfg())["state_dict"]
        assert not torch.allclose(got["actor_mean.0.weight"], init["actor_mean.0.weight"])
        if call == 0:
            diff = max(float((got[k] - ref["state_dict"][k]).abs().max()) for k in got)
            print(f"call 1: max |2 ranks - 1 process| over parameters = {diff:.2e}")
        for name in ("actor_loss", "critic_loss", "entropy", "approx_kl", "clipfrac", "ratio_mean", "loss",
                     "grad_norm", "minibatch_updates", "epochs_run"):
            key = f"train/{name}"
            assert r0["metrics"][call][key] == pytest.approx(ref["metrics"][key], rel=1e-4, abs=1e-6), key
            assert r1["metrics"][call][key] == pytest.approx(r0["metrics"][call][key], rel=1e-6, abs=1e-9), key
        assert r0["metrics"][call]["train/grad_accum"] == 2.0 and r0["metrics"][call]["train/actor_ranks"] == 2.0
    # FSDP2 sharded the parameters: each rank holds about half of them
    total = sum(v.numel() for v in r0["state_dicts"][0].values())
    assert r0["local_numel"] + r1["local_numel"] == total and r0["local_numel"] < total


def test_process_group_lives_across_update_calls(two_ranks):
    (r0, r1), _ = two_ranks
    for r in (r0, r1):
        assert r["inits"] == [1, 1, 1, 2]  # one group for calls 1-3; generation 1 builds a new one
        assert [m["train/group_built"] for m in r["metrics"]] == [1.0, 0.0, 0.0, 1.0]
        assert [m["train/group_generation"] for m in r["metrics"]] == [0.0, 0.0, 0.0, 1.0]
        assert [m["train/weight_version"] for m in r["metrics"]] == [1.0, 2.0, 3.0, 4.0]


def test_check_batch_sizes():
    plan = check_batch_sizes(32, 2, 16, 4)
    assert (plan.per_rank_batch_size, plan.grad_accum, plan.num_minibatches) == (8, 2, 2)
    with pytest.raises(ConfigError, match=r"algorithm.global_batch_size=12: must divide the batch of 32"):
        check_batch_sizes(32, 2, 12, 2)
    with pytest.raises(ConfigError, match=r"algorithm.micro_batch_size=3: micro_batch_size\*num_actor_ranks = 3\*2 = 6 "
                                          r"must divide algorithm.global_batch_size=16"):
        check_batch_sizes(32, 2, 16, 3)
    with pytest.raises(ConfigError, match="algorithm.num_actor_ranks"):
        check_batch_sizes(32, 0, 16, 4)
    # defaults: global = batch / num_minibatches (the single-process minibatch), micro = global / ranks
    cfg = replace_key(_cfg(), "algorithm.micro_batch_size", None)
    assert batch_plan(cfg) == check_batch_sizes(32, 1, 16, 16)
    assert batch_plan(cfg, num_ranks=4).grad_accum == 1


def test_stale_or_inconsistent_group_raises():
    st = RankState(rank=0, world_size=2, master_addr="127.0.0.1", master_port=1234, generation=3,
                   device=torch.device("cpu"))
    resident.put("stale/actor_group", st)
    try:
        spec = {"rank": 0, "world_size": 2, "master_addr": "127.0.0.1", "master_port": 1234}
        with pytest.raises(RuntimeError, match="generation 2 is older"):
            _join(_cfg(), "stale", {**spec, "generation": 2}, {}, (O, D))
        with pytest.raises(ValueError, match="bump the generation"):
            _join(_cfg(), "stale", {**spec, "master_port": 999, "generation": 3}, {}, (O, D))
        assert _join(_cfg(), "stale", {**spec, "generation": 3}, {}, (O, D)) == (st, False)
    finally:
        resident._RESIDENT.pop("stale/actor_group", None)


def test_one_rank_micro_batches_accumulate_to_the_same_update():
    """`algorithm.micro_batch_size` on one rank splits each optimizer step's G = 16 samples into micro-batches of 4
    with the gradients accumulated (a memory lever): the parameters after two updates equal the unsplit update's
    (float summation order only), and a size that does not divide G runs at their gcd (never more samples)."""
    from tasks.actor import entries
    from tasks.actor.loop import one_rank_plan
    split, whole = _cfg(), replace_key(_cfg(), "algorithm.micro_batch_size", None)
    assert (one_rank_plan(split, 32).grad_accum, one_rank_plan(whole, 32).grad_accum) == (4, 1)
    assert one_rank_plan(replace_key(_cfg(), "algorithm.micro_batch_size", 6), 32).micro_batch_size == 2
    samples = [_shard(0), _shard(1)]
    got = {}
    for name, cfg in (("split", split), ("whole", whole)):
        weights = _initial_weights(cfg)
        for _ in range(2):
            weights = entries.actor_update(cfg, f"mb-{name}", weights, *samples)
        resident.release(f"mb-{name}/")
        got[name] = weights["state_dict"]
    init = _initial_weights(whole)["state_dict"]
    assert not torch.allclose(got["whole"]["actor_mean.0.weight"], init["actor_mean.0.weight"])
    for k in got["whole"]:
        torch.testing.assert_close(got["split"][k], got["whole"][k], atol=1e-5, rtol=1e-5)
