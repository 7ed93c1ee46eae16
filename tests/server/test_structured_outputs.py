"""Structured outputs and token-level constraints on a live server, through the openai client.

Every constrained generation runs in one concurrent batch (``outputs``, module scope), so the
built-in model decodes them together; the tests then check each output exactly: JSON outputs
parse and validate with ``jsonschema`` and end with ``finish_reason == "stop"`` (strings are
bounded with ``maxLength`` and arrays with ``maxItems`` so a sampled output always fits
``max_tokens``), regex outputs ``re.fullmatch``, choices are in the set, grammar outputs parse.
Then the errors (400 with the compiler's reason, and the server still answers), and
``logit_bias`` / ``allowed_token_ids`` / ``bad_words`` against the model's greedy tokens.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from tests.server.conftest import BUILTIN, Server

pytestmark = pytest.mark.slow

TIMEOUT = 600.0  # a loaded 2-core machine decodes the whole batch slowly
MAX_TOKENS = 200
N = 3


def _str(n: int) -> dict[str, Any]:
    return {"type": "string", "maxLength": n}


SCHEMAS: dict[str, dict[str, Any]] = {
    # nested objects, a pattern, required and optional fields
    "nested": {
        "type": "object",
        "properties": {
            "name": _str(16),
            "address": {
                "type": "object",
                "properties": {
                    "city": _str(12),
                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                },
                "required": ["city"],
            },
            "nickname": _str(8),
        },
        "required": ["name", "address"],
    },
    # an array (maxItems) of objects with an enum
    "array": {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "maxItems": 3,
                "items": {
                    "type": "object",
                    "properties": {"sku": _str(8), "size": {"enum": ["S", "M", "L"]}},
                    "required": ["sku", "size"],
                },
            },
        },
        "required": ["items"],
    },
    # integers and numbers with bounds, an optional boolean
    "numbers": {
        "type": "object",
        "properties": {
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "level": {"type": "integer", "minimum": -3, "maximum": 3},
            "score": {"type": "number", "minimum": -1.5, "maximum": 9.5},
            "ok": {"type": "boolean"},
        },
        "required": ["age", "level", "score"],
    },
    # $ref into $defs, used twice
    "refs": {
        "$defs": {
            "point": {
                "type": "object",
                "properties": {
                    "x": {"type": "integer", "minimum": -99, "maximum": 99},
                    "y": {"type": "integer", "minimum": -99, "maximum": 99},
                },
                "required": ["x", "y"],
            },
            "color": {"enum": ["red", "green", "blue"]},
        },
        "type": "object",
        "properties": {
            "start": {"$ref": "#/$defs/point"},
            "end": {"$ref": "#/$defs/point"},
            "color": {"$ref": "#/$defs/color"},
        },
        "required": ["start", "end", "color"],
    },
}
PROMPTS = {
    "nested": "A customer record as JSON:",
    "array": "An order as JSON:",
    "numbers": "A player's stats as JSON:",
    "refs": "A line segment as JSON:",
}
# completions spell the schema both ways (vLLM's older field and its current one)
COMPLETION_FIELD = {
    "nested": lambda s: {"guided_json": s},
    "array": lambda s: {"structured_outputs": {"json": s}},
    "numbers": lambda s: {"guided_json": json.dumps(s)},  # the schema as JSON text
    "refs": lambda s: {"structured_outputs": {"json": s}},
}

REGEX = r"[A-Z][a-z]{1,7} (is|was) [1-9][0-9]? years old\."
CHOICES = ["red", "green", "blue", "blue-green"]
# GBNF: a sum or product of at most three small numbers
GBNF = r"""
root ::= num (op num)? (op num)?
op ::= " + " | " - " | " * "
num ::= [1-9] [0-9]?
"""
GBNF_RE = r"[1-9][0-9]?(?: [-+*] [1-9][0-9]?){0,2}"
# Lark: one to three key=value pairs
LARK = r"""
start: pair ("," pair)? ("," pair)?
pair: KEY "=" VALUE
KEY: /[a-z]{1,8}/
VALUE: /[0-9]{1,4}/
"""
LARK_RE = r"[a-z]{1,8}=[0-9]{1,4}(?:,[a-z]{1,8}=[0-9]{1,4}){0,2}"


def _user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def _jobs(client: openai.OpenAI) -> dict[str, Callable[[], list[tuple[str, str | None]]]]:
    """name -> a call returning [(text, finish_reason)] per choice."""

    def chat(prompt: str, **kw: Any) -> Callable[[], list[tuple[str, str | None]]]:
        def run() -> list[tuple[str, str | None]]:
            r = client.chat.completions.create(model=BUILTIN, messages=_user(prompt), **kw)
            return [(c.message.content or "", c.finish_reason) for c in r.choices]

        return run

    def completion(prompt: str, **kw: Any) -> Callable[[], list[tuple[str, str | None]]]:
        def run() -> list[tuple[str, str | None]]:
            r = client.completions.create(model=BUILTIN, prompt=prompt, **kw)
            return [(c.text, c.finish_reason) for c in r.choices]

        return run

    def chat_stream(prompt: str, **kw: Any) -> Callable[[], list[tuple[str, str | None]]]:
        def run() -> list[tuple[str, str | None]]:
            stream = client.chat.completions.create(
                model=BUILTIN, messages=_user(prompt), stream=True, **kw
            )
            text, finish = [], None
            for chunk in stream:
                for c in chunk.choices:
                    text.append(c.delta.content or "")
                    finish = c.finish_reason or finish
            return [("".join(text), finish)]

        return run

    sampled = {"temperature": 0.8, "max_tokens": MAX_TOKENS}
    jobs: dict[str, Callable[[], list[tuple[str, str | None]]]] = {}
    for i, (name, schema) in enumerate(SCHEMAS.items()):
        rf = {
            "type": "json_schema",
            "json_schema": {"name": name, "schema": schema, "strict": True},
        }
        jobs[f"{name}/chat"] = chat(PROMPTS[name], n=N, seed=100 + i, response_format=rf, **sampled)
        jobs[f"{name}/completions"] = completion(
            PROMPTS[name], n=N, seed=200 + i, extra_body=COMPLETION_FIELD[name](schema), **sampled
        )
    jobs["nested/stream"] = chat_stream(
        PROMPTS["nested"], seed=7, extra_body={"structured_outputs": {"json": SCHEMAS["nested"]}},
        **sampled,
    )  # fmt: skip
    jobs["json_object/chat"] = chat(
        "What is the capital of France? Answer in JSON.",
        temperature=0, max_tokens=MAX_TOKENS, response_format={"type": "json_object"},
    )  # fmt: skip
    jobs["json_object/completions"] = completion(
        'Reply with JSON: {"answer": ...}. What is 2+2?', temperature=0, max_tokens=MAX_TOKENS,
        extra_body={"structured_outputs": {"json_object": True, "disable_any_whitespace": True}},
    )  # fmt: skip
    jobs["regex/completions"] = completion(
        "Tell me about someone:", n=N, seed=3, extra_body={"guided_regex": REGEX}, **sampled
    )
    jobs["regex/chat"] = chat(
        "Tell me about someone.", n=2, seed=4,
        extra_body={"structured_outputs": {"regex": REGEX}}, **sampled,
    )  # fmt: skip
    jobs["choice/completions"] = completion(
        "My favourite colour is", n=5, seed=5, temperature=1.0, max_tokens=20,
        extra_body={"guided_choice": CHOICES},
    )  # fmt: skip
    jobs["choice/chat"] = chat(
        "Pick a colour.", n=5, seed=6, temperature=1.0, max_tokens=20,
        extra_body={"structured_outputs": {"choice": CHOICES}},
    )  # fmt: skip
    jobs["gbnf/completions"] = completion(
        "An arithmetic exercise:", n=N, seed=8, extra_body={"guided_grammar": GBNF}, **sampled
    )
    jobs["lark/completions"] = completion(
        "Settings:", n=N, seed=9, extra_body={"structured_outputs": {"grammar": LARK}}, **sampled
    )
    return jobs


@pytest.fixture(scope="module")
def outputs(server: Server) -> dict[str, list[tuple[str, str | None]]]:
    """Every constrained generation of this module, all in flight at once."""
    jobs = _jobs(server.client(timeout=TIMEOUT, max_retries=0))
    with ThreadPoolExecutor(len(jobs)) as pool:
        futures = {name: pool.submit(run) for name, run in jobs.items()}
        return {name: f.result() for name, f in futures.items()}


def _all_stop(results: list[tuple[str, str | None]]) -> list[str]:
    assert [f for _, f in results] == ["stop"] * len(results), results
    return [t for t, _ in results]


@pytest.mark.parametrize("name", list(SCHEMAS))
@pytest.mark.parametrize("route", ["chat", "completions"])
def test_json_schema_outputs_validate(
    outputs: dict[str, list[tuple[str, str | None]]], name: str, route: str
) -> None:
    texts = _all_stop(outputs[f"{name}/{route}"])
    assert len(texts) == N
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMAS[name])


def test_streamed_json_schema_output_validates(
    outputs: dict[str, list[tuple[str, str | None]]],
) -> None:
    (text,) = _all_stop(outputs["nested/stream"])
    jsonschema.validate(json.loads(text), SCHEMAS["nested"])


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_json_object_output_is_an_object(
    outputs: dict[str, list[tuple[str, str | None]]], route: str
) -> None:
    (text,) = _all_stop(outputs[f"json_object/{route}"])
    assert isinstance(json.loads(text), dict)
    if route == "completions":
        # disable_any_whitespace: xgrammar's fixed separators ", " and ": " (as vLLM's flag
        # gives), no other whitespace outside strings
        skeleton = re.sub(r'"(?:[^"\\]|\\.)*"', '""', text)
        assert not re.search(r"\s", re.sub(r"([,:]) ", r"\1", skeleton)), text


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_regex_outputs_match(outputs: dict[str, list[tuple[str, str | None]]], route: str) -> None:
    for text in _all_stop(outputs[f"regex/{route}"]):
        assert re.fullmatch(REGEX, text), text


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_choice_outputs_are_choices(
    outputs: dict[str, list[tuple[str, str | None]]], route: str
) -> None:
    texts = _all_stop(outputs[f"choice/{route}"])
    assert len(texts) == 5
    assert set(texts) <= set(CHOICES), texts


def test_gbnf_grammar_outputs_parse(outputs: dict[str, list[tuple[str, str | None]]]) -> None:
    for text in _all_stop(outputs["gbnf/completions"]):
        assert re.fullmatch(GBNF_RE, text), text
        tree = ast.parse(text, mode="eval")  # an arithmetic expression of integer literals
        allowed = (ast.Expression, ast.BinOp, ast.Constant, ast.Add, ast.Sub, ast.Mult)
        assert all(isinstance(node, allowed) for node in ast.walk(tree)), text


def test_lark_grammar_outputs_parse(outputs: dict[str, list[tuple[str, str | None]]]) -> None:
    for text in _all_stop(outputs["lark/completions"]):
        assert re.fullmatch(LARK_RE, text), text
        pairs = [p.split("=") for p in text.split(",")]
        assert all(k.isalpha() and v.isdigit() for k, v in pairs), text


# --- errors: 400 with the compiler's reason, then the server still answers -------------------

BAD_SCHEMA = {"type": "object", "properties": {"a": {"type": "nonsense"}}}
ERRORS: dict[str, tuple[str, dict[str, Any], str, str]] = {
    # id: (route, request fields, param, message)
    "response_format-schema": (
        "chat",
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": BAD_SCHEMA},
            }
        },
        "structured_outputs",
        'invalid json for structured outputs: Unsupported type "nonsense"',
    ),
    "guided_json-range": (
        "completions",
        {"guided_json": {"type": "integer", "minimum": 5, "maximum": 1}},
        "structured_outputs",
        "invalid json for structured outputs: Invalid range: minimum greater than maximum",
    ),
    "guided_json-text": (
        "completions",
        {"guided_json": "{not json"},
        "structured_outputs",
        "the JSON schema is not valid JSON",
    ),
    "structured_outputs-ref": (
        "completions",
        {"structured_outputs": {"json": {"$ref": "#/$defs/missing"}}},
        "structured_outputs",
        "invalid json for structured outputs: ",
    ),
    "guided_regex": (
        "completions",
        {"guided_regex": "(ab"},
        "structured_outputs",
        "invalid regex for structured outputs: Regex parsing error at position 4: "
        "The parenthesis is not closed.",
    ),
    "structured_outputs-regex": (
        "chat",
        {"structured_outputs": {"regex": "[a-"}},
        "structured_outputs",
        "invalid regex for structured outputs: Regex parsing error",
    ),
    "guided_grammar-gbnf": (
        "completions",
        {"guided_grammar": "root ::= foo"},
        "structured_outputs",
        "invalid grammar for structured outputs: EBNF parser error at line 1, column 10: "
        'Rule "foo" is not defined',
    ),
    "structured_outputs-lark": (
        "completions",
        {"structured_outputs": {"grammar": "start: foo"}},
        "structured_outputs",
        "invalid grammar for structured outputs: Lark error at line 1, column 8: "
        "unknown name 'foo'",
    ),
    "two-legacy": (
        "completions",
        {"guided_regex": "a+", "guided_choice": ["x"]},
        "guided_choice",
        "only one structured output constraint is allowed: guided_regex, guided_choice",
    ),
    "response_format-and-guided_json": (
        "chat",
        {"response_format": {"type": "json_object"}, "guided_json": {"type": "object"}},
        "guided_json",
        "only one structured output constraint is allowed: response_format, guided_json",
    ),
    "two-in-structured_outputs": (
        "completions",
        {"structured_outputs": {"regex": "a+", "choice": ["x"]}},
        "structured_outputs",
        "structured outputs need exactly one of json, regex, choice, grammar",
    ),
    "backend-outlines": (
        "completions",
        {"guided_regex": "a+", "guided_decoding_backend": "outlines"},
        "guided_decoding_backend",
        "guided_decoding_backend 'outlines' is not available",
    ),
    "whitespace-pattern": (
        "chat",
        {"guided_json": {"type": "object"}, "guided_whitespace_pattern": r"[ ]?"},
        "guided_whitespace_pattern",
        "guided_whitespace_pattern is not supported",
    ),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_invalid_constraint_is_a_400_and_the_server_still_answers(
    server: Server, case: str
) -> None:
    route, fields, param, message = ERRORS[case]
    client = server.client(timeout=TIMEOUT, max_retries=0)
    for _ in range(2):  # the second time from the compiler's cache: the same 400
        with pytest.raises(openai.BadRequestError) as info:
            if route == "chat":
                client.chat.completions.create(
                    model=BUILTIN, messages=_user("hi"), max_tokens=4, extra_body=fields
                )
            else:
                client.completions.create(
                    model=BUILTIN, prompt="hi", max_tokens=4, extra_body=fields
                )
        assert info.value.status_code == 400
        assert info.value.param == param
        assert message in info.value.message, info.value.message
    ok = client.completions.create(model=BUILTIN, prompt="hi", max_tokens=1, temperature=0)
    assert ok.choices[0].finish_reason in ("stop", "length")
    assert ok.usage is not None and ok.usage.completion_tokens == 1


# --- logit_bias, allowed_token_ids, bad_words -------------------------------------------------

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def tokenizer(builtin_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(builtin_model_dir)


def _ids(server: Server, max_tokens: int, **kw: Any) -> tuple[list[int], Any]:
    """The completion's token ids (``return_token_ids``) and its choice."""
    extra = {"return_token_ids": True, **kw.pop("extra_body", {})}
    r = server.client(timeout=TIMEOUT, max_retries=0).completions.create(
        model=BUILTIN, prompt=PROMPT, max_tokens=max_tokens, extra_body=extra, **kw
    )
    (choice,) = r.choices
    ids = choice.model_extra["token_ids"]
    assert len(ids) == r.usage.completion_tokens
    return ids, choice


