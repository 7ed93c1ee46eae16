"""The proposer interface: given each request's tokens, propose the tokens that follow.

n-gram lookup (``ngram.py``) and a draft model (``draft_model.py``) implement it; Medusa or
EAGLE heads would too (they need trained heads on the target's hidden states, which no model
here has, so none is built: ``propose`` would take the target's last hidden states as well).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass
class ProposalInput:
    """One request to propose for, as plain data."""

    request_id: str
    token_ids: list[int]  # prompt + output, including the tokens this step accepted
    block_table: list[int]  # its KV block ids (a draft model keeps its own K/V in them)
    max_tokens: int  # propose at most this many (its room before max_tokens)


class Proposer(ABC):
    """Proposes up to k tokens per request; deterministic proposals (the rejection sampler
    treats each as a one-hot proposal distribution)."""

    num_speculative_tokens: int  # k

    @abstractmethod
    def propose(self, batch: list[ProposalInput]) -> dict[str, list[int]]:
        """request id -> up to ``min(k, max_tokens)`` proposed tokens (absent or empty:
        nothing to propose for it)."""

    def forget(self, finished: Iterable[str], preempted: Iterable[str]) -> None:  # noqa: B027
        """Drop per-request state of finished requests; preempted requests' K/V is gone."""
