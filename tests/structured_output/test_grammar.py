"""Grammar compilation (xgrammar) and one request's matcher, on the built-in tokenizer."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from kvserve.sample.logits_processors import unpack_token_bitmask
from kvserve.sampling_params import ParamError
from kvserve.structured_output.grammar import (
    GrammarCompiler,
    StructuredOutputRequest,
    choice_grammar,
    grammar_bitmask,
)
from kvserve.structured_output.params import GrammarError, StructuredOutputsParams

VOCAB = 49152
EOS = 2


@pytest.fixture(scope="module")
def tokenizer(builtin_model_dir: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(builtin_model_dir)


@pytest.fixture(scope="module")
def compiler(tokenizer: PreTrainedTokenizerBase) -> Iterator[GrammarCompiler]:
    compiler = GrammarCompiler(tokenizer, VOCAB, [EOS])
    yield compiler
    compiler.shutdown()


def walk(so: StructuredOutputRequest, ids: list[int]) -> list[bool]:
    """For each id: was it allowed by the bitmask just before it was accepted?"""
    allowed = []
    for t in ids:
        mask = grammar_bitmask([so])  # [1, W]
        allowed.append(bool(unpack_token_bitmask(mask, VOCAB)[0, t]))
        assert so.accept_tokens([t])
    return allowed


def test_params_need_exactly_one_constraint() -> None:
    with pytest.raises(ParamError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ParamError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["b"])
    with pytest.raises(ParamError, match="choice"):
        StructuredOutputsParams(choice=[])
    # a schema as a dict and as JSON text is one cache key
    a = StructuredOutputsParams(json={"type": "object", "required": ["x"]})
    b = StructuredOutputsParams(json='{"required": ["x"], "type": "object"}')
    assert a.key() == b.key()
    with pytest.raises(GrammarError, match="not valid JSON"):
        StructuredOutputsParams(json="{nope").key()


def test_equal_constraints_compile_once(compiler: GrammarCompiler) -> None:
    first = compiler.compile(StructuredOutputsParams(regex="[ab]+"))
    again = compiler.compile(StructuredOutputsParams(regex="[ab]+"))  # while it compiles
    grammar = first.result(timeout=120)
    assert again.result(timeout=30) is grammar  # one compile, two callers
    assert compiler.compile(StructuredOutputsParams(regex="[ab]+")).result() is grammar  # cached
    other = compiler.compile(StructuredOutputsParams(regex="[ab]*")).result(timeout=30)
    assert other is not grammar


@pytest.mark.parametrize(
    ("params", "reason"),
    [
        (StructuredOutputsParams(regex="(abc"), "parenthesis is not closed"),
        (StructuredOutputsParams(json={"type": "nonsense"}), 'Unsupported type "nonsense"'),
        (StructuredOutputsParams(grammar="root ::= undefined_rule"), "undefined_rule"),
    ],
)
def test_invalid_constraints_give_the_compilers_reason(
    compiler: GrammarCompiler, params: StructuredOutputsParams, reason: str
) -> None:
    future = compiler.compile(params)
    with pytest.raises(GrammarError, match=reason) as info:
        future.result(timeout=30)
    assert info.value.param == "structured_outputs"
    assert not str(info.value).startswith("[")  # the C++ time stamp and location are cut


def test_choice_grammar_escapes_quotes_and_unicode(
    compiler: GrammarCompiler, tokenizer: PreTrainedTokenizerBase
) -> None:
    choices = ['say "hi"', "naïve\\path", "x"]
    assert choice_grammar(["a"]) == 'root ::= "a"'
    for choice in choices:
        so = compiler.new_request(StructuredOutputsParams(choice=choices))
        so.grammar.result(timeout=30)
        ids = tokenizer.encode(choice, add_special_tokens=False)
        assert all(walk(so, ids))
        assert walk(so, [EOS]) == [True]
        assert so.is_terminated()


def test_matcher_refuses_and_rolls_back(
    compiler: GrammarCompiler, tokenizer: PreTrainedTokenizerBase
) -> None:
    so = compiler.new_request(StructuredOutputsParams(regex="ab(c|d)"))
    so.grammar.result(timeout=30)
    ab = tokenizer.encode("ab", add_special_tokens=False)
    c, d = (tokenizer.encode(x, add_special_tokens=False)[0] for x in "cd")
    assert all(walk(so, [*ab, c]))
    so.rollback(1)  # a rejected speculative token
    assert walk(so, [d]) == [True]
    assert not so.is_terminated()
    z = tokenizer.encode("z", add_special_tokens=False)[0]
    assert not so.accept_tokens([z])
    assert so.error is not None and str(z) in so.error


def test_bitmask_rows_are_per_request(compiler: GrammarCompiler) -> None:
    digits = compiler.new_request(StructuredOutputsParams(regex="[0-9]"))
    letters = compiler.new_request(StructuredOutputsParams(choice=["yes", "no"]))
    for so in (digits, letters):
        so.grammar.result(timeout=30)
    allowed = unpack_token_bitmask(grammar_bitmask([digits, letters]), VOCAB)  # [2, V]
    assert allowed.dtype == torch.bool
    assert 0 < int(allowed[0].sum()) < 100 and 0 < int(allowed[1].sum()) < 100
    assert not bool((allowed[0] & allowed[1]).any())


def test_a_failed_compile_is_reported_once_ready(compiler: GrammarCompiler) -> None:
    so = compiler.new_request(StructuredOutputsParams(regex="[z"))
    so.grammar.exception(timeout=30)
    assert so.is_ready()
    reason = so.check_failed()
    assert reason is not None and "regex" in reason


def test_structural_tag(compiler: GrammarCompiler, tokenizer: PreTrainedTokenizerBase) -> None:
    """xgrammar's structural tag: a fixed begin/end around JSON that matches a schema."""
    import json

    schema = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    tag = {
        "type": "structural_tag",
        "format": {
            "type": "tag",
            "begin": "<answer>",
            "content": {"type": "json_schema", "json_schema": schema},
            "end": "</answer>",
        },
    }
    params = StructuredOutputsParams(structural_tag=json.dumps(tag))
    so = compiler.new_request(params)
    so.grammar.result(timeout=30)
    assert all(walk(so, tokenizer.encode('<answer>{"x": 5}</answer>', add_special_tokens=False)))
    assert walk(so, [EOS]) == [True] and so.is_terminated()
    wrong = compiler.new_request(params)
    wrong.grammar.result(timeout=30)
    assert not wrong.accept_tokens(tokenizer.encode('<answer>{"y"', add_special_tokens=False))
