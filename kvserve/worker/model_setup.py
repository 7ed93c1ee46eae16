"""What a runner builds from the engine's config before its first step: the context limit,
the (draft) models, the KV cache size and the swap space.

The engine and every worker compute the same numbers from the same config (pure functions
of it and the checkpoint's config.json), so the engine's block pool and the runners' KV
tensors agree without a round trip; the runner also reports its numbers (``RunnerInfo``).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PretrainedConfig

from kvserve.config import EngineConfig, ModelConfig, PreemptionMode, SpecMethod
from kvserve.distributed.layers import check_heads
from kvserve.distributed.parallel_state import SINGLE, TPGroup, backend_for
from kvserve.model.base import CausalLM
from kvserve.model.batch_invariant import batch_invariant_refusal, make_batch_invariant
from kvserve.model.loader import check_shardable, load_hf_config, load_model, model_max_len
from kvserve.model.registry import resolve_model_class
from kvserve.quantization.apply import QuantOptions
from kvserve.quantization.compressed_tensors import checkpoint_scheme
from kvserve.spec.build import SPEC_WITH_PROCESSORS
from kvserve.worker.inputs import kv_bytes_per_block

logger = logging.getLogger("kvserve")

DEFAULT_KV_CACHE_MEMORY = 1024**3  # 1 GiB when neither a size nor a block count is given


# vLLM's switch that lets max_model_len exceed the model's own limit (honoured by that name).
ALLOW_LONG_MAX_MODEL_LEN_ENV = "VLLM_ALLOW_LONG_MAX_MODEL_LEN"


def resolve_max_model_len(mc: ModelConfig, hf_config: PretrainedConfig) -> int:
    """The context limit: ``max_model_len`` when given, else the checkpoint's own. Above the
    checkpoint's own it is refused, as vLLM does, unless VLLM_ALLOW_LONG_MAX_MODEL_LEN=1
    (positions past the trained ones: the model's output may be garbage)."""
    own = model_max_len(hf_config)
    if mc.max_model_len is None or mc.max_model_len <= own:
        return mc.max_model_len or own
    if os.environ.get(ALLOW_LONG_MAX_MODEL_LEN_ENV, "").strip().lower() in ("1", "true"):
        logger.warning(
            "max_model_len %d is above the model's %d (%s=1): positions past the trained "
            "ones may give garbage", mc.max_model_len, own, ALLOW_LONG_MAX_MODEL_LEN_ENV,
        )  # fmt: skip
        return mc.max_model_len
    raise ValueError(
        f"max_model_len {mc.max_model_len} (--max-model-len) is greater than the model's own "
        f"limit {own} (max_position_embeddings in its config.json); set "
        f"{ALLOW_LONG_MAX_MODEL_LEN_ENV}=1 to allow it anyway (the model may give garbage past "
        f"{own} tokens)"
    )


def check_tensor_parallel(config: EngineConfig) -> None:
    """Refuse, before any rank starts or loads, a model that cannot be sharded over
    ``tensor_parallel_size`` ranks, with the message the loader would give on each rank:
    the transformers backend, quantization but int8/int4 and Gemma (``check_shardable``),
    heads or MLP width not divisible by the ranks, a draft model, a device without a
    torch.distributed backend."""
    size = config.parallel.world_size
    if size == 1:
        return
    backend_for(config.device)
    spec = config.speculative
    if spec is not None and spec.method is SpecMethod.DRAFT_MODEL:
        raise ValueError(
            f"speculative method 'draft_model' does not support tensor parallelism yet "
            f"(tensor_parallel_size {size}): the draft model is not sharded; use method "
            "'ngram' or tensor_parallel_size 1"
        )
    mc = config.model
    path = Path(mc.path)
    hf = load_hf_config(path)
    quant = QuantOptions.of(mc)
    check_shardable(path, resolve_model_class(hf, mc.model_impl), checkpoint_scheme(hf),
                    quant, size)  # fmt: skip
    heads = int(hf.num_attention_heads)
    check_heads(heads, int(getattr(hf, "num_key_value_heads", None) or heads), size)
    for field in ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size"):
        inter = int(getattr(hf, field, 0) or 0)  # the MLP's, and an MoE model's experts'
        if inter % size:
            raise ValueError(f"{field} ({inter}) is not divisible by tensor_parallel_size ({size})")


def load_target(config: EngineConfig, max_model_len: int, tp: TPGroup = SINGLE) -> CausalLM:
    """The served model: with ``tp`` of several ranks, this rank's shard of it."""
    mc = config.model
    quant = QuantOptions.of(mc)
    # batch-invariant mode: no oneDNN packing (GEMMs blocked by the number of rows), but the
    # bf16 packed layout where auto picks it (vdpbf16ps, one order per row: 1.65x the widening
    # kernel at one row, 2.8x at 32, Zen 5 kind, docs/server.md); every
    # linear then sums each row in a fixed order (model/batch_invariant.py), and the C++
    # decode loop is built after that swap, so that it calls the fixed-order kernels too
    invariant = mc.batch_invariant
    model = load_model(
        mc.path, mc.dtype, torch.device(config.device), max_model_len,
        mc.prepack_weights and not invariant, mc.fused_ops, mc.model_impl, quant,
        tp if tp.world_size > 1 else None,
        decode_loop=not (mc.enforce_eager or invariant), weight_dtype=mc.weight_dtype,
        linear_kernel=mc.cpu_linear_kernel, batch_invariant=invariant,
    )  # fmt: skip
    if invariant:
        refusal = batch_invariant_refusal(model)  # type: ignore[arg-type]
        if refusal is not None:
            raise ValueError(f"batch-invariant mode (--batch-invariant): {refusal}")
        make_batch_invariant(model)  # type: ignore[arg-type]
        if mc.fused_ops and not mc.enforce_eager and model.fused_ops_enabled:  # type: ignore[attr-defined]
            model.enable_decode_loop()  # type: ignore[attr-defined]
    return model


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
        mc.fused_ops, mc.model_impl, decode_loop=not mc.enforce_eager,
        weight_dtype=mc.weight_dtype, linear_kernel=mc.cpu_linear_kernel,
    )  # fmt: skip


