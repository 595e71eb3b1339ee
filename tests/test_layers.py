"""Layer contracts (pyproject's [tool.importlinter]) and the absence of import cycles between our modules."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_import_contracts_kept():
    lint = Path(sys.executable).with_name("lint-imports")
    res = subprocess.run([str(lint), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr


def test_layer_contract_refuses_an_upward_import(tmp_path):
    """The declared layers (pipelines > tasks > storage) fail a tree where storage imports tasks, and keep one
    where tasks imports storage (the decision the layout documents), under this project's own contracts."""
    import os
    import tomllib
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    layers = next(c for c in contracts if c["type"] == "layers")
    config = tmp_path / "contracts.toml"
    config.write_text('[tool.importlinter]\nroot_packages = ["pipelines", "tasks", "storage"]\n\n'
                      '[[tool.importlinter.contracts]]\nname = "layers"\ntype = "layers"\n'
                      f"layers = {layers['layers']!r}\n".replace("'", '"'))

    def lint(files: dict[str, str]) -> int:
        tree = tmp_path / f"tree{len(list(tmp_path.iterdir()))}"
        for pkg in ("pipelines", "tasks", "storage"):
            (tree / pkg).mkdir(parents=True)
            (tree / pkg / "__init__.py").write_text("")
        for name, text in files.items():
            (tree / name).write_text(text)
        lint_bin = Path(sys.executable).with_name("lint-imports")
        env = {**os.environ, "PYTHONPATH": str(tree)}
        return subprocess.run([str(lint_bin), "--no-cache", "--config", str(config)], cwd=tree, env=env,
                              capture_output=True, text=True, timeout=300).returncode
    assert lint({"tasks/a.py": "import storage.b\n", "storage/b.py": ""}) == 0
    assert lint({"storage/b.py": "import tasks.a\n", "tasks/a.py": ""}) != 0
    assert lint({"tasks/a.py": "import pipelines.c\n", "pipelines/c.py": ""}) != 0


def _cycles(graph, modules: set[str]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), imports inside functions included."""
    adj = {m: set(graph.find_modules_directly_imported_by(m)) & modules for m in modules}
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in adj[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for m in sorted(modules):
        if m not in index:
            visit(m)
    return out


def test_cycle_finder_finds_a_cycle():
    class G:  # a -> b -> c -> a, c -> d
        edges = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set()}

        def find_modules_directly_imported_by(self, m):
            return self.edges[m]
    assert _cycles(G(), {"a", "b", "c", "d"}) == [["a", "b", "c"]]


def test_config_imports_nothing_else_of_tasks_but_the_estimator_specs():
    """tasks.config reads one module of tasks besides its own, the estimator specs beside the estimators' math, and
    that module imports nothing of ours; importing either imports no torch (tasks/algorithms/__init__.py is lazy)."""
    import grimp
    g = grimp.build_graph("tasks", "pipelines", "storage", cache_dir=None)
    package = {"tasks.config", *g.find_descendants("tasks.config")}  # tasks.config is a package now
    outside = {m for p in package for m in g.find_modules_directly_imported_by(p) if m.startswith("tasks")} - package
    assert outside == {"tasks.algorithms.specs"}
    assert not g.find_modules_directly_imported_by("tasks.algorithms.specs")
    code = "import sys, tasks.algorithms.specs, tasks.config; print(sorted(m for m in sys.modules if m == 'torch'))"
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "[]", res.stdout + res.stderr


def test_no_import_cycle():
    """No module of pipelines/, tasks/ or storage/ reaches itself through imports (function-level imports count):
    the whole graph of the three packages is acyclic, not only each package on its own."""
    import grimp
    g = grimp.build_graph("pipelines", "tasks", "storage", cache_dir=None)
    assert {m.split(".")[0] for m in g.modules} == {"pipelines", "tasks", "storage"}
    assert _cycles(g, set(g.modules)) == []


MAX_MODULE_LINES = 500
# a branch on a family's name in pipelines/: callers ask a component's capabilities instead (README "Layout")
FAMILY_BRANCH = re.compile(r"""(\.(policy|env|cluster)\.(name|simulator|kind)|algorithm\.name)\s*(==|!=|in)\s*|"""
                           r"""(==|!=)\s*["'](mlp|pi0|pi05|token_vla|sft|maniskill|libero|local|address)["']""")


def _modules(*packages: str) -> list[Path]:
    return sorted(p for pkg in packages for p in (ROOT / pkg).rglob("*.py") if "__pycache__" not in p.parts)


def test_no_module_over_500_lines():
    """A module of pipelines/ or tasks/ holds one job: none passes 500 lines (benchmarks/ aside)."""
    long = {str(p.relative_to(ROOT)): n for p in _modules("pipelines", "tasks")
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert long == {}


def test_no_branch_on_a_family_name_in_pipelines():
    """No `cfg.policy.name ==`, `env.simulator ==`, `cluster.kind ==`, `algorithm.name == "sft"` (nor a comparison with
    a family's name) in pipelines/; the pattern itself finds each form (checked on samples)."""
    for sample in ('if cfg.policy.name == "mlp":', "if c.env.simulator != x:", 'a.algorithm.name == "sft"',
                   'kind = "x" if k == "address" else "y"', "if cfg.cluster.kind in kinds:"):
        assert FAMILY_BRANCH.search(sample), sample
    for sample in ('name = cfg.policy.name', 'family_class("policy", cfg.policy.name)'):
        assert not FAMILY_BRANCH.search(sample), sample
    hits = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}" for p in _modules("pipelines")
            for i, line in enumerate(p.read_text().splitlines(), 1)
            if FAMILY_BRANCH.search(line) and not line.lstrip().startswith("#")]
    assert hits == []
