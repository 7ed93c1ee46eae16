"""``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Hermes 2 Pro/3,
Qwen2.5/Qwen3 and other models whose chat template asks for this format).

Text before the first ``<tool_call>`` is content; several calls may follow one another; a last
call whose ``</tool_call>`` never came (the model stopped right after the JSON) still counts.
"""

from __future__ import annotations

from kvserve.server.tool_parsers.base import PartialCall, PartialParse, ToolParser, holdback
from kvserve.server.tool_parsers.partial_json import (
    MalformedJSON,
    ObjectScan,
    loads_strict,
    scan_object,
    skip_ws,
)

START = "<tool_call>"
END = "</tool_call>"


def call_from_object(text: str, scan: ObjectScan, argument_keys: tuple[str, ...]) -> PartialCall:
    """The call an object ``{"name": ..., <argument key>: {...}}`` describes so far.

    The arguments are the raw text of the first argument member (a string value holding
    JSON is unwrapped once complete); a name that is not a string is no name.
    """
    name = None
    m = scan.member("name")
    if m is not None and m.value_start is not None and m.value_end is not None:
        value = loads_strict(text[m.value_start : m.value_end])
        name = value if isinstance(value, str) and value else None
    arguments = ""
    a = scan.member(*argument_keys)
    if a is not None and a.value_start is not None:
        if text[a.value_start] == '"':  # arguments sent as a JSON string: only when whole
            if a.value_end is not None:
                arguments = str(loads_strict(text[a.value_start : a.value_end]))
        else:
            arguments = text[a.value_start : a.value_end]
    return PartialCall(name, arguments, scan.end is not None)


class HermesToolParser(ToolParser):
    name = "hermes"

    def parse(self, text: str, final: bool) -> PartialParse:
        start = text.find(START)
        if start < 0:
            keep = len(text) if final else len(text) - holdback(text, START)
            return PartialParse(text[:keep])
        parse = PartialParse(text[:start])
        pos = start + len(START)
        while True:
            pos = skip_ws(text, pos)
            if pos == len(text):
                return parse
            if text[pos] != "{":
                raise MalformedJSON(f"expected a JSON object after {START}")
            scan = scan_object(text, pos)
            parse.calls.append(call_from_object(text, scan, ("arguments", "parameters")))
            if scan.end is None:
                return parse
            pos = skip_ws(text, scan.end)
            if text.startswith(END, pos):
                pos += len(END)
            elif pos < len(text) and not END.startswith(text[pos:]):
                raise MalformedJSON(f"expected {END} after a tool call")
            nxt = text.find(START, pos)
            if nxt < 0:
                return parse  # text after the last call (usually nothing) is dropped
            pos = nxt + len(START)
