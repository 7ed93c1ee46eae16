"""The tool-call parsers (hermes, llama3_json, pythonic), whole and streamed (no model)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvserve.server.tool_parsers import (
    TOOL_PARSERS,
    HermesToolParser,
    Llama3JsonToolParser,
    PythonicToolParser,
    ToolParser,
    get_tool_parser,
)


def stream(parser: ToolParser, text: str, step: int) -> tuple[list[dict[str, Any]], bool]:
    """The deltas a stream of ``text`` in ``step``-character pieces gives, and whether the
    finish says tools were called."""
    deltas, prev = [], ""
    for end in range(step, len(text) + step, step):
        cur = text[:end]
        d = parser.extract_tool_calls_streaming(prev, cur, cur[len(prev) :], [], [], [], None)
        if d is not None:
            deltas.append(d.model_dump(mode="json"))
        prev = cur
    last, called = parser.finish_streaming(text)
    if last is not None:
        deltas.append(last.model_dump(mode="json"))
    return deltas, called


def accumulate(deltas: list[dict[str, Any]]) -> tuple[str, list[dict[str, Any]]]:
    """What a client (the openai SDK, LangChain) builds from the deltas: content, calls."""
    content, calls = "", {}
    for d in deltas:
        content += d.get("content") or ""
        for tc in d.get("tool_calls") or []:
            if tc["index"] not in calls:  # a call's first delta names it
                assert tc["id"].startswith("chatcmpl-tool-") and tc["type"] == "function"
                assert tc["function"]["name"]
                calls[tc["index"]] = {"name": "", "arguments": ""}
            else:
                assert "id" not in tc and "name" not in tc.get("function", {})
            f = tc.get("function") or {}
            calls[tc["index"]]["name"] += f.get("name") or ""
            calls[tc["index"]]["arguments"] += f.get("arguments") or ""
    assert sorted(calls) == list(range(len(calls)))
    return content, [calls[i] for i in sorted(calls)]


def check(cls: type[ToolParser], text: str) -> tuple[bool, list[tuple[str, Any]], str | None]:
    """Parse ``text`` whole and streamed in pieces of 1, 2, 3, 7 characters and all at once;
    the stream must add up to the same content and calls. Returns (called, [(name, args)],
    content)."""
    info = cls().extract_tool_calls(text, None)
    whole = [(c.function.name, c.function.arguments) for c in info.tool_calls]
    for c in info.tool_calls:
        assert c.id.startswith("chatcmpl-tool-") and c.type == "function"
    for step in (1, 2, 3, 7, len(text) or 1):
        deltas, called = stream(cls(), text, step)
        content, calls = accumulate(deltas)
        assert called == info.tools_called, step
        assert content == (info.content or ""), step
        if called:
            assert [(c["name"], c["arguments"]) for c in calls] == whole, step
    args = [(name, json.loads(a)) for name, a in whole]
    return info.tools_called, args, info.content


def test_registry_has_vllms_names() -> None:
    assert set(TOOL_PARSERS) == {"hermes", "llama3_json", "pythonic"}
    assert get_tool_parser("hermes") is HermesToolParser
    with pytest.raises(ValueError, match="unknown tool call parser 'mistral'"):
        get_tool_parser("mistral")


# -- hermes -------------------------------------------------------------------------------------
def test_hermes_calls_with_content_before() -> None:
    text = (
        "Let me check.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2], "q": "a}\\"b"}}\n'
        '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    )
    called, calls, content = check(HermesToolParser, text)
    assert called and content == "Let me check.\n"
    assert calls == [
        ("get_weather", {"city": "Paris", "days": [1, 2], "q": 'a}"b'}),
        ("get_time", {}),
    ]


def test_hermes_variants() -> None:
    # no closing tag (the model stopped right after the JSON), "parameters", name last
    assert check(HermesToolParser, '<tool_call>{"name": "f", "arguments": {"a": 1}}')[1] == [
        ("f", {"a": 1})
    ]
    assert check(HermesToolParser, '<tool_call>{"name": "f", "parameters": {"a": 1}}')[1] == [
        ("f", {"a": 1})
    ]
    assert check(HermesToolParser, '<tool_call>{"arguments": {"a": 1}, "name": "f"}')[1] == [
        ("f", {"a": 1})
    ]
    # arguments given as a JSON string, and no arguments at all
    text = '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>'
    assert check(HermesToolParser, text)[1] == [("f", {"a": 1})]
    assert check(HermesToolParser, '<tool_call>{"name": "f"}</tool_call>')[1] == [("f", {})]
    # unicode is kept as is
    text = '<tool_call>{"name": "f", "arguments": {"city": "Zürich 東京"}}</tool_call>'
    assert check(HermesToolParser, text)[1] == [("f", {"city": "Zürich 東京"})]


@pytest.mark.parametrize(
    "text",
    [
        "",
        "Just an answer, no tools.",
        "I would write <tool_call> here",  # the tag but no JSON
        "<tool_call>{not json}</tool_call>",
        '<tool_call>{"name": "f", "arguments": {"a": 1}</tool_call>',  # unbalanced
        '<tool_call>{"name": "f", "arguments": {"a": 1',  # cut by max_tokens
        '<tool_call>{"arguments": {"a": 1}}</tool_call>',  # no name
        '<tool_call>{"name": 3, "arguments": {}}</tool_call>',  # a name that is no string
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',  # arguments not an object
        '<tool_call>{"name": "f", "arguments": {"a": NaN}}</tool_call>',  # not JSON
        '<tool_call>{"name": "f", "arguments": {}} trailing</tool_call>',
        "<tool_call>" + "[" * 5000 + "]" * 5000,  # deep nesting
    ],
)
def test_hermes_malformed_is_content(text: str) -> None:
    called, calls, content = check(HermesToolParser, text)
    assert not called and calls == [] and content == text


def test_hermes_holds_back_a_partial_tag() -> None:
    p = HermesToolParser()
    d = p.extract_tool_calls_streaming("", "Hi <tool", "Hi <tool")
    assert d is not None and d.content == "Hi "  # "<tool" may become "<tool_call>"
    d = p.extract_tool_calls_streaming("Hi <tool", "Hi <tools", "s")
    assert d is not None and d.content == "<tools"


def test_hermes_name_is_sent_only_when_complete() -> None:
    p = HermesToolParser()
    assert p.extract_tool_calls_streaming("", '<tool_call>{"name": "get_w', "") is None
    d = p.extract_tool_calls_streaming("", '<tool_call>{"name": "get_weather", "argu', "")
    assert d is not None and d.tool_calls is not None
    assert d.tool_calls[0].function is not None
    assert d.tool_calls[0].function.name == "get_weather"
    assert d.tool_calls[0].function.arguments == ""


def test_parallel_calls_off_keeps_the_first() -> None:
    text = (
        '<tool_call>{"name": "a", "arguments": {}}</tool_call>'
        '<tool_call>{"name": "b", "arguments": {}}</tool_call>'
    )
    info = HermesToolParser(max_calls=1).extract_tool_calls(text)
    assert [c.function.name for c in info.tool_calls] == ["a"]
    deltas, called = stream(HermesToolParser(max_calls=1), text, 4)
    assert called and [c["name"] for c in accumulate(deltas)[1]] == ["a"]


# -- llama3_json --------------------------------------------------------------------------------
def test_llama3_json_calls() -> None:
    text = '<|python_tag|>{"name": "f", "parameters": {"x": "y"}}; {"name": "g", "arguments": {}}'
    called, calls, content = check(Llama3JsonToolParser, text)
    assert called and content is None and calls == [("f", {"x": "y"}), ("g", {})]
    called, calls, content = check(Llama3JsonToolParser, '  {"name": "f", "parameters": {}}')
    assert called and calls == [("f", {})]
    called, calls, content = check(
        Llama3JsonToolParser, 'Calling it.<|python_tag|>{"name": "f", "parameters": {"n": -1.5}}'
    )
    assert called and content == "Calling it." and calls == [("f", {"n": -1.5})]


@pytest.mark.parametrize(
    "text",
    [
        "The answer is 42.",
        '{"answer": 42}',  # JSON, but no call
        '{"name": "f", "parameters": {}} and then text',
    ],
)
def test_llama3_json_non_calls_are_content(text: str) -> None:
    called, _, content = check(Llama3JsonToolParser, text)
    assert not called and content == text


def test_llama3_json_holds_back_a_partial_python_tag() -> None:
    p = Llama3JsonToolParser()
    d = p.extract_tool_calls_streaming("", "Ok <|python", "Ok <|python")
    assert d is not None and d.content == "Ok "
    assert p.extract_tool_calls_streaming("", "   ", "   ") is None  # undecided yet


# -- pythonic -----------------------------------------------------------------------------------
def test_pythonic_calls() -> None:
    text = '[get_weather(city="Paris", days=-3, opts={"a": [1, (2, 3)], "b": None}), now()]'
    called, calls, content = check(PythonicToolParser, text)
    assert called and content is None
    assert calls == [
        ("get_weather", {"city": "Paris", "days": -3, "opts": {"a": [1, [2, 3]], "b": None}}),
        ("now", {}),
    ]
    text = "[f(s='it\\'s \"quoted\" ) ] (', t=True, u=1e3)]"
    assert check(PythonicToolParser, text)[1] == [
        ("f", {"s": 'it\'s "quoted" ) ] (', "t": True, "u": 1000.0})
    ]


@pytest.mark.parametrize(
    "text",
    [
        "Sure, [f(a=1)]",  # text first
        "[f(1)]",  # positional
        "[f(**kw)]",
        '[f(a=__import__("os").system("touch /tmp/kvserve-pwned"))]',  # never evaluated
        "[f(a=x)]",  # a name, not a literal
        "[os.system(a=1)]",  # not a plain name
        "[f(a=1e999)]",  # infinity is not JSON
        "[f(a={1: 2})]",  # a key that is not a string
        "[f(a=1)",  # not closed
        "[f(a=1)] extra",
        "[1, 2]",
        "[]",
    ],
)
def test_pythonic_non_calls_are_content(text: str) -> None:
    called, _, content = check(PythonicToolParser, text)
    assert not called and content == text


def test_pythonic_announces_only_valid_calls() -> None:
    p = PythonicToolParser()
    text = '[f(a=1), g(b=open("x"))]'
    deltas, called = stream(p, text, 1)
    content, calls = accumulate(deltas)
    assert not called and content == text  # the stream's content is the whole text
    assert [c["name"] for c in calls] == ["f"]  # g was never announced
