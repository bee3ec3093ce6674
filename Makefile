# hybridpar: `make demo` and `make test` set everything up on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DEMO_STAMP := $(VENV)/.installed-demo

.PHONY: demo test install clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

# pyproject.toml declares the torch range hybridpar is tested on; constraints.txt pins the exact
# versions the suite and CI run (torch==2.13.0), so `make` stays reproducible. FLA's kernels (the
# fla-interpret extra) go to their own folder, on the path of the one test that runs them.
# pip compiles the bytecode one file at a time (about 60 s here); compileall does it on every core
# (about 30 s). As under pip, a file that does not compile on this Python (torch ships a 3.12-only
# test file) is skipped.
$(STAMP): pyproject.toml constraints.txt | $(PY)
	$(PY) -m pip install --quiet --no-compile -c constraints.txt -e ".[dev,hf,data,peft]"
	rm -rf $(VENV)/fla-interpret
	$(PY) -c "import tomllib; print(*tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['fla-interpret'], sep='\n')" > $(VENV)/fla-interpret.txt
	$(PY) -m pip install --quiet --no-compile --no-deps -c constraints.txt --target $(VENV)/fla-interpret -r $(VENV)/fla-interpret.txt
	$(PY) -m compileall -qq -j 0 $(VENV)/lib $(VENV)/fla-interpret || true
	touch $(STAMP)

install: $(STAMP)

# The demo also writes TensorBoard logs (the optional `tensorboard` extra).
$(DEMO_STAMP): $(STAMP)
	$(PY) -m pip install --quiet -c constraints.txt -e ".[dev,hf,tensorboard]"
	touch $(DEMO_STAMP)

# The default job: the tiny hybrid model on packed MQAR, 2 processes as cp=2.
# Each `make demo` starts afresh and replaces the previous demo run in runs/tiny-hybrid.
demo: $(DEMO_STAMP)
	$(PY) -m hybridpar train --config configs/tiny-hybrid.yaml --nproc-per-node 2 checkpoint.resume=null checkpoint.if_exists=overwrite

# Two pytest workers, a test file each at a time (module fixtures stay whole): the ranks of one test
# leave a core idle while the pytest process computes its single-process reference. One OpenMP
# thread each: two workers' thread pools on two cores spin against each other (the single-process
# tests took 72 s with torch's default threads, 44 s with one). The project's own bytecode is
# compiled first: where PYTHONDONTWRITEBYTECODE is set (this machine sets it) every process, each
# CLI test's launcher and workers included, would otherwise compile src/ from source (about 0.9 s of
# CPU each); Python still reads bytecode that is there.
test: $(STAMP)
	$(PY) -m compileall -q -j 0 src tests benchmarks > /dev/null
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n 2 --dist loadfile

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
