"""Tiny native Qwen3 and Gemma 3 folders packaged as their hubs ship them: a tokenizer with
the family's chat special tokens and chat template, and a generation_config.json with the
family's EOS list (and, for Qwen3, its sampling defaults)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerFast

from tests.model.tiny_hf import EOS, VOCAB, byte_tokenizer
from tests.model.tiny_native import make_native_model

START, END = 257, 258  # the turn markers' ids (<|im_start|>/<|im_end|>, Gemma's turns)

# Qwen3's template, cut to what these tests use (ChatML turns, the generation prompt and
# its enable_thinking switch), as its tokenizer saves it: chat_template.jinja.
QWEN3_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)
# Gemma's template (the system turn folded into the first user turn, 'assistant' -> 'model'),
# in tokenizer_config.json as older transformers saved it.
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
    "{% set first = messages[0]['content'] + '\\n\\n' %}{% set loop_messages = messages[1:] %}"
    "{% else %}{% set first = '' %}{% set loop_messages = messages %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\\n' + (first if loop.first else '') "
    "+ message['content'] | trim + '<end_of_turn>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)
# Qwen3-0.6B's own sampling defaults, plus a repetition penalty and an output cap.
QWEN3_SAMPLING = {
    "temperature": 0.6,
    "top_k": 20,
    "top_p": 0.95,
    "repetition_penalty": 1.3,
    "max_new_tokens": 6,
}
FAMILIES = {
    # arch -> (turn markers, template, where it is saved, generation_config.json)
    "qwen3": (
        ("<|im_start|>", "<|im_end|>"),
        QWEN3_TEMPLATE,
        "chat_template.jinja",
        {"bos_token_id": EOS, "eos_token_id": [END, EOS], **QWEN3_SAMPLING},
    ),
    "gemma3": (
        ("<start_of_turn>", "<end_of_turn>"),
        GEMMA_TEMPLATE,
        "tokenizer_config.json",
        # Gemma 3's [1, 106]: <eos> and <end_of_turn>; the tokenizer knows only the first.
        {"bos_token_id": EOS, "eos_token_id": [EOS, END], "pad_token_id": 0},
    ),
}


def chat_tokenizer(arch: str) -> PreTrainedTokenizerFast:
    markers, template, _, _ = FAMILIES[arch]
    tok = byte_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": list(markers)})
    assert tok.convert_tokens_to_ids(list(markers)) == [START, END]
    tok.bos_token = "<|endoftext|>"
    tok.chat_template = template
    return tok


def make_chat_model(arch: str, path: Path) -> Any:
    """The tiny native model of ``arch`` with its chat tokenizer and generation config."""
    model = make_native_model(arch, path, vocab_size=VOCAB, bos_token_id=EOS, eos_token_id=EOS)
    _, template, where, generation = FAMILIES[arch]
    chat_tokenizer(arch).save_pretrained(path)
    if where == "tokenizer_config.json":
        (path / "chat_template.jinja").unlink()
        cfg = json.loads((path / where).read_text())
        (path / where).write_text(json.dumps({**cfg, "chat_template": template}))
    (path / "generation_config.json").write_text(json.dumps(generation))
    return model
