#!/usr/bin/env bash
# Installs a real vLLM VERSION (0.32.0 or 0.33.0) into DIR on a machine without a GPU: enough to
# import and drive vLLM's own v1 Scheduler and KV-cache manager (no kernels, no model execution).
# vLLM is installed with --no-deps and then only the runtime packages its scheduler, config and
# core tests import, at the bounds its wheel metadata (Requires-Dist) gives for that version.
#   0.32.0 pins torch==2.13.0: the CPU wheel these machines hold locally (~2.1 GB venv).
#   0.33.0 pins torch==2.14.0: only its CUDA build exists; pip takes torch and most NVIDIA
#          libraries from local disk (~5.7 GB venv, a few minutes). vLLM's scheduler runs on CPU.
# Usage: bash tools/vllm-venv.sh VERSION DIR
# Known: pip prints "vllm requires X, which is not installed" for the GPU-only packages: harmless.
set -euo pipefail
VERSION=${1:?usage: vllm-venv.sh VERSION DIR}
DIR=${2:?usage: vllm-venv.sh VERSION DIR}
case "$VERSION" in
  0.32.0) TORCH=2.13.0; AIOHTTP=3.14.3; PILLOW=12.3.0; TRANSFORMERS="<5.20.0" ;;
  0.33.0) TORCH=2.14.0; AIOHTTP=3.14.4; PILLOW=13.0.0; TRANSFORMERS="<5.21.0" ;;
  *) echo "vllm-venv.sh: unsupported vLLM version $VERSION (supported: 0.32.0, 0.33.0)" >&2; exit 2 ;;
esac
python3 -m venv "$DIR"
PIP=("$DIR/bin/python" -m pip)
"${PIP[@]}" install -q --upgrade pip
# torch without triton (~0.9 GB): vLLM disables triton on a machine without a GPU anyway
# (vllm.triton_utils.HAS_TRITON is False here), and nothing the scheduler runs compiles kernels.
"${PIP[@]}" install -q --no-deps "torch==$TORCH"
mapfile -t TORCH_DEPS < <("$DIR/bin/python" -c "
from importlib.metadata import requires
for r in requires('torch') or []:
    if not r.startswith('triton') and 'extra ==' not in r:
        print(r)")
"${PIP[@]}" install -q "${TORCH_DEPS[@]}"
"${PIP[@]}" install -q --no-deps "vllm==$VERSION"
"${PIP[@]}" install -q numpy psutil regex "pyzmq>=25.0.0" "transformers>=5.16.1,$TRANSFORMERS" \
  "tokenizers>=0.23.2" "huggingface_hub>=1.31.0" "aiohttp>=$AIOHTTP" "requests>=2.33.0" \
  "openai>=2.25.0" "oss-harmony>=0.0.11" "pillow>=$PILLOW" pybase64 cachetools \
  "prometheus_client>=0.18.0" msgspec cloudpickle uvloop py-cpuinfo "fastapi>=0.133.0,<0.137.0" \
  "starlette>=1.0.1" partial-json-parser "llguidance>=1.7.0,<1.8.0" einops "pydantic>=2.12.0" cbor2 \
  pyyaml "apache-tvm-ffi==0.1.11" "typing_extensions>=4.10" blake3 httpx "pytest>=8" pytest-timeout \
  "scikit-build-core>=0.10" "pybind11>=2.13"
"${PIP[@]}" install -q --no-deps "xgrammar==0.2.8"
"$DIR/bin/python" -c "from vllm.v1.core.sched.scheduler import Scheduler; import vllm; print('vllm', vllm.__version__, 'scheduler importable')"
