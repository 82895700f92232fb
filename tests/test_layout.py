"""The package layout holds: no import circles, every package installed, nothing named `agent` at the top.

Import circles are read from the source (every `import`, also those inside functions, except the ones
under `if TYPE_CHECKING:`), so a lazy import that only hides a circle counts as the circle it hides.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest
from source_tree import REPO, modules
from util import cli


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(module: str, path: Path, known: set[str]) -> set[str]:
    """The modules of ours that `module` imports at run time."""
    is_pkg = path.name == "__init__.py"
    out: set[str] = set()

    def resolve(name: str) -> None:
        while name and name not in known:
            name = name.rpartition(".")[0]
        if name and name != module:
            out.add(name)

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            for a in node.names:
                resolve(a.name)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = module.split(".")
                parts = parts if is_pkg else parts[:-1]
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            for a in node.names:
                full = f"{base}.{a.name}"
                resolve(full if full in known else base)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), filename=str(path)))
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    comps: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                strong(w)
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
                comps.append(sorted(comp))

    sys.setrecursionlimit(max(10_000, sys.getrecursionlimit()))
    for v in graph:
        if v not in index:
            strong(v)
    return comps


def _graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    graph = {m: _imports(m, p, known) for m, p in mods.items()}
    # A package's own __init__ is imported on the way to any of its modules; that edge is not a circle.
    for m in graph:
        graph[m] = {d for d in graph[m] if not m.startswith(d + ".")}
    return graph


def test_no_import_circles():
    # Over every module of the package, the runtime and the control plane alike: a circle means two
    # modules that are one in disguise (or a mixin reaching into its host's private names).
    assert _cycles(_graph()) == []


# The user surface that runs the user's own script in its process, and so loads the runtime with it.
RUNS_USER_CODE = {
    "elasticd": "re-exports @elastic, and marks the process start for streams nobody seeded",
    "elasticd.cli.run": "imports the script when its N is not a literal",
}
RUNTIME = "elasticd.agent"
CORE = "elasticd.core"


def _package(module: str) -> str:
    """The package a module belongs to: `elasticd.agent.X` for the runtime's, `elasticd.X` for the rest."""
    parts = module.split(".")
    return ".".join(parts[:3] if module.startswith(RUNTIME + ".") else parts[:2])


def _inside(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_the_control_plane_imports_no_runtime_module():
    # The daemon, the scheduler and the CLI read what they share with the agents from elasticd.core;
    # importing the runtime would drag torch into them and tie their layout to its insides.
    graph = _graph()
    found = sorted((m, d) for m, deps in graph.items() for d in deps
                   if not _inside(m, RUNTIME) and _inside(d, RUNTIME) and m not in RUNS_USER_CODE)
    assert found == []
    assert set(RUNS_USER_CODE) <= set(graph)


def test_the_core_imports_only_itself():
    found = sorted((m, d) for m, deps in _graph().items() for d in deps if _inside(m, CORE) and not _inside(d, CORE))
    assert found == []


def test_no_import_circles_between_packages():
    # Packages that import each other are one package in disguise: the layering is
    # core <- protocol <- runtime, and core <- protocol <- scheduler <- observe, placement <- daemon <- cli.
    graph: dict[str, set[str]] = {}
    for m, deps in _graph().items():
        graph.setdefault(_package(m), set()).update(_package(d) for d in deps if _package(d) != _package(m))
    for deps in list(graph.values()):
        for d in deps:
            graph.setdefault(d, set())
    assert _cycles(graph) == []


def test_the_cycle_finder_sees_a_lazy_import_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]
    src = textwrap.dedent("""
        from typing import TYPE_CHECKING
        if TYPE_CHECKING:
            from elasticd.agent import runtime
        def f():
            from elasticd.agent.comm import physical
    """)
    path = REPO / "build" / "layout_probe.py"
    path.parent.mkdir(exist_ok=True)
    path.write_text(src)
    try:
        assert _imports("elasticd.probe", path, {"elasticd.agent.runtime", "elasticd.agent.comm.physical",
                                                 "elasticd.agent.comm"}) == {"elasticd.agent.comm.physical"}
    finally:
        path.unlink()


