"""Every GPU check of jenga-vmm in one run, written up as one results file.

Usage (from the repository root; `make test-gpu` runs it)::

    python3 tools/gpu_check.py [--backend cuda|host] [--out PATH] [--device N]

Parts, each PASS / FAIL / SKIP with its reason and figures:

    pytest        every `cuda`- or `gpu`-marked test (cuda: on the device, leak-checked)
    vmm-bench     `python -m vmm.bench --backend B --quick` (cuda: with `--check`): its table
    kvcache       a KVCache over a ChunkPool on the backend: writes read back, every
                  chunk unmapped after the requests are freed
    hf-cache      `generate` with a VmmCache on the backend vs transformers' own cache,
                  tiny random Llama / Mistral (sliding window) / Jamba (Mamba states) /
                  DeepSeek-V3 (multi-head latent attention: one latent per token)
    engine        the mini engine (``attention='sdpa'`` and ``'flash'``) vs per-request
                  `generate`, tiny random Mistral

The HF parts skip, with the reason, when transformers is missing or older than the
oldest supported release. On ``--backend host`` the models run on the CPU and the pools
on the host backend (CI runs it so the script cannot rot); ``--backend cuda`` needs
torch with CUDA and cuda-bindings. Exit status 1 when a part failed. Default output:
docs/results/gpu-DATE.md (cuda), build/gpu-check/host.md (host).
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.metadata
import platform
import shlex
import subprocess
import sys
import time
import traceback
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


@dataclass
class Part:
    name: str
    status: str = "PASS"  # PASS | FAIL | SKIP
    lines: list[str] = field(default_factory=list)
    seconds: float = 0.0


class Skip(Exception):
    """The part cannot run here; the message is the reason."""


# ---- environment -----------------------------------------------------------------------
def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def machine(backend: str, device: int) -> list[tuple[str, str]]:
    import torch

    rows = [
        ("date (UTC)", dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M")),
        ("host", f"{platform.node()} ({platform.machine()}, {platform.system()})"),
        ("python", sys.version.split()[0]),
        ("torch", f"{torch.__version__} (CUDA build {torch.version.cuda})"),
        ("cuda-bindings", _version("cuda-bindings")),
        ("transformers", _version("transformers")),
        ("flash-attn", _version("flash-attn")),
        ("backend", backend),
    ]
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(device)
        free, total = torch.cuda.mem_get_info(device)
        rows.append(("GPU", f"{props.name}, {total >> 20} MiB ({free >> 20} MiB free)"))
        rows.append(("driver", _driver_version()))
    else:
        rows.append(("GPU", "none (torch sees no CUDA device)"))
    return rows


def _driver_version() -> str:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30, check=True,
        )  # fmt: skip
        return out.stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return "unknown (nvidia-smi unavailable)"


def device_of(backend: str, device: int) -> Any:
    import torch

    return torch.device(f"cuda:{device}") if backend == "cuda" else torch.device("cpu")


def make_pool(backend: str, device: int, budget: int, chunk: int) -> Any:
    """A ChunkPool on the backend: CUDA chunks are the device's granularity (2 MiB)."""
    import vmm

    if backend == "cuda":
        from vmm.cuda import CudaBackend

        return vmm.ChunkPool(CudaBackend(device), budget)
    return vmm.ChunkPool(vmm.get_backend("host", granularity=chunk), budget)


def hf_skip_reason() -> str | None:
    try:
        from integrations.hf.compat import unsupported_reason
    except ImportError as exc:
        return f"transformers cannot be imported ({exc})"
    return unsupported_reason()


# ---- parts -------------------------------------------------------------------------------
PYTEST_TIMEOUT_S = 240  # the whole check is meant to take under 5 minutes on a GPU
BENCH_TIMEOUT_S = 180


def _run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    """`cmd` from the repository root; a run past `timeout` seconds is killed and reported
    as exit status 124 with what it printed."""
    try:
        return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
        err = exc.stderr.decode() if isinstance(exc.stderr, bytes) else exc.stderr or ""
        note = f"killed after {timeout} s"
        return subprocess.CompletedProcess(cmd, 124, out + "\n" + note, err + "\n" + note)


