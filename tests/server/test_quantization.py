"""A server with quantized weights (the built-in model's own Q4_1 blocks, kept quantized)
answers the official client, plain and streaming, exactly as the offline engine does."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

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


def test_pre_quantized_checkpoints_serve_as_offline(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """`kvserve serve` on a GPTQ and an AutoAWQ checkpoint (found from their config.json, no
    flag): the official client's greedy completions equal the offline engine's."""
    from tests.engine.test_awq import write_awq
    from tests.engine.test_gptq import write_gptq

    root = tmp_path_factory.mktemp("prequantized")
    gptq, _ = write_gptq(tiny_model_dir, root / "gptq", 4, 32, True)
    awq, _ = write_awq(tiny_model_dir, root / "awq", 32)
    args = [str(gptq), str(awq), "--served-model-name", "tiny-gptq", "tiny-awq",
            "--num-kv-blocks", "64"]  # fmt: skip
    srv = start_server(args, root / "server.log")
    try:
        client = srv.client()
        assert sorted(m.id for m in client.models.list()) == ["tiny-awq", "tiny-gptq"]
        for name, path in (("tiny-gptq", gptq), ("tiny-awq", awq)):
            r = client.completions.create(model=name, prompt="The capital of France is",
                                          temperature=0, max_tokens=12)  # fmt: skip
            llm = LLM(str(path), num_kv_blocks=64, num_threads=1)
            offline = llm.generate(["The capital of France is"],
                                   SamplingParams(temperature=0, max_tokens=12))  # fmt: skip
            assert r.choices[0].text == offline[0].outputs[0].text
            assert r.usage is not None and r.usage.completion_tokens == 12
        log = srv.log.read_text()
        assert "quantized gptq: 8 layers" in log and "quantized awq: 8 layers" in log
    finally:
        srv.stop()
