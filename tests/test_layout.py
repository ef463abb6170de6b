"""The package's layout: one-way imports and small modules (issue 25).

Every ``import`` of ``mapoffload``'s own modules, at any depth in a module (a function's lazy import
too), is an edge of the module graph. The graph has no circle, counting the imports under
``if TYPE_CHECKING:`` too (issue 42: two modules that name each other's types are one concept split); the layers import downward only (running -> page cache -> memory, and loading -> memory):
``mapoffload.memory`` imports neither ``loading``, ``pagecache`` nor ``offload``,
``mapoffload.pagecache`` does not import ``offload``, ``mapoffload.loading`` imports none of
``pagecache``, ``offload``, ``hf``, ``vllm``; ``mapoffload.conversion`` (the conversion cache ``hf``
and ``vllm`` share) imports none of ``pagecache``, ``offload``, ``hf``, ``vllm``; no function or method longer than
``MAX_FUNCTION_LINES`` (issue 34: one function, one job). Modules have no length cap (issue 42: a file
holds one concept whole, however long); the stack runtime has a size (issue 42): ``mapoffload/offload/``
in twelve modules at most, no class in the package over twenty methods, the manager a facade of fifteen public
methods at most.
"""

from __future__ import annotations

import ast
import os

import pytest

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "mapoffload")
MAX_FUNCTION_LINES = 100  # from the ``def`` line to the last line of the body, docstring included


