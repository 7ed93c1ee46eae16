"""The structure of JSON text that may still be growing (a model's output, token by token).

Tool-call parsers need to know, while a call is being generated, where its ``name`` string
ends and where its arguments object starts, so that the name can be sent as soon as it is
complete and the arguments as raw text fragments. Nothing here decodes whole values: the
scanner only finds spans, so the raw arguments text seen at any moment is a prefix of the
final raw text (the property streaming relies on). Whether the finished text is valid JSON
is decided by ``json.loads`` once it is complete.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

WHITESPACE = " \t\n\r"
_CLOSERS = {"}": "{", "]": "["}


class MalformedJSON(ValueError):
    """The text cannot be the beginning of the JSON expected here."""


@dataclass
class Member:
    """One ``"key": value`` of an object; spans are indexes into the scanned text."""

    key: str | None  # None while the key string is still open
    value_start: int | None = None  # the value's first character, once it began
    value_end: int | None = None  # one past the value's last character, once it is complete


@dataclass
class ObjectScan:
    start: int  # index of "{"
    end: int | None  # one past "}", or None while the object is open
    members: list[Member] = field(default_factory=list)

    def member(self, *keys: str) -> Member | None:
        """The first member whose key is one of ``keys``."""
        return next((m for m in self.members if m.key in keys), None)


def skip_ws(text: str, pos: int) -> int:
    n = len(text)
    while pos < n and text[pos] in WHITESPACE:
        pos += 1
    return pos


def scan_string(text: str, pos: int) -> int | None:
    """``text[pos]`` is a quote: one past the closing quote, or None if it is not closed."""
    i, n = pos + 1, len(text)
    while i < n:
        c = text[i]
        if c == "\\":
            i += 2
        elif c == '"':
            return i + 1
        else:
            i += 1
    return None


def scan_value(text: str, pos: int) -> int | None:
    """One past the JSON value starting at ``text[pos]``, or None while it may still grow."""
    n = len(text)
    c = text[pos]
    if c == '"':
        return scan_string(text, pos)
    if c in "{[":
        stack = [c]
        i = pos + 1
        while i < n:
            ch = text[i]
            if ch == '"':
                end = scan_string(text, i)
                if end is None:
                    return None
                i = end
                continue
            if ch in "{[":
                stack.append(ch)
            elif ch in "}]":
                if stack.pop() != _CLOSERS[ch]:
                    raise MalformedJSON(f"mismatched {ch!r} at {i}")
                if not stack:
                    return i + 1
            i += 1
        return None
    if c in ",:}]":
        raise MalformedJSON(f"a value cannot start with {c!r} (at {pos})")
    i = pos  # a number, true, false or null: it ends at a delimiter
    while i < n and text[i] not in ",}]" + WHITESPACE:
        if text[i] in '{["':
            raise MalformedJSON(f"unexpected {text[i]!r} at {i}")
        i += 1
    return None if i == n else i


def scan_object(text: str, pos: int) -> ObjectScan:
    """The members of the object starting at ``text[pos] == "{"``, as far as the text goes.

    Raises ``MalformedJSON`` when the text cannot be the start of an object.
    """
    if pos >= len(text) or text[pos] != "{":
        raise MalformedJSON(f"expected '{{' at {pos}")
    scan = ObjectScan(start=pos, end=None)
    n = len(text)
    i = pos + 1
    while True:
        i = skip_ws(text, i)
        if i == n:
            return scan
        if text[i] == "}":
            scan.end = i + 1
            return scan
        if text[i] != '"':
            raise MalformedJSON(f"expected a key at {i}")
        key_end = scan_string(text, i)
        if key_end is None:
            scan.members.append(Member(None))
            return scan
        try:
            key = json.loads(text[i:key_end])
        except ValueError as e:
            raise MalformedJSON(f"bad key at {i}: {e}") from e
        member = Member(key)
        scan.members.append(member)
        i = skip_ws(text, key_end)
        if i == n:
            return scan
        if text[i] != ":":
            raise MalformedJSON(f"expected ':' at {i}")
        i = skip_ws(text, i + 1)
        if i == n:
            return scan
        member.value_start = i
        end = scan_value(text, i)
        if end is None:
            return scan
        member.value_end = end
        i = skip_ws(text, end)
        if i == n:
            return scan
        if text[i] == ",":
            i += 1
        elif text[i] == "}":
            scan.end = i + 1
            return scan
        else:
            raise MalformedJSON(f"expected ',' or '}}' at {i}")


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def loads_strict(text: str) -> Any:
    """``json.loads`` without Python's extensions (``NaN``, ``Infinity``)."""
    value = json.loads(text, parse_constant=_no_constants)
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError("not a finite number")
    return value


def is_json_object(text: str) -> bool:
    """Whether ``text`` is exactly one JSON object (surrounding whitespace allowed)."""
    try:
        return isinstance(loads_strict(text), dict)
    except (ValueError, RecursionError):
        return False
