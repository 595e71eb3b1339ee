"""The generated reference pages (docs/reference/, `pipelines.reference`) are current, complete and honest, and every
command prints its version."""
import dataclasses
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import ClassVar, Optional

import pytest

from pipelines import reference as ref

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def generated():
    """{relative path: text} of every reference page, generated once in memory."""
    return ref.pages()


def test_reference_pages_are_current(generated):
    """A page that differs from what the code generates now is stale: `python -m pipelines.reference` rewrites it."""
    stale = [str(rel) for rel, text in generated.items()
             if not (ROOT / rel).is_file() or (ROOT / rel).read_text() != text]
    assert not stale, f"stale reference pages {stale}: run `python -m pipelines.reference`"


def test_check_names_a_stale_page_and_exits_1(tmp_path, monkeypatch, capsys, generated):
    """--check compares the files under ROOT: a copy of the pages with one edited line fails, naming that page only."""
    for rel, text in generated.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    monkeypatch.setattr(ref, "ROOT", tmp_path)
    monkeypatch.setattr(ref, "pages", lambda: generated)
    assert ref.main(["--check"]) == 0
    page = ref.REFERENCE / "config.md"
    (tmp_path / page).write_text(generated[page].replace("| `seed` |", "| `sead` |"))
    assert ref.main(["--check"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(page) in err[0] and "stale" in err[0]


def _all_keys(cls, prefix=""):
    """Every dotted key of config class `cls` (nested sections walked), from the dataclass fields."""
    for f in dataclasses.fields(cls):
        default = ref._default(f)
        if dataclasses.is_dataclass(default):
            yield from _all_keys(type(default), f"{prefix}{f.name}.")
        else:
            yield prefix + f.name


def test_config_page_lists_every_key_of_every_family(generated):
    """Each key of the schema and of every registered family class has its own row, once."""
    from tasks.config.registry import SELECTORS, families
    from tasks.config.schema import Config
    page = generated[ref.REFERENCE / "config.md"]
    rows = re.findall(r"^\| `([a-z_.0-9]+)` \|", page, re.M)
    want = set(_all_keys(Config))
    for section in SELECTORS:
        for cls in families(section).values():
            want |= {f"{section}.{k}" for k in _all_keys(cls)}
    assert len(rows) == len(set(rows)), "a key listed twice"
    assert set(rows) == want


@dataclasses.dataclass(frozen=True)
class Sample:
    """A class in the layouts of the schema's comments (not a config section of dagrl)."""

    a: int = 1  # trailing of a
    # continued here
    b: int = 2  # b's own
    # ----- group title -----
    c: int = 3
    # leading of d
    d: str = "x"
    f: str = "y"  # ends unfinished (continued
    # below)
    g: int = 0
    h: int = 0  # h's comment
    # continues h

    i: int = 1
    K: ClassVar[int] = 0  # a class constant, not a key
    e: Optional[int] = None  # last field,
    # continued after it


def test_field_comments_are_read_from_the_source():
    """Trailing, continued and leading comments, group titles, fields without any (`field_docs` on `Sample`)."""
    docs = ref.field_docs(Sample)
    assert list(docs) == ["a", "b", "c", "d", "f", "g", "h", "i", "e"]  # ClassVars are no keys
    assert docs["a"].doc == "trailing of a continued here"  # b has its own: the line between is a's
    assert (docs["b"].doc, docs["b"].group) == ("b's own", "")
    assert (docs["c"].doc, docs["c"].group) == ("", "group title")  # no comment: said so on the page
    assert (docs["d"].doc, docs["d"].group) == ("leading of d", "group title")
    assert docs["f"].doc == "ends unfinished (continued below)" and docs["g"].doc == ""
    assert docs["h"].doc == "h's comment continues h" and docs["i"].doc == ""  # a blank line parts i from it
    assert docs["e"].doc == "last field, continued after it" and docs["e"].annotation == "Optional[int]"


def test_every_command_is_listed_with_its_help(generated):
    """cli.md holds each `python -m pipelines.X` module's --help (those with a __main__ block or __main__.py)."""
    page = generated[ref.REFERENCE / "cli.md"]
    mains = {p.stem for p in (ROOT / "pipelines").glob("*.py") if 'if __name__ == "__main__":' in p.read_text()}
    mains |= {p.parent.name for p in (ROOT / "pipelines").glob("*/__main__.py")}
    assert set(ref.cli_modules()) == mains
    for name in mains:
        assert f"\n## python -m pipelines.{name}\n" in page


def test_trajectory_page_is_the_spec_rendering(generated):
    from tasks import trajectory
    page = generated[ref.REFERENCE / "trajectory.md"]
    assert page.split(ref.TRAJECTORY_BEGIN, 1)[1].split(ref.TRAJECTORY_END, 1)[0].strip() == trajectory.markdown()


@pytest.mark.parametrize("name", ref.cli_modules())
def test_every_command_prints_its_version(name):
    """`python -m pipelines.X --version` prints `dagrl <pyproject's version>` (the installed dagrl's) and exits 0."""
    rc, out = ref.run_cli(name, ["--version"])
    assert rc == 0 and out.strip() == f"dagrl {metadata.version('dagrl')}"


def test_version_falls_back_to_pyproject_when_not_installed(monkeypatch):
    import tomllib

    from pipelines import cli

    def missing(name):
        raise metadata.PackageNotFoundError(name)
    monkeypatch.setattr(metadata, "version", missing)
    want = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert cli.version() == f"dagrl {want}"


def test_version_from_a_process():
    """The process entry as a user runs it (one command; the others share `pipelines.cli.start` / argparse)."""
    out = subprocess.run([sys.executable, "-m", "pipelines.validate", "--version"], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert out.returncode == 0 and re.fullmatch(r"dagrl \d+\.\d+\.\d+\S*\n", out.stdout)
