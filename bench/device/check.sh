#!/usr/bin/env bash
# Every check that needs an NVIDIA GPU, in one run: the engine and worker tests on CUDA, the engine
# benchmark on CUDA against transformers on the same GPU (and Tandem again with CUDA graphs), where a
# decode step's time goes, eager and with CUDA graphs, and the live hybrid benchmark (hybrid.sh).
# Usage: bench/device/check.sh OUT_DIR [tests|benchmarks|all]
#
# `tests` needs no model download (the tests build tiny models); `benchmarks` provisions the default
# model. TANDEM_WHEELS as for hybrid.sh; TANDEM_DEVICE_BUDGET_S bounds the hybrid part (200 s here).
set -uo pipefail

out="${1:?usage: bench/device/check.sh OUT_DIR [tests|benchmarks|all]}"
part="${2:-all}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
source "$(dirname "$0")/env.sh" || exit 1
export TANDEM_HOME="${TANDEM_HOME:-$out/tandem-home}"
status=0

if [[ "$part" == tests || "$part" == all ]]; then
  TANDEM_TEST_DEVICE=cuda timeout 240 "$python" -m pytest -q -p no:cacheprovider -m "not model" \
    tests/engine tests/integration/test_worker.py tests/integration/test_worker_lifecycle.py \
    tests/integration/test_router.py 2>&1 | tee "$out/tests.log" || status=1
fi

if [[ "$part" == benchmarks || "$part" == all ]]; then
  "$python" -m tandem.cli provision > /dev/null || exit 1
  timeout 100 "$python" bench/engine.py --device cuda --output "$out/engine-cuda-8.json" 2>&1 \
    | tee "$out/engine.log" || status=1
  timeout 60 "$python" bench/engine.py --device cuda --cuda-graphs --peers "" --output "$out/engine-cuda-8-graphs.json" \
    2>&1 | tee -a "$out/engine.log" || status=1
  TANDEM_WHEELS= TANDEM_DEVICE_BUDGET_S="${TANDEM_DEVICE_BUDGET_S:-200}" "$repo/bench/device/hybrid.sh" "$out" || status=1
  timeout 50 "$python" bench/device/decode_step.py "$out" 2>&1 | tee "$out/decode-step.log" || status=1
  timeout 60 "$python" bench/engine.py --device cuda --requests 64 --repeats 2 \
    --peers hf_padded_batch,hf_continuous_batching --output "$out/engine-cuda-64.json" 2>&1 \
    | tee -a "$out/engine.log" || status=1
fi
exit $status
