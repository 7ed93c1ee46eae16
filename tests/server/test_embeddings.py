"""``/v1/embeddings`` through the official ``openai`` client against a real ``kvserve serve``
of the built-in model: the vectors are ``LLM.embed``'s, every input form and both encodings
work, bad input is an OpenAI 400, and metrics count embedding requests."""

from __future__ import annotations

import asyncio
import base64
import struct
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch

from kvserve.engine.llm import LLM
from kvserve.sampling_params import SamplingParams
from tests.server.conftest import BUILTIN, SERVER_THREADS, TINY, Server

pytestmark = pytest.mark.slow

TEXTS = ["The capital of France is Paris.", "def fibonacci(n):", "Embeddings!"]
HIDDEN = 576  # SmolLM2-135M's hidden size
TOL = 1e-4  # float32, one thread on both sides; batches may differ (summation order)


@pytest.fixture(scope="module")
def offline(builtin_model_dir: Path) -> Iterator[LLM]:
    threads = torch.get_num_threads()
    torch.set_num_threads(int(SERVER_THREADS))  # the server's thread count
    try:
        yield LLM(str(builtin_model_dir), num_kv_blocks=64)
    finally:
        torch.set_num_threads(threads)


def vectors(offline: LLM, prompts: list[str] | list[list[int]]) -> list[list[float]]:
    outs = offline.embed(prompts, use_tqdm=False)  # type: ignore[arg-type]
    return [o.outputs.embedding for o in outs]


def test_every_input_form_matches_llm_embed(server: Server, offline: LLM) -> None:
    client = server.client()
    want = vectors(offline, TEXTS)
    ids = [offline.get_tokenizer().encode(t) for t in TEXTS]
    for given in (TEXTS, ids):  # a list of strings, a list of token-id lists
        r = client.embeddings.create(model=BUILTIN, input=given, encoding_format="float")
        assert r.model == BUILTIN and r.object == "list"
        assert [d.index for d in r.data] == [0, 1, 2]
        assert all(d.object == "embedding" and len(d.embedding) == HIDDEN for d in r.data)
        for d, w in zip(r.data, want, strict=True):
            assert d.embedding == pytest.approx(w, abs=TOL)
        assert r.usage.prompt_tokens == r.usage.total_tokens == sum(len(i) for i in ids)
    one = client.embeddings.create(model=BUILTIN, input=TEXTS[0], encoding_format="float")
    assert len(one.data) == 1 and one.data[0].embedding == pytest.approx(want[0], abs=TOL)
    one = client.embeddings.create(model=BUILTIN, input=ids[1], encoding_format="float")
    assert len(one.data) == 1 and one.data[0].embedding == pytest.approx(want[1], abs=TOL)
    assert one.usage.prompt_tokens == len(ids[1])
    norm = sum(x * x for x in one.data[0].embedding)
    assert norm == pytest.approx(1.0, abs=1e-5)  # normalised, as vLLM's default


def test_base64_is_little_endian_float32(server: Server, offline: LLM) -> None:
    """The client asks for base64 by default and decodes it itself."""
    (want,) = vectors(offline, TEXTS[2:])
    r = server.client().embeddings.create(model=BUILTIN, input=TEXTS[2])
    assert r.data[0].embedding == pytest.approx(want, abs=TOL)
    body = {"model": BUILTIN, "input": TEXTS[2], "encoding_format": "base64"}
    raw = httpx.post(f"{server.url}/v1/embeddings", json=body, headers=server.headers(), timeout=60)
    assert raw.status_code == 200
    data = base64.b64decode(raw.json()["data"][0]["embedding"])
    assert len(data) == 4 * HIDDEN
    assert list(struct.unpack(f"<{HIDDEN}f", data)) == pytest.approx(want, abs=TOL)


