"""Speculative decoding: proposers of the next k tokens (n-gram lookup, a draft model).

The target verifies the proposals in its next step (``worker/model_runner.py``) with the
rejection sampler (``sample/rejection.py``); ``build_proposer`` picks the proposer from the
engine's ``SpeculativeConfig``.
"""

from kvserve.spec.proposer import ProposalInput, Proposer

__all__ = ["ProposalInput", "Proposer"]
