"""Ratio tables and heat maps of a sweep's JSON (no vLLM needed)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from integrations.vllm.harness.sweep_report import cell_ratios, heat_maps, loses, markdown, ratio


def _row(running: float, hits: int, preempt: int, committed: int) -> dict[str, Any]:
    return {
        "avg_running": running,
        "hit_tokens": hits,
        "preemptions": preempt,
        "committed_bytes": committed,
    }


def _payload() -> dict[str, Any]:
    cells = [
        {
            "case": "jamba",
            "memory_mb": memory,
            "requests": 16,
            "seed": 0,
            "rows": {"vllm": _row(8.0, 7168, 0, 100), "jenga-vmm": ours},
        }
        for memory, ours in ((256, _row(7.72, 3072, 0, 99)), (512, _row(8.0, 7168, 1, 100)))
    ]
    return {"command": "x", "managers": ["vllm", "jenga-vmm"], "cells": cells}


def test_ratios_treat_zero_over_zero_as_equal() -> None:
    assert ratio(0, 0) == 1.0 and math.isinf(ratio(1, 0)) and ratio(3, 4) == 0.75


def test_a_cell_loses_on_running_hits_or_bytes_and_the_table_marks_it() -> None:
    payload = _payload()
    bad, good = (cell_ratios(c, "jenga-vmm") for c in payload["cells"])
    assert loses(bad) == ["avg_running", "hit_tokens"] and loses(good) == []
    assert loses({**good, "committed_bytes": 1.01}) == ["committed_bytes"]
    text = markdown(payload)
    assert "| jamba | jenga-vmm | 2 | 1 | 0.965 | 0.429 | 1.000 |" in text
    assert "- jamba, jenga-vmm: 256, 16, 0: run, hit" in text
    assert "| 16 | 0 | **0.965 / 0.429 / 1.000 / 0.990** | 1.000 / 1.000 / inf / 1.000 |" in text


def test_heat_maps_write_one_png_per_case_and_manager(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    written = heat_maps(_payload(), tmp_path)
    assert written == [tmp_path / "jamba-jenga-vmm.png"]
    assert written[0].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_manager_that_raised_loses_its_cell_and_is_listed() -> None:
    payload = _payload()
    payload["cells"][1]["rows"]["jenga-vmm"] = {"error": "JengaVllmError: 64 chunks, 63 held"}
    ratios = cell_ratios(payload["cells"][1], "jenga-vmm")
    assert loses(ratios) == ["avg_running", "hit_tokens"]
    text = markdown(payload)
    assert "- jamba, jenga-vmm: 512, 16, 0: JengaVllmError: 64 chunks, 63 held" in text
    assert "| jamba | jenga-vmm | 2 | 2 |" in text


def test_sweeps_run_apart_merge_into_one_table(tmp_path: Path) -> None:
    import json

    from integrations.vllm.harness.sweep_report import main, merge

    one, two = _payload(), _payload()
    for cell in two["cells"]:
        cell["case"] = "gemma2"
    two["command"] = "y"
    merged = merge([one, two])
    assert [c["case"] for c in merged["cells"]] == ["jamba", "jamba", "gemma2", "gemma2"]
    assert merged["command"] == "x ; y"
    paths = [tmp_path / "a.json", tmp_path / "b.json"]
    for path, payload in zip(paths, (one, two), strict=True):
        path.write_text(json.dumps(payload))
    out, table = tmp_path / "m.json", tmp_path / "m.md"
    assert main([*map(str, paths), "--merged", str(out), "--table", str(table)]) == 0
    assert json.loads(out.read_text()) == merged
    assert "| gemma2 | jenga-vmm | 2 | 1 |" in table.read_text()
    with pytest.raises(ValueError, match="different managers"):
        merge([one, two | {"managers": ["vllm", "jenga"]}])
