"""THE actor state format (tasks.actor.state): weights, FQN-keyed optimizer and RNG on
torch.distributed.checkpoint.state_dict. One process here (the 2-rank round trips: tests/tasks/
test_distributed_integrity.py, the resume tests); what a checkpoint holds must rebuild the actor exactly."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from storage.checkpoints import load_checkpoint, save_checkpoint
from tasks.actor.state import (STATE_KEYS, actor_state_dict, load_model_state, load_optimizer_state, model_state,
                               optimizer_state, rng_state, set_rng_state)


def _model_and_opt(seed: int = 0, steps: int = 2):
    """A 2-layer net; Adam with two param groups (the second layer at another lr); `steps` Adam steps."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    opt = torch.optim.Adam([{"params": list(model[0].parameters()), "lr": 1e-2},
                            {"params": list(model[2].parameters()), "lr": 5e-3}], eps=1e-5)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(8, 3)).pow(2).mean().backward()
        opt.step()
    return model, opt


def test_the_state_is_keyed_by_parameter_name_and_rebuilds_the_next_step_exactly(tmp_path):
    """Save after 2 steps, load into a fresh model + optimizer, take one more step on the same batch: parameters
    and every Adam moment equal the uninterrupted run's bit for bit (the state survives save_checkpoint too)."""
    model, opt = _model_and_opt()
    state = actor_state_dict(model, opt, version=2)
    assert set(state) == set(STATE_KEYS)
    names = [n for n, _ in model.named_parameters()]
    assert set(state["optimizer"]["state"]) == set(names)  # FQN keys, not positions
    assert [g["params"] for g in state["optimizer"]["param_groups"]] == [names[:2], names[2:]]
    back = load_checkpoint(save_checkpoint(tmp_path, 2, state))
    fresh, fresh_opt = _model_and_opt(seed=1, steps=0)
    load_model_state(fresh, back["policy"])
    load_optimizer_state(fresh, fresh_opt, back["optimizer"])
    x = torch.randn(8, 3)
    for m, o in ((model, opt), (fresh, fresh_opt)):
        o.zero_grad()
        m(x).pow(2).mean().backward()
        o.step()
    for (n, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), n
    a, b = optimizer_state(model, opt), optimizer_state(fresh, fresh_opt)
    assert a["param_groups"] == b["param_groups"]
    for n in a["state"]:
        for k in a["state"][n]:
            assert torch.equal(torch.as_tensor(a["state"][n][k]), torch.as_tensor(b["state"][n][k])), (n, k)


def test_saving_an_optimizer_without_state_adds_none():
    """torch's helper steps an empty optimizer once to make its state; saving must not leave that behind, in the
    saved dict or in the live optimizer (a resumed run would start Adam at step 1 instead of 0)."""
    model, opt = _model_and_opt(steps=0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    saved = optimizer_state(model, opt)
    assert saved["state"] == {} and not any(opt.state[p] for p in model.parameters())
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_model_state_is_a_copy():
    model, _ = _model_and_opt(steps=0)
    sd = model_state(model)
    with torch.no_grad():
        model[0].weight.add_(1.0)
    assert not torch.equal(sd["0.weight"], model[0].weight)


@pytest.mark.parametrize("bad", ["integer ids", "another layout"])
def test_an_optimizer_state_of_another_format_or_layout_is_refused(bad):
    model, opt = _model_and_opt()
    if bad == "integer ids":
        state, match = opt.state_dict(), r"not keyed by parameter name.*python -m pipelines.upgrade"
    else:
        state, match = optimizer_state(model, opt), "param_groups name other parameters"
        state["param_groups"][0]["params"] = state["param_groups"][0]["params"][1:]
    fresh, fresh_opt = _model_and_opt(steps=0)
    with pytest.raises(ValueError, match=match):
        load_optimizer_state(fresh, fresh_opt, state)


def test_rng_state_restores_torch_numpy_and_python_draws(tmp_path):
    torch.manual_seed(3), np.random.seed(4), random.seed(5)
    torch.rand(3), np.random.randn(3), np.random.normal(), random.random()  # has_gauss set by normal()
    saved = load_checkpoint(save_checkpoint(tmp_path, 1, {"rng": rng_state()}))["rng"]
    first = (torch.rand(4), np.random.randn(4), random.random())
    torch.manual_seed(99), np.random.seed(99), random.seed(99)
    set_rng_state(saved)
    again = (torch.rand(4), np.random.randn(4), random.random())
    assert torch.equal(first[0], again[0]) and np.array_equal(first[1], again[1]) and first[2] == again[2]


def test_a_torch_only_rng_state_restores_torch_and_leaves_the_other_streams():
    """What `pipelines.upgrade` makes of an older checkpoint's `rng_torch`: {"torch": ...} alone."""
    torch.manual_seed(3)
    saved = {"torch": torch.get_rng_state()}
    first = torch.rand(4)
    np.random.seed(7)
    expect_np = np.random.rand(2)
    np.random.seed(7)
    torch.manual_seed(99)
    set_rng_state(saved)
    assert torch.equal(torch.rand(4), first) and np.array_equal(np.random.rand(2), expect_np)
