"""vmm-bench: the CLI in-process on tiny sizes, its JSON schema, the raw baselines, the bars."""

from __future__ import annotations

import ctypes
import gc
import json
import subprocess
import sys
from pathlib import Path

import pytest
from vmm._core import bench as raw
from vmm.bench import cli as bench
from vmm.bench import stats
from vmm.bench.host import HOST_OPS, chunk_order
from vmm.bench.report import Bar, OpResult, Report
from vmm.bench.stats import Summary

TINY = ["--backend", "host", "--chunk-sizes", "64K", "--counts", "8", "--rounds", "2",
        "--map-rounds", "3", "--create-count", "4", "--views", "20", "--no-progress"]  # fmt: skip
SUMMARY_KEYS = {"n", "avg", "p50", "p99", "max"}
RESULT_KEYS = {"op", "backend", "chunk_size", "num_chunks", "mode", "layout", "unit", "ours",
               "raw", "ratio_p50"}  # fmt: skip


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    path = tmp_path_factory.mktemp("bench") / "out.json"
    assert bench.main([*TINY, "--json", str(path)]) == 0
    return json.loads(path.read_text())


def test_json_schema(tiny_run: dict) -> None:
    assert tiny_run["schema"] == "vmm-bench/1"
    assert set(tiny_run) == {"schema", "machine", "args", "results", "bars", "skipped", "passed"}
    assert tiny_run["skipped"] == [] and "device" not in tiny_run["machine"]
    assert {"nproc", "kernel", "python", "date"} <= set(tiny_run["machine"])
    assert tiny_run["args"]["backend"] == "host"
    for r in tiny_run["results"]:
        assert set(r) == RESULT_KEYS
        for side in ("ours", "raw"):
            assert set(r[side]) == SUMMARY_KEYS
            s = r[side]
            assert s["n"] >= 1 and 0 < s["p50"] <= s["max"] and s["p99"] <= s["max"]
        assert r["ratio_p50"] == pytest.approx(r["ours"]["p50"] / r["raw"]["p50"])
    for b in tiny_run["bars"]:
        assert set(b) == {"name", "limit", "value", "unit", "detail", "passed"}
        assert b["passed"] == (b["value"] <= b["limit"])
    assert tiny_run["passed"] == all(b["passed"] for b in tiny_run["bars"])


def test_every_op_has_ours_and_raw_in_every_case(tiny_run: dict) -> None:
    seen = {(r["op"], r["mode"], r["layout"]) for r in tiny_run["results"]}
    for mode in ("one_by_one", "batched"):
        for op in ("create", "reserve", "release", "free_reservation"):
            assert (op, mode, "-") in seen
        for layout in ("contiguous", "scattered"):
            assert ("map", mode, layout) in seen
            assert ("unmap", mode, layout) in seen
    for layout in ("contiguous", "scattered"):
        assert ("apply_plan", "batched", layout) in seen
        assert ("apply_plan", "one_by_one", layout) not in seen  # a plan is a batch
    assert ("tensor_view", "one_by_one", "-") in seen
    assert {op for op, _, _ in seen} == {*HOST_OPS, "tensor_view"}


def test_sample_counts_follow_the_flags(tiny_run: dict) -> None:
    def one(op: str, mode: str, layout: str) -> dict:
        (r,) = [
            r
            for r in tiny_run["results"]
            if (r["op"], r["mode"], r["layout"]) == (op, mode, layout)
        ]
        return r

    # one_by_one: every call is a sample (8 slots x 3 passes); batched: one per pass
    assert one("map", "one_by_one", "contiguous")["ours"]["n"] == 24
    assert one("map", "one_by_one", "contiguous")["raw"]["n"] == 24
    assert one("map", "batched", "scattered")["ours"]["n"] == 3
    assert one("apply_plan", "batched", "scattered")["raw"]["n"] == 3
    # create: 4 chunks x 2 rounds one by one, 2 rounds batched; reserve: one per round
    assert one("create", "one_by_one", "-")["ours"]["n"] == 8
    assert one("create", "batched", "-")["raw"]["n"] == 2
    assert one("reserve", "batched", "-")["ours"]["n"] == 2
    assert one("create", "batched", "-")["num_chunks"] == 4
    assert one("tensor_view", "one_by_one", "-")["ours"]["n"] == 20
    assert one("map", "batched", "scattered")["num_chunks"] == 8


