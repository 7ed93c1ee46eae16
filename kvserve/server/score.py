"""``POST /score``, ``/v1/score`` (vLLM's) and ``/rerank``, ``/v1/rerank``, ``/v2/rerank``
(vLLM's Jina/Cohere-shaped rerank API) over ``kvserve/scoring.py``.

A score request becomes pooling requests in the one request pipeline (``start_streams``):
one per distinct text for an embedding scorer (cosine), one per pair for a causal-LM
reranker (its yes/no template). Limits: at most ``--max-prompts-per-request`` pairs
(documents) and ``--max-score-tokens-per-request`` prompt tokens in all, each a 400 naming
its flag; every prompt also fits the model's context (the engine's check, a 400).
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Literal

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel, Field

from kvserve.engine.async_engine import AsyncLLMEngine
from kvserve.outputs import EmbeddingRequestOutput
from kvserve.scoring import finish_scores, pair_up, plan_scores
from kvserve.server.errors import bad_request
from kvserve.server.openapi import error_responses
from kvserve.server.protocol import INT64_END, INT64_MIN, Int, _examples, _Request
from kvserve.server.serving import (
    Limits,
    PromptInfo,
    final_outputs,
    is_batch_line,
    new_id,
    run_watching_disconnect,
    start_streams,
    tokenize,
)

if TYPE_CHECKING:
    from kvserve.server.app import ServerState


class _ScoreOptions(_Request):
    model: str | None = None  # None: the first model, as vLLM does
    # vLLM's extras: keep each prompt's last k tokens (-1: the context); the priority policy's
    # value; Qwen3-Reranker's instruction (its template's default otherwise)
    truncate_prompt_tokens: Int | None = None
    priority: Int = Field(0, ge=INT64_MIN, lt=INT64_END)
    instruction: str | None = None


class ScoreRequest(_ScoreOptions):
    """vLLM's score request: pairs 1:1, 1:N or N:N."""

    model_config = _examples(
        {"text_1": "What is the capital of France?", "text_2": ["Paris.", "Bananas."]},
    )

    text_1: str | list[str]
    text_2: str | list[str]


