"""Request and response bodies of the OpenAI-compatible API (with vLLM's extra fields).

Requests ignore unknown fields, as vLLM does, so newer clients keep working; fields whose
meaning kvserve cannot honour (``suffix``...) are declared so that
a non-trivial value is rejected with a 400 instead of being silently dropped.

Requests validate strictly: JSON ``true`` is not the integer 1 (nor a token id), ``"2"`` is not
a number, and ``NaN`` / ``Infinity`` (which Python's JSON parser accepts) are not floats. An
integral number written as a float (``2.0``, ``1e3``) is an integer, as JSON Schema says (the
published document's ``integer`` admits it; ``Int``).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from kvserve.sampling_params import SamplingParams
from kvserve.server.structured import (
    ResponseFormat,
    StructuredOutputsRequest,
    logit_bias_ids,
    structured_outputs_params,
)

# Seeds, priorities and top_k reach torch / the scheduler as 64-bit integers (vLLM bounds them
# alike): larger values would overflow inside the engine step instead of failing here.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# Fields bound them with ``lt=INT64_END``, not ``le=INT64_MAX``: FastAPI's OpenAPI models hold
# bounds as floats, and 2**63 - 1 has none (it becomes 2**63), so the published schema would
# admit 2**63 while the server refuses it. 2**63 is exact as a float (and openapi.py publishes
# it as the integer): the schema and the server then agree.
INT64_END = 2**63


def _integral(value: object) -> object:
    """``2.0`` as 2: JSON Schema's integers include integral floats, and strict validation
    alone would refuse them (schemathesis sends them as valid integers)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


Int = Annotated[int, BeforeValidator(_integral)]  # a request's integer field


def _omit_none(value: object) -> bool:
    return value is None


class _Request(BaseModel):
    # strict: lax pydantic turns `true` into 1 and "0.5" into 0.5, so a boolean would become
    # a token id; allow_inf_nan: a NaN penalty or temperature would poison every logit.
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class StreamOptions(_Request):
    include_usage: bool = False
    # with include_usage: every chunk carries the usage so far (vLLM's option)
    continuous_usage_stats: bool = False


# The sampling fields a request may leave unset and vLLM's value for them when the model
# has no default either (vLLM's _DEFAULT_SAMPLING_PARAMS: user -> model -> neutral).
NEUTRAL_SAMPLING: dict[str, float | int] = {
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
}


class _SamplingFields(_Request):
    """Fields shared by completions and chat completions."""

    model: str | None = None  # None serves the first model, as vLLM does
    n: Int = Field(1, ge=1)  # capped by the server's --max-n (serving.Limits)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: Int | None = Field(None, ge=INT64_MIN, lt=INT64_END)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    # token id (as a string) -> bias added to its logit, clamped to [-100, 100]
    logit_bias: dict[str, float] | None = None
    user: str | None = None  # accepted and ignored
    # vLLM extras
    top_k: Int | None = Field(None, lt=INT64_END)  # the sampler holds it in an int64 tensor
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: Int = 0
    stop_token_ids: list[Int] | None = None
    include_stop_str_in_output: bool = False
    # vLLM's beam search (server/beam.py): n (completions: best_of) beams, n best returned
    use_beam_search: bool = False
    # the score's exponent; bounded so that len ** length_penalty stays a finite float
    length_penalty: float = Field(1.0, ge=-10.0, le=10.0)
    skip_special_tokens: bool = True
    return_token_ids: bool = False  # put token_ids / prompt_token_ids in the response
    # lower runs first under --scheduling-policy priority; the default policy accepts only 0
    priority: Int = Field(0, ge=INT64_MIN, lt=INT64_END)
    # vLLM's extra field: top logprobs per prompt token (plus the prompt's own token); the
    # logprobs fields are capped by --max-logprobs (request_limits.py), not by the schema
    prompt_logprobs: Int | None = Field(None, ge=0)
    allowed_token_ids: list[Int] | None = None  # only these ids may be generated
    # vLLM's per-request arguments for custom logits processors (SamplingParams.extra_args)
    vllm_xargs: dict[str, str | int | float | bool | list[str | int | float]] | None = None
    bad_words: list[str] | None = None  # words never generated
    # structured outputs (server/structured.py): OpenAI's and vLLM's spellings, one at a time
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(None, min_length=1)  # [] has nothing to choose
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None  # "auto" / "xgrammar"; others are refused
    guided_whitespace_pattern: str | None = None  # refused: xgrammar has no such option

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> _SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        if self.stream and self.prompt_logprobs:  # vLLM's rule (0 is accepted)
            raise ValueError("`prompt_logprobs` are not available when `stream=True`.")
        return self

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Usage on every chunk: ``continuous_usage_stats`` counts with include_usage only."""
        opts = self.stream_options
        return bool(opts and opts.include_usage and opts.continuous_usage_stats)

    @property
    def engine_prompt_logprobs(self) -> int | None:
        """``SamplingParams.prompt_logprobs`` for this request."""
        return self.prompt_logprobs

    def sampling_params(
        self,
        max_tokens: int | None,
        logprobs: int | None,
        defaults: Mapping[str, Any] | None = None,
    ) -> SamplingParams:
        """The engine's parameters; raises ValueError (-> 400) on out-of-range values.
        ``defaults``: the model's values (``--generation-config auto``) for the sampling
        fields this request leaves unset or null, before vLLM's neutral ones."""
        given = {name: getattr(self, name) for name in NEUTRAL_SAMPLING}
        sampling = {
            name: (defaults or {}).get(name, neutral) if given[name] is None else given[name]
            for name, neutral in NEUTRAL_SAMPLING.items()
        }
        return SamplingParams(
            n=self.n,
            **sampling,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            prompt_logprobs=self.engine_prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            logit_bias=logit_bias_ids(self.logit_bias),
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
            extra_args=self.vllm_xargs,
            structured_outputs=structured_outputs_params(self),
        )


