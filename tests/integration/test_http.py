"""The router's OpenAI-compatible HTTP front end, driven by the real ``openai`` package (sync and async) and by
raw HTTP, in front of two real workers on 127.0.0.1."""

from __future__ import annotations

import json
import re
import threading
from typing import Literal

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tandem.launch import free_port
from tests.integration.test_reliability import assert_no_leaks
from tests.integration.workers import (
    HARNESS, NOT_SERVING, SERVING, RouterProcess, WorkerProcess, running_worker, scrape_metrics, serving_router,
    stopped, wait_until,
)

ALIAS = "tandem-tiny"


def http_router(model, log_path, workers, *args) -> tuple[RouterProcess, str]:
    port = free_port()
    router = RouterProcess(model, log_path, workers, "--http-port", str(port), *args)
    return router, f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def stack(tiny_llama, tmp_path_factory):
    logs = tmp_path_factory.mktemp("http")
    with running_worker(tiny_llama, logs / "cpu.log") as cpu, \
            running_worker(tiny_llama, logs / "gpu.log", module_kind="gpu") as gpu:
        router, url = http_router(tiny_llama, logs / "router.log", [f"cpu=cpu@{cpu.address}", f"gpu=gpu@{gpu.address}"],
                                  "--served-model-name", ALIAS, "--metrics-port", str(free_port()))
        with serving_router(router, {"cpu", "gpu"}):
            yield router, url, {"cpu": cpu, "gpu": gpu}


@pytest.fixture(scope="module")
def client(stack):
    _, url, _ = stack
    with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120) as client:
        yield client


GREEDY = dict(temperature=0, max_tokens=6, extra_body={"ignore_eos": True})
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hello"}]


def test_models_lists_the_served_model_and_its_alias(client, tiny_llama):
    models = client.models.list()
    assert [m.id for m in models.data] == [tiny_llama.name, ALIAS]
    assert all(m.object == "model" for m in models.data)


def test_chat_completion_with_usage_finish_reason_and_the_chosen_worker(client):
    raw = client.chat.completions.with_raw_response.create(model=ALIAS, messages=CHAT, **GREEDY)
    completion = raw.parse()
    assert raw.headers["x-tandem-worker"] in ("cpu", "gpu") and raw.headers["x-request-id"]
    assert completion.object == "chat.completion" and completion.model == ALIAS
    choice = completion.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    assert completion.usage.completion_tokens == 6
    assert completion.usage.total_tokens == completion.usage.prompt_tokens + 6
    assert completion.usage.prompt_tokens_details.cached_tokens >= 0


def test_streamed_chat_equals_the_whole_one_and_carries_usage_last(client):
    whole = client.chat.completions.create(model=ALIAS, messages=CHAT, **GREEDY)
    chunks = list(client.chat.completions.create(model=ALIAS, messages=CHAT, stream=True,
                                                 stream_options={"include_usage": True}, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert all(c.usage is None for c in chunks[:-1])
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == 6
    assert usage_chunk.usage.prompt_tokens == whole.usage.prompt_tokens
    finishing = chunks[-2].choices[0]
    assert finishing.finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-2])
    text = "".join(c.choices[0].delta.content or "" for c in chunks[:-1])
    assert text == whole.choices[0].message.content


def test_text_parts_are_joined_like_a_string(client):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Say"}, {"type": "text", "text": "hello"}]}]
    joined = [{"role": "user", "content": "Say\nhello"}]
    a = client.chat.completions.create(model=ALIAS, messages=parts, **GREEDY)
    b = client.chat.completions.create(model=ALIAS, messages=joined, **GREEDY)
    assert a.usage.prompt_tokens == b.usage.prompt_tokens and a.choices[0].message.content == b.choices[0].message.content


def test_completions_from_text_and_from_token_ids(client, tiny_llama):
    text = client.completions.create(model=tiny_llama.name, prompt="The quick brown fox", **GREEDY)
    assert text.object == "text_completion" and text.choices[0].finish_reason == "length"
    ids = list(range(20, 40))
    whole = client.completions.create(model=tiny_llama.name, prompt=ids, **GREEDY)
    assert whole.usage.prompt_tokens == 20 and whole.usage.completion_tokens == 6
    streamed = list(client.completions.create(model=tiny_llama.name, prompt=ids, stream=True, **GREEDY))
    assert "".join(c.choices[0].text for c in streamed) == whole.choices[0].text
    assert streamed[-1].choices[0].finish_reason == "length"
    assert all(not hasattr(c, "usage") or c.usage is None for c in streamed)


def test_a_repeated_prompt_reports_cached_tokens(client):
    # cache_aware goes where the prompt is cached, as the router knows it the moment the first request was
    # sent (an expected hit): finish_time may rightly prefer the other worker once the first request's step
    # times moved its step model.
    ids = list(range(50, 98))
    cache_aware = {**GREEDY, "extra_body": {**GREEDY["extra_body"], "tandem": {"policy": "cache_aware"}}}
    client.completions.create(model=ALIAS, prompt=ids, **cache_aware)
    again = client.completions.create(model=ALIAS, prompt=ids, **cache_aware)
    assert again.usage.prompt_tokens_details.cached_tokens >= 32