def test_cli_prints_table_and_bars(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [*TINY, "--modes", "batched", "--layouts", "scattered"]
    assert bench.main(argv) == 0
    out = capsys.readouterr().out
    assert "vmm-bench (host)" in out
    assert "apply_plan" in out and "tensor_view" in out
    assert "host tensor view creation" in out  # the only bar measured at 64 KiB
    assert ("PASS" in out) or ("FAIL" in out)


def test_quick_defaults() -> None:
    args = bench.resolve_args(bench.build_parser().parse_args(["--quick"]))
    assert args.chunk_sizes == (64 << 10, 2 << 20)
    assert args.counts == (1000,)
    assert (args.rounds, args.map_rounds, args.create_count) == (3, 10, 100)
    cases = bench.cases_of(args, "host")
    pairs = [(c.chunk_size, c.mode, c.layout, life is not None) for c, life in cases]
    assert pairs == [
        (64 << 10, "one_by_one", "contiguous", True),
        (64 << 10, "batched", "scattered", True),
        (2 << 20, "one_by_one", "contiguous", True),
        (2 << 20, "batched", "scattered", True),
    ]


@pytest.mark.parametrize(
    ("text", "size"), [("64K", 64 << 10), ("2M", 2 << 20), ("2MiB", 2 << 20), ("4096", 4096)]
)
def test_parse_size(text: str, size: int) -> None:
    assert bench.parse_size(text) == size


def test_bad_flags_are_refused() -> None:
    with pytest.raises(SystemExit):
        bench.main(["--chunk-sizes", "2X"])
    with pytest.raises(SystemExit, match="unknown mode 'sideways'"):
        bench.main(["--backend", "host", "--modes", "sideways"])
    with pytest.raises(SystemExit, match="must be >= 1"):
        bench.main(["--backend", "host", "--rounds", "0", "--views", "0"])


def test_summary_percentiles_are_exact() -> None:
    s = Summary.of([5, 1, 4, 2, 3])
    assert (s.n, s.avg, s.p50, s.max) == (5, 3.0, 3.0, 5.0)
    assert s.p99 == pytest.approx(4.96)  # numpy's linear interpolation: 4 + 0.96
    with pytest.raises(ValueError):
        Summary.of([])


def test_summary_scaled_changes_the_unit_only() -> None:
    s = Summary.of([1000, 3000, 2000, 4000]).scaled(1e-3)
    assert (s.n, s.avg, s.p50, s.max) == (4, 2.5, 2.5, 4.0)
    assert s.p99 == pytest.approx(3.97)


def test_time_calls_passes_the_index_and_pauses_the_collector() -> None:
    seen: list[tuple[int, bool]] = []
    times = stats.time_calls(lambda i: seen.append((i, gc.isenabled())), 4)
    assert seen == [(0, False), (1, False), (2, False), (3, False)]
    assert len(times) == 4 and all(isinstance(t, int) and t >= 0 for t in times)
    assert gc.isenabled()


def test_stats_loads_from_its_file_without_the_package(tmp_path: Path) -> None:
    # benchmarks/vllm_replay.py loads it this way in an interpreter without jenga-vmm;
    # -S (no site-packages) and a foreign cwd: neither vmm nor torch is importable
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('s', {stats.__file__!r})\n"
        "m = importlib.util.module_from_spec(spec); sys.modules['s'] = m\n"
        "spec.loader.exec_module(m)\n"
        "print(m.Summary.of([3, 1, 2]).p50, len(m.time_calls(lambda i: None, 5)),"
        " sorted(n for n in sys.modules if n.split('.')[0] in ('vmm', 'torch')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-S", "-c", code], capture_output=True, text=True, cwd=tmp_path
    )
    assert (out.returncode, out.stdout.strip()) == (0, "2.0 5 []"), out.stderr


def _result(op: str, ours: float, raw: float, **kw: object) -> OpResult:
    fields: dict = {"backend": "host", "chunk_size": 2 << 20, "num_chunks": 1000,
                    "mode": "batched", "layout": "scattered"} | kw  # fmt: skip
    return OpResult(op=op, ours=Summary.of([ours]), raw=Summary.of([raw]), **fields)


def test_bars_pass_and_fail_on_the_numbers() -> None:
    report = Report(args={"backend": "host"})
    report.results = [
        _result("apply_plan", 1250.0, 1000.0),
        _result("map", 1900.0, 1000.0, mode="one_by_one", layout="contiguous"),
        _result("tensor_view", 2100.0, 900.0, mode="one_by_one", layout="-", num_chunks=1),
    ]
    bars = {b.name: b for b in bench.check_bars(report, "host")}
    plan = bars["host 2 MiB batched apply of 1,000 maps"]
    assert (plan.value, plan.passed) == (1.25, False)
    single = bars["single map from Python"]
    assert (single.value, single.passed) == (1.9, True)
    view = bars["host tensor view creation"]
    assert (view.value, view.passed) == (2.1, False)
    report.bars = list(bars.values())
    assert not report.passed
    assert Bar("x", 1.2, 1.2, "x raw", "").passed  # the limit itself passes


