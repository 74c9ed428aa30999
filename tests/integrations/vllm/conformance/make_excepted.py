"""Drafts ``excepted-<version>.txt`` from the last conformance results and ``reasons.txt``.

Every test that passes on vLLM and fails on jenga gets the first reason whose pattern
matches its failure text; tests no reason matches are left out (they stay unexplained).
Review the draft before committing it: a reason is a claim about why the test fails.
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
    for test in sorted(vllm):
        if vllm[test]["outcome"] != "passed" or jenga.get(test, {}).get("outcome") != "failed":
            continue
        for name, pattern in reasons:
            if pattern.search(jenga[test]["error"]):
                lines.append(f"{test} {name}")
                break
    (HERE / f"excepted-{version}.txt").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
