"""The streaming hot path without a model: hand-built SSE chunks equal the pydantic models'
JSON, and merged streams coalesce like single ones (fast)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from kvserve.engine.async_engine import EngineStepError, RequestStream
from kvserve.outputs import CompletionOutput, RequestOutput
from kvserve.server.protocol import (
    ChatChoiceLogprobs,
    ChatCompletionChunk,
    ChatStreamChoice,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogProbs,
    CompletionResponse,
    DeltaMessage,
    TopLogprob,
)
from kvserve.server.serving import ChunkEncoder, merge_streams, sse
from tests.engine.utils import StubEngine

TEXTS = ["", "plain", 'quotes " and \\ back\nslash\t', "Ünïcödé ✓ 漢字 🙂", "\x00\x1f"]


def completion_choices() -> list[CompletionChoice]:
    lp = CompletionLogProbs(
        text_offset=[0, 3], token_logprobs=[-0.5, None], tokens=["a", "é"],
        top_logprobs=[{"a": -0.5, "b": -1.25}, None],
    )  # fmt: skip
    out = []
    for text in TEXTS:
        out.append(CompletionChoice(index=0, text=text))
        out.append(CompletionChoice(index=3, text=text, token_ids=[1, 2]))
    out.append(CompletionChoice(index=1, text="x", logprobs=lp, finish_reason="length"))
    out.append(CompletionChoice(index=2, text="", finish_reason="stop", stop_reason=""))
    out.append(CompletionChoice(index=2, text="y", finish_reason="stop", stop_reason="\n"))
    out.append(CompletionChoice(index=0, text="", finish_reason="stop", stop_reason=2))
    return out


def chat_choices() -> list[ChatStreamChoice]:
    top = [TopLogprob(token="a", logprob=-0.1, bytes=[97]), TopLogprob(token="b", logprob=-2.0)]
    lp = ChatChoiceLogprobs(
        content=[ChatTokenLogprob(token="a", logprob=-0.1, bytes=[97], top_logprobs=top)]
    )
    out = [ChatStreamChoice(index=0, delta=DeltaMessage(role="assistant", content=""))]
    for text in TEXTS[1:]:
        out.append(ChatStreamChoice(index=1, delta=DeltaMessage(content=text)))
        out.append(ChatStreamChoice(index=0, delta=DeltaMessage(content=text), token_ids=[5]))
    out.append(ChatStreamChoice(index=0, delta=DeltaMessage(), finish_reason="length"))
    out.append(ChatStreamChoice(index=0, delta=DeltaMessage(content="a"), logprobs=lp))
    out.append(ChatStreamChoice(index=0, delta=DeltaMessage(), finish_reason="stop", stop_reason=7))
    return out


@pytest.mark.parametrize("include_usage", [False, True])
def test_completion_chunks_equal_the_pydantic_json(include_usage: bool) -> None:
    enc = ChunkEncoder("cmpl-1", "text_completion", "the-model", include_usage)
    for choice in completion_choices():
        model = CompletionResponse(
            id="cmpl-1", created=enc.created, model="the-model", choices=[choice]
        )
        fields = choice.model_dump(mode="json")  # exclude_if drops None token ids
        assert enc.choice(fields) == sse(model, drop_usage=not include_usage)


@pytest.mark.parametrize("include_usage", [False, True])
def test_chat_chunks_equal_the_pydantic_json(include_usage: bool) -> None:
    enc = ChunkEncoder("chatcmpl-1", "chat.completion.chunk", "m", include_usage)
    for choice in chat_choices():
        model = ChatCompletionChunk(
            id="chatcmpl-1", created=enc.created, model="m", choices=[choice]
        )
        fields = choice.model_dump(mode="json")  # exclude_if drops None role/content/token_ids
        assert enc.choice(fields) == sse(model, drop_usage=not include_usage)


def test_a_streamed_chunk_has_the_openai_structure() -> None:
    enc = ChunkEncoder("cmpl-abc", "text_completion", "m", include_usage=True)
    raw = enc.choice(
        {"index": 0, "text": "Hi", "logprobs": None, "finish_reason": None, "stop_reason": None}
    )
    assert raw.startswith("data: {") and raw.endswith("}\n\n") and "\n" not in raw[:-2]
    data = json.loads(raw[len("data: ") :])
    assert data == {
        "id": "cmpl-abc",
        "object": "text_completion",
        "created": enc.created,
        "model": "m",
        "choices": [
            {"index": 0, "text": "Hi", "logprobs": None, "finish_reason": None, "stop_reason": None}
        ],
        "usage": None,
    }
    assert list(data) == ["id", "object", "created", "model", "choices", "usage"]
    no_usage = ChunkEncoder("chatcmpl-x", "chat.completion.chunk", "m", include_usage=False)
    data = json.loads(no_usage.choice({"index": 0, "delta": {}})[len("data: ") :])
    assert list(data) == ["id", "object", "created", "model", "choices"]


def _output(rid: str, ids: list[int], finished: bool = False) -> RequestOutput:
    comp = CompletionOutput(0, "", ids, None, None, "length" if finished else None)
    return RequestOutput(rid, None, [1], [comp], finished=finished)


async def test_merged_streams_coalesce_per_stream() -> None:
    loop = asyncio.get_running_loop()
    stub = StubEngine()
    streams = [RequestStream(f"r{i}", stub, loop) for i in range(2)]  # type: ignore[arg-type]
    got: list[tuple[int, list[int], bool]] = []
    merged = merge_streams(streams)

    async def consume() -> None:
        async for i, out in merged:
            got.append((i, out.outputs[0].token_ids, out.finished))
            await asyncio.sleep(0.05)  # a slow consumer (e.g. a busy event loop)

    task = asyncio.create_task(consume())
    streams[0].put(_output("r0", [1]))
    await asyncio.sleep(0.01)  # the consumer takes it and is busy for a while
    for n in range(2, 6):  # meanwhile both streams make progress
        streams[0].put(_output("r0", list(range(1, n + 1))))
        streams[1].put(_output("r1", list(range(10, 10 + n))))
        await asyncio.sleep(0)
    streams[0].put(_output("r0", [1, 2, 3, 4, 5, 6], finished=True))
    streams[1].put(_output("r1", [10, 11, 12, 13, 14, 15], finished=True))
    await asyncio.wait_for(task, 5)
    # Only the newest output of each stream was left when the consumer came back.
    assert got == [
        (0, [1], False),
        (0, [1, 2, 3, 4, 5, 6], True),
        (1, [10, 11, 12, 13, 14, 15], True),
    ]
    assert stub.aborted == []  # both finished


async def test_merged_streams_raise_a_stream_error_and_abort_the_others() -> None:
    loop = asyncio.get_running_loop()
    stub = StubEngine()
    streams = [RequestStream(f"r{i}", stub, loop) for i in range(2)]  # type: ignore[arg-type]
    got: list[Any] = []
    streams[0].put(_output("r0", [1]))
    streams[1].put(EngineStepError("boom"))
    with pytest.raises(EngineStepError, match="boom"):
        async for item in merge_streams(streams):
            got.append(item)
    assert [i for i, _ in got] == [0]
    assert stub.aborted == ["r0"]  # the unfinished one is aborted; the failed one is done


class _StubModel:
    """What the streaming handlers need of an AsyncLLMEngine."""

    model_name = "m"
    tokenizer = None


def _text_output(text: str, ids: list[int], finish: str | None = None) -> RequestOutput:
    comp = CompletionOutput(0, text, ids, None, None, finish_reason=finish)
    return RequestOutput("r", None, [1, 2, 3], [comp], finished=finish is not None)


async def _events(gen: Any, stream: RequestStream) -> list[dict[str, Any] | str]:
    """Drive a handler's SSE generator: one output, then three coalesced ones, then the end."""
    stream.put(_text_output("a", [11]))
    events = [await gen.__anext__()]
    for n in (2, 3, 4):  # the loop was busy: these pile up and only the newest is sent
        stream.put(_text_output("abcd"[:n], [11, 12, 13, 14][:n]))
    events.append(await gen.__anext__())
    stream.put(_text_output("abcde", [11, 12, 13, 14, 15], "length"))
    events += [e async for e in gen]
    assert stream.num_coalesced == 2
    return [e if e == "data: [DONE]\n\n" else json.loads(e[len("data: ") :]) for e in events]


