"""Mixture-of-experts decoders: Qwen2-MoE, Qwen3-MoE, Mixtral and OLMoE on the Llama family's
layers (``llama.py``: attention on the paged KV cache and its backends, RoPE, RMSNorm, the
fused C++ ops), with each layer's MLP a ``SparseMoeBlock`` (``kvserve/moe/``: top-k router,
grouped experts).

What differs between the families, as transformers 5's modeling files compute it:
- Qwen2-MoE: q/k/v bias (``qkv_bias``), a shared expert beside the routed ones whose output is
  scaled by ``sigmoid(shared_expert_gate(x))``, dense MLP layers where ``mlp_only_layers`` or
  ``decoder_sparse_step`` say so, sliding windows per ``layer_types``;
- Qwen3-MoE: Qwen3's per-head q/k norms, ``norm_topk_prob``, the same sparse-layer rules, no
  shared expert, ``sliding_window`` (when ``use_sliding_window``) on every layer;
- Mixtral: Mistral's attention (``sliding_window`` on every layer), renormalised top-k weights
  kept in float32; checkpoints name the block ``block_sparse_moe`` and the experts' matrices
  ``w1`` (gate), ``w3`` (up), ``w2`` (down);
- OLMoE: RMSNorm over the whole q and k projections (not per head) before RoPE, optional
  ``clip_qkv`` clamping of q, k and v, no renormalisation by default.

Checkpoints store each expert's matrices apart (``experts.<e>.gate_proj.weight``); they load
into the layer's stacked ``[E, 2I, H]`` / ``[E, H, I]`` weights (``FusedExperts``), and
transformers 5's own stacked names (``experts.gate_up_proj``) load as they are.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import nn
from torch.nn import functional as F
from transformers import PretrainedConfig

from kvserve.config import Quantization
from kvserve.distributed.parallel_state import SINGLE, TPGroup
from kvserve.lora.punica import LoRAMapping
from kvserve.model.base import ForwardBatch
from kvserve.model.llama import (
    ACTIVATIONS,
    MLP,
    Attention,
    DecoderLayer,
    LlamaForCausalLM,
    RMSNorm,
    layer_window,
)
from kvserve.moe.experts import (
    ActAndMul,
    FusedExperts,
    GluActivation,
    GluKind,
)
from kvserve.moe.router import RouterConfig, route
from kvserve.ops import cpu_kernels
from kvserve.ops.fused_kernels import fused_kernels_for
from kvserve.ops.malloc_tuning import trim_heap
from kvserve.quantization.apply import (
    RTN_METHODS,
    count_layer,
    layer_weight,
    load_workers,
    new_quant_layer,
    rtn_weight,
)
from kvserve.quantization.qlinear import QuantLinear
from kvserve.quantization.streaming import StreamingQuantizer

QWEN2_MOE, QWEN3_MOE = "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"
MIXTRAL, OLMOE = "MixtralForCausalLM", "OlmoeForCausalLM"
SUPPORTED_ARCHITECTURES = (QWEN2_MOE, QWEN3_MOE, MIXTRAL, OLMOE)

# experts.<e>.<matrix>.weight: Qwen/OLMoE's names, then Mixtral's
_EXPERT_WEIGHT = re.compile(r"^(layers\.\d+\.mlp\.experts)\.(\d+)\.(\w+)\.weight$")
_STACKED_WEIGHT = re.compile(r"^(layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")
_PARTS = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down",
          "w1": "gate", "w3": "up", "w2": "down"}  # fmt: skip


class RouterLinear(nn.Module):
    """A projection kept out of the linear-layer machinery (prepacking, quantization): the
    router's ``[E, H]`` logits (with a bias for gpt-oss) and Qwen2-MoE's ``[1, H]``
    shared-expert gate, both small and read in the model dtype as transformers reads them."""

    def __init__(self, hidden: int, out: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out, hidden))
        self.bias = nn.Parameter(torch.empty(out)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


def _act_and_mul(act: Callable[[torch.Tensor], torch.Tensor]) -> ActAndMul:
    """act(gate) * up for ``gate_up [N, 2I]``, as PyTorch ops (MLP's unfused chain)."""

    def run(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return act(gate) * up

    return run


# hidden_act -> the experts' activation policy (the C++ experts op's)
_GLU_KINDS = {"silu": GluKind.SILU, "gelu_pytorch_tanh": GluKind.GELU_TANH}


class SparseMoeBlock(nn.Module):
    """A layer's routed experts (and a gated shared expert where the family has one)."""

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        router: RouterConfig,
        act: str = "silu",
        shared_intermediate: int = 0,
        tp: TPGroup = SINGLE,
    ) -> None:
        """``tp``: each rank holds a slice of every expert and of the shared expert."""
        super().__init__()
        if act not in ACTIVATIONS:
            raise ValueError(
                f"unsupported hidden activation {act!r}; kvserve runs {tuple(ACTIVATIONS)}"
            )
        self.router = router
        self.gate = RouterLinear(hidden, router.num_experts)
        self.experts = FusedExperts(router.num_experts, hidden, intermediate, tp)
        self.experts.act_and_mul = _act_and_mul(ACTIVATIONS[act][0])
        self.experts.glu = GluActivation(_GLU_KINDS[act]) if act in _GLU_KINDS else None
        self.fused_act_and_mul = ACTIVATIONS[act][1]  # the C++ op enable_fused_ops switches to
        self.shared_expert: MLP | None = None
        self.shared_expert_gate: RouterLinear | None = None
        if shared_intermediate > 0:
            self.shared_expert = MLP(hidden, shared_intermediate, act, tp)
            self.shared_expert_gate = RouterLinear(hidden, 1)

    def forward(self, x: torch.Tensor, lora: LoRAMapping | None = None) -> torch.Tensor:
        """``x [T, hidden]`` -> ``[T, hidden]``. ``lora`` must be None (no adapters here)."""
        weights, ids = route(self.gate(x), self.router)  # [T, k] each
        out = self.experts(x, weights, ids)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            shared = self.shared_expert(x)
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * shared
        return out


class OlmoeAttention(Attention):
    """OLMoE's attention: RMSNorm over the whole q and k projections before they are split
    into heads (weights ``[H * D]`` and ``[Hkv * D]``), then ``clip_qkv`` clamping; RoPE, the
    KV write and attention as Llama's."""

    def __init__(self, config: PretrainedConfig) -> None:
        bias = bool(getattr(config, "attention_bias", False))
        super().__init__(config, bias, o_bias=bias)
        self.per_head_qk_norm = False
        self.q_norm = RMSNorm(self.q_size, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.kv_size, config.rms_norm_eps)
        clip = getattr(config, "clip_qkv", None)
        self.clip_qkv = float(clip) if clip is not None else None

    def project(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        qkv = super().project(x, batch)  # [T, (H + 2 Hkv) * D]
        assert self.q_norm is not None and self.k_norm is not None
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        qkv = torch.cat([self.q_norm(q.contiguous()), self.k_norm(k.contiguous()), v], dim=-1)
        if self.clip_qkv is not None:
            qkv.clamp_(-self.clip_qkv, self.clip_qkv)
        return qkv


def router_config(config: PretrainedConfig, arch: str) -> RouterConfig:
    """The family's routing rule (``kvserve/moe/router.py``) from its config."""
    if arch == MIXTRAL:
        return RouterConfig(config.num_local_experts, config.num_experts_per_tok,
                            norm_topk_prob=True, float32_weights=True)  # fmt: skip
    return RouterConfig(
        config.num_experts,
        config.num_experts_per_tok,
        norm_topk_prob=bool(getattr(config, "norm_topk_prob", False)),
    )


def is_sparse_layer(config: PretrainedConfig, arch: str, layer: int) -> bool:
    """Whether layer ``layer`` has experts (Qwen: not in ``mlp_only_layers`` and on the
    ``decoder_sparse_step``; Mixtral and OLMoE: every layer)."""
    if arch not in (QWEN2_MOE, QWEN3_MOE):
        return True
    return (
        layer not in (getattr(config, "mlp_only_layers", None) or [])
        and config.num_experts > 0
        and (layer + 1) % config.decoder_sparse_step == 0
    )


def _attention(config: PretrainedConfig, arch: str, layer: int, tp: TPGroup) -> Attention:
    if arch == OLMOE:
        if tp.world_size > 1:  # its q/k norms would need every rank's heads
            raise ValueError(
                "OlmoeForCausalLM does not support tensor parallelism (tensor_parallel_size "
                f"{tp.world_size}): its q/k norms span all heads of the projection"
            )
        return OlmoeAttention(config)
    window = getattr(config, "sliding_window", None) or None  # Qwen2-MoE stores 0 for none
    if arch == QWEN2_MOE:
        return Attention(config, bool(getattr(config, "qkv_bias", True)),
                         sliding_window=layer_window(config, layer), tp=tp)  # fmt: skip
    if arch == QWEN3_MOE:
        bias = bool(getattr(config, "attention_bias", False))
        return Attention(config, bias, o_bias=bias, qk_norm=RMSNorm, sliding_window=window,
                         tp=tp)  # fmt: skip
    return Attention(config, False, sliding_window=window, tp=tp)  # Mixtral


class MoEForCausalLM(LlamaForCausalLM):
    """Qwen2-MoE, Qwen3-MoE, Mixtral and OLMoE: Llama's machinery with sparse MoE layers."""

    architectures = SUPPORTED_ARCHITECTURES
    _streaming: StreamingQuantizer | None = None  # quantize_experts_with
    supports_cuda_graphs = False  # the experts loop reads their token counts on the host
    supports_tensor_parallel = True  # each rank a slice of every expert (not OLMoE)
    supports_lora = False  # adapters on routed experts are not implemented
    # each expert multiplies the rows routed to it together: M depends on the batch
    supports_batch_invariant = False

    @staticmethod
    def quantization_refusal(method: Quantization | None) -> str | None:
        """Why the loader must refuse ``method`` for this class (None: it runs)."""
        if method is None or method in RTN_METHODS or method is Quantization.GGUF:
            return None
        return (
            "only int8/int4 round-to-nearest at load and a GGUF's own blocks are implemented "
            "for MoE experts, not pre-quantized (compressed-tensors, AWQ, GPTQ) checkpoints"
        )

    def quantize_experts_with(self, streaming: StreamingQuantizer) -> None:
        """Quantize each layer's experts (int8/int4 RTN) as soon as all of them have loaded,
        counted in ``streaming``'s report: one layer's dense experts exist at a time."""
        self._streaming = streaming

    def make_layer(self, config: PretrainedConfig, arch: str, layer: int) -> nn.Module:
        act = getattr(config, "hidden_act", "silu")
        mlp: nn.Module | None = None  # the dense MLP of intermediate_size
        if is_sparse_layer(config, arch, layer):
            qwen = arch in (QWEN2_MOE, QWEN3_MOE)  # experts of moe_intermediate_size
            shared = getattr(config, "shared_expert_intermediate_size", 0) or 0
            mlp = SparseMoeBlock(
                config.hidden_size,
                config.moe_intermediate_size if qwen else config.intermediate_size,
                router_config(config, arch),
                act,
                shared_intermediate=int(shared) if arch == QWEN2_MOE else 0,
                tp=self.tp,
            )
        return DecoderLayer(config, _attention(config, arch, layer, self.tp), self.tp, mlp=mlp)

    def enable_fused_ops(self) -> bool:
        """As Llama's, and the experts' act(gate) * up on the same kernel module too; each
        layer's routed experts run as one C++ call on the CPU (``moe/experts_kernel.py``) and
        as two Triton launches on CUDA (``ops/triton/moe.py``; dense experts: quantized ones
        keep the grouped PyTorch path there)."""
        if not super().enable_fused_ops():
            return False
        param = self.embed_tokens.weight
        kernels = fused_kernels_for(param.device, param.dtype)  # C++ on CPU, Triton on CUDA
        for m in self.modules():
            if isinstance(m, SparseMoeBlock):
                m.experts.act_and_mul = getattr(kernels, m.fused_act_and_mul.__name__)
            if isinstance(m, FusedExperts):  # the C++ op on the CPU, the Triton op on CUDA
                m.use_kernel = kernels is cpu_kernels
                m.use_triton = kernels is not cpu_kernels
        return True

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Llama's loading, with Mixtral's names mapped and each per-expert matrix copied
        into its slice of the layer's stacked weights."""
        self._experts_loaded: dict[str, set[tuple[int, str]]] = {}
        super().load_weights(self._expert_stream(weights))

    def _expert_stream(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            name = name.removeprefix("model.").replace(".block_sparse_moe.", ".mlp.")
            m, stacked = _EXPERT_WEIGHT.match(name), _STACKED_WEIGHT.match(name)
            if m is None and stacked is None:
                yield name, tensor
                continue
            module = m[1] if m is not None else stacked[1]  # type: ignore[index]
            experts = self.get_submodule(module)
            assert isinstance(experts, FusedExperts)
            done = self._experts_loaded.setdefault(module, set())
            if m is not None:
                if m[3] not in _PARTS:
                    raise ValueError(f"unexpected weight {name!r} in checkpoint")
                experts.load_expert(int(m[2]), _PARTS[m[3]], tensor)
                done.add((int(m[2]), _PARTS[m[3]]))
            else:  # transformers 5's stacked [E, 2I, H] / [E, H, I]
                assert stacked is not None
                experts.load_stacked(stacked[2], tensor)
                parts = ("gate", "up") if stacked[2] == "gate_up_proj" else ("down",)
                done |= {(e, p) for e in range(experts.num_experts) for p in parts}
            if len(done) == 3 * experts.num_experts and self._streaming is not None:
                self._quantize_experts(module, experts)

    def _quantize_experts(self, module: str, experts: FusedExperts) -> None:
        """RTN of the loaded dense experts, or (``--quantization gguf``) the file's own blocks
        of each expert (``GGUFLinears.take_expert``; a layer the file stores with a type
        kvserve has no quantized layer for keeps its dense experts). Experts are read and
        packed ``load_workers()`` at a time (numpy and torch release the GIL): a layer's
        experts are independent and their decoding and packing is most of a MoE GGUF's load."""
        s = self._streaming
        assert s is not None and s.quant.method is not None
        source = s.source if s.quant.method is Quantization.GGUF else None
        if source is not None and module not in source.experts:  # type: ignore[union-attr]
            return

        def build(job: tuple[str, int]) -> tuple[torch.Tensor, QuantLinear, float | None]:
            pname, e = job
            name, w = f"{module}.{e}.{pname}", getattr(experts, pname)[e]
            if source is not None:
                stored = source.take_expert(module, e, pname)  # type: ignore[union-attr]
                qw, err = layer_weight(s.quant, name, w, stored)
            else:
                qw, err = rtn_weight(w, s.quant.method, s.quant.group_size, name)
            return w, new_quant_layer(name, qw, None, s.device, s.dtype, s.quant.activations), err

        layers: dict[str, list[nn.Module]] = {"gate_up_proj": [], "down_proj": []}
        jobs = [(pname, e) for pname in layers for e in range(experts.num_experts)]
        with ThreadPoolExecutor(load_workers()) as pool:  # results in the jobs' order
            for (pname, e), (w, layer, err) in zip(jobs, pool.map(build, jobs), strict=True):
                count_layer(s.report, w, layer, err, f"{module}.{e}.{pname}")
                layers[pname].append(layer)
        experts.set_quantized(layers["gate_up_proj"], layers["down_proj"])
        trim_heap()

    def _check_all_loaded(self, params: dict[str, nn.Parameter], loaded: set[str]) -> None:
        """Stacked expert weights count as loaded whole (transformers 5's names) or when every
        expert's parts came one by one."""
        rest = dict(params)
        for name, module in self.named_modules():
            if not isinstance(module, FusedExperts):
                continue
            done = self._experts_loaded.get(name, set())
            for pname, parts in (("gate_up_proj", ("gate", "up")), ("down_proj", ("down",))):
                del rest[f"{name}.{pname}"]
                if not {(e, p) for e in range(module.num_experts) for p in parts} <= done:
                    raise ValueError(f"checkpoint is missing weights: {name}.{pname} "
                                     "(some experts)")  # fmt: skip
        super()._check_all_loaded(rest, loaded)
