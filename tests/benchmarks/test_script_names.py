"""A script's folder comes first on sys.path: a benchmarks/ file named like an installed module (the old
benchmarks/distributed.py) shadows that module for every script there (`python benchmarks/throughput.py` then
failed on `from distributed.diagnostics...`)."""
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _module_file(name: str) -> Path | None:
    """The file `import name` loads outside benchmarks/ (None: no such module, or only a namespace package, e.g.
    a tests/ folder that pytest put on sys.path: a script's file always wins over one, so nothing is shadowed)."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.has_location or spec.origin is None:
        return None
    return Path(spec.origin)


def test_no_benchmark_script_shadows_an_importable_module():
    shadowing = [p.name for p in sorted((ROOT / "benchmarks").glob("*.py"))
                 if (f := _module_file(p.stem)) is not None and f.parent != ROOT / "benchmarks"]
    assert not shadowing, f"rename {shadowing}: they shadow installed modules of the same name"
    assert _module_file("distributed") is not None  # the check sees installed packages (what the old name hid)
