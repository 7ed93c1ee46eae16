"""Run llama.cpp's own ``convert_hf_to_gguf.py`` (``python llamacpp_convert.py LLAMA_CPP_DIR
IN_DIR OUT.gguf [IN_DIR OUT.gguf ...]``) on tiny Hugging Face folders that carry no tokenizer:
each model class's ``set_vocab`` is replaced by the test files' tiny SentencePiece vocabulary
(``test_gguf_gemma_phi3.add_tiny_tokenizer``), everything else is the converter's. Run in its
own process: the converter imports its tree's ``gguf-py`` as ``gguf``."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any


def main(argv: list[str]) -> None:
    tree, pairs = argv[0], argv[1:]
    sys.path.insert(0, tree)
    import convert_hf_to_gguf as conv  # the tree's, with its own gguf-py first on sys.path

    sys.path.insert(1, str(Path(__file__).resolve().parents[2]))
    from tests.model.test_gguf_gemma_phi3 import add_tiny_tokenizer

    real = conv.get_model_class

    def with_tiny_vocab(*args: Any, **kwargs: Any) -> Any:
        cls = real(*args, **kwargs)
        cls.set_vocab = lambda self: add_tiny_tokenizer(self.gguf_writer)
        return cls

    conv.get_model_class = with_tiny_vocab
    for src, out in zip(pairs[::2], pairs[1::2], strict=True):
        sys.argv = ["convert_hf_to_gguf.py", src, "--outfile", out, "--outtype", "f32"]
        conv.main()


if __name__ == "__main__":
    main(sys.argv[1:])
