"""A model's own chat template, EOS ids and sampling defaults through the OpenAI server
(issue 15, item 3): tiny Qwen3 and Gemma 3 folders packaged as their hubs ship them
(tests/engine/chat_models.py), served by a real ``kvserve serve``, asked with the official
``openai`` client. The mapping of unset/null/explicit fields is checked on the request
models directly."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from transformers import AutoTokenizer

from kvserve.server.protocol import ChatCompletionRequest, CompletionRequest
from tests.engine.chat_models import END, make_chat_model
from tests.engine.test_model_chat_defaults import CONV, DEFAULTS, PROMPTS
from tests.server.conftest import Server, start_server

MODEL_DEFAULTS = {**DEFAULTS, "max_tokens": 6}  # the Qwen3 folder's generation_config.json
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("cls", [ChatCompletionRequest, CompletionRequest])
def test_unset_and_null_fields_take_the_models_defaults(cls: type) -> None:
    """vLLM's order: the request's value, else the model's, else vLLM's neutral one."""
    base: dict[str, Any] = (
        {"messages": MESSAGES} if cls is ChatCompletionRequest else {"prompt": "x"}
    )

    def params(body: dict[str, Any], defaults: dict[str, Any] | None) -> tuple[Any, ...]:
        p = cls.model_validate({**base, **body}).sampling_params(5, None, defaults)
        fields = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")
        return tuple(getattr(p, f) for f in fields)

    assert params({}, MODEL_DEFAULTS) == (0.6, 20, 0.95, 0.0, 1.3)
    assert params({"temperature": None, "top_k": None}, MODEL_DEFAULTS) == (0.6, 20, 0.95, 0.0, 1.3)
    explicit = {"temperature": 0.0, "top_k": 0, "repetition_penalty": 1.0, "min_p": 0.1}
    assert params(explicit, MODEL_DEFAULTS) == (0.0, 0, 0.95, 0.1, 1.0)
    assert params({}, {}) == (1.0, 0, 1.0, 0.0, 1.0)


@pytest.fixture(scope="module")
def family_server(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Server, dict[str, Path]]]:
    paths = {}
    for arch in ("qwen3", "gemma3"):
        paths[arch] = tmp_path_factory.mktemp(arch)
        make_chat_model(arch, paths[arch])
    server = start_server(
        [str(paths["qwen3"]), str(paths["gemma3"]), "--served-model-name", "qwen3", "gemma3",
         "--dtype", "float32", "--num-kv-blocks", "128", "--block-size", "4",
         "--uvicorn-log-level", "warning"],
        tmp_path_factory.mktemp("log") / "server.log",
    )  # fmt: skip
    try:
        yield server, paths
    finally:
        server.stop()


def _ids(obj: Any, key: str) -> list[int]:
    return list((obj.model_extra or {})[key])


@pytest.mark.slow
def test_served_chat_uses_each_models_template_and_eos(
    family_server: tuple[Server, dict[str, Path]],
) -> None:
    server, paths = family_server
    client = server.client()
    for arch in ("qwen3", "gemma3"):
        tok = AutoTokenizer.from_pretrained(paths[arch])
        r = client.chat.completions.create(
            model=arch, messages=CONV, max_tokens=3, temperature=0,  # type: ignore[arg-type]
            extra_body={"return_token_ids": True, "ignore_eos": True},
        )  # fmt: skip
        assert _ids(r, "prompt_token_ids") == tok.encode(PROMPTS[arch], add_special_tokens=False)
        assert r.usage is not None and r.usage.completion_tokens == 3
        # <end_of_turn> / <|im_end|>: in generation_config.json's EOS list, not the tokenizer's.
        r = client.chat.completions.create(
            model=arch, messages=CONV, max_tokens=8, temperature=0,  # type: ignore[arg-type]
            logit_bias={str(END): 100},
        )  # fmt: skip
        assert (r.choices[0].finish_reason, r.usage and r.usage.completion_tokens) == ("stop", 1)
    # The template's own switches reach it (Qwen3's enable_thinking).
    r = client.chat.completions.create(
        model="qwen3", messages=CONV, max_tokens=1,  # type: ignore[arg-type]
        extra_body={"return_token_ids": True, "chat_template_kwargs": {"enable_thinking": False}},
    )  # fmt: skip
    tok = AutoTokenizer.from_pretrained(paths["qwen3"])
    assert tok.decode(_ids(r, "prompt_token_ids")).endswith("assistant\n<think>\n\n</think>\n\n")


@pytest.mark.slow
def test_served_requests_take_the_models_sampling_defaults(
    family_server: tuple[Server, dict[str, Path]],
) -> None:
    """Qwen3's generation_config.json: temperature 0.6, top_k 20, top_p 0.95, repetition
    penalty 1.3, max_new_tokens 6. Unset fields take them; sent ones win."""
    server, _ = family_server
    client = server.client()

    def chat(**kw: Any) -> Any:
        extra = {"return_token_ids": True, **kw.pop("extra_body", {})}
        return client.chat.completions.create(
            model="qwen3",
            messages=MESSAGES,
            extra_body=extra,
            **kw,  # type: ignore[arg-type]
        ).choices[0]

    unset = chat(seed=7)
    assert unset.finish_reason == "length" and len(_ids(unset, "token_ids")) == 6
    spelled = chat(
        seed=7, temperature=0.6, top_p=0.95, max_tokens=6,
        extra_body={"top_k": 20, "repetition_penalty": 1.3},
    )  # fmt: skip
    assert _ids(spelled, "token_ids") == _ids(unset, "token_ids")
    neutral = chat(
        seed=7, temperature=1.0, top_p=1.0, extra_body={"top_k": 0, "repetition_penalty": 1.0}
    )
    assert _ids(neutral, "token_ids") != _ids(unset, "token_ids")
    # Greedy, with the model's repetition penalty (unset) or without it (sent).
    penalised = chat(temperature=0, max_tokens=12, extra_body={"ignore_eos": True})
    plain = chat(
        temperature=0, max_tokens=12, extra_body={"ignore_eos": True, "repetition_penalty": 1.0}
    )
    assert len(_ids(plain, "token_ids")) == 12 and _ids(plain, "token_ids") != _ids(
        penalised, "token_ids"
    )
    # /v1/completions: an unset max_tokens is min(16, the model's max_new_tokens), as in vLLM.
    done = client.completions.create(model="qwen3", prompt="hi", extra_body={"ignore_eos": True})
    assert done.usage is not None and done.usage.completion_tokens == 6
    done = client.completions.create(
        model="qwen3", prompt="hi", max_tokens=16, extra_body={"ignore_eos": True}
    )
    assert done.usage is not None and done.usage.completion_tokens == 16
    with pytest.raises(openai.BadRequestError):  # an explicit bad value is still refused
        client.completions.create(model="qwen3", prompt="hi", extra_body={"top_k": -5})