async def test_the_async_client_streams(stack):
    _, url, _ = stack
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120) as client:
        stream = await client.chat.completions.create(model=ALIAS, messages=CHAT, stream=True, **GREEDY)
        chunks = [chunk async for chunk in stream]
        completion = await client.completions.create(model=ALIAS, prompt=[1, 2, 3], **GREEDY)
    assert chunks[-1].choices[0].finish_reason == "length"
    assert completion.usage.completion_tokens == 6


@pytest.mark.parametrize("fields, param", [
    (dict(n=17), "n"),
    (dict(top_logprobs=2), "top_logprobs"),
    (dict(logprobs=True, top_logprobs=21), "top_logprobs"),
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty="much"), "frequency_penalty"),
    (dict(logit_bias={"x": 1}), "logit_bias"),
    (dict(logit_bias={"5": 101}), "logit_bias.5"),
    (dict(logit_bias={"99999999": 1}), "logit_bias"),
    (dict(extra_body={"min_tokens": 5}), "min_tokens"),
    (dict(extra_body={"repetition_penalty": 0}), "repetition_penalty"),
    (dict(extra_body={"min_p": 2}), "min_p"),
    (dict(temperature=-1), "temperature"),
    (dict(top_p=0), "top_p"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(extra_body={"tandem": {"policy": "fastest"}}), "tandem.policy"),
    (dict(extra_body={"tandem": {"length_key": "k" * 200}}), "tandem.length_key"),
    (dict(extra_body={"no_such_field": 1}), "no_such_field"),
    (dict(messages=[{"role": "robot", "content": "hi"}]), "messages.0.role"),
])
def test_a_field_the_server_does_not_honour_is_a_bad_request_naming_it(client, fields, param):
    request = dict(model=ALIAS, messages=CHAT, max_tokens=4)
    request.update(fields)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**request)
    assert info.value.status_code == 400
    assert info.value.body["param"] == param, info.value.body


def test_chat_logprobs_whole_and_streamed(client):
    whole = client.chat.completions.create(model=ALIAS, messages=CHAT, logprobs=True, top_logprobs=2, **GREEDY)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens == 6
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].token == entry.token and entry.top_logprobs[0].logprob == entry.logprob  # greedy
        assert entry.bytes == list(entry.token.encode())
    stream = client.chat.completions.create(model=ALIAS, messages=CHAT, logprobs=True, top_logprobs=2, stream=True,
                                            **GREEDY)
    streamed = [entry for chunk in stream if chunk.choices and chunk.choices[0].logprobs
                for entry in chunk.choices[0].logprobs.content]
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == [(e.token, round(e.logprob, 4)) for e in content]
    plain = client.chat.completions.create(model=ALIAS, messages=CHAT, **GREEDY)
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == whole.choices[0].message.content


def test_completion_logprobs_in_the_legacy_shape(client):
    completion = client.completions.create(model=ALIAS, prompt=[1, 2, 3], logprobs=3, **GREEDY)
    logprobs = completion.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 6
    assert all(len(top) <= 3 and max(top.values()) == lp for top, lp in zip(logprobs.top_logprobs, logprobs.token_logprobs))
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(6)]


def test_penalties_at_their_defaults_change_nothing_and_a_logit_bias_forces_a_token(client):
    plain = client.completions.create(model=ALIAS, prompt=[1, 2, 3], **GREEDY)
    neutral = client.completions.create(model=ALIAS, prompt=[1, 2, 3], presence_penalty=0, frequency_penalty=0,
                                        logit_bias={}, **{**GREEDY, "extra_body": {
                                            "ignore_eos": True, "repetition_penalty": 1, "min_p": 0, "min_tokens": 0}})
    assert neutral.choices[0].text == plain.choices[0].text
    forced = client.completions.create(model=ALIAS, prompt=[1, 2, 3], logit_bias={"42": 100}, logprobs=0, **GREEDY)
    assert forced.usage.completion_tokens == 6
    penalised = client.completions.create(model=ALIAS, prompt=[1, 2, 3], logit_bias={"42": 100},
                                          presence_penalty=2, frequency_penalty=2, **GREEDY)
    assert penalised.usage.completion_tokens == 6
    tokens = client.completions.create(model=ALIAS, prompt=[1, 2, 3], logit_bias={"42": 100}, logprobs=0,
                                       **{**GREEDY, "extra_body": {"ignore_eos": True, "return_tokens_as_token_ids": True}})
    assert tokens.choices[0].logprobs.tokens == ["token_id:42"] * 6


def test_min_tokens_outlasts_a_stop_token(client):
    first = client.completions.create(model=ALIAS, prompt=[1, 2, 3], logprobs=0, **{**GREEDY, "extra_body": {
        "ignore_eos": True, "return_tokens_as_token_ids": True}}).choices[0].logprobs.tokens[0]
    stop = {"stop_token_ids": [int(first.removeprefix("token_id:"))]}
    stopped = client.completions.create(model=ALIAS, prompt=[1, 2, 3], **{**GREEDY, "extra_body": stop})
    held = client.completions.create(model=ALIAS, prompt=[1, 2, 3], **{**GREEDY, "extra_body": {**stop, "min_tokens": 3}})
    assert stopped.usage.completion_tokens == 1 and held.usage.completion_tokens >= 3


