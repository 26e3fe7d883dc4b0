"""Transport security and authentication for Tandem's gRPC hops.

- TLS on any server (PEM certificate and key); with a client CA, clients must present a certificate
  signed by it (mTLS, used between the router and the workers).
- TLS on any client channel (the CA that signed the server), optionally with a client certificate.
- Bearer tokens on the router's public API, compared in constant time. Health stays open, so
  orchestrators can probe without a token.
"""

from __future__ import annotations

import hmac
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/",)


def _read(path: Path | None) -> bytes | None:
    return None if path is None else Path(path).read_bytes()


@dataclass(frozen=True)
class ServerTLS:
    """A server's certificate and key; with ``client_ca_file``, client certificates are required (mTLS)."""

    cert_file: Path
    key_file: Path
    client_ca_file: Path | None = None

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(_read(self.key_file), _read(self.cert_file))],
            root_certificates=_read(self.client_ca_file),
            require_client_auth=self.client_ca_file is not None,
        )


@dataclass(frozen=True)
class ClientTLS:
    """The CA that signed the server's certificate; a client certificate and key for mTLS."""

    ca_file: Path
    cert_file: Path | None = None
    key_file: Path | None = None

    def __post_init__(self) -> None:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("a client certificate and its key must be given together")

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(_read(self.ca_file), _read(self.key_file), _read(self.cert_file))


def server_tls(cert_file: str | None, key_file: str | None, client_ca_file: str | None = None) -> ServerTLS | None:
    """Server TLS from optional flag values; None when neither certificate nor key is set.

    Raises:
        ValueError: only one of certificate and key is set, a client CA without them, or a file is missing.
    """
    if not cert_file and not key_file:
        if client_ca_file:
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key")
        return None
    if not (cert_file and key_file):
        raise ValueError("--tls-cert and --tls-key must be given together")
    files = [Path(cert_file), Path(key_file)] + ([Path(client_ca_file)] if client_ca_file else [])
    _require_files(files)
    return ServerTLS(files[0], files[1], files[2] if client_ca_file else None)


def client_tls(ca_file: str | None, cert_file: str | None = None, key_file: str | None = None) -> ClientTLS | None:
    """Client TLS from optional flag values; None (plaintext) when no CA is set."""
    if not ca_file:
        if cert_file or key_file:
            raise ValueError("a client certificate needs the CA of the server (TLS) as well")
        return None
    files = [Path(f) if f else None for f in (ca_file, cert_file, key_file)]
    _require_files([f for f in files if f is not None])
    return ClientTLS(*files)


def _require_files(paths: Sequence[Path]) -> None:
    for path in paths:
        if not path.is_file():
            raise ValueError(f"{path}: no such file")


def aio_channel(address: str, tls: ClientTLS | None, options: Sequence[tuple[str, object]] = ()) -> grpc.aio.Channel:
    if tls is None:
        return grpc.aio.insecure_channel(address, options=list(options))
    return grpc.aio.secure_channel(address, tls.credentials(), options=list(options))


def channel(address: str, tls: ClientTLS | None, options: Sequence[tuple[str, object]] = ()) -> grpc.Channel:
    if tls is None:
        return grpc.insecure_channel(address, options=list(options))
    return grpc.secure_channel(address, tls.credentials(), options=list(options))


def bearer_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),) if token else ()


class BearerTokenAuth(grpc.aio.ServerInterceptor):
    """Refuses calls without ``authorization: Bearer <token>`` matching one of ``tokens`` (UNAUTHENTICATED).

    Every configured token is compared, each in constant time, so the time taken says nothing about
    which token or how much of it matched. Methods under ``OPEN_METHOD_PREFIXES`` need no token.
    """

    def __init__(self, tokens: Sequence[str]):
        if not tokens or any(not token for token in tokens):
            raise ValueError("auth tokens must be non-empty")
        self._tokens = tuple(token.encode() for token in tokens)

    def authorized(self, header: str | None) -> bool:
        scheme, _, given = (header or "").partition(" ")
        given_bytes = given.strip().encode()
        matches = [hmac.compare_digest(given_bytes, token) for token in self._tokens]
        return scheme.lower() == "bearer" and any(matches)

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(OPEN_METHOD_PREFIXES):
            return handler
        metadata = dict(handler_call_details.invocation_metadata or ())
        if self.authorized(metadata.get("authorization")):
            return handler
        return _refusing(handler)


def _refusing(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    message = "missing or invalid bearer token (metadata 'authorization: Bearer <token>')"

    async def refuse(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def refuse_stream(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # never reached; makes this an async generator, as streaming handlers must be

    kwargs = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse_stream, **kwargs)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse, **kwargs)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse_stream, **kwargs)
    return grpc.unary_unary_rpc_method_handler(refuse, **kwargs)


def add_server_tls_arguments(parser, defaults: dict | None = None) -> None:
    """--tls-cert, --tls-key and --tls-client-ca (mTLS) on an ``EnvArgumentParser``."""
    defaults = defaults or {}
    parser.add_env_argument("--tls-cert", "TANDEM_TLS_CERT", defaults.get("tls_cert"),
                            help="PEM certificate: serve TLS (with --tls-key)")
    parser.add_env_argument("--tls-key", "TANDEM_TLS_KEY", defaults.get("tls_key"), help="PEM private key of --tls-cert")
    parser.add_env_argument("--tls-client-ca", "TANDEM_TLS_CLIENT_CA", defaults.get("tls_client_ca"),
                            help="PEM CA: require client certificates signed by it (mTLS)")
