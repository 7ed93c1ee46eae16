"""Logprobs parity with vLLM on the server: echo + logprobs in lm-evaluation-harness's shape,
``prompt_logprobs`` on both endpoints, ``stream_options.continuous_usage_stats``."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from kvserve import LLM, SamplingParams
from kvserve.outputs import RequestOutput
from kvserve.server.protocol import ChatCompletionChunk, CompletionResponse
from tests.server.conftest import TINY, Server
from tests.server.test_completions import assert_chunks_are_the_models_json, raw_sse_events

pytestmark = pytest.mark.slow

CONTEXT = "The quick brown fox"
CONTINUATION = " jumps over the lazy dog"


@pytest.fixture(scope="module")
def offline(tiny_model_dir: Path) -> Iterator[LLM]:
    """The server's tiny model offline, the reference for its numbers (same dtype: auto)."""
    llm = LLM(str(tiny_model_dir), num_kv_blocks=64)
    yield llm


def post(server: Server, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers=server.headers(), timeout=60)


def reference(llm: LLM, ids: list[int], k: int, max_tokens: int = 1) -> RequestOutput:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=k, prompt_logprobs=k)
    return llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]


def test_echo_logprobs_in_lm_eval_shape(server: Server, offline: LLM) -> None:
    """lm-eval's ``local-completions`` loglikelihood request, exactly: token-id prompts,
    ``echo``, ``logprobs: 1``, ``max_tokens: 1``; it reads ``token_logprobs[ctxlen:-1]``."""
    tok = offline.get_tokenizer()
    ctx = tok.encode(CONTEXT)
    full = [ctx + tok.encode(CONTINUATION), tok.encode(CONTEXT + " and more")]
    body = {"model": TINY, "prompt": full, "temperature": 0, "max_tokens": 1, "logprobs": 1,
            "seed": 1234, "echo": True}  # fmt: skip
    r = post(server, "/v1/completions", body)
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    assert len(choices) == 2
    for ids, choice in zip(full, choices, strict=True):
        ref = reference(offline, ids, 1)
        lp = choice["logprobs"]
        n = len(ids) + 1  # the prompt, then the one generated token
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == n
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert lp["tokens"] == [tok.decode([t]) for t in [*ids, *ref.outputs[0].token_ids]]
        assert choice["text"] == tok.decode(ids) + ref.outputs[0].text
        offsets = [0]
        for t in lp["tokens"][:-1]:
            offsets.append(offsets[-1] + len(t))
        assert lp["text_offset"] == offsets
        assert ref.prompt_logprobs is not None
        for j in range(1, len(ids)):
            entry = ref.prompt_logprobs[j]
            assert entry is not None
            assert lp["token_logprobs"][j] == pytest.approx(entry[ids[j]].logprob, abs=1e-4)
            want = {v.decoded_token: v.logprob for v in entry.values()}
            assert lp["top_logprobs"][j] == pytest.approx(want, abs=1e-4)
        # vLLM returns the choice's prompt_logprobs too
        assert choice["prompt_logprobs"][0] is None
        assert len(choice["prompt_logprobs"]) == len(ids)
    # lm-eval's parse_logprobs on the first request: sum over the continuation, greedy flag
    ctxlen = len(ctx)
    lp = choices[0]["logprobs"]
    ref = reference(offline, full[0], 1)
    assert ref.prompt_logprobs is not None
    cont = [ref.prompt_logprobs[j][full[0][j]] for j in range(ctxlen, len(full[0]))]  # type: ignore[index]
    assert sum(lp["token_logprobs"][ctxlen:-1]) == pytest.approx(
        sum(x.logprob for x in cont), abs=1e-3
    )
    greedy = all(
        t == max(top.values())
        for t, top in zip(
            lp["token_logprobs"][ctxlen:-1], lp["top_logprobs"][ctxlen:-1], strict=True
        )
    )
    assert greedy == all(x.rank == 1 for x in cont)


