"""``pythonic``: a Python list of calls with keyword arguments,
``[get_weather(city="Paris", days=3), get_time(zone="CET")]`` (Llama 3.2, Llama 4, ToolACE).

The text is read with ``ast`` and only literals are accepted as argument values (strings,
numbers, booleans, None, and lists / tuples / dicts of them); nothing is ever evaluated. An
output that does not start with ``[`` is content. While streaming, a call is announced with
its name and its arguments (as JSON) once its closing parenthesis has been generated and
the call has been read as literals, so a call that turns out invalid is never announced.
"""

from __future__ import annotations

import ast
import json
import math
from typing import Any

from kvserve.server.tool_parsers.base import PartialCall, PartialParse, ToolParser
from kvserve.server.tool_parsers.partial_json import MalformedJSON, skip_ws

_PAIRS = {")": "(", "]": "[", "}": "{"}


class NotALiteral(ValueError):
    pass


def literal(node: ast.expr) -> Any:
    """The value of a literal expression (JSON-representable), or ``NotALiteral``."""
    if isinstance(node, ast.Constant):
        value = node.value
        if value is None or isinstance(value, (bool, int, str)):
            return value
        if isinstance(value, float) and math.isfinite(value):
            return value
        raise NotALiteral(f"{value!r} is not a JSON value")
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = literal(node.operand)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise NotALiteral("a sign applies to numbers only")
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, (ast.List, ast.Tuple)):
        return [literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        out = {}
        for k, v in zip(node.keys, node.values, strict=True):
            if not (isinstance(k, ast.Constant) and isinstance(k.value, str)):
                raise NotALiteral("dict keys must be strings")
            out[k.value] = literal(v)
        return out
    raise NotALiteral(f"{type(node).__name__} is not a literal")


def call_arguments(source: str) -> tuple[str, str]:
    """(name, arguments as JSON text) of one call ``name(k=v, ...)``."""
    node = ast.parse(source.strip(), mode="eval").body
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
        raise NotALiteral("a tool call is name(key=value, ...)")
    if node.args or any(k.arg is None for k in node.keywords):
        raise NotALiteral("tool call arguments must be given by keyword")
    args = {k.arg: literal(k.value) for k in node.keywords}
    return node.func.id, json.dumps(args, ensure_ascii=False)


def _string_end(text: str, pos: int) -> int | None:
    """``text[pos]`` opens a Python string: one past its end, or None if it is open."""
    quote = text[pos]
    if text.startswith(quote * 3, pos):
        end = pos + 3
        while True:
            j = text.find(quote * 3, end)
            if j < 0:
                return None
            if text[j - 1] != "\\":
                return j + 3
            end = j + 1
    i = pos + 1
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2
        elif c == quote:
            return i + 1
        elif c == "\n":
            raise MalformedJSON("unterminated string")
        else:
            i += 1
    return None


class PythonicToolParser(ToolParser):
    name = "pythonic"

    def parse(self, text: str, final: bool) -> PartialParse:
        first = skip_ws(text, 0)
        if first == len(text):
            return PartialParse(text if final else "")
        if text[first] != "[":
            return PartialParse(text)
        parse = PartialParse("")
        stack: list[str] = []  # brackets open inside the outer list
        call_start = -1  # where the current call's name begins
        i = first + 1
        n = len(text)
        while i < n:
            c = text[i]
            if c in "'\"":
                end = _string_end(text, i)
                if end is None:
                    break
                i = end
                continue
            if not stack:  # between calls, inside the outer list
                if c == "]":
                    if skip_ws(text, i + 1) != n:
                        raise MalformedJSON("text after the list of calls")
                    return parse
                if c.isalnum() or c == "_":
                    j = i
                    while j < n and (text[j].isalnum() or text[j] == "_"):
                        j += 1
                    k = skip_ws(text, j)
                    if k == n:
                        break  # the name may still grow
                    if text[k] != "(" or not text[i:j].isidentifier():
                        raise MalformedJSON("expected name(...)")
                    call_start = i
                    parse.calls.append(PartialCall(None, ""))  # named once complete
                    stack.append("(")
                    i = k + 1
                    continue
                if c not in ", \t\r\n":
                    raise MalformedJSON(f"unexpected {c!r} between calls")
            elif c in "([{":
                stack.append(c)
            elif c in ")]}":
                if stack.pop() != _PAIRS[c]:
                    raise MalformedJSON(f"mismatched {c!r}")
                if not stack:  # the call closed
                    name, arguments = call_arguments(text[call_start : i + 1])
                    parse.calls[-1] = PartialCall(name, arguments, True)
            i += 1
        if final:
            raise MalformedJSON("the list of calls is not closed")
        return parse
