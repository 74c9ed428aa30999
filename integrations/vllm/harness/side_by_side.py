"""Side by side: vLLM 0.32's own KV-cache manager vs the jenga manager.

Both run under vLLM's real `Scheduler` on the same requests, the same `KVCacheConfig`
(vLLM's own grouping, padding and block count for the per-layer specs) and so the same
bytes. Reported per case and manager: steps to finish, the most and the average number of
running requests per step, preemptions, prefix-hit tokens of first admissions (vLLM's
``PrefixCacheStats.hits``) and of preempted requests coming back (``preempted_hits``,
column "resumed"), and the mean wall time per step of vLLM's ``schedule`` +
``update_from_output`` (column "sched ms": the manager's cost rides in both; the
harness's own checks run outside it) and their thread CPU time per step ("cpu ms", the
median over ``--reps`` timed rounds that alternate the managers' order; "cpu p90";
"cpu/vllm": the median over rounds of the ratio to vLLM's manager in the same round).
With ``--reps`` > 1 a checked round comes first (no live block shared after every step,
chunk pinning, ``--trace``) and the timed rounds run the scheduler alone (see `compare`).

Managers: ``vllm`` (vLLM's own), ``jenga`` (ours on vLLM's KV tensors: block ids are
vLLM's shared slots, ``pages="vllm"``), ``jenga-vmm`` (ours on VMM pages, ``pages="vmm"``,
in the default geometry "auto": vLLM's block slots over one range mapped chunk by chunk
where every group's block fills vLLM's slot, else per_group), ``jenga-vmm-group`` (VMM
ranges, one per KV-cache group: a large page of 2 MiB chunks holds whole blocks of all
the group's layers, ``geometry="per_group"``) and ``jenga-vmm-layer`` (one range per
layer: a large page is 2 MiB chunks in each layer range, ``geometry="per_layer"``).
Column "committed": the peak bytes mapped for ours on VMM pages (the slots geometry:
the chunks its mapped slots touch, null slot included), vLLM's whole KV buffer
otherwise; "sched cpu ms" is the thread's CPU time of the same calls.

Workload (``shared_prefix``): ``--requests`` prompts = a system prompt shared by all,
then a topic prefix shared by one request in ``--topics``, then a private question;
``--output`` tokens each. Requests arrive in two waves (half, then the rest after the
first half finishes) so the second wave finds the first wave's prefixes cached.

``--eagle N`` turns EAGLE speculative decoding on (N draft tokens, one draft layer).

Usage::

    python -m integrations.vllm.harness.side_by_side --memory-mb 256 --json out.json
    python -m integrations.vllm.harness.side_by_side --memory-mb 1024 --requests 256 --reps 3
    python -m integrations.vllm.harness.side_by_side --managers vllm jenga-vmm \
        --sweep requests=8,16,32 memory-mb=128,256 seeds=0-2 --json s.json --table s.md

``--sweep`` runs a grid per case (`integrations.vllm.harness.sweep`; ``--seed`` other than
0 draws each request's topic and lengths, see `Workload`) and writes the ratios ours ÷
vLLM per cell (`integrations.vllm.harness.sweep_report`); ``make vllm-sweep`` regenerates
the tables in docs/results/.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from vmm.bench.stats import percentile

from integrations.vllm.harness import cases, replay, sweep
from integrations.vllm.harness.pinning import PinningTally, chunk_pinning
from integrations.vllm.options import TensorGeometry


@dataclass(frozen=True)
class Workload:
    """The shared-prefix workload. ``seed`` 0: request ``i`` takes topic ``i % topics``,
    ``question_tokens`` and ``output_tokens``; another seed draws each request's topic
    uniformly and its question and output lengths uniformly in [1/2, 3/2] of those
    (`random.Random(seed)`), so a sweep sees other mixes of the same shape."""

    requests: int = 64
    system_tokens: int = 512
    topic_tokens: int = 256
    topics: int = 8
    question_tokens: int = 200
    output_tokens: int = 64
    seed: int = 0

    def _draws(self) -> list[tuple[int, int, int]]:
        """(topic, question tokens, output tokens) per request."""
        if self.seed == 0:
            return [
                (i % self.topics, self.question_tokens, self.output_tokens)
                for i in range(self.requests)
            ]
        rng = random.Random(self.seed)
        q, o = self.question_tokens, self.output_tokens
        return [
            (
                rng.randrange(self.topics),
                rng.randint(max(1, q // 2), max(1, q * 3 // 2)),
                rng.randint(max(1, o // 2), max(1, o * 3 // 2)),
            )
            for _ in range(self.requests)
        ]

    def prompts(self) -> list[list[int]]:
        return [
            [1] * self.system_tokens + [100 + topic] * self.topic_tokens + [1000 + i] * question
            for i, (topic, question, _) in enumerate(self._draws())
        ]

    def outputs(self) -> list[int]:
        """Output tokens per request."""
        return [out for _, _, out in self._draws()]

    def longest(self) -> int:
        """The most tokens one request reaches (prompt and output)."""
        return max(
            (self.system_tokens + self.topic_tokens + q + o for _, q, o in self._draws()),
            default=0,
        )


@dataclass(frozen=True)
class Row:
    case: str
    manager: str
    num_blocks: int
    steps: int
    max_running: int
    avg_running: float
    preemptions: int
    hit_tokens: int  # prefix-hit tokens of first admissions
    resumed_hit_tokens: int
    committed_bytes: int  # ours on VMM: peak bytes mapped; else vLLM's whole KV buffer
    seconds: float
    scheduler_ms_per_step: float  # schedule() + update_from_output(), mean over steps
    sched_cpu_ms: float = 0.0  # their thread CPU per step; median over reps
    sched_cpu_p90_ms: float = 0.0  # p90 over reps
    cpu_vs_vllm: float = 0.0  # median over reps of sched_cpu_ms / vLLM's (0: no vLLM row)
    block_size: int = 16  # attention block (tokens) the manager ran with
    single_pinned: float = 0.0  # ours on VMM: share of mapped chunk-steps on 1-live-block pages
    packable: float = 0.0  # ours on VMM: share of mapped chunk-steps packing would free


MANAGERS = ("vllm", "jenga", "jenga-vmm", "jenga-vmm-group", "jenga-vmm-layer")
"""vLLM's own manager; ours on vLLM's KV tensors (``pages="vllm"``); ours on VMM pages in
the default geometry ("auto": slots or per_group), one range per KV-cache group
(``geometry="per_group"``) or one per layer (``geometry="per_layer"``)."""

_JENGA_OPTIONS = {
    "jenga": {"pages": "vllm"},
    "jenga-vmm": {"pages": "vmm"},
    "jenga-vmm-group": {"pages": "vmm", "geometry": "per_group"},
    "jenga-vmm-layer": {"pages": "vmm", "geometry": "per_layer"},
}


def run_case(
    model_dir: Path,
    case: str,
    memory_mb: int,
    workload: Workload,
    *,
    manager: str,
    setup: replay.SchedulerSetup,
    window: int = 64,
    trace: list[dict[str, Any]] | None = None,
    checked: bool = True,
    observer: Callable[[Any, Any], None] | None = None,
) -> Row:
    """One run. ``checked``: after every step check that no live block is shared and
    measure chunk pinning (outside the timed calls); False runs the scheduler with only
    the committed-bytes reading after each step (the pinning columns are then 0);
    ``observer`` is called after every step too (scheduler, output)."""
    if manager not in MANAGERS:
        raise ValueError(f"unknown manager {manager!r}; choose from {MANAGERS}")
    start = time.perf_counter()
    jenga = manager != "vllm"
    if jenga:
        options = {**(setup.jenga_options or {}), **_JENGA_OPTIONS[manager]}
        setup = replace(setup, jenga_options=options)
    # state hybrids at real scale: vLLM's tensors need vLLM's GPU block size (every page
    # as large as the state); our VMM ranges keep 16-token attention blocks
    vllm_gpu = case in cases.REAL_CASES and case in cases.STATE_CASES
    vllm_gpu = vllm_gpu and not manager.startswith("jenga-vmm")
    if vllm_gpu:
        setup = replace(setup, block_size=cases.vllm_gpu_block_size(case))
    config = replay.make_vllm_config(model_dir, setup)
    specs = _with_draft_layer(
        cases.layer_specs(case, block_size=setup.block_size, window=window, vllm_gpu=vllm_gpu),
        setup,
    )
    kv_config = replay.kv_cache_config_for(config, specs, memory_mb << 20)
    scheduler = replay.make_scheduler(config, kv_config, jenga=jenga)
    peak = PeakCommitted(scheduler, manager, trace, pinning=checked, observer=observer)
    waves, expected = _waves(workload, setup.block_size)
    reports = [
        replay.replay(scheduler, wave, after_step=peak, check_blocks=checked) for wave in waves
    ]
    for report in reports:
        wrong = {k: v for k, v in report.output_tokens.items() if v != expected[k]}
        if wrong:
            raise RuntimeError(f"{case}: requests finished with wrong token counts: {wrong}")
    row = summarize(case, manager, int(kv_config.num_blocks), reports, start, peak.bytes)
    pins = peak.pinning
    return replace(
        row,
        block_size=setup.block_size,
        single_pinned=pins.single_pinned_fraction,
        packable=pins.packable_fraction,
    )


def _waves(workload: Workload, block_size: int) -> tuple[list[Any], dict[str, int]]:
    """The workload's two waves of requests ("a0".., then "b0"..) and each request's
    output length by id."""
    prompts, outputs = workload.prompts(), workload.outputs()
    half = len(prompts) // 2
    waves = [
        replay.make_requests(prompts[:half], outputs[:half], block_size, prefix="a"),
        replay.make_requests(prompts[half:], outputs[half:], block_size, prefix="b"),
    ]
    expected = {
        f"{'a' if i < half else 'b'}{i if i < half else i - half}": n for i, n in enumerate(outputs)
    }
    return waves, expected


def _with_draft_layer(specs: dict[str, Any], setup: replay.SchedulerSetup) -> dict[str, Any]:
    """With speculative decoding on, an EAGLE head beside the target: one draft layer like
    the target's full-attention layers."""
    if setup.speculative is None:
        return specs
    full = [s for s in specs.values() if type(s).__name__ == "FullAttentionSpec"]
    return {**specs, "draft_model.layers.0.self_attn.attn": full[0]} if full else specs


