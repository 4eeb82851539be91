"""The package's layout rules (docs/design.md, "Layers"), checked on its import graph.

The graph is read from the source with ``ast``: every ``import`` / ``from ... import`` of a project module, at module
level or inside a function (a lazy import still runs), but not under ``if TYPE_CHECKING:``. ``from pkg import name``
is an edge to ``pkg.name`` when that is a module, else to ``pkg``; importing ``a.b.c`` also runs ``a`` and ``a.b``.
``python tests/test_layout.py`` prints the graph's summary (layers, edges between them, the reach of each stage).
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PKG = "align_pipeline"

LAYERS: list[tuple[str, set[str]]] = [
    ("base", {"", "errors"}),  # the package itself (lazy_exports) and the user-error class
    ("config", {"config"}),
    ("data", {"data"}),
    ("model", {"model", "rl", "rewards", "envs"}),
    ("losses", {"losses"}),
    ("tracking", {"tracking"}),
    ("evaluation", {"evaluation"}),
    ("train", {"train"}),
    ("launch", {"launch"}),
    ("datasets", {"datasets"}),
    ("kedro", {"pipelines", "kedro", "settings", "pipeline_registry", "cli", "__main__"}),
]
"""Lowest first. A module may import its own layer and the ones below, never one above."""

ENTRY_POINT_EXCEPTIONS = {
    f"{PKG}.__main__",  # the align-pipeline command
    f"{PKG}.launch._agent",  # torchrun itself, its store on loopback
    f"{PKG}.launch._worker",  # the per-rank shim that runs an entry point
}
"""Modules outside train/ that may run as ``__main__``: the CLI and the launcher's own process wrappers."""

MAX_PPO_MODULES = 53
"""Modules (package ``__init__``s, which re-export lazily, not counted) the PPO job loads at start. Its reach was 72
with eager ``__init__``s (every stage config, loss, reward, launch, export); what is left is what PPO runs: the model
stack (14 files), train/core (13: rollout.py's set-up, metrics and offloading are files of their own), config (7),
data reading (7), tracking (4), its losses, RL math and rewards. No module of another stage, of launch/ or of the
Kedro layer is among them (checked below)."""


def _modules() -> dict[str, tuple[Path, bool]]:
    mods = {}
    for path in sorted((SRC / PKG).rglob("*.py")):
        name = ".".join(path.relative_to(SRC).with_suffix("").parts)
        is_pkg = name.endswith(".__init__")
        mods[name.removesuffix(".__init__")] = (path, is_pkg)
    return mods


class _Imports(ast.NodeVisitor):
    def __init__(self, module: str, is_pkg: bool, mods: dict):
        self.module, self.is_pkg, self.mods = module, is_pkg, mods
        self.edges: set[str] = set()
        self.main_guard = False
        self.names: set[str] = set()  # names imported from project modules (run_torchrun, ...)

    def visit_If(self, node: ast.If) -> None:
        test = ast.unparse(node.test)
        if "TYPE_CHECKING" in test:
            for child in node.orelse:
                self.visit(child)
            return
        if test in ("__name__ == '__main__'", '__name__ == "__main__"'):
            self.main_guard = True
        self.generic_visit(node)

    def _add(self, target: str, names: list[str]) -> None:
        if target != PKG and not target.startswith(PKG + "."):
            return
        parts = target.split(".")
        for i in range(1, len(parts) + 1):  # the parent packages run too
            if ".".join(parts[:i]) in self.mods:
                self.edges.add(".".join(parts[:i]))
        for name in names:
            if f"{target}.{name}" in self.mods:
                self.edges.add(f"{target}.{name}")
            else:
                self.names.add(name)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name, [])

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:
            base = self.module.split(".")
            base = base if self.is_pkg else base[:-1]
            base = base[: len(base) - (node.level - 1)]
            target = ".".join(base + ([node.module] if node.module else []))
        else:
            target = node.module or ""
        self._add(target, [a.name for a in node.names])


def import_graph() -> tuple[dict[str, set[str]], dict[str, _Imports]]:
    mods = _modules()
    graph, info = {}, {}
    for name, (path, is_pkg) in mods.items():
        visitor = _Imports(name, is_pkg, mods)
        visitor.visit(ast.parse(path.read_text(), str(path)))
        visitor.edges.discard(name)
        graph[name], info[name] = visitor.edges, visitor
    return graph, info


