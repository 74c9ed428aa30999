"""Runs vLLM's own ``tests/v1/core`` on vLLM's manager and on ours; prints one line.

Rationale
    Our manager claims to be a drop-in for vLLM's `KVCacheManager`; vLLM's own core tests
    are the strictest check of that claim we can run without editing them. Tests that
    cannot pass on a different manager (they read vLLM's internals) or that use a feature
    we refuse are listed, each with its reason, in ``excepted-<version>.txt`` beside this
    file; the failure text must match the reason's pattern, so an excepted test that
    starts failing for another reason counts as unexplained.

Approach
    1. The tests come from the version's source distribution: ``pip download`` with
       ``VLLM_TARGET_DEVICE=empty --no-clean`` unpacks it and then fails at the metadata
       step (it needs Rust); the unpacked tree stays in the build directory the log
       names. ``tests/v1/core`` and the ``tests.*`` modules it imports (transitively) are
       copied to ``.conformance/vllm-<version>/`` (ignored by git) with a ``pytest.ini``
       holding vLLM's markers; later runs reuse that copy.
    2. pytest runs twice there with ``jenga_conformance_plugin`` (``vllm``, ``jenga``).
    3. a = passed on vLLM, b = passed on jenga, c = passed on vLLM, failed on jenga and
       excepted with a matching failure, d = the other tests that pass on vLLM only.

Limitations
    Run with the interpreter of the vLLM venv (``make test-vllm-conformance``). The
    unexplained tests are all printed and counted in d; ``unexplained-<version>.txt``
    lists those known today (bugs not yet fixed), so the exit status is 1 only for a
    new unexplained failure (a regression), a run that did not finish, or a stale entry
    (an excepted or known test that now passes on jenga, or no longer on vLLM).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[3]
MARKERS = (
    "slow_test",
    "skip_global_cleanup",
    "core_model",
    "hybrid_model",
    "cpu_model",
    "cpu_test",
    "split",
    "distributed",
    "optional",
)
IMPORT_RE = re.compile(r"^\s*(?:from|import)\s+(tests(?:\.\w+)+)", re.MULTILINE)


def fetch_tests(version: str, cache: Path) -> Path:
    """``cache`` holding vLLM's ``tests/v1/core`` of ``version`` (downloaded once)."""
    if (cache / "pytest.ini").exists():
        return cache
    with tempfile.TemporaryDirectory(prefix="vllm-sdist-") as tmp:
        log = Path(tmp) / "pip.log"
        env = dict(os.environ, VLLM_TARGET_DEVICE="empty")
        cmd = [sys.executable, "-m", "pip", "download", "-v", "--no-clean", "--no-deps"]
        cmd += ["--no-binary", ":all:", "--no-build-isolation", f"vllm=={version}", "-d", tmp]
        with log.open("w") as out:
            subprocess.run(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, check=False)
        text = log.read_text()
        found = re.findall(r"cwd: (\S*pip-download-\S+?/vllm_\w+)", text)
        if not found or not (Path(found[0]) / "tests" / "v1" / "core").is_dir():
            sys.exit(
                f"conformance: no unpacked vLLM {version} source tree in the pip log:\n"
                + text[-3000:]
            )
        source = Path(found[0])
        try:
            _copy_core_tests(source, cache)
        finally:
            shutil.rmtree(source.parent, ignore_errors=True)
    return cache


def _copy_core_tests(source: Path, cache: Path) -> None:
    """Copy tests/v1/core and, transitively, the ``tests.*`` modules it imports."""
    tmp = cache.with_name(cache.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(source / "tests" / "v1" / "core", tmp / "tests" / "v1" / "core")
    todo = list((tmp / "tests").rglob("*.py"))
    while todo:
        for module in IMPORT_RE.findall(todo.pop().read_text()):
            parts = module.split(".")
            for n in range(1, len(parts) + 1):
                for rel in (Path(*parts[:n], "__init__.py"), Path(*parts[:n]).with_suffix(".py")):
                    if (source / rel).is_file() and not (tmp / rel).exists():
                        (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
                        shutil.copy2(source / rel, tmp / rel)
                        todo.append(tmp / rel)
    markers = "".join(f"\n    {m}" for m in MARKERS)
    (tmp / "pytest.ini").write_text(f"[pytest]\nmarkers ={markers}\n")
    shutil.rmtree(cache, ignore_errors=True)
    tmp.rename(cache)


def hub_cache(root: Path) -> Path:
    """An offline Hugging Face cache holding the model configs vLLM's tests name.

    vLLM's own CI downloads them; here each is the model's published ``config.json``
    (architecture only: the scheduler never loads weights or a tokenizer in these tests),
    kept beside this file under ``models/ORG--NAME``.
    """
    revision = "0" * 40
    for folder in sorted((HERE / "models").iterdir()):
        repo = root / "hub" / f"models--{folder.name}"
        snapshot = repo / "snapshots" / revision
        snapshot.mkdir(parents=True, exist_ok=True)
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / "main").write_text(revision)
        for file in folder.iterdir():
            shutil.copy2(file, snapshot / file.name)
    return root


def run_pytest(cache: Path, manager: str, extra: list[str]) -> dict[str, dict[str, str]]:
    out = cache / f"results-{manager}.json"
    out.unlink(missing_ok=True)
    env = dict(os.environ)
    # no network: the model configs come from `hub_cache`; no GPU: vLLM's CPU platform
    env.update(HF_HOME=str(hub_cache(cache / "hf")), HF_HUB_OFFLINE="1")
    env.update(TRANSFORMERS_OFFLINE="1", VLLM_TARGET_DEVICE="cpu")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), str(ROOT), env.get("PYTHONPATH")]))
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "--continue-on-collection-errors",
        "-p",
        "jenga_conformance_plugin",
        f"--conformance-manager={manager}",
        f"--conformance-out={out}",
        "--tb=short",
        "tests/v1/core",
        *extra,
    ]
    if importlib.util.find_spec("pytest_timeout") is not None:
        cmd.append("--timeout=300")  # a hung test fails instead of stalling CI
    print(f"conformance: {manager}: {' '.join(cmd[1:])}", flush=True)
    subprocess.run(cmd, cwd=cache, env=env, check=False)
    if not out.exists():
        sys.exit(f"conformance: the {manager} run wrote no results ({out})")
    results: dict[str, dict[str, str]] = json.loads(out.read_text())
    return results