def test_echo_with_max_tokens_zero(server: Server, offline: LLM) -> None:
    """OpenAI's prompt scoring: ``max_tokens: 0`` with echo returns the prompt alone."""
    tok = offline.get_tokenizer()
    ids = tok.encode(CONTEXT + CONTINUATION)
    for prompt in (CONTEXT + CONTINUATION, ids):  # text and token ids
        req = {"model": TINY, "prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 0,
               "temperature": 0}  # fmt: skip
        r = post(server, "/v1/completions", req)
        assert r.status_code == 200, r.text
        body = r.json()
        (choice,) = body["choices"]
        assert choice["text"] == (prompt if isinstance(prompt, str) else tok.decode(ids))
        assert choice["finish_reason"] == "length"
        lp = choice["logprobs"]
        assert len(lp["token_logprobs"]) == len(ids) and lp["token_logprobs"][0] is None
        ref = reference(offline, ids, 0)
        assert ref.prompt_logprobs is not None
        assert lp["token_logprobs"][1:] == pytest.approx(
            [e[t].logprob for e, t in zip(ref.prompt_logprobs[1:], ids[1:], strict=True)],  # type: ignore[index]
            abs=1e-4,
        )
        assert all(len(top) == 1 for top in lp["top_logprobs"][1:])  # logprobs 0: the token alone
        assert body["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0,
                                 "total_tokens": len(ids),
                                 "prompt_tokens_details": {"cached_tokens": 0}}  # fmt: skip
    # streamed: one chunk with the prompt and its logprobs, then [DONE]
    events = raw_sse_events(
        server, "/v1/completions",
        {"model": TINY, "prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 1,
         "stream": True, "temperature": 0},
    )  # fmt: skip
    chunks = assert_chunks_are_the_models_json(events, CompletionResponse, False)
    (chunk,) = chunks
    (choice,) = chunk["choices"]
    assert choice["text"] == tok.decode(ids) and choice["finish_reason"] == "length"
    assert len(choice["logprobs"]["tokens"]) == len(ids)
    # without echo, max_tokens 0 is refused, as in vLLM
    client = server.client(max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=TINY, prompt="hi", max_tokens=0)
    assert info.value.param == "max_tokens"


def test_streamed_echo_logprobs_equal_non_streamed(server: Server) -> None:
    body = {"model": TINY, "prompt": CONTEXT, "max_tokens": 5, "echo": True, "logprobs": 2,
            "temperature": 0, "ignore_eos": True}  # fmt: skip
    whole = post(server, "/v1/completions", body).json()["choices"][0]
    events = raw_sse_events(server, "/v1/completions", {**body, "stream": True})
    chunks = assert_chunks_are_the_models_json(events, CompletionResponse, False)
    merged: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "text_offset": []}
    for c in chunks:
        for key, values in merged.items():
            values.extend(c["choices"][0]["logprobs"][key])
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["text"]
    assert merged["tokens"] == whole["logprobs"]["tokens"]
    assert merged["text_offset"] == whole["logprobs"]["text_offset"]
    assert merged["token_logprobs"][0] is None
    assert merged["token_logprobs"][1:] == pytest.approx(whole["logprobs"]["token_logprobs"][1:])


def check_prompt_logprobs_json(got: list[Any], ref: RequestOutput, k: int) -> None:
    """vLLM's JSON: null, then per token {"<id>": {"logprob", "rank", "decoded_token"}} with the
    prompt's token first, then the top-k."""
    assert ref.prompt_logprobs is not None
    assert got[0] is None and len(got) == len(ref.prompt_token_ids)
    for j, (entry, want) in enumerate(zip(got[1:], ref.prompt_logprobs[1:], strict=True), 1):
        assert want is not None
        assert list(entry) == [str(t) for t in want]
        assert next(iter(entry)) == str(ref.prompt_token_ids[j])
        assert len(entry) in (k, k + 1)
        for t, lp in want.items():
            e = entry[str(t)]
            assert list(e) == ["logprob", "rank", "decoded_token"]
            assert e["rank"] == lp.rank and e["decoded_token"] == lp.decoded_token
            assert e["logprob"] == pytest.approx(lp.logprob, abs=1e-4)
        assert sorted(e["rank"] for e in entry.values())[:k] == list(range(1, k + 1))


def test_prompt_logprobs_on_completions(server: Server, offline: LLM) -> None:
    ids = offline.get_tokenizer().encode(CONTEXT + CONTINUATION)
    r = post(server, "/v1/completions", {"model": TINY, "prompt": ids, "max_tokens": 2,
                                         "temperature": 0, "prompt_logprobs": 3})  # fmt: skip
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    assert choice["logprobs"] is None  # not asked
    check_prompt_logprobs_json(choice["prompt_logprobs"], reference(offline, ids, 3), 3)
    plain = post(server, "/v1/completions", {"model": TINY, "prompt": ids, "max_tokens": 2})
    assert "prompt_logprobs" not in plain.json()["choices"][0]  # unchanged when not asked


