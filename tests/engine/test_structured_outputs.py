"""Structured outputs through the whole engine, with the built-in SmolLM2 model (offline).

Every sampled output of the 135M model at temperature 0.8 must parse and validate: the
grammar, not the model, guarantees the form. KV integrity is checked after every step.
"""

from __future__ import annotations

import json
import logging
import re
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch

from kvserve.core.request import RequestStatus
from kvserve.engine.decoding_setup import bad_words_token_ids
from kvserve.engine.llm import LLM
from kvserve.engine.llm_engine import LLMEngine
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams
from kvserve.structured_output.grammar import StructuredOutputRequest
from kvserve.structured_output.params import GrammarError
from kvserve.structured_output.params import StructuredOutputsParams as S

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "maxLength": 20},  # optional
    },
    "required": ["name", "age"],
}
SCHEMAS: dict[str, dict[str, Any]] = {
    "nested": {
        "type": "object",
        "properties": {
            "person": PERSON,
            "address": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 12}},
                "required": ["city"],
            },
        },
        "required": ["person", "address"],
    },
    "array_enum_bounds": {
        "type": "object",
        "properties": {
            "colors": {
                "type": "array",
                "items": {"enum": ["red", "green", "blue"]},
                "minItems": 1,
                "maxItems": 3,
            },
            "score": {"type": "number", "minimum": -1, "maximum": 1},
            "ok": {"type": "boolean"},
        },
        "required": ["colors", "score", "ok"],
    },
    "ref": {
        "$defs": {
            "point": {
                "type": "object",
                "properties": {
                    "x": {"type": "integer", "minimum": 0, "maximum": 9},
                    "y": {"type": "integer", "minimum": 0, "maximum": 9},
                },
                "required": ["x", "y"],
            }
        },
        "type": "object",
        "properties": {"a": {"$ref": "#/$defs/point"}, "b": {"$ref": "#/$defs/point"}},
        "required": ["a", "b"],
    },
}
PROMPTS = ["Describe it as JSON.", "Hello! What is your name?", "Give me an example."]


@pytest.fixture(scope="module")
def llm(builtin_model_dir: Path) -> LLM:
    return LLM(str(builtin_model_dir), dtype="float32", num_kv_blocks=400, seed=0)


def drain_checked(engine: LLMEngine) -> dict[str, RequestOutput]:
    """Step the engine until every request finished, checking KV integrity after each step."""
    done: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        engine.kv.check_integrity()
    return done


def run_checked(llm: LLM, prompts: list[str], params: SamplingParams) -> list[RequestOutput]:
    for i, p in enumerate(prompts):
        llm.engine.add_request(f"r{i}", p, params)
    done = drain_checked(llm.engine)
    return [done[f"r{i}"] for i in range(len(prompts))]


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_every_sampled_output_validates(llm: LLM, name: str) -> None:
    schema = SCHEMAS[name]
    params = SamplingParams(
        n=2, temperature=0.8, seed=7, max_tokens=200, structured_outputs=S(json=schema)
    )
    outs = run_checked(llm, PROMPTS, params)
    for out in outs:
        for c in out.outputs:
            assert c.finish_reason == "stop", c.text
            jsonschema.validate(json.loads(c.text), schema)


