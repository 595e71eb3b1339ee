"""What the command-line entry points share (`pipelines.run`, `pipelines.record`, `pipelines.validate`,
`pipelines.replay`, `pipelines.compare`, `pipelines.perf`, `pipelines.eval`).

- `start(argv, doc)`: the command line's words, `doc` printed for `-h`/`--help`, the loggers quietened;
  `overrides_and_flags` also splits them into a few known `--flags` and Hydra overrides (an unknown flag: one line,
  exit 2); `ArgumentParser`: argparse whose errors are one line (`UsageError`), for the commands with options;
- `quiet()`: warnings and the chatty libraries' loggers silenced before anything heavy is imported;
- `load(overrides, **kw)`: the one check path (`pipelines.config.load_config`), a refused config printed as one
  line `error: key=value: fix` (the command exits 2);
- `preflight(cfg, ...)`: the places a run writes to (`run_root`, `tracking.uri`) checked before any worker starts,
  a bad one printed as one line `error: run_root='...': why; fix` / `error: tracking.uri='...': why; fix` (exit 2);
- `with_cluster(cfg, body)`: start the cluster, run the command's body, close the cluster, map the errors a body
  can raise to the exit codes every command documents (2 bad config or cluster, 1 a stalled run or a stopped step,
  130 interrupted: one line, also while the cluster starts or closes; `held_signals` keeps the close whole).
- `SHARED_KEYS`, `as_overrides` / `as_flags`: `run_root=DIR` (and `tracking.uri=URI`) is the one documented
  spelling on every command; `--run-root DIR` (`--tracking-uri URI`) is taken everywhere too;
- `show(overrides)`: `--show`, also of an experiment that leaves required keys `???` (marked, named);
- `entry(main)`: a command's process entry (Ctrl-C and SIGTERM as one line; a closed stdout pipe, `| head`, quiet).

A leaf of `pipelines/`: it imports the modules it needs inside its functions and nothing imports it back from there.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import warnings


class UsageError(ValueError):
    """Bad command-line words (an unknown flag, a bad value); the message is one line with the fix."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse for the commands that take flags (`pipelines.replay`, `pipelines.compare`, `pipelines.perf`,
    `pipelines.eval`): an error is one
    `UsageError` line naming the problem and `--help` (argparse itself prints the usage too, and exits)."""

    def error(self, message):
        raise UsageError(f"{message}; see {self.prog} --help")


def examples(doc: str) -> str:
    """The `Examples:` block of a command's docstring (up to the next blank line), for argparse's epilog."""
    block = doc.split("\nExamples:\n", 1)[1] if "\nExamples:\n" in doc else ""
    return "examples:\n" + block.split("\n\n", 1)[0] if block else ""


def split_flags(argv: list[str], flags: dict[str, str], prog: str) -> tuple[set[str], list[str]]:
    """(the flags given, the overrides) of a Hydra-style command line (`key=value` words and a few `--flags`).
    `flags`: each known flag -> what it does (for the error). Raises UsageError for an unknown flag or a word that
    is neither a flag nor `key=value` (one line: the flags it takes, `--help`)."""
    given, overrides = set(), []
    takes = (f"takes {', '.join(f'{f} ({what})' for f, what in flags.items())} and key=value overrides" if flags
             else "takes key=value overrides only")
    for a in argv:
        if a.startswith("-"):
            if a not in flags:
                from tasks.config import did_you_mean
                hint = did_you_mean(a, list(flags))
                raise UsageError(f"unknown flag {a!r}{f' ({hint})' if hint else ''}; {prog} {takes}; "
                                 f"see {prog} --help")
            given.add(a)
        elif "=" not in a and not a.startswith("~"):  # `~key` deletes a key in Hydra's grammar
            raise UsageError(f"{a!r} is not key=value (Hydra override) or a flag; e.g. conf=smoke runner.max_steps=3;"
                             f" see {prog} --help")
        else:
            overrides.append(a)
    return given, overrides


# Keys more than one command takes, in the one documented spelling `key=value` (pipelines.run's overrides: the
# config's key) -> the flag spelling pipelines.replay, perf and compare took before, still taken by every command.
SHARED_KEYS = {"run_root": "--run-root", "tracking.uri": "--tracking-uri"}


def as_overrides(argv: list[str], prog: str, keys=tuple(SHARED_KEYS)) -> list[str]:
    """The words with `--run-root DIR` / `--run-root=DIR` (the flag of each of `keys`, SHARED_KEYS) written as the
    override `run_root=DIR`: for the commands that take `key=value` words (run, validate, record, eval).
    Raises UsageError for such a flag without its value."""
    flags = {SHARED_KEYS[k]: k for k in keys}
    out, it = [], iter(argv)
    for w in it:
        flag, eq, value = w.partition("=")
        if flag not in flags:
            out.append(w)
            continue
        if not eq:
            value = next(it, None)
            if value is None or value.startswith("-"):
                raise UsageError(f"{flag} needs a value: {flags[flag]}=VALUE (or {flag} VALUE); see {prog} --help")
        out.append(f"{flags[flag]}={value}")
    return out


def as_flags(argv: list[str], keys=tuple(SHARED_KEYS)) -> list[str]:
    """The words with `run_root=DIR` (each of `keys`, SHARED_KEYS, written as an override) as the flag and its
    value, `--run-root DIR`: for the commands whose words argparse parses (replay, perf, compare)."""
    out = []
    for w in argv:
        key, eq, value = w.partition("=")
        out += [SHARED_KEYS[key], value] if eq and key in keys else [w]
    return out


def quiet() -> None:
    """Silence warnings and the loggers of ManiSkill, Dask distributed, alembic and MLflow (errors still show)."""
    warnings.filterwarnings("ignore")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    for name in ("mani_skill", "mani_skill ", "distributed", "alembic", "mlflow"):
        logging.getLogger(name).setLevel(logging.ERROR)
    # MLflow sets its logger to INFO when imported (later than this): its level variable keeps it at ERROR (the
    # first run on a new store printed "INFO mlflow.store.db.utils: Creating initial MLflow database tables...")
    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("PYTHONWARNINGS", "ignore")


def version() -> str:
    """`dagrl X.Y.Z`: the installed distribution's version (importlib.metadata), else, when dagrl is not installed
    (a bare checkout on sys.path), the `version` of pyproject.toml's [project] table beside the package."""
    from importlib import metadata
    try:
        return f"dagrl {metadata.version('dagrl')}"
    except metadata.PackageNotFoundError:
        import re
        from pathlib import Path
        text = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
        project = text.split("[project]", 1)[1].split("\n[", 1)[0]
        found = re.search(r"""^version\s*=\s*["']([^"']+)""", project, re.M)
        return f"dagrl {found.group(1)}"


