"""The two front ends prepare a request the same way: each bad input below goes through the router's gRPC API
and its OpenAI HTTP API, and both refuse it with the same field (as each API spells it) and the same reason."""

from __future__ import annotations

import grpc
import httpx
import pytest

from tandem.v1 import router_pb2, worker_pb2
from tests.integration.test_http import http_router
from tests.integration.workers import running_worker, serving_router

VOCAB = 400  # the tiny model's (tests/models.py)

# (case, RouteRequest fields, completion body fields, the gRPC field, the HTTP param, the HTTP error code)
CASES = [
    ("unknown policy", dict(policy="fastest"), dict(tandem={"policy": "fastest"}), "policy", "tandem.policy", None),
    ("unprintable length key", dict(length_key="a\nb"), dict(tandem={"length_key": "a\nb"}),
     "length_key", "tandem.length_key", None),
    ("token id beyond the vocabulary", dict(prompt=[1, VOCAB]), dict(prompt=[1, VOCAB]),
     "prompt_token_ids", "prompt", None),
    ("prompt and budget beyond the context", dict(prompt=[1] * 1000, max_new_tokens=100),
     dict(prompt=[1] * 1000, max_tokens=100), "max_new_tokens", "max_tokens", "context_length_exceeded"),
]


@pytest.fixture(scope="module")
def front_ends(tiny_llama, tmp_path_factory):
    logs = tmp_path_factory.mktemp("frontends")
    with running_worker(tiny_llama, logs / "cpu.log") as cpu:
        router, url = http_router(tiny_llama, logs / "router.log", [f"cpu=cpu@{cpu.address}"])
        with serving_router(router, {"cpu"}):
            yield router, url


def grpc_refusal(router, fields: dict) -> tuple[grpc.StatusCode, str]:
    prompt = fields.pop("prompt", [1, 2, 3])
    fields.setdefault("max_new_tokens", 4)
    request = router_pb2.RouteRequest(prompt_token_ids=worker_pb2.TokenIds(ids=prompt), **fields)
    with pytest.raises(grpc.RpcError) as error:
        list(router.stub.Generate(request, timeout=30))
    return error.value.code(), error.value.details()


def http_refusal(url: str, model: str, fields: dict) -> httpx.Response:
    body = {"model": model, "prompt": [1, 2, 3], "max_tokens": 4, **fields}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=30)


@pytest.mark.parametrize("case, grpc_fields, http_fields, grpc_field, http_param, http_code", CASES,
                         ids=[case[0] for case in CASES])
def test_both_front_ends_refuse_a_bad_input_alike(front_ends, tiny_llama, case, grpc_fields, http_fields, grpc_field,
                                                  http_param, http_code):
    router, url = front_ends
    code, details = grpc_refusal(router, dict(grpc_fields))
    response = http_refusal(url, tiny_llama.name, http_fields)
    error = response.json()["error"]
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith(f"{grpc_field}: "), details
    assert response.status_code == 400 and error["param"] == http_param and error["code"] == http_code, error
    assert error["message"] == f"{http_param}: {details.removeprefix(f'{grpc_field}: ')}"