@pytest.fixture(scope="module")
def greedy(server: Server) -> tuple[list[int], Any]:
    return _ids(server, 6, temperature=0, logprobs=2)


def test_logit_bias_minus_100_keeps_the_greedy_token_out(
    server: Server, greedy: tuple[list[int], Any], tokenizer: Any
) -> None:
    ids, choice = greedy
    first = ids[0]
    # the greedy token is the top-1 of the logprobs; the runner-up takes its place when biased
    top = choice.logprobs.top_logprobs[0]
    best, runner_up = sorted(top, key=top.get, reverse=True)[:2]
    assert best == tokenizer.decode([first])
    biased, _ = _ids(server, 6, temperature=0, logit_bias={str(first): -100})
    assert biased[0] != first and tokenizer.decode([biased[0]]) == runner_up
    assert first not in biased
    # sampled rows too: the biased token never comes out
    sampled, _ = _ids(server, 8, temperature=1.0, seed=1, logit_bias={str(first): -100})
    assert first not in sampled


def test_logit_bias_plus_100_forces_a_token(server: Server, tokenizer: Any) -> None:
    (banana,) = tokenizer.encode(" banana")
    ids, choice = _ids(server, 4, temperature=1.0, seed=2, logit_bias={str(banana): 100})
    assert ids == [banana] * 4 and choice.text == " banana" * 4