def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(client):
    stream = client.completions.create(model=ALIAS, prompt=[1, 2, 3], stream=True, **{**GREEDY, "extra_body": {
        "ignore_eos": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}})
    chunks = list(stream)
    counts = [chunk.usage.completion_tokens for chunk in chunks]
    assert all(chunk.usage.prompt_tokens == 3 for chunk in chunks)
    assert counts == sorted(counts) and counts[-1] == 6


def test_a_seed_reproduces_a_sampled_completion(client):
    sampled = dict(model=ALIAS, prompt=[1, 2, 3], temperature=1.0, max_tokens=8, seed=11, presence_penalty=0.5)
    assert client.completions.create(**sampled).choices[0].text == client.completions.create(**sampled).choices[0].text


def test_a_list_of_prompts_gets_one_choice_each_in_order(client):
    texts = ["The sky is", "Once upon a time", "Hello"]
    alone = [client.completions.create(model=ALIAS, prompt=text, **GREEDY) for text in texts]
    batch = client.completions.create(model=ALIAS, prompt=texts, **GREEDY)
    assert [choice.index for choice in batch.choices] == [0, 1, 2]
    assert [choice.text for choice in batch.choices] == [one.choices[0].text for one in alone]
    assert batch.usage.prompt_tokens == sum(one.usage.prompt_tokens for one in alone)
    assert batch.usage.completion_tokens == 18
    ids = client.completions.create(model=ALIAS, prompt=[[1, 2, 3], [4, 5]], **GREEDY)
    assert [c.text for c in ids.choices] == [client.completions.create(model=ALIAS, prompt=p, **GREEDY).choices[0].text
                                             for p in ([1, 2, 3], [4, 5])]
    stream = client.completions.create(model=ALIAS, prompt=texts, stream=True, stream_options={"include_usage": True},
                                       **GREEDY)
    streamed, usage = {}, None
    for chunk in stream:
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
        usage = chunk.usage or usage
    assert [streamed[index] for index in range(3)] == [choice.text for choice in batch.choices]
    assert usage.completion_tokens == 18


def test_n_choices_per_prompt_whole_and_streamed(client):
    greedy = client.chat.completions.create(model=ALIAS, messages=CHAT, n=3, logprobs=True, **GREEDY)
    alone = client.chat.completions.create(model=ALIAS, messages=CHAT, **GREEDY)
    assert [c.index for c in greedy.choices] == [0, 1, 2]
    assert {c.message.content for c in greedy.choices} == {alone.choices[0].message.content}
    assert all(len(c.logprobs.content) == 6 for c in greedy.choices)
    assert greedy.usage.prompt_tokens == alone.usage.prompt_tokens and greedy.usage.completion_tokens == 18
    sampled = dict(model=ALIAS, prompt=["The sky is", "Hello"], n=2, temperature=1.0, seed=5, max_tokens=8,
                   extra_body={"ignore_eos": True})
    whole = client.completions.create(**sampled)
    assert [c.index for c in whole.choices] == [0, 1, 2, 3]
    assert whole.choices[0].text != whole.choices[1].text  # sample i draws with seed + i
    # Each sample is the request seeded seed + i, alone.
    assert whole.choices[1].text == client.completions.create(**{**sampled, "prompt": "The sky is", "n": 1,
                                                                 "seed": 6}).choices[0].text
    stream = client.completions.create(**sampled, stream=True, stream_options={"include_usage": True})
    streamed, finished, usage = {}, {}, None
    for chunk in stream:
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
            finished[choice.index] = choice.finish_reason or finished.get(choice.index)
        usage = chunk.usage or usage
    assert [streamed[i] for i in range(4)] == [c.text for c in whole.choices]
    assert set(finished.values()) == {"length"} and usage.completion_tokens == 32
    assert usage.prompt_tokens == whole.usage.prompt_tokens


def test_echo_repeats_the_prompt_with_its_logprobs_as_lm_eval_reads_them(client, tiny_llama):
    plain = client.completions.create(model=ALIAS, prompt="The sky is blue", logprobs=1, **GREEDY)
    echoed = client.completions.create(model=ALIAS, prompt="The sky is blue", logprobs=1, echo=True, **GREEDY)
    choice = echoed.choices[0]
    assert choice.text == "The sky is blue" + plain.choices[0].text
    logprobs, prompt_tokens = choice.logprobs, echoed.usage.prompt_tokens
    assert len(logprobs.tokens) == prompt_tokens + 6
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert all(lp <= 0 for lp in logprobs.token_logprobs[1:])
    assert logprobs.token_logprobs[prompt_tokens:] == pytest.approx(plain.choices[0].logprobs.token_logprobs, abs=1e-4)
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(len(logprobs.tokens))]
    stream = client.completions.create(model=ALIAS, prompt="The sky is blue", logprobs=1, echo=True, stream=True,
                                       **GREEDY)
    streamed = [lp for chunk in stream for c in chunk.choices if c.logprobs for lp in c.logprobs.token_logprobs]
    assert streamed[0] is None and streamed[1:] == pytest.approx(logprobs.token_logprobs[1:], abs=1e-4)
    from transformers import AutoTokenizer

    prompt_text = AutoTokenizer.from_pretrained(tiny_llama).decode([5, 6, 7])
    assert client.completions.create(model=ALIAS, prompt=[5, 6, 7], echo=True, **GREEDY).choices[0].text.startswith(
        prompt_text)


