# Set-up and everyday commands. A fresh machine needs only Python 3.10+ and make.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# CPU machines get torch 2.13.0 (a local CPU build here; an unpinned torch would pull several GB of
# CUDA packages). On GPU nodes pass the build you want, e.g. `make install TORCH=torch==2.13.0`.
TORCH  ?= torch==2.13.0

.PHONY: install quickstart test test-fast list ui clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet -e ".[test]"
	touch $@

quickstart: install
	$(PY) -m suite run configs/quickstart.yaml

test: install
	$(PY) -m pytest -q

test-fast: install  ## everything except multi-process and end-to-end sweeps
	$(PY) -m pytest -q -m "not slow"

list: install
	$(PY) -m suite list

ui: install
	$(PY) -m suite ui

clean:
	rm -rf $(VENV) results/*/ results/mlflow.db results/mlartifacts reports/*/
