"""gpt-oss (transformers' ``GptOssForCausalLM``) on the MoE decoder's machinery (``moe.py``,
``llama.py``): paged attention with its backends, RoPE, RMSNorm, grouped experts.

What differs from the other MoE families, as transformers 5's ``modeling_gpt_oss.py`` computes
it:
- attention sinks: a learned logit per query head (``self_attn.sinks``) joins every query's
  softmax denominator and takes no value (``Attention(sinks=True)``, passed to the backend as
  ``sinks``); q/k/v and o projections with biases (``attention_bias``);
- ``layer_types`` alternating ``sliding_attention`` (``sliding_window`` keys) and
  ``full_attention``; YaRN RoPE (``rope_parameters``, transformers' own ``yarn`` init);
- the router is a linear layer WITH a bias, top-k of its logits, then softmax over the k
  (``Scoring.TOPK_SOFTMAX``);
- the experts carry biases and use a clamped SwiGLU (``GluKind.CLAMPED_SWIGLU``):
  ``gate.clamp(max=limit)``, ``up.clamp(-limit, limit)``,
  ``(up + 1) * gate * sigmoid(alpha * gate)``;
- the checkpoint stacks the experts as ``gate_up_proj [E, H, 2I]`` (applied as ``x @ W``, the
  gate and up columns interleaved: gate ``[..., ::2]``, up ``[..., 1::2]``) with
  ``gate_up_proj_bias [E, 2I]`` (interleaved the same way), and ``down_proj [E, I, H]`` with
  ``down_proj_bias [E, H]``. They load transposed and de-interleaved into ``FusedExperts``'
  ``[E, 2I, H]`` (gate rows, then up rows) and ``[E, H, I]``. OpenAI's published checkpoints
  store the experts in MXFP4 (``*_blocks``/``*_scales``, ``[E, rows, cols]`` orientation):
  they are dequantized to the model dtype at load (``quantization/mxfp4.py``), or with
  ``--quantization mxfp4`` (vLLM's name) kept as stored, each expert a quantized layer of exact
  8-bit codes and a power-of-two scale per 32 weights (``mxfp4_qweight``). llama.cpp's
  GGUF files (``gpt-oss``) hold each expert's gate, up and down separately, their biases
  likewise (``gguf_names``); ``--quantization gguf`` keeps their MXFP4 blocks as the same
  codes and scales (``gguf_blocks``).

Numbers: in float32 every step is transformers'; in bf16 transformers keeps the RMSNorm
weights in float32 (``_keep_in_fp32_modules``) and takes the router and attention softmaxes in
bf16, where kvserve rounds the norm weight to bf16 and takes those softmaxes in float32.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import nn
from transformers import PretrainedConfig

from kvserve.config import Quantization
from kvserve.distributed.parallel_state import SINGLE, TPGroup
from kvserve.lora.punica import LoRAMapping
from kvserve.model.llama import Attention, DecoderLayer, layer_window
from kvserve.model.moe import MoEForCausalLM, RouterLinear
from kvserve.moe.experts import FusedExperts, GluActivation, GluKind, act_and_mul_for
from kvserve.moe.router import RouterConfig, Scoring, route
from kvserve.ops.malloc_tuning import trim_heap
from kvserve.quantization.apply import RTN_METHODS, count_layer, load_workers, new_quant_layer
from kvserve.quantization.mxfp4 import dequantize_mxfp4, mxfp4_qweight
from kvserve.quantization.qlinear import QuantLinear

GPT_OSS = "GptOssForCausalLM"

# layers.<i>.mlp.experts.<gate_up_proj|down_proj>[_bias|_blocks|_scales]
_EXPERTS = re.compile(
    r"^(layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)(_bias|_blocks|_scales)?$"
)
_SINKS = re.compile(r"^layers\.\d+\.self_attn\.sinks$")
# a GGUF's stacked expert biases, one projection each (gguf_names; its expert matrices come
# one expert at a time under the other MoE families' names, ``MoEForCausalLM``'s stream)
_PART_BIAS = re.compile(r"^(layers\.\d+\.mlp\.experts)\.(gate|up|down)_proj_bias$")


def load_stacked_experts(experts: FusedExperts, name: str, tensor: torch.Tensor) -> None:
    """Copy one of gpt-oss's stacked expert tensors, as transformers' ``GptOssExperts`` holds
    them, into ``experts`` (this rank's slices): ``gate_up_proj [E, H, 2I]`` (``x @ W``, gate
    and up columns interleaved), ``gate_up_proj_bias [E, 2I]`` (interleaved), ``down_proj
    [E, I, H]``, ``down_proj_bias [E, H]``."""
    e = experts.num_experts
    if tensor.dim() < 2 or tensor.shape[0] != e:
        raise ValueError(f"experts.{name} has shape {tuple(tensor.shape)}, expected [{e}, ...]")
    if name == "gate_up_proj_bias":
        experts.load_bias("gate", tensor[:, ::2])
        experts.load_bias("up", tensor[:, 1::2])
    elif name == "down_proj_bias":
        experts.load_bias("down", tensor)
    elif name == "gate_up_proj":
        for i in range(e):
            experts.load_expert(i, "gate", tensor[i, :, ::2].T)
            experts.load_expert(i, "up", tensor[i, :, 1::2].T)
    elif name == "down_proj":
        for i in range(e):
            experts.load_expert(i, "down", tensor[i].T)
    else:
        raise ValueError(f"unexpected expert tensor experts.{name}")


class GptOssMoeBlock(nn.Module):
    """A gpt-oss layer's MLP: the biased router, top-k then softmax, the biased experts with
    the clamped SwiGLU. Parameter names as the checkpoint's (``mlp.router``, ``mlp.experts``)."""

    def __init__(self, config: PretrainedConfig, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        e, hidden = config.num_local_experts, config.hidden_size
        self.route_config = RouterConfig(e, config.num_experts_per_tok,
                                         scoring=Scoring.TOPK_SOFTMAX)  # fmt: skip
        self.router = RouterLinear(hidden, e, bias=True)
        self.experts = FusedExperts(e, hidden, config.intermediate_size, tp, bias=True)
        act = GluActivation(GluKind.CLAMPED_SWIGLU, float(config.swiglu_alpha),
                            float(config.swiglu_limit))  # fmt: skip
        self.experts.act_and_mul = act_and_mul_for(act)
        self.experts.glu = act

    def forward(self, x: torch.Tensor, lora: LoRAMapping | None = None) -> torch.Tensor:
        """``x [T, hidden]`` -> ``[T, hidden]``. ``lora`` must be None (no adapters here)."""
        weights, ids = route(self.router(x), self.route_config)  # [T, k] each
        return self.experts(x, weights, ids)


class GptOssForCausalLM(MoEForCausalLM):
    """gpt-oss: Llama's layers with attention sinks, biases everywhere, alternating sliding
    windows, and ``GptOssMoeBlock`` as every layer's MLP."""

    architectures = (GPT_OSS,)

    @staticmethod
    def quantization_refusal(method: Quantization | None) -> str | None:
        """int8/int4 round-to-nearest run (the experts' matrices as the other families', their
        biases kept in the model dtype), mxfp4 keeps an MXFP4 checkpoint's experts as stored
        and gguf a GGUF's blocks; pre-quantized checkpoints do not."""
        allowed = (Quantization.MXFP4, Quantization.GGUF)
        if method is None or method in RTN_METHODS or method in allowed:
            return None
        return (
            "only int8/int4 round-to-nearest at load, mxfp4 (an MXFP4 checkpoint's experts "
            "as stored) and a GGUF's own blocks are implemented for gpt-oss's experts, not "
            "pre-quantized (compressed-tensors, AWQ, GPTQ) checkpoints; without mxfp4 its "
            "MXFP4 checkpoints load dequantized to the model dtype"
        )

    def make_layer(self, config: PretrainedConfig, arch: str, layer: int) -> nn.Module:
        bias = bool(getattr(config, "attention_bias", True))
        attn = Attention(config, bias, o_bias=bias, sliding_window=layer_window(config, layer),
                         sinks=True, tp=self.tp)  # fmt: skip
        return DecoderLayer(config, attn, self.tp, mlp=GptOssMoeBlock(config, self.tp))

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Llama's loading, with the sinks (this rank's heads) and the stacked experts (dense
        or MXFP4) taken out of the stream and copied into place here."""
        self._extra_loaded: set[str] = set()  # bias and sink parameters loaded here
        self._bias_parts: dict[str, set[str]] = {}  # a GGUF's expert biases loaded, by layer
        self._mxfp4: dict[str, torch.Tensor] = {}  # a *_blocks or *_scales awaiting its pair
        # --quantization mxfp4: a layer's quantized experts of one projection, awaiting the other
        self._mxfp4_layers: dict[str, dict[str, list[nn.Module]]] = {}
        super().load_weights(weights)
        if self._mxfp4:
            raise ValueError(f"MXFP4 blocks without scales (or scales without blocks): "
                             f"{sorted(self._mxfp4)[:4]}")  # fmt: skip

    def _expert_stream(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """gpt-oss's own tensors taken here; per-expert matrices (a GGUF's) go on to the
        other MoE families' stream, the rest to Llama's loading."""
        return super()._expert_stream(self._gpt_oss_stream(weights))

    def _gpt_oss_stream(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            name = name.removeprefix("model.")
            m, bias = _EXPERTS.match(name), _PART_BIAS.match(name)
            if _SINKS.match(name):
                self._load_sinks(name, tensor)
            elif bias is not None:
                self._load_part_bias(bias[1], bias[2], tensor)
            elif m is None:
                yield name, tensor
            elif m[3] in ("_blocks", "_scales"):
                self._take_mxfp4(m[1], m[2], m[3], tensor)
            else:
                self._load_experts(m[1], m[2] + (m[3] or ""), tensor)

    def _load_sinks(self, name: str, tensor: torch.Tensor) -> None:
        attn = self.get_submodule(name.removesuffix(".sinks"))
        assert isinstance(attn, Attention) and attn.sinks is not None
        h = attn.num_heads  # this rank's query heads, a contiguous run as the q projection's
        if tuple(tensor.shape) != (h * self.tp.world_size,):
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected "
                             f"({h * self.tp.world_size},)")  # fmt: skip
        attn.sinks.copy_(tensor.narrow(0, self.tp.rank * h, h))
        self._extra_loaded.add(name)

    def _load_part_bias(self, module: str, part: str, tensor: torch.Tensor) -> None:
        """One projection's biases of every expert, ``[E, I]`` (gate, up) or ``[E, H]``."""
        experts = self.get_submodule(module)
        assert isinstance(experts, FusedExperts)
        experts.load_bias(part, tensor)
        done = self._bias_parts.setdefault(module, set())
        done.add(part)
        if "down" in done:
            self._extra_loaded.add(f"{module}.down_bias")
        if {"gate", "up"} <= done:
            self._extra_loaded.add(f"{module}.gate_up_bias")

    def _take_mxfp4(self, module: str, proj: str, part: str, tensor: torch.Tensor) -> None:
        """Hold a ``*_blocks`` or ``*_scales`` tensor until its pair arrives, then dequantize
        the pair one expert at a time (a whole gpt-oss-20b ``gate_up_proj`` in float32 would
        be 2 GB at once) into this rank's slices."""
        other = f"{module}.{proj}{'_scales' if part == '_blocks' else '_blocks'}"
        if other not in self._mxfp4:
            self._mxfp4[f"{module}.{proj}{part}"] = tensor
            return
        pair = self._mxfp4.pop(other)
        blocks, scales = (tensor, pair) if part == "_blocks" else (pair, tensor)
        experts = self.get_submodule(module)
        assert isinstance(experts, FusedExperts)
        if blocks.dim() != 4 or blocks.shape[0] != experts.num_experts:
            raise ValueError(f"{module}.{proj}_blocks has shape {tuple(blocks.shape)}, "
                             f"expected [{experts.num_experts}, rows, cols / 32, 16]")  # fmt: skip
        if self._keeps_mxfp4():
            self._keep_mxfp4(module, proj, experts, blocks, scales)
            return
        dtype = self.embed_tokens.weight.dtype
        for e in range(experts.num_experts):
            w = dequantize_mxfp4(blocks[e], scales[e], dtype)  # [rows, cols]: a linear weight
            if proj == "gate_up_proj":  # [2I, H], gate and up rows interleaved
                experts.load_expert(e, "gate", w[::2])
                experts.load_expert(e, "up", w[1::2])
            else:  # [H, I]
                experts.load_expert(e, "down", w)
        self._experts_done(module, experts, proj)

    def _keeps_mxfp4(self) -> bool:
        """``--quantization mxfp4``: the experts stay as the checkpoint stores them."""
        s = self._streaming
        return s is not None and s.quant.method is Quantization.MXFP4

    def _keep_mxfp4(
        self,
        module: str,
        proj: str,
        experts: FusedExperts,
        blocks: torch.Tensor,
        scales: torch.Tensor,
    ) -> None:
        """Each expert's ``proj`` as a quantized layer of its blocks (``mxfp4_qweight``:
        exact 8-bit codes; gate_up's interleaved gate and up rows de-interleaved, gate first,
        as the dense path does); once both projections of the layer are in, the experts run
        them (``FusedExperts.set_quantized``). The stacked dense weights are never written."""
        s = self._streaming
        assert s is not None

        def build(e: int) -> QuantLinear:  # on load_workers() threads, as moe.py's experts
            b, sc = blocks[e], scales[e]  # [rows, G, 16], [rows, G]
            if proj == "gate_up_proj":  # rows gate0, up0, gate1, ...: gate rows, then up rows
                b, sc = torch.cat([b[0::2], b[1::2]]), torch.cat([sc[0::2], sc[1::2]])
            return new_quant_layer(f"{module}.{e}.{proj}", mxfp4_qweight(b, sc), None,
                                   s.device, s.dtype, s.quant.activations)  # fmt: skip

        layers: list[nn.Module] = []
        with ThreadPoolExecutor(load_workers()) as pool:  # results in expert order
            for e, layer in enumerate(pool.map(build, range(experts.num_experts))):
                w = getattr(experts, proj)[e]  # [rows, cols]: the shape, never read
                count_layer(s.report, w, layer, None, f"{module}.{e}.{proj}")
                layers.append(layer)
        held = self._mxfp4_layers.setdefault(module, {})
        held[proj] = layers
        if len(held) == 2:
            experts.set_quantized(held.pop("gate_up_proj"), held.pop("down_proj"))
            trim_heap()
        self._experts_done(module, experts, proj)

    def _load_experts(self, module: str, name: str, tensor: torch.Tensor) -> None:
        """One of the checkpoint's stacked expert tensors (dense orientation, ``x @ W``)."""
        experts = self.get_submodule(module)
        assert isinstance(experts, FusedExperts)
        load_stacked_experts(experts, name, tensor)
        if name.endswith("_bias"):
            self._extra_loaded.add(f"{module}.{name.replace('_proj_', '_')}")
        else:
            self._experts_done(module, experts, name)

    def _experts_done(self, module: str, experts: FusedExperts, proj: str) -> None:
        """Count ``proj`` of every expert of ``module`` as loaded; once all are, int8/int4
        quantize the layer's experts (``quantize_experts_with``) right away."""
        parts = ("gate", "up") if proj == "gate_up_proj" else ("down",)
        done = self._experts_loaded.setdefault(module, set())
        done |= {(i, p) for i in range(experts.num_experts) for p in parts}
        if (
            len(done) == 3 * experts.num_experts
            and self._streaming is not None
            and not self._keeps_mxfp4()  # MXFP4 experts are set by _keep_mxfp4
        ):
            self._quantize_experts(module, experts)

    def _check_all_loaded(self, params: dict[str, nn.Parameter], loaded: set[str]) -> None:
        super()._check_all_loaded(params, loaded | self._extra_loaded)
