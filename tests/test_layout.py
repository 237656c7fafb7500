"""The layout's rules, checked on the source (docs/pipeline.md, "Layout"): what may import what (no import cycle, no
pipeline import that climbs a layer), and no file over 400 lines in the library, the pipeline and the jobs."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("rcr", "pipeline", "embedded", "jobs")
MAX_LINES = 400


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def imports(path: Path, name: str, known: set[str]) -> set[str]:
    """Every project module ``path`` imports, at module level or inside a function: ``from a.b import c`` counts as
    ``a.b.c`` where that is a module, else ``a.b``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        out.update(t for t in targets if t in known)
    return out - {name}


def graph() -> dict[str, set[str]]:
    mods = project_modules()
    return {name: imports(path, name, set(mods)) for name, path in mods.items()}


def test_no_import_cycle():
    g = graph()
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def visit(m: str):
        state[m] = 1
        stack.append(m)
        for n in sorted(g[m]):
            if state.get(n) == 1:
                cycle = stack[stack.index(n):] + [n]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(g):
        if m not in state:
            visit(m)


def test_the_library_imports_neither_the_pipeline_nor_the_embedded_tooling():
    """rcr/ imports torch and transformers (never ray, mlflow or pyarrow); pipeline/ never imports embedded/."""
    banned = {"rcr": ("pipeline", "embedded", "jobs", "ray", "mlflow", "pyarrow"), "pipeline": ("embedded", "jobs")}
    for path in (p for pkg in banned for p in (ROOT / pkg).rglob("*.py")):
        pkg = path.relative_to(ROOT).parts[0]
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            for n in names:
                assert n.split(".")[0] not in banned[pkg], f"{path.relative_to(ROOT)} imports {n}"


# The pipeline's layers, lowest first: a module imports its own part and the parts of lower layers, never a part of
# its own layer or above (docs/pipeline.md, "Layout"). A part is a subpackage of pipeline/ or a module at its top.
LAYERS = (
    ("pipeline", "pipeline.tasks", "pipeline.paths"),  # the task registry; where files go
    ("pipeline.schema", "pipeline.quiet"),  # the schemas (of the registered tasks); a job's own output lines
    ("pipeline.data", "pipeline.analysis"),  # input shards; statistics and MLflow after a job
    ("pipeline.run",),  # a job
    ("pipeline.diagnose", "pipeline.lmms"),  # built on jobs and analyses
)


def part(module: str) -> str:
    return ".".join(module.split(".")[:2])


def layer_violations(g: dict[str, set[str]]) -> list[str]:
    rank = {p: i for i, layer in enumerate(LAYERS) for p in layer}
    out = []
    for m, deps in sorted(g.items()):
        if not m.startswith("pipeline"):
            continue
        assert part(m) in rank, f"{m}: its part {part(m)} has no layer in LAYERS"
        for d in sorted(deps):
            if d.startswith("pipeline") and part(d) != part(m) and rank[part(d)] >= rank[part(m)]:
                out.append(f"{m} -> {d}")
    return out


def test_no_pipeline_import_climbs_a_layer():
    """pipeline/run/ imports nothing above it (the pre-flight lives in it), and the analysis nothing of a job
    (the default store is pipeline.paths')."""
    assert layer_violations(graph()) == []


def test_the_layer_check_finds_an_import_that_climbs():
    g = {"pipeline.analysis.backfill": {"pipeline.run.config", "pipeline.schema"}, "pipeline.run.config": set(),
         "pipeline.schema": set(), "pipeline.run.driver": {"pipeline.run.config", "pipeline.analysis.report"},
         "pipeline.analysis.report": set()}
    assert layer_violations(g) == ["pipeline.analysis.backfill -> pipeline.run.config"]


def test_no_file_is_over_400_lines():
    long = {str(p.relative_to(ROOT)): n for pkg in ("rcr", "pipeline", "jobs") for p in (ROOT / pkg).rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, long


def test_the_cycle_check_finds_a_cycle(tmp_path, monkeypatch):
    """The check above would see a cycle: two modules importing each other, one through a relative import."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "a.py").write_text("def f():\n    from .b import g\n")
    (tmp_path / "pkg" / "b.py").write_text("from pkg import a\n")
    known = {"pkg", "pkg.a", "pkg.b"}
    monkeypatch.setattr("tests.test_layout.ROOT", tmp_path)
    assert imports(tmp_path / "pkg" / "a.py", "pkg.a", known) == {"pkg.b"}
    assert imports(tmp_path / "pkg" / "b.py", "pkg.b", known) == {"pkg.a"}
