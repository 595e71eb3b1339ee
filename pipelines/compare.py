"""Compare runs side by side: `python -m pipelines.compare RUN [RUN ...] [--metric KEY ...] [--png out.png]
[tracking.uri=URI] [run_root=DIR]`; a sweep's report: `python -m pipelines.compare --sweep ID [--threshold X]`
(the runs of `pipelines.run -m` grouped by their swept keys other than seed, each configuration's mean over seeds
with a Student-t 95 % interval, paired differences, a curve plot: pipelines.sweep_report).

RUN is a dagrl run id (the run directory's name, e.g. 20261201-151530-98db: the MLflow runs carry it as the tag
`dagrl.run_id` and as their run name), an MLflow run id, or an MLflow experiment name (then every active run of
it, oldest first). A resumed or rolled-back run is read from its newest timeline (the active MLflow run with that
tag; superseded ones are soft-deleted, `storage.tracking`).

Printed:
  runs        one line per run: its column label (the dagrl run id), experiment, MLflow run id, status, steps
  config      the flattened params (the resolved config, `storage.tracking.flatten_config`) that differ between
              the runs, one row per key with each run's value ("-": not logged by that run), and the count of the
              identical ones
  metrics     for each metric, two rows: `final` (the value at the run's last logged step) and `best` (the
              maximum; the minimum for keys ending in `loss` or `kl` and for `time/` and `system/` keys), each as
              `value @step` (the earliest step of the best value); one value per step (the newest point, as MLflow
              charts show a step logged twice). A value logged as +-inf reads as inf/-inf (MLflow stores +-float
              max: `storage.tracking.metric_value`), NaN as nan; a non-finite value (diverged) is never the best:
              best is taken over the finite values (nan when there is none)
With --png: one figure, a row per metric, against step (left) and against wall time (right: seconds since the
run's first point or its MLflow start, whichever is earlier; a resumed run's pause shows as a gap), Agg backend.

Default metrics (no --metric): `eval/success_once` and the first of train/actor_loss, train/sft_loss,
train/critic_loss (else the first `train/` key, sorted) that EVERY run logged; a --metric some run lacks is an error.
Default store: the one `pipelines.run` writes by default, sqlite:///<run_root>/mlflow.db with run_root `runs`.

Examples:
  python -m pipelines.compare 20261201-151530-98db 20261201-160102-3c0e
  python -m pipelines.compare pushcube_ppo --metric eval/success_once --metric env/return --png compare.png
  python -m pipelines.compare smoke run_root=/tmp/runs
  python -m pipelines.compare RUN tracking.uri=http://127.0.0.1:5000
  python -m pipelines.compare --sweep 20261201-151530-98db --threshold 0.8

Exit codes: 0 printed; 2 an unknown run or metric, a store that cannot be read, bad arguments (one line
`error: ...` naming it and the fix).
"""
from __future__ import annotations

import argparse
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from tasks.config import close_matches  # the one "did you mean"

DEFAULT_EVAL_METRIC = "eval/success_once"
DEFAULT_TRAIN_METRICS = ("train/actor_loss", "train/sft_loss", "train/critic_loss")
LOWER_IS_BETTER = re.compile(r"(loss|kl)$|^(time|system)/")


class CompareError(ValueError):
    """A run, metric, store or argument `pipelines.compare` cannot use; the message is one line with the fix."""


@dataclass
class Summary:
    """One metric of one run: `final` at `final_step` (the last step logged), `best` at `best_step` (the earliest
    step holding it, over the finite values only; NaN when no value is finite), `lower_is_better` says which way best
    is taken, and the points (step, value, timestamp in ms), one per step."""

    final: float
    final_step: int
    best: float
    best_step: int
    lower_is_better: bool
    points: list[tuple[int, float, int]]


def lower_is_better(key: str) -> bool:
    """True when the best value of `key` is its minimum: keys ending in `loss` or `kl`, `time/` and `system/` keys."""
    return bool(LOWER_IS_BETTER.search(key))


def history(client, run_id: str, key: str) -> list[tuple[int, float, int]]:
    """(step, value, timestamp ms) of `key`, sorted by step, one point per step (the newest where a step was logged
    twice); +-inf as logged (`storage.tracking.metric_history`, the one reading place)."""
    from storage.tracking import metric_history
    return metric_history(client, run_id, key)


