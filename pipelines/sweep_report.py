"""A sweep's report: `python -m pipelines.compare --sweep ID [--threshold 0.8] [--metric KEY] [--png PATH]
[--run-root DIR | --tracking-uri URI]` (pipelines.compare parses the command line and calls `report_sweep`).

The runs are the active MLflow runs tagged `dagrl.sweep=ID` (pipelines.sweep; a resumed or rolled-back run is read
from its newest timeline, which carries the tags too), the jobs and their status from `<run_root>/sweeps/ID/
sweep.json` when it is there. Runs are grouped into configurations by their swept values other than `seed`
(tags `dagrl.swept.<key>`), and per configuration the report prints, over its seeds (tasks.seedstats: the mean with
a two-sided Student-t 95 % interval, `mean [low, high]`; one seed: no interval):

  final   the metric at the run's last logged step (default `eval/success_once`, the eval's success rate);
  best    its maximum over the run's evals (finite values only);
  steps to THRESHOLD / wall s to THRESHOLD   the first training step whose value is >= THRESHOLD, and the seconds
          from the MLflow run's start to that eval being logged, over the runs that reached it; the runs that never
          did are counted beside (`2 of 3 reached`), never averaged in;
  paired differences   for each pair of configurations, B - A over the seeds both ran (the per-seed difference's
          t interval: the seed's shared part cancels), for final and best;
  a curve plot (matplotlib, Agg): the metric against step per configuration, the mean over seeds with its t 95 %
          band (steps every seed of it logged) and each seed thin; written to --png, else `<sweep dir>/curves.png`.

Failed, interrupted and unrun jobs (sweep.json) are listed with their one-line reason.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from tasks.seedstats import Interval, paired_difference, t_interval

SEED_KEY = "seed"


class SweepReportError(ValueError):
    """A sweep that cannot be reported (unknown id, no run, a store that cannot be read); one line with the fix."""


@dataclass
class RunPoints:
    """One run of the sweep: its configuration label, seed, run id and the metric's points (step, value, ms)."""

    label: str
    seed: str
    run_id: str
    dagrl_id: str
    start_ms: int
    points: list[tuple[int, float, int]]

    @property
    def final(self) -> float:
        return self.points[-1][1] if self.points else math.nan

    @property
    def best(self) -> float:
        finite = [v for _, v, _ in self.points if math.isfinite(v)]
        return max(finite) if finite else math.nan

    def reach(self, threshold: float) -> tuple[int, float] | None:
        """(step, seconds since the run's start) of the first point >= `threshold`, None if never reached."""
        for step, v, ts in self.points:
            if math.isfinite(v) and v >= threshold:
                return step, (ts - self.start_ms) / 1000.0
        return None


def config_label(swept: dict[str, str], keys: list[str]) -> str:
    """`algorithm.lr=1e-4 env.num_envs=8` from a run's swept values (the keys other than seed, in sweep order);
    `(all runs)` when only the seed is swept."""
    return " ".join(f"{k}={swept[k]}" for k in keys if k != SEED_KEY and k in swept) or "(all runs)"


def stats(runs: list[RunPoints], threshold: float | None) -> dict[str, object]:
    """Per configuration: {"final": Interval, "best": Interval, and with a threshold "steps", "wall" (Interval over
    the runs that reached it), "reached" (how many did)}."""
    out: dict[str, object] = {"final": t_interval([r.final for r in runs]),
                              "best": t_interval([r.best for r in runs])}
    if threshold is not None:
        hits = [h for h in (r.reach(threshold) for r in runs) if h is not None]
        out.update(steps=t_interval([h[0] for h in hits]), wall=t_interval([h[1] for h in hits]), reached=len(hits))
    return out


def format_report(sweep_id: str, groups: dict[str, list[RunPoints]], metric: str, threshold: float | None,
                  jobs=None) -> str:
    """The printed report (module docstring). `groups`: configuration label -> its runs (seed order); `jobs`: the
    sweep record's jobs (pipelines.sweep.Job) or None."""
    n_runs = sum(len(v) for v in groups.values())
    lines = [f"sweep {sweep_id}: {n_runs} run(s) in {len(groups)} configuration(s); {metric}: mean over seeds "
             f"[Student-t 95 % interval]"]
    for label, runs in groups.items():
        seeds = ", ".join(r.seed for r in runs)
        lines.append(f"  {label}: {len(runs)} seed(s) ({seeds}); runs {', '.join(r.dagrl_id for r in runs)}")
        s = stats(runs, threshold)
        rows = [(f"final {metric}", s["final"].text()), (f"best {metric}", s["best"].text())]
        if threshold is not None:
            note = f"({s['reached']} of {len(runs)} reached; {len(runs) - s['reached']} never)"
            rows += [(f"steps to {threshold:g}", f"{s['steps'].text('.1f')} {note}"),
                     (f"wall s to {threshold:g}", f"{s['wall'].text('.1f')} {note}")]
        width = max(len(name) for name, _ in rows)
        lines += [f"    {name:<{width}}  {text}" for name, text in rows]
    labels = list(groups)
    if len(labels) > 1:
        lines.append("paired differences (B - A over the seeds both ran; Student-t 95 % interval):")
        for i, a in enumerate(labels):
            for b in labels[i + 1:]:
                for what in ("final", "best"):
                    d = paired_difference({r.seed: getattr(r, what) for r in groups[a]},
                                          {r.seed: getattr(r, what) for r in groups[b]})
                    lines.append(f"  {what:<5} [{b}] - [{a}]: {d.text('+.3f')} over {d.n} shared seed(s)")
    unfinished = [j for j in jobs or [] if j.status != "finished"]
    if unfinished:
        lines.append("jobs that did not finish (sweep.json):")
    for j in unfinished:
        if j.status != "finished":
            lines.append(f"  job {j.index} {j.label()}: {j.status}" + (f": {j.reason}" if j.reason else ""))
    return "\n".join(lines)


