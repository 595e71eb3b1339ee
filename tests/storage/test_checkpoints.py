import json
import os
import random

import numpy as np
import pytest
import torch

from storage.checkpoints import (
    checkpoint_step,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    prune_checkpoints,
    save_checkpoint,
)
from storage.rundir import find_run_dir, new_run_dir, write_resolved_config


def _trained_state(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for _ in range(2):
        loss = model(torch.randn(16, 4)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    return model, opt, sched


def _state(step=3):
    model, opt, sched = _trained_state()
    return {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "scheduler": sched.state_dict(),
        "torch_rng": torch.get_rng_state(),
        "numpy_rng": np.random.default_rng(5).bit_generator.state,  # plain dict of ints -> meta.json
        "python_rng": random.Random(7).getstate(),  # tuple: not JSON round-trippable -> pickle
        "runner": {"global_step": step, "env_cursor": 12, "weight_version": 4},
    }


def test_round_trip_model_and_optimizer(tmp_path):
    state = _state()
    path = save_checkpoint(tmp_path, 3, state)
    assert path == tmp_path / "checkpoints" / "global_step_3"
    index = json.loads((path / "index.json").read_text())
    assert index["step"] == 3
    # StepLR's state dict holds no tensors and survives JSON exactly, so it goes to meta.json
    assert sorted(index["files"]) == ["meta.json", "model.pt", "optimizer.pt", "python_rng.pkl.pt",
                                      "torch_rng.pt"]
    assert index["keys"]["scheduler"]["kind"] == "json"
    for name, info in index["files"].items():
        assert (path / name).stat().st_size == info["size"] and len(info["sha256"]) == 64
    assert index["keys"]["runner"] == {"file": "meta.json", "kind": "json"}

    loaded = load_checkpoint(path)
    assert set(loaded) == set(state)
    model, opt, sched = _trained_state(seed=1)  # different weights, then restore
    model.load_state_dict(loaded["model"])
    opt.load_state_dict(loaded["optimizer"])
    sched.load_state_dict(loaded["scheduler"])
    for k, v in state["model"].items():
        assert torch.equal(model.state_dict()[k], v)
    for pid, s in state["optimizer"]["state"].items():
        for k, v in s.items():
            assert torch.equal(opt.state_dict()["state"][pid][k], v)
    assert opt.state_dict()["param_groups"] == state["optimizer"]["param_groups"]
    assert sched.state_dict() == state["scheduler"]
    assert torch.equal(loaded["torch_rng"], state["torch_rng"])
    assert loaded["numpy_rng"] == state["numpy_rng"]
    assert loaded["python_rng"] == state["python_rng"]
    random.Random().setstate(loaded["python_rng"])  # still a valid tuple
    assert loaded["runner"] == {"global_step": 3, "env_cursor": 12, "weight_version": 4}


def test_latest_ignores_tmp_and_incomplete_dirs(tmp_path):
    assert latest_checkpoint(tmp_path) is None
    save_checkpoint(tmp_path, 1, {"runner": {"step": 1}})
    save_checkpoint(tmp_path, 2, {"w": torch.ones(3)})
    ck = tmp_path / "checkpoints"
    # simulated crash mid-save of step 5: tmp dir with data but no index, never renamed
    crashed = ck / ".tmp-global_step_5-abc123"
    crashed.mkdir()
    torch.save({"w": torch.zeros(3)}, crashed / "w.pt")
    # a final-looking dir without index.json (e.g. copied by hand, interrupted)
    (ck / "global_step_9").mkdir()
    (ck / "global_step_9" / "w.pt").write_bytes(b"partial")
    assert latest_checkpoint(tmp_path) == ck / "global_step_2"
    assert [checkpoint_step(p) for p in list_checkpoints(tmp_path)] == [1, 2]


def test_atomic_replace_of_same_step(tmp_path):
    first = save_checkpoint(tmp_path, 4, {"w": torch.zeros(2), "runner": {"v": 1}})
    second = save_checkpoint(tmp_path, 4, {"w": torch.ones(2), "runner": {"v": 2}})
    assert first == second
    loaded = load_checkpoint(second)
    assert torch.equal(loaded["w"], torch.ones(2)) and loaded["runner"] == {"v": 2}
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["global_step_4"]


def test_failed_save_keeps_previous(tmp_path):
    save_checkpoint(tmp_path, 4, {"w": torch.zeros(2)})

    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        save_checkpoint(tmp_path, 4, {"w": torch.ones(2), "bad": Unpicklable()})
    assert torch.equal(load_checkpoint(latest_checkpoint(tmp_path))["w"], torch.zeros(2))
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["global_step_4"]


def test_corrupt_or_missing_file_raises(tmp_path):
    path = save_checkpoint(tmp_path, 1, _state())
    f = path / "optimizer.pt"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, different bytes
    f.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"optimizer\.pt is corrupt"):
        load_checkpoint(path)
    os.remove(f)
    with pytest.raises(ValueError, match=r"optimizer\.pt listed in index\.json is missing"):
        load_checkpoint(path)
    assert latest_checkpoint(tmp_path) is None  # incomplete now
    (path / "index.json").unlink()
    with pytest.raises(ValueError, match="index.json is missing"):
        load_checkpoint(path)


def test_prune_and_key_validation(tmp_path):
    for step in (10, 2, 30, 7):
        save_checkpoint(tmp_path, step, {"runner": {"step": step}})
    removed = prune_checkpoints(tmp_path, keep=2)
    assert [checkpoint_step(p) for p in removed] == [2, 7]
    assert [checkpoint_step(p) for p in list_checkpoints(tmp_path)] == [10, 30]
    assert load_checkpoint(latest_checkpoint(tmp_path)) == {"runner": {"step": 30}}
    with pytest.raises(ValueError, match="file-name-safe"):
        save_checkpoint(tmp_path, 1, {"../x": 1})
    with pytest.raises(ValueError, match="file-name-safe"):
        save_checkpoint(tmp_path, 1, {"index": 1})


def test_run_dirs(tmp_path):
    run = new_run_dir(tmp_path, "pickcube-ppo", "a1b2c3d4")
    assert run == tmp_path / "pickcube-ppo" / "a1b2c3d4" and run.is_dir()
    assert new_run_dir(tmp_path, "pickcube-ppo", "a1b2c3d4") == run  # resume reuses it
    new_run_dir(tmp_path, "other", "ffff0000")
    assert find_run_dir(tmp_path, "a1b2c3d4") == run
    with pytest.raises(FileNotFoundError, match=r"close matches: a1b2c3d4 \(pickcube-ppo\)"):
        find_run_dir(tmp_path, "a1b2c3")
    with pytest.raises(FileNotFoundError, match="close matches: none"):
        find_run_dir(tmp_path, "zzzz")
    new_run_dir(tmp_path, "other", "a1b2c3d4")
    with pytest.raises(ValueError, match="several experiments"):
        find_run_dir(tmp_path, "a1b2c3d4")
    for bad in ("a/b", "..", ""):
        with pytest.raises(ValueError, match="experiment"):
            new_run_dir(tmp_path, bad, "r1")
    cfg = write_resolved_config(run, "algo:\n  name: ppo\n")
    assert cfg == run / "config.yaml" and cfg.read_text() == "algo:\n  name: ppo\n"
    with pytest.raises(ValueError, match="not valid YAML"):
        write_resolved_config(run, "a: [1, 2\n")
    assert sorted(p.name for p in run.iterdir()) == ["config.yaml"]