def summarize(points: list[tuple[int, float, int]], key: str) -> Summary:
    """Final and best of one metric's points (`history`); a non-finite value (NaN, +-inf: diverged) never is the
    best, whichever way best is taken."""
    low = lower_is_better(key)
    finite = [p for p in points if math.isfinite(p[1])]
    if finite:
        best = min(finite, key=lambda p: (p[1] if low else -p[1], p[0]))
    else:
        best = (points[-1][0], math.nan, 0)
    return Summary(points[-1][1], points[-1][0], best[1], best[0], low, points)


def _all_experiments(client):
    from mlflow.entities import ViewType
    return client.search_experiments(view_type=ViewType.ACTIVE_ONLY)


def _search(client, experiments, filter_string: str = ""):
    from mlflow.entities import ViewType
    ids = [e.experiment_id for e in experiments]
    return client.search_runs(ids, filter_string=filter_string, run_view_type=ViewType.ACTIVE_ONLY,
                              order_by=["attributes.start_time ASC"], max_results=50000) if ids else []


def resolve_runs(client, names: list[str], uri: str) -> list:
    """The MLflow runs named by `names` (each a dagrl run id, an MLflow run id or an experiment name; see the
    module docstring), in order, each once.

    Raises:
        CompareError: a name that is none of these (close matches among the store's run ids and experiments).
    """
    from mlflow.exceptions import MlflowException
    from storage.tracking import RUN_ID_TAG, SUPERSEDED_TAG
    experiments = _all_experiments(client)
    out, seen = [], set()
    for name in names:
        quoted = name.replace("'", "\\'")
        hits = _search(client, experiments, f"tags.`{RUN_ID_TAG}` = '{quoted}'")[-1:]  # the newest timeline
        if not hits:
            exp = next((e for e in experiments if e.name == name), None)
            hits = _search(client, [exp]) if exp is not None else []
            if exp is not None and not hits:
                raise CompareError(f"RUN={name!r}: experiment {name!r} has no active run in {uri}; run one, or "
                                   f"name runs by id")
        if not hits and re.fullmatch(r"[0-9a-f]{32}", name):
            try:
                run = client.get_run(name)
                for _ in range(100):  # a superseded run: follow it to the newest timeline
                    if SUPERSEDED_TAG not in run.data.tags:
                        break
                    run = client.get_run(run.data.tags[SUPERSEDED_TAG])
                hits = [run]
            except MlflowException:
                hits = []
        if not hits:
            raise CompareError(_unknown_run(client, experiments, name, uri))
        for r in hits:
            if r.info.run_id not in seen:
                seen.add(r.info.run_id)
                out.append(r)
    return out


def _unknown_run(client, experiments, name: str, uri: str) -> str:
    from storage.tracking import RUN_ID_TAG
    known = [e.name for e in experiments] + sorted({r.data.tags.get(RUN_ID_TAG) or r.info.run_name
                                                    for r in _search(client, experiments)} - {None})
    close = close_matches(name, known, n=5)
    return (f"RUN={name!r}: no dagrl run id, MLflow run id or experiment of that name in {uri} (close matches: "
            f"{', '.join(close[:5]) or 'none'}); pass a run directory's name (runs/<experiment>/<run_id>) or an "
            f"experiment name, or the store it was logged to (tracking.uri=URI / run_root=DIR)")


def labels(runs) -> list[str]:
    """Column labels: each run's dagrl run id (its run name); the MLflow run id where two would read the same."""
    from storage.tracking import RUN_ID_TAG
    names = [r.data.tags.get(RUN_ID_TAG) or r.info.run_name or r.info.run_id for r in runs]
    return [n if names.count(n) == 1 else f"{n} ({r.info.run_id[:8]})" for n, r in zip(names, runs)]


def config_diff(runs) -> tuple[dict[str, list[str | None]], int]:
    """({config key: each run's value (None: not logged)} for the keys whose values differ, number of identical
    keys), from the runs' params joined back into config keys (`storage.tracking.unflatten_values`)."""
    from storage.tracking import unflatten_values
    values = [unflatten_values(r.data.params) for r in runs]
    keys = sorted(set().union(*values))
    diff = {k: [v.get(k) for v in values] for k in keys if len({v.get(k) for v in values}) > 1}
    return diff, len(keys) - len(diff)