def plot(path: Path, groups: dict[str, list[RunPoints]], metric: str, threshold: float | None) -> Path:
    """The curves PNG (module docstring). Returns `path`."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for i, (label, runs) in enumerate(groups.items()):
        color = f"C{i % 10}"
        for r in runs:
            ax.plot([p[0] for p in r.points], [p[1] for p in r.points], color=color, alpha=0.3, lw=0.8)
        steps = sorted(set.intersection(*({p[0] for p in r.points} for r in runs))) if runs else []
        by = [{p[0]: p[1] for p in r.points} for r in runs]
        iv: list[Interval] = [t_interval([b[s] for b in by]) for s in steps]
        ax.plot(steps, [v.mean for v in iv], color=color, lw=2, marker=".", label=f"{label} (n={len(runs)})")
        if len(runs) > 1:
            ax.fill_between(steps, [v.low for v in iv], [v.high for v in iv], color=color, alpha=0.2)
    if threshold is not None:
        ax.axhline(threshold, color="grey", ls="--", lw=0.8)
    ax.set_xlabel("training step")
    ax.set_ylabel(metric)
    ax.set_title("mean over seeds, band: Student-t 95 % interval; thin: each seed", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def report_sweep(sweep_id: str, *, run_root: str, tracking_uri: str | None, metric: str,
                 threshold: float | None, png: str | None, echo=print) -> int:
    """Print the report of sweep `sweep_id` and write its plot; returns 0.

    Raises:
        SweepReportError: no sweep of that id (neither a sweep directory under `run_root` nor a tagged run in the
            store), a store that cannot be read, a metric none of its runs logged, a --png directory missing.
    """
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient
    from pipelines.sweep import Sweep, sweep_dir
    from storage.tracking import check_tracking_uri, default_tracking_uri
    where = sweep_dir(run_root, sweep_id)
    record = None
    if (where / "sweep.json").is_file():
        try:
            record = Sweep.read(where / "sweep.json")
        except ValueError as exc:
            raise SweepReportError(f"--sweep={sweep_id!r}: {exc}") from None
    uri = tracking_uri or (record.tracking_uri if record else default_tracking_uri(Path(run_root).resolve()))
    try:
        check_tracking_uri(uri, must_exist=True)
        client = MlflowClient(uri)
        runs = _tagged_runs(client, sweep_id)
    except (ValueError, MlflowException) as exc:
        raise SweepReportError(f"--sweep={sweep_id!r}: tracking store {uri} cannot be read ({str(exc).splitlines()[0]}"
                               f"); pass the store the sweep logged to (--run-root / --tracking-uri)") from None
    if not runs:
        known = sorted(p.name for p in (Path(run_root).resolve() / "sweeps").glob("*") if p.is_dir())
        raise SweepReportError(f"--sweep={sweep_id!r}: no run tagged with this sweep in {uri} (sweeps under "
                               f"{Path(run_root).resolve() / 'sweeps'}: {', '.join(known[-5:]) or 'none'}); pass the "
                               f"id `pipelines.run -m` printed and its --run-root")
    keys = record.swept_keys if record else sorted({k for r in runs for k in _swept(r)})
    if not any(metric in r.data.metrics for r in runs):
        raise SweepReportError(f"--metric={metric!r}: no run of sweep {sweep_id} logged it; e.g. "
                               f"{', '.join(sorted(runs[0].data.metrics)[:4])}")
    groups = group_runs(client, runs, keys, metric)
    echo(format_report(sweep_id, groups, metric, threshold, record.jobs if record else None))
    out = Path(png) if png else (where / "curves.png" if where.is_dir() else None)
    if out is not None:
        if not out.resolve().parent.is_dir():
            raise SweepReportError(f"--png={png!r}: its directory does not exist; create it or write elsewhere")
        echo(f"plot: {plot(out, groups, metric, threshold)}")
    return 0


def _swept(run) -> dict[str, str]:
    from storage.tracking import SWEPT_TAG_PREFIX
    return {k[len(SWEPT_TAG_PREFIX):]: v for k, v in run.data.tags.items() if k.startswith(SWEPT_TAG_PREFIX)}


def _tagged_runs(client, sweep_id: str) -> list:
    from mlflow.entities import ViewType
    from storage.tracking import SWEEP_TAG
    ids = [e.experiment_id for e in client.search_experiments(view_type=ViewType.ACTIVE_ONLY)]
    quoted = sweep_id.replace("'", "\\'")
    return client.search_runs(ids, filter_string=f"tags.`{SWEEP_TAG}` = '{quoted}'", run_view_type=ViewType.ACTIVE_ONLY,
                              order_by=["attributes.start_time ASC"], max_results=50000) if ids else []


def group_runs(client, runs, keys: list[str], metric: str) -> dict[str, list[RunPoints]]:
    """{configuration label: its runs sorted by seed}, configurations in the order of their first run."""
    from storage.tracking import RUN_ID_TAG, metric_history
    groups: dict[str, list[RunPoints]] = {}
    for r in runs:
        swept = _swept(r)
        seed = swept.get(SEED_KEY) or r.data.params.get(SEED_KEY, "?")
        pts = metric_history(client, r.info.run_id, metric) if metric in r.data.metrics else []
        groups.setdefault(config_label(swept, keys), []).append(
            RunPoints(config_label(swept, keys), seed, r.info.run_id, r.data.tags.get(RUN_ID_TAG, r.info.run_id),
                      r.info.start_time or (pts[0][2] if pts else 0), pts))
    for v in groups.values():
        v.sort(key=lambda p: (len(p.seed), p.seed))
    return groups
