"""TLS, mTLS and bearer tokens on a real in-process gRPC server (127.0.0.1, throwaway certificates)."""

from __future__ import annotations

import os
import subprocess
import sys

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

from tandem.launch import free_port
from tandem.security import BearerTokenAuth, ClientTLS, aio_channel, bearer_metadata, client_tls, server_tls
from tandem.v1 import common_pb2, router_pb2, worker_pb2, worker_pb2_grpc
from tests.certs import make_certificates
from tests.integration.workers import REPO, SERVING, RouterProcess, WorkerProcess


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_certificates(tmp_path_factory.mktemp("certs"))


def test_tokens_are_checked_by_scheme_and_value():
    auth = BearerTokenAuth(["first-token", "second-token"])
    assert auth.authorized("Bearer first-token") and auth.authorized("bearer second-token")
    for header in (None, "", "Bearer", "Bearer first", "Bearer first-token-x", "Basic first-token", "first-token"):
        assert not auth.authorized(header), header
    with pytest.raises(ValueError):
        BearerTokenAuth([""])


def test_flag_combinations_are_validated(certs, tmp_path):
    assert server_tls(None, None) is None and client_tls(None) is None
    with pytest.raises(ValueError, match="--tls-cert and --tls-key"):
        server_tls(str(certs.server_cert), None)
    with pytest.raises(ValueError, match="--tls-client-ca needs"):
        server_tls(None, None, str(certs.ca))
    with pytest.raises(ValueError, match="no such file"):
        server_tls(str(tmp_path / "missing.pem"), str(certs.server_key))
    with pytest.raises(ValueError, match="CA of the server"):
        client_tls(None, str(certs.client_cert), str(certs.client_key))
    with pytest.raises(ValueError, match="together"):
        ClientTLS(certs.ca, certs.client_cert, None)


@pytest.fixture
async def secured_server(certs):
    server = grpc.aio.server(interceptors=[BearerTokenAuth(["s3cret"])])
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    reflection.enable_server_reflection(("grpc.health.v1.Health", reflection.SERVICE_NAME), server)
    tls = server_tls(str(certs.server_cert), str(certs.server_key), str(certs.ca))
    port = server.add_secure_port("127.0.0.1:0", tls.credentials())
    await server.start()
    yield f"127.0.0.1:{port}"
    await server.stop(None)


async def _list_services(channel, token):
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    return [r async for r in stub.ServerReflectionInfo(iter([request]), metadata=bearer_metadata(token), timeout=5)]


async def test_mtls_with_token_is_served_and_health_needs_no_token(secured_server, certs):
    tls = client_tls(str(certs.ca), str(certs.client_cert), str(certs.client_key))
    async with aio_channel(secured_server, tls) as channel:
        check = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert check.status == health_pb2.HealthCheckResponse.SERVING
        assert (await _list_services(channel, "s3cret"))[0].list_services_response.service
        for token in (None, "wrong"):
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await _list_services(channel, token)
            assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "bearer token" in error.value.details()


@pytest.mark.parametrize("who", ["no client certificate", "untrusted server", "plaintext"])
async def test_connections_without_the_right_certificates_fail(secured_server, certs, who):
    tls = {"no client certificate": client_tls(str(certs.ca)),
           "untrusted server": client_tls(str(certs.other_ca), str(certs.client_cert), str(certs.client_key)),
           "plaintext": None}[who]
    async with aio_channel(secured_server, tls) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert error.value.code() == grpc.StatusCode.UNAVAILABLE


