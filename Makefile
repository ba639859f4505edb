# The two commands of README.md (demo, test), each installing what it needs first
# (idempotent); test-fast for a first signal, docs for the documentation site.
PYTHON ?= python3
PIP_FLAGS ?= --quiet --disable-pip-version-check
# pytest marks that `make test-fast` leaves out (given in tests/conftest.py)
FAST_LOOP ?= not slow and not cluster and not e2e

.PHONY: install demo test test-fast lint docs-install docs docs-build

install:
	$(PYTHON) -m pip install $(PIP_FLAGS) -e '.[dev]'

demo: install
	pairforge build examples/demo.yaml

# the whole suite (what .ci/run runs), with the 25 slowest tests at the end; whole files
# to each worker, the longest first (tests/conftest.py, LONGEST_FIRST)
XDIST ?= -n 2 --dist loadfile --no-loadscope-reorder
test: install
	$(PYTHON) -m pytest -q -ra $(XDIST) --durations=25

# everything but the slow, cluster and end-to-end tests: a few minutes on 2 cores
test-fast: install
	$(PYTHON) -m pytest -q -ra $(XDIST) -m "$(FAST_LOOP)" --durations=10

lint:
	ruff check pairforge tests bench

docs-install:
	$(PYTHON) -m pip install $(PIP_FLAGS) -e '.[docs]'

# docs/reference/ is generated from the code first; the site is served on 127.0.0.1:8001
docs: docs-install
	$(PYTHON) docs/gen_reference.py
	NO_MKDOCS_2_WARNING=1 $(PYTHON) -m mkdocs serve -a 127.0.0.1:8001

docs-build: docs-install
	$(PYTHON) docs/gen_reference.py
	NO_MKDOCS_2_WARNING=1 $(PYTHON) -m mkdocs build --strict
