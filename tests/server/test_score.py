"""``/score`` and ``/rerank`` through a real ``kvserve serve`` per scorer kind: a causal-LM
reranker (``--task score``, a tiny random Qwen3) scores by Qwen3-Reranker's yes/no rule and
an embedding scorer (a tiny random Llama) by the cosine of pooled vectors, both equal to
transformers' numbers; vLLM's response shapes; the limits and bad input are 400s naming the
field or flag. The reranker server is shared with the sleep tests, the embedding one is the
suite's shared server (its tiny random Llama)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from kvserve.config import auto_dtype
from kvserve.scoring import reranker_prompt
from tests.engine.score_models import cosine_reference, reranker_reference
from tests.server.conftest import SCORE_MAX_DOCS, TINY, Server

pytestmark = pytest.mark.slow

QUERY = "What is the capital of France?"
DOCS = ["Paris is the capital of France.", "Bananas are yellow.", "France borders Spain."]
TOL = 1e-4  # float32; the server's batches sum in other orders than transformers

Served = tuple[Server, PreTrainedModel, PreTrainedTokenizerBase]


@pytest.fixture(scope="module")
def reranker(reranker_server: tuple[Server, Path]) -> Served:
    srv, path = reranker_server
    return (
        srv,
        AutoModelForCausalLM.from_pretrained(path).eval(),
        AutoTokenizer.from_pretrained(path),
    )


# The shared server runs ``dtype=auto``: bfloat16 where the CPU has it natively. There the
# reference runs in bfloat16 too, and the two differ by bf16 rounding in other summation
# orders (0.0024 in a cosine of -0.0098 seen on an AVX512-BF16 EPYC against a float32
# reference).
EMBED_DTYPE = auto_dtype("cpu")
EMBED_TOL = 1e-2 if EMBED_DTYPE is torch.bfloat16 else TOL


@pytest.fixture(scope="module")
def embedder(server: Server, tiny_model_dir: Path) -> Served:
    """The suite's shared server: its tiny random Llama scores by embeddings (cosine)."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=EMBED_DTYPE).eval()
    return server, model, AutoTokenizer.from_pretrained(tiny_model_dir)


def post(srv: Server, path: str, body: dict[str, Any], key: bool = True) -> httpx.Response:
    headers = srv.headers() if key else {}
    return httpx.post(f"{srv.url}{path}", json=body, headers=headers, timeout=60)


def test_reranker_score_and_rerank(reranker: Served) -> None:
    srv, model, tok = reranker
    want = [reranker_reference(model, tok, QUERY, d) for d in DOCS]
    ntok = sum(len(tok.encode(reranker_prompt(QUERY, d), add_special_tokens=False)) for d in DOCS)
    for path in ("/score", "/v1/score"):
        r = post(srv, path, {"text_1": QUERY, "text_2": DOCS})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "list" and body["id"].startswith("score-")
        assert [d["index"] for d in body["data"]] == [0, 1, 2]
        assert all(d["object"] == "score" for d in body["data"])
        assert [d["score"] for d in body["data"]] == pytest.approx(want, abs=TOL)
        assert body["usage"] == {"prompt_tokens": ntok, "total_tokens": ntok}
    ranked = sorted(range(3), key=lambda i: -want[i])
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        r = post(srv, path, {"query": QUERY, "documents": DOCS})
        assert r.status_code == 200, r.text
        results = r.json()["results"]
        assert [x["index"] for x in results] == ranked
        assert [x["document"]["text"] for x in results] == [DOCS[i] for i in ranked]
        assert [x["relevance_score"] for x in results] == pytest.approx(
            [want[i] for i in ranked], abs=TOL
        )
        assert r.json()["usage"]["total_tokens"] == ntok
    r = post(srv, "/v1/rerank", {"query": QUERY, "documents": DOCS, "top_n": 1,
                                 "return_documents": False})  # fmt: skip
    assert r.status_code == 200, r.text
    (top,) = r.json()["results"]
    assert top["index"] == ranked[0] and "document" not in top


def test_embedding_score_is_the_cosine(embedder: Served) -> None:
    srv, model, tok = embedder
    body = {"model": TINY, "text_1": [QUERY, DOCS[0]], "text_2": [DOCS[1], DOCS[2]]}
    r = post(srv, "/v1/score", body)
    assert r.status_code == 200, r.text
    want = [cosine_reference(model, tok, QUERY, DOCS[1]),
            cosine_reference(model, tok, DOCS[0], DOCS[2])]  # fmt: skip
    assert [d["score"] for d in r.json()["data"]] == pytest.approx(want, abs=EMBED_TOL)
    ntok = sum(len(tok.encode(t)) for t in (QUERY, *DOCS))  # each text embedded once
    assert r.json()["usage"]["prompt_tokens"] == ntok


@pytest.mark.parametrize(
    ("path", "body", "param", "message"),
    [
        ("/score", {"text_1": [QUERY, QUERY], "text_2": DOCS}, "text_2", "1:1, 1:N or N:N"),
        ("/score", {"text_1": [], "text_2": DOCS}, "text_1", "text_1 is empty"),
        ("/rerank", {"query": QUERY, "documents": []}, "documents", "documents is empty"),
        ("/rerank", {"query": QUERY, "documents": ["d"] * (SCORE_MAX_DOCS + 1)}, "documents",
         "--max-prompts-per-request"),
        ("/rerank", {"query": "long " * 200, "documents": DOCS}, "documents",
         "--max-score-tokens-per-request"),
        ("/rerank", {"query": QUERY, "documents": DOCS, "top_n": -1}, "top_n", ""),
    ],
)  # fmt: skip
def test_bad_input_is_a_400(
    reranker: Served, path: str, body: dict[str, Any], param: str, message: str
) -> None:
    r = post(reranker[0], path, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert message in error["message"] and error["param"] == param, error


def test_the_key_is_needed(reranker: Served) -> None:
    for path in ("/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank"):
        assert post(reranker[0], path, {}, key=False).status_code == 401
