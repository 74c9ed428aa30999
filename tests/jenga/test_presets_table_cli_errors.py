"""``python -m jenga.presets_table`` on bad flags and unusable documents: one line on
stderr, exit 2, no traceback, and the document left as it was."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.cli_errors import MIN_CASES, assert_one_line, run_cli

PROG = "python -m jenga.presets_table: error:"
MARKERS = "intro\n<!-- BEGIN presets_table -->\nstale\n<!-- END presets_table -->\nend\n"

# name: (argv, the document's text or None for no document, a piece of the one line);
# DOC in argv stands for the document's path
BAD: dict[str, tuple[list[str], str | None, str]] = {
    "chunk bytes zero": (["--chunk-bytes", "0"], None, "bytes > 0, got '0'"),
    "chunk bytes negative": (["--chunk-bytes", "-5"], None, "bytes > 0, got '-5'"),
    "chunk bytes not an integer": (["--chunk-bytes", "2M"], None, "got '2M'"),
    "chunk bytes fractional": (["--chunk-bytes", "1.5"], None, "got '1.5'"),
    "chunk bytes without a value": (["--chunk-bytes"], None, "expected one argument"),
    "epsilon nan": (["--epsilon", "nan"], None, "epsilon must be in [0, 1), got nan"),
    "epsilon inf": (["--epsilon", "inf"], None, "epsilon must be in [0, 1), got inf"),
    "epsilon negative": (["--epsilon", "-1"], None, "epsilon must be in [0, 1), got -1.0"),
    "epsilon one": (["--epsilon", "1"], None, "epsilon must be in [0, 1), got 1.0"),
    "epsilon not a number": (["--epsilon", "small"], None, "invalid float value: 'small'"),
    "update a missing file": (["--update", "DOC"], None, "No such file or directory"),
    "update in a missing folder": (
        ["--update", "/nonexistent-presets-folder/pages.md"],
        None,
        "--update /nonexistent-presets-folder/pages.md: No such file or directory",
    ),
    "update a folder": (["--update", "/tmp"], None, "--update /tmp: Is a directory"),
    "update a file without markers": (["--update", "DOC"], "just text\n", "not found in order"),
    "update markers out of order": (
        ["--update", "DOC"],
        "<!-- END presets_table -->\n<!-- BEGIN presets_table -->\n",
        "not found in order",
    ),
    "update only a begin marker": (
        ["--update", "DOC"],
        "<!-- BEGIN presets_table -->\n",
        "not found in order",
    ),
    "update without a path": (["--update"], None, "argument --update: expected one argument"),
    "update, epsilon bad": (["--update", "DOC", "--epsilon", "2"], MARKERS, "got 2.0"),
    "unknown flag": (["--bogus"], None, "unrecognized arguments: --bogus"),
    "stray positional": (["docs/jenga-pages.md"], None, "unrecognized arguments"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_arguments_end_in_one_line(name: str, tmp_path: Path) -> None:
    argv, text, expected = BAD[name]
    doc = tmp_path / "pages.md"
    if text is not None:
        doc.write_text(text)
    argv = [str(doc) if a == "DOC" else a for a in argv]
    assert_one_line(run_cli("jenga.presets_table", argv, tmp_path), PROG, expected)
    assert (doc.read_text() if doc.exists() else None) == text  # left as it was


def test_the_table_is_large_enough() -> None:
    assert len(BAD) >= MIN_CASES
