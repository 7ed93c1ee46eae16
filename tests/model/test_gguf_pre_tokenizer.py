"""A GGUF's pre-tokenizer (``tokenizer.ggml.pre``) through kvserve's tokenizer build.

gpt-oss's GGUF files name ``gpt-4o`` (OpenAI's o200k split). The file's vocabulary here is
SmolLM2's (a byte-level BPE, its first 8192 tokens: cheap to rebuild), written under that name;
the reference is a ``tokenizers`` BPE of the same vocabulary and merges split by o200k's regex as
tiktoken defines it, so a build that dropped or changed the split encodes differently. A
transformers without the name's split is refused by name (``check_pre_tokenizer``).
"""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer

from kvserve.model.builtin import find_builtin_gguf
from kvserve.model.gguf_metadata import check_pre_tokenizer, write_tokenizer
from tests.model.test_gguf import TINY_VOCAB, _copy_tokenizer_metadata, _tokenizer_metadata

# tiktoken's o200k_base pattern (openai_public.py), the split gpt-oss's tokenizer.json carries
O200K = "|".join(
    [
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n/]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    ]
)
# where o200k's rules and GPT-2's (a build without the split) cut differently: digit runs,
# case changes inside a word, contractions, newlines, punctuation runs, non-Latin letters
TEXTS = [
    "In 2024 we sold 1234567 units.",
    "HelloWorld and XMLHttpRequest",
    "don't, WE'LL, they'Re",
    "line one\n\n  line two\r\n",
    "Prices: $3.50/kg!!! ...really?",
    "naïveCafé, GrüßeGott, ΕλληνικάΑλφα",
    "    indented code()\n\tx = y  ",
]


def _write(path: Path, pre: str) -> Path:
    writer = gguf.GGUFWriter(path, "gpt-oss")
    # "gpt2" (byte-level BPE) vocabulary, as gpt-oss's, under the name ``pre``
    _copy_tokenizer_metadata(writer, find_builtin_gguf(), TINY_VOCAB, pre)
    writer.add_context_length(4096)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return path


def _reference() -> Tokenizer:
    meta = _tokenizer_metadata(find_builtin_gguf(), TINY_VOCAB)
    vocab = {token: i for i, token in enumerate(meta["tokens"])}
    merges = [tuple(m.split(" ")) for m in meta["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(O200K), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    return tok


def test_gpt4o_split_encodes_as_o200k(tmp_path: Path) -> None:
    path = _write(tmp_path / "gpt4o.gguf", "gpt-4o")
    write_tokenizer(path, gguf.GGUFReader(path), tmp_path / "out")
    built = AutoTokenizer.from_pretrained(tmp_path / "out")
    reference = _reference()
    splitter = built.backend_tokenizer.pre_tokenizer
    for text in TEXTS:
        want = reference.encode(text, add_special_tokens=False).ids
        assert built.encode(text, add_special_tokens=False) == want, text
        assert _pieces(splitter, text) == _pieces(reference.pre_tokenizer, text), text
    # not vacuous: GPT-2's split (what a build without the name gives) cuts these texts
    # otherwise (their ids may still agree: this small vocabulary merges few of the pieces)
    gpt2 = pre_tokenizers.ByteLevel(add_prefix_space=False)
    differ = [t for t in TEXTS if _pieces(gpt2, t) != _pieces(reference.pre_tokenizer, t)]
    assert differ == TEXTS


def _pieces(splitter: pre_tokenizers.PreTokenizer, text: str) -> list[str]:
    return [piece for piece, _ in splitter.pre_tokenize_str(text)]


def test_a_split_transformers_did_not_apply_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As an older transformers builds it: no split for the name, GPT-2's in its place."""
    from transformers.integrations.gguf import gguf_tokenizer_mapping

    splits = dict(gguf_tokenizer_mapping.GGUF_PRE_TOKENIZER_SPLITS)
    del splits["gpt-4o"]
    monkeypatch.setattr(gguf_tokenizer_mapping, "GGUF_PRE_TOKENIZER_SPLITS", splits)
    path = _write(tmp_path / "gpt4o.gguf", "gpt-4o")
    with pytest.raises(ValueError, match=r"pre-tokenizer 'gpt-4o'.*\['12345'\].*\['123', '45'\]"):
        write_tokenizer(path, gguf.GGUFReader(path), tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("pre", "pieces", "ok"),
    [
        ("qwen2", ["1", "2", "3", "4", "5"], True),
        ("qwen2", ["123", "45"], False),
        ("llama-bpe", ["123", "45"], True),
        ("llama-bpe", ["12345"], False),
        ("smollm", ["12345"], True),  # not listed: left to transformers
        (None, ["12345"], True),
    ],
)
def test_check_pre_tokenizer_by_name(pre: str | None, pieces: list[str], ok: bool) -> None:
    regex = {"1": r"\p{N}", "123": r"\p{N}{1,3}", "12345": r"\p{N}+"}[pieces[0]]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(regex), behavior="isolated")

    class Fast:  # what check_pre_tokenizer reads of a PreTrainedTokenizerFast
        backend_tokenizer = tok

    if ok:
        check_pre_tokenizer(Fast(), pre)
    else:
        with pytest.raises(ValueError, match=repr(pre)):
            check_pre_tokenizer(Fast(), pre)
