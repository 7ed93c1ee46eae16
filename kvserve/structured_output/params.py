"""``StructuredOutputsParams``: what the output must match (vLLM's class, field for field).

Exactly one constraint is set: ``json`` (a JSON schema, as a dict or its text), ``regex``,
``choice`` (one of a few strings), ``grammar`` (EBNF/GBNF when it contains ``::=``, else Lark),
``json_object`` (any JSON object) or ``structural_tag`` (xgrammar's structural tag JSON).
Validation of the form happens here; whether the schema/regex/grammar compiles is decided by
the grammar compiler (``grammar.compile_grammar``), which raises ``GrammarError``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kvserve.sampling_params import ParamError

_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


class GrammarError(ParamError):
    """A constraint the grammar compiler refused; the message is the compiler's reason."""

    def __init__(self, message: str) -> None:
        super().__init__("structured_outputs", message)


@dataclass(frozen=True)
class StructuredOutputsParams:
    json: str | dict[str, Any] | None = None  # a JSON schema (dict or JSON text)
    regex: str | None = None  # the whole output matches this regular expression
    choice: list[str] | None = None  # the output is exactly one of these strings
    grammar: str | None = None  # EBNF (GBNF, with ``::=``) or Lark
    json_object: bool | None = None  # any JSON object (``response_format: json_object``)
    structural_tag: str | None = None  # xgrammar structural tag, as JSON text
    # JSON only: no whitespace between tokens (vLLM's flag; fewer tokens, same value)
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ParamError(
                "structured_outputs",
                "structured outputs need exactly one of json, regex, choice, grammar, "
                f"json_object or structural_tag; got {given or 'none'}",
            )
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ParamError("structured_outputs", "json must be a JSON schema (object or text)")
        for name in ("regex", "grammar", "structural_tag"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ParamError("structured_outputs", f"{name} must be a non-empty string")
        if self.choice is not None and (
            not isinstance(self.choice, (list, tuple))
            or not self.choice
            or not all(isinstance(c, str) and c for c in self.choice)
        ):
            raise ParamError("structured_outputs", "choice must be a list of non-empty strings")
        if self.json_object not in (None, True, False):
            raise ParamError("structured_outputs", "json_object must be a boolean")

    @property
    def kind(self) -> str:
        """Which constraint is set: one of json, regex, choice, grammar, json_object, ..."""
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))

    def key(self) -> tuple[str, str]:
        """(kind, canonical text): the grammar cache key; equal keys compile to one grammar."""
        kind = self.kind
        value: Any = getattr(self, kind)
        if kind == "json":
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except json.JSONDecodeError as e:
                    raise GrammarError(f"the JSON schema is not valid JSON: {e}") from e
            text = json.dumps(value, sort_keys=True)
            return kind, f"{self.disable_any_whitespace}{text}"
        if kind == "choice":
            return kind, json.dumps(list(value))
        if kind == "json_object":
            return kind, str(self.disable_any_whitespace)
        return kind, str(value)