class PeakCommitted:
    """``after_step`` hook: the most physical bytes the run commits.

    Ours on VMM ranges: the allocator's mapped units (what the worker's ranges map)
    after each step, at its peak, and the chunk pinning of every step (`pinning`); on
    the slots geometry the chunks its mapped slots touch (`integrations.vllm.block_ids.
    VmmSlotBlockIds.committed_bytes`, read through the manager's `committed_bytes`), no
    pinning figures.
    vLLM's manager and ours on vLLM's tensors: the whole KV buffer vLLM allocates up
    front (no pinning figures). ``pinning`` False: the mapped units alone (no per-block
    walk). ``observer``: called last after every step, with the scheduler and its output.
    """

    def __init__(
        self,
        scheduler: Any,
        manager: str,
        trace: list[dict[str, Any]] | None = None,
        *,
        pinning: bool = True,
        observer: Callable[[Any, Any], None] | None = None,
    ) -> None:
        self.kv = scheduler.kv_cache_manager
        self.observer = observer
        self.trace = trace
        self.measure_pinning = pinning
        self.pinning = PinningTally()
        self.on_vmm = manager.startswith("jenga-vmm")
        # the slots geometry maps chunks per slot: no per-page pinning to count
        geometry = self.kv.layout.options.tensor_geometry if self.on_vmm else None
        self.slot_pages = geometry is TensorGeometry.VMM_SLOTS
        if self.on_vmm:
            self.bytes = 0
        else:
            from integrations.vllm.specs import kv_cache_memory_bytes

            self.bytes = kv_cache_memory_bytes(scheduler.kv_cache_config)

    def __call__(self, scheduler: Any, out: Any) -> None:
        step: dict[str, Any] = {}
        if self.slot_pages:
            committed = self.kv.committed_bytes
            self.bytes = max(self.bytes, committed)
            step = {"mapped_chunks": committed // self.kv.layout.options.chunk_bytes}
        elif self.on_vmm and not self.measure_pinning:
            self.bytes = max(self.bytes, self.kv.committed_bytes)
        elif self.on_vmm:
            running = [r.request_id for r in scheduler.running]
            mapped, single, packable = chunk_pinning(self.kv, running)
            self.pinning.add(mapped, single, packable)
            self.bytes = max(self.bytes, mapped * self.kv.layout.options.chunk_bytes)
            step = {"mapped_chunks": mapped, "single_pinned": single, "packable": packable}
        if self.trace is not None:
            self.trace.append(_trace_step(scheduler, out) | step)
        if self.observer is not None:
            self.observer(scheduler, out)


def _trace_step(scheduler: Any, out: Any) -> dict[str, Any]:
    """One step of ``--trace``: the scheduler's queues and the manager's free memory."""
    step = {
        "running": len(scheduler.running),
        "waiting": len(scheduler.waiting),
        "preempted": len(out.preempted_req_ids or ()),
        "admitted": len(out.scheduled_new_reqs),
        "tokens": sum(out.num_scheduled_tokens.values()),
    }
    kv = scheduler.kv_cache_manager
    if hasattr(kv, "allocator"):  # ours: free units (chunks or slots), blocks per group
        use = kv.allocator.usage()
        return step | {
            "free_units": use.free_units,
            "used_blocks": list(use.used_blocks),
            "cached_blocks": list(use.cached_blocks),
            "free_blocks": list(use.free_blocks),
        }
    return step | {"free_blocks": kv.block_pool.get_num_free_blocks()}  # vLLM: incl. cached


def summarize(
    case: str,
    manager: str,
    num_blocks: int,
    reports: list[replay.ReplayReport],
    start: float,
    committed_bytes: int = 0,
) -> Row:
    """One row from the replays of a run (waves in order) that began at ``start``."""
    running = [n for r in reports for n in r.running_per_step]
    steps = sum(r.steps for r in reports)
    return Row(
        case=case,
        manager=manager,
        num_blocks=num_blocks,
        steps=steps,
        max_running=max(r.max_running for r in reports),
        avg_running=round(sum(running) / len(running), 2),
        preemptions=sum(r.preemptions for r in reports),
        hit_tokens=sum(r.prefix_hit_tokens for r in reports),
        resumed_hit_tokens=sum(r.resumed_hit_tokens for r in reports),
        committed_bytes=committed_bytes,
        seconds=round(time.perf_counter() - start, 2),
        scheduler_ms_per_step=round(1000 * sum(r.scheduler_seconds for r in reports) / steps, 3),
        sched_cpu_ms=round(sum(r.scheduler_cpu_ns for r in reports) / 1e6 / steps, 4),
    )


def compare(
    model_dir: Path,
    case_names: list[str],
    memory_mb: int,
    workload: Workload,
    setup: replay.SchedulerSetup,
    managers: tuple[str, ...] = MANAGERS,
    window: int = 64,
    reps: int = 1,
    traces: dict[str, list[dict[str, Any]]] | None = None,
) -> list[Row]:
    """One row per case and manager. The first round checks every step (no live block
    shared, chunk pinning, ``traces``); with ``reps`` > 1, ``reps`` timed rounds follow
    that run the scheduler alone, each round every manager once (the order rotating),
    and the CPU columns are the median / p90 over the timed rounds and the median of
    each round's ratio to vLLM's. The checks run between ``schedule`` and
    ``update_from_output``, outside the timed calls, but they evict the scheduler's
    working set from the CPU caches and slow the timed calls after them (ours more: its
    ``get_blocks`` builds the tables the check reads), so they are kept out of the
    timed rounds; with ``reps`` = 1 the one round is both."""
    if reps < 1:
        raise ValueError(f"reps must be >= 1, got {reps}")
    rows = []
    rounds = reps + 1 if reps > 1 else 1
    for case in case_names:
        runs: dict[str, list[Row]] = {m: [] for m in managers}
        for r in range(rounds):
            k = r % len(managers)
            for manager in (*managers[k:], *managers[:k]):
                runs[manager].append(
                    run_case(
                        model_dir,
                        case,
                        memory_mb,
                        workload,
                        manager=manager,
                        setup=setup,
                        window=window,
                        trace=None
                        if traces is None or r
                        else traces.setdefault(f"{case}/{manager}", []),
                        checked=r == 0,
                    )
                )
        rows += [_over_reps(got, runs.get("vllm")) for got in runs.values()]
    return rows


def _over_reps(got: list[Row], vllm: list[Row] | None) -> Row:
    """The first (checked) round's row with the CPU columns taken over the timed rounds
    (the rounds after it; the first one when it is the only one)."""
    timed = got[1:] or got
    cpu = [r.sched_cpu_ms for r in timed]
    base = (vllm[1:] or vllm) if vllm else ()
    ratios = [r.sched_cpu_ms / v.sched_cpu_ms for r, v in zip(timed, base, strict=False)]
    p90 = percentile(sorted(cpu), 90.0)
    return replace(
        got[0],
        sched_cpu_ms=round(statistics.median(cpu), 4),
        sched_cpu_p90_ms=round(p90, 4),
        cpu_vs_vllm=round(statistics.median(ratios), 3) if ratios else 0.0,
    )


def format_table(rows: list[Row]) -> str:
    head = (
        "case",
        "manager",
        "block",
        "blocks",
        "steps",
        "max run",
        "avg run",
        "preempt",
        "hit tokens",
        "resumed",
        "committed MiB",
        "sched ms",
        "cpu ms",
        "cpu p90",
        "cpu/vllm",
        "1-pinned",
        "packable",
    )
    widths = [15 if h == "manager" else 10 for h in head]  # "jenga-vmm-group"
    lines = ["  ".join(f"{h:>{w}}" for h, w in zip(head, widths, strict=True))]
    for r in rows:
        cells = (
            r.case,
            r.manager,
            r.block_size,
            r.num_blocks,
            r.steps,
            r.max_running,
            r.avg_running,
            r.preemptions,
            r.hit_tokens,
            r.resumed_hit_tokens,
            round(r.committed_bytes / 2**20, 1),
            r.scheduler_ms_per_step,
            r.sched_cpu_ms,
            r.sched_cpu_p90_ms,
            r.cpu_vs_vllm,
            r.single_pinned if r.manager.startswith("jenga-vmm") else "-",
            r.packable if r.manager.startswith("jenga-vmm") else "-",
        )
        lines.append("  ".join(f"{c!s:>{w}}" for c, w in zip(cells, widths, strict=True)))
    return "\n".join(lines)


def _add_sweep_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--sweep",
        nargs="+",
        default=None,
        metavar="KEY=VALUES",
        help="a grid instead of one run: requests=8,16 memory-mb=128,256 (or memory-gib=20,40) "
        "seeds=0-2; writes --json, a ratio table (--table) and heat maps (--plots)",
    )
    parser.add_argument("--table", type=Path, default=None, help="sweep: markdown table here")
    parser.add_argument("--plots", type=Path, default=None, help="sweep: heat-map PNG folder")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--cases",
        nargs="+",
        default=list(cases.CASES),
        choices=cases.ALL_CASES + cases.LATENT_CASES,
        help=f"default: the small stand-ins; real-scale geometries: {', '.join(cases.REAL_CASES)}"
        f"; MLA and sink kinds: {', '.join(cases.LATENT_CASES)}",
    )
    parser.add_argument("--memory-mb", type=int, default=256)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--output", type=int, default=64)
    parser.add_argument("--question-tokens", type=int, default=200)
    parser.add_argument("--system-tokens", type=int, default=512, help="shared by all")
    parser.add_argument(
        "--topics", type=int, default=8, help="topic prefixes (256 tokens), one per request in N"
    )
    parser.add_argument("--window", type=int, default=64, help="sliding window (tokens)")
    parser.add_argument(
        "--seed", type=int, default=0, help="0: the fixed workload; else drawn topics, lengths"
    )
    _add_sweep_arguments(parser)
    parser.add_argument(
        "--order",
        choices=("compact", "paper", "pinned"),
        default=None,
        help="allocation order of ours (default: the manager's, pinned on per_group VMM pages)",
    )
    parser.add_argument("--managers", nargs="+", default=list(MANAGERS), choices=MANAGERS)
    parser.add_argument(
        "--eagle",
        type=int,
        default=0,
        help="EAGLE speculative decoding with this many draft tokens (a draft layer is "
        "added beside the target's; vLLM's scheduler then holds lookahead slots and drops "
        "the last block of a hit)",
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    parser.add_argument(
        "--trace",
        type=Path,
        default=None,
        help="write per-step records (queues, preemptions, free memory, pinning) here",
    )
    parser.add_argument(
        "--reps",
        type=int,
        default=1,
        help="timed rounds per case, managers alternating (CPU: median); > 1 adds a "
        "checked round first",
    )
    return parser


def scheduler_setup(workload: Workload, order: str | None = None) -> replay.SchedulerSetup:
    """The scheduler limits of one run: ``max_model_len`` the longest request rounded up
    to 1,024 (at least 2,048), 256 sequences, 2,048 batched tokens."""
    return replay.SchedulerSetup(
        max_model_len=max(2048, -(-workload.longest() // 1024) * 1024),
        max_num_seqs=256,
        max_num_batched_tokens=2048,
        jenga_options={} if order is None else {"order": order},
    )


def main_sweep(args: argparse.Namespace, workload: Workload) -> int:
    """``--sweep``: every cell of the grid (`sweep.run_grid`), ``--json`` rewritten after
    each case, then the ratio table (``--table``) and heat maps (``--plots``)."""
    grid = sweep.parse_grid(
        args.sweep, requests=args.requests, memory_mb=args.memory_mb, seed=args.seed
    )
    payload: dict[str, Any] = {
        "command": " ".join(["python -m integrations.vllm.harness.side_by_side", *sys.argv[1:]]),
        "grid": asdict(grid),
        "order": args.order or "default",
        "window": args.window,
        "workload": asdict(workload),
        "managers": list(args.managers),
        "cells": [],
    }

    def save(cells: list[dict[str, Any]]) -> None:
        payload["cells"] = cells
        if args.json is not None:
            args.json.write_text(json.dumps(payload, indent=1))

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = replay.write_tiny_model(Path(tmp) / "model")

        def run_one(case: str, memory: int, load: Workload, manager: str) -> dict[str, Any]:
            """The row, or the error a manager raised (a cell it cannot run loses)."""
            setup = scheduler_setup(load, args.order)
            try:
                row = run_case(
                    model_dir,
                    case,
                    memory,
                    load,
                    manager=manager,
                    setup=setup,
                    window=args.window,
                    checked=False,
                )
            except Exception as exc:  # recorded in the cell, reported as losing
                return {"error": f"{type(exc).__name__}: {exc}"}
            return asdict(row)

        def run_cell(case: str, memory: int, requests: int, seed: int) -> dict[str, Any]:
            load = replace(workload, requests=requests, seed=seed)
            return {m: run_one(case, memory, load, m) for m in args.managers}

        save(sweep.run_grid(args.cases, grid, run_cell, on_case=save))
    print(sweep.write_outputs(payload, args.table, args.plots))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    workload = Workload(
        requests=args.requests,
        output_tokens=args.output,
        question_tokens=args.question_tokens,
        system_tokens=args.system_tokens,
        topics=args.topics,
        seed=args.seed,
    )
    if args.sweep is not None:
        return main_sweep(args, workload)
    setup = scheduler_setup(workload, args.order)
    traces: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = replay.write_tiny_model(Path(tmp) / "model")
        if args.eagle:
            draft = replay.write_tiny_model(Path(tmp) / "draft")
            eagle = {"method": "eagle", "model": str(draft), "num_speculative_tokens": args.eagle}
            setup = replace(setup, speculative=eagle)
        rows = compare(
            model_dir,
            args.cases,
            args.memory_mb,
            workload,
            setup,
            tuple(args.managers),
            window=args.window,
            reps=args.reps,
            traces=None if args.trace is None else traces,
        )
    print(format_table(rows))
    if args.json is not None:
        payload: dict[str, Any] = {
            "memory_mb": args.memory_mb,
            "order": args.order or "default",
            "window": args.window,
            "workload": asdict(workload),
            "rows": [asdict(r) for r in rows],
        }
        args.json.write_text(json.dumps(payload, indent=2))
    if args.trace is not None:
        args.trace.write_text(json.dumps(traces))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