def test_every_package_is_installed():
    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    on_disk = {m for m, p in modules().items() if p.name == "__init__.py"}
    assert listed == on_disk


def test_torch_free_parts_stay_torch_free():
    # The daemon and the scheduler read these; importing torch there costs seconds and memory per node.
    code = ("import sys, elasticd.daemon.server, elasticd.scheduler.server, elasticd.local_node, elasticd.cli;"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False"


def _script_beside_its_own_agent_module(tmp_path: Path) -> None:
    (tmp_path / "agent.py").write_text("NAME = 'the user agent'\n")
    (tmp_path / "train.py").write_text(textwrap.dedent("""
        import sys
        import agent
        import elasticd
        import torch

        @elasticd.elastic(workers=2)
        def train(ctx):
            model = torch.nn.Linear(2, 1)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            model, opt = ctx.replicate(model, opt)
            for _ in ctx.steps(2):
                opt.zero_grad()
                model(torch.ones(1, 2)).sum().backward()
                opt.step()
            print(f"rank {ctx.rank}: {agent.NAME}", flush=True)

        if __name__ == "__main__":
            train()
    """))


@pytest.mark.parametrize("how", ["standalone", "run"])
def test_a_users_own_agent_module_does_not_shadow_the_runtime(tmp_path, how):
    """RL code often has an `agent.py` next to its training script; it must be the user's `agent`."""
    _script_beside_its_own_agent_module(tmp_path)
    cmd = ([sys.executable, "train.py"] if how == "standalone"
           else [sys.executable, "-m", "elasticd", "run", "train.py", "--devices", "2"])
    out = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    assert "rank 0: the user agent" in out.stdout and "rank 1: the user agent" in out.stdout


def test_a_users_own_agent_module_does_not_shadow_the_runtime_under_the_daemon(cluster, tmp_path):
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    _script_beside_its_own_agent_module(job_dir)
    d = cluster.daemon(cpu=2, fake=False)
    r = cli("submit", str(job_dir / "train.py"), "--min-devices", "2", "--wait", "--state-dir", str(d.state_dir),
            cwd=job_dir, timeout=300)
    assert r.code == 0, (r.out, r.err, d.output()[-3000:])
    job = r.out.split()[0]
    logs = cli("logs", job, "--state-dir", str(d.state_dir))
    assert "rank 0: the user agent" in logs.out and "rank 1: the user agent" in logs.out, logs.out


def test_no_two_classes_share_a_name():
    # A name read in a traceback or a grep must lead to one class.
    where: dict[str, list[str]] = {}
    for module, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ClassDef):
                where.setdefault(node.name, []).append(module)
    assert {name: mods for name, mods in where.items() if len(mods) > 1} == {}


def test_lifecycles_are_enums_not_string_literals():
    # A resize's phase and outcome, a run's outcome and a failure's cause, compared or assigned as bare strings
    # would let a typo pass silently; they are elasticd.core.lifecycle's, elasticd.core.failures' and
    # agent/slicer/boundary.py's enums.
    pattern = re.compile(r"""\.(phase|outcome)\s*(==|!=|=|is|is not)\s*["']|["']cause["']\)?\s*(==|!=|:)\s*["']""")
    found = [f"{m}:{n}" for m, path in modules().items()
             for n, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
    assert found == []


def test_nothing_outside_the_context_reaches_into_its_privates():
    # A worker's runtime is `worker.runtime`; code holding a ctx uses slicer/context.py's `worker_of` and
    # `runtime_of`. Reaching into `ctx._rt` ties every layer to the context's insides.
    pattern = re.compile(r"\bctx\._(rt|w)\b")
    found = [f"{m}:{n}" for m, path in modules().items() if not m.endswith("slicer.context")
             for n, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
    assert found == []