@pytest.mark.parametrize("fields, param", [
    (dict(prompt=["a"] * 257), "prompt"),
    (dict(prompt=[[1, 2], []]), "prompt"),
    (dict(prompt="a", suffix="b"), "suffix"),
    (dict(prompt="a", logprobs=21), "logprobs"),
    (dict(prompt="a", echo="maybe"), "echo"),
    (dict(prompt="a", n=17), "n"),
    (dict(prompt="a", n=0), "n"),
    (dict(prompt="a", n=2, best_of=3), "best_of"),
])
def test_bad_completion_fields_are_a_bad_request_naming_them(client, fields, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=ALIAS, max_tokens=2, **fields)
    assert info.value.body["param"].split(".")[0] == param, info.value.body


def test_tokenize_and_detokenize_as_vllm_serves_them(stack, client, tiny_llama):
    from transformers import AutoTokenizer

    _, url, _ = stack
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    text = httpx.post(f"{url}/tokenize", json={"prompt": "Hello there", "return_token_strs": True}).json()
    assert text["tokens"] == tokenizer("Hello there")["input_ids"] and text["count"] == len(text["tokens"])
    assert text["max_model_len"] > 0 and len(text["token_strs"]) == text["count"]
    chat = httpx.post(f"{url}/tokenize", json={"model": ALIAS, "messages": CHAT}).json()
    assert chat["tokens"] == tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True,
                                                           return_dict=False)
    completion = client.chat.completions.create(model=ALIAS, messages=CHAT, **GREEDY)
    assert completion.usage.prompt_tokens == chat["count"]
    back = httpx.post(f"{url}/detokenize", json={"tokens": text["tokens"]}).json()
    assert back["prompt"] == tokenizer.decode(text["tokens"])
    for path, body, param in (("/tokenize", {}, "prompt"), ("/tokenize", {"prompt": "a", "messages": CHAT}, "prompt"),
                              ("/detokenize", {"tokens": [10**7]}, "tokens"), ("/detokenize", {"tokens": "x"}, "tokens"),
                              ("/tokenize", {"prompt": "a", "model": "nope"}, "model")):
        response = httpx.post(f"{url}{path}", json=body)
        assert response.status_code in (400, 404) and response.json()["error"]["param"] == param, response.text


def test_vllms_chat_rendering_extensions(client, tiny_llama):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    partial = [*CHAT, {"role": "assistant", "content": "Hello, I am"}]
    continued = client.chat.completions.create(model=ALIAS, messages=partial, **{**GREEDY, "extra_body": {
        "ignore_eos": True, "add_generation_prompt": False, "continue_final_message": True}})
    expected = tokenizer.apply_chat_template(partial, continue_final_message=True, tokenize=True, return_dict=False)
    assert continued.usage.prompt_tokens == len(expected)
    plain = client.chat.completions.create(model=ALIAS, messages=CHAT, **GREEDY)
    with_variables = client.chat.completions.create(model=ALIAS, messages=CHAT, **{**GREEDY, "extra_body": {
        "ignore_eos": True, "chat_template_kwargs": {"enable_thinking": False}}})
    assert with_variables.choices[0].message.content == plain.choices[0].message.content
    for extra, param in (({"add_generation_prompt": True, "continue_final_message": True}, "continue_final_message"),
                         ({"chat_template_kwargs": {"add_generation_prompt": False}},
                          "chat_template_kwargs.add_generation_prompt")):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=ALIAS, messages=partial, max_tokens=2, extra_body=extra)
        assert info.value.body["param"] == param, info.value.body


def test_vllms_text_extensions(client, tiny_llama):
    from transformers import AutoTokenizer

    eos = AutoTokenizer.from_pretrained(tiny_llama).eos_token_id
    forced = dict(model=ALIAS, prompt=[1, 2, 3], max_tokens=2, temperature=0, logit_bias={str(eos): 100})
    assert client.completions.create(**forced, extra_body={"ignore_eos": True}).choices[0].text == ""
    assert client.completions.create(**forced, extra_body={"ignore_eos": True, "skip_special_tokens": False}
                                     ).choices[0].text == "</s></s>"
    text = client.completions.create(model=ALIAS, prompt="The sky", **GREEDY).choices[0].text
    stop = text.strip()[:2]
    cut = client.completions.create(model=ALIAS, prompt="The sky", stop=[stop], **GREEDY).choices[0].text
    kept = client.completions.create(model=ALIAS, prompt="The sky", stop=[stop], **{**GREEDY, "extra_body": {
        "ignore_eos": True, "include_stop_str_in_output": True}}).choices[0].text
    assert kept == cut + stop


