"""Tool calling on /v1/chat/completions with the official openai client (and LangChain),
against a live ``kvserve serve --enable-auto-tool-choice --tool-call-parser hermes``.

The built-in 135M model rarely calls a tool by itself, so ``auto`` is tested two ways: as it
comes (the answer is either content or well-formed calls), and with the model's output forced
into the hermes format by a regex (``structured_outputs``), which runs the parser path on
real engine output. ``required`` and named calls are guaranteed by the grammar, so at
temperature 0.8 every answer's arguments must validate against the tool's schema.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from kvserve.server.protocol import ChatCompletionChunk
from tests.server.conftest import BUILTIN, Server, start_server
from tests.server.test_completions import assert_chunks_are_the_models_json, raw_sse_events

pytestmark = pytest.mark.slow

TEMPLATE = Path(__file__).parents[2] / "examples" / "tool_chat_template_hermes.jinja"
WEATHER_PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo", "Rome"]},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME_PARAMS = {
    "type": "object",
    "properties": {"zone": {"type": "string", "enum": ["CET", "UTC", "PST"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather forecast for a city",
            "parameters": WEATHER_PARAMS,
        },
    },
    {
        "type": "function",
        "function": {"name": "get_time", "description": "The time now", "parameters": TIME_PARAMS},
    },
]
SCHEMAS = {"get_weather": WEATHER_PARAMS, "get_time": TIME_PARAMS}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris, and the time in CET?"}]
WEATHER_CHOICE = {"type": "function", "function": {"name": "get_weather"}}
# Forces the model's text into a hermes tool call (content first), for the auto parser path.
HERMES_REGEX = (
    r'Checking\.\n<tool_call>\n\{"name": "get_weather", "arguments": '
    r'\{"city": "(Paris|Oslo|Rome)", "unit": "(celsius|fahrenheit)"\}\}\n</tool_call>'
)


@pytest.fixture(scope="module")
def tool_server(
    builtin_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("logs") / "tool_server.log"
    srv = start_server(
        [
            str(builtin_model_dir), "--served-model-name", BUILTIN,
            "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
            "--chat-template", str(TEMPLATE),
            "--num-kv-blocks", "400", "--max-num-seqs", "16",
        ],
        log,
    )  # fmt: skip
    yield srv
    srv.stop()
    assert "Traceback" not in log.read_text()


def chat(server: Server, **kw: Any) -> Any:
    body = {"model": BUILTIN, "messages": MESSAGES, "tools": TOOLS, "max_tokens": 120, **kw}
    return server.client().chat.completions.create(**body)


def streamed(server: Server, **kw: Any) -> Any:
    """The openai SDK's own accumulation of a stream (``get_final_completion``)."""
    body = {"model": BUILTIN, "messages": MESSAGES, "tools": TOOLS, "max_tokens": 120, **kw}
    with server.client().chat.completions.stream(**body) as stream:
        for _ in stream:
            pass
        return stream.get_final_completion()


def valid_calls(message: Any, names: set[str] | None = None) -> list[tuple[str, dict[str, Any]]]:
    """The message's calls as (name, arguments); each arguments string is a JSON object
    valid under its tool's schema."""
    assert message.tool_calls, message
    out = []
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
        assert call.function.name in (names or SCHEMAS)
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, SCHEMAS[call.function.name])
        out.append((call.function.name, args))
    assert len({c.id for c in message.tool_calls}) == len(message.tool_calls)
    return out


# -- required and named: the grammar ------------------------------------------------------------
def test_required(tool_server: Server) -> None:
    for seed in range(2):
        r = chat(tool_server, tool_choice="required", temperature=0.8, seed=seed)
        (choice,) = r.choices
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.content is None
        assert len(valid_calls(choice.message)) >= 1


def test_required_without_parallel_calls_is_one_call(tool_server: Server) -> None:
    r = chat(
        tool_server, tool_choice="required", parallel_tool_calls=False, temperature=0.8, seed=0,
        n=2,
    )  # fmt: skip
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls"
        assert len(valid_calls(choice.message)) == 1


def test_required_streaming(tool_server: Server) -> None:
    kw = {"tool_choice": "required", "temperature": 0.8, "seed": 11}
    final = streamed(tool_server, **kw)
    (choice,) = final.choices
    assert choice.finish_reason == "tool_calls"
    calls = valid_calls(choice.message)
    # the same request without streaming gives the same calls (same seed, same tokens)
    whole = chat(tool_server, **kw).choices[0]
    assert valid_calls(whole.message) == calls
    assert [c.function.arguments for c in whole.message.tool_calls] == [
        c.function.arguments for c in choice.message.tool_calls
    ]


