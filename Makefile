# Set-up and everyday commands. A fresh machine needs only Python 3.10+ and make.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# CPU machines get torch 2.13.0 (a local CPU build here; an unpinned torch would pull several GB of
# CUDA packages). On GPU nodes pass the build you want, e.g. `make install TORCH=torch==2.13.0`.
TORCH  ?= torch==2.13.0
# pip (the default) or uv: `make install INSTALLER=uv` installs uv with pip, then the same packages
# with uv (measured: reports/recorded/install_speed.md). uv reads no pip configuration, so pip's
# find-links (where a local CPU torch build lies) are passed on to it.
INSTALLER  ?= pip
FIND_LINKS ?= $(or $(PIP_FIND_LINKS),$(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null))
UV_FLAGS   := $(foreach d,$(FIND_LINKS),--find-links $(d))

.PHONY: install quickstart test test-fast test-long lint format list ui clean sim-check simulate gpu-check \
	gpu-check-device gpu-check-dry

install: $(VENV)/.installed

# Each step says what it does, and pip and uv print what they fetch and install (a quiet install
# of torch looks hung for minutes on a slow link).
$(VENV)/.installed: pyproject.toml
	@echo "== install 1/3: virtual environment $(VENV) ($(PYTHON))"
	$(PYTHON) -m venv $(VENV)
ifeq ($(INSTALLER),uv)
	@echo "== install 2/3: uv, then $(TORCH) (the largest download: minutes on a slow link)"
	$(PY) -m pip install uv
	$(VENV)/bin/uv pip install --python $(PY) $(UV_FLAGS) "$(TORCH)"
	@echo "== install 3/3: the suite and its test dependencies (pyproject.toml [test])"
	$(VENV)/bin/uv pip install --python $(PY) $(UV_FLAGS) -e ".[test]"
else ifeq ($(INSTALLER),pip)
	@echo "== install 2/3: $(TORCH) (the largest download: minutes on a slow link)"
	$(PY) -m pip install "$(TORCH)"
	@echo "== install 3/3: the suite and its test dependencies (pyproject.toml [test])"
	$(PY) -m pip install -e ".[test]"
else
	@echo "INSTALLER must be pip or uv, got $(INSTALLER)" >&2; exit 2
endif
	touch $@
	@echo "== installed: $(VENV); next: make quickstart (or make test)"

quickstart: install
	$(PY) -m suite run configs/quickstart.yaml

# The tests run in parallel processes (pytest-xdist): one per core, at most 4, each taking whole files
# (a file's module fixtures are built once). Most tests hold one core or less (small tensors, process
# start-up, MLflow's sqlite), so a second process uses the other core. `make test PYTEST_PAR=` runs them in one.
PYTEST_PAR ?= -n auto --maxprocesses 4 --dist loadfile
test: install
	$(PY) -m pytest -q $(PYTEST_PAR)

# ruff (pyproject.toml [tool.ruff]): 120 columns, unused or undefined names, import order, and the
# format (`make format` writes it); mypy (pyproject.toml [tool.mypy], with check_untyped_defs) type-checks
# methods/ and suite/.
# .pre-commit-config.yaml runs the same before each commit.
LINTED := suite methods tests benchmarks .ci
lint: install
	$(PY) -m ruff check $(LINTED)
	$(PY) -m ruff format --check $(LINTED)
	$(PY) -m mypy methods suite

format: install
	$(PY) -m ruff format $(LINTED)
	$(PY) -m ruff check --fix $(LINTED)

test-fast: install  ## everything except multi-process and end-to-end sweeps
	$(PY) -m pytest -q $(PYTEST_PAR) -m "not slow"

# make test plus the tests marked `long` (wider grids of properties a default test checks: each
# method and size of the CP-vs-one-device training parity); about 45 s more on 2 cores.
test-long: install
	$(PY) -m pytest -q $(PYTEST_PAR) --long

# The simulator's measured check on this machine: calibrate the host model (kernel times of every
# block the sweep emits, gloo loopback latency/bandwidth), run the sweep measured (dist) and
# predicted (sim), and write the predicted-vs-measured table and figure. About 3 minutes on 2 cores.
sim-check: install
	$(PY) -m suite calibrate configs/sim_check_cpu.yaml --out results/calibration/cpu_host.yaml
	$(PY) -m suite run configs/sim_check_cpu.yaml --no-progress
	$(PY) -m suite run configs/sim_check_cpu.yaml run.executor=sim name=sim_check_cpu_sim --no-progress
	$(PY) -m suite report results/sim_check_cpu results/sim_check_cpu_sim --out reports/sim_check_cpu --no-mlflow

# The simulated studies (TASP, BurstAttention, USP grid, multi-node); several minutes each for the multi-node ones.
simulate: install
	for c in tasp burst usp multinode; do $(PY) -m suite run configs/simulate_$$c.yaml --no-progress || exit 1; done

# The GPU checks (tests/test_gpu.py; skipped without CUDA), run part by part by benchmarks/gpu_check.py,
# each part with its own time limit, all in at most 440 s: every own method emulated on the one GPU
# (threads) in bf16 against float64 at P = 2, 4, 8; every mask family at P = 4; sinks, soft cap, MLA
# head dims and GQA at P = 1, 2, 4, 8; the fused kernels block by block; world size 1 over NCCL for
# every method and importable peer; `suite calibrate` (kernel table); a short headline sweep. Writes
# summary.md (one screen), rows.jsonl, kernels.md, calibration.blocks.yaml, parts.json, device.json and
# log.txt to $(GPU_CHECK_OUT). Install with the CUDA torch build of the node first:
# make install TORCH=torch==2.13.0. `make gpu-check-dry` runs the same on CPU (the dry run: 422 s on
# 2 busy cores, reports/recorded/gpu_check_cpu_dry_run.md).
# On a lent GPU machine (the device tool: the image's python3, no venv, no hydra-core or omegaconf),
# gpu-check-device installs the wheels carried in .whl/ (docs/gpu_and_clusters.md makes them) into a
# temporary folder. The device tool's call, first thing in a session with a device:
#   command: python3 benchmarks/gpu_check.py --out "$$OUT"      (= make gpu-check-device OUT="$$OUT")
#   carry: [".whl"]   timeout_s: 480      (then bring summary.md and kernels.md to reports/recorded/)
GPU_CHECK_OUT ?= $(or $(OUT),results/gpu_check)
gpu-check: install
	$(PY) benchmarks/gpu_check.py --wheels "" --out $(GPU_CHECK_OUT)

gpu-check-device:
	$(PYTHON) benchmarks/gpu_check.py --out $(GPU_CHECK_OUT)

gpu-check-dry: install
	SUITE_GPU_CHECK_DEVICE=cpu $(PY) benchmarks/gpu_check.py --wheels "" --device cpu --out results/gpu_check_dry

list: install
	$(PY) -m suite list

ui: install
	$(PY) -m suite ui

clean:
	rm -rf $(VENV) results/*/ results/mlflow.db results/mlartifacts reports/*/
