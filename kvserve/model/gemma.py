"""Gemma 1, 2 and 3 (text) decoders on the Llama family's paged, fused and prepacked paths.

What differs from Llama (``llama.py``), as transformers 5's Gemma modeling files compute it:
- embeddings are scaled by sqrt(hidden), the factor rounded to the model dtype first;
- every RMSNorm is ``(1 + w)``-weighted and computed in float32, rounded once after the
  multiply (``GemmaRMSNorm``); the fused C++ norms take ``unit_offset`` and do the same
  (float32 ``x * rsqrt(mean + eps) * (1 + w)``, one rounding), so bf16 outputs stay equal;
- the MLP is GeGLU: tanh-approximated GELU (``gelu_tanh_and_mul`` on the fused path);
- Gemma 2/3 wrap attention and MLP in extra norms (post-attention, pre/post feed-forward),
  scale scores by ``query_pre_attn_scalar ** -0.5``, alternate sliding-window and global
  layers (``layer_types``) and may soft-cap the final logits;
- Gemma 2 soft-caps attention scores (``attn_logit_softcapping``); Gemma 3 does not (its
  transformers attention ignores the field, and so does kvserve) but has Gemma-style q/k
  norms before RoPE and a separate RoPE per layer type (local base ``rope_local_base_freq``
  -> ``rope_parameters["sliding_attention"]``, global ``rope_parameters["full_attention"]``).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from kvserve.model.base import ForwardBatch
from kvserve.model.llama import (
    MLP,
    Attention,
    LlamaForCausalLM,
    RMSNorm,
    Rope,
    RotaryEmbedding,
    layer_window,
)

SUPPORTED_ARCHITECTURES = ("GemmaForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM")


class GemmaRMSNorm(RMSNorm):
    """``T(x * rsqrt(mean(x^2) + eps) * (1 + w))`` with every step in float32."""

    unit_offset = True

    def __init__(self, hidden: int, eps: float) -> None:
        super().__init__(hidden, eps)
        self.weight = nn.Parameter(torch.zeros(hidden))  # zeros: the identity, as HF

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return self.kernels.rms_norm(x, self.weight, self.eps, unit_offset=True)
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, attn: Attention, act: str, sandwich: bool):
        """``sandwich``: Gemma 2/3's norms after attention and around the MLP; in Gemma 1
        ``post_attention_layernorm`` is the pre-MLP norm, as in Llama."""
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.sandwich = sandwich
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.self_attn = attn
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        if sandwich:
            self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
            self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.mlp = MLP(hidden, config.intermediate_size, act)

    def forward(
        self,
        rope: Rope,
        x: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        batch: ForwardBatch,
        residual: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As ``llama.DecoderLayer``: the layer's input is ``x + residual``; returns the MLP
        output and the residual stream (the skip adds are fused into the next norm)."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            residual, h = self.input_layernorm.add_forward(x, residual)
        h = self.self_attn(rope, h, kv_cache, batch)
        if not self.sandwich:
            residual, h = self.post_attention_layernorm.add_forward(h, residual)
            return self.mlp(h), residual
        h = self.post_attention_layernorm(h)
        residual, h = self.pre_feedforward_layernorm.add_forward(h, residual)
        return self.post_feedforward_layernorm(self.mlp(h)), residual


class LayerTypeRotary(nn.Module):
    """One RoPE table per attention type: Gemma 3's local (sliding) and global layers use
    different bases; Gemma 1/2 share one table (key None)."""

    def __init__(self, tables: dict[str | None, RotaryEmbedding]) -> None:
        super().__init__()
        self.tables = tables  # plain dict: the tables are not parameters or buffers

    def to_device(self, device: str | torch.device) -> None:
        for table in self.tables.values():
            table.to_device(device)

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> dict[str | None, Rope]:
        return {key: table.lookup(positions, dtype) for key, table in self.tables.items()}


def _check_config(config: PretrainedConfig, arch: str) -> None:
    """Refuse what these classes do not implement, naming it."""
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError(f"{arch} with use_bidirectional_attention is not a causal decoder")
    if arch == "Gemma3ForCausalLM":
        params = getattr(config, "rope_parameters", None) or {}
        missing = set(config.layer_types) - set(params)
        if missing:
            raise ValueError(f"Gemma3 config has no rope_parameters for layer types {missing}")


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma 1/2/3 text decoders: Llama's machinery with Gemma's layers, norms and RoPE."""

    architectures = SUPPORTED_ARCHITECTURES
    norm_class = GemmaRMSNorm
    supports_tensor_parallel = False  # its layers are built unsharded (make_layer)
    supports_lora = False  # its decoder layer does not hand the step's adapters to its MLP

    def __init__(self, config: PretrainedConfig, max_positions: int) -> None:
        arch = (getattr(config, "architectures", None) or [SUPPORTED_ARCHITECTURES[0]])[0]
        if arch in SUPPORTED_ARCHITECTURES:
            _check_config(config, arch)
        self.arch = arch
        super().__init__(config, max_positions)  # checks arch, builds via make_layer/make_rotary
        self.final_logit_softcapping = getattr(config, "final_logit_softcapping", None)
        self.embed_scale = float(config.hidden_size) ** 0.5
        # The layer -> RoPE table key (Gemma 3: the layer's attention type).
        types = getattr(config, "layer_types", None)
        self.rope_keys = types if arch == "Gemma3ForCausalLM" else [None] * len(self.layers)

    def make_layer(self, config: PretrainedConfig, arch: str, layer: int) -> nn.Module:
        gemma1 = arch == "GemmaForCausalLM"
        attn = Attention(
            config,
            bool(getattr(config, "attention_bias", False)),
            o_bias=bool(getattr(config, "attention_bias", False)),
            qk_norm=GemmaRMSNorm if arch == "Gemma3ForCausalLM" else None,
            scale=None if gemma1 else float(config.query_pre_attn_scalar) ** -0.5,
            sliding_window=None if gemma1 else layer_window(config, layer),
            soft_cap=(
                getattr(config, "attn_logit_softcapping", None)
                if arch == "Gemma2ForCausalLM"
                else None
            ),
        )
        act = config.hidden_act if gemma1 else config.hidden_activation
        return GemmaDecoderLayer(config, attn, act, sandwich=not gemma1)

    def make_rotary(self, config: PretrainedConfig, max_positions: int) -> LayerTypeRotary:  # type: ignore[override]
        if self.arch != "Gemma3ForCausalLM":
            return LayerTypeRotary({None: RotaryEmbedding(config, self.head_dim, max_positions)})
        return LayerTypeRotary(
            {
                key: RotaryEmbedding(config, self.head_dim, max_positions, layer_type=key)
                for key in sorted(set(config.layer_types))
            }
        )

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """The step's tokens (``[T]``) -> the final hidden states ``[T, hidden]``."""
        x = self.embed_tokens(batch.input_ids)  # [T, hidden]
        # transformers multiplies by the factor as a tensor of the model dtype: round it first
        # (sqrt(2048) = 45.25 in bf16), then one multiply rounded to the dtype.
        x = x * float(torch.tensor(self.embed_scale).to(x.dtype))
        ropes = self.rotary.lookup(batch.positions, x.dtype)
        residual = None
        for layer, kv, key in zip(self.layers, batch.kv_caches, self.rope_keys, strict=True):
            if batch.interrupt is not None:
                batch.interrupt.check()  # the step gives way to an online request
            x, residual = layer(ropes[key], x, kv, batch, residual)
        assert residual is not None, "a model has at least one layer"
        return self.norm.add_forward(x, residual)[1]