def test_allowed_token_ids_restrict_every_token(server: Server, tokenizer: Any) -> None:
    allowed = sorted({t for w in (" yes", " no", " maybe", ",") for t in tokenizer.encode(w)})
    client = server.client(timeout=TIMEOUT, max_retries=0)
    r = client.completions.create(
        model=BUILTIN, prompt=PROMPT, max_tokens=6, temperature=1.0, seed=3, n=3,
        extra_body={"return_token_ids": True, "allowed_token_ids": allowed},
    )  # fmt: skip
    for c in r.choices:
        ids = c.model_extra["token_ids"]
        assert len(ids) == 6 and set(ids) <= set(allowed), ids  # no EOS: it is not allowed
        assert c.finish_reason == "length"


def _contains(ids: list[int], word: list[int]) -> bool:
    return any(ids[i : i + len(word)] == word for i in range(len(ids) - len(word) + 1))


def test_bad_words_keep_the_word_out(
    server: Server, greedy: tuple[list[int], Any], tokenizer: Any
) -> None:
    ids, choice = greedy
    word = "Paris"
    variants = [tokenizer.encode(word), tokenizer.encode(" " + word)]
    assert word in choice.text and any(_contains(ids, v) for v in variants)  # can fail
    banned, choice = _ids(server, 6, temperature=0, extra_body={"bad_words": [word]})
    assert not any(_contains(banned, v) for v in variants), (banned, choice.text)
    assert banned[0] != ids[0]


def test_logit_bias_composes_with_a_choice(server: Server, tokenizer: Any) -> None:
    """The grammar's mask and logit_bias compose: -100 on the greedy choice's first token keeps
    it out (the choice may still be spelled with other tokens), +100 on the other choice's one
    token picks that choice."""
    client = server.client(timeout=TIMEOUT, max_retries=0)
    choices = [" yes", " no"]
    single = {c: tokenizer.encode(c) for c in choices}
    assert all(len(ids) == 1 for ids in single.values())

    def pick(**extra: Any) -> tuple[str, list[int]]:
        r = client.completions.create(
            model=BUILTIN, prompt="Is the sky blue? Answer:", max_tokens=4, temperature=0,
            extra_body={"guided_choice": choices, "return_token_ids": True, **extra},
        )  # fmt: skip
        (c,) = r.choices
        assert c.finish_reason == "stop" and c.text in choices, c.text
        return c.text, c.model_extra["token_ids"]

    text, ids = pick()
    (other,) = set(choices) - {text}
    _, banned = pick(logit_bias={str(ids[0]): -100})
    assert ids[0] not in banned
    forced, forced_ids = pick(logit_bias={str(single[other][0]): 100})
    assert forced == other and forced_ids[0] == single[other][0]
