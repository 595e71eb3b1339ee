"""A script's folder comes first on sys.path: a benchmarks/ file named like an installed package (the old
benchmarks/distributed.py) shadows that package for every script there (`python benchmarks/throughput.py` then
failed on `from distributed.diagnostics...`)."""
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_no_benchmark_script_shadows_an_importable_module():
    shadowing = [p.name for p in sorted((ROOT / "benchmarks").glob("*.py"))
                 if importlib.util.find_spec(p.stem) is not None
                 and Path(importlib.util.find_spec(p.stem).origin or "").parent != ROOT / "benchmarks"]
    assert not shadowing, f"rename {shadowing}: they shadow installed modules of the same name"
