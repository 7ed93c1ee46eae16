"""The app and the CLI without a model: readiness, guards, flag validation (fast)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest.mock import ANY

import pytest
from fastapi.testclient import TestClient

from kvserve.engine.async_engine import AsyncLLMEngine
from kvserve.engine.llm import build_engine_config
from kvserve.engine.llm_engine import LLMEngine
from kvserve.server.app import ServerState, build_app
from kvserve.server.cli import _model_specs, add_serve_parser
from kvserve.server.errors import APIError, error_event, error_response
from tests.engine.utils import make_tiny_model


def loading_client(**kw: object) -> TestClient:
    return TestClient(build_app(ServerState(**kw)))  # type: ignore[arg-type]


def test_everything_is_503_while_loading() -> None:
    client = loading_client()
    r = client.get("/health")
    assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
    assert client.get("/v1/models").status_code == 503
    r = client.post("/v1/completions", json={"prompt": "hi"})
    assert r.status_code == 503
    assert client.get("/metrics").status_code == 200  # metrics never need a model


def test_auth_comes_before_anything_else() -> None:
    client = loading_client(api_key="k")
    assert client.post("/v1/completions", json={}).status_code == 401
    wrong = {"Authorization": "Bearer nope"}
    assert client.post("/tokenize", json={}, headers=wrong).status_code == 401
    ok = {"Authorization": "Bearer k"}
    assert client.post("/v1/completions", json={"prompt": "x"}, headers=ok).status_code == 503
    assert client.get("/health").status_code == 503  # open, but not ready


def test_body_limit_is_413_in_openai_shape() -> None:
    client = loading_client(max_request_body_bytes=100)
    r = client.post("/v1/completions", json={"prompt": "x" * 200})
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "request_too_large"


def test_validation_errors_are_400_not_422() -> None:
    client = loading_client()
    r = client.post("/v1/chat/completions", json={"messages": "not a list"})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "messages" and err["type"] == "invalid_request_error"
    r = client.post("/v1/completions", json={"prompt": "x", "stream_options": {}})
    assert r.status_code == 400 and "stream_options" in r.json()["error"]["message"]


JSON = {"Content-Type": "application/json"}


def post_raw(client: TestClient, body: bytes, path: str = "/v1/completions") -> dict[str, Any]:
    r = client.post(path, content=body, headers=JSON)
    assert r.status_code == 400, r.text
    return dict(r.json()["error"])


def test_lone_surrogates_are_400_before_anything_else() -> None:
    client = loading_client()  # every well-formed request would be a 503: the check comes first
    chat = b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}'
    err = post_raw(client, chat, "/v1/chat/completions")
    assert err["param"] == "messages" and err["code"] == 400
    where = "the string at messages[0].content[0].text holds a lone UTF-16 surrogate"
    assert where in err["message"]
    err = post_raw(client, b'{"logit_bias": {"\\uDC00": 1}}')
    assert err["param"] == "logit_bias" and "a key in logit_bias" in err["message"]
    err = post_raw(client, b'{"\\udbff": 1}')
    assert err["param"] is None and "a key in the body" in err["message"]
    # As bytes: encoded surrogates (not UTF-8, but json.loads decodes them), or UTF-16.
    err = post_raw(client, b'{"prompt": ["ok", "\xed\xa0\x80"]}')
    assert err["param"] == "prompt" and "the string at prompt[1]" in err["message"]
    err = post_raw(client, '{"stop": "\ud800"}'.encode("utf-16-le", "surrogatepass"))
    assert err["param"] == "stop"
    # Not JSON (cut short): the JSON parser's 400, which names no field.
    err = post_raw(client, b'{"prompt": "\\ud800')
    assert err["param"] is None and "not valid JSON" in err["message"]
    # Valid text goes through to the 503: a valid pair (one code point), an escaped backslash,
    # UTF-8 (Hangul syllables start with the byte of encoded surrogates, 0xED), UTF-16.
    for body in (
        b'{"prompt": "\\ud83d\\ude00"}',
        b'{"prompt": "\\\\ud800"}',
        '{"prompt": "\ud55c\uad6d"}'.encode(),
        '{"prompt": "h\u00e9"}'.encode("utf-16"),
    ):
        r = client.post("/v1/completions", content=body, headers=JSON)
        assert r.status_code == 503, r.text


def test_error_bodies_survive_odd_text() -> None:
    r = error_response(400, "bad \ud800 text", param="\udfff")
    assert r.body == (
        b'{"error":{"message":"bad \\ud800 text","type":"invalid_request_error",'
        b'"param":"\\udfff","code":400}}'
    )
    event = error_event(APIError(500, "\ud800 \u00e9"))
    assert event.startswith("data: {") and event.endswith("}\n\n") and event.isascii()


def test_openapi_documents_the_real_statuses() -> None:
    open_doc = loading_client().get("/openapi.json").json()
    client = loading_client(api_key="k")
    r = client.get("/openapi.json")  # no key needed, like /health
    assert r.status_code == 200
    doc = r.json()
    assert "422" not in json.dumps(doc) and "HTTPValidationError" not in json.dumps(doc)
    ops = {(m, p): op for p, item in doc["paths"].items() for m, op in item.items()}
    # The HTTP layer's 408 and 431 (http_guard.py) can answer any route.
    assert all({"408", "431"} <= set(op["responses"]) for op in ops.values())
    statuses = {key: sorted(set(op["responses"]) - {"408", "431"}) for key, op in ops.items()}
    generation = ["200", "400", "401", "404", "413", "429", "500", "503"]
    lora = ["200", "400", "401", "403", "404", "413", "500", "503"]  # 403: runtime updating off
    assert statuses == {
        ("post", "/v1/completions"): generation,
        ("post", "/v1/chat/completions"): generation,
        ("post", "/v1/embeddings"): generation,
        ("post", "/v1/responses"): generation,
        ("get", "/v1/responses/{response_id}"): ["200", "400", "401", "404", "500", "503"],
        ("delete", "/v1/responses/{response_id}"): ["200", "400", "401", "404", "500", "503"],
        ("get", "/v1/models"): ["200", "401", "500", "503"],
        ("get", "/v1/models/{model_id}"): ["200", "401", "404", "500", "503"],
        ("get", "/health"): ["200", "503"],
        ("get", "/ping"): ["200", "503"],
        ("post", "/ping"): ["200", "503"],
        ("get", "/version"): ["200"],
        ("get", "/metrics"): ["200"],
        ("post", "/tokenize"): ["200", "400", "401", "404", "413", "500", "503"],
        ("post", "/detokenize"): ["200", "400", "401", "404", "413", "500", "503"],
        ("post", "/reset_prefix_cache"): ["200", "401", "404", "500", "503"],
        ("post", "/v1/messages"): generation,
        ("post", "/v1/messages/count_tokens"): ["200", "400", "401", "404", "413", "500", "503"],
        ("post", "/v1/load_lora_adapter"): lora,
        ("post", "/v1/unload_lora_adapter"): lora,
        ("post", "/v1/files"): ["200", "400", "401", "413", "500", "503"],
        ("get", "/v1/files"): ["200", "400", "401", "500", "503"],
        ("get", "/v1/files/{file_id}"): ["200", "401", "404", "500", "503"],
        ("get", "/v1/files/{file_id}/content"): ["200", "401", "404", "500", "503"],
        ("delete", "/v1/files/{file_id}"): ["200", "400", "401", "404", "500", "503"],
        ("post", "/v1/batches"): ["200", "400", "401", "429", "500", "503"],
        ("get", "/v1/batches"): ["200", "400", "401", "404", "500", "503"],
        ("get", "/v1/batches/{batch_id}"): ["200", "401", "404", "500", "503"],
        ("post", "/v1/batches/{batch_id}/cancel"): ["200", "400", "401", "404", "500", "503"],
        ("post", "/v1/score"): generation,  # /score: an unpublished alias
        ("post", "/v1/rerank"): generation,  # /rerank, /v2/rerank: unpublished aliases
        ("post", "/sleep"): ["200", "400", "401", "404", "409", "503"],
        ("post", "/wake_up"): ["200", "400", "401", "404", "503"],
        ("get", "/is_sleeping"): ["200", "401", "404", "503"],
    }
    error = {"$ref": "#/components/schemas/ErrorResponse"}
    assert ops["post", "/tokenize"]["responses"]["400"]["content"]["application/json"] == {
        "schema": error
    }
    anthropic = {"$ref": "#/components/schemas/AnthropicErrorResponse"}
    for route in ("/v1/messages", "/v1/messages/count_tokens"):
        for status in ("400", "401"):
            content = ops["post", route]["responses"][status]["content"]["application/json"]
            assert content == {"schema": anthropic}
    assert ops["get", "/v1/models"]["security"] == [{"bearerAuth": []}, {"apiKeyHeader": []}]
    assert "security" not in ops["get", "/health"]
    # Without an API key there is no 401 and no security scheme.
    assert "401" not in json.dumps(open_doc["paths"])
    assert "securitySchemes" not in open_doc["components"]
    for path in ("/docs", "/redoc"):
        assert client.get(path).status_code == 404


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["serve", *argv])


def test_serve_defaults_are_safe() -> None:
    args = parse()
    assert args.host == "127.0.0.1" and args.port == 8000
    assert args.models == [] and args.max_request_body_bytes == 1024 * 1024
    assert args.api_key is None and args.max_queued_requests is None
    assert parse("--max-request-body-bytes", "2MiB").max_request_body_bytes == 2 * 1024**2
    assert _model_specs(args) == [(None, None)]
    assert (args.max_n, args.max_prompts_per_request) == (128, 256)
    assert args.max_num_queued_tokens is None
    args = parse("--max-n", "4", "--max-prompts-per-request", "2", "--max-num-queued-tokens", "9")
    assert (args.max_n, args.max_prompts_per_request, args.max_num_queued_tokens) == (4, 2, 9)


def test_serve_flag_errors() -> None:
    with pytest.raises(ValueError, match="one per model"):
        _model_specs(parse("--served-model-name", "a", "b"))
    with pytest.raises(ValueError, match="does not exist"):
        _model_specs(parse("/no/such/model"))
    with pytest.raises(ValueError, match="--max-n"):
        _model_specs(parse("--max-n", "0"))
    with pytest.raises(ValueError, match="--max-prompts-per-request"):
        _model_specs(parse("--max-prompts-per-request", "0"))
    with pytest.raises(ValueError, match="--max-num-queued-tokens"):
        _model_specs(parse("--max-num-queued-tokens", "-1"))
    with pytest.raises(ValueError, match="needs --enable-sleep-mode"):
        _model_specs(parse("--sleep-idle-seconds", "5"))
    with pytest.raises(ValueError, match="positive number"):
        _model_specs(parse("--enable-sleep-mode", "--sleep-idle-seconds", "0"))
    with pytest.raises(ValueError, match="--max-score-tokens-per-request"):
        _model_specs(parse("--max-score-tokens-per-request", "0"))
    # Through the real entry point: a clear message and exit code 2, before loading anything.
    r = subprocess.run(
        [sys.executable, "-m", "kvserve.cli", "serve", "/no/such/model"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 2 and "does not exist" in r.stderr


@pytest.fixture
def tiny_app(tmp_path: Path) -> Iterator[tuple[TestClient, AsyncLLMEngine]]:
    """The app over a tiny random model without a tokenizer (token-id prompts only)."""
    make_tiny_model("llama", tmp_path)
    cfg = build_engine_config(str(tmp_path), dtype="float32", num_kv_blocks=64, block_size=4)
    engine = AsyncLLMEngine(LLMEngine(cfg))
    state = ServerState()
    state.add_engine(engine)
    state.ready = True
    with TestClient(build_app(state)) as client:
        yield client, engine
    engine.shutdown()


def test_engine_failure_is_500_or_an_sse_error_and_serving_goes_on(
    tiny_app: tuple[TestClient, AsyncLLMEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    client, engine = tiny_app
    body = {"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    ok = client.post("/v1/completions", json=body)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
    real_step = engine.engine.step
    monkeypatch.setattr(engine.engine, "step", lambda: (_ for _ in ()).throw(RuntimeError("boom")))
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 500 and "boom" in r.json()["error"]["message"]
    r = client.post("/v1/completions", json={**body, "stream": True})
    events = [line for line in r.text.splitlines() if line.startswith("data: ")]
    assert "boom" in events[-2] and events[-1] == "data: [DONE]"
    monkeypatch.setattr(engine.engine, "step", real_step)
    assert client.get("/health").status_code == 200  # two failures are not fatal
    assert client.post("/v1/completions", json=body).json() == {
        **ok.json(), "id": ANY, "created": ANY
    }  # fmt: skip
    # No tokenizer: text prompts and chat are clean 400s, not crashes.
    assert client.post("/v1/completions", json={"prompt": "text"}).status_code == 400
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    assert client.post("/v1/chat/completions", json=chat).status_code == 400
