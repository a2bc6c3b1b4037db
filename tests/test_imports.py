"""The package's import graph: acyclic (module-level and function-level imports alike), and
``import k3tail`` stays cheap (no flashinfer).

The graph is read from the sources with ``ast`` (nothing is imported to build it): every
``import`` / ``from ... import`` statement anywhere in a module (top level, inside functions,
under ``if``/``try``) is an edge to the k3tail module it names.  ``from pkg import name`` is an
edge to ``pkg.name`` when that is a module, else to ``pkg`` (a submodule that imports a
name from its own package's ``__init__`` depends on that ``__init__``).  The implicit import
of a package before its submodules is not an edge: Python initializes the package first
whatever the order, so it cannot close a cycle by itself.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# source folder -> package name (pyproject's package-dir: the kernel folders install inside k3tail)
PACKAGES = {"k3tail": "k3tail", "triton_kernels": "k3tail.triton_kernels",
            "cute_fallback": "k3tail.cute_fallback"}


def _modules() -> dict:
    """{module name: (path, is_package)} of every module of the package."""
    out = {}
    for folder, pkg in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT / folder).with_suffix("").parts
            if rel[-1] == "__init__":
                out[".".join((pkg, *rel[:-1]))] = (path, True)
            else:
                out[".".join((pkg, *rel))] = (path, False)
    return out


def _resolve(module: str, is_pkg: bool, level: int, name) -> str:
    if level == 0:
        return name or ""
    base = module.split(".")
    if not is_pkg:
        base = base[:-1]
    if level > 1:
        base = base[:-(level - 1)]
    return ".".join(base + ([name] if name else []))


def import_graph() -> dict:
    mods = _modules()
    graph = {m: set() for m in mods}
    for mod, (path, is_pkg) in mods.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.Import):
                for a in node.names:
                    # `import a.b.c` imports a, a.b and a.b.c
                    parts = a.name.split(".")
                    targets += [".".join(parts[:i + 1]) for i in range(len(parts))]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(mod, is_pkg, node.level, node.module)
                for a in node.names:
                    # `from pkg import name`: the module pkg.name if there is one, else pkg
                    sub = f"{base}.{a.name}"
                    targets.append(sub if sub in mods else base)
            for t in targets:
                if t in mods and t != mod:
                    graph[mod].add(t)
    return graph


def find_cycles(graph: dict) -> list:
    """Every strongly connected component with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
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

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_graph_sees_the_package():
    g = import_graph()
    # sanity: the walk finds the modules and known edges (the test cannot pass on an empty graph)
    assert {"k3tail", "k3tail.runtime.workspace", "k3tail.runtime.launch", "k3tail.ops.finalize_ar_norm",
            "k3tail.ops.custom_ops",
            "k3tail.triton_kernels.lamport", "k3tail.cute_fallback.mnnvl"} <= set(g)
    assert {"k3tail.runtime.workspace", "k3tail.runtime.loopback"} & g["k3tail.runtime.launch"]
    assert "k3tail.runtime.launch" in g["k3tail.ops.allreduce"]
    assert "k3tail.ops.custom_ops" in g["k3tail.ops.finalize_ar_norm"]  # the function-level import is counted
    assert "k3tail.triton_kernels.allreduce" in g["k3tail.ops.allreduce"]


def test_find_cycles_detects_function_level_cycles():
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [["a", "b", "c"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    cycles = find_cycles(import_graph())
    assert not cycles, f"import cycles among k3tail modules: {cycles}"


def test_import_k3tail_does_not_import_flashinfer():
    code = ("import sys, k3tail\n"
            "bad = sorted(m for m in sys.modules if m == 'flashinfer' or m.startswith('flashinfer.'))\n"
            "print('BAD', bad)\n"
            "assert not bad, bad\n")
    env = {**os.environ, "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET", "1")}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "BAD []" in p.stdout


# ------------------------------------------------------------------ the layers (DESIGN §11)
# Bottom to top; a module may import modules of its own layer or below, never above.
LAYERS = (
    ("kernels", ("k3tail.triton_kernels", "k3tail.errors")),
    ("runtime", ("k3tail.config", "k3tail.numerics", "k3tail.reference", "k3tail.runtime")),
    ("ops", ("k3tail.ops", "k3tail.cute_fallback")),
    ("collectives", ("k3tail.collectives", "k3tail.tuning", "k3tail.vote")),
    ("tiers", ("k3tail.tiers",)),
    ("module", ("k3tail.module",)),
    ("tools", ("k3tail.tools", "k3tail.testing", "k3tail.__main__")),
)


def layer_of(mod: str) -> int:
    if mod == "k3tail":
        return len(LAYERS)  # the package's public face names every layer (lazily)
    for i, (_, prefixes) in enumerate(LAYERS):
        if any(mod == p or mod.startswith(p + ".") for p in prefixes):
            return i
    raise AssertionError(f"{mod} is in no layer: add it to tests/test_imports.LAYERS")


def test_imports_go_down_the_layers():
    g = import_graph()
    up = [(m, t) for m, targets in g.items() for t in targets
          if t != "k3tail" and layer_of(t) > layer_of(m)]
    assert not up, "imports that go up a layer: " + ", ".join(f"{m} -> {t}" for m, t in sorted(up))


def _top_level_names(path: Path) -> set:
    names = set()
    for n in ast.parse(path.read_text()).body:
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(n.name)
        elif isinstance(n, (ast.Assign, ast.AnnAssign)):
            for t in (n.targets if isinstance(n, ast.Assign) else [n.target]):
                names |= {x.id for x in ast.walk(t) if isinstance(x, ast.Name)}
    return names


def test_names_come_from_their_defining_module_and_privates_stay_home():
    """No facades: ``from k3tail.X import name`` names something X defines (a module of the package
    is fine too), except the package's public names; and no module imports another's private name."""
    mods = _modules()
    defined = {m: _top_level_names(p) for m, (p, _) in mods.items()}
    bad = []
    for mod, (path, is_pkg) in mods.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom):
                continue
            base = _resolve(mod, is_pkg, node.level, node.module)
            if not base.startswith("k3tail"):
                continue
            for a in node.names:
                if f"{base}.{a.name}" in mods or base == "k3tail":
                    continue
                if a.name not in defined.get(base, ()):
                    bad.append(f"{mod}: {a.name} from {base}, which does not define it")
                elif a.name.startswith("_"):
                    bad.append(f"{mod}: private {a.name} from {base}")
    assert not bad, "\n".join(bad)
