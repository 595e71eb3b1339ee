"""Every `python -m pipelines.<cli> ...` command line in README.md and docs/**/*.md code blocks is parsed and its
config validated, so that a renamed key or flag fails here, not for the user.

A command line is a code block's line (a `\\` continues it on the next), from the `python -m pipelines.X` words to
the end of that command (`&&`, `;`, `|` or a `# comment` end it); what comes before is left out (`.venv/bin/`, a
`./scripts/setup.sh &&`, `VAR=value` prefixes, a `$ ` prompt). Per command:
  - run, validate, record: `pipelines.config.load_config(overrides, command=..., components=False)`, the check path
    of `pipelines.validate` less the components (the simulator, the machine, the files of a checkpoint or a
    store): Hydra's grammar, the schema (unknown keys, types), the combinations and the set-but-inert keys. A `-m`
    sweep: each job of its grid (`pipelines.sweep.expand`). The files the combination checks require (a store's
    `zarr.json` for `sft.store`, a checkpoint's `config.json` for `policy.model_path`: a guide makes them earlier)
    are made as empty stubs under a temporary working directory (an absolute path is moved under it);
  - eval: its argparse words, then `pipelines.eval.eval_config` of a run whose config.yaml is the default
    experiment's (a stand-in for RUN_DIR; with `conf=` an hf dir stub), components left out as above;
  - the other commands (replay, compare, perf, export, upgrade, ...): their argparse words (no config keys).
A command whose next line in the block starts with `error: KEY=` shows a refusal: it must be refused naming KEY.
Skipped, with the reason, and asserted few: a placeholder where the config needs a real value (`conf=NAME`, an
absolute path a conf file sets), a command that needs CUDA on a machine without, a refusal shown in a doc that
only a component check makes. `usage:` lines (argparse's) are not commands.
"""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PLACEHOLDER = re.compile(r"\b[A-Z][A-Z0-9]*(?:_[A-Z0-9]+)*\b|<[^>]+>")  # NAME, RUN_DIR, <run_id>
GENERIC = {"...", "key=value", "KEY=VALUE", "[key=value", "...]", "[key=value ...]"}
OPERATORS = {"&&", "||", ";", "|", "&", ">", ">>", "<", "2>", "2>&1", "(", ")"}
MAX_SKIPPED = 0.2  # the share of command lines that may be skipped for a placeholder


def doc_files(root: Path = ROOT) -> list[Path]:
    """README.md and every markdown page under docs/."""
    return [p for p in [root / "README.md", *sorted((root / "docs").rglob("*.md"))] if p.is_file()]


def code_lines(text: str) -> list[tuple[int, str]]:
    """(1-based line number, logical line) of the fenced code blocks of markdown `text` (``` or ~~~ fences;
    a line ending in `\\` joined with the next; argparse's `usage:` lines left out)."""
    out, fence, pending = [], None, None
    for n, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if fence is None:
            m = re.match(r"(`{3,}|~{3,})", stripped)
            if m:
                fence = m.group(1)
            continue
        if stripped.startswith(fence):
            fence = None
            if pending:
                out.append(pending)
            pending = None
            continue
        if pending is not None:
            pending = (pending[0], pending[1] + " " + stripped)
        else:
            pending = (n, stripped)
        if pending[1].endswith("\\"):
            pending = (pending[0], pending[1][:-1].rstrip())
        else:
            out.append(pending)
            pending = None
    return [(n, line) for n, line in out if not line.startswith("usage:")]


def commands(line: str) -> list[tuple[str, list[str]]]:
    """The dagrl commands of one shell line: [(cli name, its words)] (module docstring)."""
    try:
        lex = shlex.shlex(line, posix=True, punctuation_chars=True)
        lex.whitespace_split, lex.commenters = True, ""
        words = list(lex)
    except ValueError:  # an unclosed quote: not shell
        return []
    if "#" in [w[:1] for w in words]:
        words = words[:[w[:1] for w in words].index("#")]
    out = []
    for i, w in enumerate(words[:-2]):
        if (w == "python" or re.fullmatch(r"(.*/)?python3?(\.\d+)?", w)) and words[i + 1] == "-m" \
                and words[i + 2].startswith("pipelines."):
            rest = words[i + 3:]
            end = next((j for j, x in enumerate(rest) if x in OPERATORS), len(rest))
            out.append((words[i + 2].split(".", 1)[1], rest[:end]))
    return out


class Skip(Exception):
    """A command line that cannot be checked here (a placeholder the config needs real), with the reason."""


