"""codraft's layers and the one direction of their imports (docs/architecture.md, section 2).

Every module's imports are read with `ast` (at module level, inside functions and under
TYPE_CHECKING alike: a lazy import is still a dependency), resolved to the project's modules and
checked:

* the foundation (`codraft.models`, `codraft.draft`, `codraft.tap`, ...) imports no other layer;
* the client imports nothing of the project but the two contracts in CLIENT_MAY_IMPORT;
* the server and the learner do not import each other (the learner publishes through the
  client; the server needs no part but the foundation);
* only the top layers, the CLI and the experiments, import the server, the learner and the
  client together, and nothing imports a top layer but itself;
* no module imports itself back round a loop of imports (strongly connected components of the
  module graph).

`problems` takes module sources, so the tests also feed it planted ones and see it fail.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
PACKAGE_DIRS: dict[str, str] = PYPROJECT["tool"]["setuptools"]["package-dir"]

# layer -> the modules it holds (each name with everything below it; "codraft" only itself)
LAYERS: dict[str, tuple[str, ...]] = {
    "foundation": (
        "codraft",
        "codraft.atomic",
        "codraft.control_token",
        "codraft.draft",
        "codraft.drafters",
        "codraft.ipc_handles",
        "codraft.loopback",
        "codraft.models",
        "codraft.prepare",
        "codraft.prompts",
        "codraft.tap",
        "codraft.testing",
    ),
    "client": ("codraft.client",),
    "server": ("codraft.server",),
    "learner": ("codraft.learner",),
    "cli": ("codraft.cli",),
    "experiments": ("codraft.experiments",),
}
# layer -> the other layers its modules may import
MAY_IMPORT: dict[str, set[str]] = {
    "foundation": set(),
    "client": set(),  # but CLIENT_MAY_IMPORT
    "server": {"foundation"},
    "learner": {"foundation", "client"},
    "cli": {"foundation", "client", "server", "learner"},
    "experiments": {"foundation", "client", "server", "learner"},
}
# what the client takes from the foundation: the contracts of what it sends
CLIENT_MAY_IMPORT = {
    "codraft.control_token": "the control token's sources and rules",
    "codraft.draft.checkpoint": "a checkpoint's codraft.json: the version and sha256 it posts",
    "codraft.ipc_handles": "CUDA IPC handles as the JSON a weight-sync update posts",
}
OLD_TOP_LEVEL = ("server", "learner", "client")

Modules = dict[str, tuple[str, bool]]  # module name -> (source, is a package)


# ------------------------------------------------------------------------------ the checker
def project_modules() -> Modules:
    """Every module of the installed import names, from pyproject.toml's package-dir."""
    out: Modules = {}
    for name, rel in PACKAGE_DIRS.items():
        root = REPO / rel
        for file in sorted(root.rglob("*.py")):
            if "__pycache__" in file.parts:
                continue
            parts = list(file.relative_to(root).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            if is_package:
                parts.pop()
            out[".".join([name, *parts])] = (file.read_text(), is_package)
    return out


def layer_of(module: str) -> str | None:
    for layer, names in LAYERS.items():
        for name in names:
            if module == name or (name != "codraft" and module.startswith(name + ".")):
                return layer
    return None


def imports(module: str, source: str, is_package: bool, known: set[str]) -> set[str]:
    """The project modules `module` imports anywhere in its source (`from P import name`
    counts as P.name when that is a module, else as P)."""

    def nearest(name: str) -> str | None:
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    found: set[str | None] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(nearest(a.name) for a in node.names if a.name.startswith("codraft"))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's own package upwards
                package = module if is_package else module.rpartition(".")[0]
                for _ in range(node.level - 1):
                    package = package.rpartition(".")[0]
                base = f"{package}.{base}" if base else package
            if base.split(".")[0] != "codraft":
                continue
            for a in node.names:
                full = f"{base}.{a.name}"
                found.add(full if full in known else nearest(base))
    found.discard(None)
    found.discard(module)
    return found  # type: ignore[return-value]


def graph(modules: Modules) -> dict[str, set[str]]:
    known = set(modules)
    return {m: imports(m, src, pkg, known) for m, (src, pkg) in modules.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def problems(modules: Modules) -> list[str]:
    """Every import against the layering, and every import cycle, one line each."""
    edges = graph(modules)
    out = [f"{m}: belongs to no layer (add it to LAYERS)" for m in edges if layer_of(m) is None]
    for m, targets in sorted(edges.items()):
        here = layer_of(m)
        for t in sorted(targets):
            there = layer_of(t)
            if here is None or there is None or there == here or there in MAY_IMPORT[here]:
                continue
            if here == "client" and t in CLIENT_MAY_IMPORT:
                continue
            out.append(f"{m} ({here}) imports {t} ({there})")
    out += [f"import cycle: {' <-> '.join(c)}" for c in cycles(edges)]
    return out


# ------------------------------------------------------------------------------ today's code
def test_the_code_keeps_its_layers_and_has_no_import_cycle() -> None:
    modules = project_modules()
    assert len(modules) > 100 and {"codraft.server.worker_ext", "codraft.cli"} <= set(modules)
    assert problems(modules) == []


def test_every_layer_is_there() -> None:
    layers = {layer_of(m) for m in project_modules()}
    assert layers == set(LAYERS)
    assert set(CLIENT_MAY_IMPORT) <= set(project_modules())


# ------------------------------------------------------------------------------ planted faults
def _planted(name: str, source: str, is_package: bool = False) -> list[str]:
    modules = project_modules()
    modules[name] = (source, is_package)
    return problems(modules)


@pytest.mark.parametrize(
    "name, source, expected",
    [
        (  # the foundation reaching up, lazily, inside a function
            "codraft.tap.planted",
            "def f():\n    from codraft.server.serve import main\n",
            "codraft.tap.planted (foundation) imports codraft.server.serve (server)",
        ),
        (  # the same through a relative import
            "codraft.draft.planted",
            "from ..learner import trainer\n",
            "codraft.draft.planted (foundation) imports codraft.learner.trainer (learner)",
        ),
        (  # the client taking more of the project than its contracts
            "codraft.client.planted",
            "import codraft.models.llama\n",
            "codraft.client.planted (client) imports codraft.models.llama (foundation)",
        ),
        (  # the server and the learner kept apart, even for a type
            "codraft.server.planted",
            "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n    from codraft.learner.trainer import Trainer\n",
            "codraft.server.planted (server) imports codraft.learner.trainer (learner)",
        ),
        (  # a library importing a top layer
            "codraft.learner.planted",
            "def f():\n    import codraft.cli.learn\n",
            "codraft.learner.planted (learner) imports codraft.cli.learn (cli)",
        ),
        (  # a module nobody placed
            "codraft.planted",
            "x = 1\n",
            "codraft.planted: belongs to no layer (add it to LAYERS)",
        ),
    ],
)
def test_a_planted_upward_import_is_found(name: str, source: str, expected: str) -> None:
    assert expected in _planted(name, source)


def test_a_planted_cycle_through_a_lazy_import_is_found() -> None:
    modules = project_modules()
    # a function-level import one way, a module-level one back
    modules["codraft.learner.attention.planted"] = (
        "def f():\n    from codraft.learner.ttt import ttt_forward\n",
        False,
    )
    src, pkg = modules["codraft.learner.ttt"]
    modules["codraft.learner.ttt"] = (src + "\nimport codraft.learner.attention.planted\n", pkg)
    found = [p for p in problems(modules) if p.startswith("import cycle")]
    assert found == ["import cycle: codraft.learner.attention.planted <-> codraft.learner.ttt"]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


# ------------------------------------------------------------------------------ one import root
def _python_files() -> list[Path]:
    skip = {".venv", ".git", ".vllm-src", ".gpu_wheels", ".gpu_venv", ".gpu_carry", "runs"}
    out = []
    for dirpath, dirnames, filenames in os.walk(REPO):
        dirnames[:] = [d for d in dirnames if d not in skip and d != "__pycache__"]
        out += [Path(dirpath, f) for f in filenames if f.endswith(".py")]
    return out


def test_no_file_imports_the_old_top_level_names() -> None:
    bad = []
    for file in _python_files():
        for node in ast.walk(ast.parse(file.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names = [node.module]
            bad += [
                f"{file.relative_to(REPO)}:{node.lineno}: {n}"
                for n in names
                if n.split(".")[0] in OLD_TOP_LEVEL
            ]
    assert bad == []


def test_pyproject_lists_every_package_folder() -> None:
    packages = {m for m, (_, is_package) in project_modules().items() if is_package}
    assert set(PYPROJECT["tool"]["setuptools"]["packages"]) == packages


def test_the_install_has_one_import_root(tmp_path: Path) -> None:
    """Outside the checkout (no repository folder on sys.path) the installed names resolve to
    the repository's folders, and the old top-level ones do not exist."""
    check = (
        "import importlib.metadata as md, importlib.util as u, sys\n"
        "spec = u.find_spec('codraft.server.worker_ext')\n"
        "print(spec.origin)\n"
        "print([u.find_spec(n) for n in ('server', 'learner', 'client')])\n"
        "eps = md.entry_points(group='vllm.general_plugins')\n"
        "print([e.value for e in eps if e.name == 'codraft'])\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run(
        [sys.executable, "-c", check], capture_output=True, text=True, cwd=tmp_path, env=env
    )
    assert r.returncode == 0, r.stderr
    origin, tops, plugin = r.stdout.splitlines()
    assert Path(origin) == REPO / "server" / "worker_ext.py"
    assert tops == "[None, None, None]"
    assert plugin == "['codraft.server.plugin:register']"
