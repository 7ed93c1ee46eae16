"""The reasoning parsers on text (no server): exact splits, and streaming pieces that add up
to the unary split for every way the text can arrive."""

from __future__ import annotations

import pytest

from kvserve.server.chat_pipeline import ChatPlan, ChoiceDeltas, choice_message, reasoning_for
from kvserve.server.errors import APIError
from kvserve.server.protocol import ChatCompletionRequest
from kvserve.server.reasoning import (
    REASONING_PARSERS,
    ReasoningParser,
    ReasoningSplit,
    get_reasoning_parser,
    thinking_enabled,
)
from kvserve.server.serving import PromptInfo
from kvserve.server.tool_parsers import HermesToolParser
from kvserve.server.tools import ChatOptions, ToolPlan

CASES = {
    # text: (deepseek_r1's split, qwen3's split)
    "<think>abc</think>\n\nHi": (ReasoningSplit("abc", "\n\nHi"), ReasoningSplit("abc", "\n\nHi")),
    "abc</think>Hi": (ReasoningSplit("abc", "Hi"), ReasoningSplit(None, "abc</think>Hi")),
    "an answer": (ReasoningSplit("an answer", ""), ReasoningSplit(None, "an answer")),
    "<think>cut short": (ReasoningSplit("cut short", ""), ReasoningSplit("cut short", "")),
    "<think></think>Hi": (ReasoningSplit("", "Hi"), ReasoningSplit("", "Hi")),
    "<thin": (ReasoningSplit("<thin", ""), ReasoningSplit(None, "<thin")),
    "": (ReasoningSplit("", ""), ReasoningSplit(None, "")),
    "<think>a</think>b</think>c": (
        ReasoningSplit("a", "b</think>c"), ReasoningSplit("a", "b</think>c")
    ),
}  # fmt: skip


@pytest.mark.parametrize("text", list(CASES))
@pytest.mark.parametrize("name", ["deepseek_r1", "qwen3"])
def test_split(name: str, text: str) -> None:
    expected = CASES[text][0 if name == "deepseek_r1" else 1]
    assert get_reasoning_parser(name)().split(text, final=True) == expected


@pytest.mark.parametrize("text", list(CASES))
@pytest.mark.parametrize("name", ["deepseek_r1", "qwen3"])  # the text parsers
def test_streamed_pieces_add_up_to_the_unary_split(name: str, text: str) -> None:
    parser: ReasoningParser = get_reasoning_parser(name)()
    unary = parser.split(text, final=True)
    for step in (1, 2, 3, 5):  # characters per streamed piece
        prefixes = [text[:k] for k in range(step, len(text), step)] + [text]
        seen = ReasoningSplit("", "")
        for k, prefix in enumerate(prefixes):
            split = parser.split(prefix, final=k == len(prefixes) - 1)
            # each part only grows at its end, and never past what the unary split says
            assert (split.reasoning or "").startswith(seen.reasoning or "")
            assert split.content.startswith(seen.content)
            assert (unary.reasoning or "").startswith(split.reasoning or "")
            assert unary.content.startswith(split.content)
            seen = split
        assert seen == unary


def test_thinking_enabled() -> None:
    assert thinking_enabled(None) and thinking_enabled({"enable_thinking": True})
    assert not thinking_enabled({"enable_thinking": False})
    assert not thinking_enabled({"thinking": False})


def test_unknown_parser() -> None:
    assert sorted(REASONING_PARSERS) == ["deepseek_r1", "gpt_oss", "openai_gptoss", "qwen3"]
    with pytest.raises(ValueError, match="deepseek_r1, qwen3, gpt_oss"):
        get_reasoning_parser("granite")


class _Tokenizer:
    def __init__(self, vocab: list[str], special: list[str]) -> None:
        self.vocab, self.all_special_tokens = vocab, special

    def get_vocab(self) -> dict[str, int]:
        return {t: i for i, t in enumerate(self.vocab)}


def test_tokenizer_check() -> None:
    parser = get_reasoning_parser("deepseek_r1")
    parser.check_tokenizer(_Tokenizer(["a", "<think>", "</think>"], []), "m")
    with pytest.raises(ValueError, match="has no </think> token"):
        parser.check_tokenizer(_Tokenizer(["a", "<think>"], []), "m")
    with pytest.raises(ValueError, match="special token"):
        parser.check_tokenizer(_Tokenizer(["<think>", "</think>"], ["<think>"]), "m")


TOOL_OUTPUT = (
    '<think>Paris, then.</think>Checking.\n<tool_call>\n{"name": "get_weather", '
    '"arguments": {"city": "Paris"}}\n</tool_call>'
)


def test_tool_calls_are_parsed_in_the_answer_after_the_thinking() -> None:
    """A hermes call inside the thinking is thinking; the one in the answer is a call, the
    same unary and streamed (one character at a time)."""
    plan = ChatPlan(
        PromptInfo(None, []),
        ToolPlan("auto", parser=HermesToolParser),
        get_reasoning_parser("qwen3")(),
    )
    message, finish = choice_message(plan, TOOL_OUTPUT, "stop")
    assert finish == "tool_calls"
    assert message.reasoning == message.reasoning_content == "Paris, then."
    assert message.content == "Checking.\n"
    (call,) = message.tool_calls or []
    assert call.function.name == "get_weather"
    assert call.function.arguments == '{"city": "Paris"}'
    deltas = ChoiceDeltas(plan)
    got: dict[str, str] = {"reasoning": "", "reasoning_content": "", "content": "", "args": ""}
    for k in range(1, len(TOOL_OUTPUT) + 1):
        last = k == len(TOOL_OUTPUT)
        delta, reason = deltas.step(TOOL_OUTPUT[:k], "stop" if last else None)
        for key in ("reasoning", "reasoning_content", "content"):
            got[key] += delta.get(key) or ""
        for tc in delta.get("tool_calls") or ():
            got["args"] += tc["function"].get("arguments") or ""
    assert reason == "tool_calls"
    assert got == {
        "reasoning": "Paris, then.", "reasoning_content": "Paris, then.",
        "content": "Checking.\n", "args": '{"city": "Paris"}',
    }  # fmt: skip
    # a call written inside the thinking is thinking, not a call
    inside = "<think>" + TOOL_OUTPUT.split("</think>")[1] + "</think>ok"
    message, finish = choice_message(plan, inside, "stop")
    assert (message.content, message.tool_calls, finish) == ("ok", None, "stop")


def test_a_thinking_budget_needs_a_reasoning_parser() -> None:
    req = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "Hi"}], "thinking_token_budget": 4}
    )
    with pytest.raises(APIError) as e:
        reasoning_for(req, ChatOptions(), None)
    assert (e.value.status, e.value.param) == (400, "thinking_token_budget")
    assert "--reasoning-parser" in e.value.message
    off = req.model_copy(update={"chat_template_kwargs": {"enable_thinking": False}})
    assert reasoning_for(off, ChatOptions(reasoning_parser="qwen3"), None) is None
