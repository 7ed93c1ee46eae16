"""Every error answers in OpenAI's shape with the right status, and harms no other request."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from tests.server.conftest import BUILTIN, Server

pytestmark = pytest.mark.slow


def assert_error_body(r: httpx.Response, status: int, code: object = None) -> dict[str, object]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if code is not None:
        assert err["code"] == code
    return err


def test_unknown_model_is_404(server: Server) -> None:
    client = server.client(max_retries=0)
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=2)
    assert info.value.status_code == 404
    assert info.value.code == "model_not_found"
    assert info.value.type == "invalid_request_error"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(
            model="no-such-model", messages=[{"role": "user", "content": "hi"}]
        )
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_api_key_is_required_on_the_api_only(server: Server) -> None:
    bad = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        bad.models.list()
    assert info.value.status_code == 401
    for path in ("/v1/models", "/v1/completions", "/tokenize", "/detokenize"):
        r = httpx.post(f"{server.url}{path}", json={}) if path != "/v1/models" else None
        r = r or httpx.get(f"{server.url}{path}")
        assert_error_body(r, 401, "invalid_api_key")
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/metrics").status_code == 200


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"n": 0}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"logprobs": 21}, "logprobs"),
        ({"max_tokens": 5000}, "max_tokens"),  # above --max-tokens-limit 4096
        ({"extra_body": {"top_k": -5}}, None),
        ({"extra_body": {"repetition_penalty": 0}}, None),
        ({"logit_bias": {"one": 5}}, "logit_bias"),  # keys are token ids
        ({"logit_bias": {"99999999": 5}}, "logit_bias"),  # outside the vocabulary
    ],
)
def test_bad_parameters_are_400(server: Server, kwargs: dict[str, object], param: str) -> None:
    client = server.client(max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=BUILTIN, prompt="hi", **kwargs)  # type: ignore[call-overload]
    assert info.value.status_code == 400
    assert info.value.type == "invalid_request_error"
    if param is not None:
        assert info.value.param == param


def test_context_limits_are_400(server: Server) -> None:
    client = server.client(max_retries=0)
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model=BUILTIN, prompt=[5] * 8200, max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model=BUILTIN, prompt=[5] * 5000, max_tokens=4000)
    with pytest.raises(openai.BadRequestError, match="vocabulary"):
        client.completions.create(model=BUILTIN, prompt=[5, 10**6], max_tokens=1)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=BUILTIN, messages=[])


def test_malformed_and_oversized_bodies(server: Server) -> None:
    h = {**server.headers(), "Content-Type": "application/json"}
    r = httpx.post(f"{server.url}/v1/completions", content=b"{not json", headers=h)
    assert_error_body(r, 400)
    r = httpx.post(f"{server.url}/v1/completions", json={"model": BUILTIN}, headers=h)
    assert assert_error_body(r, 400)["param"] == "prompt"  # missing field: 400, not 422
    big = {"model": BUILTIN, "prompt": "x" * 70_000}  # above --max-request-body-bytes 65536
    r = httpx.post(f"{server.url}/v1/completions", json=big, headers=h)
    assert_error_body(r, 413, "request_too_large")
    r = httpx.get(f"{server.url}/v1/nothing-here", headers=h)
    assert_error_body(r, 404)


async def test_bad_requests_do_not_disturb_a_running_one(server: Server) -> None:
    client = server.async_client(max_retries=0)
    prompt, n = "Write a long story about a dragon.", 48
    ref = await client.completions.create(
        model=BUILTIN, prompt=prompt, max_tokens=n, temperature=0, extra_body={"ignore_eos": True}
    )

    async def good() -> tuple[str, str | None, int]:
        stream = await client.completions.create(
            model=BUILTIN, prompt=prompt, max_tokens=n, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )  # fmt: skip
        text, reason, used = "", None, 0
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
                reason = chunk.choices[0].finish_reason or reason
            if chunk.usage:
                used = chunk.usage.completion_tokens
        return text, reason, used

    async def bad() -> list[int]:
        await asyncio.sleep(0.3)  # while the good request is generating
        codes = []
        for kw in (
            {"model": BUILTIN, "prompt": [5] * 9000},
            {"model": BUILTIN, "prompt": "x", "temperature": -3},
            {"model": "missing", "prompt": "x"},
            {"model": BUILTIN, "prompt": [10**7]},
        ):
            try:
                await client.completions.create(**kw)  # type: ignore[call-overload]
            except openai.APIStatusError as e:
                codes.append(e.status_code)
        return codes

    (text, reason, used), codes = await asyncio.gather(good(), bad())
    assert codes == [400, 400, 404, 400]
    assert (text, reason, used) == (ref.choices[0].text, "length", n)
    await client.close()


def test_health_and_loading(server: Server) -> None:
    # The fixture polled /health from process start: 503 while loading, then 200.
    assert server.health_seen[-1] == 200
    assert 503 in server.health_seen
