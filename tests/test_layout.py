"""The package layout, checked from the source (docs/design-notes.md, "Layout").

Rules, each a test:
  * `vmm` (memory) and `jenga` (integers) are independent bottoms: neither imports the other,
    and `jenga` never imports torch;
  * the KV cache (`integrations.kvcache`) sits above both and below the engines: it imports
    no engine integration;
  * no import circle between files (module-level and function-level imports both count),
    not even a type-only one (`if TYPE_CHECKING:` imports count too: a module names what
    it needs by a protocol or a moved type);
  * every import of vLLM goes through `integrations.vllm.compat`; the vLLM harness imports
    the product, never the reverse;
  * no module assigns another module's private attribute (`obj._name = ...` where `_name`
    is not an attribute the writing module itself defines on `self`);
  * no file over 800 lines, no function over 60 lines (Python, and C++ in csrc/ through a
    brace scanner whose own test catches a long function in a synthetic snippet).

The walk is static (ast), so it sees lazy imports a runtime check would miss.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("vmm", "jenga", "integrations")
MAX_FILE_LINES = 800
MAX_FUNCTION_LINES = 60
# Checks that do not hold yet while a refactor lands, one (test, area) per line;
# strict xfails, so a check that starts to hold must be taken off this list.
PENDING: set[tuple[str, str]] = set()


def _areas(test: str) -> list[object]:
    return [
        pytest.param(a, marks=pytest.mark.xfail(strict=True, reason="refactor in progress"))
        if (test, a) in PENDING
        else a
        for a in AREAS
    ]


def _pending(test: str) -> pytest.MarkDecorator:
    return pytest.mark.xfail((test, "") in PENDING, strict=True, reason="refactor in progress")


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


# Type-only imports (`if TYPE_CHECKING:`) count towards circles as well, everywhere.
TYPE_ONLY_AREAS = AREAS


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


# -- C++ function sizes (csrc/) ------------------------------------------------------------
# A brace scanner, not a parser: comments, literals and preprocessor lines are blanked;
# at namespace or class level a `{` opens a function body when its header (the text since
# the last `;`, `{` or `}` there) is not a namespace / class / struct / union / enum /
# extern block, has parentheses outside any initializer and no top-level `=` (a lambda
# bound to a name at namespace level, `auto f = [..](..) {`, counts as a function). Every
# brace inside a body (blocks, lambdas, local classes) belongs to that body. A brace in a
# constructor's member initializer list (`: a_{x}, b_(y) {`) is seen as a body closed by
# `,` or `{` and folded back into the header.
CXX_SUFFIXES = (".cpp", ".hpp", ".cc", ".h", ".c")
_CXX_SKIP = re.compile(
    r"//[^\n]*|/\*.*?\*/|R\"(?P<d>[^(\s\"]{0,16})\(.*?\)(?P=d)\""
    r"|\"(?:\\.|[^\"\\\n])*\"|'(?:\\.|[^'\\\n])*'",
    re.S,
)
_CXX_SCOPE = re.compile(r"(typedef\s+)?(namespace|class|struct|union|enum)\b|extern\s*\"")
_CXX_ACCESS = re.compile(r"^\s*(public|private|protected)\s*:(?!:)")
_CXX_NAME = re.compile(r"((?:[\w~]+\s*::\s*)*(?:operator\s*[^\s(]+|[\w~]+))\s*\(")


def _blank(text: str) -> str:
    return re.sub(r"[^\n]", " ", text)


def strip_cxx(text: str) -> str:
    """Comments, string and character literals' contents and preprocessor lines (with
    their continuations) blanked; every newline kept, so line numbers still hold."""

    def blank(m: re.Match[str]) -> str:
        s = m.group(0)
        return s if s[0] not in "\"'R" else '"' + _blank(s[1:-1]) + '"'

    text = _CXX_SKIP.sub(lambda m: _blank(m.group(0)) if m.group(0)[0] == "/" else blank(m), text)
    out, continued = [], False
    for line in text.split("\n"):
        directive = continued or line.lstrip().startswith("#")
        continued = directive and line.rstrip().endswith("\\")
        out.append("" if directive else line)
    return "\n".join(out)


def _drop_template(header: str) -> str:
    """The header without leading `template <...>` parameter lists."""
    h = header.lstrip()
    while h.startswith("template") and "<" in h:
        depth = 0
        for j in range(h.index("<"), len(h)):
            depth += {"<": 1, ">": -1}.get(h[j], 0)
            if depth == 0:
                h = h[j + 1 :].lstrip()
                break
        else:
            return h
    return h


def _top_level_assign(header: str) -> int:
    """Index of an `=` outside brackets that is not a comparison or `operator=`, or -1."""
    depth = 0
    for i, ch in enumerate(header):
        if ch in "([":
            depth += 1
        elif ch in ")]":
            depth -= 1
        elif ch == "=" and depth == 0:
            before, after = header[i - 1 : i], header[i + 1 : i + 2]
            if (before and before in "=!<>+-*/%&|^") or after == "=":
                continue
            if header[:i].rstrip().endswith("operator"):
                continue
            return i
    return -1


def _opens_function(header: str) -> bool:
    h = _drop_template(header)
    if _CXX_SCOPE.match(h):
        return False
    eq = _top_level_assign(h)
    if eq >= 0:
        return h[eq + 1 :].lstrip().startswith("[")
    return "(" in h and h.count("(") == h.count(")")


def _function_name(header: str) -> str:
    eq = _top_level_assign(_drop_template(header))
    if eq >= 0:  # a lambda: the name it is bound to
        return _drop_template(header)[:eq].split()[-1]
    found = _CXX_NAME.search(header)
    return " ".join((found.group(1) if found else header).split())


def cxx_functions(text: str) -> list[tuple[str, int, int]]:
    """(name, first line, last line) of every function defined outside another function."""
    src = strip_cxx(text)
    # per open brace outside bodies: "scope" (namespace, class, initializer) or "expr"
    # (a braced value inside a header's parentheses, `f(S{2}) {`: the header goes on)
    stack: list[str] = []
    body: tuple[int, str] | None = None  # the open function body's (start, header)
    body_depth = 0  # braces open inside it, its own included
    start = 0
    out = []
    for i, ch in enumerate(src):
        if body is not None:
            body_depth += {"{": 1, "}": -1}.get(ch, 0)
            if body_depth == 0:
                begin, header = body
                body = None
                if src[i + 1 :].lstrip()[:1] not in (",", "{"):  # else a member initializer
                    first = src.count("\n", 0, begin) + 1
                    out.append((_function_name(header), first, src.count("\n", 0, i) + 1))
                    start = i + 1
            continue
        if ch == ";":
            start = i + 1
        elif ch == "{":
            header = _CXX_ACCESS.sub("", src[start:i])
            if header.count("(") > header.count(")"):
                stack.append("expr")
            elif _opens_function(header):
                body = (i - len(header.lstrip()), header)
                body_depth = 1
            else:
                stack.append("scope")
                start = i + 1
        elif ch == "}" and stack and stack.pop() == "scope":
            start = i + 1
    return out


def _cxx_files() -> Iterator[Path]:
    yield from (p for p in sorted((ROOT / "csrc").rglob("*")) if p.suffix in CXX_SUFFIXES)


def long_cxx_functions(path: Path, text: str) -> dict[str, int]:
    return {
        f"{path}:{first} {name}": last - first + 1
        for name, first, last in cxx_functions(text)
        if last - first + 1 > MAX_FUNCTION_LINES
    }


def test_no_cxx_function_over_60_lines() -> None:
    long: dict[str, int] = {}
    for path in _cxx_files():
        long.update(long_cxx_functions(path.relative_to(ROOT), path.read_text()))
    assert long == {}


def test_cxx_scanner_finds_functions_and_a_long_one() -> None:
    body = "".join(f"  x += {i};\n" for i in range(60))
    snippet = (
        '#include "a.hpp"\n'  # 1
        "#define BODY(x) { \\\n"  # 2
        "  return x; }\n"  # 3
        "namespace a::b {\n"  # 4
        "namespace {\n"  # 5
        'const char* s = "} {";  // } {\n'  # 6
        "auto twice = [](int v) {\n"  # 7
        "  return 2 * v;\n"  # 8
        "};\n"  # 9
        "}  // namespace\n"  # 10
        "struct alignas(64) S {\n"  # 11
        "  int v{1};\n"  # 12
        "  S(int a) : v{a}, w_(a) {}\n"  # 13
        " public:\n"  # 14
        "  bool operator<(const S& o) const { return v < o.v; }\n"  # 15
        "};\n"  # 16
        "template <class T>\n"  # 17
        "int Long::run(T x, const S& s = S{2}) {\n"  # 18
        "  auto f = [&](int y) { return y + '}'; };\n"  # 19
        "  /* { */\n"  # 20
        f"{body}"  # 21..80
        "  return f(x);\n"  # 81
        "}\n"  # 82
        "}  // namespace a::b\n"
    )
    assert cxx_functions(snippet) == [
        ("twice", 7, 9),
        ("S", 13, 13),
        ("operator<", 15, 15),
        ("Long::run", 17, 82),
    ]
    assert long_cxx_functions(Path("x.cpp"), snippet) == {"x.cpp:17 Long::run": 66}