def group(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def layer(module: str) -> int:
    for i, (_, groups) in enumerate(LAYERS):
        if group(module) in groups:
            return i
    raise AssertionError(f"{module}: its folder {group(module)!r} is in no layer of LAYERS")


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
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

    sys.setrecursionlimit(10_000)
    for v in graph:
        if v not in index:
            visit(v)
    return out


def reach(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for w in graph[todo.pop()]:
            if w not in seen:
                seen.add(w)
                todo.append(w)
    return seen - {start}


@pytest.fixture(scope="module")
def graph():
    return import_graph()


def test_every_module_has_a_layer_and_no_import_goes_up(graph):
    edges, _ = graph
    up = [f"{a} ({LAYERS[layer(a)][0]}) -> {b} ({LAYERS[layer(b)][0]})"
          for a, targets in edges.items() for b in targets if layer(b) > layer(a)]
    assert up == []


def test_the_import_graph_has_no_cycle(graph):
    assert cycles(graph[0]) == []


def test_config_imports_nothing_of_the_project_but_errors(graph):
    edges, _ = graph
    allowed = {PKG, f"{PKG}.errors"}
    bad = [f"{a} -> {b}" for a, targets in edges.items() if group(a) == "config"
           for b in targets if group(b) != "config" and b not in allowed]
    assert bad == []


def test_only_train_holds_entry_points(graph):
    _, info = graph
    guarded = {name for name, v in info.items() if v.main_guard}
    assert guarded - ENTRY_POINT_EXCEPTIONS == {m for m in guarded if group(m) == "train"}
    assert all(info[m].main_guard for m in ENTRY_POINT_EXCEPTIONS)


def test_only_launch_and_the_kedro_layer_launch_jobs(graph):
    edges, info = graph
    kedro_layer = LAYERS[-1][1] | {"launch"}
    launching = {a for a, targets in edges.items()
                 if {f"{PKG}.launch.torchrun", f"{PKG}.launch.model_jobs"} & targets or "run_torchrun" in info[a].names}
    assert {group(a) for a in launching} <= kedro_layer, sorted(launching)


def test_package_inits_import_nothing_eagerly(graph):
    _, info = graph
    eager = {}
    for name, v in info.items():
        if v.is_pkg and name != PKG:
            tree = ast.parse(_modules()[name][0].read_text())
            imports = [ast.unparse(n) for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
            project = [i for i in imports if PKG in i and i != f"from {PKG} import lazy_exports"]
            if project:
                eager[name] = project
    assert eager == {}


def test_one_place_resolves_nproc_per_node_gpus():
    """``nproc_per_node: gpus`` (and the world size made of it) is resolved in launch/world.py alone."""
    users = sorted(str(p.relative_to(SRC)) for p in (SRC / PKG).rglob("*.py")
                   if 'nproc_per_node == "gpus"' in p.read_text() or "visible_gpus()" in p.read_text())
    assert users == [f"{PKG}/launch/world.py"]


def _loaded(code: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", code + "\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"],
                         capture_output=True, text=True, check=True, timeout=300)
    return json.loads(out.stdout.splitlines()[-1])


def test_the_kedro_process_never_imports_torch():
    """Settings (the hooks), the registry, every node module and the commands, as the Kedro process imports them."""
    code = ("import align_pipeline.settings, align_pipeline.pipeline_registry as r, align_pipeline.cli\n"
            "import align_pipeline.kedro.commands, align_pipeline.launch.model_jobs, align_pipeline.launch.world\n"
            "r.register_pipelines()\n"
            "import importlib, pkgutil, align_pipeline.pipelines as p\n"
            "for m in pkgutil.walk_packages(p.__path__, p.__name__ + '.'): importlib.import_module(m.name)\n"
            "from align_pipeline.launch.world import job_backend, resolved\n"
            "from align_pipeline.config.common import LaunchConfig\n"
            "job_backend('auto'); resolved(LaunchConfig())\n")
    heavy = [m for m in _loaded(code) if m.split(".")[0] in ("torch", "megatron", "transformers", "transformer_engine")]
    assert heavy == []


def test_a_stage_entry_point_imports_few_project_modules():
    """PPO, the widest stage: the project modules its job loads at start (package __init__s included)."""
    mods = _modules()
    project = [m for m in _loaded("import align_pipeline.train.ppo") if m in mods and not mods[m][1]]
    assert len(project) <= MAX_PPO_MODULES, project
    unrelated = [m for m in project if group(m) in ("launch", "kedro", "pipelines", "datasets", "evaluation")
                 or m.split(".")[-1] in ("dpo", "sft", "reward_model", "reinforce", "evaluation", "hf_export")]
    assert unrelated == []


def test_every_imported_project_name_exists():
    """Each ``from align_pipeline.x import name`` in src/, tests/ and benchmarks/ (lazy ones too, which only run on
    their code path) names a module or an attribute that exists: a moved function fails here, not in a user's run."""
    code = r"""
import ast, importlib, importlib.util, pathlib, sys
missing = []
def exists(name):
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a dotted name below a plain module
        return False
for root in sys.argv[1:]:
    for f in sorted(pathlib.Path(root).rglob("*.py")):
        for n in ast.walk(ast.parse(f.read_text())):
            if isinstance(n, ast.ImportFrom) and n.level == 0 and (n.module or "").startswith("align_pipeline"):
                mod = importlib.import_module(n.module)
                for a in n.names:
                    if not hasattr(mod, a.name) and not exists(f"{n.module}.{a.name}"):
                        missing.append(f"{f}:{n.lineno}: {n.module}.{a.name}")
            elif isinstance(n, ast.Import):
                for a in n.names:
                    if a.name.startswith("align_pipeline") and not exists(a.name):
                        missing.append(f"{f}:{n.lineno}: {a.name}")
print("MISSING " + repr(missing))
"""
    root = SRC.parent
    out = subprocess.run([sys.executable, "-c", code, *(str(root / d) for d in ("src", "tests", "benchmarks"))],
                         check=False, capture_output=True, text=True, cwd=root, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "MISSING []" in out.stdout, out.stdout[out.stdout.find("MISSING"):]


if __name__ == "__main__":
    edges, _ = import_graph()
    print(f"{len(edges)} modules, {sum(map(len, edges.values()))} edges, cycles: {cycles(edges)}")
    between: dict[tuple[str, str], int] = {}
    for a, targets in edges.items():
        for b in targets:
            if group(a) != group(b):
                between[(group(a) or PKG, group(b) or PKG)] = between.get((group(a) or PKG, group(b) or PKG), 0) + 1
    for name, groups in LAYERS:
        print(f"{name:10s} {' '.join(sorted(g or PKG for g in groups))}")
    for (a, b), n in sorted(between.items()):
        print(f"  {a} -> {b}: {n}")
    for stage in ("sft", "reward_model", "dpo", "ppo", "reinforce", "distill", "evaluate"):
        print(f"train.{stage}: {len(reach(edges, f'{PKG}.train.{stage}'))} modules reachable (lazy imports included)")