def part_pytest(args: argparse.Namespace, part: Part) -> None:
    junit = Path(args.work) / "pytest.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m",
           "cuda or gpu", f"--junitxml={junit}", "tests"]  # fmt: skip
    proc = _run(cmd, PYTEST_TIMEOUT_S)
    counts, failed, lost = _junit_summary(junit)
    summary = ", ".join(f"{v} {k}" for k, v in counts.items())
    part.lines.append(f"`python {shlex.join(cmd[1:])}`: {summary}")
    if lost:
        worst = max(lost, key=lambda kv: kv[1])
        part.lines.append(
            f"leak check: device free memory after each test within {worst[1] >> 10} KiB "
            f"of its start (largest: {worst[0]})"
        )
    for name in failed:
        part.lines.append(f"failed: {name}")
    if proc.returncode not in (0, 5) or failed:
        part.status = "FAIL"
        part.lines.extend(["```", *proc.stdout.strip().splitlines()[-30:], "```"])
    elif counts.get("passed", 0) == 0:
        part.status = "SKIP"
        part.lines.append("no test ran: every cuda test skips without a GPU")


def _junit_summary(path: Path) -> tuple[dict[str, int], list[str], list[tuple[str, int]]]:
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    failed: list[str] = []
    lost: list[tuple[str, int]] = []
    if not path.exists():
        return counts, ["pytest wrote no report"], lost
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        if case.find("failure") is not None or case.find("error") is not None:
            counts["failed"] += 1
            failed.append(name)
        elif case.find("skipped") is not None:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
        for prop in case.iter("property"):
            if prop.get("name") == "gpu_free_bytes_lost":
                lost.append((name, int(prop.get("value", "0"))))
    return counts, failed, lost


def part_bench(args: argparse.Namespace, part: Part) -> None:
    report = Path(args.work) / "vmm-bench.json"
    cmd = [sys.executable, "-m", "vmm.bench", "--backend", args.backend, "--quick",
           "--no-progress", "--json", str(report)]  # fmt: skip
    if args.backend == "cuda":  # the bars are GPU figures; a shared CI core would flake them
        cmd.append("--check")
    proc = _run(cmd, BENCH_TIMEOUT_S)
    part.lines.append(f"`vmm-bench {shlex.join(cmd[3:])}` exit {proc.returncode}")
    part.lines.extend(["```", *proc.stdout.rstrip().splitlines()[-60:], "```"])
    if proc.returncode != 0:
        part.status = "FAIL"
        part.lines.extend(["```", *proc.stderr.strip().splitlines()[-20:], "```"])


def part_kvcache(args: argparse.Namespace, part: Part) -> None:
    import torch
    from integrations.kvcache.access import read_kv, token_slots, write_kv
    from jenga.specs import Kind, KVGroup, LayerSpec, ModelSpec

    from integrations.kvcache import KVCache, KVCacheConfig

    layer = LayerSpec(Kind.FULL, num_kv_heads=8, head_dim=128, dtype_bytes=2, block_size=16)
    window = LayerSpec(Kind.SLIDING_WINDOW, num_kv_heads=8, head_dim=128, dtype_bytes=2,
                       block_size=16, window=64)  # fmt: skip
    groups = (KVGroup("full", layer, (0, 2)), KVGroup("sliding", window, (1, 3)))
    spec = ModelSpec("gpu-check", groups, max_model_len=4096)
    pool = make_pool(args.backend, args.device, 256 << 20, 64 << 10)
    kv = KVCache(spec, pool, KVCacheConfig(dtype=torch.float16))
    try:
        dev = device_of(args.backend, args.device)
        gen = torch.Generator(device=dev).manual_seed(0)
        start = time.perf_counter()
        for rid, n in (("a", 1000), ("b", 333)):
            kv.add_request(rid, list(range(n)), use_cache=False)
            assert kv.allocate(rid, n) is not None, f"request {rid}: no room for {n} tokens"
            for lay in (0, 2):
                slots = token_slots(kv, rid, 0, 0, n)
                k, v = (torch.randn((n, 8, 128), generator=gen, device=dev).half() for _ in "kv")
                write_kv(kv, lay, slots, k, v)
                got_k, got_v = read_kv(kv, lay, slots)
                assert torch.equal(got_k, k) and torch.equal(got_v, v), f"{rid} layer {lay}"
        mapped = pool.num_mapped
        kv.check_invariants(expensive=True)
        for rid in ("a", "b"):
            kv.free(rid)
        elapsed = time.perf_counter() - start
        assert pool.num_mapped == 0, f"{pool.num_mapped} chunks still mapped after free"
        part.lines.append(
            f"2 requests (1000 + 333 tokens, fp16, 4 layers): {mapped} chunks of "
            f"{pool.backend.granularity >> 10} KiB mapped, K/V read back equal, all unmapped "
            f"after free; {elapsed * 1e3:.0f} ms"
        )
    finally:
        kv.close()
        pool.close()


