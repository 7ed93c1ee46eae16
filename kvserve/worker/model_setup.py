"""What a runner builds from the engine's config before its first step: the context limit,
the (draft) models, the KV cache size and the swap space.

The engine and every worker compute the same numbers from the same config (pure functions
of it and the checkpoint's config.json), so the engine's block pool and the runners' KV
tensors agree without a round trip; the runner also reports its numbers (``RunnerInfo``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PretrainedConfig

from kvserve.config import EngineConfig, ModelConfig, PreemptionMode, SpecMethod
from kvserve.model.base import CausalLM
from kvserve.model.loader import load_hf_config, load_model, model_max_len
from kvserve.quantization.apply import QuantOptions
from kvserve.spec.build import SPEC_WITH_PROCESSORS
from kvserve.worker.inputs import kv_bytes_per_block

DEFAULT_KV_CACHE_MEMORY = 1024**3  # 1 GiB when neither a size nor a block count is given


def resolve_max_model_len(mc: ModelConfig, hf_config: PretrainedConfig) -> int:
    """The context limit: ``max_model_len`` when given, never past the checkpoint's own."""
    own = model_max_len(hf_config)
    return min(mc.max_model_len or own, own)


def load_target(
    config: EngineConfig, max_model_len: int, rank: int = 0, world_size: int = 1
) -> CausalLM:
    """The served model. ``rank``/``world_size``: this process's share of a tensor-parallel
    model. The seam for the tensor-parallel loader (issue 17, part 2): until it shards the
    weights here, every rank loads and runs the whole model and rank 0's tokens are used."""
    del rank, world_size  # replicated for now
    mc = config.model
    quant = QuantOptions(mc.quantization, mc.quantization_group_size, mc.gguf_file)
    return load_model(
        mc.path, mc.dtype, torch.device(config.device), max_model_len, mc.prepack_weights,
        mc.fused_ops, mc.model_impl, quant,
    )  # fmt: skip


def load_draft(
    config: EngineConfig, target_hf: PretrainedConfig, max_model_len: int
) -> CausalLM | None:
    """The draft model of ``speculative_config`` method draft_model, else None."""
    spec = config.speculative
    if spec is None or spec.method is not SpecMethod.DRAFT_MODEL:
        return None
    mc = config.model
    if mc.logits_processors:
        raise ValueError(SPEC_WITH_PROCESSORS)
    assert spec.model is not None  # checked by SpeculativeConfig
    draft_path = Path(spec.model)
    draft_config = load_hf_config(draft_path)
    if int(draft_config.vocab_size) != int(target_hf.vocab_size):
        raise ValueError(
            f"the draft model {spec.model} has a vocabulary of {draft_config.vocab_size} "
            f"tokens, the target {target_hf.vocab_size}: a draft must share the "
            "target's tokenizer"
        )
    return load_model(
        draft_path, mc.dtype, torch.device(config.device), max_model_len, mc.prepack_weights,
        mc.fused_ops, mc.model_impl,
    )  # fmt: skip


@dataclass(frozen=True)
class KVCacheSize:
    """The KV cache a runner allocates (per rank: a rank's share of the KV heads)."""

    num_blocks: int  # device blocks (the engine's block pool has exactly these)
    num_swap_blocks: int  # CPU swap blocks (PreemptionMode.SWAP), else 0
    bytes_per_block: int  # K and V of every layer, the draft's too


def kv_cache_size(config: EngineConfig, model: CausalLM, draft: CausalLM | None) -> KVCacheSize:
    """Blocks from ``num_kv_blocks``, else from ``kv_cache_memory`` (default 1 GiB)."""
    cc, dtype = config.cache, config.model.dtype
    per_block = kv_bytes_per_block(model, cc.block_size, dtype)
    if draft is not None:  # the draft's K/V lives in the same blocks
        per_block += kv_bytes_per_block(draft, cc.block_size, dtype)
    num_blocks = cc.num_kv_blocks or max(
        1, (cc.kv_cache_memory or DEFAULT_KV_CACHE_MEMORY) // per_block
    )
    swap = config.scheduler.preemption_mode is PreemptionMode.SWAP
    # More swap than twice the device cache is never useful here (a full swap space falls
    # back to recompute), and capping keeps a tiny model from a huge block list.
    num_swap = min(cc.swap_space // per_block, 2 * num_blocks) if swap else 0
    return KVCacheSize(num_blocks, num_swap, per_block)