def test_cuda_overhead_bars_pass_and_fail_on_the_numbers() -> None:
    """One-by-one CUDA ops: ours - raw <= 3 µs; free_reservation <= 1.2x raw, or raw + 3 µs
    where the raw call is short; a tensor view <= 1.5 µs over the bare capsule."""
    one = {"backend": "cuda", "mode": "one_by_one", "layout": "-"}
    report = Report(args={"backend": "cuda"})
    report.results = [
        _result("map", 8_000.0, 5_000.0, **one),  # 3 µs over: the limit passes
        _result("unmap", 6_100.0, 3_000.0, **one),  # 3.1 µs over
        _result("free_reservation", 36_000.0, 29_500.0, **one),  # 1.22x of a long call
        _result("free_reservation", 7_900.0, 5_000.0, chunk_size=8 << 20, **one),  # +2.9 µs
        _result("tensor_view", 2_300.0, 770.0, **one | {"num_chunks": 1}),  # 1.53 µs over
        _result("map", 90_000.0, 5_000.0, backend="cuda"),  # batched: no overhead bar
    ]
    bars = {b.name: b for b in bench.check_bars(report, "cuda")}
    assert bars["cuda map 2M one-by-one overhead"].passed
    assert not bars["cuda unmap 2M one-by-one overhead"].passed
    long_free = bars["cuda free_reservation 2M"]
    assert (long_free.limit, long_free.passed) == (1.2, False)
    assert bars["cuda free_reservation 8M"].passed  # 1.58x, within raw + 3 µs
    assert not bars["cuda tensor view overhead"].passed
    assert not bars["cuda tensor view creation"].passed
    assert len(bars) == 6


# ---- the raw baselines ------------------------------------------------------------------
def test_raw_host_cycle_times_every_call() -> None:
    order = chunk_order("scattered", 5)
    assert order == [0, 2, 4, 6, 8]
    times = raw.raw_host_cycle(64 << 10, order)
    assert {op: len(v) for op, v in times.items()} == {
        "pool": 1, "create": 5, "reserve": 1, "map": 5, "unmap": 5, "release": 5,
        "free_reservation": 1,
    }  # fmt: skip
    assert all(t > 0 for v in times.values() for t in v)


def test_raw_host_cycle_rejects_bad_orders() -> None:
    with pytest.raises(ValueError, match="twice"):
        raw.raw_host_cycle(64 << 10, [0, 1, 1])
    with pytest.raises(ValueError, match="negative"):
        raw.raw_host_cycle(64 << 10, [-1, 0])
    with pytest.raises(ValueError, match="empty"):
        raw.raw_host_cycle(64 << 10, [])


def test_raw_host_map_rounds_counts() -> None:
    times = raw.raw_host_map_rounds(64 << 10, [3, 1, 0], 4)
    assert {op: len(v) for op, v in times.items()} == {"map": 12, "unmap": 12}


def test_raw_view_capsule_is_zero_copy() -> None:
    import torch

    buf = ctypes.create_string_buffer(32)
    t = torch.from_dlpack(raw.raw_view_capsule(ctypes.addressof(buf), 32))
    assert (t.shape, t.dtype, t.device.type) == ((32,), torch.uint8, "cpu")
    t[3] = 7
    assert buf.raw[3] == 7


def test_docs_exist() -> None:
    doc = Path(__file__).resolve().parents[2] / "docs" / "vmm-bench.md"
    assert "vmm-bench --quick" in doc.read_text()


def test_max_mib_cuts_counts_to_fit() -> None:
    argv = ["--chunk-sizes", "2M", "--counts", "10", "--max-mib", "8"]
    args = bench.resolve_args(bench.build_parser().parse_args(argv))
    cases = bench.cases_of(args, "host")
    got = [(c.mode, c.layout, c.num_chunks, life and life.num_chunks) for c, life in cases]
    assert got == [
        ("one_by_one", "contiguous", 4, 4),  # 8 MiB / 2 MiB
        ("one_by_one", "scattered", 2, None),  # two chunks held per slot
        ("batched", "contiguous", 4, 4),
        ("batched", "scattered", 2, None),
    ]