PromptInput = str | list[str] | list[Int] | list[list[Int]]


def _examples(*examples: dict[str, Any]) -> ConfigDict:
    """Request examples for /openapi.json (no ``model``: the server's first model answers)."""
    return ConfigDict(json_schema_extra={"examples": list(examples)})


class CompletionRequest(_SamplingFields):
    model_config = _examples(
        {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0},
        {"prompt": [[1, 504, 3458], [1, 504]], "max_tokens": 4, "n": 2, "stream": True},
    )

    prompt: PromptInput
    # 0 only with echo (OpenAI's "score the prompt"): one token is computed, none returned
    max_tokens: Int | None = Field(16, ge=0)
    logprobs: Int | None = Field(None, ge=0)
    echo: bool = False
    # the beam width with use_beam_search (capped by --max-n); else only equal to n
    best_of: Int | None = Field(None, ge=1)
    suffix: str | None = None  # unsupported: rejected when set

    @property
    def engine_prompt_logprobs(self) -> int | None:
        """echo with logprobs returns the prompt's logprobs too (vLLM's rule)."""
        if self.prompt_logprobs is None and self.echo:
            return self.logprobs
        return self.prompt_logprobs


class TextPart(_Request):
    type: Literal["text"]
    text: str


class FunctionDefinition(_Request):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments (an object)
    strict: bool | None = None  # accepted; required/named calls are always grammar-bound


class ChatCompletionTool(_Request):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"] = "function"
    function: NamedFunction


class MessageFunctionCall(_Request):
    name: str
    arguments: str | dict[str, Any]  # a JSON string (OpenAI); an object is accepted too


class MessageToolCall(_Request):
    """A tool call of an earlier assistant turn, as the client sends it back."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: MessageFunctionCall


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # assistant turns that called tools
    tool_call_id: str | None = None  # tool turns: the call this result answers
    # an earlier assistant turn's thinking (vLLM's names), given to the chat template as
    # both ``reasoning`` and ``reasoning_content`` (Qwen3's template reads the latter)
    reasoning: str | None = None
    reasoning_content: str | None = None

    def thinking(self) -> str | None:
        return self.reasoning if self.reasoning is not None else self.reasoning_content

    def text(self) -> str:
        """The content as one string (text parts joined by newlines, as vLLM does)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(p.text for p in self.content)


