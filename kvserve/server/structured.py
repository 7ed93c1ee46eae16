"""Request fields that constrain decoding, mapped onto ``SamplingParams`` (vLLM's names).

Structured outputs arrive in three spellings, all accepted on both endpoints, as vLLM does:
OpenAI's ``response_format`` (``json_object``, ``json_schema``), vLLM's ``structured_outputs``
object, and vLLM's older ``guided_json`` / ``guided_regex`` / ``guided_choice`` /
``guided_grammar``. More than one of them in a request is a 400 (which would win is not
obvious); so is any constraint kvserve cannot honour. Token-level fields (``logit_bias``,
``allowed_token_ids``, ``bad_words``) are checked here for form and by the engine against the
vocabulary.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvserve.sampling_params import ParamError
from kvserve.structured_output.params import StructuredOutputsParams

# guided_decoding_backend values that name what kvserve runs (vLLM's default is "auto").
_BACKENDS = (None, "auto", "xgrammar")


class _Strict(BaseModel):
    model_config = ConfigDict(
        extra="forbid", strict=True, allow_inf_nan=False, populate_by_name=True
    )


class JsonSchemaFormat(_Strict):
    """OpenAI's ``response_format.json_schema``; the schema is always enforced (strict)."""

    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(_Strict):
    """vLLM's ``structured_outputs`` request object (``extra_body``)."""

    json_: str | dict[str, Any] | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(None, min_length=1)  # [] has nothing to choose
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = False


def _from_response_format(rf: ResponseFormat) -> StructuredOutputsParams | None:
    if rf.type == "text":
        return None
    if rf.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    if rf.json_schema is None or rf.json_schema.json_schema is None:
        raise ParamError("response_format", "response_format json_schema needs json_schema.schema")
    return StructuredOutputsParams(json=rf.json_schema.json_schema)


def structured_outputs_params(req: Any) -> StructuredOutputsParams | None:
    """The request's one structured-output constraint, or None; ``ParamError`` (a 400 naming
    the field) when several are given or one cannot be honoured."""
    if req.guided_decoding_backend not in _BACKENDS:
        raise ParamError(
            "guided_decoding_backend",
            f"guided_decoding_backend {req.guided_decoding_backend!r} is not available; "
            "kvserve runs xgrammar ('auto' or 'xgrammar')",
        )
    if req.guided_whitespace_pattern is not None:
        raise ParamError(
            "guided_whitespace_pattern",
            "guided_whitespace_pattern is not supported (xgrammar has no whitespace pattern); "
            "use structured_outputs.disable_any_whitespace",
        )
    found: list[tuple[str, StructuredOutputsParams]] = []
    if req.response_format is not None:
        so = _from_response_format(req.response_format)
        if so is not None:
            found.append(("response_format", so))
    if req.structured_outputs is not None:
        fields = req.structured_outputs.model_dump(by_alias=True, exclude_none=True)
        found.append(("structured_outputs", _build("structured_outputs", fields)))
    legacy = {
        "guided_json": ("json", req.guided_json),
        "guided_regex": ("regex", req.guided_regex),
        "guided_choice": ("choice", req.guided_choice),
        "guided_grammar": ("grammar", req.guided_grammar),
    }
    for name, (kind, value) in legacy.items():
        if value is not None:
            found.append((name, _build(name, {kind: value})))
    if len(found) > 1:
        names = ", ".join(n for n, _ in found)
        raise ParamError(found[1][0], f"only one structured output constraint is allowed: {names}")
    return found[0][1] if found else None


def _build(field: str, fields: dict[str, Any]) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**fields)
    except ParamError as e:
        raise ParamError(field, str(e)) from e


def logit_bias_ids(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's ``logit_bias`` (JSON keys are strings) as ``{token id: bias}``."""
    if not bias:
        return None
    out: dict[int, float] = {}
    for key, value in bias.items():
        try:
            tid = int(key)
        except ValueError:
            raise ParamError(
                "logit_bias", f"logit_bias keys must be token ids, got {key!r}"
            ) from None
        out[tid] = value
    return out
