"""Offload/onload mechanics (tasks.offload): parameters, gradients and Adam's state move between devices in place,
the optimizer keeps working on the moved tensors, and the byte accounting is exact. CPU -> CPU on any machine;
the CUDA test checks that torch.cuda.memory_allocated drops."""
from __future__ import annotations

import pytest
import torch

from tasks import offload


def _trained(device="cpu"):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 32), torch.nn.Tanh(), torch.nn.Linear(32, 2)).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x = torch.randn(16, 4, device=device)
    for _ in range(2):
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
    return model, opt, x


def _param_bytes(model):
    return sum(p.numel() * p.element_size() for p in model.parameters())


def test_device_bytes_count_parameters_gradients_and_adam_state():
    model, opt, _ = _trained()
    P = _param_bytes(model)  # 4*32+32 + 32*2+2 = 226 floats
    assert P == 4 * 226
    steps = sum(s["step"].numel() * s["step"].element_size() for s in opt.state.values())  # CPU scalar steps
    # params + grads + exp_avg + exp_avg_sq (+ Adam's step counters)
    assert offload.device_bytes(model, opt, "cpu") == 4 * P + steps
    assert offload.device_bytes(model, None, "cpu") == 2 * P
    assert offload.device_bytes(model, opt, "meta") == 0


def test_cpu_to_cpu_moves_are_no_ops_that_keep_training():
    model, opt, x = _trained()
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
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    opt.step()  # the optimizer state it stepped with is the one it had: training continues
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_moves_replace_the_state_tensors_on_the_target_device():
    """To the meta device (exists everywhere, holds no memory): every param, grad and Adam moment is replaced,
    Adam's CPU scalar step counters stay on the CPU, and the byte counts match."""
    model, opt, _ = _trained()
    P = _param_bytes(model)
    assert offload.move_optimizer_state(opt, "meta") == 2 * P  # exp_avg + exp_avg_sq; steps stay
    for s in opt.state.values():
        assert s["exp_avg"].device.type == "meta" and s["exp_avg_sq"].device.type == "meta"
        assert s["step"].device.type == "cpu"
    assert offload.move_module(model, "meta") == 2 * P  # params + grads
    assert offload.module_device(model).type == "meta"
    assert all(p.grad.device.type == "meta" for p in model.parameters())
    assert offload.device_bytes(model, opt, "cpu") == sum(s["step"].numel() * 4 for s in opt.state.values())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_offload_frees_cuda_memory_and_onload_restores_training():
    model, opt, x = _trained("cuda")
    torch.cuda.synchronize()
    res = offload.offload(model, opt, "cuda")
    P = _param_bytes(model)
    assert res["device_mb_before"] * 1e6 >= 4 * P and res["device_mb_after"] == 0.0
    assert res["cuda_allocated_mb_before"] - res["cuda_allocated_mb_after"] >= 4 * P / 1e6 * 0.99
    assert offload.module_device(model).type == "cpu"
    assert all(v.device.type == "cpu" for s in opt.state.values() for v in s.values())
    s = offload.onload(model, opt, "cuda")
    assert s >= 0 and offload.module_device(model).type == "cuda"
    assert all(v.device.type == "cuda" for st in opt.state.values() for k, v in st.items() if k != "step")
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    opt.step()