def test_allowed_token_ids_and_truncate_prompt_tokens(client):
    allowed = client.completions.create(model=ALIAS, prompt=[1, 2, 3], **{**GREEDY, "extra_body": {
        "ignore_eos": True, "allowed_token_ids": [40, 41], "return_tokens_as_token_ids": True}}, logprobs=0)
    assert set(allowed.choices[0].logprobs.tokens) <= {"token_id:40", "token_id:41"}
    long_prompt = list(range(5, 105))
    cut = client.completions.create(model=ALIAS, prompt=long_prompt, **{**GREEDY, "extra_body": {
        "ignore_eos": True, "truncate_prompt_tokens": 10}})
    tail = client.completions.create(model=ALIAS, prompt=long_prompt[-10:], **GREEDY)
    assert cut.usage.prompt_tokens == 10 and cut.choices[0].text == tail.choices[0].text
    for extra, param in (({"allowed_token_ids": [10**7]}, "allowed_token_ids"),
                         ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens")):
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=ALIAS, prompt="a", max_tokens=2, extra_body=extra)
        assert info.value.body["param"] == param, info.value.body


RESPONSE = dict(model=ALIAS, temperature=0, max_output_tokens=6, extra_body={"ignore_eos": True})


def test_the_responses_api_whole_and_streamed(client):
    chat = client.chat.completions.create(model=ALIAS, messages=CHAT, **GREEDY)
    response = client.responses.create(instructions="You are terse.", input="Say hello", **RESPONSE)
    assert response.object == "response" and response.status == "incomplete"  # ignore_eos: it ran to the budget
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.output_text == chat.choices[0].message.content
    assert (response.usage.input_tokens, response.usage.output_tokens) == (chat.usage.prompt_tokens, 6)
    items = client.responses.create(input=[{"role": "developer", "content": "You are terse."},
                                           {"role": "user", "content": [{"type": "input_text", "text": "Say hello"}]}],
                                    **RESPONSE)
    assert items.output_text == response.output_text
    events = list(client.responses.create(instructions="You are terse.", input="Say hello", stream=True, **RESPONSE))
    kinds = [event.type for event in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert deltas == events[-1].response.output_text == response.output_text
    finished = client.responses.create(input="Say hello", model=ALIAS, temperature=0, max_output_tokens=64)
    assert finished.status in ("completed", "incomplete") and finished.output[0].role == "assistant"


SHORT_SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                                "size": {"type": "integer", "minimum": 1, "maximum": 9}},
                "required": ["color", "size"], "additionalProperties": False}
HELD = dict(temperature=0, max_tokens=200)


def test_structured_outputs_hold_the_output_whole_and_streamed(client):
    """The tiny model's weights are random: whatever it prefers, the output matches its spec."""
    formats = [
        dict(response_format={"type": "json_schema", "json_schema": {"name": "item", "schema": SHORT_SCHEMA,
                                                                      "strict": True}}),
        dict(extra_body={"guided_json": SHORT_SCHEMA}),
        dict(extra_body={"structured_outputs": {"json": json.dumps(SHORT_SCHEMA)}}),
    ]
    for fields in formats:
        completion = client.chat.completions.create(model=ALIAS, messages=CHAT, **HELD, **fields)
        item = json.loads(completion.choices[0].message.content, strict=False)
        assert completion.choices[0].finish_reason == "stop"
        assert item["color"] in ("red", "green", "blue") and 1 <= item["size"] <= 9 and set(item) == {"color", "size"}
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in client.chat.completions.create(
        model=ALIAS, messages=CHAT, stream=True, **HELD, **formats[0]) if chunk.choices)
    assert streamed == completion.choices[0].message.content
    choice = client.completions.create(model=ALIAS, prompt="Pick:", extra_body={"guided_choice": ["yes", "no"]}, **HELD)
    assert choice.choices[0].text in ("yes", "no")
    regex = client.completions.create(model=ALIAS, prompt="Code:", extra_body={"guided_regex": "[A-Z]{2}-[0-9]{3}"},
                                      **HELD)
    assert re.fullmatch("[A-Z]{2}-[0-9]{3}", regex.choices[0].text)
    grammar = client.completions.create(model=ALIAS, prompt="List:", n=2, temperature=1.0, seed=3, max_tokens=200,
                                        extra_body={"structured_outputs": {"grammar": 'root ::= "[" [a-c] ("," [a-c])* "]"'}})
    assert all(re.fullmatch(r"\[[a-c](,[a-c])*\]", c.text) for c in grammar.choices)
    response = client.responses.create(model=ALIAS, input="Describe an item.", temperature=0, max_output_tokens=200,
                                       text={"format": {"type": "json_schema", "name": "item", "schema": SHORT_SCHEMA}})
    assert json.loads(response.output_text, strict=False)["color"] in ("red", "green", "blue")


def test_with_structured_output_of_langchain(stack):
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    class Item(BaseModel):
        color: str = Field(json_schema_extra={"enum": ["red", "green", "blue"]})
        size: int = Field(ge=1, le=9)

    _, url, _ = stack
    model = ChatOpenAI(model=ALIAS, base_url=f"{url}/v1", api_key="unused", temperature=0, max_tokens=200,
                       max_retries=0)
    item = model.with_structured_output(Item, method="json_schema", strict=True).invoke("Describe an item.")
    assert isinstance(item, Item) and item.color in ("red", "green", "blue") and 1 <= item.size <= 9


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]},
                                                    "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}


