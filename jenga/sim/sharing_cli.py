"""``jenga-sim --scenario sampling-alpaca`` (and the other `jenga.sim.sharing` scenarios).

Prints, per width, the blocks held without sharing and the share of them that vLLM's
block manager and the Jenga allocator's forks save, beside PagedAttention's reported
saving (its Fig. 15 per width for Alpaca, the §6.3 range for ShareGPT). Flags: ``--seed``,
``--block-size``, ``--max-num-seqs``, ``--param num_requests=N``, ``--param
beam_skew=F``, ``--param widths=2/4/6``, ``--json PATH`` (``-``: stdout); any other
scenario flag is refused, naming it.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from rich.console import Console
from rich.table import Table

from jenga.sim import report
from jenga.sim.protocol import SimError
from jenga.sim.sharing import (
    PAPER_RANGE,
    PAPER_SAVING,
    SCENARIOS,
    SharingScenario,
    WidthResult,
    run_scenario,
)

_ALLOWED = {"scenario", "seed", "block_size", "max_num_seqs", "param", "json", "no_progress"}
_PARAMS = {"num_requests": int, "beam_skew": float}


def scenario_from_args(args: argparse.Namespace) -> SharingScenario:
    """The named scenario with the flags it takes applied; `SimError` for any other."""
    unused = sorted(
        k for k, v in vars(args).items() if k not in _ALLOWED and v not in (None, False, [])
    )
    if unused:
        flags = ", ".join("--" + k.replace("_", "-") for k in unused)
        raise SimError(f"--scenario {args.scenario} does not take {flags}")
    changes: dict[str, Any] = {}
    for item in args.param:
        key, _, value = item.partition("=")
        if key == "widths":
            try:
                changes["widths"] = tuple(int(w) for w in value.split("/"))
            except ValueError:
                raise SimError(f"widths must look like 2/4/6, got {value!r}") from None
        elif key in _PARAMS:
            try:
                changes[key] = _PARAMS[key](value)
            except ValueError:
                raise SimError(f"{key} must be a {_PARAMS[key].__name__}, got {value!r}") from None
        else:
            raise SimError(f"--param {key!r}: {args.scenario} takes {sorted([*_PARAMS, 'widths'])}")
    for key in ("seed", "block_size", "max_num_seqs"):
        if getattr(args, key) is not None:
            changes[key] = getattr(args, key)
    return dataclasses.replace(SCENARIOS[args.scenario], **changes)


def paper_text(scenario: SharingScenario, width: int) -> str:
    per_width = PAPER_SAVING.get((scenario.dataset, scenario.mode), {})
    if width in per_width:
        return f"{per_width[width]:.1f} %"
    low, high = PAPER_RANGE[(scenario.dataset, scenario.mode)]
    return f"{low}-{high} % (2-6)"


def table(scenario: SharingScenario, results: list[WidthResult]) -> Table:
    what = "samples" if scenario.mode == "sample" else "beam width"
    t = Table(
        title=f"{scenario.name}: memory saved by sharing KV blocks ({scenario.num_requests} "
        f"{scenario.dataset} requests, block {scenario.block_size}, seed {scenario.seed})"
    )
    for col in (what, "steps", "blocks, no sharing", "vLLM sharing", "jenga forks",
                "PagedAttention reported"):  # fmt: skip
        t.add_column(col, justify="right")
    for r in results:
        t.add_row(
            str(r.width), str(r.steps), f"{r.blocks['none']:,}", f"{r.saving('vllm'):.1f} %",
            f"{r.saving('jenga'):.1f} %", paper_text(scenario, r.width),
        )  # fmt: skip
    return t


def run(args: argparse.Namespace, console: Console) -> int:
    scenario = scenario_from_args(args)
    results = run_scenario(scenario)
    if args.json != "-":
        console.print(table(scenario, results))
    if args.json:
        doc = {
            "scenario": dataclasses.asdict(scenario),
            "widths": {
                r.width: {
                    "steps": r.steps,
                    "blocks": r.blocks,
                    "saving_pct": {h: r.saving(h) for h in ("vllm", "jenga")},
                    "paper": paper_text(scenario, r.width),
                }
                for r in results
            },
        }
        report.write_json(doc, args.json)
    return 0
