"""docs/jenga-pages.md embeds the generated preset tables; they must match the code."""

from pathlib import Path

from jenga import presets_table

DOC = Path(__file__).resolve().parents[2] / "docs" / "jenga-pages.md"
BEGIN, END = "<!-- BEGIN presets_table -->\n", "<!-- END presets_table -->"


def test_docs_tables_are_current():
    text = DOC.read_text()
    embedded = text[text.index(BEGIN) + len(BEGIN) : text.index(END)]
    expected = presets_table.vmm_markdown() + "\n\n" + presets_table.static_markdown() + "\n"
    assert embedded == expected, "regenerate with: python -m jenga.presets_table"


def test_cli_prints_both_tables(capsys):
    assert presets_table.main(["--epsilon", "0"]) == 0
    out = capsys.readouterr().out
    # exact LCM: Jamba's Mamba row takes 35 chunks per range, 128 states, no tail
    assert "| jamba-1.5-mini | mamba | 28 | 560 KiB | 35 (35) | 128 | 980 | 0 B (0.00%) |" in out
    assert "| LCM large page: pages per group |" in out