def asks_version(argv: list[str]) -> bool:
    """True, after printing `version()`, when the words hold `--version` (every command: it then exits 0)."""
    if "--version" in argv:
        print(version())
        return True
    return False


def parse_words(parser: argparse.ArgumentParser, argv: list[str] | None, flags=()):
    """The words (`sys.argv[1:]` when `argv` is None) parsed by `parser` (an `ArgumentParser` of this module, which
    raises UsageError; `key=value` words of `flags`, e.g. ("run_root",), taken as their flags: `as_flags`), or the
    exit code when there is nothing to run: 0 after `-h`/`--help` (the parser's help printed) or `--version`, 2
    after one line `error: ...` on stderr. The argparse commands (export, replay, perf, upgrade) start here."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if {"-h", "--help"} & set(argv):
        parser.print_help()
        return 0
    if asks_version(argv):
        return 0
    try:
        return parser.parse_args(as_flags(argv, flags) if flags else argv)
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def start(argv: list[str] | None, doc: str, more=None) -> list[str] | None:
    """The command's words (`sys.argv[1:]` when `argv` is None), after `quiet()`; None when they ask for help
    (`-h`/`--help`: `doc` printed, then `more()` when given, the command exits 0) or for the version (`--version`:
    `version()` printed)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if {"-h", "--help"} & set(argv):
        print(doc if more is None else f"{doc.rstrip()}\n\n{more()}")
        return None
    if asks_version(argv):
        return None
    quiet()
    return argv


