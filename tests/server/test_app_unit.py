"""The app and the CLI without a model: readiness, guards, flag validation (fast)."""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from unittest.mock import ANY

import pytest
from fastapi.testclient import TestClient

from kvserve.engine.async_engine import AsyncLLMEngine
from kvserve.engine.llm import build_engine_config
from kvserve.engine.llm_engine import LLMEngine
from kvserve.server.app import ServerState, build_app
from kvserve.server.cli import _model_specs, add_serve_parser
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


def test_serve_flag_errors() -> None:
    with pytest.raises(ValueError, match="one per model"):
        _model_specs(parse("--served-model-name", "a", "b"))
    with pytest.raises(ValueError, match="does not exist"):
        _model_specs(parse("/no/such/model"))
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
