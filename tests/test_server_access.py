"""Access control on a real server: a bearer token (UNAUTHENTICATED without it; health open only when the operator
says so) and TLS with a certificate made here by openssl."""
from __future__ import annotations

import shutil

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from _models import make_served_tiny_model
from _served_process import self_signed_cert
from slabserve.proto.slabserve.v1 import serving_pb2 as pb
from slabserve.proto.slabserve.v1 import serving_pb2_grpc as pb_grpc
from slabserve.runtime.engine import Engine, EngineConfig
from slabserve.runtime.server import Access, create_server
from slabserve.runtime.slab_allocator import SlabClass

TOKEN = "s3cret-token"


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    folder = make_served_tiny_model(tmp_path_factory.mktemp("access") / "tiny")
    return Engine(EngineConfig(str(folder), (SlabClass(64, 4),), max_seqs=4, step_tokens=16, buckets=(1, 16)))


def _serve(engine, access: Access):
    server = create_server(engine, "127.0.0.1", 0, access=access)
    server.start()
    server.warm_up()
    return server


def _generate(channel, metadata=()):
    stub = pb_grpc.SlabServeStub(channel)
    request = pb.GenerateRequest(prompt="hello", stopping=pb.StoppingOptions(max_tokens=3, ignore_eos=True))
    return list(stub.Generate(request, metadata=metadata, timeout=30))


def _health(channel, metadata=()):
    return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), metadata=metadata, timeout=10)


def test_bearer_token_guards_every_call(engine):
    server = _serve(engine, Access(token=TOKEN))
    try:
        with grpc.insecure_channel(server.address) as channel:
            for metadata in ((), (("authorization", "Bearer wrong"),), (("authorization", TOKEN),)):
                with pytest.raises(grpc.RpcError) as err:
                    _generate(channel, metadata)
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert "bearer token" in err.value.details()
                with pytest.raises(grpc.RpcError) as err:
                    pb_grpc.SlabServeStub(channel).GetLoad(pb.GetLoadRequest(), metadata=metadata, timeout=10)
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
                with pytest.raises(grpc.RpcError) as err:
                    _health(channel, metadata)
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            good = (("authorization", f"Bearer {TOKEN}"),)
            assert _generate(channel, good)[-1].finished.usage.completion_tokens == 3
            assert _health(channel, good).status == health_pb2.HealthCheckResponse.SERVING
        load = engine.scheduler.load()
        assert load.free_per_class == load.total_per_class  # refused calls never reached the engine
    finally:
        server.drain(1.0)


def test_open_health_answers_probes_without_the_token(engine):
    server = _serve(engine, Access(token=TOKEN, open_health=True))
    try:
        with grpc.insecure_channel(server.address) as channel:
            assert _health(channel).status == health_pb2.HealthCheckResponse.SERVING
            with pytest.raises(grpc.RpcError) as err:
                _generate(channel)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        server.drain(1.0)


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make a certificate")
def test_tls(engine, tmp_path):
    cert, key = self_signed_cert(tmp_path)
    server = _serve(engine, Access(tls_cert=cert.read_bytes(), tls_key=key.read_bytes()))
    try:
        credentials = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
        with grpc.secure_channel(f"localhost:{server.port}", credentials) as channel:
            assert _generate(channel)[-1].finished.usage.completion_tokens == 3
        with grpc.insecure_channel(server.address) as plaintext:  # a plaintext client cannot talk to it
            with pytest.raises(grpc.RpcError) as err:
                _health(plaintext)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        server.drain(1.0)
