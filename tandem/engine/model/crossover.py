"""Where a CPU step stops reading the decode copy of the weights, measured on this machine.

A step of few rows is bound by reading the weights, so the decode copy (int8 or float16, a quarter or half
the bytes) wins there, and a step of decodes alone runs every layer in one kernel call. A step of many rows
is bound by arithmetic, where oneDNN's kernels on the batched weights win (bfloat16 ones where the CPU
multiplies bfloat16). Where the two cross depends on the CPU, the model's shape, the two formats and the
threads, so it is timed on whole decode steps, once for each such combination on a machine, and kept in
``$TANDEM_HOME/kernels/decode-rows.json``. ``make bench-weights`` reports it beside the per-layer timings.

A copy that wins every step size up to the largest decode step may win on prompt chunks too, and so may uint4
weights wherever they are the copy: a chunk's rows, rounded to int8, multiply them in integers (with AVX512-VNNI,
four products an instruction), which beats float32 weights everywhere and bfloat16 ones on some CPUs. How far, in
rows, is timed on a prompt chunk through one whole decoder layer, not its linears alone, so that what the rows
around them cost counts too: float32 on the copy's path, bfloat16 beside bfloat16 batched weights. The figure is
kept in the same file.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from tandem.model_files import tandem_home

logger = logging.getLogger(__name__)

# The step sizes timed, in rows. A step of more rows than the largest reads the batched weights.
LADDER = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)
# The prompt chunk sizes timed where the copy may win on them, up to the longest chunk a step takes by default
# (SchedulerConfig.max_prefill_step_tokens).
PROMPT_LADDER = (128, 256, 512, 1024, 2048, 4096)
REPEATS = 5  # timed runs of each path at each size, interleaved; the median counts


def measured_decode_rows(combination: dict, time_step: Callable[[int, bool], None], max_rows: int) -> int:
    """The most rows on ``LADDER`` (up to ``max_rows``) at which a step on the decode copy beats the same step
    on the batched weights, as must every smaller size: the figure recorded for ``combination`` (what the
    timing depends on, JSON-ready), or else timed now and recorded. ``time_step(rows, decode_copy)`` runs
    one step of ``rows`` decodes on either path."""
    return _measured(combination, lambda: _decode_crossover(time_step, max_rows))


def measured_prompt_rows(combination: dict, time_layer: Callable[[int, bool], None]) -> int:
    """The most rows on ``PROMPT_LADDER`` up to which the decode copy's times, summed over the ladder, stay
    below the batched weights' (0 where it loses at the first size), recorded beside the decode steps'
    figure: ``time_layer(rows, decode_copy)`` runs a prompt chunk of ``rows`` tokens through one decoder layer
    on either path. Both paths cost about the same per row at nearby chunk sizes, so the sum decides on all the
    ladder's timings at once, not on the first that a stall of the host turned."""
    return _measured({**combination, "path": "prompt layer"}, lambda: _prompt_crossover(time_layer))


def copy_may_win_prompts(decode_rows: int, decode_weights: str) -> bool:
    """Whether prompt chunks are worth timing on the decode copy (``decode_weights``, as "uint4+int8"): where it
    won every decode step (``decode_rows``), or where its layers are uint4, whose chunks' rows, rounded to int8,
    multiply them in a kernel of their own."""
    return decode_rows == LADDER[-1] or "uint4" in decode_weights


def recorded_crossovers() -> Path:
    """Where this machine keeps the crossovers it has timed, one per combination."""
    return tandem_home() / "kernels" / "decode-rows.json"


def _measured(combination: dict, measure: Callable[[], int]) -> int:
    path = recorded_crossovers()
    key = json.dumps(combination, sort_keys=True)
    recorded = _read(path)
    if key in recorded:
        return recorded[key]
    rows = measure()
    _record(path, key, rows)
    logger.info("steps of up to %d rows read the decode copy of the weights (measured here for %s)", rows, key)
    return rows


def _decode_crossover(time_step: Callable[[int, bool], None], max_rows: int) -> int:
    rows = 0
    for size in (size for size in LADDER if size <= max_rows):
        decode_copy_s, batched_s = step_seconds(time_step, size)
        if decode_copy_s > batched_s:
            break
        rows = size
    return rows


def _prompt_crossover(time_layer: Callable[[int, bool], None]) -> int:
    rows, decode_copy_total, batched_total = 0, 0.0, 0.0
    for size in PROMPT_LADDER:
        decode_copy_s, batched_s = step_seconds(time_layer, size)
        decode_copy_total, batched_total = decode_copy_total + decode_copy_s, batched_total + batched_s
        if decode_copy_total <= batched_total:
            rows = size
    return rows


def step_seconds(time_step: Callable[[int, bool], None], rows: int) -> tuple[float, float]:
    """The median of ``REPEATS`` steps of ``rows`` decodes on the decode copy and on the batched weights, the
    two interleaved after a warm-up step each, so that a stall of the host in one run decides nothing."""
    seconds = {True: [], False: []}
    for decode_copy in (True, False):
        time_step(rows, decode_copy)
    for _ in range(REPEATS):
        for decode_copy in (True, False):
            start = time.perf_counter()
            time_step(rows, decode_copy)
            seconds[decode_copy].append(time.perf_counter() - start)
    return statistics.median(seconds[True]), statistics.median(seconds[False])


def _read(path: Path) -> dict[str, int]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _record(path: Path, key: str, rows: int) -> None:
    """Add the figure to the file, replaced whole so that a reader never sees half of it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    recorded = {**_read(path), key: rows}
    with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as file:
        json.dump(recorded, file, indent=1, sort_keys=True)
    os.replace(file.name, path)