def default_metrics(runs) -> list[str]:
    """`eval/success_once` and one train metric, each only if every run logged it (module docstring).

    Raises:
        CompareError: no such metric in every run (the keys they share are listed)."""
    common = set.intersection(*(set(r.data.metrics) for r in runs))
    chosen = [DEFAULT_EVAL_METRIC] if DEFAULT_EVAL_METRIC in common else []
    train = [k for k in DEFAULT_TRAIN_METRICS if k in common] or sorted(k for k in common if k.startswith("train/"))
    chosen += train[:1]
    if not chosen:
        raise CompareError(f"--metric: the runs share neither {DEFAULT_EVAL_METRIC} nor a train/ metric; pass "
                           f"--metric KEY (shared: {', '.join(sorted(common)[:12]) or 'none'})")
    return chosen


def check_metrics(runs, run_labels: list[str], metrics: list[str]) -> None:
    """Every metric logged by every run. Raises CompareError naming the metric, the run and close keys."""
    for key in metrics:
        for r, lab in zip(runs, run_labels):
            if key not in r.data.metrics:
                close = close_matches(key, r.data.metrics, n=3, cutoff=0.5)
                raise CompareError(f"--metric={key!r}: not logged by run {lab} (close: "
                                   f"{', '.join(close) or 'none'}); pass a key every run logged, e.g. "
                                   f"{', '.join(sorted(r.data.metrics)[:4])}")


def fmt(value: float) -> str:
    """A metric value as printed: 4 significant digits."""
    return f"{value:.4g}"


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def report(runs, run_labels, metrics, summaries: dict[str, list[Summary]], experiments: dict[str, str]) -> str:
    """The printed text (module docstring: runs, config, metrics); `experiments`: experiment id -> name."""
    from storage.tracking import metric_value
    lines = ["runs:"]
    for r, lab in zip(runs, run_labels):
        env_steps = r.data.metrics.get("rollout/env_steps_total")
        env_steps = None if env_steps is None else metric_value(env_steps)
        lines.append(f"  {lab}: experiment {experiments.get(r.info.experiment_id, r.info.experiment_id)}, MLflow "
                     f"run {r.info.run_id}, {r.info.status}"
                     + (f", {env_steps:.0f} env steps" if env_steps is not None else ""))
    diff, same = config_diff(runs)
    lines.append(f"config: {len(diff)} keys differ, {same} identical")
    if diff:
        lines.append(_table([["key", *run_labels]] +
                            [[k, *("-" if v is None else v for v in vals)] for k, vals in diff.items()]))
    lines.append("metrics (final: the last step's value; best: max, min for *loss, *kl, time/, system/):")
    rows = [["metric", "", *run_labels]]
    for key in metrics:
        s = summaries[key]
        rows.append([key, "final", *(f"{fmt(x.final)} @{x.final_step}" for x in s)])
        rows.append(["", "best (min)" if s[0].lower_is_better else "best (max)",
                     *(f"{fmt(x.best)} @{x.best_step}" for x in s)])
    lines.append(_table(rows))
    return "\n".join(lines)