@pytest.fixture(scope="module")
def secured_stack(tiny_llama, certs, tmp_path_factory):
    """A worker requiring client certificates (mTLS) behind a router serving TLS with bearer tokens."""
    logs = tmp_path_factory.mktemp("secured")
    (logs / "tokens").write_text("# clients\nalpha-token\nbeta-token\n")
    worker_tls = client_tls(str(certs.ca), str(certs.client_cert), str(certs.client_key))
    worker = WorkerProcess(tiny_llama, logs / "worker.log", "--tls-cert", str(certs.server_cert), "--tls-key",
                           str(certs.server_key), "--tls-client-ca", str(certs.ca), tls=worker_tls)
    router = None
    try:
        worker.wait_for_health()
        router = RouterProcess(tiny_llama, logs / "router.log", [f"w=cpu@127.0.0.1:{worker.port}"],
                               "--http-port", str(free_port()),
                               "--tls-cert", str(certs.server_cert), "--tls-key", str(certs.server_key),
                               "--auth-token-file", str(logs / "tokens"), "--worker-ca", str(certs.ca),
                               "--worker-cert", str(certs.client_cert), "--worker-key", str(certs.client_key),
                               tls=client_tls(str(certs.ca)))
        router.wait_for_health()
        router.wait_for_backends({"w"}, metadata=bearer_metadata("beta-token"))
        yield router, worker
    finally:
        for process in (router, worker):
            if process is not None:
                process.close()


def _generate(router, token):
    request = router_pb2.RouteRequest(prompt_token_ids=worker_pb2.TokenIds(ids=list(range(20, 40))), max_new_tokens=4,
                                      sampling=common_pb2.SamplingParams(temperature=0.0))
    return list(router.stub.Generate(request, timeout=30, metadata=bearer_metadata(token)))


@pytest.mark.slow
def test_tls_everywhere_with_tokens_serves_only_authorized_clients(secured_stack, certs):
    router, worker = secured_stack
    responses = _generate(router, "alpha-token")
    assert responses[0].decision.chosen_worker == "w"
    assert responses[-1].result.usage.output_tokens == 4
    for token in (None, "alpha", "gamma-token"):
        with pytest.raises(grpc.RpcError) as error:
            _generate(router, token)
        assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as error:
        router.stub.ListBackends(router_pb2.ListBackendsRequest(), timeout=5)
    assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert router.health_status() == SERVING  # health needs no token


@pytest.mark.slow
def test_workers_refuse_clients_without_a_certificate(secured_stack, certs):
    _, worker = secured_stack
    ca_only = [sys.executable, "-m", "tandem.healthcheck", worker.address, "--tls-ca", str(certs.ca)]
    mutual = [*ca_only, "--tls-cert", str(certs.client_cert), "--tls-key", str(certs.client_key)]
    assert subprocess.run(mutual, capture_output=True, env={**os.environ, "PYTHONPATH": str(REPO)}).returncode == 0
    refused = subprocess.run(ca_only, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert refused.returncode == 1 and "UNAVAILABLE" in refused.stderr
    with grpc.insecure_channel(worker.address) as plaintext:
        with pytest.raises(grpc.RpcError):
            worker_pb2_grpc.WorkerStub(plaintext).GetInfo(worker_pb2.GetInfoRequest(), timeout=3)


@pytest.mark.slow
def test_the_http_api_serves_tls_with_the_same_tokens(secured_stack, certs):
    import ssl

    import httpx

    router, _ = secured_stack
    url = f"https://127.0.0.1:{router.args[router.args.index('--http-port') + 1]}"
    body = {"prompt": [20, 21, 22], "max_tokens": 3, "ignore_eos": True}
    with httpx.Client(verify=ssl.create_default_context(cafile=certs.ca)) as client:
        assert client.get(f"{url}/health").status_code == 200  # health needs no token
        refused = client.get(f"{url}/v1/models", headers={"Authorization": "Bearer gamma-token"})
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
        models = client.get(f"{url}/v1/models", headers={"Authorization": "Bearer alpha-token"}).json()["data"]
        body["model"] = models[0]["id"]
        completion = client.post(f"{url}/v1/completions", json=body, headers={"Authorization": "Bearer beta-token"})
        assert completion.status_code == 200 and completion.json()["usage"]["completion_tokens"] == 3
        assert completion.headers["x-tandem-worker"] == "w"
    with httpx.Client(verify=ssl.create_default_context(cafile=certs.other_ca)) as untrusting, \
            pytest.raises(httpx.ConnectError):
        untrusting.get(f"{url}/health")
    with pytest.raises(httpx.HTTPError):
        httpx.get(url.replace("https", "http") + "/health")
