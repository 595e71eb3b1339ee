"""algorithm.ema_decay: the actor's exponential moving average of its weights (tasks.actor.actor.ema_step), what evals,
checkpoints and exports use, and that training itself is unchanged by it."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from storage.checkpoints import load_checkpoint, played_policy_key, save_checkpoint
from tasks.actor.actor import Actor, ema_start, ema_step
from tasks.actor.entries import actor_export, actor_eval_weights


def _cfg(decay: float):
    return SimpleNamespace(algorithm=SimpleNamespace(ema_decay=decay))


def _actor(seed: int = 0) -> Actor:
    torch.manual_seed(seed)
    policy = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))
    return Actor(policy, torch.optim.SGD(policy.parameters(), lr=0.1))


def _fake_update(actor: Actor, g: torch.Generator) -> None:
    """Move every parameter but the last layer's bias (a frozen one), and the BatchNorm step counter."""
    with torch.no_grad():
        for name, p in actor.policy.named_parameters():
            if name != "2.bias":
                p.add_(torch.randn(p.shape, generator=g))
        actor.policy[1].num_batches_tracked += 3
    actor.version += 1


def test_the_average_follows_the_recurrence_from_the_initial_weights():
    """ema_0 = w_0, ema_k = d ema_{k-1} + (1 - d) w_k (float64 loop): floating entries averaged, a frozen
    parameter kept bit for bit, the integer step counter copied."""
    d, actor, g = 0.75, _actor(), torch.Generator().manual_seed(5)
    ema_start(_cfg(d), actor)
    expected = {k: v.double().clone() for k, v in actor.policy.state_dict().items()}
    for _ in range(6):
        _fake_update(actor, g)
        ema_step(actor, d)
        for k, v in actor.policy.state_dict().items():
            expected[k] = d * expected[k] + (1 - d) * v.double() if v.is_floating_point() else v.double()
    for k, v in actor.ema.items():
        assert v.dtype == actor.policy.state_dict()[k].dtype
        torch.testing.assert_close(v.double(), expected[k], rtol=0, atol=1e-6)
    assert torch.equal(actor.ema["2.bias"], actor.policy.state_dict()["2.bias"])
    assert int(actor.ema["1.num_batches_tracked"]) == 18
    assert not torch.allclose(actor.ema["0.weight"], actor.policy.state_dict()["0.weight"])


def test_eval_weights_are_the_average_under_their_own_version():
    actor, g = _actor(), torch.Generator().manual_seed(1)
    assert actor.eval_weights()["version"] == 0  # no average: the trained weights
    ema_start(_cfg(0.5), actor)
    _fake_update(actor, g)
    ema_step(actor, 0.5)
    w = actor.eval_weights()
    assert w["version"] == "ema:1" and actor.weights()["version"] == 1  # a replica holding one reloads the other
    assert all(torch.equal(w["state_dict"][k], actor.ema[k]) for k in actor.ema)
    w["state_dict"]["0.weight"].zero_()  # a copy: an eval never edits the average
    assert not torch.equal(actor.ema["0.weight"], w["state_dict"]["0.weight"])


def test_decay_zero_keeps_no_average():
    actor = _actor()
    ema_start(_cfg(0.0), actor)
    assert actor.ema is None
    ema_step(actor, 0.0)  # no-op
    assert actor.ema is None and actor.eval_weights()["version"] == 0


def test_eval_weights_without_the_actor_name_the_loss():
    from tasks.actor.actor import ActorMissing
    with pytest.raises(ActorMissing):
        actor_eval_weights("no-such-run-ema", {"version": 0})


def test_played_policy_key(tmp_path):
    sd = {"w": torch.ones(2)}
    plain = save_checkpoint(tmp_path / "a", 1, {"policy": sd})
    avg = save_checkpoint(tmp_path / "b", 1, {"policy": sd, "policy_ema": {"w": torch.zeros(2)}})
    assert played_policy_key(plain) == "policy" and played_policy_key(avg) == "policy_ema"
    assert played_policy_key(tmp_path / "missing") == "policy"  # loading then names what is wrong
    assert torch.equal(load_checkpoint(avg, keys=(played_policy_key(avg),))["policy_ema"]["w"], torch.zeros(2))


def test_the_export_of_a_vla_is_its_average(tmp_path):
    """actor_export writes the averaged weights (what the evals scored); the actor's own weights stay."""
    from tasks import resident
    from tasks.config import family_class
    from tasks.policies import make_policy
    policy = make_policy(family_class("policy", "pi0")(num_action_chunks=2, num_denoise_steps=2, max_prompt_len=8),
                         obs_dim=5, action_dim=3, seed=0, image_size=32)
    actor = Actor(policy, torch.optim.SGD(policy.parameters(), lr=0.1))
    ema_start(_cfg(0.9), actor)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(1.0)
    ema_step(actor, 0.9)
    trained = {k: v.clone() for k, v in policy.state_dict().items()}
    resident.put("ema-export/actor", actor)
    try:
        out = actor_export("ema-export", str(tmp_path))
    finally:
        resident.release("ema-export/")
    loaded = type(policy).from_pretrained(out).state_dict()
    for k, v in actor.ema.items():
        assert torch.equal(loaded[k], v), k
    assert any(not torch.equal(loaded[k], trained[k]) for k in trained)
    assert all(torch.equal(policy.state_dict()[k], trained[k]) for k in trained)


