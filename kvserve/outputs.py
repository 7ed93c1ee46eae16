"""What the engine returns to its callers (offline ``LLM`` and the async server engine)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """One token's logprob at one position (vLLM's ``Logprob``)."""

    logprob: float  # log-softmax of the model's raw logits (float32)
    rank: int | None = None  # 1-based rank in that distribution (1 = most likely)
    decoded_token: str | None = None  # the token's text, when the request detokenizes


# One position's logprobs: token id -> Logprob. Holds the chosen token (sampled, or the prompt's
# own token) first, then the top-k (vLLM's order; a chosen token among the top-k appears once).
TokenLogprobs = dict[int, Logprob]
# Per prompt token: None for the first one (nothing predicts it), then its TokenLogprobs.
PromptLogprobs = list[TokenLogprobs | None]


@dataclass
class CompletionOutput:
    index: int  # which of the request's n completions this is
    text: str  # detokenized text so far (cumulative), stop strings cut off
    token_ids: list[int]  # generated token ids so far (cumulative)
    cumulative_logprob: float | None  # sum of sampled-token logprobs, when logprobs were asked for
    logprobs: list[TokenLogprobs] | None  # per generated token, when logprobs were asked for
    finish_reason: str | None = None  # "stop", "length", "abort", "error", or None if running
    stop_reason: int | str | None = None  # the stop string or stop token id that matched

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float  # time.monotonic() when the request was added
    first_scheduled_time: float | None = None  # first step that computed any of its tokens
    first_token_time: float | None = None  # when the first output token was sampled
    # When the latest output token was sampled (vLLM's last_token_ts): the end of the decode
    # and inference intervals (/metrics, traces), which finished_time is not for a failed one
    last_token_time: float | None = None
    finished_time: float | None = None  # when the request finished
    num_preemptions: int = 0  # how many times the request was preempted


@dataclass
class RequestOutput:
    request_id: str  # the caller's id
    prompt: str | None  # the prompt text, when the request came as text
    prompt_token_ids: list[int]  # the tokenized prompt
    outputs: list[CompletionOutput]  # n completions, ordered by index
    finished: bool  # every completion has finished
    metrics: RequestMetrics | None = None  # timing, for the server's histograms
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache (vLLM's field)
    extra: dict[str, object] = field(default_factory=dict)  # free-form info for callers
    # Why the engine failed this request (its completions end with finish reason "error");
    # None for every request that ran normally. Other requests are never affected.
    error: str | None = None
    # SamplingParams.prompt_logprobs: one entry per prompt token (the first is None); else None
    prompt_logprobs: PromptLogprobs | None = None


@dataclass
class EmbeddingOutput:
    """vLLM's ``EmbeddingOutput``: one prompt's pooled (and, by default, L2-normalised) final
    hidden state."""

    embedding: list[float]  # float32 values; empty when the engine failed on the request

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """vLLM's ``EmbeddingRequestOutput`` (``LLM.embed``, /v1/embeddings): an embedding request
    has one output, when its prefill is done, and ``finished`` is then True."""

    request_id: str  # the caller's id
    prompt_token_ids: list[int]  # the tokenized prompt (after truncate_prompt_tokens)
    outputs: EmbeddingOutput
    finished: bool = True
    prompt: str | None = None  # the prompt text, when the request came as text
    metrics: RequestMetrics | None = None  # timing, for the server's histograms
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache (last pooling only)
    error: str | None = None  # why the engine failed this request, as RequestOutput.error


# What an engine step returns per request: a generation's or an embedding's output.
EngineOutput = RequestOutput | EmbeddingRequestOutput


@dataclass
class ScoringOutput:
    """vLLM's ``ScoringOutput``: one pair's score (cosine similarity of the two texts'
    embeddings, or a reranker's P(yes); kvserve/scoring.py)."""

    score: float


@dataclass
class ScoringRequestOutput:
    """vLLM's ``ScoringRequestOutput`` (``LLM.score``): one per (text_1, text_2) pair."""

    request_id: str
    prompt_token_ids: list[int]  # the tokens the pair ran as (both texts for cosine scores)
    outputs: ScoringOutput
    finished: bool = True