def plot(path: str | Path, run_labels, metrics, summaries: dict[str, list[Summary]], starts_ms: list[int]) -> Path:
    """One PNG: a row per metric, its value against step (left) and wall time in s (right) for every run."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(len(metrics), 2, figsize=(11, 3.2 * len(metrics)), squeeze=False)
    for i, key in enumerate(metrics):
        for lab, s, t0 in zip(run_labels, summaries[key], starts_ms):
            steps = [p[0] for p in s.points]
            vals = [p[1] for p in s.points]
            wall = [(p[2] - t0) / 1000 for p in s.points]
            axes[i, 0].plot(steps, vals, marker=".", label=lab)
            axes[i, 1].plot(wall, vals, marker=".", label=lab)
        for j, xl in enumerate(("step", "wall time (s)")):
            axes[i, j].set_xlabel(xl)
            axes[i, j].set_ylabel(key)
            axes[i, j].grid(alpha=0.3)
        axes[i, 0].legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The command line (module docstring). Raises CompareError for bad arguments."""
    from pipelines.cli import ArgumentParser, UsageError
    from tasks.config import Config

    class _Parser(ArgumentParser):
        def error(self, message):  # one line, exit 2: CompareError, as every other refusal of this command
            try:
                super().error(message)
            except UsageError as exc:
                raise CompareError(str(exc)) from None
    ap = _Parser(prog="python -m pipelines.compare", add_help=False)
    ap.add_argument("runs", nargs="*", metavar="RUN")
    ap.add_argument("--sweep", metavar="ID")  # a sweep's report (pipelines.sweep_report)
    ap.add_argument("--threshold", type=float)  # with --sweep: steps and wall time to this value
    ap.add_argument("--metric", action="append", default=None)
    ap.add_argument("--png")
    ap.add_argument("--tracking-uri")
    ap.add_argument("--run-root", default=Config().run_root)
    from pipelines.cli import as_flags  # run_root=DIR, tracking.uri=URI: the spelling of every command (the
    args = ap.parse_args(as_flags(argv))  # flags --run-root DIR, --tracking-uri URI are the same)
    if bool(args.runs) == bool(args.sweep):
        raise CompareError("give RUN names or --sweep ID (one of them); see python -m pipelines.compare --help")
    if args.threshold is not None and not args.sweep:
        raise CompareError("--threshold goes with --sweep ID (steps and wall time to it, per configuration)")
    if args.sweep and args.metric and len(args.metric) > 1:
        raise CompareError("--sweep reports one --metric (default eval/success_once)")
    return args


def compare(args: argparse.Namespace, *, echo=print) -> int:
    """Resolve the runs, print the report, write the PNG. Raises CompareError (module docstring)."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient
    from storage.tracking import check_tracking_uri, default_tracking_uri
    if args.sweep:  # pipelines.sweep_report: the runs tagged with the sweep id, grouped by configuration
        from pipelines.sweep_report import SweepReportError, report_sweep
        try:
            return report_sweep(args.sweep, run_root=args.run_root, tracking_uri=args.tracking_uri,
                                metric=(args.metric or [DEFAULT_EVAL_METRIC])[0], threshold=args.threshold,
                                png=args.png, echo=echo)
        except SweepReportError as exc:
            raise CompareError(str(exc)) from None
    uri = args.tracking_uri or default_tracking_uri(Path(args.run_root).resolve())
    what = "tracking.uri" if args.tracking_uri else "run_root"
    try:
        check_tracking_uri(uri, must_exist=True)
    except ValueError as exc:
        raise CompareError(f"{what}: tracking store {uri}: {exc}") from None
    if args.png and not Path(args.png).resolve().parent.is_dir():
        raise CompareError(f"--png={args.png!r}: its directory {Path(args.png).resolve().parent} does not exist; "
                           f"create it or write elsewhere")
    client = MlflowClient(uri)
    try:
        runs = resolve_runs(client, args.runs, uri)
        experiments = {e.experiment_id: e.name for e in _all_experiments(client)}
        run_labels = labels(runs)
        metrics = args.metric or default_metrics(runs)
        check_metrics(runs, run_labels, metrics)
        summaries = {k: [summarize(history(client, r.info.run_id, k), k) for r in runs] for k in metrics}
    except MlflowException as exc:
        raise CompareError(f"{what}: tracking store {uri} cannot be read ({str(exc).splitlines()[0]}); pass the "
                           f"store the runs were logged to") from None
    echo(report(runs, run_labels, metrics, summaries, experiments))
    if args.png:
        starts = [min([r.info.start_time or 2**62] + [p[2] for k in metrics for p in summaries[k][i].points])
                  for i, r in enumerate(runs)]
        echo(f"plot: {plot(args.png, run_labels, metrics, summaries, starts)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m pipelines.compare ...` (module docstring). Returns the exit code."""
    from pipelines.cli import start
    argv = start(argv, __doc__)
    if argv is None:
        return 0
    try:
        return compare(parse_args(argv))
    except CompareError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    from pipelines.cli import entry
    sys.exit(entry(main))
