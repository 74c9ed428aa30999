"""The configuration values: the rules reach the core whole, and the public facade."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
from jenga.allocator import JengaAllocator
from jenga.config import AllocationOrder, AllocationRules, AllocatorConfig, GroupConfig
from jenga.pages import vmm_page_table
from jenga.specs import Kind

import jenga
from jenga import _core as J
from jenga import presets

GROUPS = (
    GroupConfig("full", Kind.FULL, 4, 2, 1),
    GroupConfig("swa", Kind.SLIDING_WINDOW, 4, 2, 1, window=8),
)


def test_python_rules_and_core_rules_have_the_same_fields():
    python = {f.name for f in dataclasses.fields(AllocationRules)}
    core = {name for name in dir(J.Rules) if not name.startswith("_")}
    # from the policies
    assert core - python == {"early_release_groups", "window_blocks", "retention_reach"}
    assert python <= core


def test_every_rule_reaches_the_core():
    rules = AllocationRules(
        order=AllocationOrder.PINNED, frugal_retry=False, demote_window_releases=True
    )
    core_rules = JengaAllocator(AllocatorConfig(GROUPS, 4, rules))._core.rules
    assert core_rules.order == J.AllocationOrder.PINNED
    assert (core_rules.frugal_retry, core_rules.demote_window_releases) == (False, True)
    assert core_rules.early_release_groups == [False, True]
    default = JengaAllocator(AllocatorConfig(GROUPS, 4))._core.rules
    assert default.order == J.AllocationOrder.PAPER
    assert (default.frugal_retry, default.demote_window_releases) == (True, False)
    assert (default.retention_interval, default.retention_reach) == (0, [-1, 7])
    retained = AllocationRules(retention_interval=16)
    core_rules = JengaAllocator(AllocatorConfig(GROUPS, 4, retained))._core.rules
    assert (core_rules.retention_interval, core_rules.retention_reach) == (16, [-1, 7])


def test_core_rules_are_one_value():
    with pytest.raises(TypeError, match="unknown rules \\['compact'\\]"):
        J.Rules(compact=True)
    core = J.Core([1], [1], 2)
    with pytest.raises(AttributeError):
        core.rules.frugal_retry = False  # a copy: its fields are read-only
    core.rules = J.Rules(frugal_retry=False)
    assert core.rules.frugal_retry is False


def test_from_page_table_takes_rules_or_an_order_alone():
    model = presets.get("gemma-2-9b")
    table = vmm_page_table(model)
    by_order = AllocatorConfig.from_page_table(model, table, 100, AllocationOrder.COMPACT)
    assert by_order.rules == AllocationRules(order=AllocationOrder.COMPACT)
    rules = AllocationRules(frugal_retry=False)
    assert AllocatorConfig.from_page_table(model, table, 100, rules).rules is rules


def test_the_facade_exports_its_names():
    assert sorted(jenga.__all__) == sorted(set(jenga.__all__))
    assert all(hasattr(jenga, name) for name in jenga.__all__)
    assert jenga.JengaAllocator is JengaAllocator and jenga.AllocationRules is AllocationRules


def test_modules_inside_jenga_never_import_through_the_facade():
    root = Path(jenga.__file__).parent
    bad = []
    for path in root.rglob("*.py"):
        if path.name == "__init__.py" and path.parent == root:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "jenga" and node.level == 0:
                names = [a.name for a in node.names]
                bad += [f"{path.name}: {n}" for n in names if not _is_submodule(root, n)]
    assert bad == []


def _is_submodule(root: Path, name: str) -> bool:
    return (root / f"{name}.py").exists() or (root / name).is_dir() or name == "_core"
