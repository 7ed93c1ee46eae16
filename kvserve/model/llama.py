"""Llama-family decoder (Llama, Qwen2, Mistral, SmolLM, Qwen3) written for a paged KV cache.

Tokens of all requests in a step arrive flat (``[T]``, no padding between requests); the
attention metadata says which tokens belong to which request and where their K/V live.
Q/K/V and gate/up projections are fused into single matmuls at load time. Given a ``TPGroup``
of several ranks, the layers are this rank's shards (``kvserve/distributed/layers.py``): its
query and K/V heads, its slice of the MLP and the vocabulary. With
``enable_fused_ops`` RMSNorm, SiLU*up and RoPE + KV write each run as one kernel that rounds
like the PyTorch op chain it replaces: C++ on the CPU (``cpu_kernels``), Triton on CUDA
(``ops/triton/fused_ops.py``; ``ops/fused_kernels.py`` picks).

Qwen3 is Llama plus a per-head RMSNorm on q and k before RoPE (fused: inside the RoPE + KV
write kernel), a head_dim of its own, and optional sliding-window layers (``layer_types``).
The pieces here (attention with q/k norms, windows and soft-capping, the gated MLP with SiLU
or tanh-GELU, per-layer-type RoPE) are shared with ``gemma.py``.
"""

from __future__ import annotations

from collections.abc import Iterable
from types import ModuleType

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
from kvserve.lora.layers import LoRASlotWeights
from kvserve.lora.punica import LoRAMapping
from kvserve.model.base import ForwardBatch
from kvserve.model.decode_loop import DecodeLoop, build_decode_loop
from kvserve.ops import cpu_kernels
from kvserve.ops.fused_kernels import fused_kernels_for

Rope = tuple[torch.Tensor, torch.Tensor]  # (cos, sin), each [T, 1, head_dim]

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "MistralForCausalLM",
    "Qwen3ForCausalLM",
)

LAYER_TYPES = ("full_attention", "sliding_attention")


def model_architecture(config: PretrainedConfig, supported: tuple[str, ...]) -> str:
    """The config's architecture, or a ValueError naming what this class runs."""
    arch = (getattr(config, "architectures", None) or [supported[0]])[0]
    if arch not in supported:
        raise ValueError(f"unsupported architecture {arch!r}; this model class runs {supported}")
    return arch


def layer_window(config: PretrainedConfig, layer: int) -> int | None:
    """Layer ``layer``'s sliding window from ``layer_types`` (None: full attention), as
    transformers reads it: ``config.sliding_window`` on ``sliding_attention`` layers."""
    types = getattr(config, "layer_types", None)
    if types is None:
        return None
    if types[layer] not in LAYER_TYPES:
        raise ValueError(
            f"layer {layer} has attention type {types[layer]!r}; kvserve runs {LAYER_TYPES}"
        )
    window = getattr(config, "sliding_window", None)
    return int(window) if window and types[layer] == "sliding_attention" else None


