"""The gRPC API without a model: request mapping, health from the server's state, binding.

A real ``grpc.aio`` server runs in the test's event loop over a ``ServerState`` whose engines
are stand-ins, so loading, draining and a dead engine can be set at will.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvserve.server.app import SHUTTING_DOWN, ServerState
from kvserve.server.errors import APIError
from kvserve.server.grpc import kvserve_pb2 as pb
from kvserve.server.grpc import kvserve_pb2_grpc as pb_grpc
from kvserve.server.grpc.server import GENERATION_SERVICE, start_grpc_server, stop_grpc_server
from kvserve.server.grpc.service import completion_request
from kvserve.server.protocol import CompletionRequest

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@dataclass
class StubEngine:
    """What health and routing read of an engine."""

    model_name: str = "m"
    dead_reason: str | None = None

    @property
    def is_healthy(self) -> bool:
        return self.dead_reason is None


def test_every_grpc_parameter_is_a_completions_field() -> None:
    # The mapping passes fields by name; a proto field the HTTP model lacked would be dropped.
    names = {f.name for f in pb.SamplingParameters.DESCRIPTOR.fields}
    assert names <= set(CompletionRequest.model_fields), names - set(CompletionRequest.model_fields)


def test_unset_fields_take_the_http_defaults() -> None:
    req = completion_request(pb.GenerateRequest(text="hi"))
    assert req == CompletionRequest.model_validate({"prompt": "hi"})
    assert (req.max_tokens, req.temperature, req.n, req.skip_special_tokens) == (16, None, 1, True)
    params = pb.SamplingParameters(
        temperature=0.0, top_k=-1, stop=["a", "b"], stop_token_ids=[5], skip_special_tokens=False
    )
    req = completion_request(pb.GenerateRequest(model="x", token_ids=pb.TokenIds(ids=[1, 2])))
    assert (req.model, req.prompt) == ("x", [1, 2])
    req = completion_request(pb.GenerateRequest(text="hi", params=params))
    # a set zero is sent (presence), not taken for "unset"
    assert (req.temperature, req.top_k, req.stop, req.stop_token_ids) == (0.0, -1, ["a", "b"], [5])
    assert req.skip_special_tokens is False


@pytest.mark.parametrize(
    ("request_", "message", "param"),
    [
        (pb.GenerateRequest(), "prompt: Field required", "prompt"),
        (
            pb.GenerateRequest(text="x", params=pb.SamplingParameters(temperature=-1)),
            "temperature: Input should be greater than or equal to 0",
            "temperature",
        ),
        (
            pb.GenerateRequest(text="x", params=pb.SamplingParameters(logprobs=-1)),
            "logprobs: Input should be greater than or equal to 0",
            "logprobs",
        ),
    ],
)
def test_invalid_fields_are_400s(request_: pb.GenerateRequest, message: str, param: str) -> None:
    with pytest.raises(APIError) as e:
        completion_request(request_)
    assert (e.value.status, e.value.message, e.value.param) == (400, message, param)


@pytest.fixture
async def grpc_state() -> AsyncIterator[tuple[ServerState, grpc.aio.Channel]]:
    state = ServerState(api_key="k")
    server, poller, port = await start_grpc_server(state, "127.0.0.1", 0)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield state, channel
    await stop_grpc_server(server, poller)


async def _check(channel: grpc.aio.Channel, service: str = "") -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    return (await stub.Check(health_pb2.HealthCheckRequest(service=service))).status


async def _generate_error(channel: grpc.aio.Channel) -> tuple[grpc.StatusCode, str]:
    stub = pb_grpc.GenerationStub(channel)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stub.Generate(pb.GenerateRequest(text="x"), metadata=(("authorization", "Bearer k"),))
    return e.value.code(), e.value.details() or ""


async def test_health_follows_loading_draining_and_dead_engines(grpc_state) -> None:
    state, channel = grpc_state
    assert await _check(channel) == NOT_SERVING  # still loading
    assert await _check(channel, GENERATION_SERVICE) == NOT_SERVING
    assert await _generate_error(channel) == (
        grpc.StatusCode.UNAVAILABLE,
        "the server is still loading its models",
    )
    engine = StubEngine()
    state.engines = {"m": engine}  # type: ignore[dict-item]
    state.ready = True
    assert await _check(channel) == SERVING
    assert await _check(channel, GENERATION_SERVICE) == SERVING
    engine.dead_reason = "3 engine steps failed in a row"
    assert await _check(channel) == NOT_SERVING
    engine.dead_reason = None
    state.draining = True
    assert await _check(channel) == NOT_SERVING
    assert await _generate_error(channel) == (grpc.StatusCode.UNAVAILABLE, SHUTTING_DOWN)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await _check(channel, "no.such.Service")
    assert e.value.code() == grpc.StatusCode.NOT_FOUND


async def test_watch_sees_the_engine_die(grpc_state) -> None:
    state, channel = grpc_state
    engine = StubEngine()
    state.engines, state.ready = {"m": engine}, True  # type: ignore[assignment]
    watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""))
    seen = [(await asyncio.wait_for(watch.read(), 5)).status]
    engine.dead_reason = "dead"
    seen.append((await asyncio.wait_for(watch.read(), 5)).status)  # pushed by the poller
    watch.cancel()
    assert seen == [SERVING, NOT_SERVING]


async def test_the_key_is_checked_before_the_state(grpc_state) -> None:
    _, channel = grpc_state
    stub = pb_grpc.GenerationStub(channel)
    for metadata in ((), (("authorization", "Bearer nope"),), (("authorization", "Basic k"),)):
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.Generate(pb.GenerateRequest(text="x"), metadata=metadata)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED


async def test_a_busy_port_is_an_error() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(OSError, match=f"cannot listen for gRPC on 127.0.0.1:{port}"):
            await start_grpc_server(ServerState(), "127.0.0.1", port)
