"""Per-request sampling parameters, shaped like vLLM's ``SamplingParams``.

Validation happens in ``__post_init__`` so that bad input is rejected with a
clear ``ValueError`` before a request ever reaches the engine.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvserve.structured_output.params import StructuredOutputsParams
    from kvserve.structured_output.reasoning import ReasoningMarkers

# Below this temperature sampling is treated as greedy (argmax); vLLM uses the same cut-off.
_GREEDY_EPS = 1e-5
# vLLM clamps logit_bias values to this range, as OpenAI documents it.
LOGIT_BIAS_LIMIT = 100.0
# Seeds are int64: torch.Generator.manual_seed takes [-2**63, 2**64), and the n > 1 children
# use seed + i, which must stay inside that range.
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1

_INT_FIELDS = (
    "n", "top_k", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs", "seed",
    "thinking_token_budget",
)  # fmt: skip
# The integer fields where None means "not set"; n, top_k and min_tokens always need a value.
_OPTIONAL_INT_FIELDS = (
    "max_tokens", "logprobs", "prompt_logprobs", "seed", "thinking_token_budget"
)  # fmt: skip
_FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)


# Most completions one request may ask for. Each is a request object from the start, so an
# unbounded n was a denial of service through the Python API (n = 2**63 grew the process to
# the machine's 24 GB, found by tests/engine/test_fuzz_requests.py); the server's --max-n
# (default 128) is lower still.
MAX_N = 4096


class ParamError(ValueError):
    """A bad ``SamplingParams`` field; ``param`` names it (the server's error ``param``)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def is_int(value: object) -> bool:
    """A real integer: ``bool`` is an ``int`` subclass in Python, but ``True`` is no token id."""
    return isinstance(value, int) and not isinstance(value, bool)


def _check_types(params: SamplingParams) -> None:
    """Every field that reaches a tensor has the type the tensor needs (clear errors, early)."""
    for name in _INT_FIELDS:
        value = getattr(params, name)
        if (value is not None or name not in _OPTIONAL_INT_FIELDS) and not is_int(value):
            raise ParamError(name, f"{name} must be an integer, got {value!r}.")
    for name in _FLOAT_FIELDS:
        value = getattr(params, name)
        if not (is_int(value) or isinstance(value, float)) or not math.isfinite(value):
            raise ParamError(name, f"{name} must be a finite number, got {value!r}.")
    if params.seed is not None and not SEED_MIN <= params.seed <= SEED_MAX:
        raise ParamError("seed", f"seed must be in [-2**63, 2**63 - 1], got {params.seed}.")
    if params.seed is not None and is_int(params.n) and params.seed + params.n - 1 > SEED_MAX:
        # Completion i of n draws with seed + i: the last one must stay an int64 too.
        raise ParamError(
            "seed",
            f"seed + n - 1 must be at most 2**63 - 1 (completion i uses seed + i), "
            f"got seed {params.seed} with n {params.n}.",
        )
    ids = params.stop_token_ids
    if ids is not None and (
        not isinstance(ids, (list, tuple)) or not all(is_int(t) and t >= 0 for t in ids)
    ):
        raise ParamError(
            "stop_token_ids",
            f"stop_token_ids must be a list of non-negative integers, got {ids!r}.",
        )
    stop = params.stop
    if stop is not None and not (
        isinstance(stop, str)
        or (isinstance(stop, (list, tuple)) and all(isinstance(x, str) for x in stop))
    ):
        raise ParamError("stop", f"stop must be a string or a list of strings, got {stop!r}.")


def _check_reasoning(params: SamplingParams) -> None:
    """reasoning_markers and thinking_token_budget (``structured_output/reasoning.py``)."""
    markers = params.reasoning_markers
    if markers is not None:
        from kvserve.structured_output.reasoning import ReasoningMarkers

        if not isinstance(markers, ReasoningMarkers):
            raise ParamError("reasoning_markers", "reasoning_markers must be ReasoningMarkers.")
    budget = params.thinking_token_budget
    if budget is None:
        return
    if budget < 0:
        raise ParamError(
            "thinking_token_budget", f"thinking_token_budget must be >= 0, got {budget}."
        )
    if markers is None:
        raise ParamError(
            "thinking_token_budget",
            "thinking_token_budget needs a reasoning model's markers: serve it with "
            "--reasoning-parser (Python API: reasoning_markers) and leave thinking on.",
        )


def _check_seam_fields(params: SamplingParams) -> None:
    """logit_bias, allowed_token_ids, bad_words, logits_processors and structured_outputs."""
    bias = params.logit_bias
    if bias is not None:
        if not isinstance(bias, dict) or not all(
            is_int(k) and k >= 0 and (is_int(v) or isinstance(v, float)) and math.isfinite(v)
            for k, v in bias.items()
        ):
            raise ParamError(
                "logit_bias", "logit_bias must map non-negative token ids to finite numbers."
            )
        limit = LOGIT_BIAS_LIMIT
        params.logit_bias = {k: max(-limit, min(limit, float(v))) for k, v in bias.items()}
    allowed = params.allowed_token_ids
    if allowed is not None and (
        not isinstance(allowed, (list, tuple))
        or not allowed
        or not all(is_int(t) and t >= 0 for t in allowed)
    ):
        raise ParamError(
            "allowed_token_ids",
            "allowed_token_ids must be a non-empty list of non-negative token ids.",
        )
    words = params.bad_words
    if words is not None and (
        not isinstance(words, (list, tuple)) or not all(isinstance(w, str) and w for w in words)
    ):
        raise ParamError("bad_words", "bad_words must be a list of non-empty strings.")
    procs = params.logits_processors
    if procs is not None and (
        not isinstance(procs, (list, tuple)) or not all(callable(f) for f in procs)
    ):
        raise ParamError("logits_processors", "logits_processors must be a list of callables.")
    so = params.structured_outputs
    if so is not None:
        from kvserve.structured_output.params import StructuredOutputsParams

        if not isinstance(so, StructuredOutputsParams):
            raise ParamError(
                "structured_outputs", "structured_outputs must be a StructuredOutputsParams."
            )
        if params.ignore_eos:
            raise ParamError(
                "ignore_eos",
                "ignore_eos cannot be combined with structured_outputs: the output ends "
                "where the grammar does.",
            )


@dataclass
class SamplingParams:
    n: int = 1  # number of completions returned for the prompt
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0  # nucleus mass kept, in (0, 1]
    top_k: int = 0  # keep the k most likely tokens; 0 or -1 disables
    min_p: float = 0.0  # drop tokens below min_p * p(most likely token), in [0, 1]
    presence_penalty: float = 0.0  # OpenAI semantics, in [-2, 2]
    frequency_penalty: float = 0.0  # OpenAI semantics, in [-2, 2]
    repetition_penalty: float = 1.0  # HF/CTRL semantics over prompt+output tokens, > 0
    seed: int | None = None  # per-request generator seed; None uses the engine's generator
    stop: str | list[str] | None = None  # stop strings; the text is cut before them
    stop_token_ids: list[int] | None = None  # extra token ids that end the request
    include_stop_str_in_output: bool = False  # keep the matched stop string in the text
    ignore_eos: bool = False  # keep generating past EOS (benchmarks)
    max_tokens: int | None = 16  # None means "until the context is full"
    min_tokens: int = 0  # EOS / stop token ids are masked until this many tokens exist
    logprobs: int | None = None  # number of top logprobs per output token (plus the sampled one)
    # number of top logprobs per prompt token (plus the prompt's own token); vLLM's field
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True  # drop special tokens when detokenizing
    detokenize: bool = True  # False: token ids only, no text (vLLM's flag; saves CPU time)
    # token id -> added to its logit before sampling (OpenAI's field; clamped to [-100, 100])
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None  # only these ids may be sampled
    bad_words: list[str] | None = None  # words never generated (tokenized by the engine)
    # Per-request callables ``fn(output_ids, logits) -> logits`` or
    # ``fn(prompt_ids, output_ids, logits) -> logits`` on the row's float32 ``[V]`` logits
    # (vLLM's per-request logits processors); they run before penalties and temperature.
    logits_processors: list[Callable[..., Any]] | None = None
    structured_outputs: StructuredOutputsParams | None = None  # grammar the output must match
    extra_args: dict[str, Any] | None = None  # free-form, for custom logits processors (vLLM)
    # A reasoning model's thinking markers (the server sets them from --reasoning-parser):
    # structured_outputs then constrain only the answer after the thinking.
    reasoning_markers: ReasoningMarkers | None = None
    # vLLM's field: after this many thinking tokens the end marker is forced (needs markers)
    thinking_token_budget: int | None = None
    stop_list: list[str] = field(init=False, default_factory=list)  # normalised `stop`
    # bad_words as token id sequences, filled by the engine from its tokenizer (vLLM's field)
    bad_words_token_ids: list[list[int]] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        _check_types(self)
        if self.n < 1:
            raise ParamError("n", f"n must be at least 1, got {self.n}.")
        if self.n > MAX_N:
            raise ParamError(
                "n", f"n must be at most {MAX_N}, got {self.n}: each completion is held as its "
                "own request from the start (the server caps n further with --max-n)."
            )  # fmt: skip
        if self.temperature < 0.0:
            raise ParamError(
                "temperature", f"temperature must be non-negative, got {self.temperature}."
            )
        if not 0.0 < self.top_p <= 1.0:
            raise ParamError("top_p", f"top_p must be in (0, 1], got {self.top_p}.")
        if self.top_k == -1:
            self.top_k = 0
        if self.top_k < 0:
            raise ParamError(
                "top_k", f"top_k must be 0 or -1 (disabled) or at least 1, got {self.top_k}."
            )
        if not 0.0 <= self.min_p <= 1.0:
            raise ParamError("min_p", f"min_p must be in [0, 1], got {self.min_p}.")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ParamError(
                "presence_penalty",
                f"presence_penalty must be in [-2, 2], got {self.presence_penalty}.",
            )
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ParamError(
                "frequency_penalty",
                f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}.",
            )
        if self.repetition_penalty <= 0.0:
            raise ParamError(
                "repetition_penalty",
                f"repetition_penalty must be positive, got {self.repetition_penalty}.",
            )
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ParamError("max_tokens", f"max_tokens must be at least 1, got {self.max_tokens}.")
        if self.min_tokens < 0:
            raise ParamError(
                "min_tokens", f"min_tokens must be non-negative, got {self.min_tokens}."
            )
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ParamError(
                "min_tokens",
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens}).",
            )
        if self.logprobs is not None and self.logprobs < 0:
            raise ParamError("logprobs", f"logprobs must be non-negative, got {self.logprobs}.")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise ParamError(
                "prompt_logprobs",
                f"prompt_logprobs must be non-negative, got {self.prompt_logprobs}.",
            )
        if self.stop is None:
            self.stop_list = []
        elif isinstance(self.stop, str):
            self.stop_list = [self.stop]
        else:
            self.stop_list = list(self.stop)
        if any(not s for s in self.stop_list):
            raise ParamError("stop", "stop strings must be non-empty.")
        if self.stop_list and not self.detokenize:
            raise ParamError(
                "stop", "stop strings need detokenize=True (they are matched in text)."
            )
        self.stop_token_ids = list(self.stop_token_ids or [])
        _check_seam_fields(self)
        _check_reasoning(self)

    @property
    def greedy(self) -> bool:
        """True when the request takes the argmax token at every step."""
        return self.temperature < _GREEDY_EPS
