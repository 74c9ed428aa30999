"""The package layout, checked from the source (docs/design-notes.md, "Layout").

Rules, each a test:
  * `vmm` (memory) and `jenga` (integers) are independent bottoms: neither imports the other,
    and `jenga` never imports torch;
  * the KV cache (`integrations.kvcache`) sits above both and below the engines: it imports
    no engine integration;
  * no import circle between files (module-level and function-level imports both count;
    `if TYPE_CHECKING:` blocks do not, they never run); in `vmm` not even a type-only one
    (`if TYPE_CHECKING:` imports count too: a module names what it needs by a protocol);
  * every import of vLLM goes through `integrations.vllm.compat`; the vLLM harness imports
    the product, never the reverse;
  * no module assigns another module's private attribute (`obj._name = ...` where `_name`
    is not an attribute the writing module itself defines on `self`);
  * no file over 800 lines, no function over 60 lines.

The walk is static (ast), so it sees lazy imports a runtime check would miss.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("vmm", "jenga", "integrations")
MAX_FILE_LINES = 800
MAX_FUNCTION_LINES = 60
# Checks that do not hold yet while issue 11's refactor lands, one (test, area) per line;
# strict xfails, so a check that starts to hold must be taken off this list.
PENDING: set[tuple[str, str]] = set()


def _areas(test: str) -> list[object]:
    return [
        pytest.param(a, marks=pytest.mark.xfail(strict=True, reason="issue 11 in progress"))
        if (test, a) in PENDING
        else a
        for a in AREAS
    ]


def _pending(test: str) -> pytest.MarkDecorator:
    return pytest.mark.xfail((test, "") in PENDING, strict=True, reason="issue 11 in progress")


# Areas the per-area checks run over; an area is a dotted prefix.
AREAS = (
    "vmm",
    "jenga",
    "integrations.kvcache",
    "integrations.vllm",
    "integrations.hf",
    "integrations.engine",
)


@dataclass(frozen=True)
class Module:
    name: str
    path: Path
    tree: ast.Module

    @property
    def is_package(self) -> bool:
        return self.path.stem == "__init__"


def _sources(package: str) -> Iterator[Path]:
    """The package's .py files, plus the generated stub of each compiled module (a .pyi
    with no .py beside it: `vmm._core`, `jenga._core`), so that importing a compiled
    module is an edge to that module, not to its parent package."""
    yield from sorted((ROOT / package).rglob("*.py"))
    yield from (
        p for p in sorted((ROOT / package).rglob("*.pyi")) if not p.with_suffix(".py").exists()
    )


def _modules() -> dict[str, Module]:
    out: dict[str, Module] = {}
    for package in PACKAGES:
        for path in _sources(package):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            name = ".".join(parts)
            out[name] = Module(name, path, ast.parse(path.read_text(), str(path)))
    return out


MODULES = _modules()


def _runtime_nodes(tree: ast.AST) -> Iterator[ast.AST]:
    """Every node except those under `if TYPE_CHECKING:`."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            yield from (n for child in node.orelse for n in _runtime_nodes_and_self(child))
            continue
        yield node
        yield from _runtime_nodes(node)


def _runtime_nodes_and_self(node: ast.AST) -> Iterator[ast.AST]:
    yield node
    yield from _runtime_nodes(node)


