"""Greedy output matches transformers' generate token for token, in every scheduling situation."""

from __future__ import annotations

import pytest

from tests.engine.helpers import (
    assert_no_leaks,
    greedy_request,
    hf_greedy,
    make_engine,
    output_tokens,
    random_prompt,
    run_to_completion,
)


@pytest.mark.parametrize("prefill_step_tokens", [32, 96])  # one budget; a larger one where no request decodes
def test_concurrent_requests_of_different_lengths_with_chunked_prefill(tiny_model, prefill_step_tokens):
    engine = make_engine(tiny_model, max_num_batched_tokens=32, max_prefill_step_tokens=prefill_step_tokens)
    prompts = {f"r{i}": random_prompt(engine, length, seed=i) for i, length in enumerate((3, 17, 40, 100, 64))}
    for req_id, prompt in prompts.items():
        engine.add_request(greedy_request(req_id, prompt, 24))
    outputs = run_to_completion(engine)
    for req_id, prompt in prompts.items():
        assert output_tokens(outputs[req_id]) == hf_greedy(tiny_model, prompt, 24), req_id
    assert_no_leaks(engine)


def test_prefix_hits_reuse_blocks_and_keep_outputs_exact(tiny_model):
    engine = make_engine(tiny_model)
    prefix = random_prompt(engine, 48, seed=7)
    engine.add_request(greedy_request("warm", prefix + [5, 6, 7], 4))
    run_to_completion(engine)

    prompts = {f"r{i}": prefix + random_prompt(engine, 5 + i, seed=100 + i) for i in range(4)}
    predicted = {req_id: engine.cached_prefix(prompt).tokens for req_id, prompt in prompts.items()}
    for req_id, prompt in prompts.items():
        engine.add_request(greedy_request(req_id, prompt, 16))
    outputs = run_to_completion(engine)
    for req_id, prompt in prompts.items():
        final = outputs[req_id][-1]
        assert predicted[req_id] == 48
        assert final.stats.num_cached_tokens == predicted[req_id]
        assert output_tokens(outputs[req_id]) == hf_greedy(tiny_model, prompt, 16), req_id
    assert_no_leaks(engine)


def test_full_prompt_hit_still_computes_last_token(tiny_llama):
    engine = make_engine(tiny_llama)
    prompt = random_prompt(engine, 64, seed=3)
    engine.add_request(greedy_request("first", prompt, 8))
    first = run_to_completion(engine)["first"]
    assert engine.cached_prefix(prompt).tokens == 48  # capped below len - 1 at a block boundary
    engine.add_request(greedy_request("again", prompt, 8))
    again = run_to_completion(engine)["again"]
    assert again[-1].stats.num_cached_tokens == 48
    assert output_tokens(again) == output_tokens(first) == hf_greedy(tiny_llama, prompt, 8)


def test_eviction_and_preemption_under_memory_pressure_keep_outputs_exact(tiny_model):
    # 14 blocks of 16 tokens cannot hold four 40-token prompts growing by 48 tokens each.
    engine = make_engine(tiny_model, num_kv_blocks=14, max_active_requests=4)
    prompts = {f"r{i}": random_prompt(engine, 40, seed=20 + i) for i in range(4)}
    for req_id, prompt in prompts.items():
        engine.add_request(greedy_request(req_id, prompt, 48))
    outputs = run_to_completion(engine)
    assert sum(outputs[req_id][-1].stats.num_preemptions for req_id in prompts) > 0
    for req_id, prompt in prompts.items():
        assert output_tokens(outputs[req_id]) == hf_greedy(tiny_model, prompt, 48), req_id
    assert_no_leaks(engine)


def test_evicted_prefix_is_recomputed_correctly(tiny_llama):
    engine = make_engine(tiny_llama, num_kv_blocks=12)
    prefix = random_prompt(engine, 64, seed=11)
    engine.add_request(greedy_request("warm", prefix + [9], 4))
    run_to_completion(engine)
    assert engine.cached_prefix(prefix + [9]).tokens == 64
    engine.add_request(greedy_request("flood", random_prompt(engine, 150, seed=12), 30))
    run_to_completion(engine)
    assert engine.cached_prefix(prefix + [9]).tokens < 64
    engine.add_request(greedy_request("after", prefix + [9], 12))
    outputs = run_to_completion(engine)
    assert output_tokens(outputs["after"]) == hf_greedy(tiny_llama, prefix + [9], 12)


def test_steps_of_decodes_through_cuda_graphs_keep_outputs_exact(tiny_model):
    """Steps of 3 decodes padded to graphs of 4 rows, contexts crossing from the 256-position graph to the
    512 one, and a request joining late: on CUDA replayed from captured graphs, elsewhere the same padded
    steps run eagerly."""
    engine = make_engine(tiny_model, cuda_graphs=True, max_active_requests=4)
    prompts = {f"r{i}": random_prompt(engine, length, seed=40 + i) for i, length in enumerate((250, 30, 120))}
    for req_id, prompt in prompts.items():
        engine.add_request(greedy_request(req_id, prompt, 24))
    outputs: dict[str, list] = {}
    for _ in range(12):
        for output in engine.step():
            outputs.setdefault(output.req_id, []).append(output)
    prompts["late"] = random_prompt(engine, 20, seed=50)
    engine.add_request(greedy_request("late", prompts["late"], 8))
    for req_id, later in run_to_completion(engine).items():
        outputs.setdefault(req_id, []).extend(later)
    for req_id, prompt in prompts.items():
        assert output_tokens(outputs[req_id]) == hf_greedy(tiny_model, prompt, 24 if req_id != "late" else 8), req_id
    assert {(4, 256), (4, 512)} <= engine.executor.decode_graphs.shapes
    assert_no_leaks(engine)


def test_cuda_graphs_follow_the_device_unless_asked(tiny_llama):
    from tandem.worker.config import parse_config
    from tests.device import TEST_DEVICE

    assert (make_engine(tiny_llama).executor.decode_graphs is not None) == TEST_DEVICE.startswith("cuda")
    assert make_engine(tiny_llama, cuda_graphs=False).executor.decode_graphs is None
    assert [parse_config("gpu", 50061, argv).cuda_graphs for argv in ([], ["--cuda-graphs", "on"],
                                                                       ["--cuda-graphs", "off"])] == [None, True, False]


def test_samples_of_one_prompt_compute_it_once_and_share_its_blocks(tiny_llama):
    engine = make_engine(tiny_llama, max_active_requests=4)
    prompt = random_prompt(engine, 100, seed=60)
    samples = greedy_request("s", prompt, 8).samples(4)
    for sample in samples:
        engine.add_request(sample)
    outputs, peak_blocks = {}, 0
    while engine.has_work():
        for output in engine.step():
            outputs.setdefault(output.req_id, []).append(output)
        peak_blocks = max(peak_blocks, engine.scheduler.pool.num_used_blocks)
    expected = hf_greedy(tiny_llama, prompt, 8)
    assert [output_tokens(outputs[sample.req_id]) for sample in samples] == [expected] * 4
    # The first computes the prompt; the others find its 6 full blocks cached and compute the 4 tokens after.
    assert [outputs[sample.req_id][-1].stats.num_cached_tokens for sample in samples] == [0, 96, 96, 96]
    # 108 tokens each: the first's 7 blocks, and one block of its own for each other sample.
    assert peak_blocks == 7 + 3
    assert_no_leaks(engine)
