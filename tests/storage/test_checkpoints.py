import json
import os
import random

import numpy as np
import pytest
import torch

from storage.checkpoints import (
    FORMAT,
    OldFormat,
    check_loadable,
    checkpoint_step,
    checkpoint_damage,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    prune_checkpoints,
    save_checkpoint,
)
from storage.rundir import find_run_dir, new_run_dir, write_resolved_config
from tasks.actor.state import rng_state


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
        "python_rng": random.Random(7).getstate(),  # tuple: not JSON round-trippable -> torch.save
        "runner": {"global_step": step, "env_cursor": 12, "weight_version": 4},
    }


def test_round_trip_model_and_optimizer(tmp_path):
    state = _state()
    path = save_checkpoint(tmp_path, 3, state)
    assert path == tmp_path / "checkpoints" / "global_step_3"
    index = json.loads((path / "index.json").read_text())
    assert index["step"] == 3
    # StepLR's state dict holds no tensors and survives JSON exactly, so it goes to meta.json
    assert sorted(index["files"]) == ["meta.json", "model.pt", "optimizer.pt", "python_rng.pt",
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

    with pytest.raises(ValueError, match="checkpoint value bad .*Unpicklable"):  # refused before writing
        save_checkpoint(tmp_path, 4, {"w": torch.ones(2), "bad": Unpicklable()})
    assert torch.equal(load_checkpoint(latest_checkpoint(tmp_path))["w"], torch.zeros(2))
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["global_step_4"]


def test_a_failure_while_writing_keeps_previous(tmp_path, monkeypatch):
    import storage.checkpoints as ck
    save_checkpoint(tmp_path, 4, {"w": torch.zeros(2)})
    real, calls = ck._write_file, []

    def flaky(path, write):
        calls.append(path.name)
        if len(calls) == 2:
            raise OSError("disk full")
        real(path, write)
    monkeypatch.setattr(ck, "_write_file", flaky)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(tmp_path, 4, {"w": torch.ones(2), "v": torch.ones(3)})
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
    assert sorted(p.name for p in run.iterdir()) == [".started", "config.yaml", "config.yaml.sha256"]


def test_latest_started_run_orders_by_start_not_by_mtime(tmp_path):
    from storage.rundir import latest_started_run, run_started_ns
    exp = tmp_path / "exp"
    assert latest_started_run(exp) is None
    runs = []
    for name in ("20261201-090000-aaaa", "20261201-080000-bbbb", "zz-no-stamp"):  # started in this order
        runs.append(new_run_dir(tmp_path, "exp", name))
        write_resolved_config(runs[-1], "a: 1\n")
    assert [run_started_ns(r) for r in runs] == sorted(run_started_ns(r) for r in runs)
    os.utime(runs[0], (2e9, 2e9))  # newest mtime: does not matter
    (runs[1] / "checkpoints").mkdir()
    assert latest_started_run(exp) == runs[2]
    assert new_run_dir(tmp_path, "exp", runs[0].name) == runs[0]  # a resume keeps the start time
    assert latest_started_run(exp) == runs[2]
    (runs[2] / ".started").unlink()  # a run dir from before .started: the ctime (no time in its name)
    (exp / "half-made").mkdir()  # no config.yaml: not a run
    assert latest_started_run(exp) == runs[2]
    (runs[0] / ".started").unlink()  # the time in the run id
    assert run_started_ns(runs[0]) == int(__import__("datetime").datetime(2026, 12, 1, 9).timestamp() * 1e9)


def _equal(a, b):
    """Exact structural equality of nested dicts/lists/tuples of tensors and plain values (types kept)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and (a == b or (a != a and b != b))


@pytest.mark.parametrize("value, where", [
    ({"torch": torch.get_rng_state(), "numpy": np.random.get_state()}, "rng.numpy[1]"),
    ({"numpy": np.random.get_state()}, "rng.numpy[1]"),  # no tensor: used to go to a pickle
    ({"a": [1, {"b": np.float32(0.5)}]}, "rng.a[1].b"),
    ({"arr": np.zeros(3)}, "rng.arr"),
    ({"gen": np.random.default_rng(0)}, "rng.gen"),
    ({"x": torch.zeros(2), "obj": object()}, "rng.obj"),
    ({(1, 2): 3}, "rng"),
])
def test_a_value_that_cannot_be_loaded_back_is_refused_when_saved(tmp_path, value, where):
    import re
    pattern = "has a key" if where == "rng" else "^checkpoint value " + re.escape(where) + " "
    with pytest.raises(ValueError, match=pattern):
        save_checkpoint(tmp_path, 1, {"policy": {"w": torch.ones(2)}, "rng": value})
    assert not (tmp_path / "checkpoints").exists()  # nothing written, not even the directory


def _runner_like_states():
    """Every kind of state the runner saves (tasks.actor.entries.actor_state + graphs._save_checkpoint + Runner.checkpoint
    meta): policy and optimizer state dicts (Adam: step tensors, param_groups with tuples/None/bools, a second
    group, a parameter that has received no gradient yet), RNG states via rng_state(), the runner meta with cursors
    (plain lists of ints/floats/bools incl. a per-shard RNG), best eval -1.0, None mlflow id."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    unused = torch.nn.Linear(2, 2)
    opt = torch.optim.Adam([{"params": model.parameters()}, {"params": unused.parameters(), "lr": 0.5}], eps=1e-5)
    model(torch.randn(5, 3)).sum().backward()
    opt.step()
    cursor = {"episode_count": [1, 2], "seed": [10, 11], "active": [True, False], "actions": [[[0.25, -1.0]], []],
              "return": [0.5, 0.0], "parts": [{"started": True, "chunk_steps": 3,
                                               "rng": torch.get_rng_state().tolist()}]}
    return {"policy": model.state_dict(), "optimizer": opt.state_dict(), "rng": rng_state(),
            "run": {"runner": {"run_id": "r", "mlflow_run_id": None, "step": 2, "env_steps": 64,
                               "cursors": [cursor, None], "elapsed_s": 1.5, "best_eval_success_once": -1.0,
                               "best_eval_step": -1, "actor_generation": 0},
                    "experiment": "smoke", "weight_version": 2, "dims": (3, 2)}}


def test_round_trip_of_every_kind_of_state_the_runner_saves(tmp_path):
    state = _runner_like_states()
    check_loadable(state)
    back = load_checkpoint(save_checkpoint(tmp_path, 2, state))
    assert _equal(back, state)
    only = load_checkpoint(latest_checkpoint(tmp_path), keys=("run",))
    assert list(only) == ["run"] and _equal(only["run"], state["run"])
    with pytest.raises(KeyError, match="has no key"):
        load_checkpoint(latest_checkpoint(tmp_path), keys=("nope",))


def test_an_older_format_is_listed_but_refused_with_the_upgrade_command(tmp_path):
    """A checkpoint whose index has no format (written before FORMAT) is still a complete checkpoint (a resume finds
    it), but verifying or loading it is one line naming its index and `python -m pipelines.upgrade <run dir>`."""
    path = save_checkpoint(tmp_path, 1, {"policy": {"w": torch.ones(2)}, "run": {"step": 1}})
    assert json.loads((path / "index.json").read_text())["format"] == FORMAT
    index = json.loads((path / "index.json").read_text())
    del index["format"]
    (path / "index.json").write_text(json.dumps(index))
    assert latest_checkpoint(tmp_path) == path
    fix = f"`python -m pipelines.upgrade {tmp_path}`"
    for read in (lambda: load_checkpoint(path), lambda: load_checkpoint(path, keys=("run",))):
        with pytest.raises(OldFormat) as exc:
            read()
        assert str(path / "index.json") in str(exc.value) and fix in str(exc.value) and "\n" not in str(exc.value)
    assert fix in checkpoint_damage(path)


def test_write_text_atomic_leaves_the_old_file_or_the_new_one(tmp_path, monkeypatch):
    """The one helper behind every small file a run, an eval or the recipe replaces (config.yaml, evals/step_N.json,
    perf_summary.json, eval.json, videos.json, recipe markers): a write interrupted before its rename (a Ctrl-C,
    here a KeyboardInterrupt from os.replace) leaves the old content and no temporary file; a complete one
    replaces it."""
    from storage.rundir import write_text_atomic
    path = tmp_path / "rl.json"
    write_text_atomic(path, '{"run_id": "old"}')

    def interrupted(src, dst):
        raise KeyboardInterrupt
    monkeypatch.setattr(os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        write_text_atomic(path, '{"run_id": "new", "wall_s": 12.5}')
    assert path.read_text() == '{"run_id": "old"}'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rl.json"]
    monkeypatch.undo()
    assert write_text_atomic(path, '{"run_id": "new"}') == path and path.read_text() == '{"run_id": "new"}'
