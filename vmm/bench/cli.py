"""vmm-bench: per-op latency of the vmm layer against a raw baseline measured in the same run.

Rationale
---------
Speed goals are checked by a benchmark, not by timed unit tests: every op (create,
reserve, map, set-access on CUDA, unmap, release, tensor view, apply-plan) is timed
through vmm ("ours") and as the plainest loop of the same syscalls / driver calls
("raw"), case by case, so the printed ratio is what the vmm layer adds on this machine.

Approach
--------
`main` parses flags into `BenchArgs`, expands them into cases (chunk size x count x mode
x layout), runs each case's rounds (`vmm.bench.host` / `vmm.bench.cuda`), collects
garbage between cases, then prints a rich table, checks the bars and optionally writes
JSON (schema in `vmm.bench.report`). `--quick` is the short run `make test-gpu` uses.
A bad flag, an unusable value or an unavailable backend ends with one line on stderr and
exit status 2 (flags) or 1 (everything else), never a traceback.

Bars (PASS/FAIL lines; `--check` turns a FAIL into exit status 1):
  * host, 2 MiB, batched apply of 1,000 maps <= 1.2x the raw C loop per chunk
    (judged on the scattered layout, where ours must make the same N mmaps as raw);
  * tensor view creation <= 2 us median, and <= 1.5 us over the bare capsule;
  * single map from Python (one slot per backend.map call) <= 2x the raw C mmap call;
  * CUDA, one call per op: create, reserve, map, unmap, release each <= 3 us over the
    raw cuda-python loop (medians), free_reservation <= 1.2x raw (or raw + 3 us where
    the driver's call is so short that 1.2x leaves under 3 us).

Limitations
-----------
Timings on a shared machine are noisy: rounds, medians and the side-by-side baseline
reduce that, they do not remove it. CUDA cases need a CUDA driver and cuda-python; on
the test suite's driver emulator they run end to end and are labelled "cuda-emulated"
(host memory: not GPU figures), and tensor views, which need torch CUDA, are reported
as not measured.
"""

from __future__ import annotations

import argparse
import gc
import mmap
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, NoReturn

from vmm._core.host import HostError
from vmm.bench.host import Case
from vmm.bench.report import Bar, OpResult, Report, render, size_label
from vmm.errors import BackendUnavailable, VmmError
from vmm.extras import MissingExtra, require

_SIZE_SUFFIXES = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
BAR_CHUNK = 2 << 20
BAR_COUNT = 1000
#: most µs a one-by-one CUDA op may add to the raw driver loop; a tensor view to a bare capsule
OP_OVERHEAD_US = 3.0
VIEW_OVERHEAD_US = 1.5
OVERHEAD_OPS = ("create", "reserve", "map", "unmap", "release", "free_reservation")


