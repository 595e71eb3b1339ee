"""benchmarks/learning_curve.py's reach-and-hold check (eval >= 0.9 once, never below 0.8 after)."""
import pytest


@pytest.fixture(scope="module")
def lc(load_benchmark):
    return load_benchmark("learning_curve")


def test_first_step_at_threshold_and_the_lowest_eval_after_it(lc):
    evals = {10: 0.0, 20: 0.7, 30: 0.92, 40: 0.81, 50: 0.95}
    assert lc.first_and_hold(evals, 0.9) == (30, 0.81)  # 0.7 before the first hit does not count
    assert lc.first_and_hold(evals, 0.8) == (30, 0.81)
    assert lc.first_and_hold({20: 0.5, 10: 0.91, 30: 0.95}, 0.9) == (10, 0.5)  # steps in time order, not insertion


def test_mean_interval_is_the_student_t_interval_over_seeds(lc):
    """[1, 2, 3]: mean 2, sample sd 1, t_{0.975, 2} = 4.302653 (tables): 2 +- 4.302653 / sqrt(3) = 2 +- 2.484138."""
    m, lo, hi = lc.mean_interval([1.0, 2.0, 3.0])
    assert m == 2.0 and lo == pytest.approx(2 - 2.484138, abs=1e-5) and hi == pytest.approx(2 + 2.484138, abs=1e-5)
    assert lc.mean_interval([5.0, 5.0]) == (5.0, 5.0, 5.0)  # no spread, no width
    m, lo, hi = lc.mean_interval([7.0])
    assert m == 7.0 and lo != lo and hi != hi  # one seed: no interval (nan)
    with pytest.raises(ValueError):
        lc.mean_interval([])


def test_never_reached_and_reached_at_the_last_eval(lc):
    assert lc.first_and_hold({10: 0.5, 20: 0.89}, 0.9) == (None, None)
    assert lc.first_and_hold({10: 0.5, 20: 0.9}, 0.9) == (20, None)  # reached (>=) at the last eval: nothing to hold
    assert lc.first_and_hold({}, 0.9) == (None, None)


def test_runs_found_by_dagrl_name_or_mlflow_id_and_plotted_together(lc, tmp_path):
    """Two seeds in a scratch MLflow store: each found by its run name and by its id, its eval curve read back
    per step against env steps, and both drawn into one png; an unknown name is a clear error."""
    from mlflow.tracking import MlflowClient
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    exp = client.create_experiment("pushcube_ppo", artifact_location=(tmp_path / "art").as_uri())
    made = {}
    for seed, evals in ((1, {10: 0.2, 20: 0.95}), (2, {10: 0.1, 20: 0.5})):
        run = client.create_run(exp, run_name=f"20261204-000000-000{seed}")
        client.log_param(run.info.run_id, "seed", seed)
        for step, v in evals.items():
            client.log_metric(run.info.run_id, "eval/success_once", v, step=step)
            client.log_metric(run.info.run_id, "eval/success_at_end", v / 2, step=step)
            client.log_metric(run.info.run_id, "rollout/env_steps_total", step * 3200, step=step)
        made[seed] = run.info.run_id
    for seed, run_id in made.items():
        assert lc.find_run(client, f"20261204-000000-000{seed}").info.run_id == run_id
        assert lc.find_run(client, run_id).info.run_id == run_id
    c = lc.curve(client, client.get_run(made[1]))
    assert c["evals"]["success_once"] == {10: 0.2, 20: 0.95}
    assert c["env_steps"] == {10: 32000, 20: 64000}
    assert lc.first_and_hold(c["evals"]["success_once"], 0.9) == (20, None)
    png = tmp_path / "out" / "curve.png"
    lc.plot([(f"seed {s}", lc.curve(client, client.get_run(i))) for s, i in made.items()], "t", str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(SystemExit, match="no MLflow run with id or name '20261204-nope'"):
        lc.find_run(client, "20261204-nope")
