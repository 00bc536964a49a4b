# Set-up is one stamp file: the venv is built once and rebuilt only when pyproject.toml changes.
# torch is pinned first so pip takes the local CPU build instead of a multi-GB CUDA one.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
TORCH  ?= torch==2.13.0

.PHONY: setup test demo distributed-demo train-demo bench bench-all lint clean gpu-check gpu-wheels

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check $(TORCH)
	$(BIN)/python -m pip install -q --disable-pip-version-check -e '.[dev]'
	touch $(STAMP)

test: setup
	$(BIN)/python -m pytest -q

demo: setup
	$(BIN)/tensorql demo

distributed-demo: setup
	$(BIN)/tensorql distributed-demo --ranks $(or $(RANKS),2)

train-demo: setup
	$(BIN)/tensorql train-demo --steps $(or $(STEPS),200)

bench: setup
	$(BIN)/python bench/cpu_einsum.py

# GPU checks (docs/benchmarks.md, "GPU"): `make gpu-wheels` here downloads the cp312 wheels the
# device image lacks into .whl (carried along); `make gpu-check` there runs every GPU check in
# one command (bench/gpu_check.py); `DEV=cpu make gpu-check` is its dry run on the CPU. Neither
# needs `setup` (the device image has torch but no network): the venv's python when there is
# one, else python3.
GPU_PY ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,python3)

gpu-check:
	$(GPU_PY) bench/gpu_check.py --device $(or $(DEV),cuda)

gpu-wheels:
	$(GPU_PY) bench/gpu_check.py --prepare

# Every CPU bench at full size, each contender in its own process (bench/harness.py), each
# bench's record in bench/results/, then the tables of docs/benchmarks.md regenerated from
# them. Run on a quiet machine: the records are the published figures. BENCH_ARGS is passed
# to every bench (e.g. BENCH_ARGS="--threads 4"). Exits 1 if any bench missed a goal or
# computed a wrong result, after regenerating the tables.
CPU_BENCHES ?= cpu_einsum store_io sql_backends memory optimizer networks llama train distributed

bench-all: setup
	@failed=""; for b in $(CPU_BENCHES); do \
		echo "== bench/$$b.py"; \
		$(BIN)/python bench/$$b.py --json bench/results/$$b.json $(BENCH_ARGS) \
			|| failed="$$failed $$b"; \
	done; \
	$(BIN)/python bench/tables.py; \
	if [ -n "$$failed" ]; then echo "goal missed or result wrong:$$failed"; exit 1; fi

lint: setup
	$(BIN)/ruff check tensorql kernels tests bench

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