async def test_completion_stream_sends_coalesced_outputs_as_one_exact_chunk() -> None:
    from kvserve.server import completions
    from kvserve.server.protocol import CompletionRequest
    from kvserve.server.serving import PromptInfo

    stream = RequestStream("r", StubEngine(), asyncio.get_running_loop())  # type: ignore[arg-type]
    req = CompletionRequest(
        prompt=[1, 2, 3], max_tokens=5, stream=True, return_token_ids=True,
        stream_options={"include_usage": True},  # type: ignore[arg-type]
    )  # fmt: skip
    gen = completions._stream(req, _StubModel(), [PromptInfo(None, [1, 2, 3])], [stream], "c-1")  # type: ignore[arg-type]
    *chunks, usage, done = await _events(gen, stream)
    assert done == "data: [DONE]\n\n"
    assert [(c["choices"][0]["text"], c["choices"][0]["token_ids"]) for c in chunks] == [  # type: ignore[index]
        ("a", [11]),
        ("bcd", [12, 13, 14]),
        ("e", [15]),
    ]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, "length"]  # type: ignore[index]
    assert usage["usage"] == {  # type: ignore[index]
        "prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8,
        "prompt_tokens_details": {"cached_tokens": 0},
    }  # fmt: skip


async def test_chat_stream_sends_coalesced_outputs_as_one_exact_chunk() -> None:
    from kvserve.server import chat
    from kvserve.server.chat_pipeline import ChatPlan
    from kvserve.server.protocol import ChatCompletionRequest
    from kvserve.server.serving import PromptInfo
    from kvserve.server.tools import ToolPlan

    stream = RequestStream("r", StubEngine(), asyncio.get_running_loop())  # type: ignore[arg-type]
    req = ChatCompletionRequest(
        messages=[{"role": "user", "content": "hi"}], stream=True,  # type: ignore[list-item]
        return_token_ids=True,
    )  # fmt: skip
    plan = ChatPlan(PromptInfo("hi", [1, 2]), ToolPlan("none"), None)
    gen = chat._stream(req, _StubModel(), [stream], "cc-1", None, plan)  # type: ignore[arg-type]
    role = json.loads((await gen.__anext__())[len("data: ") :])
    assert role["choices"] == [
        {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
         "finish_reason": None, "stop_reason": None}
    ]  # fmt: skip
    *chunks, done = await _events(gen, stream)
    assert done == "data: [DONE]\n\n"
    deltas = [(c["choices"][0]["delta"], c["choices"][0]["token_ids"]) for c in chunks]  # type: ignore[index]
    assert deltas == [
        ({"content": "a"}, [11]),
        ({"content": "bcd"}, [12, 13, 14]),
        ({"content": "e"}, [15]),
    ]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"  # type: ignore[index]
    assert all("usage" not in c for c in chunks)  # no include_usage: no usage key
