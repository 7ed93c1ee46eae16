"""``--reasoning-parser gpt_oss`` on token ids (no server): the built-in tokenizer with the
harmony markers added as special tokens (as gpt-oss's tokenizer has them), exact splits, and
streamed pieces (one token at a time) that add up to the unary split."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import AddedToken
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from kvserve.server.chat_pipeline import ChatPlan, ChoiceDeltas, choice_message
from kvserve.server.reasoning import GptOssReasoningParser, ReasoningSplit, get_reasoning_parser
from kvserve.server.serving import PromptInfo
from kvserve.server.tools import ToolPlan

HARMONY = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>",
           "<|constrain|>")  # fmt: skip
OUTPUT = (
    "<|channel|>analysis<|message|>The user greets. Answer briefly.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>Hello there! ✓<|return|>"
)


def harmony_tokenizer(builtin_model_dir: Path) -> PreTrainedTokenizerBase:
    tok = AutoTokenizer.from_pretrained(builtin_model_dir)
    tok.add_special_tokens(
        {
            "additional_special_tokens": [
                AddedToken(t, special=True, normalized=False) for t in HARMONY
            ]
        }
    )
    return tok


@pytest.fixture(scope="module")
def tok(builtin_model_dir: Path) -> PreTrainedTokenizerBase:
    return harmony_tokenizer(builtin_model_dir)


def split(tok: PreTrainedTokenizerBase, text: str, final: bool = True) -> ReasoningSplit:
    ids = tok.encode(text, add_special_tokens=False)
    # the engine's text drops the special tokens: the parser must not need it
    return GptOssReasoningParser(tok).split(tok.decode(ids, skip_special_tokens=True), final, ids)


def test_markers_are_single_special_tokens(tok: PreTrainedTokenizerBase) -> None:
    for marker in HARMONY:
        assert len(tok.encode(marker, add_special_tokens=False)) == 1
    text = tok.decode(tok.encode(OUTPUT, add_special_tokens=False), skip_special_tokens=True)
    assert text.startswith("analysisThe user")  # the engine's text has lost the markers
    assert get_reasoning_parser("openai_gptoss") is GptOssReasoningParser  # vLLM's name


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (OUTPUT, ReasoningSplit("The user greets. Answer briefly.", "Hello there! ✓")),
        # cut by max_tokens inside the thinking: all thinking so far
        ("<|channel|>analysis<|message|>Still thinking", ReasoningSplit("Still thinking", "")),
        # no thinking at all
        ("<|channel|>final<|message|>Hi<|return|>", ReasoningSplit(None, "Hi")),
        # two analysis messages, then a preamble (commentary without recipient) and the answer
        (
            "<|channel|>analysis<|message|>A<|end|><|start|>assistant<|channel|>analysis"
            "<|message|>B<|end|><|start|>assistant<|channel|>commentary<|message|>Looking."
            "<|end|><|start|>assistant<|channel|>final<|message|>Done<|return|>",
            ReasoningSplit("A\nB", "Looking.\nDone"),
        ),
        # a tool call (commentary to=functions.x): neither thinking nor answer (not parsed)
        (
            "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>"
            'commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}'
            "<|call|>",
            ReasoningSplit("Need weather.", ""),
        ),
        # a model that did not speak harmony: all answer
        ("just text", ReasoningSplit(None, "just text")),
    ],
)
def test_split(tok: PreTrainedTokenizerBase, text: str, expected: ReasoningSplit) -> None:
    assert split(tok, text) == expected


def test_streamed_tokens_add_up_to_the_unary_split(tok: PreTrainedTokenizerBase) -> None:
    ids = tok.encode(OUTPUT, add_special_tokens=False)
    parser = GptOssReasoningParser(tok)
    unary = parser.split("", True, ids)
    seen = ReasoningSplit("", "")
    for k in range(1, len(ids) + 1):
        s = parser.split("", k == len(ids), ids[:k])
        assert (s.reasoning or "").startswith(seen.reasoning or "")
        assert s.content.startswith(seen.content)
        assert (unary.reasoning or "").startswith(s.reasoning or "")
        assert unary.content.startswith(s.content)
        seen = s
    assert seen == unary
    # the chat pipeline's deltas: exact strings, each part in order
    plan = ChatPlan(PromptInfo(None, []), ToolPlan("none"), parser)
    deltas = ChoiceDeltas(plan)
    got = {"reasoning": "", "content": ""}
    for k in range(1, len(ids) + 1):
        last = k == len(ids)
        delta, _ = deltas.step(tok.decode(ids[:k], skip_special_tokens=True),
                               "stop" if last else None, ids[:k])  # fmt: skip
        for key in got:
            got[key] += delta.get(key) or ""
    assert got == {"reasoning": "The user greets. Answer briefly.", "content": "Hello there! ✓"}
    message, finish = choice_message(plan, "", "stop", ids)
    assert (message.reasoning, message.content, finish) == (
        "The user greets. Answer briefly.", "Hello there! ✓", "stop",
    )  # fmt: skip


def test_a_partial_character_is_held_back(tok: PreTrainedTokenizerBase) -> None:
    head = tok.encode("<|channel|>final<|message|>", add_special_tokens=False)
    check = tok.encode("✓", add_special_tokens=False)
    parser = GptOssReasoningParser(tok)
    if len(check) > 1:  # byte-level pieces of one character
        assert parser.split("", False, head + check[:1]).content == ""
    assert parser.split("", True, head + check).content == "✓"


def test_markers_for_the_engine(tok: PreTrainedTokenizerBase) -> None:
    m = GptOssReasoningParser(tok).markers()
    assert tok.decode(m.end_ids) == "<|channel|>final<|message|>"
    assert tok.decode(m.forced) == "<|end|><|start|>assistant<|channel|>final<|message|>"
    assert tok.decode(m.start_ids) == "<|channel|>analysis<|message|>"
    assert not m.start_required  # gpt-oss thinks whatever its output opens with


def test_tokenizer_check(tok: PreTrainedTokenizerBase, builtin_model_dir: Path) -> None:
    GptOssReasoningParser.check_tokenizer(tok, "m")
    plain = AutoTokenizer.from_pretrained(builtin_model_dir)
    with pytest.raises(ValueError, match=r"has no <\|start\|>, <\|channel\|>"):
        GptOssReasoningParser.check_tokenizer(plain, "m")
