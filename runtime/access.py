"""Access control for both front doors: TLS material, the bearer token, and the gRPC interceptor that checks it.

Contract: `Access` is read once at start (`Access.from_files`) and passed to the server; `Access.allows` is the one
token check (constant time), used by `BearerTokenInterceptor` for gRPC and by the HTTP door's middleware.
"""
from __future__ import annotations

import hmac
from dataclasses import dataclass
from pathlib import Path

import grpc

UNAUTHENTICATED_MESSAGE = "authorization: missing or wrong bearer token (send 'authorization: Bearer <token>')"


@dataclass(frozen=True)
class Access:
    """Who may call, through either door: TLS (PEM bytes of the server's certificate chain and key; the HTTP door
    needs them as files too, `tls_cert_file` and `tls_key_file`, since Python's ssl reads only files) and a bearer
    token. With a token, every call must send `authorization: Bearer <token>` or gets UNAUTHENTICATED (HTTP 401);
    health checks (gRPC health and reflection, HTTP /health) are answered without it only when `open_health`
    says so (a load balancer's probe, say)."""

    tls_cert: bytes | None = None
    tls_key: bytes | None = None
    token: str | None = None
    open_health: bool = False
    tls_cert_file: str | None = None
    tls_key_file: str | None = None

    def allows(self, authorization: str | None) -> bool:
        """Whether an `authorization` header value carries the token (constant time); True without a token."""
        if self.token is None:
            return True
        return hmac.compare_digest((authorization or "").encode(), f"Bearer {self.token}".encode())

    @classmethod
    def from_files(cls, token_file: str | None, cert_file: str | None, key_file: str | None,
                   open_health: bool = False) -> "Access":
        """Read the TLS files and the token once, at start; a missing or empty file stops the server with its
        name (SystemExit)."""
        token = _read(token_file, "--auth-token-file").decode().strip() if token_file else None
        cert = _read(cert_file, "--tls-cert") if cert_file else None
        key = _read(key_file, "--tls-key") if key_file else None
        return cls(cert, key, token, open_health, cert_file, key_file)


def _read(path: str, what: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as err:
        raise SystemExit(f"slabserve serve: cannot read {what} {path}: {err.strerror or err}") from None
    if not data.strip():
        raise SystemExit(f"slabserve serve: {what} {path} is empty")
    return data


_OPEN_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


class BearerTokenInterceptor(grpc.ServerInterceptor):
    """Refuses gRPC calls without the operator's bearer token, before any handler (or the engine) sees them."""

    def __init__(self, access: Access):
        self._access = access

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or (self._access.open_health and
                               handler_call_details.method.startswith(_OPEN_PREFIXES)):
            return handler
        if self._access.allows(dict(handler_call_details.invocation_metadata or ()).get("authorization")):
            return handler
        return _refusal(handler)


def _refusal(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that answers UNAUTHENTICATED."""
    def deny(request, context):
        context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)

    def deny_stream(request, context):
        deny(request, context)
        yield  # never reached: makes this a generator for streaming handlers

    codec = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(deny_stream, **codec)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(deny, **codec)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(deny_stream, **codec)
    return grpc.unary_unary_rpc_method_handler(deny, **codec)
