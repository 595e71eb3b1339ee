"""The test tiers of tests/conftest.py, on a throwaway test tree run by a pytest of its own: every test gets one tier
(its mark, else `unit`), two tier marks are a usage error, `-m unit` leaves the slow tests out as the default
selection does, and the guard fails a test that starts more than its tier allows (a `dask scheduler` process here:
the guard records it before the process starts, so a program that does not exist is enough)."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

TESTS = '''
import subprocess
import pytest


def _start_a_scheduler():
    try:
        subprocess.Popen(["/nonexistent/dask", "scheduler"])
    except FileNotFoundError:
        pass


def test_plain():
    pass


def test_unit_that_starts_a_scheduler():
    _start_a_scheduler()


@pytest.mark.cluster
def test_cluster_that_starts_a_scheduler():
    _start_a_scheduler()


@pytest.mark.slow
def test_slow():
    pass
'''

INI = '''[pytest]
markers =
    unit: u
    sim: s
    cluster: c
    slow: s
    gpu: g
addopts = -m "not slow and not gpu" -p no:cacheprovider
'''


def _pytest(tree: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rA", *args], cwd=tree, capture_output=True,
                          text=True, timeout=120)


def test_tiers_are_assigned_selected_and_guarded(tmp_path):
    shutil.copy(HERE / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "pytest.ini").write_text(INI)
    (tmp_path / "test_inner.py").write_text(TESTS)

    unit = _pytest(tmp_path, "--collect-only", "-m", "unit")
    assert "2/4 tests collected (2 deselected)" in unit.stdout, unit.stdout  # test_plain + the unit one; no slow

    run = _pytest(tmp_path)
    assert run.returncode == 1, run.stdout
    assert "3 passed, 1 deselected, 1 error" in run.stdout, run.stdout
    assert "ERROR test_inner.py::test_unit_that_starts_a_scheduler" in run.stdout
    assert ("tier: this test is `unit` (the default) but started cluster: a `dask scheduler` process: mark it "
            "`cluster`") in run.stdout

    (tmp_path / "test_two.py").write_text("import pytest\n\n\n@pytest.mark.sim\n@pytest.mark.unit\n"
                                          "def test_two():\n    pass\n")
    two = _pytest(tmp_path, "--collect-only")
    assert two.returncode != 0 and "marked ['sim', 'unit']; a test has exactly one tier" in two.stderr + two.stdout


def _defined(path: Path, kind: str) -> set[str]:
    """Names of the test functions (kind "test") or fixtures (kind "fixture") defined in the test file `path`."""
    import ast
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        is_fixture = any("fixture" in ast.unparse(d) for d in node.decorator_list)
        if (kind == "fixture") == is_fixture and (kind == "fixture" or node.name.startswith("test")):
            names.add(node.name)
    return names


def test_every_tiers_entry_names_an_existing_test_or_fixture():
    """A TIERS entry whose file, test or fixture was renamed or deleted would silently tier nothing (the test it
    meant falls back to `unit` and the run-time guard catches it only when it runs): every entry must match."""
    import fnmatch

    import importlib.util  # by path: `import conftest` may pick up a nested tests/**/conftest.py
    spec = importlib.util.spec_from_file_location("_tiers_conftest", HERE / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    TIERS = module.TIERS

    root = HERE.parent
    stale = []
    for entry in TIERS:
        file, _, pattern = entry.partition("::")
        path = root / file
        if not path.is_file():
            stale.append(f"{entry} (no file {file})")
        elif pattern.startswith("@"):
            if pattern[1:] not in _defined(path, "fixture"):
                stale.append(f"{entry} (no fixture {pattern[1:]} in {file})")
        elif pattern and not fnmatch.filter(_defined(path, "test"), pattern):
            stale.append(f"{entry} (no test matches {pattern} in {file})")
    assert not stale, "stale TIERS entries in tests/conftest.py:\n" + "\n".join(stale)
