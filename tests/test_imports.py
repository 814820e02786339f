"""No import circles between llmjax's modules (issue 40; DESIGN: one way through the house).

The imports are read from the source with `ast` (every `import` and `from ... import`, at module
level or inside a function, a `TYPE_CHECKING` block included), each resolved to the llmjax module
it names (`from llmjax.model import quant` names llmjax.model.quant; `from llmjax.config import
X` names llmjax.config). A module may import its own package's `__init__` (re-exports), which is
not an edge here; every other edge counts. The test fails naming the modules of any strongly
connected component of more than one module, with the import lines that close it.

The house has floors (`FLOORS`, bottom first; docs/structure.md draws them): a module may import
its own floor and those below, never one above, and every module stands on a floor (a new package
is placed in the table, by its longest matching prefix)."""

from __future__ import annotations

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def modules(package: str = "llmjax") -> dict[str, str]:
    """Module name -> file path, for every .py file under the package."""
    out = {}
    for d, _, files in os.walk(os.path.join(ROOT, package)):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(d, f)
                name = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                out[name.removesuffix(".__init__")] = path
    return out


def _named(node: ast.AST, module: str, path: str) -> list[str]:
    """The dotted names an import statement may refer to (longest first resolved later)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if node.level:  # a relative import
        parts = module.split(".")
        if not path.endswith("__init__.py"):
            parts = parts[:-1]
        parts = parts[: len(parts) - node.level + 1]
        base = ".".join(parts + ([node.module] if node.module else []))
    else:
        base = node.module or ""
    return [base] + [f"{base}.{a.name}" for a in node.names]


def import_graph(package: str = "llmjax") -> dict[str, dict[str, int]]:
    """module -> {imported llmjax module: line of the first such import}."""
    mods = modules(package)
    graph = {}
    for module, path in mods.items():
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        edges: dict[str, int] = {}
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for name in _named(node, module, path):
                while name and name not in mods:
                    name = name.rpartition(".")[0]
                if name and name != module and not module.startswith(name + "."):
                    edges.setdefault(name, node.lineno)
        graph[module] = edges
    return graph


FLOORS: list[tuple[str, tuple[str, ...]]] = [
    # Configs, sampling parameters and data: import nothing of llmjax.
    ("ground", ("llmjax.config", "llmjax.sampling_params", "llmjax.progress", "llmjax.data")),
    # The device side: pure functions over pytrees, their sharding, weights and tokenizers.
    (
        "device",
        (
            "llmjax.model",
            "llmjax.parallel",
            "llmjax.checkpoint",
            "llmjax.tokenizer",
            "llmjax.roofline",
        ),
    ),
    # One engine on its device: the host side, sparse KV, the KV tiers, and the simulated
    # device that stands in for the runner (sim/'s device half: the engine picks its runner).
    (
        "engine",
        (
            "llmjax.engine",
            "llmjax.sparse",
            "llmjax.kvstore",
            "llmjax.sim.runner",
            "llmjax.sim.cost",
            "llmjax.sim.hardware",
            "llmjax.sim.roofline",
            "llmjax.sim.kvpool",
            "llmjax.lora",
        ),
    ),
    # The user-facing LLM over one engine, and how its weights and options are loaded.
    ("llm", ("llmjax.llm", "llmjax.llm_options", "llmjax.loading")),
    # Many engines: the cluster core and its two drivers (sim/'s cluster half), programs.
    ("cluster", ("llmjax.cluster", "llmjax.program", "llmjax.sim")),
    # Front doors and tools over all of it: the server, benchmarks, flags, notebooks' helpers,
    # the RL trainer (rl/) over an LLM.
    (
        "doors",
        (
            "llmjax.serve",
            "llmjax.bench",
            "llmjax.viz",
            "llmjax.notebook",
            "llmjax.peer_worker",
            "llmjax.engine_flags",
            "llmjax.quality",
            "llmjax.rl",
            "llmjax",
        ),
    ),
]


def floor_of(module: str, floors=FLOORS) -> int | None:
    """The index of the floor whose longest prefix matches `module` (None: on no floor)."""
    best, length = None, -1
    for i, (_, prefixes) in enumerate(floors):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > length:
                best, length = i, len(p)
    return best


def upward_imports(graph, floors=FLOORS) -> list[str]:
    """Each import of a module on a higher floor than the importer's, as a readable line."""
    out = []
    for m, edges in sorted(graph.items()):
        for dep, line in edges.items():
            here, there = floor_of(m, floors), floor_of(dep, floors)
            if here is not None and there is not None and there > here:
                out.append(f"{m}:{line} ({floors[here][0]}) imports {dep} ({floors[there][0]})")
    return out


def circles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's, iterative)."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(graph[root]))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(graph[w])))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def test_the_walk_finds_a_circle_it_is_shown():
    """The walker itself: a made-up graph with one circle and one chain."""
    graph = {"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3}, "d": {"a": 4}, "e": {}}
    assert circles(graph) == [["a", "b", "c"]]
    assert circles({"a": {"b": 1}, "b": {}}) == []


def test_relative_and_aliased_imports_resolve():
    graph = import_graph()
    assert "llmjax.model.quant" in graph["llmjax.model.moe"]  # `from llmjax.model.quant import`
    assert "llmjax.config" in graph["llmjax.model.layers"]
    assert all(not m.startswith("jax") for edges in graph.values() for m in edges)


@pytest.mark.parametrize("package", ["llmjax"])
def test_no_import_circles(package):
    graph = import_graph(package)
    found = circles(graph)
    lines = []
    for component in found:
        members = set(component)
        lines.append(" <-> ".join(component))
        for m in component:
            for dep, line in graph[m].items():
                if dep in members:
                    lines.append(f"    {m}:{line} imports {dep}")
    assert not found, "import circles:\n" + "\n".join(lines)


def test_the_floor_check_finds_an_upward_import():
    floors = [("low", ("p.a",)), ("high", ("p.b", "p"))]
    assert floor_of("p.a.x", floors) == 0 and floor_of("p.c", floors) == 1
    assert floor_of("q", floors) is None
    graph = {"p.a.x": {"p.b": 3}, "p.b": {"p.a.x": 1}, "p.c": {}}
    assert upward_imports(graph, floors) == ["p.a.x:3 (low) imports p.b (high)"]


def test_every_module_stands_on_a_floor():
    lost = [m for m in import_graph() if floor_of(m) is None]
    assert not lost, f"modules on no floor (place them in FLOORS): {lost}"


def test_no_floor_imports_a_higher_one():
    found = upward_imports(import_graph())
    assert not found, "imports that run up the house:\n" + "\n".join(found)