def test_named(tool_server: Server) -> None:
    for seed in range(2):
        r = chat(tool_server, tool_choice=WEATHER_CHOICE, temperature=0.8, seed=seed)
        (choice,) = r.choices
        assert choice.finish_reason == "stop"  # vLLM and OpenAI: named calls "stop"
        assert [n for n, _ in valid_calls(choice.message, {"get_weather"})] == ["get_weather"]
    final = streamed(tool_server, tool_choice=WEATHER_CHOICE, temperature=0.8, seed=7)
    assert final.choices[0].finish_reason == "stop"
    assert len(valid_calls(final.choices[0].message, {"get_weather"})) == 1


def test_stream_chunks_are_openais_deltas(tool_server: Server) -> None:
    body = {
        "model": BUILTIN, "messages": MESSAGES, "tools": TOOLS, "max_tokens": 400,
        "tool_choice": "required", "temperature": 0.8, "seed": 3, "stream": True,
        "stream_options": {"include_usage": True},
    }  # fmt: skip
    events = raw_sse_events(tool_server, "/v1/chat/completions", body)
    chunks = assert_chunks_are_the_models_json(events, ChatCompletionChunk, include_usage=True)
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert deltas[0] == {"role": "assistant", "content": ""}
    seen: dict[int, str] = {}
    for d in deltas[1:]:
        assert set(d) <= {"tool_calls"}
        for tc in d.get("tool_calls", []):
            if tc["index"] not in seen:  # first delta of a call: id, type, name
                assert set(tc) == {"index", "id", "type", "function"}
                assert tc["function"]["name"] in SCHEMAS
                seen[tc["index"]] = tc["function"]["name"]
            else:  # then arguments fragments only
                assert set(tc) == {"index", "function"} and set(tc["function"]) == {"arguments"}
    assert seen and sorted(seen) == list(range(len(seen)))
    assert chunks[-2]["choices"][0]["finish_reason"] == "tool_calls"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0


# -- auto: the hermes parser --------------------------------------------------------------------
def test_auto_as_the_model_answers(tool_server: Server) -> None:
    for seed in range(2):
        (choice,) = chat(tool_server, temperature=0.8, seed=seed, max_tokens=48).choices
        if choice.finish_reason == "tool_calls":
            valid_calls(choice.message)
        else:
            assert choice.message.content and not choice.message.tool_calls


def test_auto_parses_a_hermes_tool_call(tool_server: Server) -> None:
    forced = {"structured_outputs": {"regex": HERMES_REGEX}}
    r = chat(tool_server, tool_choice="auto", temperature=0.8, seed=1, extra_body=forced)
    (choice,) = r.choices
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Checking.\n"
    ((name, args),) = valid_calls(choice.message)
    assert name == "get_weather" and set(args) == {"city", "unit"}
    final = streamed(tool_server, temperature=0.8, seed=1, extra_body=forced)
    assert final.choices[0].finish_reason == "tool_calls"
    assert final.choices[0].message.content == "Checking.\n"
    assert valid_calls(final.choices[0].message) == [(name, args)]


def test_none_answers_with_text(tool_server: Server) -> None:
    (choice,) = chat(tool_server, tool_choice="none", temperature=0, max_tokens=24).choices
    assert choice.message.content and not choice.message.tool_calls
    assert choice.finish_reason in ("stop", "length")


# -- history with tool calls and results --------------------------------------------------------
def test_round_trip_with_a_tool_message(tool_server: Server) -> None:
    client = tool_server.client()
    first = chat(tool_server, tool_choice=WEATHER_CHOICE, temperature=0.8, seed=5)
    call = first.choices[0].message.tool_calls[0]
    result = "Sunny, 21 degrees."
    history = [
        *MESSAGES,
        first.choices[0].message.model_dump(exclude_none=True),  # content null, tool_calls
        {"role": "tool", "tool_call_id": call.id, "content": result},
    ]
    assert history[1]["role"] == "assistant" and "content" not in history[1]
    r = client.chat.completions.create(
        model=BUILTIN, messages=history, tools=TOOLS, tool_choice="none", max_tokens=16,
        temperature=0, extra_body={"return_token_ids": True},
    )  # fmt: skip
    assert r.choices[0].finish_reason in ("stop", "length")
    # the template saw the call (arguments as an object) and the result
    prompt_ids = r.model_extra["prompt_token_ids"]
    prompt = httpx.post(f"{tool_server.url}/detokenize", json={"tokens": prompt_ids}).json()
    text = prompt["prompt"]
    args = json.loads(call.function.arguments)
    assert json.dumps({"name": "get_weather", "arguments": args}) in text
    assert f"<tool_response>\n{result}\n</tool_response>" in text
    assert '"name": "get_time"' in text  # the tools are in the system turn
    # /tokenize renders the same prompt
    tok = httpx.post(
        f"{tool_server.url}/tokenize", json={"messages": history, "tools": TOOLS}
    ).json()
    assert tok["tokens"] == prompt_ids and r.usage.prompt_tokens == len(prompt_ids)


