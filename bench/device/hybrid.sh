#!/usr/bin/env bash
# The live hybrid benchmark on a machine with an NVIDIA GPU and many CPU cores (for example an H200
# with 16 cores): router + cpu_worker + gpu_worker (CUDA), seed-burst at N = 8 and 48 for `cost`,
# `gpu_only` at GPU max_active 4, and the best `gpu_only` of a max_active sweep. Writes JSON into the
# directory given as the only argument; stops itself after TANDEM_DEVICE_BUDGET_S seconds (420).
# TANDEM_DEVICE_MODEL names a model directory to use in place of the default model.
#
# Run it from a checkout of this repository. It uses the machine's python (with torch); set
# TANDEM_WHEELS to a directory of wheels to install the other dependencies from it, offline.
set -euo pipefail

out="${1:?usage: bench/device/hybrid.sh OUT_DIR}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
source "$(dirname "$0")/env.sh"
export TANDEM_HOME="${TANDEM_HOME:-$out/tandem-home}"

"$python" -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())" | tee "$out/env.txt"
"$python" -m tandem.cli provision ${TANDEM_DEVICE_MODEL:+--model "$TANDEM_DEVICE_MODEL"} > /dev/null
timeout --signal=TERM --kill-after=20 "${TANDEM_DEVICE_BUDGET_S:-420}" \
  "$python" bench/device/hybrid.py "$out" 2>&1 | tee "$out/hybrid.log"
