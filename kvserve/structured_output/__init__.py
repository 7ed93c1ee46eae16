"""Structured outputs: grammar-constrained decoding with xgrammar (as vLLM and SGLang use).

- ``params.py``: ``StructuredOutputsParams``, the user's constraint (vLLM's class and fields);
- ``grammar.py``: compiling a constraint for one tokenizer (off the engine thread, cached by text)
  and ``StructuredOutputRequest``, one request's matcher;
- ``bitmask.py``: the batch's token bitmask for the rows that sample this step.

The scheduler and runner only call methods of ``StructuredOutputRequest`` and the pure bitmask
helpers; nothing outside ``grammar.py`` imports xgrammar.
"""

from kvserve.structured_output.params import GrammarError, StructuredOutputsParams

__all__ = ["GrammarError", "StructuredOutputsParams"]
