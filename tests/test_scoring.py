"""``kvserve/scoring.py``'s pure rules: vLLM's pairing, Qwen3-Reranker's template and yes/no
score (against torch's softmax), the cosine, the scorer a config chooses, and the plans."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from kvserve.scoring import (
    RERANKER_PREFIX,
    RERANKER_SUFFIX,
    ScoreMethod,
    Scorer,
    cosine,
    finish_scores,
    pair_up,
    plan_scores,
    reranker_prompt,
    resolve_scorer,
    yes_no_score,
)

VOCAB = {"no": 7, "yes": 9, "No": 11, "Yes": 12}


class Tok:
    """The tokenizer's two members resolve_scorer reads (0: the unknown token)."""

    unk_token_id = 0

    def convert_tokens_to_ids(self, token: str) -> int:
        return VOCAB.get(token, 0)


def test_pairing_follows_vllm() -> None:
    assert pair_up("q", "d") == [("q", "d")]
    assert pair_up("q", ["a", "b"]) == [("q", "a"), ("q", "b")]
    assert pair_up(["q"], ["a", "b"]) == [("q", "a"), ("q", "b")]
    assert pair_up(["x", "y"], ["a", "b"]) == [("x", "a"), ("y", "b")]
    with pytest.raises(ValueError, match=r"1:1, 1:N or N:N"):
        pair_up(["x", "y"], ["a", "b", "c"])


@pytest.mark.parametrize("logits", [(0.0, 0.0), (1.5, -2.0), (-3.0, 4.0), (800.0, -800.0)])
def test_yes_no_score_is_the_softmax_of_no_yes(logits: tuple[float, float]) -> None:
    want = float(torch.softmax(torch.tensor(logits, dtype=torch.float64), dim=0)[1])
    assert yes_no_score(logits) == pytest.approx(want, rel=1e-12, abs=1e-300)


def test_cosine() -> None:
    a, b = [1.0, 2.0, -0.5], [0.3, -1.0, 2.0]
    want = float(F.cosine_similarity(torch.tensor(a), torch.tensor(b), dim=0))
    assert cosine(a, b) == pytest.approx(want, abs=1e-6)
    assert cosine([0.0, 0.0], [1.0, 2.0]) == 0.0


def test_reranker_template() -> None:
    text = reranker_prompt("q?", "doc.")
    assert text.startswith(RERANKER_PREFIX) and text.endswith(RERANKER_SUFFIX)
    assert 'the answer can only be "yes" or "no".<|im_end|>' in text
    body = text[len(RERANKER_PREFIX) : -len(RERANKER_SUFFIX)]
    assert body == (
        "<Instruct>: Given a web search query, retrieve relevant passages that answer the "
        "query\n<Query>: q?\n<Document>: doc."
    )
    assert "<Instruct>: find\n" in reranker_prompt("q", "d", instruction="find")
    formatted = RERANKER_PREFIX + "<Instruct>: i\n<Query>: q\n"
    assert reranker_prompt(formatted, "<Document>: d" + RERANKER_SUFFIX) == (
        formatted + "<Document>: d" + RERANKER_SUFFIX
    )  # vLLM's client-side formatting is kept as it is


def test_the_config_chooses_the_scorer() -> None:
    plain = SimpleNamespace()
    assert resolve_scorer("auto", plain, Tok()) == Scorer(ScoreMethod.COSINE)
    assert resolve_scorer("score", plain, Tok()) == Scorer(ScoreMethod.YES_NO, (7, 9))
    flagged = SimpleNamespace(is_original_qwen3_reranker=True)
    assert resolve_scorer("auto", flagged, Tok()).token_ids == (7, 9)
    tokens = SimpleNamespace(classifier_from_token=["No", "Yes"])
    assert resolve_scorer("auto", tokens, Tok()).token_ids == (11, 12)
    with pytest.raises(ValueError, match="'maybe' is not a token"):
        resolve_scorer("auto", SimpleNamespace(classifier_from_token=["no", "maybe"]), Tok())


def test_plans() -> None:
    cos = Scorer(ScoreMethod.COSINE)
    plan = plan_scores(cos, [("q", "a"), ("q", "b"), ("a", "b")])
    assert plan.texts == ["q", "a", "b"]  # each text embedded once
    assert plan.pairs == [(0, 1), (0, 2), (1, 2)] and plan.params.normalize
    vecs = [[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]
    assert finish_scores(cos, plan, vecs) == pytest.approx([0.0, 2**-0.5, 2**-0.5])
    rr = Scorer(ScoreMethod.YES_NO, (7, 9))
    plan = plan_scores(rr, [("q", "a"), ("q", "b")])
    assert plan.texts == [reranker_prompt("q", "a"), reranker_prompt("q", "b")]
    assert plan.params.logit_token_ids == (7, 9) and not plan.params.normalize
    assert not plan.add_special_tokens
    assert finish_scores(rr, plan, [[0.0, 0.0], [0.0, 2.0]]) == pytest.approx(
        [0.5, 1 / (1 + 2.718281828459045**-2)]
    )
