"""Structured output in Tandem's engine: every sampled output matches its spec, whatever the weights prefer."""

from __future__ import annotations

import json
import re

import pytest

from tandem.engine.request import FinishReason, Request
from tandem.errors import InvalidRequestError
from tandem.sampling import SamplingParams
from tandem.structured import StructuredOutput
from tests.engine.helpers import assert_no_leaks, make_engine, random_prompt, run_to_completion

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}


def text_of(engine, outputs) -> str:
    return "".join(output.text for output in outputs)


def loads(text: str):
    """JSON as the grammar allows it: a random model's strings hold control characters, which strict JSON
    leaves to its producers."""
    return json.loads(text, strict=False)


@pytest.mark.parametrize("output, check", [
    (StructuredOutput("json_schema", json.dumps(SCHEMA)),
     lambda text: set(loads(text)) == {"name", "age"} and 0 <= loads(text)["age"] <= 150),
    (StructuredOutput("json_object"), lambda text: isinstance(loads(text), dict)),
    (StructuredOutput("regex", r"(yes|no)-[0-9]{3}"), lambda text: re.fullmatch(r"(yes|no)-[0-9]{3}", text)),
    (StructuredOutput("choice", ("red", "green", "blue")), lambda text: text in ("red", "green", "blue")),
    (StructuredOutput("grammar", 'root ::= "(" [a-z]+ ")"'), lambda text: re.fullmatch(r"\([a-z]+\)", text)),
])
def test_sampled_outputs_match_their_spec_and_end_when_it_is_complete(tiny_llama, output, check):
    engine = make_engine(tiny_llama)
    seeds = (1, 2, 3)  # prompts on which the random model's strings end within the budget
    for seed in seeds:
        sampling = SamplingParams(temperature=1.0, seed=seed, structured_output=output)
        engine.add_request(Request(f"r{seed}", random_prompt(engine, 10, seed=seed), 200, sampling))
    outputs = run_to_completion(engine)
    for seed in seeds:
        text = text_of(engine, outputs[f"r{seed}"])
        assert outputs[f"r{seed}"][-1].finish_reason in (FinishReason.EOS, FinishReason.STOP), text
        assert check(text), text
    assert engine.current_rates().step_per_constrained_row_s > 0
    assert_no_leaks(engine)


def test_a_constrained_request_beside_free_ones_leaves_them_unchanged(tiny_llama):
    engine = make_engine(tiny_llama)
    prompt = random_prompt(engine, 12, seed=3)
    engine.add_request(Request("alone", prompt, 10, SamplingParams(temperature=0), ignore_eos=True))
    alone = run_to_completion(engine)["alone"]
    engine.add_request(Request("free", prompt, 10, SamplingParams(temperature=0), ignore_eos=True))
    engine.add_request(Request("held", prompt, 50, SamplingParams(
        temperature=0, structured_output=StructuredOutput("choice", ("abc", "xyz")))))
    together = run_to_completion(engine)
    assert [o.token_ids for o in together["free"]] == [o.token_ids for o in alone]
    assert text_of(engine, together["held"]) in ("abc", "xyz")


@pytest.mark.parametrize("kind, spec", [
    ("json_schema", "{not json"), ("json_schema", '{"type": "nonsense"}'), ("regex", "(("),
    ("grammar", "root ::= undefined_rule"), ("choice", ()), ("choice", ("a", "")),
])
def test_a_spec_that_does_not_compile_names_its_field(kind, spec):
    with pytest.raises(InvalidRequestError) as info:
        StructuredOutput(kind, spec)
    assert info.value.field == f"structured_output.{kind}"
