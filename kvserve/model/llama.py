"""Llama-family decoder (Llama, Qwen2, Mistral, SmolLM) written for a paged KV cache.

Tokens of all requests in a step arrive flat (``[T]``, no padding between requests); the
attention metadata says which tokens belong to which request and where their K/V live.
Q/K/V and gate/up projections are fused into single matmuls at load time. Given a ``TPGroup``
of several ranks, the layers are this rank's shards (``kvserve/distributed/layers.py``): its
query and K/V heads, its slice of the MLP and the vocabulary. With
``enable_fused_ops`` (CPU, bf16) RMSNorm, SiLU*up and RoPE + KV write each run as one C++
kernel (``cpu_kernels``) that rounds like the PyTorch op chain it replaces.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from kvserve.distributed.layers import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    load_weight,
)
from kvserve.distributed.parallel_state import SINGLE, TPGroup, divide
from kvserve.model import cpu_kernels
from kvserve.model.attention import AttentionMetadata, paged_attention, write_kv

Rope = tuple[torch.Tensor, torch.Tensor]  # (cos, sin), each [T, 1, head_dim]

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps
        self.fused = False  # one C++ kernel instead of the op chain below

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return cpu_kernels.rms_norm(x, self.weight, self.eps)
        # Normalise in float32 as Hugging Face does, so bf16 runs round the same way.
        normed = nn.functional.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(x.dtype)

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The skip connection and this norm: returns ``(residual + x, norm(residual + x))``.
        Fused, the sum is written into ``residual`` (which the caller owns)."""
        if self.fused:
            return residual, cpu_kernels.add_rms_norm(x, residual, self.weight, self.eps)
        residual = residual + x
        return residual, self(residual)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position, from the config's rope parameters (theta, scaling)."""

    def __init__(self, config: PretrainedConfig, head_dim: int, max_positions: int) -> None:
        super().__init__()
        # Tables are computed on the CPU whatever device context the model is built under
        # (the loader builds on "meta"); ``to_device`` moves them.
        with torch.device("cpu"):
            inv_freq, scaling = _inv_freq(config, head_dim)
            pos = torch.arange(max_positions, dtype=torch.float)
            freqs = torch.outer(pos, inv_freq)  # [P, D/2]
            emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
        # Plain float32 attributes, not buffers: a later model.to(bf16) must not round them;
        # they are cast per use, as Hugging Face does.
        self.cos = emb.cos() * scaling
        self.sin = emb.sin() * scaling

    def to_device(self, device: str | torch.device) -> None:
        self.cos = self.cos.to(device)
        self.sin = self.sin.to(device)

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> Rope:
        """cos/sin rows for this step's positions, once per forward (shared by all layers)."""
        cos = self.cos[positions].unsqueeze(1).to(dtype)  # [T, 1, D]
        sin = self.sin[positions].unsqueeze(1).to(dtype)
        return cos, sin


