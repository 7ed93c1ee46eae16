"""The transformers backend: a model's own transformers class on kvserve's paged KV cache.

For an architecture without a native kvserve class (or with ``model_impl="transformers"``)
the model is built by transformers with ``attn_implementation="kvserve"``: every attention
layer then calls :func:`paged_attention_forward` (registered in transformers'
``AttentionInterface``) with its post-RoPE query, key and value. That function writes K/V
through the step's slot mapping and attends through the block tables, as the native Llama
does, so continuous batching, preemption, swap and prefix caching work unchanged.

The step's ``ForwardBatch`` (KV tensors, attention metadata, the attention backend) travels
as one forward keyword argument (:class:`PagedStep`), which transformers hands down to the
attention function: no global forward context. The function calls the batch's backend.
The tokens of a step are one flat sequence (``input_ids [1, T]``, the requests' own
positions as ``position_ids [1, T]``); transformers builds no attention mask
for an implementation that has no mask function registered (``masking_utils``: a name
missing from ``AttentionMaskInterface`` returns ``None``), so the mask comes from the block
tables alone and no dense ``[T, T]`` mask is ever built.

What the paged attention cannot do is refused at load (``ValueError`` naming the
architecture and the reason), never run wrongly: see :func:`check_supported` and
:func:`_attention_options`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch
import transformers
from torch import nn
from transformers import AttentionInterface, PretrainedConfig, PreTrainedModel
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from kvserve.attention.paged import AttentionMetadata
from kvserve.attention.torch_sdpa import TorchSDPABackend
from kvserve.model.architectures import REMOTE_CODE, architecture_name, backend_refusal
from kvserve.model.base import ForwardBatch

ATTN_IMPLEMENTATION = "kvserve"  # the name registered in transformers' AttentionInterface
STEP_KWARG = "kvserve_step"  # the forward keyword argument carrying the PagedStep
ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})


@dataclass
class PagedStep:
    """One forward's paged-attention inputs, passed to transformers as a keyword argument."""

    batch: ForwardBatch  # the step: KV caches, attention metadata and backend
    config: PretrainedConfig  # the model's config (per-layer attention types)
    max_positions: int  # the engine's context limit (a longer window cannot change a score)
    seen: list[int] = field(default_factory=list)  # layers that attended, in call order


def check_supported(config: PretrainedConfig) -> type[PreTrainedModel]:
    """The transformers class that runs ``config`` on kvserve's paged attention, or a
    ``ValueError`` naming the architecture and why it cannot (checks that need no weights)."""
    arch = architecture_name(config)
    if getattr(config, "auto_map", None):
        raise backend_refusal(arch, REMOTE_CODE)
    if getattr(config, "is_encoder_decoder", False):
        raise backend_refusal(
            arch, "it is an encoder-decoder model; kvserve runs decoder-only causal language models"
        )
    cls = getattr(transformers, arch, None)
    if cls is None or arch not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
        raise backend_refusal(
            arch,
            f"it is not a causal language model class of transformers {transformers.__version__}",
        )
    types = set(getattr(config, "layer_types", None) or ())
    if not getattr(config, "num_attention_heads", None) or not types <= ATTENTION_LAYER_TYPES:
        other = sorted(types - ATTENTION_LAYER_TYPES) or ["no attention heads"]
        raise backend_refusal(
            arch,
            f"it has layers without attention ({', '.join(other)}); kvserve's "
            "KV cache holds attention K/V only",
        )
    if not getattr(cls, "_supports_attention_backend", False):
        # vLLM's check too: only these classes promise that every attention goes through
        # the interface (and nothing depends on the mask transformers would have built).
        raise backend_refusal(
            arch,
            "its attention does not go through transformers' attention "
            "interface (_supports_attention_backend is False)",
        )
    return cls