def test_continue_final_message(tool_server: Server) -> None:
    client = tool_server.client()
    prefill = [*MESSAGES, {"role": "assistant", "content": "The weather in Paris is"}]
    r = client.chat.completions.create(
        model=BUILTIN, messages=prefill, max_tokens=4, temperature=0,
        extra_body={"continue_final_message": True, "add_generation_prompt": False,
                    "return_token_ids": True},
    )  # fmt: skip
    prompt = httpx.post(
        f"{tool_server.url}/detokenize", json={"tokens": r.model_extra["prompt_token_ids"]}
    ).json()["prompt"]
    assert prompt.endswith("<|im_start|>assistant\nThe weather in Paris is")
    with pytest.raises(openai.BadRequestError, match="continue_final_message"):
        client.chat.completions.create(
            model=BUILTIN, messages=prefill, max_tokens=4,
            extra_body={"continue_final_message": True},
        )  # fmt: skip


# -- bad requests: 400, and the engine serves on -----------------------------------------------
def tool(name: str, parameters: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


BAD_REQUESTS = [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "does not match"),
    ({"tools": None, "tool_choice": "required"}, "`tools` must be set"),
    ({"tools": [tool("f", {"type": "string"})], "tool_choice": "required"}, "type object"),
    (  # a schema only the grammar compiler can refuse
        {"tools": [tool("f", {"properties": {"a": {"type": "strnig"}}})],
         "tool_choice": "required"},
        "structured outputs",
    ),
    ({"tool_choice": "required", "extra_body": {"guided_regex": "a+"}}, "not both"),
    ({"extra_body": {"chat_template": "{{ messages }}"}}, "--trust-request-chat-template"),
    (
        {"messages": [{"role": "assistant", "tool_calls": [
            {"id": "x", "function": {"name": "f", "arguments": "{oops"}}]}]},
        "not a JSON object",
    ),
]  # fmt: skip


def test_bad_tool_requests_are_400(tool_server: Server) -> None:
    for kw, message in BAD_REQUESTS:
        with pytest.raises(openai.BadRequestError) as e:
            chat(tool_server, **kw)
        assert message in e.value.message, (kw, e.value.message)
    assert httpx.get(f"{tool_server.url}/health").status_code == 200
    r = chat(tool_server, tool_choice=WEATHER_CHOICE, temperature=0.8, seed=0)
    valid_calls(r.choices[0].message)


# -- LangChain ----------------------------------------------------------------------------------
def langchain_model(server: Server, **kw: Any) -> Any:
    lc = pytest.importorskip("langchain_openai")
    args = {"temperature": 0.8, "max_tokens": 120, "max_retries": 0, **kw}
    return lc.ChatOpenAI(model=BUILTIN, base_url=f"{server.url}/v1", api_key="none", **args)


def test_langchain_bind_tools(tool_server: Server) -> None:
    from langchain_core.messages import HumanMessage, ToolMessage
    from pydantic import BaseModel, Field

    class get_weather(BaseModel):  # the tool's name
        """The weather forecast for a city."""

        city: str = Field(json_schema_extra={"enum": ["Paris", "Oslo", "Rome"]})
        unit: str = Field(json_schema_extra={"enum": ["celsius", "fahrenheit"]})

    llm = langchain_model(tool_server, seed=2)
    for choice in ("get_weather", "any"):  # a named function; "any" is OpenAI's "required"
        msg = llm.bind_tools([get_weather], tool_choice=choice).invoke("Weather in Oslo?")
        (call,) = msg.tool_calls[:1]
        assert call["name"] == "get_weather" and call["id"].startswith("chatcmpl-tool-")
        get_weather.model_validate(call["args"])
        assert not msg.invalid_tool_calls
    # streamed: LangChain merges the tool_call_chunks by index
    bound = llm.bind_tools([get_weather], tool_choice="get_weather")
    chunks = list(bound.stream("Weather in Rome?"))
    merged = chunks[0]
    for c in chunks[1:]:
        merged = merged + c
    (call,) = merged.tool_calls
    get_weather.model_validate(call["args"])
    # a round trip: the call and its result go back to the model
    history = [HumanMessage("Weather in Oslo?"), msg]
    history.append(ToolMessage("Cold, -3 degrees.", tool_call_id=msg.tool_calls[0]["id"]))
    answer = llm.bind_tools([get_weather], tool_choice="none").invoke(history)
    assert isinstance(answer.content, str) and answer.content


def test_langchain_with_structured_output(tool_server: Server) -> None:
    from pydantic import BaseModel, Field

    class City(BaseModel):
        name: str = Field(max_length=20)
        country: str = Field(max_length=20)
        population: int = Field(ge=0)

    llm = langchain_model(tool_server, seed=4, max_tokens=200)
    city = llm.with_structured_output(City, method="json_schema").invoke("Describe Paris.")
    assert isinstance(city, City)
    named = llm.with_structured_output(City, method="function_calling").invoke("Describe Oslo.")
    assert isinstance(named, City)
