"""Embedding requests' parameters (vLLM's ``PoolingParams``) and what the runner is told.

An embedding request is a prompt-only request: it runs through the same scheduler as
generation, finishes after its prefill and never samples. The engine's ``pooling`` option
(``--pooling last|mean``) says how the hidden states become one vector; the request says
whether that vector is L2-normalised.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.config import PoolingType
from kvserve.sampling_params import ParamError, is_int


@dataclass
class PoolingParams:
    """vLLM's ``PoolingParams`` for embeddings. Raises ``ValueError`` (a ``ParamError``
    naming the field) for bad values."""

    # L2-normalise the pooled vector (vLLM's default for embedding models)
    normalize: bool = True
    # The embedding's size: only the model's hidden size is possible (no Matryoshka
    # truncation); checked by the engine, which knows the size. None: the hidden size.
    dimensions: int | None = None
    # Keep only the last k prompt tokens (vLLM's rule; -1: the model's context length).
    # Applied where the prompt is tokenized (``LLM.embed``, /v1/embeddings).
    truncate_prompt_tokens: int | None = None
    # Score requests of a causal-LM reranker (``kvserve/scoring.py``): instead of a hidden
    # state, the LM head's logits of these token ids at the last prompt position, raw
    # (``normalize`` must be False). None: an embedding.
    logit_token_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.normalize, bool):
            raise ParamError("normalize", f"normalize must be a boolean, got {self.normalize!r}")
        if self.dimensions is not None and not (is_int(self.dimensions) and self.dimensions > 0):
            raise ParamError(
                "dimensions", f"dimensions must be a positive integer, got {self.dimensions!r}"
            )
        k = self.truncate_prompt_tokens
        if k is not None and not (is_int(k) and (k == -1 or k >= 1)):
            raise ParamError(
                "truncate_prompt_tokens",
                f"truncate_prompt_tokens must be -1 or at least 1, got {k!r}",
            )
        ids = self.logit_token_ids
        if ids is not None:
            if not ids or not all(is_int(t) and t >= 0 for t in ids):
                raise ParamError(
                    "logit_token_ids", f"logit_token_ids must be token ids, got {ids!r}"
                )
            if self.normalize or self.dimensions is not None:
                raise ParamError(
                    "logit_token_ids",
                    "logit_token_ids returns raw logits: normalize must be False and "
                    "dimensions unset",
                )
            self.logit_token_ids = tuple(int(t) for t in ids)


@dataclass(frozen=True)
class PoolingSpec:
    """What the runner does with an embedding request's hidden states (``Request.pooling``):
    the engine's pooling type and the request's ``normalize``; with ``token_ids`` (a score
    request of a reranker, type LAST) the LM head's logits of those ids instead."""

    type: PoolingType
    normalize: bool = True
    token_ids: tuple[int, ...] = ()


def truncate_prompt(ids: list[int], k: int | None, max_model_len: int) -> list[int]:
    """The last ``k`` tokens of a prompt (vLLM's ``truncate_prompt_tokens``: -1 means the
    context length); the prompt itself when ``k`` is None or it is not longer."""
    if k is None:
        return ids
    keep = max_model_len if k == -1 else k
    return ids[-keep:] if len(ids) > keep else ids