def test_tool_calls_required_named_and_auto_whole_and_streamed(client):
    asked = [{"role": "user", "content": "What is the weather in Paris?"}]
    # One call a reply: the random model could add calls to a parallel reply without end.
    for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
        completion = client.chat.completions.create(model=ALIAS, messages=asked, tools=[WEATHER, TIME],
                                                    tool_choice=choice, parallel_tool_calls=False, **HELD)
        message, finish = completion.choices[0].message, completion.choices[0].finish_reason
        assert finish == "tool_calls" and message.content is None
        call = message.tool_calls[0]
        assert call.id.startswith("call_") and call.type == "function"
        assert call.function.name in (("get_weather", "get_time") if choice == "required" else ("get_time",))
        arguments = json.loads(call.function.arguments)
        assert arguments in ({"zone": "UTC"}, {"zone": "CET"}) or set(arguments) == {"city", "unit"}
        assert len(message.tool_calls) == 1
    stream = client.chat.completions.create(model=ALIAS, messages=asked, tools=[WEATHER, TIME], tool_choice="required",
                                            parallel_tool_calls=False, stream=True, **HELD)
    calls, finish = {}, None
    for chunk in stream:
        for delta_call in chunk.choices[0].delta.tool_calls or () if chunk.choices else ():
            entry = calls.setdefault(delta_call.index, {"id": None, "name": None, "arguments": ""})
            entry["id"] = delta_call.id or entry["id"]
            entry["name"] = (delta_call.function.name if delta_call.function else None) or entry["name"]
            entry["arguments"] += (delta_call.function.arguments or "") if delta_call.function else ""
        finish = (chunk.choices[0].finish_reason if chunk.choices else None) or finish
    whole = client.chat.completions.create(model=ALIAS, messages=asked, tools=[WEATHER, TIME], tool_choice="required",
                                           parallel_tool_calls=False, **HELD)
    assert finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls]
    # auto: whatever the random model writes comes back, as calls or as content, never as an error
    auto = client.chat.completions.create(model=ALIAS, messages=asked, tools=[WEATHER], tool_choice="auto", **HELD)
    assert auto.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert (auto.choices[0].message.content is None) == (auto.choices[0].finish_reason == "tool_calls")
    # the round trip: the call and its result in the history
    history = [*asked, whole.choices[0].message.model_dump(exclude_none=True),
               *({"role": "tool", "tool_call_id": c.id, "content": "18 C"} for c in whole.choices[0].message.tool_calls)]
    answer = client.chat.completions.create(model=ALIAS, messages=history, tools=[WEATHER, TIME], tool_choice="none",
                                            **GREEDY)
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls


def test_function_calls_in_the_responses_api_whole_and_streamed(client):
    tools = [{"type": "function", **WEATHER["function"]}, {"type": "function", **TIME["function"]}]
    asked = dict(model=ALIAS, input="What is the weather in Paris?", tools=tools, tool_choice="required",
                 parallel_tool_calls=False, temperature=0, max_output_tokens=200)
    response = client.responses.create(**asked)
    call, = response.output
    assert call.type == "function_call" and call.call_id.startswith("call_") and response.status == "completed"
    assert call.name in ("get_weather", "get_time") and isinstance(json.loads(call.arguments), dict)
    events = list(client.responses.create(**asked, stream=True))
    kinds = [event.type for event in events]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.function_call_arguments.delta", "response.function_call_arguments.done",
                     "response.output_item.done", "response.completed"]
    assert events[3].delta == events[4].arguments == call.arguments
    answered = client.responses.create(
        model=ALIAS, tools=tools, temperature=0, max_output_tokens=8, input=[
            {"role": "user", "content": "What is the weather in Paris?"},
            {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": "18 C"}], tool_choice="none")
    assert answered.output[0].type == "message" and answered.output_text


def test_tool_calls_of_langchain(stack):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: Literal["Paris", "Oslo"]) -> str:  # an enum: a random model's free string may not end
        """The weather in a city."""
        return f"18 C in {city}"

    _, url, _ = stack
    model = ChatOpenAI(model=ALIAS, base_url=f"{url}/v1", api_key="unused", temperature=0, max_tokens=100,
                       max_retries=0)
    asked = [HumanMessage("What is the weather in Paris?")]
    reply = model.bind_tools([get_weather], tool_choice="get_weather", parallel_tool_calls=False).invoke(asked)
    call, = reply.tool_calls
    assert call["name"] == "get_weather" and call["args"]["city"] in ("Paris", "Oslo")
    result = ToolMessage(get_weather.invoke(call["args"]), tool_call_id=call["id"])
    answer = model.bind_tools([get_weather]).invoke([*asked, reply, result])
    assert isinstance(answer.content, str)


@pytest.mark.parametrize("fields, param", [
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wrong"}}}),
     "response_format.json_schema.schema"),
    (dict(response_format={"type": "json_schema"}), "response_format.json_schema"),
    (dict(response_format={"type": "text", "json_schema": {"name": "x", "schema": {}}}), "response_format.json_schema"),
    (dict(response_format={"type": "yaml"}), "response_format.type"),
    (dict(extra_body={"guided_regex": "(("}), "guided_regex"),
    (dict(extra_body={"guided_grammar": "root ::= missing"}), "guided_grammar"),
    (dict(extra_body={"guided_choice": []}), "guided_choice"),
    (dict(extra_body={"guided_choice": ["a"], "guided_regex": "a"}), "guided_choice"),
    (dict(extra_body={"structured_outputs": {}}), "structured_outputs"),
    (dict(extra_body={"structured_outputs": {"json": "{not json"}}), "structured_outputs.json"),
    (dict(tools=[{"type": "function", "function": {"description": "no name"}}]), "tools.0.function.name"),
    (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "other"}}), "tool_choice"),
    (dict(tools=[WEATHER], tool_choice="always"), "tool_choice"),
    (dict(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}), "response_format"),
    (dict(extra_body={"messages": [{"role": "user", "content": "x", "tool_call_id": "c1"}]}),
     "messages.0.tool_call_id"),
])
def test_a_structured_output_that_does_not_compile_is_a_bad_request_naming_it(client, fields, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=ALIAS, messages=CHAT, max_tokens=4, **fields)
    assert info.value.body["param"] == param, info.value.body


