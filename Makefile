# Every target sets up what it needs: a fresh clone runs `make run` or `make test` directly.
VENV    ?= .venv
PY      := $(VENV)/bin/python
PIP     := $(PY) -m pip
STAMP   := $(VENV)/.jenga-vmm-installed
SOURCES := $(shell find csrc -name '*.cpp' -o -name '*.hpp' 2>/dev/null) CMakeLists.txt
# C/C++ under clang-format: the extension and the test suite's CUDA driver emulator
CLANG_SOURCES := $(shell find csrc tests/vmm/cuda_emulator -name '*.cpp' -o -name '*.hpp' \
                   -o -name '*.c' -o -name '*.h' 2>/dev/null)

.PHONY: release-check run test lint format build stubs stubs-check clean test-vllm vllm-sweep test-vllm-conformance vllm-venv test-cuda-emulated cuda-emulator test-asan test-hf-oldest hf-venv test-gpu

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch 2.13.0 is the local CPU wheel; installing it first stops pip from fetching a CUDA build.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q "scikit-build-core>=0.10" "pybind11>=2.13"
	$(PIP) install -q --no-build-isolation -e '.[dev]'
	touch $(STAMP)

# Incremental rebuild of the C++ module (build/ keeps the CMake tree between runs).
build: $(STAMP)
	@$(PIP) install -q --no-build-isolation --no-deps -e . 2>&1 | grep -v "^$$" || true
	@$(PY) -c "import vmm._core, jenga._core" || (echo "extension failed to build/import" && exit 1)

run: build
	$(VENV)/bin/jenga-sim

test: build
	$(PY) -m pytest -q

# The release job (tools/release-check.sh): sdist, a wheel built from it and repaired to a
# manylinux tag (dist/), installed with no extras into a venv outside the repository, then
# imports, jenga-sim, vmm-bench --quick and vmm-pool start/ls/stop run there without torch.
release-check: build
	nice bash tools/release-check.sh $(abspath $(PY))

# C++ extensions under -fsanitize=address,undefined (build/asan), then the vmm, jenga and
# kvcache suites with libasan preloaded; skips cleanly without a sanitizer toolchain.
test-asan: $(STAMP)
	PY=$(PY) .ci/test-asan

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(VENV)/bin/clang-format --dry-run --Werror $(CLANG_SOURCES)
	$(MAKE) --no-print-directory stubs-check

format: $(STAMP)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .
	$(VENV)/bin/clang-format -i $(CLANG_SOURCES)

stubs: build
	$(VENV)/bin/pybind11-stubgen vmm._core jenga._core -o . --numpy-array-remove-parameters
	$(VENV)/bin/ruff format -q vmm/_core jenga/_core.pyi
	$(VENV)/bin/ruff check --fix -q vmm/_core jenga/_core.pyi
	$(VENV)/bin/ruff format -q vmm/_core jenga/_core.pyi

# The checked-in stubs against stubs generated from the built extensions: the same steps
# as `stubs`, into build/stubs-check, with ruff reading each file under its checked-in
# name (so the project's settings apply); fails naming the drift (then run `make stubs`).
STUB_CHECK := build/stubs-check
STUB_FILES := { find vmm/_core -name '*.pyi'; find jenga -name '_core*.pyi'; } | sort
stubs-check: build
	@rm -rf $(STUB_CHECK)
	@$(VENV)/bin/pybind11-stubgen vmm._core jenga._core -o $(STUB_CHECK) \
	  --numpy-array-remove-parameters > /dev/null
	@cd $(STUB_CHECK) && $(STUB_FILES) > generated.txt
	@$(STUB_FILES) | diff -u - $(STUB_CHECK)/generated.txt \
	  || { echo "stubs-check: the set of stub files drifted; run make stubs"; exit 1; }
	@for f in $$(cat $(STUB_CHECK)/generated.txt); do \
	  $(VENV)/bin/ruff format -q --stdin-filename $$f < $(STUB_CHECK)/$$f \
	    | $(VENV)/bin/ruff check --fix -q --exit-zero --stdin-filename $$f - 2>/dev/null \
	    | $(VENV)/bin/ruff format -q --stdin-filename $$f > $(STUB_CHECK)/$$f.formatted; \
	  diff -u $$f $(STUB_CHECK)/$$f.formatted \
	    || { echo "stubs-check: $$f drifted from the extension; run make stubs"; exit 1; }; \
	done
	@echo "stubs-check: the stubs match the extensions"

