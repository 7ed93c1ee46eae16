"""Top-k expert routing: a token's router logits -> its k experts and their weights.

The families differ in small ways that change the numbers, so each is one ``RouterConfig``
(a frozen contract) rather than a class:

- Qwen2-MoE / Qwen3-MoE / OLMoE: softmax over all experts in float32, top-k, optionally
  renormalised over the k (``norm_topk_prob``: Qwen3-MoE's checkpoints set it, Qwen2-MoE and
  OLMoE's do not), then the weights are rounded to the model dtype before they scale the
  experts' outputs (transformers' ``*TopKRouter``).
- Mixtral: the same softmax, top-k and renormalisation (always), but the weights stay float32,
  so in bf16 each expert's output is scaled in float32 and rounded once.
  ``Scoring.TOPK_SOFTMAX`` is Mixtral's original formulation (softmax over the k largest
  logits, as mistral-inference and vLLM's fused kernel compute it): equal to softmax -> top-k
  -> renormalise up to float32 rounding (tested), and cheaper (k exponentials, not E).
- gpt-oss: ``Scoring.TOPK_SOFTMAX`` on logits from a router WITH a bias (the router's own
  ``F.linear``; ``kvserve/model/gpt_oss.py``), weights in the model dtype. transformers takes
  the softmax in the logits' dtype; here it is float32 then rounded, the same in float32.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch


class Scoring(enum.Enum):
    SOFTMAX_TOPK = "softmax_topk"  # softmax over all experts, then the k largest
    TOPK_SOFTMAX = "topk_softmax"  # the k largest logits, then softmax over those k


@dataclass(frozen=True)
class RouterConfig:
    num_experts: int
    top_k: int
    norm_topk_prob: bool = False  # renormalise the k weights to sum to 1 (SOFTMAX_TOPK)
    scoring: Scoring = Scoring.SOFTMAX_TOPK
    float32_weights: bool = False  # keep the weights in float32 (Mixtral); else model dtype

    def __post_init__(self) -> None:
        if self.num_experts < 1:
            raise ValueError(f"num_experts must be at least 1, got {self.num_experts}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok must be in [1, num_experts={self.num_experts}], "
                f"got {self.top_k}"
            )


def route(logits: torch.Tensor, cfg: RouterConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits [T, E]`` (model dtype) -> ``(weights [T, k], ids [T, k] int64)``; weights in
    float32 if ``cfg.float32_weights`` else in the logits' dtype. Ties between equal scores
    go as ``torch.topk`` breaks them (the same choice transformers makes)."""
    if cfg.scoring is Scoring.TOPK_SOFTMAX:
        top, ids = torch.topk(logits.float(), cfg.top_k, dim=-1)  # [T, k]
        weights = torch.softmax(top, dim=-1)
    else:
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)  # [T, E]
        weights, ids = torch.topk(probs, cfg.top_k, dim=-1)  # [T, k]
        if cfg.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
    if not cfg.float32_weights:
        weights = weights.to(logits.dtype)
    return weights, ids
