"""n-gram (prompt lookup) proposals: exact tokens for exact matches."""

from __future__ import annotations

import numpy as np

from kvserve.spec.ngram import NgramProposer, ngram_propose
from kvserve.spec.proposer import ProposalInput


def arr(tokens: list[int]) -> np.ndarray:
    return np.asarray(tokens, dtype=np.int64)


def test_longest_suffix_wins_and_latest_occurrence() -> None:
    # suffix [5, 6, 7] occurs at 1 (followed by 8, 9) ; [6, 7] alone also at 10 (-> 3)
    tokens = [4, 5, 6, 7, 8, 9, 2, 2, 2, 2, 6, 7, 3, 0, 5, 6, 7]
    assert ngram_propose(arr(tokens), 1, 3, 2) == [8, 9]
    assert ngram_propose(arr(tokens), 1, 2, 2) == [3, 0]  # [6, 7]: its latest occurrence
    assert ngram_propose(arr(tokens), 1, 3, 10) == [8, 9, 2, 2, 2, 2, 6, 7, 3, 0]


def test_min_n_and_no_match() -> None:
    tokens = [1, 2, 3, 4, 9, 8, 7, 4]
    assert ngram_propose(arr(tokens), 1, 3, 3) == [9, 8, 7]  # only the 1-gram [4] matches
    assert ngram_propose(arr(tokens), 2, 3, 3) == []
    assert ngram_propose(arr([5]), 1, 3, 3) == []
    assert ngram_propose(arr([5, 5]), 1, 3, 3) == [5]  # up to the end of the tokens


def test_proposer_caps_by_room_and_skips_empty() -> None:
    p = NgramProposer(num_speculative_tokens=4, min_n=1, max_n=2)
    batch = [
        ProposalInput("a", [1, 2, 3, 4, 5, 6, 1, 2], [0], max_tokens=2),
        ProposalInput("b", [1, 2, 3], [1], max_tokens=4),
        ProposalInput("c", [7, 8, 9, 7, 8], [2], max_tokens=9),
    ]
    assert p.propose(batch) == {"a": [3, 4], "c": [9, 7, 8]}