@dataclass(frozen=True)
class KVCacheSize:
    """The KV cache a runner allocates (per rank: a rank's share of the KV heads)."""

    num_blocks: int  # device blocks (the engine's block pool has exactly these)
    num_swap_blocks: int  # CPU swap blocks (PreemptionMode.SWAP), else 0
    bytes_per_block: int  # K and V of every layer, the draft's too


def kv_cache_size(
    config: EngineConfig, model: CausalLM, draft: CausalLM | None, kv_bytes: int | None = None
) -> KVCacheSize:
    """Blocks from ``num_kv_blocks``, else from ``kv_bytes`` (CUDA's profiled share under
    ``gpu_memory_utilization``), else from ``kv_cache_memory`` (default 1 GiB)."""
    cc, dtype = config.cache, config.model.dtype
    per_block = kv_bytes_per_block(model, cc.block_size, dtype)
    if draft is not None:  # the draft's K/V lives in the same blocks
        per_block += kv_bytes_per_block(draft, cc.block_size, dtype)
    num_blocks = cc.num_kv_blocks or max(
        1, (kv_bytes or cc.kv_cache_memory or DEFAULT_KV_CACHE_MEMORY) // per_block
    )
    swap = config.scheduler.preemption_mode is PreemptionMode.SWAP
    # More swap than twice the device cache is never useful here (a full swap space falls
    # back to recompute), and capping keeps a tiny model from a huge block list.
    num_swap = min(cc.swap_space // per_block, 2 * num_blocks) if swap else 0
    return KVCacheSize(num_blocks, num_swap, per_block)
