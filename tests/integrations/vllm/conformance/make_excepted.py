"""Drafts ``excepted-<version>.txt`` from the last conformance results and ``reasons.txt``.

Every test that passes on vLLM and fails on jenga gets the first reason whose pattern
matches its failure text; the tests no reason matches go to ``unexplained-<version>.txt``
with their error (they stay unexplained, counted in d: bugs to fix, not reasons).
Review the drafts before committing them: a reason is a claim about why the test fails.
Usage: python make_excepted.py VERSION  (after ``make test-vllm-conformance VLLM=VERSION``)
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> None:
    version = sys.argv[1]
    cache = HERE.parents[3] / ".conformance" / f"vllm-{version}"
    vllm = json.loads((cache / "results-vllm.json").read_text())
    jenga = json.loads((cache / "results-jenga.json").read_text())
    header = (HERE / "reasons.txt").read_text()
    reasons = []
    for line in header.splitlines():
        if line.startswith("["):
            name, _, rest = line[1:].partition("]")
            reasons.append((name, re.compile(rest.partition("::")[0].strip(), re.DOTALL)))
    lines = [f"# vLLM {version}: tests/v1/core tests that pass on vLLM's manager and fail on ours"]
    lines += ["# for a reason below (drafted by make_excepted.py, reviewed).", header]
    unexplained = [f"# vLLM {version}: pass on vLLM, fail on jenga, no reason (counted in d)"]
    for test in sorted(vllm):
        got = jenga.get(test, {"outcome": "missing", "error": ""})
        if vllm[test]["outcome"] != "passed" or got["outcome"] == "passed":
            continue
        name = next((n for n, p in reasons if p.search(got["error"])), None)
        if name is not None and got["outcome"] == "failed":
            lines.append(f"{test} {name}")
        else:
            first = (got["error"].splitlines() or [got["outcome"]])[0][:120]
            unexplained.append(f"{test}  # {first}")
    (HERE / f"excepted-{version}.txt").write_text("\n".join(lines) + "\n")
    (HERE / f"unexplained-{version}.txt").write_text("\n".join(unexplained) + "\n")


if __name__ == "__main__":
    main()
