"""Adapter-only weight sync of the pi0 families (tasks.weights' partial weights, `Actor.sync_weights`,
`tasks.rollout.get_replica`) on a real in-process Dask cluster, and the frozen unused expert embedding of pi0
(tasks.policies.pi0.lora.UNUSED).

The actor lives on worker a (`actor_init` under its own key, the base of partial weights, as pipelines.graphs builds
it); an "update" there changes every trainable tensor; the replica on worker b receives handles only. After every
sync the replica's state dict must equal the actor's full one, tensor for tensor, and the bytes it loaded must be the
trainable tensors' (plus the base once per replica)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("peft")
pytest.importorskip("transformers")

from distributed import Client, LocalCluster  # noqa: E402

from tasks import resident, rollout  # noqa: E402
from tasks.actor.actor import resident_actor  # noqa: E402
from tasks.actor.entries import actor_init  # noqa: E402
from tasks.policies.pi0 import lora  # noqa: E402
from tasks.weights import KeyName, handle, state_dict_nbytes  # noqa: E402

O, D = 9, 7  # state and action dims (any: the tiny preset pads to its max dims)


def _cfg(family: str, *extra: str):
    from pipelines.config import load_config
    cfg, _ = load_config(["conf=smoke", "env=pushcube_vla", f"policy={family}_tiny", "env.image_size=32", *extra])
    return cfg


def _update(run: str, seed: int) -> dict:
    """On the actor's worker: an update that changes every trainable tensor (frozen ones cannot change), then what
    `actor_update` hands out (`Actor.sync_weights`)."""
    actor = resident_actor(run)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in actor.policy.parameters():
            if p.requires_grad:
                p.add_(0.01 * torch.randn(p.shape, generator=g))
    actor.version += 1
    return actor.sync_weights()


def _actor_full(run: str) -> dict:
    return resident_actor(run).weights()["state_dict"]


def _replica(cfg, run: str, h: dict) -> dict:
    rep = rollout.get_replica(cfg, run, h, O, D)
    return {"state": {k: v.detach().clone() for k, v in rep.module.state_dict().items()},
            "sync": rep.last_sync, "base_key": rep.base_key, "version": rep.version}


def _release(run: str) -> None:
    resident.release(f"{run}/policy")


@pytest.fixture(scope="module")
def client():
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=False,
                      dashboard_address="127.0.0.1:0") as cluster, Client(cluster) as c:
        yield c


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.cluster  # an in-process LocalCluster (two workers, ~10 s with both families)
@pytest.mark.parametrize("family", ["pi0", "pi05"])
def test_lora_replica_equals_the_actor_after_each_sync_and_loads_only_the_adapters(client, family):
    a, b = sorted(client.scheduler_info()["workers"])
    cfg = _cfg(family, "policy.lora_rank=4")
    run = f"20260101-000000-ps{family}"
    init_key = f"actor_init-{run}"
    w0 = client.submit(actor_init, cfg, run, (O, D), None, KeyName(init_key), workers=[a], key=init_key)
    h0 = client.submit(handle, w0, KeyName(w0.key), workers=[a], key=f"weights_handle-{run}-0")
    full_bytes = state_dict_nbytes(w0.result()["state_dict"])
    first = client.submit(_replica, cfg, run, h0, workers=[b], key=f"env_step-{run}-0").result()
    assert first["sync"]["bytes"] == full_bytes and first["base_key"] == init_key
    assert _equal(first["state"], client.submit(_actor_full, run, workers=[a], pure=False).result())
    for v in (1, 2):
        u = client.submit(_update, run, v, workers=[a], key=f"actor_update-{run}-{v}")
        out = u.result()
        assert out["partial"] and out["base_key"] == init_key and out["version"] == v
        trainable = set(lora.trainable_names(_local_policy(cfg)))
        assert set(out["state_dict"]) == trainable  # adapters and heads: no base weight, no buffer
        assert all(lora.is_adapter(k) or not k.startswith("hf.") for k in trainable)
        h = client.submit(handle, u, KeyName(u.key), workers=[a], key=f"update_handle-{run}-{v}")
        got = client.submit(_replica, cfg, run, h, workers=[b], key=f"env_step-{run}-{v}").result()
        actor = client.submit(_actor_full, run, workers=[a], pure=False).result()
        assert got["version"] == v and _equal(got["state"], actor)  # base + newest adapters = the actor's weights
        assert got["sync"]["bytes"] == state_dict_nbytes(out["state_dict"]) < full_bytes / 5
    # a replica that never held the base (a new worker, a released replica) loads it once, then the adapters
    client.submit(_release, run, workers=[b], pure=False).result()
    fresh = client.submit(_replica, cfg, run, h, workers=[b], key=f"eval-{run}-2").result()
    assert fresh["sync"]["bytes"] == full_bytes + state_dict_nbytes(out["state_dict"])
    assert _equal(fresh["state"], actor)
    client.submit(resident.release, "", workers=[a], pure=False).result()
    client.submit(resident.release, "", workers=[b], pure=False).result()


def _local_policy(cfg):
    from tasks.policies import make_policy
    return make_policy(cfg.policy, obs_dim=O, action_dim=D, num_values=1, image_size=32, load=False)


def test_without_frozen_parameters_the_update_ships_full_weights():
    """pi05 without LoRA or freeze list trains every parameter: `sync_state` is None and the weights are full."""
    pol = _local_policy(_cfg("pi05"))
    assert pol.sync_state() is None
    frozen = _local_policy(_cfg("pi05", "policy.freeze=[hf.model.vlm.vision_tower]"))
    part = frozen.sync_state()
    assert part and not any(k.startswith("hf.model.vlm.vision_tower.") for k in part)
    assert set(part) == {n for n, p in frozen.named_parameters() if p.requires_grad}


# ---------------------------------------------------------------- pi0's expert token embedding
def test_pi0_expert_token_embedding_is_never_used_and_frozen():
    """transformers' PI0 builds its action expert as a whole GemmaModel and calls it with `inputs_embeds`: its
    `model.dit.embed_tokens` is never called (a forward hook counts calls through act, evaluate, values, sft_loss)
    and gets no gradient even when made trainable; the family freezes it, so full fine-tuning neither trains nor
    syncs it (it stays in the state dict: checkpoints and exports keep the library's layout)."""
    pol = _local_policy(_cfg("pi0"))
    emb = pol.hf.model.dit.embed_tokens
    assert not emb.weight.requires_grad
    name = "hf.model.dit.embed_tokens.weight"
    assert name in pol.state_dict() and name not in pol.sync_state()
    assert all(p.requires_grad for n, p in pol.named_parameters() if n != name)  # nothing else frozen
    calls = []
    emb.register_forward_hook(lambda *a: calls.append(1))
    emb.weight.requires_grad_(True)
    g = torch.Generator().manual_seed(0)
    obs = {"state": torch.randn(2, O, generator=g),
           "rgb": torch.randint(0, 256, (2, 32, 32, 3), generator=g, dtype=torch.uint8),
           "prompt": pol.tokenize(["push the cube", "push the cube"])}
    out = pol.act(obs)
    ev = pol.evaluate(obs, out["actions"], out["extras"])
    loss = -ev["logprobs"].sum() + ev["values"].pow(2).mean() + pol.values(obs).sum()
    sft = pol.sft_loss(obs, out["actions"])
    (loss + sft).backward()
    assert calls == [] and emb.weight.grad is None
    assert any(p.grad is not None for n, p in pol.named_parameters() if n.startswith("hf.model.dit."))
    # the LoRA preset freezes it too (a base weight), and pi05's expert has no token embedding at all
    assert not hasattr(_local_policy(_cfg("pi05")).hf.model.dit, "embed_tokens")