def parse_size(text: str) -> int:
    """'64K' / '2M' / '2MiB' / '4096' -> bytes."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    scale = _SIZE_SUFFIXES.get(t[-1:], 1)
    digits = t[:-1] if t[-1:] in _SIZE_SUFFIXES else t
    if not digits.isdigit() or int(digits) <= 0:
        raise argparse.ArgumentTypeError(f"bad size {text!r} (e.g. 64K, 2M, 8M)")
    return int(digits) * scale


def parse_count(text: str) -> int:
    """'1000' -> 1000 (an integer; the bounds are checked in resolve_args)."""
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None


def _csv(convert: Callable[[str], Any]) -> Callable[[str], list[Any]]:
    def parse(text: str) -> list[Any]:
        return [convert(part) for part in text.split(",") if part.strip()]

    parse.__name__ = "list"
    return parse


@dataclass(frozen=True)
class BenchArgs:
    backend: str
    chunk_sizes: tuple[int, ...]
    counts: tuple[int, ...]
    modes: tuple[str, ...]
    layouts: tuple[str, ...]
    rounds: int
    map_rounds: int
    create_count: int | None
    views: int
    device: int
    zero_fill: bool
    progress: bool
    quick: bool
    max_bytes: int


def _flags() -> list[tuple[str, dict[str, Any]]]:
    """Every flag and its argparse options (defaults of None are resolved in resolve_args)."""
    return [
        ("--backend", {"choices": ("host", "cuda", "auto"), "default": "auto"}),
        ("--chunk-sizes", {"type": _csv(parse_size),
                           "help": "comma list, e.g. 64K,256K,2M,8M (default; --quick: 64K,2M)"}),
        ("--counts", {"type": _csv(parse_count),
                      "help": "chunks per case, comma list (default 1000)"}),
        ("--modes", {"type": _csv(str), "default": ["one_by_one", "batched"],
                     "help": "one_by_one (one call per chunk) and/or batched (one call for all)"}),
        ("--layouts", {"type": _csv(str), "default": ["contiguous", "scattered"],
                       "help": "host memfd offsets per slot: contiguous (i) / scattered (2i)"}),
        ("--rounds", {"type": int,
                      "help": "create/reserve/release rounds, a fresh backend each (5; quick 3)"}),
        ("--map-rounds", {"type": int,
                          "help": "map/unmap/apply passes over chunks made once (30; quick 10)"}),
        ("--create-count", {"type": int,
                            "help": "chunks per create/release round (each count; quick 100)"}),
        ("--views", {"type": int, "help": "tensor views timed (5000; quick 2000)"}),
        ("--max-mib", {"type": int, "default": 4096,
                       "help": "most memory one case may populate; larger counts are cut"}),
        ("--device", {"type": int, "default": 0, "help": "CUDA device ordinal"}),
        ("--zero-fill", {"action": "store_true",
                         "help": "cuda: CudaBackend.create zero-fills (raw never does)"}),
        ("--quick", {"action": "store_true",
                     "help": "a short run: the bars' cases only, fewer rounds (make test-gpu)"}),
        ("--json", {"metavar": "PATH", "help": "write the results as JSON to PATH"}),
        ("--no-progress", {"action": "store_true", "help": "no progress bar"}),
        ("--check", {"action": "store_true", "help": "exit 1 if a bar fails"}),
    ]  # fmt: skip


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line on stderr (not the usage block), exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="vmm-bench", description=__doc__.split("\n\n")[0])
    for flag, options in _flags():
        p.add_argument(flag, **options)
    return p


def _given(value: Any, default: Any) -> Any:
    return default if value is None else value


def resolve_args(ns: argparse.Namespace) -> BenchArgs:
    """Flags plus the defaults of a full or a --quick run; SystemExit on bad values."""
    quick = ns.quick
    full_sizes = [64 << 10, 256 << 10, 2 << 20, 8 << 20]
    sizes = _given(ns.chunk_sizes, [64 << 10, 2 << 20] if quick else full_sizes)
    counts = _given(ns.counts, [BAR_COUNT])
    for mode in ns.modes:
        if mode not in ("one_by_one", "batched"):
            raise SystemExit(f"vmm-bench: unknown mode {mode!r} (one_by_one, batched)")
    for layout in ns.layouts:
        if layout not in ("contiguous", "scattered"):
            raise SystemExit(f"vmm-bench: unknown layout {layout!r} (contiguous, scattered)")
    _check_sizes(sizes, ns.max_mib, ns.device)
    rounds = _given(ns.rounds, 3 if quick else 5)
    map_rounds = _given(ns.map_rounds, 10 if quick else 30)
    create_count = _given(ns.create_count, 100 if quick else None)
    views = _given(ns.views, 2000 if quick else 5000)
    numbers = [rounds, map_rounds, views, *counts, 1 if create_count is None else create_count]
    if not sizes or not counts or not ns.modes or not ns.layouts or min(numbers) < 1:
        raise SystemExit(
            "vmm-bench: --rounds, --map-rounds, --views, --counts, --create-count must be "
            f">= 1 and lists non-empty (got rounds={rounds}, map_rounds={map_rounds}, "
            f"views={views}, counts={counts}, create_count={create_count})"
        )
    return BenchArgs(
        backend=ns.backend, chunk_sizes=tuple(sizes), counts=tuple(counts),
        modes=tuple(ns.modes), layouts=tuple(ns.layouts), rounds=rounds, map_rounds=map_rounds,
        create_count=create_count, views=views, device=ns.device, zero_fill=ns.zero_fill,
        progress=not ns.no_progress, quick=quick, max_bytes=ns.max_mib << 20,
    )  # fmt: skip


def _check_sizes(sizes: Sequence[int], max_mib: int, device: int) -> None:
    """SystemExit unless every chunk size is a page multiple that fits in `max_mib`."""
    if max_mib < 1:
        raise SystemExit(f"vmm-bench: --max-mib must be >= 1 (got {max_mib})")
    if device < 0:
        raise SystemExit(f"vmm-bench: --device must be a device ordinal >= 0 (got {device})")
    page = mmap.PAGESIZE
    for size in sizes:
        if size % page:
            raise SystemExit(
                f"vmm-bench: chunk size {size} bytes is not a multiple of the "
                f"{page}-byte page (e.g. 64K, 2M)"
            )
        if size > max_mib << 20:
            raise SystemExit(
                f"vmm-bench: chunk size {size_label(size)} is larger than --max-mib {max_mib}"
            )


def check_json_path(path: str) -> None:
    """SystemExit unless a file can be written at `path` (checked before the run)."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise SystemExit(f"vmm-bench: --json {path}: is a folder, not a file")
    if not os.path.isdir(folder):
        raise SystemExit(f"vmm-bench: --json {path}: folder {folder} does not exist")
    if not os.access(folder, os.W_OK):
        raise SystemExit(f"vmm-bench: --json {path}: folder {folder} is not writable")