def _stub_missing(exc, cwd: Path, overrides: list[str]) -> bool:
    """Make the file a combination check found missing (ConfigError of sft.store / policy.model_path) under `cwd`:
    a relative path as it is, an absolute one (`/path/to/ckpt`) moved under `cwd` in `overrides`; False when it is
    not such an error."""
    key, value = getattr(exc, "key", None), getattr(exc, "value", None)
    wanted = {"sft.store": "zarr.json", "policy.model_path": "config.json"}
    if key not in wanted or not isinstance(value, str) or "???" in value:
        return False
    path, moved = Path(value), False
    if path.is_absolute() and not path.resolve().is_relative_to(cwd.resolve()):
        given = [i for i, o in enumerate(overrides) if o.lstrip("+").split("=", 1) == [key, value]]
        if not given:
            raise Skip(f"{key}={value}: an absolute path that is not here, set by a conf file")
        path, moved = cwd / value.lstrip("/"), True
        overrides[given[0]] = f"{key}={path}"
    target = (cwd / path / wanted[key])
    if target.exists():
        return moved
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text("{}")
    return True


def _load(overrides: list[str], command: str, cwd: Path):
    """load_config without components, stubbing the files the combination checks need (at most a few)."""
    from pipelines.config import load_config
    from tasks.config import ConfigError
    overrides = list(overrides)
    for _ in range(4):
        try:
            return load_config(overrides, command=command, components=False, notes=[])[0]
        except ConfigError as exc:
            if not _stub_missing(exc, cwd, overrides):
                raise
    raise AssertionError(f"still missing files after stubbing: {overrides}")


def _fake_run(cwd: Path) -> Path:
    """A run directory whose config.yaml is the default experiment's (what eval reads of a run), made once."""
    run = cwd / "fake_run"
    if not (run / "config.yaml").is_file():
        from pipelines.config import to_yaml
        from storage.rundir import write_resolved_config
        write_resolved_config(run, to_yaml(_load([f"run_root={cwd / 'runs'}"], "run", cwd)))
    return run


def _as_flags(words: list[str], parser) -> list[str]:
    """`key=value` words as `--key value` where `parser` has that option (`run_root=DIR`: `--run-root DIR`, as the
    commands that take both read them)."""
    out = []
    for w in words:
        key, eq, value = w.partition("=")
        flag = "--" + key.replace("_", "-")
        out += [flag, value] if eq and not w.startswith("-") and flag in parser._option_string_actions else [w]
    return out


def check(cli: str, words: list[str], cwd: Path, monkeypatch) -> None:
    """Parse and validate one command (module docstring). Raises its error, or Skip."""
    words = [w for w in words if w not in GENERIC]
    if cli == "run":  # `--jobs N` / `-j N` (a sweep's jobs side by side) is the one flag with a value word
        from pipelines.sweep_jobs import jobs_flag
        words, _ = jobs_flag(words)
    overrides = [w for w in words if not w.startswith("-")]
    for w in overrides:
        key, _, value = w.partition("=")
        if key.lstrip("+~") == "conf" and PLACEHOLDER.fullmatch(value):
            raise Skip(f"{w}: a placeholder experiment")
    if cli in ("run", "validate", "record"):
        from pipelines.config import command_for
        bad = [w for w in words if w.startswith("-") and w not in ("--show", "--connect", "-m", "--multirun")]
        assert not bad, f"unknown flags {bad}"
        if {"-m", "--multirun"} & set(words):
            from pipelines.sweep import expand
            jobs = [j.overrides for j in expand(overrides)[0]]
        else:
            jobs = [overrides]
        for job in jobs:
            _load(job, "record" if cli == "record" else (command_for(job) if cli == "validate" else "run"), cwd)
    elif cli == "eval":
        import pipelines.config
        from pipelines import eval as ev
        args = ev.parse_args(words)
        monkeypatch.setattr(pipelines.config, "check_components", lambda *a, **k: None)  # the simulator's
        if any(o.split("=", 1)[0] == "conf" for o in args.overrides):
            hf = cwd / "hf_stub"
            hf.mkdir(exist_ok=True)
            (hf / "config.json").write_text("{}")
            _load([*args.overrides, f"policy.model_path={hf}"], "run", cwd)
        else:
            run = _fake_run(cwd)
            src = ev.Source(args.source, run_dir=run, checkpoint=run / "checkpoints" / "global_step_1", step=1)
            ev.eval_config(src, args.overrides)
    else:  # the commands without config keys: their argparse words
        import importlib

        from pipelines.reference import cli_modules
        assert cli in cli_modules(), f"no command pipelines.{cli}"
        mod = importlib.import_module(f"pipelines.{cli}")
        make = getattr(mod, "_parser", None) or getattr(mod, "parser", None)
        if make is not None:  # replay, perf, export, ...
            make().parse_args(_as_flags(words, make()))
        elif hasattr(mod, "parse_args"):  # compare
            mod.parse_args(words)
        elif cli == "upgrade":  # its parser is built inside main
            assert len([w for w in words if not w.startswith("-")]) <= 2, "upgrade takes RUN_DIR [--run-root DIR]"


