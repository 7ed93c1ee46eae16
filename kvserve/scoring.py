"""Score and rerank (vLLM's ``LLM.score``, ``/score``, ``/rerank``): how a model scores a
(query, document) pair, as small pure functions.

Two scorers, chosen per engine (``resolve_scorer``):

* ``COSINE``: the cosine similarity of the two texts' embeddings (each text pooled as
  ``--pooling`` says, as ``/v1/embeddings`` does); any model can do it, and it is what an
  embedding model (a bi-encoder) is for.
* ``YES_NO``: a causal-LM reranker such as Qwen3-Reranker, which reads the pair in its prompt
  template and answers "yes" or "no"; the score is P(yes) of the softmax over the last
  position's [logit(no), logit(yes)] (the model card's rule; vLLM serves the same model as a
  converted classifier with ``classifier_from_token: ["no", "yes"]``, which is the same
  number: sigmoid(logit(yes) - logit(no))). Chosen by ``--task score`` (vLLM's flag), or by
  the model's config.json carrying vLLM's ``is_original_qwen3_reranker`` or
  ``classifier_from_token`` (the hf_overrides vLLM's docs give for this model).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvserve.pooling_params import PoolingParams

# Qwen3-Reranker's prompt (its model card), with the system line the model was trained on
RERANKER_SYSTEM = (
    "Judge whether the Document meets the requirements based on the Query and the Instruct "
    'provided. Note that the answer can only be "yes" or "no".'
)
DEFAULT_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
RERANKER_PREFIX = f"<|im_start|>system\n{RERANKER_SYSTEM}<|im_end|>\n<|im_start|>user\n"
RERANKER_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
# The tokens whose logits decide, in softmax order: P(index 1) is the score
DEFAULT_CLASSIFIER_TOKENS = ("no", "yes")


class ScoreMethod(enum.Enum):
    COSINE = "cosine"  # embeddings of both texts, their cosine
    YES_NO = "yes_no"  # a causal-LM reranker's P(yes) over [no, yes]


@dataclass(frozen=True)
class Scorer:
    """How an engine scores pairs: the method and, for ``YES_NO``, the (no, yes) token ids."""

    method: ScoreMethod
    token_ids: tuple[int, int] | None = None


def resolve_scorer(task: str, hf_config: Any, tokenizer: Any) -> Scorer:
    """The engine's scorer: ``YES_NO`` with ``task == "score"`` or a reranker config (see the
    module docstring), else ``COSINE``. Raises ValueError when the reranker's tokens are not
    single tokens of the vocabulary."""
    tokens = getattr(hf_config, "classifier_from_token", None)
    reranker = task == "score" or bool(getattr(hf_config, "is_original_qwen3_reranker", False))
    if not (reranker or tokens):
        return Scorer(ScoreMethod.COSINE)
    names = tuple(tokens or DEFAULT_CLASSIFIER_TOKENS)
    if len(names) != 2:
        raise ValueError(f"classifier_from_token must name two tokens (no, yes), got {names}")
    if tokenizer is None:
        raise ValueError("--task score needs the model's tokenizer (for its yes/no tokens)")
    unk = getattr(tokenizer, "unk_token_id", None)
    ids = [tokenizer.convert_tokens_to_ids(t) for t in names]
    for name, tid in zip(names, ids, strict=True):
        if tid is None or tid == unk:
            raise ValueError(f"--task score: {name!r} is not a token of this model's vocabulary")
    return Scorer(ScoreMethod.YES_NO, (int(ids[0]), int(ids[1])))


def reranker_prompt(query: str, document: str, instruction: str | None = None) -> str:
    """The reranker's prompt for one pair. A query that already starts with the chat
    template (``<|im_start|>``, as vLLM's Qwen3-Reranker examples format it client-side,
    documents carrying the suffix) is joined to the document as it is."""
    if query.startswith("<|im_start|>"):
        return query + document
    body = f"<Instruct>: {instruction or DEFAULT_INSTRUCTION}\n<Query>: {query}\n<Document>: "
    return f"{RERANKER_PREFIX}{body}{document}{RERANKER_SUFFIX}"


def yes_no_score(logits: Sequence[float]) -> float:
    """P(yes) of softmax([logit(no), logit(yes)]): sigmoid(yes - no), computed so that it
    neither overflows nor loses the small end."""
    no, yes = float(logits[0]), float(logits[1])
    d = yes - no
    if d >= 0:
        return 1.0 / (1.0 + math.exp(-d))
    e = math.exp(d)
    return e / (1.0 + e)


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    """Cosine similarity of two vectors (0 when either is all zero)."""
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    na = math.sqrt(sum(x * x for x in a))
    nb = math.sqrt(sum(y * y for y in b))
    return dot / (na * nb) if na > 0 and nb > 0 else 0.0


def pair_up(text_1: str | Sequence[str], text_2: str | Sequence[str]) -> list[tuple[str, str]]:
    """vLLM's pairing: 1 to 1, 1 to N (the one ``text_1`` with each ``text_2``), or N to N
    (element-wise). Raises ValueError for anything else (empty lists, N to M)."""
    first = [text_1] if isinstance(text_1, str) else list(text_1)
    second = [text_2] if isinstance(text_2, str) else list(text_2)
    for name, items in (("text_1", first), ("text_2", second)):
        if not items:
            raise ValueError(f"{name} is empty; send at least one text")
        for i, t in enumerate(items):
            if not isinstance(t, str):
                raise ValueError(f"{name}[{i}] must be a string, got {type(t).__name__}")
    if len(first) == 1:
        return [(first[0], t) for t in second]
    if len(first) != len(second):
        raise ValueError(
            f"text_1 has {len(first)} texts and text_2 {len(second)}: the pairs must be 1:1, "
            "1:N or N:N"
        )
    return list(zip(first, second, strict=True))


@dataclass(frozen=True)
class ScorePlan:
    """The engine requests that score some pairs: one per distinct text (``COSINE``: each
    embedded once) or per pair (``YES_NO``), and where each pair's score comes from."""

    texts: list[str]  # each one pooling request's prompt text
    pairs: list[tuple[int, int]]  # per pair: its two texts' indices (YES_NO: both the same)
    add_special_tokens: bool  # the reranker template is a whole prompt: nothing is added
    params: PoolingParams


def plan_scores(
    scorer: Scorer, pairs: Sequence[tuple[str, str]], instruction: str | None = None
) -> ScorePlan:
    """The requests to run for ``pairs`` (``pair_up``'s)."""
    if scorer.method is ScoreMethod.YES_NO:
        texts = [reranker_prompt(q, d, instruction) for q, d in pairs]
        params = PoolingParams(normalize=False, logit_token_ids=scorer.token_ids)
        return ScorePlan(texts, [(i, i) for i in range(len(texts))], False, params)
    index: dict[str, int] = {}
    for a, b in pairs:
        index.setdefault(a, len(index))
        index.setdefault(b, len(index))
    pair_idx = [(index[a], index[b]) for a, b in pairs]
    return ScorePlan(list(index), pair_idx, True, PoolingParams(normalize=True))


def finish_scores(
    scorer: Scorer, plan: ScorePlan, vectors: Sequence[Sequence[float]]
) -> list[float]:
    """Each pair's score from its requests' pooled outputs (in ``plan.texts`` order)."""
    if scorer.method is ScoreMethod.YES_NO:
        return [yes_no_score(vectors[i]) for i, _ in plan.pairs]
    return [cosine(vectors[i], vectors[j]) for i, j in plan.pairs]
