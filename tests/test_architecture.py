"""The import structure of src/zerostack: no cycle of any size, imports inside functions
included, and the layers of pyproject.toml's import contract (``lint-imports``) kept.

A module-level scan misses an import written inside a function to dodge a cycle at import time;
this one reads every import statement of every module (those under ``if TYPE_CHECKING:`` aside:
they never run)."""

from __future__ import annotations

import ast
import importlib
import os
import re
import shutil
import subprocess
import sys
from collections import defaultdict

import pytest

import zerostack

SRC = os.path.dirname(os.path.dirname(zerostack.__file__))


def _modules() -> dict[str, str]:
    mods = {}
    for folder, _, files in os.walk(os.path.join(SRC, "zerostack")):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(folder, f)
                name = os.path.relpath(path, SRC)[:-3].replace(os.sep, ".")
                mods[name.removesuffix(".__init__")] = path
    return mods


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST):
    """Every import node, at any depth, outside ``if TYPE_CHECKING:`` blocks."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and _type_checking(node):
            yield from (n for child in node.orelse for n in _imports_of(child))
            continue
        yield from _imports_of(node)


def _imports_of(node: ast.AST):
    if isinstance(node, ast.Import | ast.ImportFrom):
        yield node
    yield from _imports(node)


def import_graph() -> dict[str, set[str]]:
    """Module -> the zerostack modules it imports (a package's own ``__init__`` counts as it)."""
    mods, graph = _modules(), defaultdict(set)
    for name, path in mods.items():
        package = name.split(".") if path.endswith("__init__.py") else name.split(".")[:-1]
        for node in _imports(ast.parse(open(path).read())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = package[: len(package) - (node.level - 1)] if node.level else []
                mod = ".".join(base + ([node.module] if node.module else []))
                targets = [
                    f"{mod}.{a.name}" if f"{mod}.{a.name}" in mods else mod for a in node.names
                ]
            graph[name].update(t for t in targets if t in mods and t != name)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
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

    for v in list(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_even_through_imports_inside_functions():
    graph = import_graph()
    assert len(graph) > 100  # the scan sees the whole package
    assert "zerostack.engine" in graph["zerostack.compose"]
    assert cycles(graph) == []


def test_the_scan_finds_a_cycle_made_inside_a_function():
    """The scan's own check: a planted import inside a function that closes a loop is found."""
    graph = import_graph()
    graph["zerostack.comm.grid"].add("zerostack.engine")  # as `def f(): from ..engine import x`
    assert any("zerostack.comm.grid" in c and "zerostack.engine" in c for c in cycles(graph))
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_layers_contract_is_kept():
    """pyproject.toml's import-linter contracts (the package's layers, and those inside the
    engine, core and zero): each layer imports only from layers below it (imports inside functions
    count)."""
    exe = shutil.which("lint-imports") or os.path.join(
        os.path.dirname(sys.executable), "lint-imports"
    )
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # its pyproject.toml
    # the package analysed is the one imported (PYTHONPATH first: the mutation gate's copy)
    done = subprocess.run(
        [exe, "--no-cache"], cwd=repo, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "4 kept, 0 broken" in done.stdout


# ------------------------------------------------------------------ the strategy's interface
def _is_strategy(node: ast.AST, bound: set[str]) -> bool:
    """``<expr>.zero`` (an engine's strategy; not the package, ``zerostack.zero``), or a name
    bound to one in the same function."""
    if isinstance(node, ast.Attribute) and node.attr == "zero":
        return not (isinstance(node.value, ast.Name) and node.value.id == "zerostack")
    return isinstance(node, ast.Name) and node.id in bound


def strategy_members_used(tree: ast.AST) -> dict[str, int]:
    """Member -> the first line that uses it, for every use of a strategy in ``tree``:
    ``engine.zero.x``, ``zero = engine.zero; zero.x`` (tuple assignments too) and
    ``getattr(engine.zero, "x", ...)``."""
    used: dict[str, int] = {}
    scopes = [n for n in ast.walk(tree) if isinstance(n, ast.Module | ast.FunctionDef)]
    for scope in scopes:
        bound: set[str] = set()
        for node in ast.walk(scope):
            if isinstance(node, ast.Assign) and len(node.targets) == 1:
                target, value = node.targets[0], node.value
                pairs = [(target, value)]
                if isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple):
                    pairs = list(zip(target.elts, value.elts, strict=False))
                bound |= {
                    t.id
                    for t, v in pairs
                    if isinstance(t, ast.Name) and _is_strategy(v, set())
                    and isinstance(v, ast.Attribute)
                }  # fmt: skip
        for node in ast.walk(scope):
            if isinstance(node, ast.Attribute) and _is_strategy(node.value, bound):
                used.setdefault(node.attr, node.lineno)
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr")
                and len(node.args) >= 2
                and _is_strategy(node.args[0], bound)
                and isinstance(node.args[1], ast.Constant)
            ):
                used.setdefault(node.args[1].value, node.lineno)
    return used


def _declared() -> set[str]:
    """Every member the strategy's interfaces declare (zero/strategy.py's Protocols)."""
    from zerostack.zero import strategy

    parts = (strategy.ZeroStrategy, strategy.WholeGrads, strategy.Pieces)
    names = set()
    for proto in parts:
        for cls in proto.__mro__:
            if cls.__module__ == strategy.__name__:
                names |= set(getattr(cls, "__annotations__", {}))
                names |= {k for k, v in vars(cls).items() if callable(v) and not k.startswith("_")}
    return names


def test_every_strategy_member_used_outside_zero_is_declared():
    """Code outside ``zero/`` talks to a strategy only through its declared interfaces (the
    training step, the checkpoint view, one parameter's access, and each family's extras)."""
    undeclared, seen = [], set()
    for name, path in _modules().items():
        if name == "zerostack.zero" or name.startswith("zerostack.zero."):
            continue
        for member, line in strategy_members_used(ast.parse(open(path).read())).items():
            seen.add(member)
            if member not in _declared():
                undeclared.append(f"{os.path.relpath(path, SRC)}:{line}: {member}")
    assert {"reduce_grads", "owned_slices", "window_grad", "release_gathered"} <= seen
    assert undeclared == []


def test_the_member_scan_finds_an_undeclared_use():
    """The scan's own check, on planted code: each way of reaching the strategy is seen."""
    code = (
        "def f(engine):\n"
        "    engine.zero.buckets\n"
        "    topo, zero = engine.topology, engine.zero\n"
        "    zero._where\n"
        "    getattr(self.engine.zero, 'coord', None)\n"
        "    zerostack.zero.Init\n"
    )
    used = strategy_members_used(ast.parse(code))
    assert set(used) == {"buckets", "_where", "coord"}
    assert not {"buckets", "_where", "coord"} & _declared()


# ------------------------------------------------------------------ sizes
# The 400/250 bounds are a review signal (scripts/sizes.py, printed by .ci/run), not a gate:
# a file is split where its responsibilities part, never packed to fit.
def test_the_size_report_names_each_file_and_class_past_its_bound(tmp_path):
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "scripts"))
    import sizes

    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "small.py").write_text("x = 1\n" * 400)
    (pkg / "sub" / "long.py").write_text("x = 1\n" * 401)
    body = "    x = 1\n" * 249
    (pkg / "fits.py").write_text(f"class Fits:\n{body}")
    (pkg / "classes.py").write_text(f"class Over:\n{body}    y = 2\n")
    found = sizes.sizes(str(pkg))
    assert found == {"pkg/sub/long.py": 401, "pkg/classes.py:Over": 251}
    assert sizes.report(found).splitlines() == [
        "sizes: 2 over the review bounds (400 a file, 250 a class)",
        "    401  pkg/sub/long.py",
        "    251  pkg/classes.py:Over",
    ]


