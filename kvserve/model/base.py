"""What the runner, the engine, the draft proposer and pooling use of a model.

Two kinds of model satisfy it: kvserve's native classes (``llama.py``) and the transformers
backend's wrapper (``transformers_backend.py``). Code outside ``kvserve/model`` names this
protocol, never a concrete class, so a new architecture changes nothing there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch
from transformers import PretrainedConfig

from kvserve.attention.backend import AttentionBackend
from kvserve.attention.paged import AttentionMetadata
from kvserve.lora.punica import LoRAMapping

if TYPE_CHECKING:
    from kvserve.worker.step_interrupt import StepInterrupt

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]  # per layer (K, V) [blocks, Hkv, bs, D]


@dataclass(frozen=True)
class ForwardBatch:
    """Everything one forward of a step reads, passed as the model's one argument (vLLM's
    forward context, but an argument: never a global). Built by its caller (the runner, the
    draft proposer, the warm-up) and read by every layer; nothing in it outlives the step.

    The fields are fixed (frozen); the metadata's own per-step caches (masks per window) are
    filled by the first layer that needs them and read by the rest.
    """

    input_ids: torch.Tensor  # [T] int64, the step's tokens, rows after each other
    positions: torch.Tensor  # [T] int64, each token's position in its request
    kv_caches: KVCaches  # per layer (K, V) [num_blocks, Hkv, block_size, D]
    attn_metadata: AttentionMetadata  # the rows, slots and block tables (built by the backend)
    attn_backend: AttentionBackend  # what every attention layer calls (attention/selector.py)
    # Multi-LoRA: each token row's adapter slot, grouped by slot (kvserve/lora/punica.py),
    # read by the adapted linears; None: every row runs the base model.
    lora: LoRAMapping | None = None
    # An interruptible step (worker/step_interrupt.py): the layer loops call its check()
    # between layers and the step is given up once an online request waits and no online
    # row in it is still wanted; None: run on.
    interrupt: StepInterrupt | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


@runtime_checkable
class CausalLM(Protocol):
    """A decoder over a flat token batch with a paged KV cache (one (K, V) pair per layer)."""

    config: PretrainedConfig  # the checkpoint's Hugging Face config

    @property
    def head_dim(self) -> int:
        """Size of one K/V head vector (the KV cache's last dimension)."""
        ...

    @property
    def num_kv_heads(self) -> int:
        """K/V heads per layer (the KV cache's second dimension): this rank's share of them
        under tensor parallelism."""
        ...

    @property
    def num_layers(self) -> int:
        """Layers holding K/V: one (K, V) pair each in ``kv_caches``."""
        ...

    @property
    def fused_ops_enabled(self) -> bool:
        """Whether the C++ fused ops run (the engine logs it)."""
        ...

    def __call__(self, batch: ForwardBatch) -> torch.Tensor:
        """Writes this step's K/V through ``batch.attn_backend`` (the slots of
        ``batch.attn_metadata``); returns the final hidden states ``[T, hidden]`` (after the
        last norm: what pooling reads)."""
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """``[N, hidden]`` -> ``[N, vocab]``, with the model's own post-processing. A
        tensor-parallel shard (``kvserve.distributed``) gathers the logits on rank 0 and
        returns None on the other ranks, which must call it with the same rows."""
        ...

    def enable_fused_ops(self) -> bool:
        """Switch to the C++ fused ops where this model has them; returns whether it did."""
        ...

    def enable_decode_loop(self) -> bool:
        """Run decode-only steps' layers as one C++ call where this model can (after
        ``enable_fused_ops``); returns whether it does."""
        ...

    def eval(self) -> CausalLM: ...
