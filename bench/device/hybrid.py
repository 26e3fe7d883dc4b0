"""The live hybrid experiment on a machine with an NVIDIA GPU: router + cpu_worker + gpu_worker (CUDA).

Runs seed-burst (the default model, or the directory TANDEM_DEVICE_MODEL names) for N = 8 and 48 with
`cost` and `gpu_only` at GPU max_active 4, sweeps `gpu_only` over GPU max_active 1..32 at N = 48, then runs
the best of the sweep at N = 8 and `cost` with that GPU setting. One fresh stack per run. Writes hybrid.json
(and each run's record) into the directory given.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from seed import MAX_ACTIVE_SWEEP, live_run  # noqa: E402

from tandem.loadgen.results import write_json  # noqa: E402


def main(out_dir: Path) -> int:
    import torch

    from tandem.model_files import resolve_model

    started = time.perf_counter()
    model = str(resolve_model(os.environ.get("TANDEM_DEVICE_MODEL")))
    report: dict = {"device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu (no CUDA)",
                    "torch": torch.__version__, "model": model, "runs": []}

    def run(n: int, policy: str, gpu_max_active: int) -> dict:
        entry = live_run(model, n, policy, 0, out_dir / "runs", gpu_max_active=gpu_max_active)
        report["runs"].append({"requests": n, **entry})
        write_json(out_dir / "hybrid.json", {**report, "elapsed_s": time.perf_counter() - started})
        return entry

    for n in (8, 48):
        run(n, "cost", 4)
    sweep = [run(48, "gpu_only", k) for k in MAX_ACTIVE_SWEEP]
    best = min(sweep, key=lambda entry: entry["makespan_s"])["gpu_max_active"]
    report["best_gpu_only_max_active"] = best
    run(8, "gpu_only", 4)
    if best != 4:
        run(8, "gpu_only", best)
        run(8, "cost", best)
        run(48, "cost", best)
    write_json(out_dir / "hybrid.json", {**report, "elapsed_s": time.perf_counter() - started})
    print(f"wrote {out_dir / 'hybrid.json'} in {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: hybrid.py OUT_DIR")
    sys.exit(main(Path(sys.argv[1])))