def _layer_window(config: PretrainedConfig, layer: int) -> int | None:
    """The sliding window of ``layer`` as its config declares it (per layer type)."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types is not None:
        return window if types[layer] == "sliding_attention" else None
    return window if getattr(config, "use_sliding_window", True) else None


def _attention_options(module: nn.Module, kwargs: dict[str, Any], step: PagedStep) -> dict:
    """The keyword arguments of the backend's ``forward`` for this layer's call: the one place
    that reads what a layer's attention needs beyond plain causal attention.

    A window at least as long as the context changes no score (position i may see every
    j > i - window, i.e. all of 0..i), so it is dropped. Soft-capping is what the layer
    passes its attention function (``softcap``, as transformers' Gemma 2 does; Gemma 3's
    config field is ignored by transformers too).
    """
    arch, layer = architecture_name(step.config), module.layer_idx
    if getattr(module, "is_causal", True) is False or kwargs.get("is_causal") is False:
        raise backend_refusal(arch, f"layer {layer} attends bidirectionally (is_causal=False)")
    window = kwargs.get("sliding_window", _layer_window(step.config, layer))
    if window is not None and int(window) >= step.max_positions:
        window = None
    soft_cap = kwargs.get("softcap")
    options: dict[str, Any] = {
        "sliding_window": None if window is None else int(window),
        "soft_cap": None if soft_cap is None else float(soft_cap),
    }
    if kwargs.get("s_aux") is not None:  # gpt-oss's attention sinks, [H]
        options["sinks"] = kwargs["s_aux"]
    return options


def paged_attention_forward(
    module: nn.Module,
    query: torch.Tensor,  # [1, H, T, D] after RoPE
    key: torch.Tensor,  # [1, Hkv, T, D] after RoPE
    value: torch.Tensor,  # [1, Hkv, T, D]
    attention_mask: torch.Tensor | None,  # None: transformers builds none for this backend
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature over kvserve's paged KV cache."""
    step = kwargs.get(STEP_KWARG)
    if not isinstance(step, PagedStep):
        raise RuntimeError(
            f"attn_implementation {ATTN_IMPLEMENTATION!r} runs inside kvserve's engine only "
            f"(the forward needs its {STEP_KWARG} argument)"
        )
    if query.shape[0] != 1:
        raise RuntimeError("kvserve's flat batch has batch size 1")
    layer = module.layer_idx
    options = _attention_options(module, kwargs, step)
    k_cache, v_cache = step.batch.kv_caches[layer]
    q = query[0].transpose(0, 1).contiguous()  # [T, H, D]
    k = key[0].transpose(0, 1)  # [T, Hkv, D]
    v = value[0].transpose(0, 1)
    if k.shape[1:] != (k_cache.shape[1], k_cache.shape[3]) or v.shape != k.shape:
        raise backend_refusal(
            architecture_name(step.config),
            f"layer {layer}'s K/V heads are {tuple(k.shape[1:])} and {tuple(v.shape[1:])}, "
            f"the KV cache's (from the config) {(k_cache.shape[1], k_cache.shape[3])}",
        )
    backend, md = step.batch.attn_backend, step.batch.attn_metadata
    backend.write_kv(k, v, k_cache, v_cache, md)
    scale = kwargs.get("scaling")
    scale = float(query.shape[-1] ** -0.5 if scale is None else scale)
    out = backend.forward(q, k_cache, v_cache, md, scale, **options)  # [T, H, D]
    step.seen.append(layer)
    return out.unsqueeze(0), None  # [1, T, H, D]


AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)