class ScoreData(BaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreUsage(BaseModel):
    prompt_tokens: int = 0
    total_tokens: int = 0


class ScoreResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[ScoreData]
    usage: ScoreUsage


class RerankRequest(_ScoreOptions):
    """vLLM's rerank request (Jina's and Cohere's shape)."""

    model_config = _examples(
        {"query": "What is the capital of France?", "documents": ["Paris.", "Bananas."],
         "top_n": 1},
    )  # fmt: skip

    query: str
    documents: list[str]
    top_n: Int | None = Field(None, ge=0)  # None or 0: every document (vLLM's rule)
    return_documents: bool = True  # Cohere's field; vLLM always returns them


class RerankDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int  # the document's position in the request
    document: RerankDocument | None = None
    relevance_score: float


class RerankUsage(BaseModel):
    prompt_tokens: int = 0
    total_tokens: int = 0


class RerankResponse(BaseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]


async def run_scores(
    engine: AsyncLLMEngine,
    pairs: list[tuple[str, str]],
    opts: _ScoreOptions,
    limits: Limits,
    raw: Request,
) -> tuple[list[float], int]:
    """The pairs' scores and the prompt tokens they took."""
    if len(pairs) > limits.max_prompts_per_request:
        raise bad_request(
            f"the request has {len(pairs)} pairs (documents), above this server's limit of "
            f"{limits.max_prompts_per_request} (--max-prompts-per-request)",
            "documents",
        )
    plan = plan_scores(engine.scorer, pairs, opts.instruction)
    params = plan.params
    if opts.truncate_prompt_tokens is not None:
        try:
            params = dataclasses.replace(params, truncate_prompt_tokens=opts.truncate_prompt_tokens)
        except ValueError as e:
            raise bad_request(str(e), "truncate_prompt_tokens") from e
    prompts, total = [], 0
    cap = limits.max_score_tokens_per_request
    for text in plan.texts:
        ids = await tokenize(engine, text, plan.add_special_tokens)
        total += len(ids)
        if total > cap:  # checked as we go: an oversized request stops tokenizing here
            raise bad_request(
                f"the request's prompts have more than {cap} tokens in all, this server's "
                "limit (--max-score-tokens-per-request)",
                "documents",
            )
        prompts.append(PromptInfo(text, ids))
    streams = start_streams(
        engine, prompts, params, new_id("score"), opts.priority, is_batch_line(raw)
    )
    outputs = await run_watching_disconnect(raw, final_outputs(streams))
    vectors = []
    for out in outputs:
        assert isinstance(out, EmbeddingRequestOutput)  # pooling requests yield only these
        vectors.append(out.outputs.embedding)
    tokens = sum(len(o.prompt_token_ids) for o in outputs)  # after truncate_prompt_tokens
    return finish_scores(engine.scorer, plan, vectors), tokens


def _pairs(text_1: str | list[str], text_2: str | list[str]) -> list[tuple[str, str]]:
    try:
        return pair_up(text_1, text_2)
    except ValueError as e:
        first = str(e).startswith(("text_1 is", "text_1["))  # else text_2's, or the lengths
        param = "text_1" if first else "text_2"
        raise bad_request(str(e), param) from e


async def create_score(
    req: ScoreRequest, raw: Request, engine: AsyncLLMEngine, limits: Limits
) -> Response:
    scores, tokens = await run_scores(engine, _pairs(req.text_1, req.text_2), req, limits, raw)
    body = ScoreResponse(
        id=new_id("score"),
        model=engine.model_name,
        data=[ScoreData(index=i, score=s) for i, s in enumerate(scores)],
        usage=ScoreUsage(prompt_tokens=tokens, total_tokens=tokens),
    )
    return Response(body.model_dump_json(), media_type="application/json")


async def create_rerank(
    req: RerankRequest, raw: Request, engine: AsyncLLMEngine, limits: Limits
) -> Response:
    if not req.documents:
        raise bad_request("documents is empty; send at least one document", "documents")
    pairs = [(req.query, d) for d in req.documents]
    scores, tokens = await run_scores(engine, pairs, req, limits, raw)
    order = sorted(range(len(scores)), key=lambda i: -scores[i])  # stable: ties keep order
    if req.top_n:
        order = order[: req.top_n]
    results = [
        RerankResult(
            index=i,
            document=RerankDocument(text=req.documents[i]) if req.return_documents else None,
            relevance_score=scores[i],
        )
        for i in order
    ]
    body = RerankResponse(
        id=new_id("rerank"),
        model=engine.model_name,
        usage=RerankUsage(prompt_tokens=tokens, total_tokens=tokens),
        results=results,
    )
    return Response(body.model_dump_json(exclude_none=True), media_type="application/json")


def add_score_routes(app: FastAPI, state: ServerState) -> None:
    """The score and rerank routes on ``state``'s engines."""
    errors = error_responses(400, 404, 413, 429, 500, 503)

    async def score(req: ScoreRequest, raw: Request) -> Response:
        engine = state.engine_for(req.model)
        return await create_score(req, raw, engine, state.limits)

    async def rerank(req: RerankRequest, raw: Request) -> Response:
        engine = state.engine_for(req.model)
        return await create_rerank(req, raw, engine, state.limits)

    # The aliases share the handler and stay out of /openapi.json (each published route is
    # fuzzed by tests/server/test_schemathesis.py: ~150 requests a route).
    for path, published in (("/v1/score", True), ("/score", False)):
        app.post(path, responses={200: {"model": ScoreResponse}, **errors},
                 include_in_schema=published)(score)  # fmt: skip
    for path, published in (("/v1/rerank", True), ("/rerank", False), ("/v2/rerank", False)):
        app.post(path, responses={200: {"model": RerankResponse}, **errors},
                 include_in_schema=published)(rerank)  # fmt: skip
