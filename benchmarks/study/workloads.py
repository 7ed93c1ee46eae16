"""The study's requests and its second model, built from the bench lab's datasets.

* fixed lengths: the lab's random dataset (:func:`kvserve.bench.synthetic.sample_random`), or
  random token ids for a model without a tokenizer, always with ``ignore_eos``;
* chat: the lab's packaged chatterbot conversations
  (:func:`kvserve.bench.datasets.sample_chatterbot`) through the model's chat template, exactly
  as the server's ``/v1/chat/completions`` renders them;
* EOS-terminated random prompts for a random-weight model: token ids drawn uniformly from the
  non-special vocabulary, sampled at temperature 1.0 so that EOS arrives with a probability of
  about 1/vocab per token;
* the larger random-weight Llama (:func:`build_random_llama`), saved once as a Hugging Face
  folder under the kvserve cache.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.study.driver import DriverRequest
from kvserve.bench.datasets import SampleRequest, sample_chatterbot
from kvserve.bench.synthetic import sample_random
from kvserve.sampling_params import SamplingParams

# Token ids 0 and 1 are BOS and EOS of the random models (as in tests/engine/utils.py).
RANDOM_BOS, RANDOM_EOS = 0, 1


@dataclass(frozen=True)
class RandomLlamaSpec:
    """Shape of a random-weight Llama; the default is the study's "bigger model"."""

    vocab_size: int = 256
    hidden_size: int = 1024
    intermediate_size: int = 2816
    num_hidden_layers: int = 16
    num_attention_heads: int = 16
    num_key_value_heads: int = 8
    max_position_embeddings: int = 2048
    seed: int = 0

    def name(self) -> str:
        return (
            f"random-llama-h{self.hidden_size}-l{self.num_hidden_layers}-"
            f"kv{self.num_key_value_heads}-v{self.vocab_size}-s{self.seed}"
        )


def study_cache_dir() -> Path:
    """``$KVSERVE_CACHE_DIR/study`` or ``~/.cache/kvserve/study`` (never inside the repo)."""
    root = os.environ.get("KVSERVE_CACHE_DIR") or Path.home() / ".cache" / "kvserve"
    return Path(root) / "study"


def build_random_llama(spec: RandomLlamaSpec, path: Path | None = None) -> Path:
    """Save a random-weight ``LlamaForCausalLM`` of ``spec`` in bfloat16 (once) and return
    its folder. No tokenizer is saved: the engine then takes token-id prompts only."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = path or study_cache_dir() / spec.name()
    if (folder / "config.json").is_file() and (folder / "study_spec.json").is_file():
        return folder
    torch.manual_seed(spec.seed)
    cfg = LlamaConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        bos_token_id=RANDOM_BOS,
        eos_token_id=RANDOM_EOS,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()  # type: ignore[arg-type]
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)  # a build that was interrupted
    model.save_pretrained(tmp)
    (tmp / "study_spec.json").write_text(json.dumps(asdict(spec), indent=2))
    shutil.rmtree(folder, ignore_errors=True)  # a folder without study_spec.json is partial
    tmp.rename(folder)
    return folder


def model_size(folder: str | Path) -> dict[str, Any]:
    """Parameters, bytes of the weights in bfloat16 and KV bytes per token of a Llama folder."""
    cfg = json.loads((Path(folder) / "config.json").read_text())
    h, layers, vocab = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or h // heads
    inter = cfg["intermediate_size"]
    attn = h * heads * head_dim + 2 * h * kv_heads * head_dim + heads * head_dim * h
    per_layer = attn + 3 * h * inter + 2 * h  # q/k/v/o, gate/up/down, two norms
    embed = vocab * h * (1 if cfg.get("tie_word_embeddings") else 2)
    params = layers * per_layer + embed + h
    return {
        "parameters": params,
        "weight_bytes_bf16": 2 * params,
        "kv_bytes_per_token_bf16": 2 * layers * kv_heads * head_dim * 2,
        "hidden_size": h,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "intermediate_size": inter,
        "vocab_size": vocab,
    }


def fixed_length_requests(
    tokenizer: Any, n: int, input_len: int, output_len: int, seed: int = 0, vocab_size: int = 0
) -> tuple[list[DriverRequest], list[SampleRequest] | None]:
    """``n`` prompts of ``input_len`` tokens, each generating exactly ``output_len`` tokens.

    With a tokenizer, the lab's random dataset (text that re-encodes to ``input_len`` tokens,
    the same samples an HTTP run sends); without one, random token ids in
    ``[2, vocab_size)``. Also returns the lab samples (None without a tokenizer).
    """
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    if tokenizer is not None:
        samples = sample_random(n, tokenizer, input_len=input_len, output_len=output_len, seed=seed)
        reqs = [DriverRequest(s.prompt, params, s.expected_output_len) for s in samples]
        return reqs, samples
    rng = np.random.default_rng(seed)
    ids = rng.integers(2, vocab_size, size=(n, input_len)).tolist()
    return [DriverRequest({"prompt_token_ids": p}, params, output_len) for p in ids], None


def chat_prompt(tokenizer: Any, messages: list[dict[str, str]]) -> dict[str, Any]:
    """The prompt the server's chat endpoint builds: template text, encoded without adding
    special tokens again (see ``kvserve/server/chat.py``)."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return {"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}


def chatterbot_samples(
    tokenizer: Any, n: int, seed: int = 0, max_output_len: int | None = None
) -> list[SampleRequest]:
    """The lab's chatterbot samples (reference-answer lengths, capped at ``max_output_len``)."""
    return sample_chatterbot(n, tokenizer, seed=seed, max_output_len=max_output_len)


def chat_requests(
    tokenizer: Any,
    samples: list[SampleRequest],
    *,
    ignore_eos: bool,
    max_tokens: int | None = None,
    temperature: float = 0.0,
    seed: int | None = None,
) -> list[DriverRequest]:
    """Chat-template prompts of the samples. ``ignore_eos``: exactly the sample's expected
    length; otherwise until EOS with ``max_tokens`` (or the sample's length) as the cap. With
    ``seed``, request ``i`` samples with seed ``seed + i`` (the same tokens in any batch)."""
    out = []
    for i, s in enumerate(samples):
        assert s.chat_messages is not None
        params = SamplingParams(
            temperature=temperature,
            max_tokens=max_tokens or s.expected_output_len,
            ignore_eos=ignore_eos,
            seed=None if seed is None else seed + i,
        )
        out.append(
            DriverRequest(chat_prompt(tokenizer, s.chat_messages), params, params.max_tokens)
        )
    return out


def eos_random_requests(
    n: int,
    vocab_size: int,
    min_input_len: int,
    max_input_len: int,
    max_tokens: int,
    seed: int = 0,
    temperature: float = 1.0,
) -> list[DriverRequest]:
    """Random token-id prompts (uniform lengths) that end at EOS or ``max_tokens``; request
    ``i`` samples with seed ``seed + i`` so that every engine setting sees the same tokens."""
    rng = np.random.default_rng(seed)
    lens = rng.integers(min_input_len, max_input_len + 1, size=n).tolist()
    out = []
    for i, length in enumerate(lens):
        ids = rng.integers(2, vocab_size, size=length).tolist()
        params = SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed + i)
        out.append(DriverRequest({"prompt_token_ids": ids}, params, max_tokens))
    return out