def test_vllm_extras_and_dimensions(server: Server, offline: LLM) -> None:
    client = server.client()
    ids = offline.get_tokenizer().encode(TEXTS[0])
    r = client.embeddings.create(model=BUILTIN, input=TEXTS[0], encoding_format="float",
                                 dimensions=HIDDEN, user="u-1",
                                 extra_body={"truncate_prompt_tokens": 3})  # fmt: skip
    assert r.usage.prompt_tokens == 3
    (want,) = vectors(offline, [ids[-3:]])
    assert r.data[0].embedding == pytest.approx(want, abs=TOL)
    raw = client.embeddings.create(model=BUILTIN, input=TEXTS[0], encoding_format="float",
                                   extra_body={"normalize": False})  # fmt: skip
    norm = sum(x * x for x in raw.data[0].embedding) ** 0.5
    assert abs(norm - 1.0) > 0.1
    unit = [x / norm for x in raw.data[0].embedding]
    assert unit == pytest.approx(vectors(offline, [TEXTS[0]])[0], abs=TOL)
    tiny = client.embeddings.create(model=TINY, input=TEXTS, dimensions=64)
    assert [len(d.embedding) for d in tiny.data] == [64, 64, 64]


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"input": ""}, "input", "input[0] is empty"),
        ({"input": []}, "input", "input must not be empty"),
        ({"input": ["ok", ""]}, "input", "input[1] is empty"),
        ({"input": [[]]}, "input", "input[0] is empty"),
        ({"input": "x", "dimensions": 100}, "dimensions", "dimensions is 100 but"),
        ({"input": "x", "dimensions": 0}, "dimensions", "positive integer"),
        ({"input": [5, 49152]}, None, "token id 49152 is out of the vocabulary"),
        ({"input": [[5], [-1]]}, None, "token id -1 is out of the vocabulary"),
        ({"input": [5, True]}, "input", "input"),
        ({"input": "x", "encoding_format": "int8"}, "encoding_format", "'float' or 'base64'"),
        ({"input": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens", "-1 or at"),
        ({"input": [5] * 9000}, None, "more than the model's context of 8192 tokens"),
        ({"input": ["a"] * 257}, "input", "257 inputs"),
    ],
)
def test_bad_input_is_a_400(
    server: Server, body: dict[str, object], param: str | None, message: str
) -> None:
    rest = {k: v for k, v in body.items() if k != "input"}  # as JSON, past the client's types
    with pytest.raises(openai.BadRequestError) as e:
        server.client().embeddings.create(model=BUILTIN, input=body["input"], extra_body=rest)  # type: ignore[arg-type]
    assert e.value.status_code == 400
    err = e.value.body
    assert isinstance(err, dict) and err["type"] == "invalid_request_error"
    assert err["param"] == param and message in err["message"], err


def test_model_and_key_are_checked(server: Server) -> None:
    with pytest.raises(openai.NotFoundError):
        server.client().embeddings.create(model="nope", input="x")
    no_key = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong")
    with pytest.raises(openai.AuthenticationError):
        no_key.embeddings.create(model=BUILTIN, input="x")


def test_metrics_count_embedding_requests(server: Server) -> None:
    before = server.wait_idle()
    r = server.client().embeddings.create(model=BUILTIN, input=TEXTS)
    after = server.wait_idle()  # every block free again
    stop = "kvserve:request_success_total{stop}"
    assert after[stop] - before[stop] == len(TEXTS)
    count = "kvserve:request_prompt_tokens_count"
    assert after[count] - before[count] == len(TEXTS)
    tokens = "kvserve:request_prompt_tokens_sum"
    assert after[tokens] - before[tokens] == r.usage.prompt_tokens
    gen = "kvserve:request_generation_tokens_sum"
    assert after[gen] == before[gen]


def test_embeddings_share_the_engine_with_a_completion(server: Server, offline: LLM) -> None:
    """Concurrent embeddings do not change a greedy completion beside them."""
    prompt = "Once upon a time"
    (ref,) = offline.generate(prompt, SamplingParams(temperature=0, max_tokens=24),
                              use_tqdm=False)  # fmt: skip
    want = vectors(offline, TEXTS)

    async def both() -> tuple[str, list[list[float]]]:
        client = server.async_client()
        completion = client.completions.create(model=BUILTIN, prompt=prompt, max_tokens=24,
                                               temperature=0)  # fmt: skip
        embeds = [client.embeddings.create(model=BUILTIN, input=t) for t in TEXTS]
        done = await asyncio.gather(completion, *embeds)
        return done[0].choices[0].text, [e.data[0].embedding for e in done[1:]]

    text, got = asyncio.run(both())
    assert text == ref.outputs[0].text
    for g, w in zip(got, want, strict=True):
        assert g == pytest.approx(w, abs=TOL)
