"""The package layout's import rules, read from the source (docs/design.md §3).

Inside router/ and inside workers/, no two modules import each other, directly or around
a loop: the modules' top-level imports form an acyclic graph. In router/ that holds for
the imports under `if TYPE_CHECKING:` too (a type shared by two modules lives below both);
in workers/ those are left out, as they never run. And the real engine (workers/engine) never imports the
simulator (workers/sim).
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or \
        (isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _imported(module: str, is_package: bool, body: list[ast.stmt], typing: bool) -> set[str]:
    """Every dotted name a module's top level imports (a module, or a name in one);
    `typing`: those under `if TYPE_CHECKING:` as well."""
    out: set[str] = set()
    for node in body:
        if isinstance(node, ast.If):
            if typing or not _type_checking(node):
                out |= _imported(module, is_package, node.body, typing)
                out |= _imported(module, is_package, node.orelse, typing)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                out |= _imported(module, is_package, block, typing)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base[:len(base) - node.level + (1 if is_package else 0)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            out.add(source)
            out |= {f"{source}.{a.name}" for a in node.names}
    return out


def import_graph(root: Path, packages: list[str], typing: bool = False) -> dict[str, set[str]]:
    """module -> the modules of `packages` it imports at its top level (itself left out)."""
    paths = {_module_name(p, root): p for pkg in packages for p in sorted((root / pkg).rglob("*.py"))}
    graph = {}
    for name, path in paths.items():
        names = _imported(name, path.name == "__init__.py", ast.parse(path.read_text()).body, typing)
        graph[name] = {n for n in names if n in paths and n != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1:
                found.append(sorted(scc))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle_inside_router_or_workers() -> None:
    assert cycles(import_graph(ROOT, ["router"], typing=True)) == []
    assert cycles(import_graph(ROOT, ["workers"])) == []


def test_the_cycle_check_finds_a_loop(tmp_path: Path) -> None:
    """The check can fail: a loop through a package-relative import, and one through
    `from . import x`, are found; one closed only under TYPE_CHECKING is one only when
    those imports are counted."""
    pkg = tmp_path / "p"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .sub.b import f\n")
    (pkg / "sub" / "b.py").write_text("from ..a import g\n")
    (pkg / "c.py").write_text("from . import d\n")
    (pkg / "d.py").write_text("import p.c\n")
    (pkg / "e.py").write_text("from typing import TYPE_CHECKING\nfrom .f import x\n")
    (pkg / "f.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .e import y\n")
    assert cycles(import_graph(tmp_path, ["p"])) == [["p.a", "p.sub.b"], ["p.c", "p.d"]]
    assert cycles(import_graph(tmp_path, ["p"], typing=True)) == [["p.a", "p.sub.b"], ["p.c", "p.d"], ["p.e", "p.f"]]

