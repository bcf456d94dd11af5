# Everything a fresh machine needs is installed by these targets (Python >= 3.11 with venv and pip).
# The venv is made from the system's /usr/bin/python3 when it is >= 3.11 with venv (Debian's and Ubuntu's builds
# are profile-guided and link-time optimized: the whole suite took 12 % less CPU on it than on a default pyenv
# build, docs/benchmarks.md), else from python3 on PATH; `make setup PYTHON=python3.12` picks another.
SYSTEM_PYTHON := /usr/bin/python3
PYTHON ?= $(shell $(SYSTEM_PYTHON) -c 'import sys, venv, ensurepip; sys.exit(sys.version_info < (3, 11))' \
                  2>/dev/null && echo $(SYSTEM_PYTHON) || echo python3)
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

export HF_HUB_OFFLINE := 1
export PREFECT_HOME ?= $(CURDIR)/.prefect
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export DO_NOT_TRACK := 1
export NO_MKDOCS_2_WARNING := 1
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS := 90
# Python keeps a module's compiled .pyc at its first import, for every later process (the suite starts hundreds);
# an image that sets PYTHONDONTWRITEBYTECODE (a sandbox's does) makes every process compile torch's, Prefect's and
# transformers' modules again: collecting the tests took 12.2 CPU s uncached against 8.0 cached, in each worker.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: demo test test-fast bench docs serve setup clean

setup: $(STAMP)

# Refreshed when the dependencies change; constraints.txt pins the dev environment (CPU torch). Byte-compiled at
# install (pip's default): uncompiled, the test workers compiled the same modules at once, each for itself, as they
# collected and as their first sessions and flows started.
$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[train,dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) deploy/demo.py

# In parallel: the relay tests mostly wait on processes (kernels, Prefect, the emulator), so more workers than
# cores pay; each worker takes one test at a time, the longest first (tests/conftest.py).
TEST_WORKERS ?= 4
test: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist load --maxschedchunk 1 --durations=15

# Everything that starts no process (no Prefect server, no relay, no subprocess session): CPU-bound, so one
# worker per core.
FAST_WORKERS ?= 2
test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow" -n $(FAST_WORKERS) --dist load

# The reference pages are generated from the code; the home page is the README's first screen.
docs: $(STAMP)
	$(PY) -m pip install -q -c constraints.txt -e '.[docs]'
	$(PY) docs/gen_reference.py
	sed 's#](docs/#](#g' README.md > docs/index.md
	$(VENV)/bin/mkdocs build --strict -q

bench: $(STAMP)
	$(PY) bench/run.py

serve: $(STAMP)
	bash deploy/serve.sh

clean:
	rm -rf runs .prefect bench/results.json site
