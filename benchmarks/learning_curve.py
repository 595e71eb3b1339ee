"""Print (and plot) a run's learning curve from MLflow: eval success vs training step, env steps and wall time.

    python benchmarks/learning_curve.py [--run-root runs] [--experiment pushcube_ppo] [--run-id MLFLOW_RUN_ID]
                                        [--png docs/pushcube_curve.png]

Without --run-id it takes the latest active run of the experiment. Prints a markdown table (the README's curve) and
the first wall time at which eval/success_once reached 0.8.

One timeline: a resumed or rolled-back run continues in a new MLflow run and the superseded one is soft-deleted
(storage.tracking); a --run-id of a superseded run is followed (tag `dagrl.superseded_by`) to the run that holds
the newest timeline. Runs logged before that (several values at one step) read the newest value per step.
"""
from __future__ import annotations

import argparse
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run-root", default="runs")
    ap.add_argument("--experiment", default="pushcube_ppo")
    ap.add_argument("--run-id")
    ap.add_argument("--png")
    ap.add_argument("--threshold", type=float, default=0.8)
    args = ap.parse_args()
    from mlflow.tracking import MlflowClient
    from storage.tracking import default_tracking_uri
    client = MlflowClient(default_tracking_uri(Path(args.run_root).resolve()))
    from mlflow.entities import ViewType
    if args.run_id:
        run = client.get_run(args.run_id)
        seen = {run.info.run_id}
        while "dagrl.superseded_by" in run.data.tags:  # follow a resume/rollback to the newest timeline
            run = client.get_run(run.data.tags["dagrl.superseded_by"])
            if run.info.run_id in seen:
                break
            seen.add(run.info.run_id)
        if run.info.run_id != args.run_id:
            print(f"run {args.run_id} was superseded (resume/rollback); reading {run.info.run_id}")
    else:
        exp = client.get_experiment_by_name(args.experiment)
        if exp is None:
            raise SystemExit(f"error: no experiment {args.experiment!r} in {args.run_root}/mlflow.db")
        runs = client.search_runs([exp.experiment_id], run_view_type=ViewType.ACTIVE_ONLY,
                                  order_by=["attributes.start_time DESC"], max_results=1)
        if not runs:
            raise SystemExit(f"error: experiment {args.experiment!r} has no active run in {args.run_root}/mlflow.db")
        run = runs[0]

    def hist(key):
        """{step: value}, one value per step: the newest point where a run logged a step twice."""
        out = {}
        for m in sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: m.timestamp):
            out[m.step] = m.value
        return out

    step_time, env_steps = hist("time/step"), hist("rollout/env_steps_total")
    evals = {k: hist(f"eval/{k}") for k in ("success_once", "success_at_end", "return", "num_episodes")}
    train_eval = hist("time/eval")
    wall, t = {}, 0.0
    for s in sorted(step_time):
        t += step_time[s] + train_eval.get(s, 0.0)
        wall[s] = t
    print(f"run {run.info.run_name} ({run.info.run_id}), status {run.info.status}")
    print("| step | env steps | wall (s) | eval success_once | eval success_at_end | eval return | episodes |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    reached = None
    for s in sorted(evals["success_once"]):
        so = evals["success_once"][s]
        print(f"| {s} | {env_steps.get(s, 0):.0f} | {wall.get(s, float('nan')):.0f} | {so:.3f} | "
              f"{evals['success_at_end'].get(s, float('nan')):.3f} | {evals['return'].get(s, float('nan')):.2f} | "
              f"{evals['num_episodes'].get(s, 0):.0f} |")
        if reached is None and so >= args.threshold:
            reached = (s, wall.get(s), env_steps.get(s))
    if reached:
        print(f"eval success_once >= {args.threshold} first at step {reached[0]}, {reached[2]:.0f} env steps, "
              f"~{reached[1]:.0f} s of training wall time (sum of step and eval times; cluster start excluded)")
    else:
        print(f"eval success_once never reached {args.threshold}")
    if args.png:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        xs = sorted(evals["success_once"])
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot([wall.get(s, 0) / 60 for s in xs], [evals["success_once"][s] for s in xs], "o-",
                label="eval success_once")
        ax.plot([wall.get(s, 0) / 60 for s in xs], [evals["success_at_end"][s] for s in xs], "s--",
                label="eval success_at_end")
        tr = hist("env/success_once")
        ax.plot([wall.get(s, 0) / 60 for s in sorted(tr)], [tr[s] for s in sorted(tr)], alpha=0.4,
                label="train episodes success_once")
        ax.set_xlabel("training wall time (min)")
        ax.set_ylabel("success rate")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")
        ax.set_title(f"{args.experiment}: {run.info.run_name}")
        fig.tight_layout()
        Path(args.png).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(args.png, dpi=110)
        print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