@pytest.mark.parametrize("decay,key,words", [
    (-0.1, "algorithm.ema_decay", "[0, 1)"),
    (1.0, "algorithm.ema_decay", "[0, 1)"),
])
def test_bad_decay_names_the_key(decay, key, words):
    from pipelines.config import load_config
    from tasks.config import ConfigError
    with pytest.raises(ConfigError) as err:
        load_config([f"algorithm.ema_decay={decay}"], components=False)
    assert str(err.value).startswith(key + "=") and words in str(err.value)


def test_asynchronous_steps_refuse_an_average():
    from pipelines.config import load_config
    from tasks.config import ConfigError
    with pytest.raises(ConfigError) as err:
        load_config(["algorithm.ema_decay=0.9", "runner.max_staleness=1"], components=False)
    assert str(err.value).startswith("algorithm.ema_decay=") and "runner.max_staleness=0" in str(err.value)


def test_many_ranks_refuse_an_average():
    from tasks.config import AlgorithmConfig, ConfigError
    from tasks.config.checks import check_algorithm
    with pytest.raises(ConfigError) as err:
        check_algorithm(AlgorithmConfig(ema_decay=0.9, num_actor_ranks=2))
    assert "algorithm.num_actor_ranks=1" in str(err.value)


def test_smoke_runs_with_and_without_an_average(tmp_path, capsys):
    """Two conf=smoke runs, the same seeds, algorithm.ema_decay 0.5 and 0, checkpoints at every step: the trained
    weights are identical at every step (the average changes no training); each checkpoint's `policy_ema` is the
    recurrence from the previous one; the step-0 evals are the same episodes (the average starts at the initial
    weights), later evals play the average (pipelines.eval of the last checkpoint, which loads `policy_ema`,
    reproduces the run's own last eval)."""
    from pipelines.eval import main as eval_main
    from pipelines.run import main
    from tasks.evalstats import read_evals
    runs = {}
    for d in (0.5, 0.0):
        root = tmp_path / f"d{d}"
        assert main(["conf=smoke", f"run_root={root}", "runner.val_at_start=true", "runner.val_check_interval=3",
                     "runner.save_interval=1", "runner.keep_checkpoints=3", f"algorithm.ema_decay={d}"]) == 0
        runs[d] = next(p for p in (root / "smoke").iterdir() if p.is_dir())
    ck = {d: {s: load_checkpoint(r / "checkpoints" / f"global_step_{s}") for s in (1, 2, 3)} for d, r in runs.items()}
    for s in (1, 2, 3):
        assert "policy_ema" not in ck[0.0][s]
        for k, v in ck[0.0][s]["policy"].items():
            assert torch.equal(ck[0.5][s]["policy"][k], v), (s, k)
    for s in (2, 3):
        for k, v in ck[0.5][s]["policy_ema"].items():
            if v.is_floating_point():
                want = 0.5 * ck[0.5][s - 1]["policy_ema"][k] + 0.5 * ck[0.5][s]["policy"][k]
                torch.testing.assert_close(v, want, rtol=0, atol=1e-6)
    ev = {d: read_evals(r) for d, r in runs.items()}
    assert ev[0.5][0]["episodes"] == ev[0.0][0]["episodes"]
    returns = {d: [e["return"] for e in ev[d][3]["episodes"].values()] for d in ev}
    assert returns[0.5] != returns[0.0]
    capsys.readouterr()
    out = tmp_path / "external"
    assert eval_main([str(runs[0.5] / "checkpoints" / "global_step_3"), f"run_root={tmp_path / 'd0.5'}",
                      "--out", str(out)]) == 0
    rec = json.loads((out / "eval.json").read_text())["episodes"]
    own = ev[0.5][3]["episodes"]
    assert list(rec) == list(own)
    for seed, o in own.items():
        assert (rec[seed]["success_once"], rec[seed]["episode_len"]) == (o["success_once"], o["episode_len"])
        assert rec[seed]["return"] == pytest.approx(o["return"], abs=1e-6)


def test_a_checkpoint_restores_the_average_and_an_old_one_starts_it():
    """actor_state carries `policy_ema`; actor_init from that state continues the very average (a resume); from a
    checkpoint without one (written with ema_decay 0) the average starts at the checkpoint's weights."""
    from pipelines.config import load_config
    from tasks import resident
    from tasks.actor.entries import actor_init, actor_state
    cfg = load_config(["conf=smoke", "algorithm.ema_decay=0.5"], components=False)[0]
    dims = (7, 3)
    try:
        actor_init(cfg, "ema-a", dims)
        a = resident.get("ema-a/actor")
        _fake_update_params(a)
        ema_step(a, 0.5)
        state = actor_state("ema-a")
        assert set(state["policy_ema"]) == set(state["policy"])
        ckpt = {**state, "run": {"weight_version": state["weight_version"]}}
        actor_init(cfg, "ema-b", dims, ckpt)
        b = resident.get("ema-b/actor")
        assert all(torch.equal(b.ema[k], a.ema[k]) for k in a.ema)
        assert any(not torch.equal(b.ema[k], state["policy"][k]) for k in a.ema)
        old = {k: v for k, v in ckpt.items() if k != "policy_ema"}
        actor_init(cfg, "ema-c", dims, old)
        c = resident.get("ema-c/actor")
        assert all(torch.equal(c.ema[k], state["policy"][k]) for k in state["policy"])
    finally:
        for r in ("ema-a", "ema-b", "ema-c"):
            resident.release(f"{r}/")


def _fake_update_params(actor: Actor) -> None:
    with torch.no_grad():
        for p in actor.policy.parameters():
            p.add_(0.5)
    actor.version += 1
