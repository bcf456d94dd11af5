# Everything a fresh machine needs is installed by these targets (Python >= 3.10 with venv and pip).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

export HF_HUB_OFFLINE := 1
export PREFECT_HOME ?= $(CURDIR)/.prefect
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export DO_NOT_TRACK := 1
export NO_MKDOCS_2_WARNING := 1
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS := 90

.PHONY: demo test test-fast bench docs serve setup clean

setup: $(STAMP)

# Refreshed when the dependencies change; constraints.txt pins the dev environment (CPU torch). Byte-compiled
# after the install on every core (pip's own compile takes one: 113 s of set-up against 67); like pip, compileall
# skips the few files written for newer Pythons (torch's py312 tests), which is why its status is not checked.
$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q --no-compile -c constraints.txt -e '.[train,dev]'
	$(PY) -m compileall -qq -j 0 $(VENV)/lib > /dev/null || true
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