def overrides_and_flags(argv: list[str] | None, doc: str, prog: str,
                        flags: dict[str, str] | None = None) -> tuple[set[str], list[str]] | int:
    """`start` then `split_flags` for the Hydra-style commands (run, validate, record): (flags given, overrides),
    or the exit code when there is nothing to run: 0 after `--help` (the command's text, then the experiments and
    config groups: pipelines.catalog), 2 after one line `error: ...` (an unknown flag, a word that is not
    key=value). `--run-root DIR` / `--tracking-uri URI` are taken as `run_root=DIR` / `tracking.uri=URI`
    (`as_overrides`)."""
    from pipelines.catalog import help_text
    argv = start(argv, doc, help_text)
    if argv is None:
        return 0
    try:
        return split_flags(as_overrides(argv, prog), flags or {}, prog)
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def load(overrides, **kw):
    """`pipelines.config.load_config(overrides, **kw)[0]` (a checked `tasks.config.Config`), or None when the config
    is refused (ConfigError, tasks.envs.errors.SimulatorUnavailable: no Vulkan driver, ...): then one line
    `error: ...` is on stderr and the command exits 2.
    A Ctrl-C that came while it loaded raises KeyboardInterrupt after it (`check_interrupted`)."""
    from pipelines.config import load_config
    from tasks.config import ConfigError
    from tasks.envs.errors import SimulatorUnavailable
    try:
        cfg = load_config(overrides, **kw)[0]
    except (ConfigError, SimulatorUnavailable) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return None
    check_interrupted()
    return cfg


def show(overrides, command: str = "run", *, notes: bool = True) -> int:
    """`--show` of `pipelines.run` / `pipelines.validate`: print the resolved config (stdout) and return 0; an
    experiment that leaves required keys `???` (conf=pushcube_pi0_grpo's policy.model_path) is shown too, those
    keys marked `???` in it (`pipelines.config.missing_required`, `shown_yaml`) and, with `notes`, one line each on
    stderr naming the key and its fix. 2 when the config is refused otherwise (one line `error: ...`)."""
    from pipelines.config import missing_required, shown_yaml
    from tasks.config import ConfigError
    try:
        missing = missing_required(overrides)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    cfg = load([*overrides, *(f"{k}=null" for k in missing)], command=command)
    if cfg is None:
        return 2
    print(shown_yaml(cfg, missing), end="")
    for key, fix in missing.items() if notes else ():
        print(f"note: {key}=??? is required and not given: {fix}", file=sys.stderr)
    return 0


def preflight(cfg, *, tracking: bool = True, writes=None) -> bool:
    """Quick checks of where the command will write, before any worker starts: each `(key, value, directory)` of
    `writes` (default: `run_root` itself) must be a directory that can be created or written
    (`storage.rundir.check_writable_dir`); then, with `tracking`, `tracking.uri` when set
    (`storage.tracking.check_tracking_uri`: an http(s) server must answer its /health
    within `tracking.wait_s` (one `dagrl: waiting for the MLflow server ...` line on stderr while it is still
    starting), a
    sqlite file must be creatable or a complete store of this MLflow's schema, the scheme known), or without
    `tracking.uri` the default sqlite store under `run_root` (reported under `run_root`). False when one fails:
    then one line `error: KEY='VALUE': why; fix` is on stderr (the command exits 2)."""
    from storage.rundir import check_writable_dir
    from storage.tracking import check_tracking_uri
    from tasks.config import ConfigError
    checks = [(key, str(value), check_writable_dir, d) for key, value, d in
              (writes if writes is not None else [("run_root", cfg.run_root, cfg.run_root)])]
    if tracking:  # the store the run logs to: tracking.uri, else the default sqlite file under run_root
        from pipelines.runner.setup import tracking_uri
        key, value = ("tracking.uri", cfg.tracking.uri) if cfg.tracking.uri else ("run_root", cfg.run_root)
        wait = lambda uri: check_tracking_uri(uri, wait_s=cfg.tracking.wait_s,  # noqa: E731 - a server starting
                                              on_wait=lambda line: print(f"dagrl: {line}", file=sys.stderr, flush=True))
        checks.append((key, str(value), wait, tracking_uri(cfg)))
    for key, value, check, arg in checks:
        try:
            check(arg)
        except ValueError as exc:
            print(f"error: {ConfigError(key, value, str(exc))}", file=sys.stderr)
            return False
    return True


class signal_handlers:
    """A context manager (main thread only) that routes SIGINT and SIGTERM to `self.handler(signum, frame)` while
    active and restores the previous handlers on exit; subclasses define `handler`.

    A SIGINT ignored when the context is entered stays ignored: a shell starts the background jobs of a script
    (`cmd &` without job control) with SIGINT ignored so that a Ctrl-C meant for the script's foreground does not
    stop them, and Python keeps that too (no KeyboardInterrupt). Such a run stops on SIGTERM (`kill PID`)."""

    SIGNALS = ("SIGINT", "SIGTERM")

    def handler(self, signum, frame) -> None:
        raise NotImplementedError

    def __enter__(self):
        import signal
        self._old = {}
        for name in self.SIGNALS:
            sig = getattr(signal, name)
            if sig == signal.SIGINT and signal.getsignal(sig) == signal.SIG_IGN:
                continue
            self._old[sig] = signal.signal(sig, self.handler)
        return self

    def __exit__(self, *exc) -> None:
        import signal
        for sig, old in self._old.items():
            signal.signal(sig, old)


