"""Helpers for engine tests: tiny random-weight models saved as Hugging Face folders."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from kvserve.engine.llm_engine import LLMEngine
from kvserve.sampling_params import SamplingParams

TINY = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "bos_token_id": 0,
    "eos_token_id": 1,
}


def make_tiny_model(arch: str, path: Path) -> PreTrainedModel:
    """A random tiny model of the given architecture, saved to ``path``, in float32."""
    torch.manual_seed(0)
    if arch == "llama":
        # Non-default theta and llama3 rope scaling exercise the config's rope parameters.
        cfg = LlamaConfig(
            **TINY,
            rope_theta=5000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 4.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
        model: PreTrainedModel = LlamaForCausalLM(cfg)
    elif arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**TINY, tie_word_embeddings=True))
    elif arch == "mistral":
        model = MistralForCausalLM(MistralConfig(**TINY))
    else:
        raise ValueError(arch)
    model.eval()
    model.save_pretrained(path)
    return model


def random_prompts(lengths: list[int], seed: int = 1, vocab: int = 256) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    # Ids from 2 up: 0 and 1 are BOS/EOS of the tiny models.
    return [torch.randint(2, vocab, (n,), generator=g).tolist() for n in lengths]


def run_engine_checked(
    engine: LLMEngine, prompts: list[list[int]], params: SamplingParams
) -> dict[str, list[int]]:
    """Drive an engine to completion, checking KV integrity after every step."""
    for i, p in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": p}, params)
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        engine.kv.check_integrity()
    return done


class StubEngine:
    """What a ``RequestStream`` needs of its async engine: somewhere to send aborts."""

    def __init__(self) -> None:
        self.aborted: list[str] = []
        self._orphans: list[str] = []

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