HF_FAMILIES = ("llama", "mistral", "jamba", "deepseek_v3")


def part_hf_cache(args: argparse.Namespace, part: Part) -> None:
    reason = hf_skip_reason()
    if reason is not None:
        raise Skip(reason)
    import torch
    from tests.integrations.hf.families import CHECKPOINT, text_inputs, tiny_model

    from integrations.hf import VmmCache, cache_kwargs

    dev = device_of(args.backend, args.device)
    gen = {"max_new_tokens": 12, "min_new_tokens": 12, "do_sample": False,
           "output_logits": True, "return_dict_in_generate": True}  # fmt: skip
    for name in HF_FAMILIES:
        model = tiny_model(name, torch.float32).to(dev)
        inputs = {k: v.to(dev) for k, v in text_inputs(2).items()}
        ref = model.generate(**inputs, **gen)
        pool = make_pool(args.backend, args.device, 64 << 21, 4096)
        cache = VmmCache(model.config, pool=pool, block_size=4, checkpoint_interval=CHECKPOINT)
        start = time.perf_counter()
        ours = model.generate(**inputs, **gen, **cache_kwargs(cache))
        elapsed = time.perf_counter() - start
        diff = (torch.stack(ours.logits) - torch.stack(ref.logits)).abs().max().item()
        same = torch.equal(ours.sequences, ref.sequences)
        part.lines.append(
            f"{name}: batch 2 (one row left-padded), 11 + 12 tokens: tokens "
            f"{'equal' if same else 'DIFFER'}, max |logit diff| {diff:.3g}, "
            f"{cache.kv.pool.num_mapped} chunks mapped, {elapsed:.2f} s"
        )
        cache.close()
        pool.close()
        if not same or diff > 1e-4:
            part.status = "FAIL"


def part_engine(args: argparse.Namespace, part: Part) -> None:
    reason = hf_skip_reason()
    if reason is not None:
        raise Skip(reason)
    import torch
    from tests.integrations.engine.test_engine import reference, tiny, workload

    from integrations.engine import EngineConfig, MiniEngine

    dev = device_of(args.backend, args.device)
    dtype = torch.float16 if args.backend == "cuda" else torch.float32
    model = tiny("mistral").to(dev, dtype)
    requests = workload(num=4, new_tokens=8)
    ref = reference(model, requests)
    chunk, block = (2 << 20, 256) if args.backend == "cuda" else (4096, 4)
    for attention in ("sdpa", "flash"):
        config = EngineConfig(
            token_budget=512, budget_bytes=64 * chunk, chunk_bytes=chunk, block_size=block,
            backend=args.backend, attention=attention,
        )  # fmt: skip
        engine = MiniEngine(model, config)
        for rid, prompt, n, arrival in requests:
            engine.add_request(rid, prompt, n, arrival_step=arrival)
        start = time.perf_counter()
        outputs = engine.run()
        elapsed = time.perf_counter() - start
        kernel = getattr(engine.forward, "flash_kernel", None) or "model forward (SDPA)"
        tokens = sum(len(v) for v in outputs.values())
        same = outputs == ref
        part.lines.append(
            f"attention={attention!r} ({kernel}), {str(dtype)[6:]}: 4 requests x 8 tokens "
            f"{'equal to' if same else 'DIFFER from'} generate; {engine.step_index} steps, "
            f"{tokens / elapsed:.0f} tokens/s"
        )
        engine.close()
        if not same:
            part.status = "FAIL"


