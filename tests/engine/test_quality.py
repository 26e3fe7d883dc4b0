"""The quality gate a weight format passes to be offered, on the default model.

Measured as the field measures quantization (``tandem.engine.model.quality``): teacher-forced, against
float32 weights for every step, at every position of a fixed text and of 16 prompts. Each low-precision
decode format (``--decode-weights``) is scored with each position in a step of its own, through the kernels a
single stream's decode steps run; the default formats also with the positions in prefill chunks of ``CHUNK``
rows, through the kernels prefill steps run (uint4 layers or the batched weights). Each must keep the
perplexity within 1%, the mean KL divergence of its next-token distribution from float32's at most 0.01 nats,
and the top-1 token at 95% of positions or more.

Greedy continuations of 64 tokens for the 16 prompts are reported beside it, not gated: one flipped
near-tie sends a continuation its own way for good (docs/engine.md, "The quality gate").
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tandem.engine.config import CacheConfig, SchedulerConfig
from tandem.engine.model.factory import build_engine
from tandem.engine.model.quality import Quality, teacher_forced_logprobs
from tests.engine.helpers import greedy_request, output_tokens, run_to_completion

pytestmark = [pytest.mark.model, pytest.mark.slow]

TEXT = (Path(__file__).parent / "data" / "quality.txt").read_text()
PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "To make a cup of tea, first",
    "The three primary colours are",
    "def add(a, b):\n    return",
    "Photosynthesis is the process by which",
    "My favourite season is autumn because",
    "The meeting has been moved to Thursday, so",
    "Water boils at a temperature of",
    "Here is a short poem about the moon:\n",
    "The best way to learn a new language is",
    "In 1969, the first astronauts",
    "A list of fruits: apple, banana,",
    "The train was late again, and the passengers",
    "Dear customer, thank you for your order.",
    "The main difference between a virus and a bacterium is",
]
NEW_TOKENS = 64
# each low-precision --decode-weights and the decode copy it makes of the default model: auto keeps its layers,
# dequantized from the Q4_1 file it ships as, in uint4, and its output head, from Q8_0, in int8
LOW_PRECISION = {"float16": "float16", "int8": "int8", "auto": "uint4+int8"}
CHUNK = 256
SMALL_STEP = 16  # rows of a wide decode step: the decode copy's path where decode_rows reaches it


def engine_with(decode_weights: str):
    """float32 weights for the reference; beside the low-precision decode ones, the batched weights ``auto``
    picks here: bfloat16 on CPUs that multiply it natively, else float32."""
    batched = "float32" if decode_weights == "float32" else "auto"
    return build_engine(None, "cpu", "float32", SchedulerConfig(max_active_requests=1), CacheConfig(num_kv_blocks=128),
                        calibrate=False, decode_weights=decode_weights, batched_weights=batched)


def greedy_continuations(engine) -> list[list[int]]:
    for index, prompt in enumerate(PROMPTS):
        engine.add_request(greedy_request(f"q{index}", engine.tokenizer.encode(prompt), NEW_TOKENS))
    outputs = run_to_completion(engine)
    return [output_tokens(outputs[f"q{index}"]) for index in range(len(PROMPTS))]


@pytest.fixture(scope="module")
def measured():
    """Per decode-weight format: the log-probabilities at every position of the text and the prompts, scored
    one position a step and in chunks, and the greedy continuations of the prompts."""
    results = {}
    for decode_weights in ("float32", *LOW_PRECISION):
        engine = engine_with(decode_weights)
        assert engine.executor.decode_weights == LOW_PRECISION.get(decode_weights, "float32"), \
            "the CPU kernels did not load"
        sequences = [engine.tokenizer.encode(text) for text in (TEXT, *PROMPTS)]
        one_row, chunked, small_steps = (torch.cat([teacher_forced_logprobs(engine.executor, tokens, rows)
                                                    for tokens in sequences]) for rows in (1, CHUNK, SMALL_STEP))
        results[decode_weights] = (one_row, chunked, greedy_continuations(engine), small_steps)
        del engine
    targets = torch.tensor([token for tokens in sequences for token in tokens[1:]])
    return results, targets


def gated(quality: Quality) -> None:
    assert quality.positions > 1500 and quality.reference_perplexity < 60  # ordinary English, scored throughout
    assert quality.passes()


@pytest.mark.parametrize("decode_weights", LOW_PRECISION)
def test_decode_weights_pass_the_teacher_forced_gate(measured, decode_weights):
    results, targets = measured
    quality = Quality.of(results["float32"][0], results[decode_weights][0], targets)
    reference, candidate = results["float32"][2], results[decode_weights][2]
    matching = sum(a == b for ref, cand in zip(reference, candidate) for a, b in zip(ref, cand))
    print(f"{decode_weights} decode weights against float32: {quality.summary()}; greedy tokens matching "
          f"{matching / (NEW_TOKENS * len(PROMPTS)):.1%} ({sum(r == c for r, c in zip(reference, candidate))} of "
          f"{len(PROMPTS)} continuations identical)")
    gated(quality)


def test_the_default_passes_the_gate_in_prefill_chunks(measured):
    """Chunks of ``CHUNK`` rows take the path a prompt takes here with the default formats: the uint4 layers
    where they win at that size (``prompt_rows``), the rows rounded to int8, else the batched weights (bfloat16
    where the CPU multiplies it natively)."""
    results, targets = measured
    float32_chunked = Quality.of(results["float32"][0], results["float32"][1], targets)
    assert float32_chunked.mean_kl < 1e-6  # float32 scores the same in chunks as one position a step
    quality = Quality.of(results["float32"][0], results["auto"][1], targets)
    print(f"the default formats in chunks of {CHUNK} against float32: {quality.summary()}")
    gated(quality)


@pytest.mark.parametrize("decode_weights", ["int8", "auto"])
def test_integer_decode_weights_pass_the_gate_in_steps_of_many_rows(measured, decode_weights):
    """Steps of ``SMALL_STEP`` rows take the path such a step takes here: where ``decode_rows`` reaches them,
    the decode copy (int8 and uint4 in int16 rows; int8 in the AMX build in bfloat16 tiles) with each token
    attended as a decode, else the batched weights and a prefill chunk's attention."""
    results, targets = measured
    quality = Quality.of(results["float32"][0], results[decode_weights][3], targets)
    print(f"{decode_weights} decode weights in steps of {SMALL_STEP} rows against float32: {quality.summary()}")
    gated(quality)


def test_the_gate_tells_a_format_that_loses_the_distribution(measured):
    """The same figures, for log-probabilities scaled to a flatter distribution, fail the gate."""
    results, targets = measured
    reference = results["float32"][0]
    assert not Quality.of(reference, torch.log_softmax(reference * 0.8, dim=1), targets).passes()
