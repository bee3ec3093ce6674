# hybridpar: `make demo` and `make test` set everything up on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DEMO_STAMP := $(VENV)/.installed-demo

# Python writes each module's bytecode on its first import (into .venv and the checkout's
# __pycache__ folders, which git ignores), whatever the environment says: where
# PYTHONDONTWRITEBYTECODE is set (this machine sets it) every process would otherwise compile every
# module it imports from source, torch's and transformers' included (12.8 s instead of 7.6 s to
# import them), in each CLI test's launcher and workers. Compiling only what is imported, once, is
# cheaper than compiling the whole environment at install (13,000 files, 43 s here).
unexport PYTHONDONTWRITEBYTECODE

.PHONY: demo test install clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

# pyproject.toml declares the torch range hybridpar is tested on; constraints.txt pins the exact
# versions the suite and CI run (torch==2.13.0), so `make` stays reproducible. FLA's kernels (the
# fla-interpret extra) go to their own folder, on the path of the one test that runs them.
# No bytecode at install (--no-compile; pip would compile all of it, one file at a time, about
# 60 s here): it is written on first import (above).
$(STAMP): pyproject.toml constraints.txt | $(PY)
	$(PY) -m pip install --quiet --no-compile -c constraints.txt -e ".[dev,hf,data,peft]"
	rm -rf $(VENV)/fla-interpret
	$(PY) -c "import tomllib; print(*tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['fla-interpret'], sep='\n')" > $(VENV)/fla-interpret.txt
	$(PY) -m pip install --quiet --no-compile --no-deps -c constraints.txt --target $(VENV)/fla-interpret -r $(VENV)/fla-interpret.txt
	touch $(STAMP)

install: $(STAMP)

# The demo also writes TensorBoard logs (the optional `tensorboard` extra).
$(DEMO_STAMP): $(STAMP)
	$(PY) -m pip install --quiet --no-compile -c constraints.txt -e ".[dev,hf,tensorboard]"
	touch $(DEMO_STAMP)

# The default job: the tiny hybrid model on packed MQAR, 2 processes as cp=2.
# Each `make demo` starts afresh and replaces the previous demo run in runs/tiny-hybrid.
demo: $(DEMO_STAMP)
	$(PY) -m hybridpar train --config configs/tiny-hybrid.yaml --nproc-per-node 2 checkpoint.resume=null checkpoint.if_exists=overwrite

# Two pytest workers, a test file each at a time (module fixtures stay whole): the ranks of one test
# leave a core idle while the pytest process computes its single-process reference. One OpenMP
# thread each: two workers' thread pools on two cores spin against each other (the single-process
# tests took 72 s with torch's default threads, 44 s with one). The slowest files go first
# (tests/conftest.py), in that order: xdist's own (most tests first) put single-test files last.
test: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
