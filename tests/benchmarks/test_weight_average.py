"""benchmarks/weight_average.py: the post-hoc average of per-step weights is what a run with
algorithm.ema_decay keeps (the same recurrence, checked against a float64 loop)."""
import pytest
import torch


@pytest.fixture(scope="module")
def wa(load_benchmark):
    return load_benchmark("weight_average")


def test_average_at_the_asked_steps_follows_the_recurrence(wa):
    g = torch.Generator().manual_seed(0)
    start = {"w": torch.randn(3, generator=g), "n": torch.tensor(0)}
    states = {s: {"w": torch.randn(3, generator=g), "n": torch.tensor(s)} for s in (1, 2, 3, 4)}
    before = start["w"].clone()
    got = wa.average_states(start, states, 0.6, [2, 4])
    assert sorted(got) == [2, 4]
    e = start["w"].double()
    for s in (1, 2, 3, 4):
        e = 0.6 * e + 0.4 * states[s]["w"].double()
        if s in got:
            torch.testing.assert_close(got[s]["w"].double(), e, rtol=0, atol=1e-6)
            assert int(got[s]["n"]) == s
    assert torch.equal(start["w"], before)  # the start weights are not edited


def test_a_missing_step_is_named(wa):
    start = {"w": torch.zeros(2)}
    with pytest.raises(KeyError, match="no checkpoint of step 2"):
        wa.average_states(start, {1: {"w": torch.ones(2)}, 3: {"w": torch.ones(2)}}, 0.5, [3])
