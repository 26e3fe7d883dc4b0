"""The real default model (SmolLM2-135M-Instruct): greedy output equals transformers' generate."""

from __future__ import annotations

import pytest

from tandem.model_files import resolve_model
from tests.engine.helpers import greedy_request, hf_greedy, make_engine, output_tokens, run_to_completion

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def default_model_dir():
    return resolve_model(None)


def test_default_model_matches_generate_with_prefix_hits_and_chunked_prefill(default_model_dir):
    engine = make_engine(default_model_dir, max_num_batched_tokens=48)
    tokenizer = engine.tokenizer
    system = tokenizer.apply_chat_template(
        [{"role": "system", "content": "You are a concise assistant. Answer in one short sentence."}],
        tokenize=True, return_dict=False,
    )
    questions = ["What is the capital of France?", "Name a prime number.", "What colour is the sky?"]
    engine.add_request(greedy_request("warm", system + tokenizer("Hi")["input_ids"], 2))
    run_to_completion(engine)

    prompts = {f"q{i}": system + tokenizer(q)["input_ids"] for i, q in enumerate(questions)}
    for req_id, prompt in prompts.items():
        engine.add_request(greedy_request(req_id, prompt, 16))
    outputs = run_to_completion(engine)
    for req_id, prompt in prompts.items():
        assert outputs[req_id][-1].stats.num_cached_tokens >= len(system) // 16 * 16
        assert output_tokens(outputs[req_id]) == hf_greedy(default_model_dir, prompt, 16), req_id
