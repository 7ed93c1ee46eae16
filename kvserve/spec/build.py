"""Builds the proposer that ``SpeculativeConfig`` names, for the runner."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvserve.config import EngineConfig, SpecMethod
from kvserve.spec.ngram import NgramProposer
from kvserve.spec.proposer import Proposer

if TYPE_CHECKING:
    from kvserve.model.base import CausalLM
    from kvserve.worker.model_runner import ModelRunner

# vLLM's rule too: custom batch-level processors keep per-row state that k + 1 rows per
# request would break.
SPEC_WITH_PROCESSORS = (
    "speculative decoding does not support custom logits processors (--logits-processors): "
    "give one or the other"
)


def build_proposer(
    config: EngineConfig,
    draft: CausalLM | None,
    num_blocks: int,
    runner: ModelRunner,
) -> Proposer | None:
    """The proposer of ``config.speculative`` (None without speculation)."""
    spec = config.speculative
    if spec is None:
        return None
    if config.model.logits_processors:
        raise ValueError(SPEC_WITH_PROCESSORS)
    if spec.method is SpecMethod.NGRAM:
        return NgramProposer(
            spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max
        )
    from kvserve.attention.selector import select_for_model
    from kvserve.spec.draft_model import DraftModelProposer

    assert draft is not None  # the engine loads it for SpecMethod.DRAFT_MODEL
    mc = config.model
    # The draft's own backend, chosen for its head size (the same choice as the target's).
    backend = select_for_model(mc.attention_backend, draft.config, draft.head_dim,
                               runner.device, mc.dtype)  # fmt: skip
    return DraftModelProposer(
        draft,
        spec.num_speculative_tokens,
        num_blocks,
        config.cache.block_size,
        config.model.dtype,
        runner.device,
        backend,
    )