def check_docs(files: list[Path], cwd: Path, monkeypatch) -> tuple[int, list[str], list[str]]:
    """(commands checked, failures 'file:line: command: error', skips 'file:line: reason')."""
    monkeypatch.chdir(cwd)
    n, failed, skipped, seen = 0, [], [], {}
    for path in files:
        rel = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
        lines = code_lines(path.read_text())
        for k, (line_no, line) in enumerate(lines):
            shown = re.match(r"error: ([\w.+~\-]+)=", lines[k + 1][1]) if k + 1 < len(lines) else None
            for cli, words in commands(line):
                n += 1
                where = f"{rel}:{line_no}: python -m pipelines.{cli} {' '.join(words)}"
                try:
                    if (cli, *words) in seen:  # the same command elsewhere: the same outcome
                        if seen[(cli, *words)] is not None:
                            raise seen[(cli, *words)]
                    else:
                        seen[(cli, *words)] = None
                        try:
                            check(cli, words, cwd, monkeypatch)
                        except (Exception, SystemExit) as exc:
                            seen[(cli, *words)] = exc
                            raise
                except Skip as exc:
                    skipped.append(f"{where}: {exc}")
                except (Exception, SystemExit) as exc:  # noqa: BLE001 - every refusal is the doc's fault
                    text = " ".join(str(exc).split())
                    if "no CUDA device" in text:
                        skipped.append(f"{where}: needs CUDA ({text})")
                    elif shown is None or getattr(exc, "key", None) != shown.group(1):
                        failed.append(f"{where}: {type(exc).__name__}: {text}"
                                      + (f" (the doc shows a refusal of {shown.group(1)})" if shown else ""))
                else:
                    if shown is not None:
                        skipped.append(f"{where}: the doc shows a refusal of {shown.group(1)} that only a component "
                                       f"check makes (the simulator, the machine, the files), not run here")
    return n, failed, skipped


def test_command_lines_are_found_as_a_shell_reads_them():
    text = "\n".join([
        "```bash", "./scripts/setup.sh && .venv/bin/python -m pipelines.run conf=smoke  # the smoke run",
        "MUJOCO_GL=egl python -m pipelines.validate \\", "    conf=smoke \\", "    runner.max_steps=2",
        "python -m pipelines.compare RUN_A RUN_B | tee x.txt", "pip install dagrl", "```",
        "python -m pipelines.run outside=a_block", "~~~", "$ python3 -m pipelines.replay RUN --video a.mp4", "~~~"])
    got = [(n, c) for n, line in code_lines(text) for c in commands(line)]
    assert got == [(2, ("run", ["conf=smoke"])), (3, ("validate", ["conf=smoke", "runner.max_steps=2"])),
                   (6, ("compare", ["RUN_A", "RUN_B"])), (11, ("replay", ["RUN", "--video", "a.mp4"]))]


def test_a_renamed_key_or_flag_in_a_doc_fails(tmp_path, monkeypatch):
    """The check refuses what a user would be refused: a key the schema lacks, a flag a command lacks."""
    page = tmp_path / "page.md"
    page.write_text("```\npython -m pipelines.run conf=smoke runner.max_stepz=3\n"
                    "python -m pipelines.replay RUN --vidoe a.mp4\n"
                    "python -m pipelines.eval RUN_DIR env.eval.num_episodez=4\n"
                    "python -m pipelines.run conf=smoke runner.max_steps=3\n"
                    "$ python -m pipelines.run conf=smoke env.num_envs=7\n"  # a refusal shown as one: fine
                    "error: env.num_envs=7: must be divisible\n"
                    "$ python -m pipelines.run conf=smoke env.num_envs=8 seed=-1\n"  # refused for another key
                    "error: env.num_envs=8: must be divisible\n```\n")
    n, failed, skipped = check_docs([page], tmp_path, monkeypatch)
    assert n == 6 and not skipped and len(failed) == 4, failed
    assert "runner.max_stepz" in failed[0] and "--vidoe" in failed[1] and "num_episodez" in failed[2]
    assert "seed=" in failed[3] and "shows a refusal of env.num_envs" in failed[3]


def test_every_doc_command_validates(tmp_path, monkeypatch):
    files = doc_files()
    n, failed, skipped = check_docs(files, tmp_path, monkeypatch)
    assert n > 0, f"no `python -m pipelines.<cli>` command in {[str(f) for f in files]}"
    assert not failed, f"{len(failed)} of {n} doc commands are refused:\n" + "\n".join(failed)
    assert len(skipped) <= MAX_SKIPPED * n, f"{len(skipped)} of {n} doc commands skipped:\n" + "\n".join(skipped)
