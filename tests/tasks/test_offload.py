"""Offload/onload mechanics (tasks.offload): parameters, gradients and Adam's state move between devices in place,
the optimizer keeps working on the moved tensors, and the byte accounting is exact. CPU -> CPU on any machine;
the CUDA tests check that torch.cuda.memory_allocated drops and that every value comes back.

Every test runs for a small MLP and for the flow family's transformers policies (tasks.policies.pi0, tiny presets
built from their configs: pi0 with rank-4 LoRA adapters and with full fine-tuning, pi05 with LoRA), trained by the
actor's own optimizer (`make_optimizer`) on the policy's flow-matching and value losses: frozen base weights, peft
modules, parameters without a gradient (adapters the loss does not reach) and buffers all move with the rest."""
from __future__ import annotations

import copy

import pytest
import torch

from tasks import offload

KINDS = ["mlp", "pi0_lora", "pi0_full", "pi05_lora"]
CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                       reason="needs CUDA")])


def _mlp(device):
    model = torch.nn.Sequential(torch.nn.Linear(4, 32), torch.nn.Tanh(), torch.nn.Linear(32, 2)).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x = torch.randn(16, 4, device=device)
    return model, opt, lambda m: m(x).pow(2).mean()


def _vla(kind, device):
    """A tiny pi0 / pi05 policy (the family's config at preset tiny, C=5, K=4; LoRA rank 4 or full fine-tuning;
    built from the schema, no Hydra: the GPU machine runs this file without it), the actor's optimizer, and its
    loss on a batch of 2 PushCube-sized observations (flow-matching SFT loss + a value loss)."""
    from tasks.actor.optim import make_optimizer
    from tasks.config import Config, family_class
    from tasks.device import to_device
    from tasks.policies import make_policy
    family, mode = kind.split("_")
    cfg = Config(policy=family_class("policy", family)(preset="tiny", num_action_chunks=5, num_denoise_steps=4,
                                                        lora_rank=4 if mode == "lora" else 0))
    pol = make_policy(cfg.policy, obs_dim=9, action_dim=7, num_values=1, image_size=32, load=False).to(device)
    opt = make_optimizer(cfg, pol)
    obs = to_device({"state": torch.randn(2, 9), "rgb": torch.randint(0, 256, (2, 32, 32, 3), dtype=torch.uint8),
                     "prompt": pol.tokenize(["push the cube", "push the cube"])}, torch.device(device))
    actions = torch.randn(2, cfg.policy.num_action_chunks, 7, device=device)
    return pol, opt, lambda m: m.sft_loss(obs, actions) + m.values(obs).pow(2).mean()


def _stepper(model, opt, loss):
    def step():
        opt.zero_grad()
        loss(model).backward()
        opt.step()
    return step


_TRAINED: dict = {}  # (device, kind) -> what two training steps left: state dict, gradients, optimizer state


def _trained(device="cpu", kind="mlp"):
    """(model, optimizer, step): two optimizer steps taken; `step()` takes one more. A fresh model per call (tests
    move and change it) that gets the state of one trained once per session (one thread: the tiny VLAs are as fast,
    and a shared machine does not stall them)."""
    torch.manual_seed(0)
    model, opt, loss = _mlp(device) if kind == "mlp" else _vla(kind, device)
    step = _stepper(model, opt, loss)
    if (device, kind) not in _TRAINED:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            for _ in range(2):
                step()
        finally:
            torch.set_num_threads(threads)
        _TRAINED[(device, kind)] = ({k: v.detach().clone() for k, v in model.state_dict().items()},
                                    [None if p.grad is None else p.grad.clone() for p in model.parameters()],
                                    copy.deepcopy(opt.state_dict()))
        return model, opt, step
    state, grads, opt_state = _TRAINED[(device, kind)]
    model.load_state_dict(state)
    for p, g in zip(model.parameters(), grads):
        p.grad = None if g is None else g.clone()
    opt.load_state_dict(copy.deepcopy(opt_state))
    return model, opt, step


def _param_bytes(model):
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _grad_bytes(model):
    """Bytes of the parameters that got a gradient: Adam keeps exp_avg and exp_avg_sq of their shape for exactly
    those (frozen parameters and adapters no loss reaches have neither)."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.grad is not None)


def _buffer_bytes(model):
    return sum(b.numel() * b.element_size() for b in model.buffers())


def _snapshot(model, opt) -> dict:
    """CPU copies of what an offload moves, by name: the state dict (parameters and persistent buffers), the
    gradients, Adam's per-parameter state."""
    names = {p: n for n, p in model.named_parameters()}
    return {"state": {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()},
            "grad": {n: p.grad.to("cpu", copy=True) for n, p in model.named_parameters() if p.grad is not None},
            "opt": {names[p]: {k: v.to("cpu", copy=True) for k, v in s.items()} for p, s in opt.state.items()}}


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(_equal(a[k], b[k]) if isinstance(a[k], dict) else torch.equal(a[k], b[k])
                                        for k in a)


