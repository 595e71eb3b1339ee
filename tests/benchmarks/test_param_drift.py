"""benchmarks/param_drift.py: per-element movement of a run's weights from its start, for trained weights and
the moving average, from an hf start or a checkpoint start."""
import pytest
import torch
from safetensors.torch import save_file

from storage.checkpoints import save_checkpoint


@pytest.fixture(scope="module")
def pd(load_benchmark):
    return load_benchmark("param_drift")


def test_drift_counts_changed_elements_and_their_mean_and_median(pd):
    start = {"a": torch.zeros(4), "frozen": torch.ones(3), "n": torch.tensor(5), "odd": torch.zeros(2)}
    state = {"a": torch.tensor([0.1, -0.3, 0.0, 0.2]), "frozen": torch.ones(3), "n": torch.tensor(7),
             "odd": torch.zeros(3), "new": torch.zeros(1)}
    d = pd.drift(start, state)
    # compared: a (4) + frozen (3); skipped: the int buffer, the reshaped and the unknown tensor
    assert (d["compared"], d["changed"], d["skipped"]) == (7, 3, 3)
    assert d["mean"] == pytest.approx((0.1 + 0.3 + 0.2) / 3, rel=1e-6)
    assert d["median"] == pytest.approx(0.2, rel=1e-6)
    assert pd.drift(start, start)["mean"] == 0.0


def test_cli_prints_trained_and_average_lines_from_an_hf_start(pd, tmp_path, capsys):
    hf = tmp_path / "hf"
    hf.mkdir()
    w0 = torch.zeros(2, 3)
    save_file({"w": w0}, str(hf / "model.safetensors"))
    run = tmp_path / "run"
    ck = save_checkpoint(run, 4, {"policy": {"w": w0 + 0.5}, "policy_ema": {"w": w0 + 0.25}})
    ck_plain = save_checkpoint(run, 2, {"policy": {"w": w0 - 0.125}})
    assert pd.main([str(hf), str(ck_plain), str(ck)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("global_step_2 policy: 6 of 6 compared elements changed, mean |dtheta| 1.25e-01")
    assert out[1].startswith("global_step_4 policy: 6 of 6") and "mean |dtheta| 5.00e-01" in out[1]
    assert out[2].startswith("global_step_4 policy_ema: 6 of 6") and "mean |dtheta| 2.50e-01" in out[2]
    assert len(out) == 3  # no average line for a checkpoint without one
    # a checkpoint as the start: its trained weights
    assert pd.main([str(ck_plain), str(ck)]) == 0
    assert "mean |dtheta| 6.25e-01" in capsys.readouterr().out.splitlines()[0]


def test_a_missing_directory_is_named(pd, tmp_path, capsys):
    assert pd.main([str(tmp_path / "nope"), str(tmp_path)]) == 2
    assert "nope: no such directory" in capsys.readouterr().err
