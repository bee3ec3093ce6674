# hybridpar: `make demo` and `make test` set everything up on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test install clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

# torch is pinned in pyproject.toml (torch==2.13.0, the CPU build here).
$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install --quiet -e ".[dev,hf,data]"
	touch $(STAMP)

install: $(STAMP)

# The default job: the tiny hybrid model on packed MQAR, 4 processes as cp=2 x tp=2.
demo: $(STAMP)
	$(PY) -m hybridpar train --config configs/tiny-hybrid.yaml --nproc-per-node 4 checkpoint.resume=null

test: $(STAMP)
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
