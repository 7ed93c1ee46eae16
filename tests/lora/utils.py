"""Helpers for LoRA tests: PEFT adapters with random non-zero A and B over a tiny model, and
the merged model (peft's ``merge_and_unload``) as the reference."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, PreTrainedModel


@dataclass(frozen=True)
class AdapterSpec:
    r: int
    alpha: int
    targets: tuple[str, ...]
    rslora: bool = False


ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SPECS = {
    "all8": AdapterSpec(8, 16, ALL),
    "qv4": AdapterSpec(4, 8, ("q_proj", "v_proj")),  # the fused QKV's k slice untouched
    "mlp16rs": AdapterSpec(16, 32, ("gate_proj", "up_proj", "down_proj"), rslora=True),
    "mixed2": AdapterSpec(2, 4, ("k_proj", "o_proj", "down_proj")),
}


def make_adapter(base: Path, out: Path, spec: AdapterSpec, seed: int) -> Path:
    """A PEFT folder whose A and B are both random (peft starts B at zero): the adapter
    changes the outputs, so a wrong slice or scaling changes the tokens."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    cfg = LoraConfig(
        r=spec.r, lora_alpha=spec.alpha, target_modules=list(spec.targets),
        init_lora_weights=False, use_rslora=spec.rslora,
    )  # fmt: skip
    peft_model = get_peft_model(model, cfg)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:  # small enough to keep logits sane, large enough to matter
                p.copy_(torch.randn_like(p) * 0.3)
    peft_model.save_pretrained(out)
    return out


def merged_model(base: Path, adapter: Path | None) -> PreTrainedModel:
    """The base model with the adapter merged in (float32), or the base model alone."""
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    return model.eval()


def hf_greedy(model: torch.nn.Module, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy tokens as kvserve's ``ignore_eos`` makes them: EOS may be chosen, and does not
    stop (``min_new_tokens`` would mask EOS instead: other tokens where EOS is the argmax)."""
    out = model.generate(  # type: ignore[operator]
        torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False, pad_token_id=0,
        eos_token_id=None,
    )  # fmt: skip
    return out[0, len(prompt) :].tolist()
