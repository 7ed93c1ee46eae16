"""A tiny model that thinks: the built-in tokenizer plus ``<think>`` / ``</think>`` (added,
not special, as in Qwen3's and DeepSeek-R1's tokenizers), a Qwen3-style chat template
(``enable_thinking: false`` closes an empty thinking in the prompt), and weights that make
the model a bigram table, so that its greedy output is known exactly.

The bigram model: every layer's output projections are zero, so the last hidden state is the
last token's embedding; the chain tokens' embeddings are orthogonal basis vectors and the
output head maps each one to the next token of the chain with a margin of 10 x hidden size
in logits. After the thinking prompt (its last token) it writes ``THINKING_OUTPUT``; after
the prompt with ``enable_thinking: false`` it writes ``ANSWER`` alone.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from tokenizers import AddedToken
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from tests.server.conftest import Server, start_server

THINK_MODEL = "tiny-thinker"
REASONING = "I think"
ANSWER = "Hello world"
THINKING_OUTPUT = f"<think>{REASONING}</think>{ANSWER}"
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}"
)
HIDDEN = 64
MARGIN = 10.0  # logit of the next chain token, per unit of hidden size


def _last_prompt_token(tok: object, **kwargs: object) -> int:
    text = tok.apply_chat_template(  # type: ignore[attr-defined]
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True, **kwargs
    )
    return int(tok.encode(text, add_special_tokens=False)[-1])  # type: ignore[attr-defined]


def build_thinker(path: Path, builtin_model_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(builtin_model_dir)
    markers = [AddedToken(m, special=False, normalized=False) for m in ("<think>", "</think>")]
    tok.add_tokens(markers)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(path)
    chain = [*tok.encode(THINKING_OUTPUT, add_special_tokens=False), tok.eos_token_id]
    answer_start = tok.encode(ANSWER, add_special_tokens=False)[0]
    starts = {_last_prompt_token(tok): chain[0]}
    starts[_last_prompt_token(tok, enable_thinking=False)] = answer_start
    successors = dict(itertools.pairwise(chain)) | starts
    assert len(starts) == 2 and len(set(chain)) == len(chain)
    assert not set(starts) & set(chain), "a prompt's last token is also in the chain"

    write_bigram_model(path, tok, successors)


def write_bigram_model(path: Path, tok: Any, successors: dict[int, int]) -> None:
    """A one-layer Llama whose greedy next token after ``t`` is ``successors[t]``."""
    torch.manual_seed(0)
    vocab = len(tok) + 6  # room past the added tokens
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        bos_token_id=1, eos_token_id=tok.eos_token_id, tie_word_embeddings=False,
    )  # fmt: skip
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb = model.model.embed_tokens.weight  # [vocab, hidden]
        head = model.lm_head.weight  # [vocab, hidden]
        head.zero_()
        for i, (token, nxt) in enumerate(successors.items()):
            basis = torch.zeros(HIDDEN)
            basis[i] = 1.0
            emb[token] = basis * HIDDEN**0.5  # RMS 1: the final norm leaves it as is
            head[nxt] += basis * MARGIN
    model.save_pretrained(path)


@pytest.fixture(scope="session")
def thinker_dir(tmp_path_factory: pytest.TempPathFactory, builtin_model_dir: Path) -> Path:
    path = tmp_path_factory.mktemp("models") / THINK_MODEL
    build_thinker(path, builtin_model_dir)
    return path


@pytest.fixture(scope="module")
def thinker_server(thinker_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The thinking model with ``--reasoning-parser qwen3`` and hermes tool calls."""
    log = tmp_path_factory.mktemp("logs") / "thinker_server.log"
    srv = start_server(
        [
            str(thinker_dir), "--served-model-name", THINK_MODEL,
            "--reasoning-parser", "qwen3",
            "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
            "--num-kv-blocks", "64", "--max-num-seqs", "8",
        ],
        log,
    )  # fmt: skip
    yield srv
    srv.stop()


# -- gpt-oss's harmony format -----------------------------------------------------------------
HARMONY_MODEL = "tiny-harmony"
HARMONY_TOKENS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>",
                  "<|call|>", "<|constrain|>")  # fmt: skip
HARMONY_TEMPLATE = (
    "{% for message in messages %}<|start|>{{ message.role }}<|message|>{{ message.content }}"
    "<|end|>{% endfor %}{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)
# The bigram model's own output: one analysis message closed by <|return|>. A bigram cannot
# write <|channel|> twice with two successors, so the final channel comes from a thinking
# budget, which forces <|end|><|start|>assistant<|channel|>final<|message|>; the model then
# writes the same words again as the answer.
HARMONY_OUTPUT = "<|channel|>analysis<|message|>Hello world<|return|>"


def build_harmony(path: Path, builtin_model_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(builtin_model_dir)
    markers = [AddedToken(t, special=True, normalized=False) for t in HARMONY_TOKENS]
    tok.add_special_tokens({"additional_special_tokens": markers})
    tok.chat_template = HARMONY_TEMPLATE
    tok.save_pretrained(path)
    chain = [*tok.encode(HARMONY_OUTPUT, add_special_tokens=False), tok.eos_token_id]
    assert len(set(chain)) == len(chain)
    successors = dict(itertools.pairwise(chain)) | {_last_prompt_token(tok): chain[0]}
    write_bigram_model(path, tok, successors)


@pytest.fixture(scope="module")
def harmony_server(
    builtin_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    """The harmony bigram model with ``--reasoning-parser gpt_oss``."""
    path = tmp_path_factory.mktemp("models") / HARMONY_MODEL
    build_harmony(path, builtin_model_dir)
    log = tmp_path_factory.mktemp("logs") / "harmony_server.log"
    srv = start_server(
        [
            str(path), "--served-model-name", HARMONY_MODEL, "--reasoning-parser", "gpt_oss",
            "--num-kv-blocks", "64", "--max-num-seqs", "8",
        ],
        log,
    )  # fmt: skip
    yield srv
    srv.stop()