def test_prompt_logprobs_on_chat(server: Server, offline: LLM) -> None:
    messages = [{"role": "user", "content": "Say something."}]
    r = server.client().chat.completions.create(
        model=TINY, messages=messages, max_tokens=2, temperature=0,  # type: ignore[arg-type]
        extra_body={"prompt_logprobs": 2},
    )  # fmt: skip
    got = (r.model_extra or {})["prompt_logprobs"]  # vLLM: top level of the response
    t = httpx.post(
        f"{server.url}/tokenize", json={"model": TINY, "messages": messages},
        headers=server.headers(),
    ).json()["tokens"]  # fmt: skip
    assert r.usage is not None and r.usage.prompt_tokens == len(t)
    check_prompt_logprobs_json(got, reference(offline, t, 2), 2)
    plain = post(server, "/v1/chat/completions", {"model": TINY, "messages": messages,
                                                  "max_tokens": 2})  # fmt: skip
    assert "prompt_logprobs" not in plain.json()


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_prompt_logprobs_refused_where_vllm_refuses(server: Server, path: str) -> None:
    base: dict[str, Any] = {"model": TINY, "max_tokens": 2}
    base |= {"prompt": "hi"} if path == "/v1/completions" else {
        "messages": [{"role": "user", "content": "hi"}]}  # fmt: skip
    for bad in ({"prompt_logprobs": 1, "stream": True}, {"prompt_logprobs": -1},
                {"prompt_logprobs": 21}, {"prompt_logprobs": True}):  # fmt: skip
        r = post(server, path, base | bad)
        assert r.status_code == 400, (bad, r.text)
        assert r.json()["error"]["type"] == "invalid_request_error"
    events = raw_sse_events(server, path, base | {"prompt_logprobs": 0, "stream": True})
    assert events[-1] == "[DONE]"  # 0 with stream is accepted (vLLM's rule)


def usage_chunks(events: list[str]) -> list[dict[str, Any]]:
    *chunks, done = events
    assert done == "[DONE]"
    return [json.loads(c) for c in chunks]


def test_continuous_usage_stats_on_completions(server: Server) -> None:
    body = {"model": TINY, "prompt": [[5, 6, 7, 8], [9, 10]], "max_tokens": 7, "n": 2,
            "temperature": 0.8, "seed": 5, "ignore_eos": True, "stream": True,
            "return_token_ids": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}  # fmt: skip
    events = raw_sse_events(server, "/v1/completions", body)
    chunks = assert_chunks_are_the_models_json(events, CompletionResponse, True)
    *deltas, final = chunks
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == 4 * 7
    sent: dict[int, int] = {}
    for c in deltas:
        (choice,) = c["choices"]
        i = choice["index"]
        sent[i] = sent.get(i, 0) + len(choice["token_ids"])
        prompt = 4 if i < 2 else 2  # choices 0, 1: prompt 0; choices 2, 3: prompt 1
        assert c["usage"] == {
            "prompt_tokens": prompt,
            "completion_tokens": sent[i],
            "total_tokens": prompt + sent[i],
            "prompt_tokens_details": None,
        }
    assert sent == {0: 7, 1: 7, 2: 7, 3: 7}
    # without include_usage the option is ignored: no usage key at all (vLLM)
    body["stream_options"] = {"continuous_usage_stats": True}
    chunks = usage_chunks(raw_sse_events(server, "/v1/completions", body))
    assert all("usage" not in c for c in chunks)


def test_continuous_usage_stats_on_chat(server: Server) -> None:
    messages = [{"role": "user", "content": "Count to ten."}]
    body = {"model": TINY, "messages": messages, "max_tokens": 6, "temperature": 0,
            "ignore_eos": True, "stream": True, "return_token_ids": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}  # fmt: skip
    events = raw_sse_events(server, "/v1/chat/completions", body)
    chunks = assert_chunks_are_the_models_json(events, ChatCompletionChunk, True)
    prompt = len(
        httpx.post(
            f"{server.url}/tokenize", json={"model": TINY, "messages": messages},
            headers=server.headers(),
        ).json()["tokens"]
    )  # fmt: skip
    role, *deltas, final = chunks
    assert role["usage"] == {"prompt_tokens": prompt, "completion_tokens": 0,
                             "total_tokens": prompt, "prompt_tokens_details": None}  # fmt: skip
    sent, seen = 0, []
    for c in deltas:
        sent += len(c["choices"][0]["token_ids"])
        seen.append(c["usage"]["completion_tokens"])
        assert c["usage"]["prompt_tokens"] == prompt
        assert c["usage"]["total_tokens"] == prompt + sent
    assert seen == sorted(seen) and seen[-1] == 6
    assert all(c["usage"]["completion_tokens"] == n for c, n in zip(deltas, seen, strict=True))
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == 6
    # through the official client: every chunk's usage, counts increasing to the total
    stream = server.client().chat.completions.create(
        model=TINY, messages=messages, max_tokens=6, temperature=0, stream=True,  # type: ignore[arg-type]
        stream_options={"include_usage": True, "continuous_usage_stats": True},  # type: ignore[typeddict-unknown-key]
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    counts = [ch.usage.completion_tokens for ch in stream if ch.usage is not None]
    assert counts[0] == 0 and counts[-1] == 6 and counts == sorted(counts)
