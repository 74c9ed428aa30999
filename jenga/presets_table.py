"""The presets' page tables as Markdown, for docs/jenga-pages.md.

Run ``python -m jenga.presets_table`` to print both tables (VMM mode and static modes);
``--chunk-bytes`` and ``--epsilon`` change the VMM parameters; ``--update DOC`` rewrites
the tables embedded in DOC between the markers. The docs embed the default output, and
a test keeps them in step. A bad flag, a DOC that cannot be read or holds no markers
prints one line on stderr and exits 2 (DOC is left as it was).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from jenga import presets
from jenga.pages import (
    DEFAULT_CHUNK_BYTES,
    format_bytes,
    static_page_table,
    vmm_page_table,
)


def vmm_markdown(
    names: Sequence[str] | None = None,
    *,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    epsilon: float = 0.01,
) -> str:
    """One row per group: small page, chosen k (and the exact LCM's k), blocks, tail."""
    lines = [
        "| model | group | layers (+readers) | small page | k (lcm k) | blocks / large page "
        "| chunks / large page | tail |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in names or presets.names():
        model = presets.get(name)
        table = vmm_page_table(model, chunk_bytes=chunk_bytes, epsilon=epsilon)
        for group, row in zip(model.groups, table.groups, strict=True):
            layers = f"{group.num_layers}" + (f" (+{len(group.readers)})" if group.readers else "")
            tail = f"{format_bytes(row.tail_bytes)} ({row.tail_fraction:.2%})"
            lines.append(
                f"| {name} | {row.group} | {layers} | {format_bytes(row.small_page_bytes)} "
                f"| {row.chunks_per_range} ({row.lcm_chunks_per_range}) "
                f"| {row.blocks_per_large_page} | {row.units_per_large_page} | {tail} |"
            )
    return "\n".join(lines)


def static_markdown(names: Sequence[str] | None = None) -> str:
    """One row per model: page-layer small pages and the LCM, MAX and GCD choices."""
    lines = [
        "| model | small pages (page-layer) | LCM large page: pages per group "
        "| MAX page: padding per group | GCD unit: units per group |",
        "|---|---|---|---|---|",
    ]
    for name in names or presets.names():
        model = presets.get(name)
        lcm, mx, gcd = (static_page_table(model, strategy=s) for s in ("lcm", "max", "gcd"))
        smalls = ", ".join(f"{g.group} {format_bytes(g.small_page_bytes)}" for g in lcm.groups)
        per_lcm = ", ".join(str(g.blocks_per_large_page) for g in lcm.groups)
        per_max = ", ".join(f"{g.tail_fraction:.1%}" for g in mx.groups)
        per_gcd = ", ".join(str(g.units_per_large_page) for g in gcd.groups)
        lines.append(
            f"| {name} | {smalls} | {format_bytes(lcm.unit_bytes)}: {per_lcm} "
            f"| {format_bytes(mx.unit_bytes)}: {per_max} "
            f"| {format_bytes(gcd.unit_bytes)}: {per_gcd} |"
        )
    return "\n".join(lines)


BEGIN_MARKER = "<!-- BEGIN presets_table -->\n"
END_MARKER = "<!-- END presets_table -->"


def tables_markdown(*, chunk_bytes: int = DEFAULT_CHUNK_BYTES, epsilon: float = 0.01) -> str:
    """Both tables, as embedded in the docs (ending with a newline)."""
    vmm = vmm_markdown(chunk_bytes=chunk_bytes, epsilon=epsilon)
    return f"{vmm}\n\n{static_markdown()}\n"


def replace_embedded_tables(doc: str, tables: str) -> str:
    """`doc` with the text between the BEGIN/END markers replaced by `tables`."""
    start, end = doc.find(BEGIN_MARKER), doc.find(END_MARKER)
    if start < 0 or end < start:
        raise ValueError(f"markers {BEGIN_MARKER.strip()} ... {END_MARKER} not found in order")
    return doc[: start + len(BEGIN_MARKER)] + tables + doc[end:]


PROG = "python -m jenga.presets_table"


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage mistake in one line on stderr (exit 2)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def _chunk_bytes(text: str) -> int:
    """An argparse type: an integer number of bytes > 0."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expects an integer number of bytes > 0, got {text!r}")
    return value


def _fail(reason: str) -> int:
    print(f"{PROG}: error: {' '.join(reason.split())}", file=sys.stderr)
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    parser = _Parser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("--chunk-bytes", type=_chunk_bytes, default=DEFAULT_CHUNK_BYTES,
                        help=f"VMM chunk size in bytes ({DEFAULT_CHUNK_BYTES})")  # fmt: skip
    parser.add_argument("--epsilon", type=float, default=0.01,
                        help="largest tail share of a large page, in [0, 1) (0.01)")  # fmt: skip
    parser.add_argument("--update", metavar="DOC", help="rewrite the tables embedded in DOC")
    args = parser.parse_args(argv)
    try:
        tables = tables_markdown(chunk_bytes=args.chunk_bytes, epsilon=args.epsilon)
    except ValueError as exc:  # SpecError: a page geometry the parameters cannot make
        return _fail(str(exc))
    if not args.update:
        print(tables, end="")
        return 0
    path = Path(args.update)
    try:
        path.write_text(replace_embedded_tables(path.read_text(), tables))
    except (ValueError, OSError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        return _fail(f"--update {args.update}: {reason}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
