"""Loading a benchmarks/ script (not a package) as a module for its tests."""
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str):
    """benchmarks/<name>.py as the module `<name>_under_test` (registered in sys.modules: dataclasses need it)."""
    spec = importlib.util.spec_from_file_location(f"{name}_under_test", ROOT / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="session")
def load_benchmark():
    """The loader `_load(name)` (a benchmark's tests wrap it in a module-scoped fixture of their own)."""
    return _load