def apply_rope(rope: Rope, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = rope
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _inv_freq(config: PretrainedConfig, head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and attention scaling from the config's rope parameters."""
    params = getattr(config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim)), 1.0
    if rope_type in ROPE_INIT_FUNCTIONS:
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
        return inv_freq, float(scaling)
    raise ValueError(f"unsupported rope_type {rope_type!r}")


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, config: PretrainedConfig, bias: bool, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, self.head_dim, heads, kv_heads, bias, tp
        )
        # This rank's heads (all of them at world_size 1).
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(heads * self.head_dim, config.hidden_size, False, tp)
        self.scale = self.head_dim**-0.5
        self.fused = False  # RoPE + KV write as one C++ kernel

    def forward(
        self,
        rope: Rope,
        x: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        md: AttentionMetadata,
    ) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)  # [T, (H + 2 Hkv) * D]
        if self.fused:
            cos, sin = rope[0].squeeze(1), rope[1].squeeze(1)  # [T, D]
            q = cpu_kernels.rope_write_kv(
                qkv, cos, sin, *kv_cache, md.slot_mapping, self.num_heads, self.num_kv_heads
            )  # [T, H, D]
        else:
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = q.view(t, self.num_heads, self.head_dim)  # [T, H, D]
            k = k.view(t, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
            v = v.view(t, self.num_kv_heads, self.head_dim)
            q, k = apply_rope(rope, q, k)
            write_kv(k, v, kv_cache[0], kv_cache[1], md.slot_mapping)
        o = paged_attention(q, kv_cache[0], kv_cache[1], md, self.scale)  # [T, H, D]
        return self.o_proj(o.reshape(t, self.q_size))


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        divide(intermediate, tp, "intermediate_size")  # the error names the config field
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [intermediate] * 2, False, tp)
        self.intermediate = self.gate_up_proj.local_sizes[0]  # this rank's features
        self.down_proj = RowParallelLinear(intermediate, hidden, False, tp)
        self.fused = False  # silu(gate) * up as one C++ kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return self.down_proj(cpu_kernels.silu_and_mul(self.gate_up_proj(x)))
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(nn.functional.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, bias: bool, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, bias, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config.hidden_size, config.intermediate_size, tp)

    def forward(
        self,
        rope: Rope,
        x: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        md: AttentionMetadata,
        residual: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's input is ``x + residual`` (just ``x`` for the first layer); returns the
        MLP output and the residual stream, whose sum is its output. Handing the sum to the
        next layer's norm lets the fused path add and normalise in one pass."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            residual, h = self.input_layernorm.add_forward(x, residual)
        h = self.self_attn(rope, h, kv_cache, md)
        residual, h = self.post_attention_layernorm.add_forward(h, residual)
        return self.mlp(h), residual


class LlamaForCausalLM(nn.Module):
    """The Llama-family decoder; Qwen2 differs only by q/k/v bias, Mistral not at all here.

    ``tp``: this process's tensor-parallel rank (None: the whole model in one process)."""

    supports_tensor_parallel = True  # the loader refuses tp > 1 for classes without it

    def __init__(
        self, config: PretrainedConfig, max_positions: int, tp: TPGroup | None = None
    ) -> None:
        super().__init__()
        tp = tp or SINGLE
        arch = (getattr(config, "architectures", None) or ["LlamaForCausalLM"])[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {arch!r}; kvserve runs {SUPPORTED_ARCHITECTURES}"
            )
        bias = arch == "Qwen2ForCausalLM" or bool(getattr(config, "attention_bias", False))
        self.config = config
        head_dim = (
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        )
        self.head_dim = head_dim
        self.tp = tp
        self.num_layers = int(config.num_hidden_layers)
        self.rotary = RotaryEmbedding(config, head_dim, max_positions)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(
            DecoderLayer(config, bias, tp) for _ in range(config.num_hidden_layers)
        )
        # This rank's K/V heads: its KV cache's second dimension.
        self.num_kv_heads = self.layers[0].self_attn.num_kv_heads
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size, tp)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        md: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids, positions: ``[T]``; returns the final hidden states ``[T, hidden]``."""
        x = self.embed_tokens(input_ids)
        rope = self.rotary.lookup(positions, x.dtype)
        residual = None
        for layer, kv in zip(self.layers, kv_caches, strict=True):
            x, residual = layer(rope, x, kv, md, residual)
        assert residual is not None, "a model has at least one layer"
        return self.norm.add_forward(x, residual)[1]

    @property
    def fused_ops_enabled(self) -> bool:
        return self.norm.fused

    def enable_fused_ops(self) -> bool:
        """Switch RMSNorm, SiLU*up and RoPE + KV write to the C++ CPU kernels when this model
        can use them (CPU, bfloat16, kernels built); returns whether it did.

        bfloat16 only: there every intermediate is rounded to bf16, so the kernels give the
        op chains' numbers; float32 stays on the PyTorch path, the reference the tests hold
        against transformers.
        """
        param = self.embed_tokens.weight
        if param.device.type != "cpu" or param.dtype != torch.bfloat16:
            return False
        if not cpu_kernels.available():
            return False
        for m in self.modules():
            if isinstance(m, (RMSNorm, Attention, MLP)):
                m.fused = True
        return True

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """``[N, hidden]`` -> ``[N, vocab]`` logits in the model dtype (the sampler widens
        them to float32 where it computes; greedy argmax reads them as they are). Under
        tensor parallelism every rank calls it with the same rows and only rank 0 gets the
        logits (the others get None)."""
        return self.lm_head(hidden)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load Hugging Face parameter names, fusing q/k/v and gate/up as they arrive; each
        layer's weight loader copies this rank's slice of the full tensor."""
        params = dict(self.named_parameters())
        fused = {
            "q_proj": ("qkv_proj", 0),
            "k_proj": ("qkv_proj", 1),
            "v_proj": ("qkv_proj", 2),
            "gate_proj": ("gate_up_proj", 0),
            "up_proj": ("gate_up_proj", 1),
        }
        loaded: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue
            parts = name.split(".")
            if len(parts) >= 2 and parts[-2] in fused:
                target, shard = fused[parts[-2]]
                pname = ".".join([*parts[:-2], target, parts[-1]])
                load_weight(self, pname, params[pname], tensor, shard)
                loaded.add(f"{pname}#{shard}")
                continue
            if name not in params:
                raise ValueError(f"unexpected weight {name!r} in checkpoint")
            load_weight(self, name, params[name], tensor)
            loaded.add(name)
        self._check_all_loaded(params, loaded)

    def _check_all_loaded(self, params: dict[str, nn.Parameter], loaded: set[str]) -> None:
        missing = []
        for pname in params:
            if pname == "lm_head.weight" and self.tie_word_embeddings:
                continue
            if pname.endswith(("qkv_proj.weight", "qkv_proj.bias")):
                shards = [f"{pname}#{i}" for i in range(3)]
            elif pname.endswith("gate_up_proj.weight"):
                shards = [f"{pname}#{i}" for i in range(2)]
            else:
                shards = [pname]
            missing += [s for s in shards if s not in loaded]
        if missing:
            raise ValueError(f"checkpoint is missing weights: {missing[:5]}...")