class RMSNorm(nn.Module):
    unit_offset = False  # Gemma's (1 + w) form (gemma.GemmaRMSNorm)

    def __init__(self, hidden: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps
        self.fused = False  # one kernel instead of the op chain below
        self.kernels: ModuleType = cpu_kernels  # C++ on the CPU, Triton on CUDA (when fused)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return self.kernels.rms_norm(x, self.weight, self.eps, self.unit_offset)
        # Normalise in float32 as Hugging Face does, so bf16 runs round the same way.
        normed = nn.functional.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(x.dtype)

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The skip connection and this norm: returns ``(residual + x, norm(residual + x))``.
        Fused, the sum is written into ``residual`` (which the caller owns)."""
        if self.fused:
            normed = self.kernels.add_rms_norm(x, residual, self.weight, self.eps, self.unit_offset)
            return residual, normed
        residual = residual + x
        return residual, self(residual)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position, from the config's rope parameters (theta, scaling)."""

    def __init__(
        self,
        config: PretrainedConfig,
        head_dim: int,
        max_positions: int,
        layer_type: str | None = None,
    ) -> None:
        """``layer_type``: the key of per-layer-type rope parameters (Gemma3's local and
        global RoPE: ``rope_parameters = {"sliding_attention": {...}, ...}``)."""
        super().__init__()
        # Tables are computed on the CPU whatever device context the model is built under
        # (the loader builds on "meta"); ``to_device`` moves them.
        with torch.device("cpu"):
            inv_freq, scaling = _inv_freq(config, head_dim, layer_type)
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


def _inv_freq(
    config: PretrainedConfig, head_dim: int, layer_type: str | None = None
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and attention scaling from the config's rope parameters."""
    params = getattr(config, "rope_parameters", None) or {}
    if layer_type is not None:
        params = params[layer_type]
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial rotary embeddings (partial_rotary_factor < 1) are unsupported")
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim)), 1.0
    if rope_type in ROPE_INIT_FUNCTIONS:
        extra = {} if layer_type is None else {"layer_type": layer_type}
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", **extra)
        return inv_freq, float(scaling)
    raise ValueError(f"unsupported rope_type {rope_type!r}")


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(
        self,
        config: PretrainedConfig,
        bias: bool,
        *,
        o_bias: bool = False,
        qk_norm: type[RMSNorm] | None = None,
        scale: float | None = None,
        sliding_window: int | None = None,
        soft_cap: float | None = None,
        sinks: bool = False,
        tp: TPGroup = SINGLE,
    ) -> None:
        """``qk_norm``: a per-head norm on q and k before RoPE (Qwen3, Gemma3); ``scale``:
        the softmax scale (default head_dim ** -0.5); ``sliding_window``: this layer attends
        to its last ``sliding_window`` keys; ``soft_cap``: scores -> cap * tanh(scores / cap);
        ``sinks``: a learned logit per query head in every softmax (gpt-oss; this rank's
        heads); ``tp``: this rank's share of the heads."""
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
        self.o_proj = RowParallelLinear(heads * self.head_dim, config.hidden_size, o_bias, tp)
        self.scale = self.head_dim**-0.5 if scale is None else scale
        self.q_norm = qk_norm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = qk_norm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        # only the features a layer uses are passed (none: the plain causal fast path)
        self.attn_kwargs: dict[str, float | int] = {}
        if sliding_window is not None:
            self.attn_kwargs["sliding_window"] = sliding_window
        if soft_cap is not None:
            self.attn_kwargs["soft_cap"] = soft_cap
        self.sinks = nn.Parameter(torch.empty(self.num_heads)) if sinks else None  # [H]
        self.fused = False  # (q/k norm +) RoPE + KV write as one kernel
        self.kernels: ModuleType = cpu_kernels  # C++ on the CPU, Triton on CUDA (when fused)
        # q_norm/k_norm act per head before RoPE (Qwen3, Gemma 3); OLMoE's are over the
        # whole projections, applied in ``project`` instead
        self.per_head_qk_norm = True
        # LoRA slot weights (kvserve/lora/layers.py attach_lora), owned by the LoRAManager
        self.lora_qkv: LoRASlotWeights | None = None
        self.lora_o: LoRASlotWeights | None = None

    def forward(
        self,
        rope: Rope,
        x: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        batch: ForwardBatch,
    ) -> torch.Tensor:
        t, md, backend = x.shape[0], batch.attn_metadata, batch.attn_backend
        qkv = self.project(x, batch)  # [T, (H + 2 Hkv) * D]
        per_head = self.per_head_qk_norm and self.q_norm is not None and self.k_norm is not None
        if self.fused:
            cos, sin = rope[0].squeeze(1), rope[1].squeeze(1)  # [T, D]
            norms = None
            if per_head and self.q_norm is not None and self.k_norm is not None:
                norms = (self.q_norm.weight, self.k_norm.weight)
            q = self.kernels.rope_write_kv(
                qkv, cos, sin, *kv_cache, md.slot_mapping, self.num_heads, self.num_kv_heads,
                norms, self.q_norm.eps if self.q_norm else 1e-6,
                bool(self.q_norm and self.q_norm.unit_offset),
            )  # fmt: skip  # [T, H, D]
        else:
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = q.view(t, self.num_heads, self.head_dim)  # [T, H, D]
            k = k.view(t, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
            v = v.view(t, self.num_kv_heads, self.head_dim)
            if per_head and self.q_norm is not None and self.k_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = apply_rope(rope, q, k)
            backend.write_kv(k, v, kv_cache[0], kv_cache[1], md)
        if self.sinks is None:
            o = backend.forward(q, kv_cache[0], kv_cache[1], md, self.scale, **self.attn_kwargs)
        else:
            o = backend.forward(
                q, kv_cache[0], kv_cache[1], md, self.scale, sinks=self.sinks, **self.attn_kwargs
            )
        o = o.reshape(t, self.q_size)  # [T, H * D]
        if batch.lora is not None and self.lora_o is not None:
            return self.lora_o.add_row_parallel(self.o_proj, o, batch.lora)  # [T, hidden]
        return self.o_proj(o)  # [T, hidden]

    def project(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """``x [T, hidden]`` -> the fused ``qkv [T, (H + 2 Hkv) * D]`` before RoPE (and
        before per-head q/k norms); OLMoE normalises the whole projections here."""
        qkv = self.qkv_proj(x)
        if batch.lora is not None and self.lora_qkv is not None:
            qkv = self.lora_qkv.add_delta(qkv, x, batch.lora)
        return qkv


# The gated MLP's activations: transformers' ``hidden_act`` name -> (PyTorch op, C++ kernel
# computing act(gate) * up). gelu_pytorch_tanh is Gemma's GeGLU.
ACTIVATIONS = {
    "silu": (nn.functional.silu, cpu_kernels.silu_and_mul),
    "gelu_pytorch_tanh": (
        lambda x: nn.functional.gelu(x, approximate="tanh"),
        cpu_kernels.gelu_tanh_and_mul,
    ),
}


class MLP(nn.Module):
    def __init__(
        self, hidden: int, intermediate: int, act: str = "silu", tp: TPGroup = SINGLE
    ) -> None:
        super().__init__()
        if act not in ACTIVATIONS:
            raise ValueError(
                f"unsupported hidden activation {act!r}; kvserve runs {tuple(ACTIVATIONS)}"
            )
        self.act, self.act_and_mul = ACTIVATIONS[act]
        divide(intermediate, tp, "intermediate_size")  # the error names the config field
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [intermediate] * 2, False, tp)
        self.intermediate = self.gate_up_proj.local_sizes[0]  # this rank's features
        self.down_proj = RowParallelLinear(intermediate, hidden, False, tp)
        self.fused = False  # act(gate) * up as one kernel
        # LoRA slot weights (kvserve/lora/layers.py attach_lora), owned by the LoRAManager
        self.lora_gate_up: LoRASlotWeights | None = None
        self.lora_down: LoRASlotWeights | None = None

    def forward(self, x: torch.Tensor, lora: LoRAMapping | None = None) -> torch.Tensor:
        """``lora``: the step's adapter rows (``ForwardBatch.lora``); None: the base model."""
        gate_up = self.gate_up_proj(x)  # [T, 2 I]
        if lora is not None and self.lora_gate_up is not None:
            gate_up = self.lora_gate_up.add_delta(gate_up, x, lora)
        if self.fused:
            h = self.act_and_mul(gate_up)  # [T, I]
        else:
            gate, up = gate_up.split(self.intermediate, dim=-1)
            h = self.act(gate) * up
        if lora is not None and self.lora_down is not None:
            return self.lora_down.add_row_parallel(self.down_proj, h, lora)  # [T, hidden]
        return self.down_proj(h)  # [T, hidden]


class DecoderLayer(nn.Module):
    def __init__(
        self,
        config: PretrainedConfig,
        attn: Attention,
        tp: TPGroup = SINGLE,
        mlp: nn.Module | None = None,
    ) -> None:
        """``mlp``: the feed-forward block (default: the gated MLP of ``intermediate_size``;
        a mixture-of-experts block in ``moe.py``), called as ``mlp(h, lora)``."""
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = attn
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if mlp is None:
            act = getattr(config, "hidden_act", "silu")
            mlp = MLP(config.hidden_size, config.intermediate_size, act, tp)
        self.mlp = mlp

    def forward(
        self,
        rope: Rope,
        x: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        batch: ForwardBatch,
        residual: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's input is ``x + residual`` (just ``x`` for the first layer); returns the
        MLP output and the residual stream, whose sum is its output. Handing the sum to the
        next layer's norm lets the fused path add and normalise in one pass."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            residual, h = self.input_layernorm.add_forward(x, residual)
        h = self.self_attn(rope, h, kv_cache, batch)
        residual, h = self.post_attention_layernorm.add_forward(h, residual)
        return self.mlp(h, batch.lora), residual


def _llama_attention(
    config: PretrainedConfig, arch: str, layer: int, tp: TPGroup = SINGLE
) -> Attention:
    """Qwen2 has q/k/v bias; Qwen3 q/k norms and (with attention_bias) an o_proj bias too;
    Llama and Mistral follow ``attention_bias``. Windows as transformers applies them:
    Qwen2/3 per layer (``layer_types``), Mistral ``sliding_window`` on every layer."""
    attention_bias = bool(getattr(config, "attention_bias", False))
    if arch == "MistralForCausalLM":
        window = getattr(config, "sliding_window", None)
        window = int(window) if window else None
    else:
        window = layer_window(config, layer)
    if arch == "Qwen3ForCausalLM":
        return Attention(
            config, attention_bias, o_bias=attention_bias, qk_norm=RMSNorm,
            sliding_window=window, tp=tp,
        )  # fmt: skip
    bias = arch == "Qwen2ForCausalLM" or attention_bias
    return Attention(config, bias, sliding_window=window, tp=tp)


class LlamaForCausalLM(nn.Module):
    """The Llama-family decoder; Qwen2 differs only by q/k/v bias, Mistral not at all here,
    Qwen3 by its q/k norms (and windows).

    ``tp``: this process's tensor-parallel rank (None: the whole model in one process)."""

    architectures = SUPPORTED_ARCHITECTURES  # what this class runs (config.architectures[0])
    norm_class: type[RMSNorm] = RMSNorm
    supports_tensor_parallel = True  # the loader refuses tp > 1 for classes without it
    supports_lora = True  # its layers add LoRA deltas (kvserve/lora/layers.py attach_lora)
    # every op is row-wise once its linears are fixed-order (model/batch_invariant.py)
    supports_batch_invariant = True
    # its forward has no host sync and no step-sized allocation: decode steps may run as CUDA
    # graphs (worker/cuda_graph.py)
    supports_cuda_graphs = True

    def __init__(
        self, config: PretrainedConfig, max_positions: int, tp: TPGroup | None = None
    ) -> None:
        super().__init__()
        arch = model_architecture(config, self.architectures)
        self.config = config
        self.tp = tp or SINGLE
        self.head_dim = (
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        )
        self.num_layers = int(config.num_hidden_layers)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, self.tp)
        self.layers = nn.ModuleList(
            self.make_layer(config, arch, i) for i in range(config.num_hidden_layers)
        )
        # This rank's K/V heads: its KV cache's second dimension.
        self.num_kv_heads = self.layers[0].self_attn.num_kv_heads
        self.norm = self.norm_class(config.hidden_size, config.rms_norm_eps)
        self.rotary = self.make_rotary(config, max_positions)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size, self.tp)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # logits -> cap * tanh(logits / cap) (Gemma 2/3's final_logit_softcapping)
        self.final_logit_softcapping: float | None = None
        # decode-only steps' layers in one C++ call (enable_decode_loop; None: Python loop)
        self.decode_loop: DecodeLoop | None = None

    def make_layer(self, config: PretrainedConfig, arch: str, layer: int) -> nn.Module:
        return DecoderLayer(config, _llama_attention(config, arch, layer, self.tp), self.tp)

    def make_rotary(self, config: PretrainedConfig, max_positions: int) -> RotaryEmbedding:
        return RotaryEmbedding(config, self.head_dim, max_positions)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """The step's tokens (``[T]``) -> the final hidden states ``[T, hidden]``."""
        x = self.embed_tokens(batch.input_ids)
        rope = self.rotary.lookup(batch.positions, x.dtype)
        residual = None
        if self.decode_loop is not None and self.decode_loop.runs(batch):
            x, residual = self.decode_loop.run(x, rope, batch)
        else:
            for layer, kv in zip(self.layers, batch.kv_caches, strict=True):
                if batch.interrupt is not None:
                    batch.interrupt.check()  # the step gives way to an online request
                x, residual = layer(rope, x, kv, batch, residual)
        assert residual is not None, "a model has at least one layer"
        return self.norm.add_forward(x, residual)[1]

    @property
    def fused_ops_enabled(self) -> bool:
        return self.norm.fused

    def enable_fused_ops(self) -> bool:
        """Switch RMSNorm, SiLU*up and RoPE + KV write to the C++ CPU kernels when this model
        can use them (CPU, bfloat16 or float32, kernels built); returns whether it did.

        bfloat16: every intermediate is rounded to bf16, so the kernels give the op chains'
        numbers bit for bit. float32 (what ``dtype=auto`` is on AVX2-only CPUs): the same
        math on 8- or 16-wide float vectors, whose sums (RMSNorm's mean of squares) add in
        another order than PyTorch's, so results differ by a few ulps (tested within 1e-6
        relative; the prepacked float32 linears already differ by ~1e-4).

        On CUDA (bfloat16, float16, float32) the same chains run as Triton kernels
        (``kvserve/ops/triton/fused_ops.py``), held to the same op chains under Triton's
        interpreter in CI; their figures on a GPU await a GPU run (docs/performance.md).
        """
        param = self.embed_tokens.weight
        kernels = fused_kernels_for(param.device, param.dtype)
        if kernels is None:
            return False
        for m in self.modules():
            if isinstance(m, (RMSNorm, Attention, MLP)):
                m.fused = True  # q/k norms then run inside the attention's RoPE kernel
            if isinstance(m, (RMSNorm, Attention)):
                m.kernels = kernels
            if isinstance(m, MLP):  # the same function of the device's kernel module
                m.act_and_mul = getattr(kernels, m.act_and_mul.__name__)
        return True

    def enable_decode_loop(self) -> bool:
        """Run decode-only steps' layers as one C++ call (``decode_loop.py``), after the
        fused ops and any packing or quantization; returns whether it could."""
        self.decode_loop = build_decode_loop(self)
        return self.decode_loop is not None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """``[N, hidden]`` -> ``[N, vocab]`` logits in the model dtype (the sampler widens
        them to float32 where it computes; greedy argmax reads them as they are). Under
        tensor parallelism every rank calls it with the same rows and only rank 0 gets the
        logits (the others get None)."""
        logits = self.lm_head(hidden)
        cap = self.final_logit_softcapping
        if logits is None:
            return None
        if cap is not None:  # in the model dtype, op by op, as transformers computes it
            logits = torch.tanh(logits / cap) * cap
        return logits

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
