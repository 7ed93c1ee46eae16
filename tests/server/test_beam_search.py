"""``use_beam_search`` over HTTP with the official ``openai`` client: the choices are
``LLM.beam_search``'s best hypotheses, exactly; unsupported fields and limits are 400s."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from kvserve.beam_search import BeamSearchParams
from kvserve.engine.llm import LLM
from tests.server.conftest import TINY, Server

pytestmark = pytest.mark.slow

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def offline(tiny_model_dir: Path) -> LLM:
    return LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=200)


def test_completions_equal_offline_beam_search(server: Server, offline: LLM) -> None:
    expected = offline.beam_search(PROMPT, BeamSearchParams(beam_width=4, max_tokens=6))[0]
    n_prompt = len(offline.get_tokenizer().encode(PROMPT))
    res = server.client().completions.create(
        model=TINY, prompt=PROMPT, max_tokens=6, n=3, best_of=4,
        extra_body={"use_beam_search": True, "return_token_ids": True},
    )  # fmt: skip
    assert [c.index for c in res.choices] == [0, 1, 2]
    got = [c.model_extra["token_ids"] for c in res.choices]
    assert got == [s.tokens[n_prompt:] for s in expected.sequences[:3]]
    assert len({tuple(g) for g in got}) == 3  # three different hypotheses
    assert res.usage.completion_tokens == sum(len(g) for g in got)
    tok = offline.get_tokenizer()
    assert [c.text for c in res.choices] == [tok.decode(g, skip_special_tokens=True) for g in got]


def test_length_penalty_and_n_as_width(server: Server, offline: LLM) -> None:
    params = BeamSearchParams(beam_width=2, max_tokens=5, length_penalty=0.0)
    expected = offline.beam_search(PROMPT, params)[0]
    n_prompt = len(offline.get_tokenizer().encode(PROMPT))
    res = server.client().completions.create(
        model=TINY, prompt=PROMPT, max_tokens=5, n=2,
        extra_body={"use_beam_search": True, "length_penalty": 0.0, "return_token_ids": True},
    )  # fmt: skip
    assert [c.model_extra["token_ids"] for c in res.choices] == [
        s.tokens[n_prompt:] for s in expected.sequences
    ]


@pytest.mark.parametrize(
    ("extra", "param", "message"),
    [
        ({"best_of": 17}, "beam_width", "max_beam_width, --max-beam-width"),
        ({"stream": True}, "stream", "stream is not supported with use_beam_search"),
        ({"temperature": 0.7}, "temperature", "temperature must be 0 or unset"),
        ({"stop": ["x"]}, "stop", "stop is not supported with use_beam_search"),
        ({"n": 3, "best_of": 2}, "n", "must not exceed best_of"),
    ],
)
def test_rejected(server: Server, extra: dict, param: str, message: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        server.client(max_retries=0).completions.create(
            model=TINY, prompt=PROMPT, max_tokens=4,
            extra_body={"use_beam_search": True, **extra},
        )  # fmt: skip
    assert info.value.status_code == 400
    body = info.value.body
    assert isinstance(body, dict) and body["param"] == param
    assert message in body["message"]


def test_chat_equals_offline_beam_search(server: Server, offline: LLM) -> None:
    res = server.client().chat.completions.create(
        model=TINY, messages=[{"role": "user", "content": "Name a colour."}], max_tokens=5, n=2,
        extra_body={"use_beam_search": True, "return_token_ids": True},
    )  # fmt: skip
    prompt_ids = res.model_extra["prompt_token_ids"]
    params = BeamSearchParams(beam_width=2, max_tokens=5)
    expected = offline.beam_search({"prompt_token_ids": prompt_ids}, params)[0]
    got = [c.model_extra["token_ids"] for c in res.choices]
    assert got == [s.tokens[len(prompt_ids) :] for s in expected.sequences]
    assert [c.index for c in res.choices] == [0, 1]
    assert res.usage.completion_tokens == sum(len(g) for g in got)