class held_signals(signal_handlers):
    """While active: SIGINT and SIGTERM do not interrupt; `name` is the first one that came (None if none). For
    what must not be cut in the middle, the cluster's close (a KeyboardInterrupt there printed a traceback and left
    workers behind)."""

    def __init__(self):
        self.name = None

    def handler(self, signum, frame) -> None:
        import signal
        self.name = self.name or signal.Signals(signum).name


def with_cluster(cfg, body, start=None) -> int:
    """Start the cluster of `cfg` (`start(cfg)`, default `pipelines.clusters.start_cluster`; a sweep passes one that
    hands the same embedded cluster to its jobs, `pipelines.sweep`), run `body(handle) -> exit code`, close the
    cluster. Exit 2 for a cluster that
    cannot start or a ConfigError, DamagedStore or DamagedEvalRecord raised by `body` (one line on stderr), 1 for
    a run with no healthy placement left (`RunStalled`), a step stopped by a non-finite value (`StepFailed`) or a
    run whose run directory or stores were removed under it (`storage.rundir.RunDirGone`), 130 when interrupted
    (SIGTERM too).

    Interrupted (Ctrl-C, SIGTERM) while the cluster starts, while `body` runs (outside the body's own handling:
    pipelines.run's graceful stop) or while the cluster closes: one line on stderr, exit 130. The embedded
    cluster's workers ignore SIGINT (`pipelines.worker_preload`), so a terminal's Ctrl-C, which reaches the whole
    process group, prints no worker traceback; the close itself is not cut short (`held_signals`)."""
    import signal
    from pipelines.clusters import start_cluster
    from pipelines.runner.watcher import RunStalled
    from pipelines.runner.scheduler import StepFailed
    from storage.rundir import RunDirGone
    from storage.trajectories import DamagedStore
    from tasks.config import ConfigError
    from tasks.envs.errors import SimulatorUnavailable
    from tasks.evalstats import DamagedEvalRecord

    def _term(signum, frame):  # SIGTERM (timeout, kill, schedulers) ends the run like Ctrl-C: MLflow run KILLED
        _interrupted.append("SIGTERM")  # recorded like a Ctrl-C (check_interrupted)
        raise KeyboardInterrupt

    old_term = signal.signal(signal.SIGTERM, _term)
    try:
        try:
            handle = (start or start_cluster)(cfg)
        except (ConnectionError, ConfigError, SimulatorUnavailable) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            print("interrupted while the cluster was starting; nothing was run", file=sys.stderr)
            return 130
        if getattr(handle, "note", None):  # e.g. the dashboard's port fallback (a busy 8787)
            print(f"dagrl: {handle.note}", file=sys.stderr, flush=True)
        try:
            check_interrupted()  # one that came while it started and was swallowed there
        except KeyboardInterrupt:
            with held_signals():
                handle.close()
            print("interrupted while the cluster was starting; nothing was run", file=sys.stderr)
            return 130
        try:
            rc = body(handle)
        except (ConfigError, DamagedStore, DamagedEvalRecord) as exc:  # damaged data read mid-run: one line
            print(f"error: {exc}", file=sys.stderr)
            rc = 2
        except (RunStalled, StepFailed, RunDirGone) as exc:  # no healthy placement left (recovery), a non-finite
            print(f"error: {exc}", file=sys.stderr)  # value stopped a step (scheduler), the run dir was removed
            rc = 1  # under the run (Runner.run): one line, exit 1
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            rc = 130
            # the Ctrl-C may have cut a client call mid-way: distributed's cancel callback for it then fails in the
            # io loop while the cluster closes, which tornado logs as a ~10-line ERROR (seen under load): noise now
            import logging
            logging.getLogger("tornado.application").setLevel(logging.CRITICAL)
        except BaseException:  # a Ctrl-C a library turned into its own error included: `entry` reports it
            with held_signals():
                handle.close()
            raise
        with held_signals() as held:
            handle.close()
        if held.name is not None and rc != 130:  # the run had ended; the interrupt came while closing
            print(f"interrupted ({held.name}) while the cluster was closing (the run had ended with exit code "
                  f"{rc}); the cluster is closed", file=sys.stderr)
            rc = 130
        return rc
    finally:
        signal.signal(signal.SIGTERM, old_term)


