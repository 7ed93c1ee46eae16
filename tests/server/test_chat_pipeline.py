"""The request pipeline in-process (the app over the built-in model, no subprocess): every
endpoint's request is tokenized and validated once, at the door; the engine thread admits
it as checked (``LLMEngine.add_validated``) and never writes into its parameters."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from kvserve.engine.async_engine import AsyncLLMEngine
from kvserve.engine.input_processor import InputProcessor
from kvserve.engine.llm import build_engine_config
from kvserve.engine.llm_engine import LLMEngine
from kvserve.server.app import ServerState, build_app
from tests.engine.test_validation import counting_validate

pytestmark = pytest.mark.slow

USER = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def client(builtin_model_dir: Path) -> Iterator[TestClient]:
    cfg = build_engine_config(str(builtin_model_dir), num_kv_blocks=64)
    engine = AsyncLLMEngine(LLMEngine(cfg))
    state = ServerState()
    state.add_engine(engine)
    state.ready = True
    with TestClient(build_app(state)) as c:
        yield c
    engine.shutdown()


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"messages": USER, "max_tokens": 2}),
        ("/v1/chat/completions", {"messages": USER, "max_tokens": 2, "stream": True}),
        ("/v1/chat/completions", {"messages": USER, "max_tokens": 2, "bad_words": ["Hello"]}),
        ("/v1/messages", {"messages": USER, "max_tokens": 2}),  # + model: Anthropic needs one
        ("/v1/responses", {"input": "Hi", "max_output_tokens": 2, "store": False}),
        ("/v1/completions", {"prompt": "Hi", "max_tokens": 2}),
    ],
)
def test_one_request_is_validated_once(
    client: TestClient, monkeypatch: pytest.MonkeyPatch, path: str, body: dict[str, Any]
) -> None:
    if path == "/v1/messages":
        body = {**body, "model": client.get("/v1/models").json()["data"][0]["id"]}
    calls = counting_validate(monkeypatch)
    r = client.post(path, json=body)
    assert r.status_code == 200, r.text
    assert len(calls) == 1


def test_the_engine_does_not_write_into_the_callers_parameters(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bad_words become token ids on the engine's own copy of the parameters."""
    seen: list[Any] = []
    real = InputProcessor.validate

    def keep(self: InputProcessor, ids: list[int], params: Any, *args: Any) -> Any:
        checked = real(self, ids, params, *args)
        seen.append((params, checked.params))
        return checked

    monkeypatch.setattr(InputProcessor, "validate", keep)
    body = {"messages": USER, "max_tokens": 2, "bad_words": ["Hello"]}
    assert client.post("/v1/chat/completions", json=body).status_code == 200
    ((given, engines),) = seen
    assert given.bad_words_token_ids == [] and engines.bad_words_token_ids
    assert engines is not given
