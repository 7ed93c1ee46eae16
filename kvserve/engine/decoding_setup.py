"""Request fields that change decoding and need the engine's tokenizer or vocabulary.

``validate_decoding_fields`` checks token ids against the model's vocabulary and returns
``bad_words`` as token id sequences (vLLM's rule: each word as written and with a leading
space, since most tokenizers give " word" its own token ids); it writes nothing into the
caller's ``SamplingParams`` (the input processor puts them on the engine's own copy).
"""

from __future__ import annotations

from typing import Any

from kvserve.sampling_params import ParamError, SamplingParams


def bad_words_token_ids(tokenizer: Any, words: list[str]) -> list[list[int]]:
    """Token id sequences of each bad word, bare and with a prefix space (vLLM's rule: the
    spaced form counts only when it is a different token sequence of the same length)."""
    out: list[list[int]] = []
    for word in words:
        bare = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        if bare:
            out.append(list(bare))
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if spaced and bare and spaced[0] != bare[0] and len(spaced) == len(bare):
            out.append(list(spaced))
    return out


def validate_decoding_fields(
    params: SamplingParams, tokenizer: Any, vocab_size: int
) -> list[list[int]]:
    """Raise ``ParamError`` for ids outside the vocabulary; the bad words' token ids."""
    for name, ids in (
        ("logit_bias", list(params.logit_bias or {})),
        ("allowed_token_ids", list(params.allowed_token_ids or [])),
    ):
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise ParamError(
                name, f"{name}: token id {bad[0]} is out of the vocabulary (size {vocab_size})"
            )
    if params.bad_words and tokenizer is None:
        raise ParamError("bad_words", "bad_words need a tokenizer; this model has none")
    if params.structured_outputs is not None and tokenizer is None:
        raise ParamError(
            "structured_outputs", "structured outputs need a tokenizer; this model has none"
        )
    return bad_words_token_ids(tokenizer, list(params.bad_words)) if params.bad_words else []
