"""Print (and plot) learning curves from MLflow: eval success vs training step, env steps and wall time.

    python benchmarks/learning_curve.py [--run-root runs] [--experiment pushcube_ppo] [--run-id ID|NAME ...]
                                        [--threshold 0.9] [--hold 0.8] [--png docs/pushcube_curve.png]

Without --run-id it takes the latest active run of the experiment. Per run it prints a markdown table (the README's
curve) and the first step, env steps and training wall time at which eval/success_once reached --threshold; with
--hold, also the lowest eval at every later evaluation and whether it stayed >= --hold (issue 13's check: >= 0.9
once, never below 0.8 after). With several run ids (e.g. one per seed) it ends with one summary table and the mean
training wall time and step to --threshold over the runs that reached it, with Student-t 95 % intervals. --png
plots every run's eval curve against env steps.

One timeline: a resumed or rolled-back run continues in a new MLflow run and the superseded one is soft-deleted
(storage.tracking); a --run-id of a superseded run is followed (tag `dagrl.superseded_by`) to the run that holds
the newest timeline. Runs logged before that (several values at one step) read the newest value per step.

Wall time is the sum of the steps' `time/step` and the evals' `time/eval` (cluster start excluded): it depends on
the machine's load, the eval numbers do not.
"""
from __future__ import annotations

import argparse
from pathlib import Path


def mean_interval(values: list[float], confidence: float = 0.95) -> tuple[float, float, float]:
    """(mean, low, high): the mean of `values` (one per seed) with its Student-t interval,
    mean +- t_{(1+confidence)/2, n-1} * s / sqrt(n), s the sample standard deviation (ddof 1). One value: (v, nan,
    nan). Raises ValueError on no values."""
    import math

    from scipy.stats import t
    n = len(values)
    if n == 0:
        raise ValueError("mean_interval: no values")
    mean = sum(values) / n
    if n == 1:
        return mean, float("nan"), float("nan")
    s = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = float(t.ppf((1 + confidence) / 2, n - 1)) * s / math.sqrt(n)
    return mean, mean - half, mean + half


def first_and_hold(evals: dict[int, float], threshold: float) -> tuple[int | None, float | None]:
    """The first eval step whose success is >= `threshold`, and the lowest success at the evals after it.

    Args:
        evals: {training step: eval success rate in [0, 1]}.
        threshold: the success rate to reach.
    Returns:
        (step, lowest later success); (None, None) when never reached; lowest is None when the first hit is the last
        eval (nothing after it to hold)."""
    steps = sorted(evals)
    for i, s in enumerate(steps):
        if evals[s] >= threshold:
            later = [evals[t] for t in steps[i + 1:]]
            return s, (min(later) if later else None)
    return None, None


def find_run(client, ref: str):
    """The MLflow run for `ref`: an MLflow run id, or a dagrl run name as printed by the job (20261203-174332-874b).

    Raises:
        SystemExit: no run has that id or name."""
    from mlflow.entities import ViewType
    from mlflow.exceptions import MlflowException
    try:
        return client.get_run(ref)
    except MlflowException:
        pass
    exps = [e.experiment_id for e in client.search_experiments(view_type=ViewType.ALL)]
    runs = client.search_runs(exps, filter_string=f"attributes.run_name = '{ref}'", run_view_type=ViewType.ALL,
                              order_by=["attributes.start_time ASC"], max_results=1)
    if not runs:
        raise SystemExit(f"error: no MLflow run with id or name {ref!r}; list runs with `mlflow ui` or use the "
                         f"run name the job printed")
    return runs[0]


def newest_timeline(client, run_id: str):
    """The MLflow run holding the newest timeline of `run_id` (an id or dagrl run name; follows
    `dagrl.superseded_by`)."""
    run = find_run(client, run_id)
    seen = {run.info.run_id}
    while "dagrl.superseded_by" in run.data.tags:  # follow a resume/rollback to the newest timeline
        run = client.get_run(run.data.tags["dagrl.superseded_by"])
        if run.info.run_id in seen:
            break
        seen.add(run.info.run_id)
    if run.info.run_id != run_id and run.info.run_name != run_id:
        print(f"run {run_id} was superseded (resume/rollback); reading {run.info.run_id}")
    return run