@pytest.mark.parametrize("kind", KINDS)
def test_device_bytes_count_parameters_gradients_and_adam_state(kind):
    model, opt, _ = _trained(kind=kind)
    P, G, B = _param_bytes(model), _grad_bytes(model), _buffer_bytes(model)
    if kind == "mlp":
        assert P == G == 4 * 226 and B == 0  # 4*32+32 + 32*2+2 = 226 floats, all trained
    else:  # frozen parameters (the LoRA base, pi0's unused expert embedding) get no gradient
        assert all(p.grad is None for p in model.parameters() if not p.requires_grad) and 0 < G < P
    steps = sum(s["step"].numel() * s["step"].element_size() for s in opt.state.values())  # CPU scalar steps
    assert len(opt.state) == len([p for p in model.parameters() if p.grad is not None])
    # params + buffers + grads + exp_avg + exp_avg_sq (+ Adam's step counters)
    assert offload.device_bytes(model, opt, "cpu") == P + B + 3 * G + steps
    assert offload.device_bytes(model, None, "cpu") == P + B + G
    assert offload.device_bytes(model, opt, "meta") == 0


@pytest.mark.parametrize("kind", KINDS)
def test_cpu_to_cpu_moves_are_no_ops_that_keep_training(kind):
    model, opt, step = _trained(kind=kind)
    ids = {id(p) for p in model.parameters()}
    state_ids = {k: id(v) for s in opt.state.values() for k, v in s.items()}
    assert offload.move_module(model, "cpu") == 0
    assert offload.move_optimizer_state(opt, "cpu") == 0
    assert {id(p) for p in model.parameters()} == ids  # same Parameter objects: the optimizer still owns them
    assert {k: id(v) for s in opt.state.values() for k, v in s.items()} == state_ids
    res = offload.offload(model, opt, "cpu")
    assert res["device_mb_before"] == res["device_mb_after"] > 0 and res["seconds"] >= 0
    assert "cuda_allocated_mb_before" not in res
    before = [p.detach().clone() for p in model.parameters()]
    step()  # the optimizer state it stepped with is the one it had: training continues
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))


@pytest.mark.parametrize("kind", KINDS)
def test_moves_replace_the_state_tensors_on_the_target_device(kind):
    """To the meta device (exists everywhere, holds no memory): every param, grad, buffer and Adam moment is
    replaced, Adam's CPU scalar step counters stay on the CPU, and the byte counts match."""
    model, opt, _ = _trained(kind=kind)
    P, G, B = _param_bytes(model), _grad_bytes(model), _buffer_bytes(model)
    assert offload.move_optimizer_state(opt, "meta") == 2 * G  # exp_avg + exp_avg_sq; steps stay
    for s in opt.state.values():
        assert s["exp_avg"].device.type == "meta" and s["exp_avg_sq"].device.type == "meta"
        assert s["step"].device.type == "cpu"
    assert offload.move_module(model, "meta") == P + G + B  # params + grads + buffers
    assert offload.module_device(model).type == "meta"
    assert all(p.grad.device.type == "meta" for p in model.parameters() if p.grad is not None)
    assert all(b.device.type == "meta" for b in model.buffers())
    assert offload.device_bytes(model, opt, "cpu") == sum(s["step"].numel() * 4 for s in opt.state.values())


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("kind", KINDS)
def test_offload_then_onload_gives_back_every_value_and_training_continues(kind, device):
    """Offload to CPU memory and onload back to the compute device: the state dict, the gradients and Adam's state
    equal, bit for bit, copies taken before the offload (CPU: the moves are no-ops; CUDA: real copies); the same
    Parameter objects stay in the optimizer, so the next step trains the parameters it trained before and leaves the
    frozen ones as they were."""
    model, opt, step = _trained(device, kind)
    before, ids = _snapshot(model, opt), [id(p) for p in model.parameters()]
    res = offload.offload(model, opt, device)
    assert offload.module_device(model).type == "cpu" and _equal(_snapshot(model, opt), before)
    assert all(v.device.type == "cpu" for s in opt.state.values() for v in s.values())
    if device == "cuda":
        assert res["device_mb_after"] == 0.0 and res["device_mb_before"] > 0.0
    offload.onload(model, opt, device)
    assert offload.module_device(model).type == device and _equal(_snapshot(model, opt), before)
    assert [id(p) for p in model.parameters()] == ids
    stepped = {n for n, p in model.named_parameters() if p.grad is not None}
    step()
    after = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    assert any(not torch.equal(after[n], before["state"][n]) for n in stepped if n in after)
    assert all(torch.equal(after[n], before["state"][n]) for n, p in model.named_parameters()
               if not p.requires_grad and n in after)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", KINDS)
def test_offload_frees_cuda_memory_and_onload_restores_training(kind):
    model, opt, step = _trained("cuda", kind)
    torch.cuda.synchronize()
    res = offload.offload(model, opt, "cuda")
    P, G, B = _param_bytes(model), _grad_bytes(model), _buffer_bytes(model)
    assert res["device_mb_before"] * 1e6 >= P + B + 3 * G and res["device_mb_after"] == 0.0
    assert res["cuda_allocated_mb_before"] - res["cuda_allocated_mb_after"] >= (P + B + 3 * G) / 1e6 * 0.99
    assert offload.module_device(model).type == "cpu"
    assert all(v.device.type == "cpu" for s in opt.state.values() for v in s.values())
    s = offload.onload(model, opt, "cuda")
    assert s >= 0 and offload.module_device(model).type == "cuda"
    assert all(v.device.type == "cuda" for st in opt.state.values() for k, v in st.items() if k != "step")
    step()