PARTS: tuple[tuple[str, Callable[[argparse.Namespace, Part], None]], ...] = (
    ("pytest (cuda/gpu tests)", part_pytest),
    ("vmm-bench", part_bench),
    ("kvcache", part_kvcache),
    ("hf-cache", part_hf_cache),
    ("engine", part_engine),
)


def run_part(name: str, fn: Callable[[argparse.Namespace, Part], None], args: Any) -> Part:
    part = Part(name)
    start = time.perf_counter()
    try:
        fn(args, part)
    except Skip as exc:
        part.status = "SKIP"
        part.lines.append(f"skipped: {exc}")
    except Exception:
        part.status = "FAIL"
        part.lines.extend(["```", *traceback.format_exc().strip().splitlines()[-25:], "```"])
    part.seconds = time.perf_counter() - start
    print(f"gpu-check: {name}: {part.status} ({part.seconds:.1f} s)", flush=True)
    return part


def render(args: argparse.Namespace, rows: list[tuple[str, str]], parts: list[Part]) -> str:
    total = sum(p.seconds for p in parts)
    out = [f"# GPU check ({args.backend} backend), {rows[0][1]} UTC", "",
           f"Command: `{args.command}` ({total:.0f} s)", "", "| | |", "| --- | --- |"]  # fmt: skip
    out += [f"| {k} | {v} |" for k, v in rows]
    out += ["", "| part | result | seconds |", "| --- | --- | --- |"]
    out += [f"| {p.name} | {p.status} | {p.seconds:.1f} |" for p in parts]
    for p in parts:
        out += ["", f"## {p.name}: {p.status}", "", *p.lines]
    return "\n".join(out) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="gpu_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", choices=("cuda", "host"), default="cuda")
    p.add_argument("--out", help="results file (default: docs/results/gpu-DATE.md on cuda, "
                   "build/gpu-check/host.md on host)")  # fmt: skip
    p.add_argument("--device", type=int, default=0, help="CUDA device ordinal")
    p.add_argument("--only", help="comma list of parts to run (default: all)")
    args = p.parse_args(argv)
    if args.out is None:
        day = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d")
        args.out = (
            f"docs/results/gpu-{day}.md" if args.backend == "cuda" else "build/gpu-check/host.md"
        )
    args.work = str(ROOT / "build" / "gpu-check" / args.backend)
    args.command = " ".join(
        ["python3 tools/gpu_check.py", *(argv if argv is not None else sys.argv[1:])]
    )
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    Path(args.work).mkdir(parents=True, exist_ok=True)
    if args.backend == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("gpu-check: torch sees no CUDA device (use --backend host)", file=sys.stderr)
            return 2
    wanted = set(args.only.split(",")) if args.only else None
    parts = [
        run_part(name, fn, args)
        for name, fn in PARTS
        if wanted is None or name.split()[0] in wanted
    ]
    out = Path(args.out) if Path(args.out).is_absolute() else ROOT / args.out
    if out.is_dir():  # `OUT` named a folder (a lent machine's output folder, say)
        out = out / f"gpu-{dt.datetime.now(dt.UTC).strftime('%Y-%m-%d')}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render(args, machine(args.backend, args.device), parts))
    failed = [p.name for p in parts if p.status == "FAIL"]
    print(
        f"gpu-check: wrote {out}; " + (f"FAILED: {', '.join(failed)}" if failed else "no failure")
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