def test_json_object_regex_choice_and_grammars(llm: LLM) -> None:
    def texts(so: S, n: int = 3, prompt: str = "Answer:", temperature: float = 0.8) -> list[str]:
        p = SamplingParams(n=n, temperature=temperature, seed=3, max_tokens=60)
        p.structured_outputs = so
        (out,) = llm.generate([prompt], p, use_tqdm=False)
        assert all(c.finish_reason == "stop" for c in out.outputs), out.outputs
        return [c.text for c in out.outputs]

    # Any JSON object: strings are unbounded, so the 135M model is asked greedily (sampled, it
    # may write a string until max_tokens; the grammar cannot end a string for it).
    (text,) = texts(S(json_object=True), 1, "Reply with a JSON object with a name.", 0.0)
    assert isinstance(json.loads(text), dict)
    for text in texts(S(regex=r"[A-Z][a-z]{2,6} \d{2}")):
        assert re.fullmatch(r"[A-Z][a-z]{2,6} \d{2}", text)
    assert set(texts(S(choice=["yes", "no", "maybe"]), n=5)) <= {"yes", "no", "maybe"}
    # Bounded repetition: a grammar with `*` lets the small model go on to max_tokens.
    ebnf = 'root ::= num | num " + " num | num " + " num " + " num\nnum ::= [1-9] [0-9]?'
    for text in texts(S(grammar=ebnf)):
        assert re.fullmatch(r"[1-9][0-9]?( \+ [1-9][0-9]?){0,2}", text)
        assert eval(text.replace(" ", ""), {}) >= 1
    lark = (
        'start: pair | pair ";" pair\npair: KEY "=" VALUE\nKEY: /[a-z]{1,5}/\nVALUE: /[0-9]{1,3}/'
    )
    for text in texts(S(grammar=lark)):
        assert re.fullmatch(r"[a-z]{1,5}=[0-9]{1,3}(;[a-z]{1,5}=[0-9]{1,3})?", text)


def test_invalid_schema_is_a_clear_error_and_the_engine_goes_on(llm: LLM) -> None:
    bad = SamplingParams(structured_outputs=S(json={"type": "object", "minProperties": "x"}))
    with pytest.raises(GrammarError) as info:
        llm.generate(["x"], bad, use_tqdm=False)
    assert "structured outputs" in str(info.value)
    (out,) = llm.generate(["x"], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 3


def test_grammar_survives_preemption(builtin_model_dir: Path) -> None:
    """Too few KV blocks for all: requests are preempted (recompute) mid-grammar."""
    small = LLM(str(builtin_model_dir), dtype="float32", num_kv_blocks=24, seed=0)
    schema = SCHEMAS["array_enum_bounds"]
    params = SamplingParams(temperature=0.8, seed=1, max_tokens=120)
    params.structured_outputs = S(json=schema)
    outs = run_checked(small, PROMPTS * 3, params)
    assert small.engine.scheduler.stats.num_preemptions > 0
    for out in outs:
        assert out.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.outputs[0].text), schema)


def test_waiting_for_grammar_does_not_block_others(llm: LLM) -> None:
    engine = llm.engine
    compiler = engine.grammar_compiler
    gate: Future[Any] = Future()
    real = compiler.new_request
    compiler.new_request = lambda so, r=None: StructuredOutputRequest(gate, compiler.vocab_size, r)  # type: ignore[method-assign]
    try:
        engine.add_request("slow", "Pick:", SamplingParams(structured_outputs=S(choice=["A"])))
    finally:
        compiler.new_request = real  # type: ignore[method-assign]
    engine.add_request("free", "Hi", SamplingParams(temperature=0, max_tokens=4))
    slow = engine.scheduler.requests["slow"]
    for _ in range(4):
        outs = {o.request_id: o for o in engine.step()}
        assert slow.status is RequestStatus.WAITING_FOR_GRAMMAR
        assert "slow" not in outs
    assert outs["free"].finished
    assert engine.num_waiting() == 1
    gate.set_result(compiler.compile(S(choice=["A"])).result(timeout=30))
    text = ""
    while engine.has_unfinished_requests():
        for o in engine.step():
            text = o.outputs[0].text
    assert text == "A"


