"""Tiny random models with the built-in model's tokenizer (vocab 49152: real "yes"/"no" and
ChatML tokens), for score/rerank and sleep tests, and transformers' references for scores."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from kvserve.scoring import reranker_prompt

SHAPE = {
    "vocab_size": 49152,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
}


def make_model(arch: str, path: Path, builtin_dir: Path) -> PreTrainedModel:
    """A random tiny ``llama`` (the embedding scorer's) or ``qwen3`` (the reranker's, as
    Qwen3-Reranker is) saved to ``path`` in float32 with the built-in tokenizer."""
    torch.manual_seed(0)
    if arch == "qwen3":
        model: PreTrainedModel = Qwen3ForCausalLM(Qwen3Config(**SHAPE, head_dim=16))
    else:
        model = LlamaForCausalLM(LlamaConfig(**SHAPE))
    model.eval()
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (builtin_dir / name).is_file():
            shutil.copy(builtin_dir / name, path / name)
    return model


def reranker_reference(
    model: PreTrainedModel, tok: PreTrainedTokenizerBase, query: str, doc: str
) -> float:
    """Qwen3-Reranker's rule computed with transformers: P(yes) of the softmax over the
    last position's [logit(no), logit(yes)] (its model card's code)."""
    ids = tok.encode(reranker_prompt(query, doc), add_special_tokens=False)
    no, yes = tok.convert_tokens_to_ids("no"), tok.convert_tokens_to_ids("yes")
    with torch.no_grad():
        last = model(torch.tensor([ids])).logits[0, -1]  # [V]
    pair = torch.stack([last[no], last[yes]]).float()
    return float(torch.log_softmax(pair, dim=0)[1].exp())


def cosine_reference(model: PreTrainedModel, tok: PreTrainedTokenizerBase, a: str, b: str) -> float:
    """The cosine of the two texts' last-token final hidden states (transformers')."""

    def vec(text: str) -> torch.Tensor:
        with torch.no_grad():
            out = model(torch.tensor([tok.encode(text)]), output_hidden_states=True)
        return out.hidden_states[-1][0, -1].float()  # [H], after the final norm

    return float(F.cosine_similarity(vec(a), vec(b), dim=0))
