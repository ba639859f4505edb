# The two commands of README.md. Each installs what it needs first (idempotent).
PYTHON ?= python3
PIP_FLAGS ?= --quiet --disable-pip-version-check

.PHONY: install demo test lint

install:
	$(PYTHON) -m pip install $(PIP_FLAGS) -e '.[dev]'

demo: install
	pairforge build examples/demo.yaml

test: install
	$(PYTHON) -m pytest -q -ra -n 2 --dist loadfile

lint:
	ruff check pairforge tests bench