# The CUDA backend through the real cuda-bindings on the CUDA driver emulator: a test
# library (tests/vmm/cuda_emulator, built into build/, never shipped or linked by the
# package) that cuda-bindings loads as libcuda.so.1. Runs the `cuda` tests that need no
# torch CUDA tensors and the emulator's own tests (all under tests/vmm; the other `cuda`
# test, tests/integrations/engine's flash-attention one, is `gpu`); `gpu` tests are
# deselected, and a `cuda` test that skips fails the run (tests/conftest.py).
EMU_DIR       := build/cuda-emulator
EMU_LIB       := $(EMU_DIR)/libcuda.so.1
EMU_SOURCES   := $(wildcard tests/vmm/cuda_emulator/*.c tests/vmm/cuda_emulator/*.h)
CUDA_BINDINGS ?= cuda-bindings>=12.6,<14

$(EMU_LIB): $(EMU_SOURCES)
	@mkdir -p $(EMU_DIR)
	$(CC) -std=c11 -O2 -g -Wall -Wextra -Werror -fPIC -shared -fvisibility=hidden \
	  -Wl,-soname,libcuda.so.1 -o $@ $(filter %.c,$(EMU_SOURCES)) -lpthread

cuda-emulator: $(EMU_LIB)

test-cuda-emulated: build $(EMU_LIB)
	$(PIP) install -q "$(CUDA_BINDINGS)"
	JENGA_VMM_CUDA_EMULATOR=$(abspath $(EMU_LIB)) \
	  $(PY) -m pytest -q -m "(cuda or emulator) and not gpu" tests/vmm

# vLLM suites, each version in its own venv (.venv-vllm-VERSION, made by tools/vllm-venv.sh when
# missing; reuse one with `make test-vllm VLLM_VENV=/path/to/venv`), then this package editable.
#   make test-vllm [VLLM=0.32.0|0.33.0]              tests/integrations/vllm
#   make test-vllm-conformance [VLLM=0.32.0|0.33.0]  vLLM's own tests/v1/core on vLLM's and our manager
VLLM        ?= 0.32.0
VLLM_VENV   ?= .venv-vllm-$(VLLM)
VLLM_STAMP  := $(VLLM_VENV)/.jenga-vmm-installed
# Each venv builds the extensions in its own CMake tree: a shared build/{wheel_tag} would be
# reconfigured (2-4 min here) every time CI switches between .venv and a vLLM venv.
VLLM_BUILD  := --config-settings=build-dir=build/$(patsubst .%,%,$(notdir $(VLLM_VENV)))/{wheel_tag}

$(VLLM_VENV)/bin/python:
	nice bash tools/vllm-venv.sh $(VLLM) $(VLLM_VENV)

$(VLLM_STAMP): pyproject.toml $(VLLM_VENV)/bin/python
	$(VLLM_VENV)/bin/python -m pip install -q "scikit-build-core>=0.10" "pybind11>=2.13" "pytest>=8"
	$(VLLM_VENV)/bin/python -m pip install -q --no-build-isolation --no-deps $(VLLM_BUILD) -e .
	touch $(VLLM_STAMP)

vllm-venv: $(VLLM_STAMP)
	@$(VLLM_VENV)/bin/python -m pip install -q --no-build-isolation --no-deps $(VLLM_BUILD) -e . 2>&1 | grep -v "^$$" || true

# Side-by-side sweeps (vLLM's manager vs ours, ratio tables in docs/results/, heat maps in
# docs/figures/vllm-sweep/ drawn by .venv, which has matplotlib):
#   make vllm-sweep [VLLM=0.32.0] [SWEEP_DATE=YYYY-MM-DD]
SWEEP_DATE  ?= $(shell date -u +%F)
SWEEP_OUT   := docs/results/$(SWEEP_DATE)-vllm-sweep
SWEEP_CMD   := nice $(VLLM_VENV)/bin/python -m integrations.vllm.harness.side_by_side
SWEEP_SMALL := --cases llama gemma2 ministral jamba --managers vllm jenga-vmm \
	--sweep requests=8,16,32,64,128,256 memory-mb=128,256,512,1024 seeds=0-2
SWEEP_REAL  := --cases gemma2-9b ministral-8b jamba-1.5-mini gpt-oss-20b qwen3-next-80b \
	--managers vllm jenga-vmm --question-tokens 2000 \
	--sweep requests=64,128,256 memory-gib=20,40,80 seeds=0-2

vllm-sweep: vllm-venv build
	$(SWEEP_CMD) $(SWEEP_SMALL) --json $(SWEEP_OUT)-small.json --table $(SWEEP_OUT)-small.md
	$(SWEEP_CMD) $(SWEEP_REAL) --json $(SWEEP_OUT)-real.json --table $(SWEEP_OUT)-real.md
	$(PY) -m integrations.vllm.harness.sweep_report $(SWEEP_OUT)-small.json \
		--table $(SWEEP_OUT)-small.md --plots docs/figures/vllm-sweep/small
	$(PY) -m integrations.vllm.harness.sweep_report $(SWEEP_OUT)-real.json \
		--table $(SWEEP_OUT)-real.md --plots docs/figures/vllm-sweep/real

test-vllm: vllm-venv
	$(VLLM_VENV)/bin/python -m pytest -q tests/integrations/vllm

test-vllm-conformance: vllm-venv
	nice $(VLLM_VENV)/bin/python tests/integrations/vllm/conformance/run_conformance.py $(VLLM)

# The HF cache and the mini engine on the oldest supported transformers (`hf` extra's lower
# bound; .venv runs the newest): a small venv .venv-hf-VERSION (torch CPU from local disk,
# transformers and what it needs, this package editable in its own CMake tree).
HF_OLDEST   ?= 5.16.0
HF_VENV     ?= .venv-hf-$(HF_OLDEST)
HF_STAMP    := $(HF_VENV)/.jenga-vmm-installed
HF_BUILD    := --config-settings=build-dir=build/$(patsubst .%,%,$(notdir $(HF_VENV)))/{wheel_tag}

$(HF_STAMP): pyproject.toml
	python3 -m venv $(HF_VENV)
	$(HF_VENV)/bin/python -m pip install -q --upgrade pip
	$(HF_VENV)/bin/python -m pip install -q torch==2.13.0
	$(HF_VENV)/bin/python -m pip install -q "transformers==$(HF_OLDEST)" "numpy>=1.26" "rich>=13" \
	  "pillow" "pytest>=8" "hypothesis>=6.100" "scikit-build-core>=0.10" "pybind11>=2.13"
	$(HF_VENV)/bin/python -m pip install -q --no-build-isolation --no-deps $(HF_BUILD) -e .
	touch $(HF_STAMP)

hf-venv: $(HF_STAMP)
	@$(HF_VENV)/bin/python -m pip install -q --no-build-isolation --no-deps $(HF_BUILD) -e . 2>&1 | grep -v "^$$" || true

test-hf-oldest: hf-venv
	$(HF_VENV)/bin/python -c "import transformers; assert transformers.__version__ == '$(HF_OLDEST)', transformers.__version__"
	$(HF_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/integrations/hf tests/integrations/engine

# Every GPU check in one run (tools/gpu_check.py): on a lent GPU machine `make test-gpu`
# uses its own python3 (torch with CUDA, cuda-bindings; no venv, no downloads) and writes
# docs/results/gpu-DATE.md; `make test-gpu BACKEND=host` runs the same parts on the host
# backend in .venv and writes build/gpu-check/host.md (CI).
BACKEND ?= cuda
ifeq ($(BACKEND),cuda)
# (PIP_BREAK_SYSTEM_PACKAGES: the machine's python3 may be marked externally managed)
test-gpu:
	PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install -q --no-build-isolation --no-deps --no-index -e .
	python3 tools/gpu_check.py --backend cuda $(if $(OUT),--out $(OUT))
else
test-gpu: build
	$(PY) tools/gpu_check.py --backend $(BACKEND) --out $(or $(OUT),build/gpu-check/$(BACKEND).md)
endif

clean:
	rm -rf build $(VENV) .venv-vllm-* .venv-hf-* .conformance
