"""Checks on a raw JSON request body that pydantic cannot make: text that is not Unicode.

JSON may spell a lone UTF-16 surrogate (``"\\ud800"``), or a body may carry one as bytes
(``b"\\xed\\xa0\\x80"``), and Python's parser accepts both, but the result is not text: the
tokenizer, the chat template and every UTF-8 encoder raise on it, deep inside a handler (a 500
that also closes the keep-alive connection). The guard middleware rejects such a body up front
with a 400 that says where the bad text is.
"""

from __future__ import annotations

import json
import re
from typing import Any

from kvserve.server.errors import APIError, bad_request

# A lone surrogate reaches Python through a \uD800-\uDFFF escape, or as bytes that are not
# strict UTF-8: json.loads decodes bytes with "surrogatepass" (so b"\xed\xa0\x80" becomes
# "\ud800") and also accepts UTF-16/32. Other bodies cannot hold one and skip the parse.
_ESCAPES = (b"\\ud", b"\\uD")
_SURROGATE = re.compile("[\ud800-\udfff]")

Path = tuple[str | int, ...]


def invalid_unicode_error(body: bytes) -> APIError | None:
    """A 400 naming a string (value or key) that holds a lone surrogate, else None."""
    if not _may_hold_surrogate(body):
        return None
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        return None  # not JSON at all: the route's own parsing answers 400
    found = _find_surrogate(data)
    if found is None:
        return None  # only valid surrogate pairs, which JSON decoding joined
    path, in_key = found
    where = _format_path(path)
    what = f"a key in {where or 'the body'}" if in_key else f"the string at {where}"
    param = path[0] if path and isinstance(path[0], str) else None
    return bad_request(
        f"invalid Unicode in the request body: {what} holds a lone UTF-16 surrogate "
        f"(U+D800-U+DFFF, e.g. a \\ud800 escape without its pair), which is not a character; "
        f"send valid UTF-8 text",
        param,
    )


def _may_hold_surrogate(body: bytes) -> bool:
    """False for almost every body, cheaply: ASCII without a surrogate escape, or strict UTF-8
    (which cannot encode a surrogate) without one."""
    if any(e in body for e in _ESCAPES):
        return True
    if body.isascii():
        return False
    try:
        body.decode("utf-8")  # strict: refuses encoded surrogates
    except UnicodeDecodeError:
        return True  # encoded surrogates, UTF-16/32, or garbage (then json.loads fails too)
    return False


def _find_surrogate(data: Any) -> tuple[Path, bool] | None:
    """(path, in a key?) of a string with a lone surrogate, depth-first.

    Iterative, so that a deeply nested body cannot exhaust the recursion limit here.
    """
    stack: list[tuple[Any, Path]] = [(data, ())]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            if _SURROGATE.search(value):
                return path, False
        elif isinstance(value, dict):
            for key, item in reversed(value.items()):
                if _SURROGATE.search(key):
                    return path, True
                stack.append((item, (*path, key)))
        elif isinstance(value, list):
            stack.extend((item, (*path, i)) for i, item in reversed(list(enumerate(value))))
    return None


def _format_path(path: Path) -> str:
    """``messages[0].content`` for ("messages", 0, "content")."""
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else part
    return out
