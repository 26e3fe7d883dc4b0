"""The engine's speed in each placement of this machine's CPUs on its host. On a virtual machine the host may move
the CPUs from one minute to the next: the two CPUs that a benchmark's two threads run on may share a last-level
cache or not, and a cache line's round trip between them (bench/round_trip.c) tells which: tens of ns on one L3,
several times that across two (another CCD of an AMD EPYC, another socket). Beside it, how fast the slower of the
two computes against the faster while both do (``slower_cpu_share``). In turns for ``--seconds``, each labelled
with those two: a step of 1 and of 8 decodes over about 600 positions (`make bench-step`'s shape), the step of 8
on one thread (no data crosses between CPUs), the bandwidth ``torch.sum`` reads memory at, and a fresh
512-token prompt's prefill through the prompt path the worker measured (``prompt_rows``) and through the batched
weights (``prompt_rows`` 0). Writes bench/results/placement.json.

    .venv/bin/python bench/placement.py --seconds 300
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import functools
import json
import os
import random
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
SOURCE = Path(__file__).with_name("round_trip.c")
TRIPS = 10_000
TRIALS = 5
MADD_STEPS = 100_000_000  # about a quarter of a second
ONE_L3_NS = 150  # round trips below this: both CPUs on one last-level cache


@functools.cache
def _library() -> ctypes.CDLL | None:
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        return None
    library = Path(tempfile.mkdtemp(prefix="round-trip-")) / "round_trip.so"
    built = subprocess.run([compiler, "-O2", "-shared", "-fPIC", "-pthread", str(SOURCE), "-o", str(library)],
                           capture_output=True, text=True)
    if built.returncode != 0:
        return None
    loaded = ctypes.CDLL(str(library))
    loaded.tandem_round_trip_ns.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long]
    loaded.tandem_round_trip_ns.restype = ctypes.c_double
    loaded.tandem_madd_rates.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.POINTER(ctypes.c_double)]
    return loaded


def _probe() -> tuple[ctypes.CDLL, int, int] | None:
    """bench/round_trip.c and the first two CPUs of this process; None with fewer than two CPUs or no C compiler."""
    cpus = sorted(os.sched_getaffinity(0))
    library = _library()
    if len(cpus) < 2 or library is None:
        return None
    return library, cpus[0], cpus[1]


def round_trip_ns() -> float | None:
    """The round trip between the first two CPUs of this process, in ns, the fastest of TRIALS (another thread
    spinning on one of the CPUs slows the others); None where there is no ``_probe`` or a thread may not be pinned."""
    probe = _probe()
    if probe is None:
        return None
    library, first, second = probe
    fastest = min(library.tandem_round_trip_ns(first, second, TRIPS) for _ in range(TRIALS))
    return round(fastest, 1) if fastest > 0 else None


def slower_cpu_share() -> float | None:
    """The slower of the first two CPUs' multiply-add rates, both computing at once, as a share of the faster's: 1
    where the host gives both the same, less where one shares its core or clock with other work; None where
    ``round_trip_ns`` is."""
    probe = _probe()
    rates = (ctypes.c_double * 2)()
    if probe is None or probe[0].tandem_madd_rates(probe[1], probe[2], MADD_STEPS, rates):
        return None
    return round(min(rates) / max(rates), 3)


def _line(figures: dict[str, float | None]) -> str:
    return ", ".join(f"{key} {'-' if value is None else format(value, '.4g')}" for key, value in figures.items())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=300)
    args = parser.parse_args()

    import torch

    from step_budget import read_bandwidth_gb_s, timed_steps
    from tandem.engine.config import CacheConfig, SchedulerConfig
    from tandem.engine.model.factory import build_engine
    from tandem.engine.request import Request
    from tandem.sampling import SamplingParams

    torch.set_num_threads(2)
    engine = build_engine(None, "cpu", "float32", SchedulerConfig(max_active_requests=8), CacheConfig(num_kv_blocks=1024))
    model = engine.executor.model
    measured_prompt_rows = model.prompt_rows
    paths = {"prefill_512_ms": measured_prompt_rows, "prefill_512_batched_weights_ms": 0}
    rng = random.Random(0)

    def prefill_ms(rows: int) -> float:
        model.prompt_rows = rows
        engine.add_request(Request(f"prefill-{rng.random()}", [rng.randrange(100, 40000) for _ in range(512)], 1,
                                   SamplingParams(temperature=0), ignore_eos=True))
        start = time.perf_counter()
        while engine.has_work():
            engine.step()
        return (time.perf_counter() - start) * 1000

    def one_thread_step_ms(rows: int) -> float:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return timed_steps(engine, rows, 20, collections.Counter())["step_ms"]
        finally:
            torch.set_num_threads(threads)

    for rows in paths.values():
        prefill_ms(rows)
    rounds = []
    end = time.monotonic() + args.seconds
    while time.monotonic() < end:
        entry = {"round_trip_ns": round_trip_ns(), "slower_cpu_share": slower_cpu_share(),
                 **{f"step_{rows}_rows_ms": timed_steps(engine, rows, 20, collections.Counter())["step_ms"]
                    for rows in (1, 8)},
                 "step_8_rows_one_thread_ms": one_thread_step_ms(8),
                 "read_gb_s": read_bandwidth_gb_s(3),
                 **{name: min(prefill_ms(rows) for _ in range(2)) for name, rows in paths.items()}}
        rounds.append(entry)
        print(time.strftime("%H:%M:%S"), _line(entry), flush=True)
    placements = collections.defaultdict(list)
    for entry in rounds:
        if entry["round_trip_ns"] is not None:
            placements["one L3" if entry["round_trip_ns"] < ONE_L3_NS else "two L3s"].append(entry)
    summary = {placement: {"rounds": len(entries),
                           **{key: statistics.median(e[key] for e in entries) for key in entries[0]}}
               for placement, entries in placements.items()}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "placement.json").write_text(json.dumps({"prompt_rows": measured_prompt_rows,
                                                        "medians": summary, "rounds": rounds}, indent=2) + "\n")
    for placement, medians in summary.items():
        print(f"{placement}: {_line(medians)}")


if __name__ == "__main__":
    main()