# ------------------------------------------------------------------ the map
def test_the_architecture_pages_map_is_the_docstrings():
    """docs/design/architecture.md's file map is generated from the packages' and modules'
    docstrings (scripts/architecture_map.py), so a moved or renamed file shows on the page."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "scripts"))
    import architecture_map
    from _pages import between

    shown = between(architecture_map.PAGE, architecture_map.BEGIN, architecture_map.END)
    assert shown == architecture_map.tree(), "run: python scripts/architecture_map.py --write"


def test_the_map_names_a_module_without_a_docstring(tmp_path):
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "scripts"))
    import architecture_map

    bare = tmp_path / "bare.py"
    bare.write_text("x = 1\n")
    with pytest.raises(ValueError, match="no docstring, so no line on the map"):
        architecture_map.first_sentence(str(bare))
    told = tmp_path / "told.py"
    told.write_text('"""The :class:`~a.b.Engine` of ``x``. More here."""\n')
    assert architecture_map.first_sentence(str(told)) == "The Engine of `x`"


_XREF = re.compile(r":(?:mod|class|func|meth|data|attr):`~?(\.*)([\w.]+)`")


def _unresolved(package: str, text: str) -> list[str]:
    """The cross-references in ``text`` (a file of ``package``) to zerostack's own modules
    and their members (relative, ``.x`` / ``..x``, or ``zerostack.x``) that name nothing."""
    bad = []
    for m in _XREF.finditer(text):
        dots, name = m.group(1), m.group(2)
        if not dots and not name.startswith("zerostack."):
            continue  # torch's, Python's, or a name in this module's own text
        base = package.split(".")
        if len(dots) > 1:
            base = base[: -(len(dots) - 1)]
        parts = (".".join(base) + "." + name if dots else name).split(".")
        for i in range(len(parts), 0, -1):  # the longest prefix that imports, then attributes
            try:
                obj = importlib.import_module(".".join(parts[:i]))
            except ImportError:
                continue
            for attr in parts[i:]:
                obj = getattr(obj, attr, _MISSING)
            if obj is _MISSING:
                bad.append(m.group(0))
            break
        else:
            bad.append(m.group(0))
    return bad


_MISSING = object()


def test_every_pointer_between_modules_names_what_is_there():
    """Docstrings point readers at modules and members (``:class:`~.write_back.WriteBack```);
    a file moved or renamed leaves them pointing nowhere. Each must import and resolve."""
    bad = []
    for name, path in sorted(_modules().items()):
        package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
        with open(path) as f:
            text = f.read()
        bad += [f"{path}: {ref}" for ref in _unresolved(package, text)]
    assert not bad, "\n".join(bad)


def test_the_pointer_scan_finds_a_moved_module():
    assert _unresolved("zerostack.zero.flat", ":class:`~.buffers.FlatBuffers`") == []
    assert _unresolved("zerostack.zero.flat", ":class:`~.flat_buffers.FlatBuffers`") != []
    assert _unresolved("zerostack.zero.flat", ":meth:`..strategy.CheckpointView.nope`") != []
    assert _unresolved("zerostack.zero", ":mod:`zerostack.nowhere`") != []
