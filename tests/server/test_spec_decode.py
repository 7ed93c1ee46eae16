"""A server with speculative decoding answers exactly as one without it (greedy), streams
several tokens per delta correctly, honours stop strings inside accepted runs, and exports
vLLM's spec_decode_* metrics."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.server.conftest import API_KEY, BUILTIN, Server, start_server

PARAGRAPH = (
    "The committee met on Tuesday to discuss the new budget proposal. After a long debate, "
    "the members agreed to increase funding for public libraries and reduce spending on "
    "administrative costs. The final vote will take place next week."
)
MESSAGES = [{"role": "user", "content": f"Repeat this paragraph word for word:\n\n{PARAGRAPH}"}]


@pytest.fixture(scope="module")
def spec_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("logs") / "spec_server.log"
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}
    srv = start_server(
        ["--served-model-name", BUILTIN, "--num-kv-blocks", "400",
         "--speculative-config", json.dumps(spec)],
        log,
        api_key=API_KEY,
    )  # fmt: skip
    yield srv
    srv.stop()


def chat(srv: Server, **kw: object) -> tuple[str, str | None, int]:
    r = srv.client().chat.completions.create(
        model=BUILTIN,
        messages=MESSAGES,
        temperature=0,
        max_tokens=80,
        **kw,  # type: ignore[arg-type]
    )
    c = r.choices[0]
    assert r.usage is not None
    return c.message.content or "", c.finish_reason, r.usage.completion_tokens


def test_greedy_answers_equal_the_plain_server(server: Server, spec_server: Server) -> None:
    before = spec_server.metrics()
    plain = chat(server)
    fast = chat(spec_server)
    assert fast == plain
    after = spec_server.metrics()
    accepted = "kvserve:spec_decode_num_accepted_tokens_total"
    drafts = "kvserve:spec_decode_num_drafts_total"
    assert after[accepted] - before[accepted] > 0  # the copy was predicted
    assert after[drafts] > before[drafts]


def test_stream_of_multi_token_deltas_equals_the_answer(spec_server: Server) -> None:
    text, reason, tokens = chat(spec_server)
    stream = spec_server.client().chat.completions.create(
        model=BUILTIN, messages=MESSAGES, temperature=0, max_tokens=80, stream=True,  # type: ignore[arg-type]
        stream_options={"include_usage": True}, logprobs=True, top_logprobs=1,
    )  # fmt: skip
    parts, reasons, logprob_tokens, usage = [], [], 0, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            parts.append(c.delta.content or "")
            if c.logprobs is not None and c.logprobs.content:
                logprob_tokens += len(c.logprobs.content)
            if c.finish_reason:
                reasons.append(c.finish_reason)
    assert "".join(parts) == text
    assert reasons == [reason]
    assert usage is not None and usage.completion_tokens == tokens
    assert logprob_tokens == tokens  # one logprob entry per token, several per delta


def test_stop_string_inside_an_accepted_run(server: Server, spec_server: Server) -> None:
    text, _, _ = chat(server)
    words = text.split()
    stop = " ".join(words[8:10])  # a stop string well inside the copied paragraph
    plain = chat(server, stop=[stop])
    fast = chat(spec_server, stop=[stop])
    assert fast == plain
    assert plain[1] == "stop" and stop not in plain[0]
    assert len(plain[0]) < len(text)  # the stop came before the end


def test_bad_speculative_config_exits_with_a_message(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="num_speculative_tokens must be at least 1"):
        start_server(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 0}'],
                     tmp_path / "bad.log")  # fmt: skip
