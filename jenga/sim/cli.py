"""``jenga-sim``: compare KV allocators on a simulated serving run.

With no flags it runs the default scenario (``mamba-chat``: a Mamba-2 hybrid, Nemotron
Nano 9B v2, serving closed-loop multi-turn chats on an H100) under today's vLLM
(``vllm_v1``) and Jenga, prints the comparison table and one line saying how Jenga
compares on the scenario's headline metric. ``--scenario arxiv-ministral`` is the Jenga
paper's Fig. 15 setup; the other flags override parts of a scenario. ``--seeds 0-9``
reports every metric as mean and range over trace seeds; ``--sweep KEY=LIST`` sweeps a
knob and reports hit rate and throughput at each value (``--scenario articles-ministral
--sweep articles=1,2,3,4,5,6,8``: the paper's Fig. 17a and 17b). ``--sweep`` alone runs
a grid of shipped scenarios x KV sizes x seeds (`jenga.sim.grid`) and prints every Jenga
row's ratio to ``vllm_v1`` per cell. ``--scenario car-chat`` and ``car-longdoc`` are CaR's
setups (`jenga.sim.tier_scenarios`): TTFT per KV cache configuration, GPU only or with a
host tier (``--host-gib``, ``--link``, ``--high-water``, ``--window``).

Mistakes on the command line (a NaN or negative size, a zero block size, an unknown
name, an output in a folder that does not exist, ``--plot-dir`` without matplotlib) print
one line on stderr and exit 2 before anything runs; a requested allocator that produced no
result makes the exit status 1 after the report.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import NoReturn

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn

from jenga.errors import AllocatorError
from jenga.sim import grid, report, seeds, sweep, tier_scenarios
from jenga.sim.engine import ADMISSIONS, PREFILLS, EngineConfig
from jenga.sim.hardware import GPUS, HardwareError
from jenga.sim.metrics import summarize
from jenga.sim.models import UnknownModel, model_names
from jenga.sim.protocol import SimError
from jenga.sim.scenarios import (
    ALLOCATORS,
    DEFAULT_SCENARIO,
    SCENARIOS,
    Scenario,
    check_allocators,
    get_scenario,
    run_scenario,
    with_overrides,
)
from jenga.sim.workloads import GENERATORS, WorkloadError
from jenga.specs import SpecError

EXIT_USAGE = 2  # a mistake on the command line
EXIT_NO_RESULT = 1  # the run finished, but a requested allocator produced no row
GRID = "grid"  # `--sweep` with no KEY=LIST


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage mistake in one line on stderr (exit 2)."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def _number(
    cast: Callable[[str], float], low: float, low_ok: bool, what: str
) -> Callable[[str], float]:
    """An argparse type: a finite ``cast`` value above ``low`` (or equal when ``low_ok``)."""

    def parse(text: str) -> float:
        try:
            value = cast(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expects {what}, got {text!r}") from None
        if not math.isfinite(value) or value < low or (value == low and not low_ok):
            raise argparse.ArgumentTypeError(f"expects {what}, got {text!r}")
        return value

    return parse


_POSITIVE = _number(float, 0.0, False, "a finite number > 0")
_NON_NEGATIVE = _number(float, 0.0, True, "a finite number >= 0")
_SHARE = _number(float, 0.0, True, "a share in [0, 1)")
_COUNT = _number(int, 0, False, "an integer > 0")
_SEED = _number(int, 0, True, "an integer >= 0")


def _parse_value(text: str) -> object:
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def _parse_params(items: list[str]) -> dict[str, object]:
    params = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise WorkloadError(f"--param expects key=value, got {item!r}")
        params[key.replace("-", "_")] = _parse_value(value)
    return params


def _sharing_scenarios() -> list[str]:
    """The parallel-sampling and beam-search scenarios (`jenga.sim.sharing`)."""
    from jenga.sim.sharing import SCENARIOS as SHARING

    return sorted(SHARING)


def _names() -> list[str]:
    return sorted([*SCENARIOS, *_sharing_scenarios()])


def _add_sweep_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--sweep",
        metavar="KEY=LIST",
        nargs="?",
        const=GRID,
        help="e.g. articles=1,2,4,8 or kv_gib=4,8; alone: the scenarios x KV sizes x seeds grid",
    )
    p.add_argument(
        "--sweep-kv-gib",
        metavar="LIST",
        help="same as --sweep kv_gib=LIST; with --sweep alone: the grid's KV sizes in GiB",
    )
    p.add_argument(
        "--sweep-scenarios",
        metavar="LIST",
        help=f"grid: scenarios, or 'all' (default {','.join(grid.QUICK_SCENARIOS)})",
    )
    p.add_argument(
        "--sweep-kv-scales",
        metavar="LIST",
        help="grid: KV sizes as shares of each scenario's own "
        f"(default {','.join(f'{x:g}' for x in grid.QUICK_KV_SCALES)})",
    )


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="jenga-sim", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--scenario", help=f"one of {_names()} (default {DEFAULT_SCENARIO})")
    p.add_argument("--model", help="model preset (see --list)")
    p.add_argument("--gpu", help=f"one of {sorted(GPUS)}")
    p.add_argument("--reserved", type=_SHARE, help="share of GPU memory left unused (0.1)")
    p.add_argument("--reserved-gib", type=_NON_NEGATIVE, help="fixed GiB kept back (activations)")
    p.add_argument("--kv-gib", type=_POSITIVE, help="KV cache size in GiB (overrides the GPU's)")
    p.add_argument("--workload", help=f"one of {sorted(GENERATORS)}")
    p.add_argument(
        "--param",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="workload parameter (repeatable), e.g. num_requests=50 (arxiv-qa)",
    )
    p.add_argument("--seed", type=_SEED, help="trace seed (default: the scenario's, 0)")
    p.add_argument("--seeds", metavar="LIST", help="run each seed, e.g. 0-9: mean and range")
    p.add_argument(
        "--rate",
        type=_POSITIVE,
        help="Poisson arrivals per second (default: the scenario's pacing)",
    )
    p.add_argument("--allocators", help="comma-separated, e.g. uniform,jenga_vmm")
    p.add_argument(
        "--max-num-batched-tokens", type=_COUNT, help="engine: tokens per step (the scenario's)"
    )
    p.add_argument("--max-num-seqs", type=_COUNT, help="engine: requests per step (the scenario's)")
    p.add_argument("--admission", choices=ADMISSIONS, help="allocate the first chunk or the prompt")
    p.add_argument("--prefill", choices=PREFILLS, help="chunked (vLLM V1) or separate (0.6)")
    p.add_argument("--no-prefix-cache", action="store_true", help="turn prefix caching off")
    p.add_argument("--block-size", type=_COUNT, help="tokens per block of attention groups")
    _add_sweep_flags(p)
    p.add_argument("--markdown", metavar="PATH", help="grid: write the ratio table as Markdown")
    p.add_argument("--json", metavar="PATH", help="write results as JSON ('-' for stdout)")
    p.add_argument("--timelines", action="store_true", help="include per-step timelines in --json")
    p.add_argument(
        "--plot-dir", help="write PNG plots there (created if missing; needs the plot extra)"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument(
        "--list",
        action="store_true",
        help="list scenarios (car-*: TTFT; sampling/beam: sharing), models, workloads, allocators",
    )
    tier_scenarios.add_arguments(p)
    return p


def _engine_from_args(base: EngineConfig, args: argparse.Namespace) -> EngineConfig:
    changes = {
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_num_seqs": args.max_num_seqs,
        "admission": args.admission,
        "prefill": args.prefill,
    }
    return replace(base, **{k: v for k, v in changes.items() if v is not None})


def scenario_from_args(args: argparse.Namespace) -> Scenario:
    base = get_scenario(args.scenario or DEFAULT_SCENARIO)
    params = dict(base.workload_params) if args.workload in (None, base.workload) else {}
    params.update(_parse_params(args.param))
    allocators = tuple(a.strip() for a in args.allocators.split(",")) if args.allocators else None
    return with_overrides(
        base,
        model=args.model,
        gpu=args.gpu,
        reserved_share=args.reserved,
        reserved_gib=args.reserved_gib,
        kv_gib=args.kv_gib,
        workload=args.workload,
        seed=args.seed,
        rate=args.rate,
        allocators=allocators,
        workload_params=params,
        engine=_engine_from_args(base.engine, args),
        prefix_cache=False if args.no_prefix_cache else None,
        block_size=args.block_size,
    )


def _print_lists(console: Console) -> None:
    console.print("scenarios:", ", ".join(sorted(SCENARIOS)))
    console.print("tier scenarios (TTFT):", ", ".join(sorted(tier_scenarios.TIER_SCENARIOS)))
    console.print("models:", ", ".join(model_names()))
    console.print("gpus:", ", ".join(sorted(GPUS)))
    console.print("workloads:", ", ".join(sorted(GENERATORS)))
    console.print("allocators:", ", ".join(sorted(ALLOCATORS)))
    console.print("sharing scenarios (samples, beams):", ", ".join(_sharing_scenarios()))


def _seed_list(args: argparse.Namespace, scenario: Scenario) -> list[int]:
    return seeds.parse_seeds(args.seeds) if args.seeds else [scenario.seed]


def _run_sweep(args: argparse.Namespace, console: Console, scenario: Scenario) -> int:
    key, values = sweep.parse_sweep(args.sweep or f"kv_gib={args.sweep_kv_gib}")
    metric, baseline = "hit_rate", scenario.headline[1]  # sweeps ask about the prefix cache
    result = sweep.run_sweep(scenario, key, values, _seed_list(args, scenario))
    if args.json != "-":
        for shown in sweep.SWEEP_METRICS:
            console.print(sweep.sweep_table(scenario, key, result, shown))
    if args.json:
        doc = {"scenario": scenario.name, "sweep": sweep.sweep_json(key, result, metric, baseline)}
        report.write_json(doc, args.json)
    if args.plot_dir:
        for shown in sweep.SWEEP_METRICS:
            console.print(f"wrote {sweep.plot_sweep(scenario, key, result, args.plot_dir, shown)}")
    ran = {n for per_seed, _ in result.values() for runs in per_seed.values() for n in runs}
    return _no_result_status(console, [n for n in scenario.allocators if n not in ran])


def _no_result_status(console: Console, names: list[str]) -> int:
    """Exit status: `EXIT_NO_RESULT` (and a line on stderr) when requested rows are absent."""
    if not names:
        return 0
    print(f"jenga-sim: no result for {', '.join(names)}", file=sys.stderr)
    return EXIT_NO_RESULT


# flags of one scenario's run that the grid (which runs shipped scenarios as they are)
# would ignore, and the grid's own flags that a single run would ignore
SCENARIO_ONLY = ("scenario", "model", "gpu", "reserved", "reserved_gib", "kv_gib", "workload",
                 "param", "rate", "max_num_batched_tokens", "max_num_seqs", "admission",
                 "prefill", "no_prefix_cache", "block_size", "timelines", "plot_dir")  # fmt: skip
GRID_ONLY = ("sweep_scenarios", "sweep_kv_scales", "markdown")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _check_mode(args: argparse.Namespace) -> None:
    """Raise `SimError` for a flag the chosen mode would silently ignore."""
    grid_mode = args.sweep == GRID
    ignored = [n for n in (SCENARIO_ONLY if grid_mode else GRID_ONLY) if getattr(args, n)]
    if ignored:
        flags = ", ".join(_flag(n) for n in ignored)
        where = "the --sweep grid (it runs shipped scenarios as they are)" if grid_mode else (
            "a run without the --sweep grid")  # fmt: skip
        raise SimError(f"{flags} {'does' if len(ignored) == 1 else 'do'} not apply to {where}")


def _run_grid(args: argparse.Namespace, console: Console) -> int:
    """``--sweep`` alone: scenarios x KV sizes x seeds, every Jenga row / vllm_v1."""
    names = grid.parse_scenarios(args.sweep_scenarios)
    seed_list = seeds.parse_seeds(args.seeds) if args.seeds else [args.seed or 0]
    scales = grid.parse_sizes(args.sweep_kv_scales, "--sweep-kv-scales", grid.QUICK_KV_SCALES)
    gibs = grid.parse_sizes(args.sweep_kv_gib, "--sweep-kv-gib")
    wanted = tuple(a.strip() for a in args.allocators.split(",")) if args.allocators else None
    if wanted is not None:
        check_allocators(wanted)
    quiet = args.no_progress or args.json == "-"

    def on_cell(cell: grid.Cell) -> None:
        if not quiet:
            console.print(f"  done: {cell.scenario} {cell.kv_label} seed {cell.seed}")

    cells = grid.run_grid(names, seed_list, scales, gibs, wanted, on_cell)
    if args.json != "-":
        console.print(grid.grid_table(cells))
        behind = grid.losing(cells)
        console.print(
            f"{len(behind)} (cell, row, metric) below vllm_v1 (batch or hit < 0.98x, more "
            f"preemptions or commit) of {len(grid.rows(cells)) * len(grid.GRID_METRICS)}"
        )
    if args.json:
        report.write_json(grid.grid_json(cells), args.json)
    if args.markdown:
        with open(args.markdown, "w") as out:
            out.write(grid.grid_markdown(cells))
    ran = {n for cell in cells for n in cell.summaries}
    asked = {n for cell in cells for n in (*cell.summaries, *cell.not_run)}
    return _no_result_status(console, sorted(asked - ran))


def _run_seeds(args: argparse.Namespace, console: Console, scenario: Scenario) -> int:
    per_seed, not_run = seeds.run_seeds(scenario, _seed_list(args, scenario))
    if args.json != "-":
        console.print(report.seeds_table(scenario, per_seed))
        for name, reason in not_run.items():
            console.print(f"[yellow]{name} has no result: {reason}")
    if args.json:
        metric, baseline = scenario.headline
        doc = {
            "scenario": scenario.name,
            "seeds": sorted(per_seed),
            "spreads": {
                n: {m: s.as_dict() for m, s in ms.items()}
                for n, ms in seeds.spreads(per_seed).items()
            },
            "ratios": {n: s.as_dict() for n, s in seeds.ratios(per_seed, metric, baseline).items()},
            "headline": [metric, baseline],
            "per_seed": {k: {n: s.as_dict() for n, s in v.items()} for k, v in per_seed.items()},
            "not_run": not_run,
        }
        report.write_json(doc, args.json)
    return _no_result_status(console, sorted(not_run.keys() - set(seeds.allocators_of(per_seed))))


def _check_file(flag: str, path: str | None) -> None:
    """Raise `SimError` unless ``path`` (a file to write; '-' is stdout) can be written."""
    if path is None or (flag == "--json" and path == "-"):
        return
    target = Path(path)
    folder = target.parent
    if target.is_dir():
        raise SimError(f"{flag} {path}: is a folder, expected a file path")
    if not folder.is_dir():
        raise SimError(f"{flag} {path}: folder {folder} does not exist")


def _check_outputs(args: argparse.Namespace) -> None:
    """Raise `SimError` for an output that would fail only after the run."""
    _check_file("--json", args.json)
    _check_file("--markdown", args.markdown)
    if args.timelines and not args.json:
        raise SimError("--timelines adds to --json: give --json PATH too")
    if args.plot_dir is None:
        return
    if Path(args.plot_dir).exists() and not Path(args.plot_dir).is_dir():
        raise SimError(f"--plot-dir {args.plot_dir}: exists and is not a folder")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise SimError(
            "--plot-dir needs matplotlib, which is not installed: install jenga-vmm with the "
            "'plot' extra (from a clone: pip install '.[plot]')"
        ) from None


def run(args: argparse.Namespace, console: Console) -> int:
    if args.scenario in tier_scenarios.TIER_SCENARIOS:
        return tier_scenarios.main(args, console, _parse_params(args.param))
    tier_flags = [_flag(n) for n in tier_scenarios.TIER_FLAGS if getattr(args, n) is not None]
    if tier_flags:
        raise SimError(f"{', '.join(tier_flags)}: only the tier scenarios read them")
    _check_mode(args)
    _check_outputs(args)
    if args.sweep == GRID:
        return _run_grid(args, console)
    scenario = scenario_from_args(args)
    if args.sweep or args.sweep_kv_gib:
        return _run_sweep(args, console, scenario)
    if args.seeds:
        return _run_seeds(args, console, scenario)
    quiet = args.no_progress or args.json == "-"
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        console=console,
        disable=quiet,
        transient=True,
    ) as progress:
        tasks: dict[str, TaskID] = {}

        def on_step(name: str, done: int, total: int) -> None:
            if name not in tasks:
                tasks[name] = progress.add_task(name, total=total)
            progress.update(tasks[name], completed=done)

        results, missing = run_scenario(scenario, on_step=on_step)
    summaries = [summarize(r) for r in results]
    if args.json != "-":
        report.print_report(console, scenario, summaries, missing)
    if args.json:
        report.write_json(
            report.to_json(scenario, summaries, results, missing, args.timelines), args.json
        )
    if args.plot_dir:
        for path in report.plot(results, summaries, args.plot_dir):
            console.print(f"wrote {path}")
    return _no_result_status(console, list(missing))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    console = Console(stderr=args.json == "-")
    if not console.is_terminal:
        console.width = 240  # logs and pipes: keep every cell of a wide sweep on one line
    if args.list:
        _print_lists(console)
        return 0
    try:
        if args.scenario in _sharing_scenarios():
            from jenga.sim import sharing_cli

            return sharing_cli.run(args, console)
        return run(args, console)
    except (SimError, WorkloadError, HardwareError, UnknownModel, SpecError, AllocatorError) as exc:
        one_line = " ".join(str(exc).split())
        print(f"jenga-sim: {type(exc).__name__}: {one_line}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
