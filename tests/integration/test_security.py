"""TLS, mTLS and bearer tokens on a real in-process gRPC server (127.0.0.1, throwaway certificates)."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

from tandem.security import BearerTokenAuth, ClientTLS, aio_channel, bearer_metadata, client_tls, server_tls
from tests.certs import make_certificates


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
