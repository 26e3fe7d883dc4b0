#!/usr/bin/env bash
# Every check that needs an NVIDIA GPU, in one run: the tests on CUDA; where a decode step's time goes,
# eager and with CUDA graphs; the engine benchmark on CUDA against transformers on the same GPU (Tandem
# with its CUDA graphs, and again without); and the live hybrid benchmark (hybrid.sh).
# Usage: bench/device/check.sh OUT_DIR [tests|engine|hybrid|all]   (all by default)
#
# With TANDEM_WHEELS (see env.sh) every dependency is there and `tests` adds the worker and router
# integration tests; without, the machine's torch and transformers suffice for the engine tests and the
# engine part (the hybrid part needs the wheels). TANDEM_DEVICE_MODEL: the model the engine part
# measures (default: the built-in one, provisioned). TANDEM_DEVICE_BUDGET_S bounds the hybrid part (200 s).
set -uo pipefail

out="${1:?usage: bench/device/check.sh OUT_DIR [tests|engine|hybrid|all]}"
part="${2:-all}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
source "$(dirname "$0")/env.sh" || exit 1
export TANDEM_HOME="${TANDEM_HOME:-$out/tandem-home}"
export PYTHONUNBUFFERED=1
status=0
"$python" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())" \
  | tee "$out/env.txt"

if [[ "$part" == tests || "$part" == all ]]; then
  tests=(tests/engine)
  "$python" -c "import pytest_asyncio" 2>/dev/null || tests+=(--ignore=tests/engine/test_async.py)
  if [[ -n "${TANDEM_WHEELS:-}" ]]; then
    tests=(tests/engine tests/integration/test_worker.py tests/integration/test_worker_lifecycle.py
           tests/integration/test_router.py)
  fi
  TANDEM_TEST_DEVICE=cuda timeout 360 "$python" -m pytest -q -p no:cacheprovider -m "not model" "${tests[@]}" \
    2>&1 | tee "$out/tests.log" || status=1
fi

if [[ "$part" == engine || "$part" == all ]]; then
  model="${TANDEM_DEVICE_MODEL:-$("$python" -m tandem.cli provision)}" || exit 1
  timeout 120 "$python" bench/device/decode_step.py "$out" --model "$model" 2>&1 | tee "$out/decode-step.log" \
    || status=1
  engine=(timeout 120 "$python" bench/engine.py --device cuda --model "$model")
  "${engine[@]}" --peers hf_padded_batch,hf_continuous_batching --output "$out/engine-cuda-8.json" 2>&1 \
    | tee "$out/engine.log" || status=1
  "${engine[@]}" --cuda-graphs off --peers "" --output "$out/engine-cuda-8-eager.json" 2>&1 \
    | tee -a "$out/engine.log" || status=1
  "${engine[@]}" --requests 64 --repeats 2 --peers hf_padded_batch --output "$out/engine-cuda-64.json" 2>&1 \
    | tee -a "$out/engine.log" || status=1
  "${engine[@]}" --requests 64 --repeats 2 --cuda-graphs off --peers "" --output "$out/engine-cuda-64-eager.json" \
    2>&1 | tee -a "$out/engine.log" || status=1
fi

if [[ "$part" == hybrid || "$part" == all ]]; then
  TANDEM_DEVICE_BUDGET_S="${TANDEM_DEVICE_BUDGET_S:-200}" "$repo/bench/device/hybrid.sh" "$out" || status=1
fi
exit $status