class ChatCompletionRequest(_SamplingFields):
    model_config = _examples(
        {"messages": [{"role": "user", "content": "Say hi"}], "max_completion_tokens": 8},
    )

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Int | None = Field(None, ge=1)  # deprecated by OpenAI, still widely sent
    max_completion_tokens: Int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: Int | None = Field(None, ge=0)
    add_generation_prompt: bool = True
    # Tool calling (kvserve/server/tools.py): vLLM's defaults, "auto" when tools are given
    tools: list[ChatCompletionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True  # false: at most one call
    # The chat template (vLLM's extra fields)
    continue_final_message: bool = False  # the last message is left open for the model
    chat_template: str | None = None  # needs --trust-request-chat-template
    chat_template_kwargs: dict[str, Any] | None = None  # extra variables for the template
    documents: list[dict[str, str]] | None = None  # passed to the template (RAG templates)
    # vLLM's field: at most this many thinking tokens, then the end marker is forced (needs
    # --reasoning-parser; kvserve/structured_output/reasoning.py)
    thinking_token_budget: Int | None = Field(None, ge=0)

    @model_validator(mode="after")
    def _one_prompt_ending(self) -> ChatCompletionRequest:
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError(
                "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
            )
        return self


def _one_input_schema(schema: dict[str, Any]) -> None:
    """Exactly one of ``prompt`` / ``messages``, neither null (``_one_input``), in the
    published schema too, so that it refuses what the server refuses."""
    for name in ("prompt", "messages"):
        prop = schema["properties"][name]
        (given,) = [arm for arm in prop.pop("anyOf") if arm.get("type") != "null"]
        prop.pop("default", None)
        prop.update(given)
    schema["oneOf"] = [{"required": ["prompt"]}, {"required": ["messages"]}]
    schema["examples"] = [{"prompt": "Hello world"}]


class TokenizeRequest(_Request):
    model_config = ConfigDict(json_schema_extra=_one_input_schema)

    model: str | None = None
    prompt: str | None = None  # None: not given (an explicit null is refused)
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    # with messages, the chat template's other inputs (as /v1/chat/completions)
    tools: list[ChatCompletionTool] | None = None
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _one_input(cls, data: Any) -> Any:
        if isinstance(data, dict):
            given = [k for k in ("prompt", "messages") if k in data]
            if len(given) != 1:
                raise ValueError("send exactly one of 'prompt' or 'messages'")
            if data[given[0]] is None:
                raise ValueError(f"'{given[0]}' must not be null")
        return data


class DetokenizeRequest(_Request):
    model_config = _examples({"tokens": [19556, 905]})

    model: str | None = None
    # ids are never negative (the vocabulary's size, which bounds them above, is the model's)
    tokens: list[Annotated[Int, Field(ge=0)]]


# -- responses ----------------------------------------------------------------------------------
class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (OpenAI's field)


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class CompletionLogProbs(BaseModel):
    """OpenAI's legacy completions format."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's ``Logprob`` as JSON."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per prompt token: null for the first, then {token id: PromptLogprob} (its token, then top-k)
PromptLogprobsJSON = list[dict[int, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = Field(default=None, exclude_if=_omit_none)
    prompt_token_ids: list[int] | None = Field(default=None, exclude_if=_omit_none)
    prompt_logprobs: PromptLogprobsJSON | None = Field(default=None, exclude_if=_omit_none)


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # the arguments as a JSON object's text


def make_tool_call_id() -> str:
    """vLLM's tool call ids: ``chatcmpl-tool-<32 hex digits>``."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


class ToolCall(BaseModel):
    id: str = Field(default_factory=make_tool_call_id)
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] | None = Field(default=None, exclude_if=_omit_none)
    # --reasoning-parser: the thinking, under vLLM's name and the older one SGLang,
    # llama.cpp and DeepSeek's API still send (clients read one or the other)
    reasoning: str | None = Field(default=None, exclude_if=_omit_none)
    reasoning_content: str | None = Field(default=None, exclude_if=_omit_none)


class ChatCompletionChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = Field(default=None, exclude_if=_omit_none)


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo
    prompt_token_ids: list[int] | None = Field(default=None, exclude_if=_omit_none)
    prompt_logprobs: PromptLogprobsJSON | None = Field(default=None, exclude_if=_omit_none)


class DeltaFunctionCall(BaseModel):
    name: str | None = Field(default=None, exclude_if=_omit_none)  # in a call's first chunk
    arguments: str | None = Field(default=None, exclude_if=_omit_none)  # the next fragment


class DeltaToolCall(BaseModel):
    """A piece of a streamed tool call: ``id``, ``type`` and the name come first, then
    argument fragments that concatenate to the call's arguments."""

    index: int
    id: str | None = Field(default=None, exclude_if=_omit_none)
    type: Literal["function"] | None = Field(default=None, exclude_if=_omit_none)
    function: DeltaFunctionCall | None = Field(default=None, exclude_if=_omit_none)


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = Field(default=None, exclude_if=_omit_none)
    content: str | None = Field(default=None, exclude_if=_omit_none)
    reasoning: str | None = Field(default=None, exclude_if=_omit_none)
    reasoning_content: str | None = Field(default=None, exclude_if=_omit_none)
    tool_calls: list[DeltaToolCall] | None = Field(default=None, exclude_if=_omit_none)


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = Field(default=None, exclude_if=_omit_none)


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "kvserve"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(BaseModel):
    prompt: str