class TransformersForCausalLM(nn.Module):
    """A transformers ``*ForCausalLM`` behind kvserve's model interface (``base.CausalLM``).

    ``forward`` runs the decoder body (``hf.base_model``: embeddings, layers, final norm) and
    returns the final hidden states; ``compute_logits`` applies the LM head and the logits
    post-processing of the class's own ``forward``, which the load-time probe checks.
    """

    # what ``registry.on_transformers_backend`` reads (that module never imports this one)
    transformers_backend: ClassVar[bool] = True

    def __init__(self, hf: PreTrainedModel, max_positions: int) -> None:
        super().__init__()
        self.hf = hf
        self.config: PretrainedConfig = hf.config
        self.arch = architecture_name(self.config)
        self.max_positions = max_positions
        body = hf.base_model
        if body is hf or hf.get_output_embeddings() is None:
            raise backend_refusal(self.arch, "it has no separate decoder body and LM head")
        self.body: nn.Module = body
        cfg = self.config
        heads = int(cfg.num_attention_heads)
        self._head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
        self._num_kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
        self._num_layers = int(cfg.num_hidden_layers)
        # The logits post-processing of the tested classes' forward (Gemma 2/3, Granite,
        # Cohere); any other is caught by the probe in ``check_logits``.
        self.logit_scale = getattr(cfg, "logit_scale", None)  # Cohere: logits * scale
        self.logits_scaling = getattr(cfg, "logits_scaling", None)  # Granite: logits / s
        self.final_softcap = getattr(cfg, "final_logit_softcapping", None)  # Gemma 2/3

    @property
    def head_dim(self) -> int:
        return self._head_dim

    @property
    def num_kv_heads(self) -> int:
        return self._num_kv_heads

    @property
    def num_layers(self) -> int:
        return self._num_layers

    @property
    def fused_ops_enabled(self) -> bool:
        return False

    def enable_fused_ops(self) -> bool:
        """transformers' own modules run; kvserve's fused kernels are for its native ones."""
        return False

    def enable_decode_loop(self) -> bool:
        """transformers' layers run in Python; the C++ decode loop is for native ones."""
        return False

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """The final hidden states ``[T, hidden]``; K/V written through the batch's backend."""
        return self._body(PagedStep(batch, self.config, self.max_positions))

    def _body(self, step: PagedStep) -> torch.Tensor:
        out = self.body(
            input_ids=step.batch.input_ids.unsqueeze(0),  # [1, T]: one flat sequence
            position_ids=step.batch.positions.unsqueeze(0),  # [1, T]
            use_cache=False,  # kvserve's paged cache holds K/V, not transformers' Cache
            **{STEP_KWARG: step},
        )
        return out.last_hidden_state[0]  # [T, hidden]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, hidden]`` -> ``[N, vocab]``, as the class's own ``forward`` computes them."""
        logits = self.hf.get_output_embeddings()(hidden)
        if self.logit_scale is not None:
            logits = logits * self.logit_scale
        if self.logits_scaling is not None:
            logits = logits / self.logits_scaling
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits

    @torch.inference_mode()
    def check_logits(self, num_tokens: int = 3) -> None:
        """The load-time probe: one short prompt through a scratch KV cache. Every layer
        must attend through kvserve's function exactly once, in order (a layer that does
        not would run without kvserve's K/V), its attention options must be supported,
        and ``compute_logits`` must give what the class's own ``forward`` gives."""
        ids = torch.arange(num_tokens) % int(self.config.vocab_size)
        device = self.hf.get_output_embeddings().weight.device
        ids, pos = ids.to(device), torch.arange(num_tokens, device=device)
        steps = [self._scratch_step(ids, pos) for _ in range(2)]
        hidden = self._body(steps[0])
        if steps[0].seen != list(range(self.num_layers)):
            raise backend_refusal(
                self.arch,
                f"its layers attended through kvserve as {steps[0].seen}, "
                f"not once each of its {self.num_layers} layers",
            )
        theirs = self.hf(
            input_ids=ids[None], position_ids=pos[None], use_cache=False, **{STEP_KWARG: steps[1]}
        ).logits[0]  # [T, V]
        ours = self.compute_logits(hidden)
        if not torch.allclose(ours.float(), theirs.float(), rtol=1e-2, atol=1e-3):
            raise backend_refusal(
                self.arch,
                "its forward post-processes the logits in a way kvserve does not reproduce",
            )

    def _scratch_step(self, ids: torch.Tensor, pos: torch.Tensor) -> PagedStep:
        """The probe's step: ``ids``/``pos`` ``[n]`` in one block, on the reference backend
        (the probe checks the layers' structure, not a backend)."""
        n, device = ids.shape[0], ids.device
        dtype = self.hf.get_output_embeddings().weight.dtype
        shape = (1, self.num_kv_heads, n, self.head_dim)  # one block of n tokens
        kv = [(torch.zeros(shape, dtype=dtype, device=device),
               torch.zeros(shape, dtype=dtype, device=device))
              for _ in range(self.num_layers)]  # fmt: skip
        md = AttentionMetadata(
            slot_mapping=torch.arange(n, device=device),
            query_start_loc=[0, n],
            seq_lens=[n],
            block_tables=torch.zeros((1, 1), dtype=torch.long, device=device),
            block_size=n,
        )
        batch = ForwardBatch(ids, pos, kv, md, TorchSDPABackend(device))
        return PagedStep(batch, self.config, self.max_positions)


def load_transformers_model(
    path: Path, config: PretrainedConfig, dtype: torch.dtype, device: str | torch.device,
    max_positions: int,
) -> TransformersForCausalLM:  # fmt: skip
    """Build the checkpoint's transformers class on kvserve's attention (safetensors only,
    no remote code), then run the load-time probe."""
    cls = check_supported(config)
    hf = cls.from_pretrained(
        path,
        config=config,
        local_files_only=True,
        use_safetensors=True,
        trust_remote_code=False,
        dtype=dtype,
        attn_implementation=ATTN_IMPLEMENTATION,
    )
    hf.to(device)
    hf.eval()
    model = TransformersForCausalLM(hf, max_positions)
    model.check_logits()
    return model
