"""docs/jenga-pages.md embeds the generated preset tables; they must match the code."""

from pathlib import Path

import pytest

from jenga import presets_table

DOC = Path(__file__).resolve().parents[2] / "docs" / "jenga-pages.md"


def test_docs_tables_are_current():
    text = DOC.read_text()
    assert presets_table.replace_embedded_tables(text, presets_table.tables_markdown()) == text, (
        "regenerate with: python -m jenga.presets_table --update docs/jenga-pages.md"
    )


def test_cli_prints_both_tables(capsys):
    assert presets_table.main(["--epsilon", "0"]) == 0
    out = capsys.readouterr().out
    # exact LCM: Jamba's Mamba row takes 35 chunks per range, 128 states, no tail
    assert "| jamba-1.5-mini | mamba | 28 | 560 KiB | 35 (35) | 128 | 980 | 0 B (0.00%) |" in out
    assert "| LCM large page: pages per group |" in out


def test_update_rewrites_only_between_markers(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("intro\n<!-- BEGIN presets_table -->\nstale\n<!-- END presets_table -->\nend\n")
    assert presets_table.main(["--update", str(doc)]) == 0
    text = doc.read_text()
    assert text.startswith("intro\n<!-- BEGIN presets_table -->\n| model | group |")
    assert text.endswith("|\n<!-- END presets_table -->\nend\n")
    assert "stale" not in text
    with pytest.raises(ValueError, match="not found in order"):
        presets_table.replace_embedded_tables("no markers", "x")