@pytest.mark.parametrize("fields, param", [
    (dict(store=True), "store"),
    (dict(previous_response_id="resp_1"), "previous_response_id"),
    (dict(tools=[{"type": "function", "parameters": {}}]), "tools"),
    (dict(tools=[{"type": "function", "name": "f"}], tool_choice={"type": "function", "name": "g"}), "tool_choice"),
    (dict(text={"format": {"type": "json_schema", "name": "x", "schema": {"type": "wrong"}}}), "text"),
    (dict(text={"format": {"type": "json_schema", "name": "x"}}), "text"),
    (dict(extra_body={"n": 2}), "n"),
    (dict(input=[{"role": "robot", "content": "hi"}]), "input"),
    (dict(max_output_tokens=0), "max_output_tokens"),
    (dict(max_output_tokens=10**6), "max_output_tokens"),
])
def test_bad_responses_fields_are_a_bad_request_naming_them(client, fields, param):
    request = dict(model=ALIAS, input="hi", max_output_tokens=4)
    request.update(fields)
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(**request)
    assert info.value.body["param"].split(".")[0] == param, info.value.body


def test_user_is_accepted_and_ignored(client):
    assert client.chat.completions.create(model=ALIAS, messages=CHAT, user="someone", **GREEDY).choices


def test_prompt_beyond_the_context_is_context_length_exceeded(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=ALIAS, prompt=[1, 2, 3], max_tokens=10**6)
    assert info.value.code == "context_length_exceeded" and info.value.body["param"] == "max_tokens"


