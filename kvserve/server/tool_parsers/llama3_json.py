"""``llama3_json``: Llama 3.1/3.2 JSON tool calls, ``{"name": ..., "parameters": {...}}``
(``"arguments"`` too), possibly after ``<|python_tag|>``, several separated by ``;``.

An output is read as tool calls when it starts with ``{`` (after whitespace) or contains
``<|python_tag|>`` (text before the tag is content); anything else is content.
"""

from __future__ import annotations

from kvserve.server.tool_parsers.base import PartialParse, ToolParser, holdback
from kvserve.server.tool_parsers.hermes import call_from_object
from kvserve.server.tool_parsers.partial_json import MalformedJSON, scan_object, skip_ws

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def parse(self, text: str, final: bool) -> PartialParse:
        tag = text.find(PYTHON_TAG)
        if tag >= 0:
            parse, pos = PartialParse(text[:tag]), tag + len(PYTHON_TAG)
        else:
            first = skip_ws(text, 0)
            if first < len(text) and text[first] == "{":
                parse, pos = PartialParse(""), first
            elif final:
                return PartialParse(text)
            elif first == len(text):
                return PartialParse("")  # only whitespace so far: undecided
            else:
                return PartialParse(text[: len(text) - holdback(text, PYTHON_TAG)])
        while True:
            pos = skip_ws(text, pos)
            if pos == len(text):
                return parse
            if text[pos] != "{":
                raise MalformedJSON("expected a JSON object")
            scan = scan_object(text, pos)
            parse.calls.append(call_from_object(text, scan, ("parameters", "arguments")))
            if scan.end is None:
                return parse
            pos = skip_ws(text, scan.end)
            if pos == len(text):
                return parse
            if text[pos] != ";":
                raise MalformedJSON("expected ';' between tool calls")
            pos += 1
