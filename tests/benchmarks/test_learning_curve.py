"""benchmarks/learning_curve.py's reach-and-hold check (issue 13: eval >= 0.9 once, never below 0.8 after)."""
import pytest


@pytest.fixture(scope="module")
def lc(load_benchmark):
    return load_benchmark("learning_curve")


def test_first_step_at_threshold_and_the_lowest_eval_after_it(lc):
    evals = {10: 0.0, 20: 0.7, 30: 0.92, 40: 0.81, 50: 0.95}
    assert lc.first_and_hold(evals, 0.9) == (30, 0.81)  # 0.7 before the first hit does not count
    assert lc.first_and_hold(evals, 0.8) == (30, 0.81)
    assert lc.first_and_hold({20: 0.5, 10: 0.91, 30: 0.95}, 0.9) == (10, 0.5)  # steps in time order, not insertion


def test_never_reached_and_reached_at_the_last_eval(lc):
    assert lc.first_and_hold({10: 0.5, 20: 0.89}, 0.9) == (None, None)
    assert lc.first_and_hold({10: 0.5, 20: 0.9}, 0.9) == (20, None)  # reached (>=) at the last eval: nothing to hold
    assert lc.first_and_hold({}, 0.9) == (None, None)