def test_failed_grammar_and_refused_token_fail_only_their_request(llm: LLM) -> None:
    engine = llm.engine
    compiler = engine.grammar_compiler
    failed: Future[Any] = Future()
    failed.set_exception(GrammarError("invalid regex for structured outputs: test"))
    real = compiler.new_request
    compiler.new_request = lambda so, r=None: StructuredOutputRequest(
        failed, compiler.vocab_size, r
    )  # type: ignore[method-assign]
    try:
        engine.add_request("bad", "x", SamplingParams(structured_outputs=S(regex="a")))
    finally:
        compiler.new_request = real  # type: ignore[method-assign]
    # A processor that forces a token the grammar refuses (the bitmask runs first; this
    # overrides it): the matcher refuses, and the request fails alone.
    z = llm.get_tokenizer().encode("z", add_special_tokens=False)[0]

    def force_z(out: list[int], row: torch.Tensor) -> torch.Tensor:
        row[z] = 1e9
        return row

    forced = SamplingParams(temperature=0, structured_outputs=S(regex="[0-9]+"))
    forced.logits_processors = [force_z]
    engine.add_request("forced", "x", forced)
    engine.add_request("fine", "x", SamplingParams(temperature=0, max_tokens=5))
    results = drain_checked(engine)
    assert results["bad"].error is not None and "test" in results["bad"].error
    assert results["bad"].outputs[0].finish_reason == "error"
    assert results["forced"].error is not None and "does not match" in results["forced"].error
    assert results["fine"].error is None and len(results["fine"].outputs[0].token_ids) == 5


def test_seam_fields_offline(llm: LLM) -> None:
    tok = llm.get_tokenizer()
    greedy = SamplingParams(temperature=0, max_tokens=8)
    (base,) = llm.generate(["The capital of France is"], greedy, use_tqdm=False)
    first = base.outputs[0].token_ids[0]
    banned = SamplingParams(temperature=0, max_tokens=8, logit_bias={first: -100})
    (out,) = llm.generate(["The capital of France is"], banned, use_tqdm=False)
    assert first not in out.outputs[0].token_ids
    allowed = [tok.encode(w, add_special_tokens=False)[0] for w in (" yes", " no")]
    only = SamplingParams(temperature=0.8, seed=2, max_tokens=6, allowed_token_ids=allowed)
    (out,) = llm.generate(["Answer:"], only, use_tqdm=False)
    assert set(out.outputs[0].token_ids) <= set(allowed)
    word = tok.decode(base.outputs[0].token_ids[:1]).strip()
    no_word = SamplingParams(temperature=0, max_tokens=8, bad_words=[word])
    (out,) = llm.generate(["The capital of France is"], no_word, use_tqdm=False)
    assert no_word.bad_words_token_ids == []  # the caller's parameters are not written into
    bad_ids = {ids[0] for ids in bad_words_token_ids(tok, [word]) if len(ids) == 1}
    assert first in bad_ids and not bad_ids & set(out.outputs[0].token_ids)
    with pytest.raises(ValueError, match="out of the vocabulary"):
        llm.generate(["x"], SamplingParams(logit_bias={10**6: 1.0}), use_tqdm=False)


def test_constraints_that_exclude_every_token_fail_that_request(
    llm: LLM, caplog: pytest.LogCaptureFixture
) -> None:
    """min_tokens past the grammar's end leaves only EOS, which min_tokens masks: no token is
    allowed; the request fails with that reason instead of sampling token 0. The request's
    own fault: a warning, no error with a traceback in the log."""
    engine = llm.engine
    stuck = SamplingParams(temperature=0, min_tokens=5, structured_outputs=S(choice=["yes"]))
    engine.add_request("stuck", "Say yes:", stuck)
    engine.add_request("fine", "Say yes:", SamplingParams(temperature=0, max_tokens=4))
    logger = logging.getLogger("kvserve")  # it does not propagate to caplog's root handler
    logger.addHandler(caplog.handler)
    try:
        results = drain_checked(engine)
    finally:
        logger.removeHandler(caplog.handler)
    runner = [r for r in caplog.records if r.name == "kvserve.runner"]
    assert [r.levelno for r in runner] == [logging.WARNING]
    assert "no token is allowed" in runner[0].getMessage() and runner[0].exc_info is None
    assert results["stuck"].error is not None
    assert "no token is allowed" in results["stuck"].error
    assert results["fine"].error is None and len(results["fine"].outputs[0].token_ids) == 4
