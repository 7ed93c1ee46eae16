"""The gRPC API of a real ``kvserve serve --grpc-port`` process, with the generated client.

One server (the built-in model, an API key, 2 running and at most 2 queued sequences) serves
both APIs, so every result is compared with what ``/v1/completions`` says for the same input,
and the queue cap, the engine's counters and the drain are the ones HTTP shares.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator
from typing import Any

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from kvserve.server.grpc import kvserve_pb2 as pb
from kvserve.server.grpc import kvserve_pb2_grpc as pb_grpc
from tests.server.conftest import API_KEY, BUILTIN, Server, free_port, start_server

pytestmark = pytest.mark.slow

AUTH = (("authorization", f"Bearer {API_KEY}"),)
PROMPT = "The capital of France is"
LONG = 2000  # tokens a request would take minutes to generate: it can only end by abort
GREEDY = {"max_tokens": 24, "temperature": 0.0, "logprobs": 2}
STOP = {"max_tokens": 24, "temperature": 0.0, "stop": ["\n"]}
SAMPLED = {
    "max_tokens": 12, "temperature": 0.8, "seed": 7, "n": 2, "top_k": 20, "top_p": 0.9,
    "min_p": 0.05, "presence_penalty": 0.5, "frequency_penalty": 0.3,
    "repetition_penalty": 1.1, "ignore_eos": True,
}  # fmt: skip


@pytest.fixture(scope="module")
def grpc_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("logs") / "grpc_server.log"
    port = free_port()
    args = [
        "--grpc-port", str(port), "--max-num-seqs", "2", "--max-queued-requests", "2",
        "--num-kv-blocks", "200", "--shutdown-timeout", "60", "--no-warmup",
    ]  # fmt: skip
    srv = start_server(args, log, api_key=API_KEY)
    srv.grpc_port = port  # type: ignore[attr-defined]
    yield srv
    srv.stop()


def target(server: Server) -> str:
    return f"127.0.0.1:{server.grpc_port}"  # type: ignore[attr-defined]


def request(text: str = PROMPT, **params: Any) -> pb.GenerateRequest:
    return pb.GenerateRequest(model=BUILTIN, text=text, params=pb.SamplingParameters(**params))


def http_completion(server: Server, **body: Any) -> httpx.Response:
    body = {"model": BUILTIN, "prompt": PROMPT, "return_token_ids": True, **body}
    return httpx.post(
        f"{server.url}/v1/completions", json=body, headers=server.headers(), timeout=120
    )


def grpc_error(server: Server, message: pb.GenerateRequest) -> grpc.RpcError:
    """The error a unary call with the right key ends with."""
    with grpc.insecure_channel(target(server)) as channel, pytest.raises(grpc.RpcError) as e:
        pb_grpc.GenerationStub(channel).Generate(message, metadata=AUTH)
    return e.value


def stop_reason(choice: pb.Choice) -> str | int | None:
    kind = choice.WhichOneof("stop_reason")
    return None if kind is None else getattr(choice, kind)


async def wait_idle(server: Server) -> dict[str, float]:
    return await asyncio.to_thread(server.wait_idle, BUILTIN, 20.0)


@pytest.mark.parametrize("fields", [GREEDY, STOP, SAMPLED], ids=["greedy", "stop", "sampled"])
async def test_generate_equals_http_completions(grpc_server: Server, fields: dict) -> None:
    before = await wait_idle(grpc_server)
    http = http_completion(grpc_server, **fields).json()
    async with grpc.aio.insecure_channel(target(grpc_server)) as channel:
        r = await pb_grpc.GenerationStub(channel).Generate(request(**fields), metadata=AUTH)
    assert r.model == BUILTIN and r.request_id.startswith("grpc-")
    assert len(r.choices) == len(http["choices"]) == fields.get("n", 1)
    for g, h in zip(r.choices, http["choices"], strict=True):
        assert (g.index, list(g.token_ids), g.text) == (h["index"], h["token_ids"], h["text"])
        assert (g.finish_reason, stop_reason(g)) == (h["finish_reason"], h["stop_reason"])
        if "logprobs" in fields:
            lp = h["logprobs"]
            assert [t.token for t in g.logprobs] == lp["tokens"]
            assert [t.logprob for t in g.logprobs] == lp["token_logprobs"]
            assert [{x.token: x.logprob for x in t.top_logprobs} for t in g.logprobs] == lp[
                "top_logprobs"
            ]
            # greedy: the chosen token comes first and no other has a higher logprob (in bf16
            # two tokens can tie: the chosen one is then the top-2's rank 2, as in vLLM)
            for t in g.logprobs:
                top = max(x.logprob for x in t.top_logprobs)
                assert t.top_logprobs[0].token == t.token and t.top_logprobs[0].logprob == top
                assert sorted(x.rank for x in t.top_logprobs[-2:]) == [1, 2]
    assert list(r.prompt_token_ids) == http["choices"][0]["prompt_token_ids"]
    usage = http["usage"]
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (
        usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"],
    )  # fmt: skip
    if fields is STOP:
        assert (r.choices[0].text, r.choices[0].stop_string) == (" Paris.", "\n")
    # One engine serves both: its counters hold both requests, exactly.
    after = await wait_idle(grpc_server)
    generated = after["kvserve:generation_tokens_total"] - before["kvserve:generation_tokens_total"]
    assert generated == 2 * r.usage.completion_tokens


async def test_token_id_prompt_equals_text_prompt(grpc_server: Server) -> None:
    async with grpc.aio.insecure_channel(target(grpc_server)) as channel:
        stub = pb_grpc.GenerationStub(channel)
        by_text = await stub.Generate(request(max_tokens=8, temperature=0.0), metadata=AUTH)
        ids = pb.TokenIds(ids=by_text.prompt_token_ids)
        params = pb.SamplingParameters(max_tokens=8, temperature=0.0)
        by_ids = await stub.Generate(
            pb.GenerateRequest(token_ids=ids, params=params), metadata=AUTH
        )
    assert list(by_ids.choices[0].token_ids) == list(by_text.choices[0].token_ids)
    assert by_ids.model == BUILTIN  # no model: the first one, as over HTTP


@pytest.mark.parametrize("fields", [GREEDY, STOP, SAMPLED], ids=["greedy", "stop", "sampled"])
async def test_stream_adds_up_to_generate(grpc_server: Server, fields: dict) -> None:
    async with grpc.aio.insecure_channel(target(grpc_server)) as channel:
        stub = pb_grpc.GenerationStub(channel)
        whole = await stub.Generate(request(**fields), metadata=AUTH)
        messages = [m async for m in stub.GenerateStream(request(**fields), metadata=AUTH)]
    assert len({m.request_id for m in messages}) == 1 and messages[0].request_id != whole.request_id
    assert [m.HasField("usage") for m in messages] == [False] * (len(messages) - 1) + [True]
    assert messages[-1].usage == whole.usage
    assert all(m.choices for m in messages)
    for c in whole.choices:
        deltas = [d for m in messages for d in m.choices if d.index == c.index]
        assert all(d.token_ids for d in deltas)  # every delta brings tokens
        assert [t for d in deltas for t in d.token_ids] == list(c.token_ids)
        assert "".join(d.text for d in deltas) == c.text
        assert [d.finish_reason for d in deltas] == [""] * (len(deltas) - 1) + [c.finish_reason]
        assert stop_reason(deltas[-1]) == stop_reason(c)
        if "logprobs" in fields:
            assert [x for d in deltas for x in d.logprobs] == list(c.logprobs)


def test_api_key_is_required(grpc_server: Server) -> None:
    with grpc.insecure_channel(target(grpc_server)) as channel:
        stub = pb_grpc.GenerationStub(channel)
        good = ("authorization", f"Bearer {API_KEY}")
        for metadata in (
            (), (("authorization", "Bearer wrong"),), (("authorization", API_KEY),), (good, good),
        ):  # fmt: skip
            for method in (stub.Generate, lambda r, **kw: list(stub.GenerateStream(r, **kw))):
                with pytest.raises(grpc.RpcError) as e:
                    method(request(max_tokens=1), metadata=metadata)
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert e.value.details() == (
                    "Incorrect or missing API key: send the metadata 'authorization: Bearer <key>'"
                )


BAD = [
    ({"temperature": -1.0}, {}),
    ({"top_p": 0.0}, {}),
    ({"n": 0}, {}),
    ({"max_tokens": 0}, {}),
    ({"logprobs": 21}, {}),
    ({"max_tokens": 10_000}, {}),  # beyond the context
    ({"stop_token_ids": [-1]}, {}),
    ({}, {"text": ""}),  # an empty prompt
    ({}, {"token_ids": pb.TokenIds(ids=[])}),
    ({}, {"token_ids": pb.TokenIds(ids=[1, 10**6])}),  # outside the vocabulary
    ({"priority": 1}, {}),  # needs --scheduling-policy priority
]


@pytest.mark.parametrize(("params", "prompt"), BAD, ids=[str(i) for i in range(len(BAD))])
def test_invalid_requests_match_http_400s(grpc_server: Server, params: dict, prompt: dict) -> None:
    prompt = prompt or {"text": PROMPT}
    message = pb.GenerateRequest(model=BUILTIN, params=pb.SamplingParameters(**params), **prompt)
    error = grpc_error(grpc_server, message)
    http_prompt = prompt["text"] if "text" in prompt else list(prompt["token_ids"].ids)
    http = http_completion(grpc_server, prompt=http_prompt, **params)
    assert http.status_code == 400
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details() == http.json()["error"]["message"]


def test_unknown_model_is_not_found_as_over_http(grpc_server: Server) -> None:
    error = grpc_error(grpc_server, pb.GenerateRequest(model="no-such-model", text=PROMPT))
    http = http_completion(grpc_server, model="no-such-model")
    assert http.status_code == 404
    assert error.code() == grpc.StatusCode.NOT_FOUND
    assert error.details() == http.json()["error"]["message"]


def test_message_above_the_body_limit_is_refused(grpc_server: Server) -> None:
    # --max-request-body-bytes (1 MiB by default) bounds gRPC messages too
    error = grpc_error(grpc_server, request("a " * 600_000))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


async def wait_for_queue(server: Server, running: int, waiting: int) -> None:
    deadline = time.monotonic() + 60
    while True:
        m = await asyncio.to_thread(server.metrics)
        now = (m["kvserve:num_requests_running"], m["kvserve:num_requests_waiting"])
        if now == (running, waiting):
            return
        assert time.monotonic() < deadline, now
        await asyncio.sleep(0.1)


async def test_queue_cap_is_resource_exhausted_and_shared_with_http(grpc_server: Server) -> None:
    await wait_idle(grpc_server)
    long = request("Tell me everything.", max_tokens=LONG, ignore_eos=True)
    async with grpc.aio.insecure_channel(target(grpc_server)) as channel:
        stub = pb_grpc.GenerationStub(channel)
        # Two at a time: sent at once, the last two would find the first two still queued.
        calls = [stub.GenerateStream(long, metadata=AUTH) for _ in range(2)]
        await wait_for_queue(grpc_server, running=2, waiting=0)
        calls += [stub.GenerateStream(long, metadata=AUTH) for _ in range(2)]
        await wait_for_queue(grpc_server, running=2, waiting=2)  # both caps reached
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.Generate(request(max_tokens=1), metadata=AUTH)
        http = await asyncio.to_thread(http_completion, grpc_server, max_tokens=1)
        for call in calls:
            call.cancel()
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "--max-queued-requests" in (e.value.details() or "")
    trailing = dict(e.value.trailing_metadata() or ())
    assert int(trailing["retry-after"]) >= 1
    assert http.status_code == 429  # gRPC's calls fill the same queue
    after = await wait_idle(grpc_server)  # cancelling freed every block
    assert after["kvserve:kv_cache_usage_perc"] == 0


async def test_cancelled_stream_frees_its_blocks(grpc_server: Server) -> None:
    before = await wait_idle(grpc_server)
    long = request("Tell me everything.", max_tokens=LONG, ignore_eos=True)
    async with grpc.aio.insecure_channel(target(grpc_server)) as channel:
        call = pb_grpc.GenerationStub(channel).GenerateStream(long, metadata=AUTH)
        for _ in range(3):
            assert (await call.read()).choices
        busy = await asyncio.to_thread(grpc_server.metrics)
        assert busy["kvserve:num_requests_running"] == 1
        assert busy["kvserve:kv_cache_usage_perc"] > 0
        call.cancel()
    after = await wait_idle(grpc_server)
    generated = after["kvserve:generation_tokens_total"] - before["kvserve:generation_tokens_total"]
    assert 3 <= generated < LONG


async def test_unary_past_its_deadline_frees_its_blocks(grpc_server: Server) -> None:
    before = await wait_idle(grpc_server)
    long = request("Tell me everything.", max_tokens=LONG, ignore_eos=True)
    async with grpc.aio.insecure_channel(target(grpc_server)) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await pb_grpc.GenerationStub(channel).Generate(long, metadata=AUTH, timeout=3)
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    after = await wait_idle(grpc_server)
    generated = after["kvserve:generation_tokens_total"] - before["kvserve:generation_tokens_total"]
    assert generated < LONG


def test_health_and_reflection_need_no_key(grpc_server: Server) -> None:
    with grpc.insecure_channel(target(grpc_server)) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "kvserve.v1.Generation"):
            status = health.Check(health_pb2.HealthCheckRequest(service=service)).status
            assert status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as e:
            health.Check(health_pb2.HealthCheckRequest(service="no.such.Service"))
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
        db = ProtoReflectionDescriptorDatabase(channel)
        assert sorted(db.get_services()) == [
            "grpc.health.v1.Health",
            "grpc.reflection.v1alpha.ServerReflection",
            "kvserve.v1.Generation",
        ]
        proto = db.FindFileContainingSymbol("kvserve.v1.Generation")
        methods = {m.name: m.server_streaming for m in proto.service[0].method}
        assert methods == {"Generate": False, "GenerateStream": True}


async def test_sigterm_drains_a_grpc_stream_then_exits_0(grpc_server: Server) -> None:
    """Last in this module: it stops the server (--shutdown-timeout 60)."""
    await wait_idle(grpc_server)
    async with grpc.aio.insecure_channel(target(grpc_server)) as channel:
        stub = pb_grpc.GenerationStub(channel)
        call = stub.GenerateStream(request(max_tokens=48, ignore_eos=True), metadata=AUTH)
        messages = [await call.read()]
        grpc_server.proc.send_signal(signal.SIGTERM)
        health = health_pb2_grpc.HealthStub(channel)
        deadline = time.monotonic() + 10
        while (await health.Check(health_pb2.HealthCheckRequest())).status != (
            health_pb2.HealthCheckResponse.NOT_SERVING
        ):
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.Generate(request(max_tokens=1), metadata=AUTH)
        while (message := await call.read()) != grpc.aio.EOF:  # read(): no iterator after it
            messages.append(message)
    assert (e.value.code(), e.value.details()) == (
        grpc.StatusCode.UNAVAILABLE,
        "the server is shutting down",
    )
    assert sum(len(c.token_ids) for m in messages for c in m.choices) == 48
    assert messages[-1].choices[-1].finish_reason == "length"
    assert await asyncio.to_thread(grpc_server.proc.wait, 60) == 0