def curve(client, run) -> dict:
    """One run's curve: {"evals": {metric: {step: value}}, "wall": {step: s}, "env_steps": {step: n}, "train": ...}."""
    def hist(key):
        """{step: value}, one value per step: the newest point where a run logged a step twice."""
        from storage.tracking import metric_value  # +-inf as logged (MLflow stores +-float max)
        out = {}
        for m in sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: m.timestamp):
            out[m.step] = metric_value(m.value)
        return out

    step_time, train_eval = hist("time/step"), hist("time/eval")
    wall, t = {}, 0.0
    for s in sorted(step_time):
        t += step_time[s] + train_eval.get(s, 0.0)
        wall[s] = t
    return {"evals": {k: hist(f"eval/{k}") for k in ("success_once", "success_at_end", "return", "num_episodes")},
            "wall": wall, "env_steps": hist("rollout/env_steps_total"), "train": hist("env/success_once")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run-root", default="runs")
    ap.add_argument("--experiment", default="pushcube_ppo")
    ap.add_argument("--run-id", nargs="+")
    ap.add_argument("--png")
    ap.add_argument("--threshold", type=float, default=0.8)
    ap.add_argument("--hold", type=float, help="report the lowest eval after the first >= --threshold against this")
    args = ap.parse_args()
    from mlflow.entities import ViewType
    from mlflow.tracking import MlflowClient
    from storage.tracking import default_tracking_uri
    client = MlflowClient(default_tracking_uri(Path(args.run_root).resolve()))
    if args.run_id:
        runs = [newest_timeline(client, r) for r in args.run_id]
    else:
        exp = client.get_experiment_by_name(args.experiment)
        if exp is None:
            raise SystemExit(f"error: no experiment {args.experiment!r} in {args.run_root}/mlflow.db")
        runs = client.search_runs([exp.experiment_id], run_view_type=ViewType.ACTIVE_ONLY,
                                  order_by=["attributes.start_time DESC"], max_results=1)
        if not runs:
            raise SystemExit(f"error: experiment {args.experiment!r} has no active run in {args.run_root}/mlflow.db")
    summary = []
    for run in runs:
        c = curve(client, run)
        ev, wall, env_steps = c["evals"], c["wall"], c["env_steps"]
        print(f"run {run.info.run_name} ({run.info.run_id}), seed {run.data.params.get('seed', '?')}, "
              f"status {run.info.status}")
        print("| step | env steps | wall (s) | eval success_once | eval success_at_end | eval return | episodes |")
        print("|---:|---:|---:|---:|---:|---:|---:|")
        for s in sorted(ev["success_once"]):
            print(f"| {s} | {env_steps.get(s, 0):.0f} | {wall.get(s, float('nan')):.0f} | "
                  f"{ev['success_once'][s]:.3f} | {ev['success_at_end'].get(s, float('nan')):.3f} | "
                  f"{ev['return'].get(s, float('nan')):.2f} | {ev['num_episodes'].get(s, 0):.0f} |")
        step, low = first_and_hold(ev["success_once"], args.threshold)
        if step is None:
            line = f"eval success_once never reached {args.threshold}"
        else:
            line = (f"eval success_once >= {args.threshold} first at step {step}, {env_steps.get(step, 0):.0f} env "
                    f"steps, ~{wall.get(step, float('nan')):.0f} s of training wall time (sum of step and eval "
                    f"times; cluster start excluded)")
            if args.hold is not None:
                held = low is None or low >= args.hold
                line += (f"; lowest later eval {'-' if low is None else f'{low:.3f}'}: "
                         f"{'held' if held else 'fell below'} {args.hold}")
        print(line + "\n")
        summary.append((run, step, low, env_steps.get(step) if step else None, wall.get(step) if step else None))
    if len(runs) > 1:
        print(f"| run | seed | first >= {args.threshold} (step) | env steps | wall s | lowest later eval |")
        print("|---|---:|---:|---:|---:|---:|")
        for run, step, low, n, w in summary:
            print(f"| {run.info.run_name} | {run.data.params.get('seed', '?')} | {step if step else 'never'} | "
                  f"{'' if n is None else f'{n:.0f}'} | {'' if w is None else f'{w:.0f}'} | "
                  f"{'' if low is None else f'{low:.3f}'} |")
        walls = [w for _, step, _, _, w in summary if step is not None and w is not None]
        steps = [step for _, step, _, _, _ in summary if step is not None]
        if walls:
            m, lo, hi = mean_interval(walls)
            ms, slo, shi = mean_interval([float(x) for x in steps])
            print(f"\n{len(steps)} of {len(summary)} runs reached {args.threshold}; over those: training wall to it "
                  f"mean {m:.0f} s, 95 % t-interval [{lo:.0f}, {hi:.0f}]; step mean {ms:.0f} [{slo:.0f}, {shi:.0f}]")
    if args.png:
        plot([(f"seed {r.data.params.get('seed', '?')}", curve(client, r)) for r in runs],
             f"{args.experiment}: eval on {runs[0].data.params.get('env.eval.num_episodes', '?')} episodes", args.png)


def plot(curves: list[tuple[str, dict]], title: str, png: str) -> None:
    """Eval success_once (solid) and success_at_end (dashed) of each run against env steps, to `png`.

    Env steps, not wall time, on the x axis: the eval numbers per step do not depend on the machine's load.

    Args:
        curves: (label, curve(...) output) per run.
        title: the plot's title.
        png: output path (parents are created)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    for label, c in curves:
        ev, env_steps = c["evals"], c["env_steps"]
        xs = sorted(ev["success_once"])
        x = [env_steps.get(s, 0) / 1000 for s in xs]
        line, = ax.plot(x, [ev["success_once"][s] for s in xs], "o-", ms=3, label=f"{label} success_once")
        ax.plot(x, [ev["success_at_end"].get(s, float("nan")) for s in xs], "--", color=line.get_color(), alpha=0.5,
                label=f"{label} success_at_end")
    ax.set_xlabel("env steps (thousands)")
    ax.set_ylabel("eval success rate")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=7)
    ax.set_title(title)
    fig.tight_layout()
    Path(png).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    print(f"wrote {png}")


if __name__ == "__main__":
    main()