def choose_backend(kind: str, device: int) -> str:
    """'host' or 'cuda'; `auto` tries the CUDA backend and says why it fell back."""
    if kind != "auto":
        return kind
    try:
        from vmm.cuda import CudaBackend

        CudaBackend(device).close()
    except BackendUnavailable as exc:
        print(f"vmm-bench: auto chose the host backend ({exc})", file=sys.stderr)
        return "host"
    print("vmm-bench: auto chose the cuda backend", file=sys.stderr)
    return "cuda"


# ---- backends and pools ------------------------------------------------------------------
def _host_backend(chunk_size: int) -> Any:
    from vmm.host import HostBackend

    return HostBackend(chunk_size)


def _cuda_factory(args: BenchArgs) -> Callable[[int], Any]:
    def make(chunk_size: int) -> Any:
        from vmm.cuda import CudaBackend

        return CudaBackend(args.device, granularity=chunk_size, zero_fill=args.zero_fill)

    return make


def _pool_factory(make_backend: Callable[[int], Any]) -> Callable[[int, int], Any]:
    def make(chunk_size: int, budget_bytes: int) -> Any:
        from vmm.pool import ChunkPool

        return ChunkPool(make_backend(chunk_size), budget_bytes)

    return make


# ---- running -------------------------------------------------------------------------------
#: (mode, layout) pairs --quick leaves out: the bars need only the other two
QUICK_SKIP = (("one_by_one", "scattered"), ("batched", "contiguous"))