@dataclass(frozen=True)
class Reason:
    name: str
    pattern: re.Pattern[str]
    text: str


def load_excepted(path: Path) -> tuple[dict[str, Reason], dict[str, Reason]]:
    """(reasons by name, reason by test id) from ``excepted-<version>.txt``.

    ``[name] REGEX :: reason`` defines a reason; ``TEST_ID name`` excepts a test.
    """
    reasons: dict[str, Reason] = {}
    tests: dict[str, Reason] = {}
    if not path.exists():
        return reasons, tests
    for n, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("["):
            name, _, rest = line[1:].partition("]")
            regex, _, text = rest.partition("::")
            reasons[name] = Reason(name, re.compile(regex.strip(), re.DOTALL), text.strip())
            continue
        test_id, _, name = line.rpartition(" ")
        if name not in reasons:
            sys.exit(f"{path}:{n}: reason {name!r} is not defined above its first use")
        tests[test_id.strip()] = reasons[name]
    return reasons, tests


def load_known(path: Path) -> set[str]:
    """Test ids of ``unexplained-<version>.txt``: failures not yet fixed or explained."""
    if not path.exists():
        return set()
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return {line for line in lines if line}


def compare(
    version: str, vllm: dict, jenga: dict, excepted: dict[str, Reason], known: set[str]
) -> int:
    passed_vllm = {t for t, r in vllm.items() if r["outcome"] == "passed"}
    passed_jenga = {t for t, r in jenga.items() if r["outcome"] == "passed"}
    counts: dict[str, int] = {}
    unexplained: list[str] = []
    for test in sorted(passed_vllm - passed_jenga):
        got = jenga.get(test, {"outcome": "missing", "error": ""})
        reason = excepted.get(test)
        if (
            reason is not None
            and got["outcome"] == "failed"
            and reason.pattern.search(got["error"])
        ):
            counts[reason.name] = counts.get(reason.name, 0) + 1
            continue
        why = (
            "not excepted" if reason is None else f"excepted as {reason.name}, but failed otherwise"
        )
        unexplained.append(f"  {test} [{got['outcome']}; {why}]: {got['error'][-300:]!r}")
    stale = sorted(t for t in excepted if t in passed_jenga or t not in passed_vllm)
    stale += sorted(t for t in known if t in passed_jenga or t not in passed_vllm)
    new = [line for line in unexplained if line.split(" [", 1)[0].strip() not in known]
    c = sum(counts.values())
    print("\n".join(unexplained))
    print(f"  {len(new)} unexplained failures are not in unexplained-{version}.txt (regressions)")
    for name, count in sorted(counts.items()):
        print(f"  excepted {name}: {count}")
    for test in stale:
        print(f"  stale excepted entry (passes on jenga or not on vllm): {test}")
    built = sum(1 for t in passed_jenga if jenga[t].get("built"))
    print(f"  {built} of the tests passing on jenga built a jenga manager or scheduler")
    print(
        f"conformance {version}: {len(passed_vllm)} pass on vllm, {len(passed_jenga)} pass "
        f"on jenga, {c} excepted, {len(unexplained)} unexplained"
    )
    return 1 if new or stale else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("version")
    parser.add_argument("--cache", type=Path, default=None)
    parser.add_argument(
        "--reuse",
        choices=("vllm", "jenga", "all"),
        help="reuse the last results of one run (vllm, jenga) or of both (all)",
    )
    parser.add_argument("pytest_args", nargs="*")
    args = parser.parse_args()
    import vllm

    if vllm.__version__.split("+")[0] != args.version:
        sys.exit(f"conformance: this interpreter has vLLM {vllm.__version__}, not {args.version}")
    cache = fetch_tests(args.version, args.cache or ROOT / ".conformance" / f"vllm-{args.version}")
    results = {}
    for manager in ("vllm", "jenga"):
        saved = cache / f"results-{manager}.json"
        if args.reuse in (manager, "all") and saved.exists():
            results[manager] = json.loads(saved.read_text())
        else:
            results[manager] = run_pytest(cache, manager, args.pytest_args)
    _, excepted = load_excepted(HERE / f"excepted-{args.version}.txt")
    known = load_known(HERE / f"unexplained-{args.version}.txt")
    return compare(args.version, results["vllm"], results["jenga"], excepted, known)


if __name__ == "__main__":
    sys.exit(main())
