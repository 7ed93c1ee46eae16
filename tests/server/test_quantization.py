"""A server with quantized weights (the built-in model's own Q4_1 blocks, kept quantized)
answers the official client, plain and streaming, exactly as the offline engine does."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvserve import LLM, SamplingParams
from tests.server.conftest import BUILTIN, Server, start_server

pytestmark = pytest.mark.slow
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def gguf_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("logs") / "gguf_server.log"
    srv = start_server(["--quantization", "gguf", "--num-kv-blocks", "200"], log)
    yield srv
    srv.stop()


def test_quantized_server_answers_as_the_offline_engine(gguf_server: Server) -> None:
    client = gguf_server.client()
    r = client.chat.completions.create(model=BUILTIN, messages=MESSAGES, temperature=0,
                                       max_tokens=24)  # type: ignore[arg-type]  # fmt: skip
    text = r.choices[0].message.content or ""
    stream = client.chat.completions.create(
        model=BUILTIN, messages=MESSAGES, temperature=0, max_tokens=24, stream=True,  # type: ignore[arg-type]
    )  # fmt: skip
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert streamed == text and text
    llm = LLM(quantization="gguf", num_kv_blocks=200, num_threads=1)
    offline = llm.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=24))  # type: ignore[arg-type]
    assert offline[0].outputs[0].text == text
    log = gguf_server.log.read_text()
    assert "quantized gguf: 120 layers" in log
