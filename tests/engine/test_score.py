"""``LLM.score``: a causal-LM reranker's score equals Qwen3-Reranker's yes/no rule computed
with transformers, an embedding scorer's the cosine of transformers' pooled vectors; vLLM's
1:1, 1:N and N:N pairing; bad input raises before anything runs."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from transformers import AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from kvserve import LLM
from kvserve.scoring import ScoreMethod
from tests.engine.score_models import cosine_reference, make_model, reranker_reference

QUERY = "What is the capital of France?"
DOCS = ["Paris is the capital of France.", "Bananas are yellow.", "France borders Spain."]
TOL = 1e-5  # float32 both sides; kernels sum in different orders


Loaded = tuple[LLM, PreTrainedModel, PreTrainedTokenizerBase]


def _load(arch: str, tmp: Path, builtin: Path, **kw: object) -> Iterator[Loaded]:
    model = make_model(arch, tmp, builtin)
    llm = LLM(str(tmp), dtype="float32", num_kv_blocks=64, **kw)  # type: ignore[arg-type]
    yield llm, model, AutoTokenizer.from_pretrained(tmp)
    llm.engine.close()


@pytest.fixture(scope="module")
def reranker(tmp_path_factory: pytest.TempPathFactory, builtin_model_dir: Path) -> Iterator[Loaded]:
    yield from _load("qwen3", tmp_path_factory.mktemp("rr"), builtin_model_dir, task="score")


@pytest.fixture(scope="module")
def embedder(tmp_path_factory: pytest.TempPathFactory, builtin_model_dir: Path) -> Iterator[Loaded]:
    yield from _load("llama", tmp_path_factory.mktemp("emb"), builtin_model_dir)


def test_reranker_score_is_the_yes_no_logit_rule(reranker: Loaded) -> None:
    llm, model, tok = reranker
    assert llm.engine.scorer.method is ScoreMethod.YES_NO
    outs = llm.score(QUERY, DOCS, use_tqdm=False)  # 1 to N
    want = [reranker_reference(model, tok, QUERY, d) for d in DOCS]
    assert [o.outputs.score for o in outs] == pytest.approx(want, abs=TOL)
    assert all(0.0 < o.outputs.score < 1.0 for o in outs)
    # N to N, and 1 to 1: the same pairs give the same scores
    pairs = llm.score([QUERY, DOCS[0]], [DOCS[1], DOCS[2]], use_tqdm=False)
    want2 = [reranker_reference(model, tok, QUERY, DOCS[1]),
             reranker_reference(model, tok, DOCS[0], DOCS[2])]  # fmt: skip
    assert [o.outputs.score for o in pairs] == pytest.approx(want2, abs=TOL)
    (one,) = llm.score(QUERY, DOCS[2], use_tqdm=False)
    assert one.outputs.score == pytest.approx(want[2], abs=TOL)
    stats = llm.stats()
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]  # nothing leaks
    assert stats["num_generation_tokens"] == 0  # a score never samples


def test_embedding_score_is_the_cosine_of_pooled_vectors(embedder: Loaded) -> None:
    llm, model, tok = embedder
    assert llm.engine.scorer.method is ScoreMethod.COSINE
    outs = llm.score(QUERY, DOCS, use_tqdm=False)
    want = [cosine_reference(model, tok, QUERY, d) for d in DOCS]
    assert [o.outputs.score for o in outs] == pytest.approx(want, abs=TOL)
    assert outs[0].prompt_token_ids == tok.encode(QUERY) + tok.encode(DOCS[0])


@pytest.mark.parametrize(
    ("text_1", "text_2", "message"),
    [
        ([QUERY, QUERY], DOCS, "1:1, 1:N or N:N"),
        ([], DOCS, "text_1 is empty"),
        (QUERY, [], "text_2 is empty"),
        (QUERY, [DOCS[0], 3], r"text_2\[1\] must be a string"),
    ],
)
def test_bad_pairs_raise(embedder: Loaded, text_1: object, text_2: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        embedder[0].score(text_1, text_2, use_tqdm=False)  # type: ignore[arg-type]