def _modules() -> dict[str, str | None]:
    """Dotted name -> path of every module of the package (None: the native extension, from its stubs)."""
    out: dict[str, str | None] = {}
    top = os.path.dirname(PACKAGE)
    for folder, _, files in os.walk(PACKAGE):
        for f in files:
            path = os.path.join(folder, f)
            parts = os.path.relpath(path, top).split(os.sep)
            if f.endswith(".py"):
                parts[-1] = parts[-1][:-3]
                if parts[-1] == "__init__":
                    parts.pop()
                out[".".join(parts)] = path
            elif f.endswith(".pyi") and not os.path.exists(path[:-1]):
                parts[-1] = parts[-1][:-4]
                out[".".join(parts)] = None
    return out


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST, typing: bool = False) -> list[ast.Import | ast.ImportFrom]:
    """Every import in ``tree``, at any depth; those under ``if TYPE_CHECKING:`` only when ``typing``."""
    found: list = []

    def walk(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if not typing and isinstance(child, ast.If) and _is_type_checking(child):
                for other in child.orelse:
                    walk_one(other)
                continue
            walk_one(child)

    def walk_one(child: ast.AST) -> None:
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            found.append(child)
        walk(child)

    walk(tree)
    return found


def module_graph(typing: bool = False) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (``typing``: those it imports for its annotations too)."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges: set[str] = set()
        if path is not None:
            package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
            with open(path) as f:
                tree = ast.parse(f.read(), path)
            for node in _imports(tree, typing):
                if isinstance(node, ast.Import):
                    edges.update(a.name for a in node.names if a.name in modules)
                    continue
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    if sub in modules:
                        edges.add(sub)
                    elif target in modules:
                        edges.add(target)
        edges.discard(name)
        graph[name] = edges
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, edges = work[-1]
            for w in edges:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
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


def test_the_graph_sees_the_imports():
    graph = module_graph()
    assert "mapoffload.pagecache.coordinator" in graph["mapoffload.offload.parts"]
    assert "mapoffload._core" in graph["mapoffload._native"]  # the extension, known from its stubs
    assert "mapoffload.memory.ranks" in graph["mapoffload.memory.budget"]  # a function's lazy import counts


def test_no_import_circle():
    assert _circles(module_graph()) == []


def test_no_import_circle_counting_annotations():
    assert _circles(module_graph(typing=True)) == []


def test_the_annotations_graph_sees_type_checking_imports():
    assert "mapoffload.offload.sequencer" in module_graph(typing=True)["mapoffload.offload.manager"]


def test_a_circle_is_found():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


@pytest.mark.parametrize("layer, above", [
    ("mapoffload.memory", ("mapoffload.loading", "mapoffload.pagecache", "mapoffload.offload", "mapoffload.hf",
                           "mapoffload.vllm")),
    ("mapoffload.pagecache", ("mapoffload.offload", "mapoffload.hf", "mapoffload.vllm")),
    ("mapoffload.loading", ("mapoffload.pagecache", "mapoffload.offload", "mapoffload.hf", "mapoffload.vllm")),
    ("mapoffload.conversion", ("mapoffload.pagecache", "mapoffload.offload", "mapoffload.hf", "mapoffload.vllm")),
])
def test_layers_import_downward_only(layer, above):
    graph = module_graph()
    wrong = sorted((m, t) for m, targets in graph.items() if m == layer or m.startswith(layer + ".")
                   for t in targets if any(t == a or t.startswith(a + ".") for a in above))
    assert wrong == []


def test_nothing_process_wide_in_the_offload_parts():
    names = set(module_graph())
    for process_wide in ("coordinator", "peers", "kernel", "uncached_read"):
        assert f"mapoffload.pagecache.{process_wide}" in names
        assert f"mapoffload.offload.{process_wide}" not in names
    assert not any(n.startswith("mapoffload._manager") for n in names)


def test_page_cache_policy_is_in_the_page_cache_layer():
    names = set(module_graph())
    for policy in ("layer_pages", "member", "read_source"):
        assert f"mapoffload.pagecache.{policy}" in names
        assert f"mapoffload.offload.{policy}" not in names


def test_the_page_cache_names_the_mapped_store_as_the_stores_do():
    from mapoffload.offload.stores import MAPPED
    from mapoffload.pagecache import layer_pages

    assert layer_pages.MAPPED == MAPPED


def long_functions(source: str, path: str = "<string>", limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """``"path:line name (n lines)"`` of every function or method (nested ones too) longer than ``limit``
    lines, counted from its ``def`` line (decorators excluded) to its last line."""
    out = []
    for node in ast.walk(ast.parse(source, path)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            n = node.end_lineno - node.lineno + 1
            if n > limit:
                out.append(f"{path}:{node.lineno} {node.name} ({n} lines)")
    return out


def test_no_function_over_the_line_limit():
    over = []
    for path in _modules().values():
        if path is not None:
            with open(path) as f:
                over += long_functions(f.read(), os.path.relpath(path, os.path.dirname(PACKAGE)))
    assert over == [], "functions over %d lines: %s" % (MAX_FUNCTION_LINES, "; ".join(sorted(over)))


def test_a_long_function_is_found():
    source = (
        "@decorated\n"          # 1: not counted
        "def three():\n"         # 2
        "    a = 1\n"
        "    return a\n"         # 4
        "class C:\n"
        "    async def four(self):\n"  # 6
        "        def inner():\n"      # 7
        "            pass\n"          # 8
        "        return inner\n"      # 9
    )
    assert long_functions(source, "m.py", limit=3) == ["m.py:6 four (4 lines)"]
    assert sorted(long_functions(source, "m.py", limit=1)) == [
        "m.py:2 three (3 lines)", "m.py:6 four (4 lines)", "m.py:7 inner (2 lines)"]


def test_the_load_targets_are_siblings_behind_one_interface():
    import inspect

    from mapoffload.offload.device_copies import DeviceCopies
    from mapoffload.offload.loads import InPlace
    from mapoffload.offload.loads import Target

    for target in (InPlace, DeviceCopies):
        assert issubclass(target, Target) and not inspect.isabstract(target), target
    assert inspect.isabstract(Target)


# --- the stack runtime's size (issue 42) ----------------------------------------------------------------------
MAX_OFFLOAD_MODULES = 12  # mapoffload/offload/, its __init__ included
MAX_CLASS_METHODS = 20  # functions defined in a class body, private and dunder ones included; properties apart
MAX_MANAGER_PUBLIC_METHODS = 15


def _is_property(node: ast.FunctionDef) -> bool:
    return any((isinstance(d, ast.Name) and d.id in ("property", "cached_property"))
               or (isinstance(d, ast.Attribute) and d.attr in ("setter", "deleter")) for d in node.decorator_list)


def class_methods(source: str, path: str = "<string>") -> dict[str, list[str]]:
    """``"path:Class"`` -> the names of the methods its body defines (properties left out: they are the state
    it shows, counted apart), for every class at any depth."""
    out = {}
    for node in ast.walk(ast.parse(source, path)):
        if isinstance(node, ast.ClassDef):
            out[f"{path}:{node.name}"] = [m.name for m in node.body if isinstance(
                m, (ast.FunctionDef, ast.AsyncFunctionDef)) and not _is_property(m)]
    return out


def _offload_paths() -> list[str]:
    return sorted(p for n, p in _modules().items()
                  if p is not None and (n == "mapoffload.offload" or n.startswith("mapoffload.offload.")))


def test_the_offload_layer_is_twelve_modules_at_most():
    paths = _offload_paths()
    assert 8 <= len(paths) <= MAX_OFFLOAD_MODULES, [os.path.basename(p) for p in paths]


def test_no_class_over_twenty_methods():
    """In the whole package (the stack runtime's ``offload/`` and the page cache's classes alike)."""
    over = {}
    for path in sorted(p for p in _modules().values() if p is not None):
        with open(path) as f:
            for cls, methods in class_methods(f.read(), os.path.relpath(path, os.path.dirname(PACKAGE))).items():
                if len(methods) > MAX_CLASS_METHODS:
                    over[cls] = len(methods)
    assert over == {}


def test_the_manager_is_a_facade_of_fifteen_public_methods_at_most():
    """Its properties counted too: the facade says the fixed names (DESIGN.md) and nothing else."""
    import inspect

    from mapoffload.offload import LayerwiseOffloadManager

    public = [n for n, v in vars(LayerwiseOffloadManager).items()
              if not n.startswith("_") and (inspect.isfunction(v) or isinstance(v, property))]
    assert 10 <= len(public) <= MAX_MANAGER_PUBLIC_METHODS, public
    assert {"register_forward_hooks", "residency", "mapped_bytes", "iter_cpu_weights", "close"} <= set(public)


def test_methods_are_counted_and_properties_are_not():
    source = (
        "class C:\n"
        "    def __init__(self): pass\n"
        "    @property\n"
        "    def p(self): return 1\n"
        "    @p.setter\n"
        "    def p(self, v): pass\n"
        "    def _private(self): pass\n"
        "    async def run(self): pass\n"
        "    class Inner:\n"
        "        def one(self): pass\n"
    )
    assert class_methods(source, "m.py") == {"m.py:C": ["__init__", "_private", "run"], "m.py:Inner": ["one"]}