def _absolute(module: Module, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.name.split(".")
    if not module.is_package:
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def imported_names(module: Module, *, type_only: bool = False) -> Iterator[str]:
    """Dotted names this module imports at run time (submodules resolved where they exist);
    with `type_only`, those under `if TYPE_CHECKING:` too."""
    for node in ast.walk(module.tree) if type_only else _runtime_nodes(module.tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            target = _absolute(module, node)
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                yield sub if sub in MODULES else target


def project_imports(module: Module, *, type_only: bool = False) -> set[str]:
    out = set()
    for name in imported_names(module, type_only=type_only):
        while name and name not in MODULES:
            name = name.rpartition(".")[0]
        if name and name != module.name:
            out.add(name)
    return out


def _top(name: str) -> str:
    return name.split(".")[0]


@pytest.mark.parametrize(("lower", "forbidden"), [("vmm", "jenga"), ("jenga", "vmm")])
def test_vmm_and_jenga_are_independent(lower: str, forbidden: str) -> None:
    bad = sorted(
        f"{m.name} imports {name}"
        for m in MODULES.values()
        if _top(m.name) == lower
        for name in imported_names(m)
        if _top(name) in (forbidden, "integrations")
    )
    assert bad == []


def test_jenga_never_imports_torch() -> None:
    bad = sorted(
        f"{m.name} imports {name}"
        for m in MODULES.values()
        if _top(m.name) == "jenga"
        for name in imported_names(m)
        if _top(name) == "torch"
    )
    assert bad == []


def test_kvcache_imports_no_engine() -> None:
    bad = sorted(
        f"{m.name} imports {name}"
        for m in MODULES.values()
        if m.name.startswith("integrations.kvcache")
        for name in project_imports(m)
        if name.startswith("integrations.") and not name.startswith("integrations.kvcache")
    )
    assert bad == []


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def _in_area(name: str, area: str) -> bool:
    return name == area or name.startswith(area + ".")


@pytest.mark.parametrize("area", _areas("test_no_import_circles"))
def test_no_import_circles(area: str) -> None:
    graph = {name: project_imports(m) for name, m in MODULES.items()}
    cycles = _cycles(graph)
    assert [c for c in cycles if any(_in_area(name, area) for name in c)] == []


# Areas where type-only imports (`if TYPE_CHECKING:`) count towards circles as well.
TYPE_ONLY_AREAS = ("vmm",)


@pytest.mark.parametrize("area", TYPE_ONLY_AREAS)
def test_no_type_only_import_circles(area: str) -> None:
    graph = {
        name: project_imports(m, type_only=_in_area(name, area)) for name, m in MODULES.items()
    }
    cycles = _cycles(graph)
    assert [c for c in cycles if any(_in_area(name, area) for name in c)] == []


def test_type_only_imports_are_edges_where_asked() -> None:
    tree = ast.parse(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from vmm.pool import ChunkPool\n"
    )
    module = Module("vmm.example", ROOT / "vmm" / "example.py", tree)
    assert project_imports(module) == set()
    assert project_imports(module, type_only=True) == {"vmm.pool"}


def test_cycle_finder_finds_a_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]


@_pending("test_vllm_is_imported_only_through_compat")
def test_vllm_is_imported_only_through_compat() -> None:
    bad = sorted(
        f"{m.name} imports {name}"
        for m in MODULES.values()
        if m.name != "integrations.vllm.compat"
        for name in imported_names(m)
        if _top(name) == "vllm"
    )
    assert bad == []


def test_vllm_product_never_imports_its_harness() -> None:
    bad = sorted(
        f"{m.name} imports {name}"
        for m in MODULES.values()
        if m.name.startswith("integrations.vllm") and ".harness" not in m.name
        for name in project_imports(m)
        if name.startswith("integrations.vllm.harness")
    )
    assert bad == []


def _self_attributes(tree: ast.AST) -> set[str]:
    out = set()
    for node in ast.walk(tree):
        for target in _assigned(node):
            if _on_self(target):
                out.add(target.attr)
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    out.add(item.target.id)
                if isinstance(item, ast.Assign):
                    out.update(t.id for t in item.targets if isinstance(t, ast.Name))
    return out


def _on_self(target: ast.expr) -> bool:
    return (
        isinstance(target, ast.Attribute)
        and isinstance(target.value, ast.Name)
        and target.value.id in ("self", "cls")
    )


def _assigned(node: ast.AST) -> list[ast.expr]:
    if isinstance(node, ast.Assign):
        return [t for target in node.targets for t in _flatten(target)]
    if isinstance(node, ast.AugAssign | ast.AnnAssign):
        return [node.target]
    return []


def _flatten(target: ast.expr) -> list[ast.expr]:
    if isinstance(target, ast.Tuple | ast.List):
        return [t for elt in target.elts for t in _flatten(elt)]
    return [target]


def _is_private(attr: str) -> bool:
    return attr.startswith("_") and not attr.startswith("__")


def foreign_private_writes(tree: ast.AST) -> list[str]:
    own = _self_attributes(tree)
    bad = []
    for node in ast.walk(tree):
        for target in _assigned(node):
            if (
                isinstance(target, ast.Attribute)
                and _is_private(target.attr)
                and target.attr not in own
                and not _on_self(target)
            ):
                bad.append(f"{ast.unparse(target)} (line {node.lineno})")
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "setattr"
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and _is_private(node.args[1].value)
            and node.args[1].value not in own
        ):
            bad.append(f"setattr(..., {node.args[1].value!r}) (line {node.lineno})")
    return bad


@pytest.mark.parametrize("area", _areas("test_no_module_writes_another_modules_private_names"))
def test_no_module_writes_another_modules_private_names(area: str) -> None:
    bad = {
        name: writes
        for name, m in MODULES.items()
        if _in_area(name, area) and (writes := foreign_private_writes(m.tree))
    }
    assert bad == {}


def test_private_write_finder_finds_one() -> None:
    tree = ast.parse("def f(pool):\n    pool._broken = True\n")
    assert foreign_private_writes(tree) == ["pool._broken (line 2)"]
    own = ast.parse("class A:\n    def f(self, o):\n        self._x = 1\n        o._x = 2\n")
    assert foreign_private_writes(own) == []


def _python_files() -> Iterator[Path]:
    for folder in (*PACKAGES, "benchmarks", "tests"):
        yield from sorted((ROOT / folder).rglob("*.py"))


@_pending("test_no_file_over_800_lines")
def test_no_file_over_800_lines() -> None:
    sizes = {str(p.relative_to(ROOT)): p.read_text().count("\n") for p in _python_files()}
    assert {path: n for path, n in sizes.items() if n > MAX_FILE_LINES} == {}


@_pending("test_no_function_over_60_lines")
def test_no_function_over_60_lines() -> None:
    long = {}
    for path in _python_files():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    long[f"{path.relative_to(ROOT)}:{node.lineno} {node.name}"] = length
    assert long == {}
