"""The quality gate that low-precision weights pass to be the default, on the default model.

The weights that decode steps read (``--decode-weights``) against float32 weights for every step:
perplexity on a fixed text (scored one position per step, the shape of a single stream's decode steps)
within 2%, for float16 and int8; and, for the default (float16), greedy continuations of 64 tokens for
16 prompts, each request alone, matching on at least 90% of the tokens. int8 keeps the perplexity but
not the greedy tokens (docs/engine.md, "Low-precision weights"), which is why it is not the default.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tandem.engine.config import DEFAULT_DECODE_WEIGHTS, CacheConfig, SchedulerConfig
from tandem.engine.model.cpu_kernels import BlockTables
from tandem.engine.model.factory import build_engine
from tandem.engine.model.llama import AttentionMetadata
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
LOW_PRECISION = ("float16", "int8")


def engine_with(decode_weights: str):
    return build_engine(None, "cpu", "float32", SchedulerConfig(max_active_requests=1),
                        CacheConfig(num_kv_blocks=64), calibrate=False, decode_weights=decode_weights)


def one_row_perplexity(engine, tokens: list[int]) -> float:
    """Perplexity of ``tokens``, each position scored in a step of its own over the cached context."""
    runner = engine.executor
    blocks = torch.arange(runner.num_kv_blocks)  # position p in slot p
    nll = 0.0
    with torch.inference_mode():
        for position in range(len(tokens) - 1):
            meta = AttentionMetadata(slot_mapping=torch.tensor([position]), num_decodes=1,
                                     decode_slots=torch.arange(position + 1),
                                     decode_mask=torch.ones(1, 1, 1, position + 1, dtype=torch.bool), prefills=[],
                                     decode_block_tables=BlockTables([blocks], [position + 1], runner.block_size))
            logits = runner.model(torch.tensor([tokens[position]]), torch.tensor([position]), runner.k_cache,
                                  runner.v_cache, meta, torch.tensor([0]), runner.cos_table, runner.sin_table)
            nll -= torch.log_softmax(logits[0], dim=-1)[tokens[position + 1]].item()
    return math.exp(nll / (len(tokens) - 1))


def greedy_continuations(engine) -> list[list[int]]:
    for index, prompt in enumerate(PROMPTS):
        engine.add_request(greedy_request(f"q{index}", engine.tokenizer.encode(prompt), NEW_TOKENS))
    outputs = run_to_completion(engine)
    return [output_tokens(outputs[f"q{index}"]) for index in range(len(PROMPTS))]


@pytest.fixture(scope="module")
def measured():
    results = {}
    for decode_weights in ("float32", *LOW_PRECISION):
        engine = engine_with(decode_weights)
        assert engine.executor.decode_dtype == getattr(torch, decode_weights), "the CPU kernels did not load"
        tokens = engine.tokenizer.encode(TEXT)
        gated = decode_weights in ("float32", DEFAULT_DECODE_WEIGHTS)
        results[decode_weights] = (one_row_perplexity(engine, tokens), greedy_continuations(engine) if gated else None)
        del engine
    return results


@pytest.mark.parametrize("decode_weights", LOW_PRECISION)
def test_decode_weights_keep_perplexity_within_two_percent(measured, decode_weights):
    reference, candidate = measured["float32"][0], measured[decode_weights][0]
    print(f"perplexity: float32 {reference:.4f}, {decode_weights} decode weights {candidate:.4f} "
          f"({100 * (candidate / reference - 1):+.2f}%)")
    assert reference < 60  # the text is ordinary English; a broken scorer would not get here
    assert abs(candidate / reference - 1) <= 0.02


def test_the_default_decode_weights_keep_ninety_percent_of_greedy_tokens(measured):
    decode_weights = DEFAULT_DECODE_WEIGHTS
    reference, candidate = measured["float32"][1], measured[decode_weights][1]
    assert all(len(tokens) == NEW_TOKENS for tokens in reference + candidate)
    matching = sum(a == b for ref, cand in zip(reference, candidate) for a, b in zip(ref, cand))
    share = matching / (NEW_TOKENS * len(PROMPTS))
    print(f"greedy tokens of {decode_weights} decode weights matching float32: {share:.1%} ({sum(r == c for r, c in zip(reference, candidate))} of "
          f"{len(PROMPTS)} continuations identical)")
    assert share >= 0.90
