"""Beam search's contract and its pure selection rule (vLLM's ``vllm/beam_search.py`` names).

``BeamSearchParams`` is what a caller asks for, ``BeamSearchOutput`` / ``BeamSearchSequence``
what ``LLM.beam_search`` returns. ``select_candidates`` is one step of vLLM's rule: every
live beam offers its top ``2 * beam_width`` next tokens; a candidate ending in EOS (unless
``ignore_eos``) is a finished hypothesis, the best ``beam_width`` of the others by
``get_beam_search_score`` are the next beams. The engine side (forking requests that share KV
blocks) is ``kvserve/engine/beam_search.py``.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from kvserve.outputs import TokenLogprobs
from kvserve.sampling_params import ParamError


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's ``BeamSearchParams``. ``temperature`` must be 0: beams are scored by the
    model's raw log-probabilities (vLLM v1 does the same and ignores the field; kvserve
    rejects what it would not honour)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.beam_width, bool) or not isinstance(self.beam_width, int):
            raise ParamError("beam_width", f"beam_width must be an int, got {self.beam_width!r}.")
        if self.beam_width < 1:
            raise ParamError("beam_width", f"beam_width must be at least 1, got {self.beam_width}.")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            raise ParamError("max_tokens", f"max_tokens must be an int, got {self.max_tokens!r}.")
        if self.max_tokens < 1:
            raise ParamError("max_tokens", f"max_tokens must be at least 1, got {self.max_tokens}.")
        if not -10.0 <= self.length_penalty <= 10.0:
            # len ** length_penalty must stay a finite, non-zero float
            raise ParamError(
                "length_penalty",
                f"length_penalty must be in [-10, 10], got {self.length_penalty}.",
            )
        if self.temperature != 0.0:
            raise ParamError(
                "temperature",
                "beam search scores beams by the model's raw log-probabilities; temperature "
                f"must be 0, got {self.temperature}.",
            )


@dataclass
class BeamSearchSequence:
    """One hypothesis: ``tokens`` are the prompt's then the generated ones (vLLM's shape);
    ``logprobs`` has one dict per generated token (that step's top candidates)."""

    tokens: list[int]
    logprobs: list[TokenLogprobs]
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """The best ``beam_width`` hypotheses of one prompt, best first."""

    sequences: list[BeamSearchSequence] = field(default_factory=list)


def get_beam_search_score(
    tokens: Sequence[int],
    cumulative_logprob: float,
    eos_token_ids: Collection[int],
    length_penalty: float = 1.0,
) -> float:
    """vLLM's (and transformers') score: ``cum_logprob / len ** length_penalty``, where the
    length counts the prompt and does not count a final EOS."""
    seq_len = len(tokens)
    if tokens and tokens[-1] in eos_token_ids:
        seq_len -= 1
    return cumulative_logprob / (seq_len**length_penalty)


@dataclass(frozen=True)
class Candidate:
    """A live beam (``parent``: its index) extended by ``token_id``."""

    parent: int
    token_id: int
    cum_logprob: float
    num_tokens: int  # prompt + output, this token included


def select_candidates(
    num_tokens: Sequence[int],
    cum_logprobs: Sequence[float],
    top_logprobs: Sequence[dict[int, float]],
    beam_width: int,
    length_penalty: float,
    eos_token_ids: Collection[int],
    ignore_eos: bool,
) -> tuple[list[Candidate], list[Candidate]]:
    """One step for the live beams (each's token count, cumulative logprob and next-token
    top logprobs): (the next beams, best first, at most ``beam_width``; the candidates that
    ended with EOS). Ties keep beam order then candidate order (a stable sort, as vLLM's)."""
    kept: list[Candidate] = []
    ended: list[Candidate] = []
    for i, top in enumerate(top_logprobs):
        for token, lp in top.items():
            c = Candidate(i, token, cum_logprobs[i] + lp, num_tokens[i] + 1)
            (ended if token in eos_token_ids and not ignore_eos else kept).append(c)

    def score(c: Candidate) -> float:
        # the length with EOS dropped (get_beam_search_score): kept ones never end in EOS
        n = c.num_tokens - (1 if c.token_id in eos_token_ids else 0)
        return c.cum_logprob / (n**length_penalty)

    kept.sort(key=score, reverse=True)
    return kept[:beam_width], ended


def best_sequences(
    sequences: list[BeamSearchSequence],
    beam_width: int,
    length_penalty: float,
    eos_token_ids: Collection[int],
) -> list[BeamSearchSequence]:
    """The ``beam_width`` best finished hypotheses by score, best first (stable)."""

    def score(s: BeamSearchSequence) -> float:
        return get_beam_search_score(s.tokens, s.cum_logprob, eos_token_ids, length_penalty)

    return sorted(sequences, key=score, reverse=True)[:beam_width]