_interrupted: list[str] = []  # the signals `_on_interrupt` took in this process (the entry's handler)


def _on_interrupt(signum, frame) -> None:
    """The entry's SIGINT handler: remember it, then raise KeyboardInterrupt as Python's own handler does."""
    import signal
    _interrupted.append(signal.Signals(signum).name)
    raise KeyboardInterrupt


def interrupted_by() -> str | None:
    """The first signal the entry's handler took in this process (`SIGINT`), or None."""
    return _interrupted[0] if _interrupted else None


def check_interrupted() -> None:
    """Raise KeyboardInterrupt when a Ctrl-C reached this process's entry handler (`entry`) before, also when the
    KeyboardInterrupt it raised was swallowed on its way: trimesh (imported with ManiSkill while the config is
    checked) wraps its optional imports in `except BaseException`, so a Ctrl-C that lands there vanished and the
    run went on (seen 2026-12-04). Called where the commands pass after their heavy imports: `load`,
    `with_cluster`, pipelines.validate, pipelines.eval, pipelines.replay."""
    if _interrupted:
        raise KeyboardInterrupt


def entry(main) -> int:
    """`main()` as a command's process entry (`sys.exit(entry(main))`): a Ctrl-C (KeyboardInterrupt) that reaches
    it — while modules import or the config loads, before any handler of the command is in place — is one line
    `interrupted` on stderr and exit 130, not a traceback. Its SIGINT handler also records the Ctrl-C for
    `check_interrupted` (a SIGINT ignored at start stays ignored: `signal_handlers`). A SIGTERM (`timeout`, `kill`,
    a batch scheduler) is taken the same way while its handler is the default one (it killed the process silently,
    exit 143, before `with_cluster` put its own in place). An exception after a recorded Ctrl-C (a library turned
    the KeyboardInterrupt into its own error) is one line `interrupted (ErrorType after the Ctrl-C)`, exit 130.
    A reader of stdout that went away (`| head`) ends the command quietly, exit 141 (`_closed_pipe`)."""
    import signal
    _interrupted.clear()
    old = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    mine = [sig for sig, h in old.items() if h is (signal.default_int_handler if sig == signal.SIGINT
                                                     else signal.SIG_DFL)]
    for sig in mine:
        signal.signal(sig, _on_interrupt)
    old_hook = sys.unraisablehook
    sys.unraisablehook = lambda unraisable: _quiet_unraisable_interrupt(unraisable, old_hook)
    try:
        rc = main()
        sys.stdout.flush()  # a reader gone (`| head`) shows here, not in the interpreter's flush at exit
        return rc
    except BrokenPipeError:
        return _closed_pipe()
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        if not _interrupted:
            raise
        # a Ctrl-C reached this process before and a library turned it into its own error on the way out (a
        # database driver's, a comm's): the command was interrupted, not broken
        print(f"interrupted ({type(exc).__name__} after the Ctrl-C)", file=sys.stderr)
        return 130
    finally:
        sys.unraisablehook = old_hook
        for sig in mine:
            signal.signal(sig, old[sig])


def _closed_pipe() -> int:
    """stdout's reader went away (`python -m pipelines.validate --help | head`): no traceback; stdout is pointed
    at /dev/null so the interpreter's flush at exit does not fail again ("Exception ignored ... BrokenPipeError",
    the Python docs' recipe for SIGPIPE), and the exit code is 141, a shell's for a command a closed pipe stopped
    (128 + SIGPIPE), as `git log | head` gives."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # stdout is not a file (a test's capture): nothing is flushed at exit
        pass
    return 141


def _quiet_unraisable_interrupt(unraisable, default) -> None:
    """`sys.unraisablehook` while `entry` runs: a KeyboardInterrupt our handler raised where Python cannot pass it
    on (a gc callback, e.g. distributed's GCDiagnosis; a `__del__`) printed "Exception ignored in ..." with a
    traceback (seen 2026-12-05: a Ctrl-C ~0.7 s after `dagrl: experiment`); the Ctrl-C is recorded in
    `_interrupted` and acted on at the next `check_interrupted` / `graceful_stop`, so it is not reported. Anything
    else goes to `default` (the hook that was in place)."""
    if isinstance(unraisable.exc_value, KeyboardInterrupt) and _interrupted:
        return
    default(unraisable)
