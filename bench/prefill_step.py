"""A fresh prompt's prefill on the engine alone: the default model in the default formats, ``build_engine`` and
``step()`` until its first token, for each prompt length, best and median of ``--prompts`` fresh prompts after
one warm-up each. ``--compare-checkout TREE`` measures another source tree the same way, each tree in its own
process, in turns ``--rounds`` times. Writes bench/results/prefill-step.json.

    .venv/bin/python bench/prefill_step.py --compare-checkout ../old-checkout
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

from trees import ROOT, measure_in

RESULTS = ROOT / "bench" / "results"


def measure(lengths: list[int], prompts: int, threads: int) -> dict:
    """Run in the process of the tree being measured: seconds to the first token per prompt, by length."""
    import torch

    import tandem
    from tandem.engine.model.factory import build_engine
    from tandem.engine.request import Request
    from tandem.sampling import SamplingParams

    torch.set_num_threads(threads)
    engine = build_engine(None, calibrate=False)
    rng = random.Random(0)

    def prefill(tag: str, length: int) -> float:
        prompt = [rng.randrange(100, 40000) for _ in range(length)]
        engine.add_request(Request(tag, prompt, 1, SamplingParams(temperature=0), ignore_eos=True))
        start = time.perf_counter()
        while engine.has_work():
            engine.step()
        return time.perf_counter() - start

    seconds = {}
    for length in lengths:
        prefill(f"warm-{length}", length)
        seconds[length] = [prefill(f"{length}-{k}", length) for k in range(prompts)]
    return {"tree": str(Path(tandem.__file__).parents[1]), "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 4096])
    parser.add_argument("--prompts", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2, help="turns of the trees")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--compare-checkout", type=Path, action="append", default=[], metavar="TREE")
    args = parser.parse_args()
    trees = [ROOT, *(path.resolve() for path in args.compare_checkout)]
    runs = {str(tree): {length: [] for length in args.lengths} for tree in trees}
    for _ in range(args.rounds):
        for tree in trees:
            measured = measure_in(tree, "prefill_step", f"m.measure({args.lengths}, {args.prompts}, {args.threads})")
            for length, seconds in measured["seconds"].items():
                runs[str(tree)][int(length)].extend(seconds)
    report = {"threads": args.threads, "trees": {tree: {length: {
        "best_s": min(seconds), "median_s": statistics.median(seconds), "runs_s": seconds,
    } for length, seconds in by_length.items()} for tree, by_length in runs.items()}}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "prefill-step.json").write_text(json.dumps(report, indent=2) + "\n")
    for tree, by_length in report["trees"].items():
        print(f"{tree}: " + ", ".join(f"{length} tokens {figures['median_s'] * 1000:.1f} ms median "
                                      f"({figures['best_s'] * 1000:.1f} best)" for length, figures in by_length.items()))


if __name__ == "__main__":
    main()
