"""n-gram (prompt lookup) proposals: the tokens that followed the latest earlier occurrence of
the request's last n tokens, trying n from ``prompt_lookup_max`` down to ``prompt_lookup_min``
(vLLM's ``ngram`` method). Free to compute, and right whenever the output copies its input:
edits, rewrites, code changes, quoting."""

from __future__ import annotations

import numpy as np

from kvserve.spec.proposer import ProposalInput, Proposer


def ngram_propose(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """Up to ``k`` tokens following the latest earlier match of the longest suffix of
    ``tokens`` (int64 ``[L]``) of length ``max_n`` down to ``min_n``; [] when none matches."""
    length = tokens.shape[0]
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n :]
        # Windows that start before the suffix itself and have a token after them.
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: length - 1], n)  # [L-n, n]
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n  # the latest occurrence: the most recent context
            return tokens[start : start + k].tolist()
    return []


class NgramProposer(Proposer):
    def __init__(self, num_speculative_tokens: int, min_n: int, max_n: int) -> None:
        self.num_speculative_tokens = num_speculative_tokens
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, batch: list[ProposalInput]) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for item in batch:
            k = min(self.num_speculative_tokens, item.max_tokens)
            tokens = np.asarray(item.token_ids, dtype=np.int64)
            proposal = ngram_propose(tokens, self.min_n, self.max_n, k)
            if proposal:
                out[item.request_id] = proposal
        return out
