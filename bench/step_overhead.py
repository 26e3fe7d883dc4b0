"""The engine's own Python work per step, on a tiny random-weight model where it is most of the step.

Two figures: Python function calls per step outside the model (cProfile; exact, so a noisy machine cannot
move it) and milliseconds per step (best and median of 8 timed bursts). ``--compare-checkout TREE`` measures
the engine of another source tree the same way, alternating with this one. Writes
bench/results/step-overhead.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from trees import ROOT, measure_in

RESULTS = ROOT / "bench" / "results"
BURST = dict(requests=16, prompt_tokens=40, max_new_tokens=64)


def measure(model_dir: str, bursts: int) -> dict:
    """Run in the process of the tree being measured."""
    import cProfile
    import pstats

    import tandem
    from tandem.engine.config import CacheConfig, SchedulerConfig
    from tandem.engine.model.factory import build_engine
    from tandem.engine.request import Request
    from tandem.sampling import SamplingParams

    engine = build_engine(model_dir, scheduler=SchedulerConfig(max_num_batched_tokens=256),
                          cache=CacheConfig(num_kv_blocks=512), calibrate=False)
    rng = random.Random(0)

    def burst(tag: str, profile=None) -> tuple[float, int]:
        for index in range(BURST["requests"]):
            prompt = [rng.randrange(3, 300) for _ in range(BURST["prompt_tokens"])]
            engine.add_request(Request(f"{tag}-{index}", prompt, BURST["max_new_tokens"], SamplingParams(temperature=0),
                                       ignore_eos=True))
        steps, start = 0, time.perf_counter()
        if profile:
            profile.enable()
        while engine.has_work():
            engine.step()
            steps += 1
        if profile:
            profile.disable()
        return (time.perf_counter() - start) * 1000 / steps, steps

    burst("warm")
    profile = cProfile.Profile()
    _, steps = burst("profiled", profile)
    calls = pstats.Stats(profile).stats
    engine_calls = sum(c[1] for (path, _, _), c in calls.items() if f"{os.sep}tandem{os.sep}engine{os.sep}" in path
                       and f"{os.sep}model{os.sep}" not in path)
    timed = [burst(f"timed-{k}")[0] for k in range(bursts)]
    return {"tree": str(Path(tandem.__file__).parents[1]), "steps_per_burst": steps,
            "engine_calls_per_step": engine_calls / steps,
            "all_calls_per_step": sum(c[1] for c in calls.values()) / steps,
            "ms_per_step_best": min(timed), "ms_per_step_median": statistics.median(timed)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bursts", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3, help="alternations between the trees")
    parser.add_argument("--compare-checkout", type=Path, action="append", default=[], metavar="TREE")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from tests.models import build_tiny_model

    trees = [ROOT, *(path.resolve() for path in args.compare_checkout)]
    with tempfile.TemporaryDirectory() as directory:
        model_dir = str(build_tiny_model(Path(directory) / "tiny"))
        runs = {str(tree): [] for tree in trees}
        for _ in range(args.rounds):
            for tree in trees:
                runs[str(tree)].append(measure_in(tree, "step_overhead", f"m.measure({model_dir!r}, {args.bursts})"))
    report = {"burst": BURST, "trees": {tree: {
        "engine_calls_per_step": measured[0]["engine_calls_per_step"],
        "all_calls_per_step": measured[0]["all_calls_per_step"],
        "ms_per_step_best": min(m["ms_per_step_best"] for m in measured),
        "ms_per_step_median_of_rounds": statistics.median(m["ms_per_step_median"] for m in measured),
    } for tree, measured in runs.items()}}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "step-overhead.json").write_text(json.dumps(report, indent=2) + "\n")
    for tree, figures in report["trees"].items():
        print(f"{tree}: {figures['engine_calls_per_step']:.0f} engine calls per step "
              f"({figures['all_calls_per_step']:.0f} in all), {figures['ms_per_step_best']:.2f} ms per step best, "
              f"{figures['ms_per_step_median_of_rounds']:.2f} median")
    return 0


if __name__ == "__main__":
    sys.exit(main())