def test_an_unknown_model_is_not_found(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-4o", messages=CHAT, max_tokens=4)
    assert info.value.code == "model_not_found" and info.value.body["param"] == "model"


def test_a_deadline_that_passes_is_a_gateway_timeout(stack):
    router, url, workers = stack
    body = {"model": ALIAS, "prompt": [3, 4, 5], "max_tokens": 300, "ignore_eos": True}
    for timeout in ("0.001", "0.05"):  # before the first token, and likely after it
        late = httpx.post(f"{url}/v1/completions", json=body, headers={"x-request-timeout": timeout}, timeout=60)
        assert late.status_code == 504 and late.json()["error"]["type"] == "timeout_error", late.text
    bad = httpx.post(f"{url}/v1/completions", json=body, headers={"x-request-timeout": "soon"}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "x-request-timeout"
    assert_no_leaks(router, workers)


def test_the_sse_framing_byte_for_byte(stack):
    _, url, _ = stack
    body = {"model": ALIAS, "prompt": [7, 8, 9], "max_tokens": 3, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = response.read()
    events = raw.split(b"\n\n")
    assert events[-1] == b"" and events[-2] == b"data: [DONE]", raw
    payloads = [json.loads(event.removeprefix(b"data: ")) for event in events[:-2]]
    assert all(event.startswith(b"data: {") and b"\n" not in event for event in events[:-2]), raw
    assert payloads[-1]["choices"] == [] and payloads[-1]["usage"]["completion_tokens"] == 3
    assert [p["choices"][0]["finish_reason"] for p in payloads[:-1]][-1] == "length"


def test_health_metrics_explain_and_backends(stack):
    router, url, _ = stack
    assert httpx.get(f"{url}/health").json()["status"] == "ok"
    httpx.post(f"{url}/v1/completions", json={"model": ALIAS, "prompt": [4, 5], "max_tokens": 2, "ignore_eos": True,
                                              "tandem": {"length_key": "http-key"}}, timeout=60)
    metrics = httpx.get(f"{url}/metrics").text
    assert 'tandem_router_output_fraction_samples{length_key="http-key"} 1.0' in metrics
    assert 'tandem_router_time_to_first_token_seconds_count{frontend="http"}' in metrics
    decision = httpx.post(f"{url}/tandem/v1/explain", json={"model": ALIAS, "prompt": [4, 5], "max_tokens": 2}).json()
    assert decision["chosen_worker"] in ("cpu", "gpu") and {s["worker"] for s in decision["scores"]} == {"cpu", "gpu"}
    listing = httpx.get(f"{url}/tandem/v1/backends").json()
    backends = listing["backends"]
    assert {b["name"] for b in backends} == {"cpu", "gpu"} and all(b["healthy"] for b in backends)
    assert {"key": "http-key", "fraction": 1.0, "samples": 1} in listing["output_lengths"]  # 2 of 2 tokens
    assert scrape_metrics(router)  # the gRPC side's metrics port serves the same registry


def test_a_client_that_disconnects_mid_stream_frees_the_worker(stack):
    router, url, workers = stack
    body = {"model": ALIAS, "prompt": list(range(100, 140)), "max_tokens": 400, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        received = [line for line, _ in zip(lines, range(6)) if line.startswith("data: ")]
    assert len(received) >= 2
    assert_no_leaks(router, workers)


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_gives_up_before_the_first_token_frees_the_worker(stack, stream):
    """The router cancels the request as the client disconnects, though it has nothing to write to notice that."""
    router, url, workers = stack
    gave_up = ("tandem_router_http_requests_total", (("route", "/v1/completions"), ("status", "499")))
    before = scrape_metrics(router).get(gave_up, 0)
    body = {"model": ALIAS, "prompt": list(range(100, 140)), "max_tokens": 400, "temperature": 0,
            "ignore_eos": True, "stream": stream}
    with stopped(*workers.values()):
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{url}/v1/completions", json=body, timeout=1.5)  # no worker answers while stopped
        wait_until(lambda: scrape_metrics(router).get(gave_up, 0) == before + 1)
    assert_no_leaks(router, workers)


BODY = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=12,
)
FIELDS = st.sampled_from(["model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature",
                          "top_p", "top_k", "seed", "stop", "stream", "stream_options", "n", "user", "ignore_eos",
                          "stop_token_ids", "tandem", "logprobs", "tools"])


@st.composite
def request_bodies(draw):
    body = draw(st.dictionaries(FIELDS, BODY, max_size=8))
    if draw(st.booleans()):
        body["model"] = ALIAS
    if draw(st.booleans()):
        body.setdefault("max_tokens", draw(st.integers(1, 4)))
    return body


@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
@given(path=st.sampled_from(["/v1/chat/completions", "/v1/completions", "/tandem/v1/explain"]), body=request_bodies())
def test_fuzzed_bodies_never_get_a_server_error(stack, path, body):
    _, url, _ = stack
    response = httpx.post(f"{url}{path}", content=json.dumps(body, allow_nan=True), timeout=60)
    assert response.status_code < 500, (body, response.text)
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]


def test_fuzzed_bodies_leave_no_leak(stack):
    router, _, workers = stack
    assert_no_leaks(router, workers)


def test_bearer_tokens_and_rate_limits(tiny_llama, tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text("secret-token\n")
    with running_worker(tiny_llama, tmp_path / "w.log") as worker:
        router, url = http_router(tiny_llama, tmp_path / "router.log", [f"w=gpu@{worker.address}"],
                                  "--auth-token-file", str(tokens), "--max-inflight", "1", "--max-queued", "0")
        try:
            router.wait_for_health(SERVING)
            with pytest.raises(openai.AuthenticationError):
                openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()
            assert httpx.get(f"{url}/health").status_code == 200  # health stays open
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="secret-token", max_retries=0)
            started = threading.Event()

            def long_request():
                for _ in client.completions.create(model=tiny_llama.name, prompt=[1, 2], max_tokens=200,
                                                   temperature=0, stream=True, extra_body={"ignore_eos": True}):
                    started.set()

            thread = threading.Thread(target=long_request)
            thread.start()
            assert started.wait(60)
            with pytest.raises(openai.RateLimitError) as info:
                client.completions.create(model=tiny_llama.name, prompt=[1, 2], max_tokens=2)
            assert int(info.value.response.headers["retry-after"]) >= 1
            thread.join(60)
        finally:
            router.close()


def test_no_healthy_worker_is_service_unavailable(tiny_llama, tmp_path):
    router, url = http_router(tiny_llama, tmp_path / "router.log", [f"gone=cpu@127.0.0.1:{free_port()}"])
    try:
        router.wait_for_health(NOT_SERVING)
        health = httpx.get(f"{url}/health")
        assert health.status_code == 503 and "gone (" in health.json()["error"]["message"]
        with pytest.raises(openai.InternalServerError) as info:
            openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0).completions.create(
                model=tiny_llama.name, prompt=[1, 2], max_tokens=2)
        assert info.value.status_code == 503 and "no healthy worker" in info.value.message
    finally:
        router.close()


@pytest.mark.slow
def test_a_worker_lost_after_tokens_ends_the_stream_with_an_error_event(tiny_llama, tmp_path):
    slow = WorkerProcess(tiny_llama, tmp_path / "slow.log", launcher=HARNESS, env={"HARNESS_STEP_DELAY_S": "0.2"})
    router, url = http_router(tiny_llama, tmp_path / "router.log", [f"slow=gpu@{slow.address}"])
    try:
        slow.wait_for_health()
        router.wait_for_backends({"slow"})
        body = {"model": tiny_llama.name, "prompt": list(range(30, 50)), "max_tokens": 100, "temperature": 0,
                "ignore_eos": True, "stream": True}
        events = []
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line.removeprefix("data: "))
                if len(events) == 3 and slow.alive:
                    slow.process.kill()
        payloads = [json.loads(event) for event in events]
        assert "[DONE]" not in events and all("choices" in p for p in payloads[:-1])
        error = payloads[-1]["error"]
        assert error["type"] == "service_unavailable_error"
        assert "worker slow failed after streaming" in error["message"] and "incomplete" in error["message"]
    finally:
        router.close()
        slow.close()
