"""``--quantization-lm-head``: the LM head as a quantized layer too.

By default the LM head stays in the model dtype (``apply.py``). It is one matrix, but a large
one at decode: TinyLlama-1.1B's (32000 x 2048) is 131 MB in bf16 against 0.6 GB for all its
int4 layers, and the built-in model's (49152 x 576, tied to the embeddings) is a third of its
bytes once the rest is int4. llama.cpp quantizes it too (``llama-quantize`` keeps it at Q6_K
for a Q4_0 model). With the option:

* int8, int4 and compressed-tensors: round-to-nearest int8 with one scale per vocabulary row
  (int4 would move every logit four bits' worth; llama.cpp keeps more bits here as well);
* gguf: the file's own output tensor (``token_embd.weight`` where the file ties them) when its
  type is one kvserve keeps quantized (Q8_0, Q6_K, Q4_0, Q4_1, Q4_K), else int8 as above.

Unset (``None``, the default), the option is on exactly for ``--quantization gguf`` files whose
head is of a kept type, on a native unsharded model (``wants_quantized_head``): llama.cpp runs
the file's head, and a bf16 copy of it was a third of what a Qwen3-0.6B Q4_K_M decode step read.

A tied LM head gets its own quantized copy; the embedding table keeps the dtype weight.
The layer is a ``QuantLinear`` (same kernels, same activations option); a vocabulary that is
not a multiple of 16 rows (the kernels' channel block) is padded with zero rows whose logits
are cut off. Native model classes only: the transformers backend computes its logits through
the Hugging Face module (``transformers_backend.py``).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from kvserve.config import Quantization
from kvserve.quantization.apply import QuantOptions, QuantReport, rtn_weight
from kvserve.quantization.qlinear import QuantLinear
from kvserve.quantization.qweight import QuantizedWeight, SuperScales, concat_rows
from kvserve.quantization.streaming import trim_heap

logger = logging.getLogger(__name__)

ROW_BLOCK = 16  # the kernels' output-channel block


class QuantLMHead(nn.Module):
    """``[N, hidden]`` -> ``[N, vocab]`` logits through a ``QuantLinear`` of ``padded`` rows
    (``vocab`` rounded up to ``ROW_BLOCK``), the padding's logits cut off."""

    def __init__(self, layer: QuantLinear, vocab_size: int) -> None:
        super().__init__()
        self.layer = layer
        self.vocab_size = vocab_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.layer(x)  # [N, padded]
        if logits.shape[-1] == self.vocab_size:
            return logits
        return logits[..., : self.vocab_size].contiguous()  # [N, vocab]


def wants_quantized_head(quant: QuantOptions, native: bool, tp_size: int) -> bool:
    """``quantization_lm_head`` resolved: as given, or unset (None) on for a GGUF on a native
    model without tensor parallelism (``lm_head_weight`` then keeps a float head dense: the
    file's head type is only known once it is read, and reading a GGUF's headers took 5 s for
    a 151,936-token vocabulary, so it is read once)."""
    if quant.lm_head is not None:
        return quant.lm_head
    return quant.method is Quantization.GGUF and native and tp_size == 1


def pad_rows(qw: QuantizedWeight, multiple: int = ROW_BLOCK) -> QuantizedWeight:
    """``qw`` with zero rows (code 0, scale 0, zero 0: weights 0) up to a multiple of rows."""
    n, k = qw.shape
    extra = -n % multiple
    if extra == 0:
        return qw
    groups = qw.scales.shape[1]
    zeros = None if qw.zeros is None else torch.zeros(extra, groups, dtype=qw.zeros.dtype)
    supers = None
    if qw.supers is not None:  # zero rows of the two levels too, so the padded head keeps them
        sup = qw.supers
        supers = SuperScales(*(None if t is None else torch.zeros(extra, t.shape[1], dtype=t.dtype)
                               for t in (sup.d, sup.sc, sup.dmin, sup.m)))  # fmt: skip
    pad = QuantizedWeight(torch.zeros(extra, k, dtype=torch.int8),
                          torch.zeros(extra, groups, dtype=qw.scales.dtype), zeros, qw.bits,
                          qw.group_size, supers=supers)  # fmt: skip
    return concat_rows([qw, pad])


def lm_head_weight(weight: torch.Tensor, quant: QuantOptions) -> tuple[QuantizedWeight, str] | None:
    """The quantized LM head for ``weight [vocab, hidden]`` (the model's, possibly the tied
    embedding table) and how it was quantized, for the report; None where the option is
    unset and the GGUF's head is stored as floats (or a type with no quantized layer)."""
    if quant.method is Quantization.GGUF:
        from kvserve.quantization.gguf_weights import read_output_weight

        assert quant.gguf_file is not None  # ModelConfig checks it
        stored = read_output_weight(quant.gguf_file)
        if stored is not None:
            qw, type_name = stored
            if qw.shape != tuple(weight.shape):
                raise ValueError(f"the GGUF's output tensor has shape {qw.shape}, the model's "
                                 f"LM head {tuple(weight.shape)}")  # fmt: skip
            return qw, type_name
        if quant.lm_head is None:
            return None
    qw, err = rtn_weight(weight, Quantization.INT8, None, "lm_head")
    return qw, f"int8 per channel (RTN error {err:.4f})"


def quantize_lm_head(
    model: nn.Module, quant: QuantOptions, device: torch.device, dtype: torch.dtype,
    report: QuantReport,
) -> None:  # fmt: skip
    """Replace ``model.lm_head`` (a loaded native model's) by a ``QuantLMHead``; noted in
    ``report.lm_head``."""
    head = getattr(model, "lm_head", None)
    if not isinstance(head, nn.Linear) or not hasattr(model, "embed_tokens"):
        raise ValueError(
            "quantization_lm_head (--quantization-lm-head) needs one of kvserve's native "
            f"model classes; {type(model).__name__} computes its logits another way"
        )
    vocab = head.out_features
    quantized = lm_head_weight(head.weight, quant)
    if quantized is None:
        logger.info("the GGUF's LM head is stored as floats: it keeps the model dtype")
        return
    qw, how = quantized
    # Drop the dense head (an untied one's weight is freed) before the codes are packed: less
    # at once. Measured peak RSS, TinyLlama-1.1B int4 server: see docs/performance.md.
    model.lm_head = None
    del head
    trim_heap()
    layer = QuantLinear(pad_rows(qw), None, device, dtype, quant.activations)
    nbytes = layer.nbytes  # as packed for its kernel
    del qw
    model.lm_head = QuantLMHead(layer, vocab)
    trim_heap()
    report.lm_head = how
    acts = "int8" if layer.int8_activations else "model dtype"
    logger.info("quantized the LM head: %s, %.1f MiB; activations: %s", how, nbytes / 2**20, acts)
