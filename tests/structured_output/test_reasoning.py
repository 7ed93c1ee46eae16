"""The thinking gate (``structured_output/reasoning.py``): a grammar that starts after the end
marker, a thinking budget that forces it, on the built-in tokenizer with ``<think>`` /
``</think>`` added (as the reasoning server tests' model has them)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from tokenizers import AddedToken
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from kvserve.sample.logits_processors import unpack_token_bitmask
from kvserve.sampling_params import ParamError, SamplingParams
from kvserve.structured_output.grammar import (
    GrammarCompiler,
    StructuredOutputRequest,
    allow_token,
    grammar_bitmask,
)
from kvserve.structured_output.params import StructuredOutputsParams
from kvserve.structured_output.reasoning import Phase, ReasoningMarkers, ReasoningState

EOS = 2


@pytest.fixture(scope="module")
def tokenizer(builtin_model_dir: Path) -> PreTrainedTokenizerBase:
    tok = AutoTokenizer.from_pretrained(builtin_model_dir)
    tok.add_tokens(
        [AddedToken(m, special=False, normalized=False) for m in ("<think>", "</think>")]
    )
    return tok


@pytest.fixture(scope="module")
def compiler(tokenizer: PreTrainedTokenizerBase) -> Iterator[GrammarCompiler]:
    compiler = GrammarCompiler(tokenizer, len(tokenizer), [EOS])
    yield compiler
    compiler.shutdown()


def ids(tok: PreTrainedTokenizerBase, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False))


def qwen3(tok: PreTrainedTokenizerBase) -> ReasoningMarkers:
    return ReasoningMarkers(
        end_ids=tuple(ids(tok, "</think>")), start_ids=tuple(ids(tok, "<think>"))
    )


def allowed(so: StructuredOutputRequest, vocab: int) -> torch.Tensor:
    """bool ``[V]``: the tokens the request may take next."""
    return unpack_token_bitmask(grammar_bitmask([so]), vocab)[0]


def test_budget_forces_the_end_marker(tokenizer: PreTrainedTokenizerBase) -> None:
    m = qwen3(tokenizer)
    (start,), (end,) = m.start_ids, m.end_ids
    state = ReasoningState(m, budget=2)
    assert state.phase is Phase.OPENING and state.forced_token() is None
    assert state.accept(start) is False and state.phase is Phase.THINKING
    a, b, c = ids(tokenizer, " one two three")[:3]
    assert state.accept(a) is False and state.forced_token() is None
    assert state.accept(b) is False and state.thinking_tokens == 2
    assert state.forced_token() == end  # the budget is spent
    assert state.accept(end) is False and state.phase is Phase.ANSWER
    assert state.forced_token() is None and state.accept(c) is True
    state.rollback(2)  # back before </think>: forced again
    assert state.phase is Phase.THINKING and state.forced_token() == end


def test_budget_zero_and_an_output_that_does_not_think(tokenizer: PreTrainedTokenizerBase) -> None:
    m = qwen3(tokenizer)
    state = ReasoningState(m, budget=0)
    state.accept(m.start_ids[0])
    assert state.forced_token() == m.end_ids[0]  # no thinking at all
    plain = ReasoningState(m, budget=0)
    assert plain.accept(ids(tokenizer, "Hello")[0]) is True  # no <think>: all answer
    assert plain.phase is Phase.ANSWER and plain.forced_token() is None


def test_multi_token_forced_end(tokenizer: PreTrainedTokenizerBase) -> None:
    forced = tuple(ids(tokenizer, "\n</think>\n\n"))
    m = ReasoningMarkers(end_ids=tuple(ids(tokenizer, "</think>")), forced_end_ids=forced[:2])
    state = ReasoningState(m, budget=1)  # no start ids: thinking from the first token
    state.accept(ids(tokenizer, "Hm")[0])
    got = []
    while (t := state.forced_token()) is not None:
        got.append(t)
        state.accept(t)
    assert tuple(got) == forced[:2] and state.phase is Phase.ANSWER
    with pytest.raises(ParamError, match="must end with end_ids"):
        ReasoningMarkers(end_ids=(5,), forced_end_ids=(5, 6))


def test_grammar_applies_after_the_thinking(
    tokenizer: PreTrainedTokenizerBase, compiler: GrammarCompiler
) -> None:
    vocab = len(tokenizer)
    m = qwen3(tokenizer)
    so = compiler.new_request(StructuredOutputsParams(regex="Yes|No"), ReasoningState(m, None))
    so.grammar.result(timeout=120)
    first = allowed(so, vocab)
    # undecided: the grammar's first tokens, and <think> to open the thinking
    assert first[m.start_ids[0]] and first[ids(tokenizer, "Yes")[0]]
    assert not first[ids(tokenizer, "Maybe")[0]]
    thinking = [m.start_ids[0], *ids(tokenizer, "Maybe not"), m.end_ids[0]]
    for t in thinking:
        assert allowed(so, vocab)[t]  # the thinking is free
        assert so.accept_tokens([t])
    after = allowed(so, vocab)
    assert int(after.sum()) < vocab // 100 and after[ids(tokenizer, "No")[0]]
    assert not after[ids(tokenizer, "Maybe")[0]]
    assert so.accept_tokens([*ids(tokenizer, "No"), EOS]) and so.is_terminated()
    # an output that answers at once is constrained from its first token
    direct = compiler.new_request(StructuredOutputsParams(regex="Yes|No"), ReasoningState(m, None))
    direct.grammar.result(timeout=120)
    assert direct.accept_tokens(ids(tokenizer, "Yes")) and direct.reasoning.phase is Phase.ANSWER
    assert not allowed(direct, vocab)[m.start_ids[0]]


def test_budget_alone_and_the_batch_path(
    tokenizer: PreTrainedTokenizerBase, compiler: GrammarCompiler
) -> None:
    """Rows of a batch: forced, free (thinking) and grammar-filled, through the batch matcher
    (4 rows or more) as through one-by-one filling."""
    vocab = len(tokenizer)
    m = qwen3(tokenizer)
    (start,), (end,) = m.start_ids, m.end_ids
    budget = StructuredOutputRequest(None, vocab, ReasoningState(m, 0))
    budget.accept_tokens([start])
    thinking = StructuredOutputRequest(None, vocab, ReasoningState(m, 5))
    thinking.accept_tokens([start])
    grammars = []
    for _ in range(4):
        so = compiler.new_request(StructuredOutputsParams(regex="Yes|No"), ReasoningState(m, 3))
        so.grammar.result(timeout=120)
        so.accept_tokens([start, end])
        grammars.append(so)
    rows = unpack_token_bitmask(grammar_bitmask([budget, thinking, *grammars]), vocab)  # [6, V]
    assert rows[0].nonzero().flatten().tolist() == [end]
    assert bool(rows[1].all())
    for r in rows[2:]:
        assert r[ids(tokenizer, "Yes")[0]] and not r[start] and int(r.sum()) < vocab // 100


def test_allow_token_sets_the_sign_bit() -> None:
    mask = torch.zeros((1, 2), dtype=torch.int32)
    allow_token(mask, 0, 31)
    allow_token(mask, 0, 32)
    assert unpack_token_bitmask(mask, 64)[0].nonzero().flatten().tolist() == [31, 32]


def test_sampling_params_thinking_budget() -> None:
    with pytest.raises(ParamError, match="--reasoning-parser"):
        SamplingParams(thinking_token_budget=4)
    with pytest.raises(ParamError, match=">= 0"):
        SamplingParams(thinking_token_budget=-1, reasoning_markers=ReasoningMarkers((7,)))
    with pytest.raises(ParamError, match="integer"):
        SamplingParams(thinking_token_budget=1.5, reasoning_markers=ReasoningMarkers((7,)))
    SamplingParams(thinking_token_budget=0, reasoning_markers=ReasoningMarkers((7,)))


def test_a_start_that_is_not_required_is_not_counted(tokenizer: PreTrainedTokenizerBase) -> None:
    """gpt-oss: the analysis header opens the thinking but is no thinking token; an output
    without it thinks all the same."""
    header, end = tuple(ids(tokenizer, "<a>")), tuple(ids(tokenizer, "</a>"))
    m = ReasoningMarkers(end_ids=end, start_ids=header, start_required=False)
    state = ReasoningState(m, budget=1)
    assert state.phase is Phase.THINKING
    for t in header:
        assert state.accept(t) is False and state.forced_token() is None
    state.accept(ids(tokenizer, "x")[0])
    assert state.thinking_tokens == 1 and state.forced_token() == end[0]
    other = ReasoningState(m, budget=1)
    assert other.accept(ids(tokenizer, "y")[0]) is False and other.thinking_tokens == 1
