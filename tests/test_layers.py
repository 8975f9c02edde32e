"""The package layering, read from the source's imports (those inside functions included): optional
engines are plugins that rollplex/ never imports, the runtime imports no bench, demo or server, the
engine and the RL step import no parallel (the step reaches it through its runtime alone), and the
fixtures sit just above the model."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def imported(path: Path) -> set[str]:
    """The modules `path` imports (relative imports resolved; `from a import b` as a.b too)."""
    module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([node.module] if node.module else []))
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)
    return out


def offenders(files, banned: tuple[str, ...]) -> dict[str, list[str]]:
    found = {}
    for f in files:
        bad = sorted(m for m in imported(f) if any(m == b or m.startswith(b + ".") for b in banned))
        if bad:
            found[str(f.relative_to(ROOT))] = bad
    return found


def test_imports_are_read_relative_ones_included():
    got = imported(ROOT / "rollplex/system.py")
    assert {"rollplex.backends", "rollplex.tiny.ensure_tiny", "torch.distributed"} <= got


@pytest.mark.parametrize("files,banned", [
    ("rollplex/**/*.py", ("engine_patches",)),  # plugins are found by name (rollplex/backends.py)
    ("rollplex/server/**/*.py", ("rollplex.demo", "rollplex.bench")),
    # the assembly and the flag generator sit above the runtime and below every entry point
    ("rollplex/{system,cli}.py", ("rollplex.server", "rollplex.demo", "rollplex.bench")),
    ("rollplex/parallel/**/*.py", ("rollplex.demo", "rollplex.bench", "rollplex.server", "rollplex.system",
                                   "rollplex.cli")),
    ("rollplex/tiny/**/*.py", ("rollplex.engine", "rollplex.rl", "rollplex.parallel", "rollplex.server",
                               "rollplex.demo", "rollplex.bench")),
    # the engine is given a tensor-parallel handle (a sharded model), it never builds one
    ("rollplex/engine/**/*.py", ("rollplex.rl", "rollplex.parallel", "rollplex.server", "rollplex.demo",
                                 "rollplex.bench")),
    # parallelism is injected into the RL step (rollplex.parallel.data_parallel), never imported by it
    ("rollplex/rl/**/*.py", ("rollplex.parallel", "rollplex.server", "rollplex.demo", "rollplex.bench",
                             "rollplex.system", "rollplex.cli")),
], ids=["no-plugin-imports", "server", "system", "parallel", "tiny", "engine", "rl"])
def test_layering(files, banned):
    globs = [files.replace("{system,cli}", name) for name in ("system", "cli")] if "{" in files else [files]
    paths = [p for g in globs for p in ROOT.glob(g)]
    assert paths and offenders(paths, banned) == {}


def test_the_rl_step_asks_its_runtime_and_schedule():
    """rl/step.py reaches the data-parallel rank only through its runtime (rl/runtime.py) and runs `run` through
    its schedule (rl/schedule.py): it reads `self.parallel` nowhere (the attribute is set for checkpoints and
    the server) and never compares `schedule`."""
    tree = ast.parse((ROOT / "rollplex/rl/step.py").read_text())
    stores = {id(t) for n in ast.walk(tree) if isinstance(n, ast.Assign) for t in n.targets}
    reads = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr == "parallel"
             and id(n) not in stores]
    compares = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Compare)
                and any(isinstance(x, ast.Attribute) and x.attr == "schedule" for x in ast.walk(n))]
    assert reads == [] and compares == []