def cases_of(args: BenchArgs, backend: str) -> list[tuple[Case, Case | None]]:
    """(case, lifecycle case or None): create/release/reserve/free are measured once per
    chunk size x count x mode, with the first layout's case. Counts are cut so that no
    case populates more than `max_bytes` (the table shows the count actually run)."""
    layouts = args.layouts if backend == "host" else ("contiguous",)
    out: list[tuple[Case, Case | None]] = []
    for size in args.chunk_sizes:
        for count in args.counts:
            for mode in args.modes:
                pairs = [(mode, lay) for lay in layouts]
                if args.quick:
                    pairs = [p for p in pairs if p not in QUICK_SKIP] or pairs[:1]
                fit = max(args.max_bytes // size, 1)
                lifecycle = Case(size, min(args.create_count or count, fit), mode, "-", args.rounds)
                for i, (_, layout) in enumerate(pairs):
                    n = min(count, max(fit // 2, 1) if layout == "scattered" else fit)
                    case = Case(size, n, mode, layout, args.map_rounds)
                    out.append((case, lifecycle if i == 0 else None))
    return out


def describe_cuda_device(ordinal: int) -> dict[str, Any]:
    """{"name", "emulated", "granularity"} of CUDA device `ordinal`, from its driver."""
    from vmm.cuda import CudaBackend
    from vmm.cuda_driver import device_name, is_emulated, load_driver

    name = device_name(load_driver(), ordinal)
    probe = CudaBackend(ordinal, zero_chunk=False)
    granularity = probe.granularity
    probe.close()
    return {"name": name, "emulated": is_emulated(name), "granularity": granularity}


def _cuda_run(args: BenchArgs, report: Report) -> tuple[BenchArgs, str]:
    """Fill in `report.device`; keep the chunk sizes the device can map (the others are
    listed as skipped); returns the args to run and the results' backend label."""
    from dataclasses import replace

    report.device = describe_cuda_device(args.device)
    gran = report.device["granularity"]
    sizes = tuple(size for size in args.chunk_sizes if size % gran == 0)
    for size in args.chunk_sizes:
        if size % gran:
            reason = f"not a multiple of the device's granularity {size_label(gran)}"
            report.skipped.append({"op": f"chunk size {size_label(size)}", "reason": reason})
    if not sizes:
        raise SystemExit(f"vmm-bench: no chunk size is a multiple of {size_label(gran)}")
    return replace(args, chunk_sizes=sizes), "cuda-emulated" if report.emulated else "cuda"


def _views_unmeasurable(backend: str) -> str | None:
    """Why tensor views cannot be timed on `backend` here, or None."""
    try:
        require("torch", "timing tensor views")
    except MissingExtra as exc:
        return str(exc)
    if backend != "cuda":
        return None
    import torch

    if torch.cuda.is_available():
        return None
    return "torch sees no CUDA device, so no CUDA tensor can be made (driver-only run)"


def _run_one(
    args: BenchArgs, backend: str, case: Case, lifecycle: Case | None, label: str
) -> list[OpResult]:
    from vmm.bench import host as bench_host

    if backend == "host":
        pools = _pool_factory(_host_backend)
        return bench_host.run_case(
            case,
            _host_backend,
            lambda c, samples: bench_host.ours_apply_plan(pools, c, samples),
            lifecycle,
        )
    from vmm.bench import cuda as bench_cuda

    make = _cuda_factory(args)
    pools = _pool_factory(make)
    return bench_cuda.run_case(
        case,
        make,
        lambda c, samples: bench_host.ours_apply_plan(pools, c, samples),
        args.device,
        label=label,
    )


def _run_views(args: BenchArgs, backend: str, chunk_size: int) -> OpResult:
    from vmm.bench.host import tensor_view_case

    make = _host_backend if backend == "host" else _cuda_factory(args)
    device = -1 if backend == "host" else args.device
    return tensor_view_case(_pool_factory(make), chunk_size, args.views, device)


def run(args: BenchArgs) -> Report:
    """Measure every case of `args`; returns the report with its bars checked."""
    backend = choose_backend(args.backend, args.device)
    report = Report(args=asdict(args) | {"backend": backend})
    label = backend
    if backend == "cuda":
        args, label = _cuda_run(args, report)
    cases = cases_of(args, backend)
    view_size = BAR_CHUNK if BAR_CHUNK in args.chunk_sizes else args.chunk_sizes[0]
    with _progress(args.progress, len(cases) + 1) as advance:
        for case, lifecycle in cases:
            report.results.extend(_run_one(args, backend, case, lifecycle, label))
            gc.collect()
            advance()
        no_views = _views_unmeasurable(backend)
        if no_views is None:
            report.results.append(_run_views(args, backend, view_size))
        else:
            report.skipped.append({"op": "tensor_view", "reason": no_views})
        gc.collect()
        advance()
    report.bars.extend(check_bars(report, backend))
    return report


class _progress:
    """A transient rich progress bar over cases (or nothing with `enabled` False)."""

    def __init__(self, enabled: bool, total: int):
        self._enabled = enabled
        self._total = total
        self._bar: Any = None

    def __enter__(self) -> Callable[[], None]:
        if not self._enabled:
            return lambda: None
        from rich.progress import Progress

        self._bar = Progress(transient=True)
        self._bar.start()
        task = self._bar.add_task("vmm-bench", total=self._total)
        return lambda: self._bar.advance(task)

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.stop()


# ---- bars ----------------------------------------------------------------------------------
def check_bars(report: Report, backend: str) -> list[Bar]:
    """The issue's three speed bars, from whatever of them this run measured."""
    bars: list[Bar] = []
    if backend == "host":
        layout = "scattered" if report.find(op="apply_plan", layout="scattered") else "contiguous"
        plan = report.find(op="apply_plan", chunk_size=BAR_CHUNK, num_chunks=BAR_COUNT,
                           mode="batched", layout=layout)  # fmt: skip
        if plan is not None:
            bars.append(Bar("host 2 MiB batched apply of 1,000 maps", 1.2, plan.ratio_p50,
                            "x raw", f"per chunk, {layout} layout"))  # fmt: skip
        single = report.find(op="map", chunk_size=BAR_CHUNK, mode="one_by_one",
                             layout="contiguous")  # fmt: skip
        if single is not None:
            bars.append(Bar("single map from Python", 2.0, single.ratio_p50, "x raw",
                            "backend.map of one 2 MiB slot vs one mmap"))  # fmt: skip
    for view in (r for r in report.results if r.op == "tensor_view"):
        bars.append(Bar(f"{view.backend} tensor view creation", 2.0, view.ours.p50 / 1000.0,
                        "us", f"median over {view.ours.n} views"))  # fmt: skip
        bars.append(Bar(f"{view.backend} tensor view overhead", VIEW_OVERHEAD_US,
                        _overhead_us(view), "us over raw",
                        "ours - raw medians: VirtualRange.tensor vs a bare capsule"))  # fmt: skip
    if backend == "cuda":
        bars.extend(cuda_overhead_bars(report))
    return bars


def _overhead_us(result: OpResult) -> float:
    return (result.ours.p50 - result.raw.p50) / 1000.0


def cuda_overhead_bars(report: Report) -> list[Bar]:
    """What `CudaBackend` adds to the driver per call, one call per op: at most
    `OP_OVERHEAD_US` over the raw cuda-python loop (medians), and free_reservation at most
    1.2x raw, or raw + `OP_OVERHEAD_US` where that is larger (a driver call of under
    15 µs, as on the emulator, leaves no room for any Python at 1.2x)."""
    bars: list[Bar] = []
    for r in report.results:
        if r.mode != "one_by_one" or r.op not in OVERHEAD_OPS:
            continue
        size = size_label(r.chunk_size)
        if r.op == "free_reservation":
            raw_us = r.raw.p50 / 1000.0
            limit = max(1.2, (raw_us + OP_OVERHEAD_US) / raw_us) if raw_us > 0 else 1.2
            bars.append(Bar(f"{r.backend} free_reservation {size}", round(limit, 2),
                            r.ratio_p50, "x raw",
                            f"ours / raw medians, {r.num_chunks} slots; 1.2x or raw + "
                            f"{OP_OVERHEAD_US:g} us"))  # fmt: skip
            continue
        name = f"{r.backend} {r.op} {size} one-by-one overhead"
        detail = "ours - raw medians, one call each"
        bars.append(Bar(name, OP_OVERHEAD_US, _overhead_us(r), "us over raw", detail))
    return bars


#: what a run can raise on a bad machine or value: one line on stderr, exit status 1
_RUN_ERRORS: tuple[type[BaseException], ...] = (
    VmmError, BackendUnavailable, MissingExtra, OSError, MemoryError, RuntimeError,
    HostError,
)  # fmt: skip


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or "no message"
    return f"vmm-bench: {type(exc).__name__}: {text}"


def main(argv: Sequence[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    args = resolve_args(ns)
    if ns.json:
        check_json_path(ns.json)
    try:
        report = run(args)
        render(report)
        if ns.json:
            report.write_json(ns.json)
    except KeyboardInterrupt:
        raise SystemExit("vmm-bench: interrupted") from None
    except _RUN_ERRORS as exc:
        raise SystemExit(_one_line(exc)) from None
    return 1 if ns.check and not report.passed else 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
