"""A run's performance report on demand: `python -m pipelines.perf RUN [run_root=DIR] [--json] [--write]`.

RUN is a dagrl run id (the run directory's name, looked up as `<run_root>/*/<RUN>`, run_root `runs` unless given,
as every command writes it; `--run-root DIR` is the same) or a run directory. The report
is built from the run dir's perf events (`<run dir>/perf/events.jsonl`, written by the Runner as the run goes;
pipelines.runner.perf has the definitions): a run still going, or one that ended without writing its summary, is
reported up to its last event. A run ends by writing the same summary to `<run dir>/perf_summary.json` itself.

Printed: the table the run prints at its end (time per phase: wall seconds, share of the run wall, busy
worker-seconds; env steps/s, update samples/s, peak memory per process role, retries); with --json the summary
as JSON instead. --write also writes it to `<run dir>/perf_summary.json`, under the run dir's lock
(`storage.rundir.lock_run_dir`): refused, one line naming the driver, while the run is live.

Examples:
  python -m pipelines.perf 20261201-151530-98db
  python -m pipelines.perf runs/smoke/20261201-151530-98db --json
  python -m pipelines.perf 20261201-151530-98db run_root=/tmp/runs --write

Exit codes: 0 printed; 2 an unknown run, a run dir without perf events, or --write on a live run (one line
`error: ...` with the fix).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pipelines.runner.perf import EVENTS, format_table, read_events, summarize, write_summary
from storage.rundir import find_run_dir


def run_dir_of(run: str, run_root: str) -> Path:
    """The run directory `run` names: a directory itself, else the run id under `run_root`.

    Raises:
        FileNotFoundError / ValueError: no such run (with close matches), or an id found in several experiments.
    """
    p = Path(run)
    if p.is_dir():
        return p
    return find_run_dir(Path(run_root), run)


def parser():
    """The command's argparse parser (errors are one line: pipelines.cli.ArgumentParser)."""
    from pipelines.cli import ArgumentParser
    ap = ArgumentParser(prog="python -m pipelines.perf", description=__doc__.split("\n\n")[0],
                        epilog=__doc__[__doc__.index("Examples:"):], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", metavar="RUN", help="a dagrl run id or a run directory")
    ap.add_argument("--run-root", default="runs", help=argparse.SUPPRESS)  # run_root=DIR (pipelines.cli.as_flags)
    ap.add_argument("--json", action="store_true", help="print the summary as JSON instead of the table")
    ap.add_argument("--write", action="store_true", help="also write <run dir>/perf_summary.json")
    from pipelines.cli import version
    ap.add_argument("--version", action="version", version=version())
    return ap


def main(argv: list[str] | None = None) -> int:
    """`python -m pipelines.perf RUN [run_root=DIR] [--json] [--write]`; returns the exit code (2: bad input,
    one `error:` line)."""
    from pipelines.cli import parse_words
    args = parse_words(parser(), argv, ("run_root",))
    if isinstance(args, int):  # --help, --version, or one `error:` line (exit 2), as every dagrl command
        return args
    try:
        run_dir = run_dir_of(args.run, args.run_root)
    except (FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}; pass a run id under run_root=DIR or a run directory", file=sys.stderr)
        return 2
    events = read_events(run_dir)
    if not any(e["kind"] == "session" for e in events):
        print(f"error: {run_dir} has no perf events ({run_dir / EVENTS}); runs started before the perf report "
              f"existed have none", file=sys.stderr)
        return 2
    if args.write:  # a write into the run: only with the run's lock (its live driver writes the summary itself)
        from storage.locks import LockBusy
        from storage.rundir import lock_run_dir
        try:
            with lock_run_dir(run_dir):
                summary = write_summary(run_dir)[1]
        except LockBusy as exc:
            print(f"error: --write: {exc} (its driver writes perf_summary.json when it ends; without --write the "
                  f"report is printed)", file=sys.stderr)
            return 2
    else:
        summary = summarize(events)
    print(json.dumps(summary, indent=1, sort_keys=True) if args.json else format_table(summary))
    return 0


if __name__ == "__main__":
    from pipelines.cli import entry
    sys.exit(entry(main))
