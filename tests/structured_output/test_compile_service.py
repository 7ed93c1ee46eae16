"""The grammar compile service: killable worker processes under a time and a memory limit,
two lanes by input size, cancellation when nobody waits, a cache bounded in bytes.

Real xgrammar compiles on the built-in tokenizer; the slow and hungry inputs are the issue's
(a 100,000-member enum, hundreds of tools as one ``anyOf``, a 30-byte regex that compiles
for seconds).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from kvserve.config import StructuredOutputsConfig
from kvserve.structured_output.compile_pool import LimitError, _alive
from kvserve.structured_output.grammar import SMALL_GRAMMAR_CHARS, GrammarCompiler
from kvserve.structured_output.params import GrammarError, StructuredOutputsParams

VOCAB = 49152
EOS = 2
MiB = 2**20
# Compiles for minutes (the 144 s) unless killed; the large lane (~1.3 MB of text).
BIG_ENUM = StructuredOutputsParams(json={"enum": [f"value{i}" for i in range(100_000)]})
# 84 bytes, the small lane, yet ~17 s of compiling with xgrammar 0.2.8 on an AVX2 EPYC (each
# part ~2.8 s; one part was ~15 s with older xgrammar, so the test uses six).
SLOW_REGEX = StructuredOutputsParams(regex="".join(f"[^{c}]{{1,100000}}" for c in "uvwxyz"))
# Hundreds of tools as tool_choice "required" builds them: GBs within seconds.
HUNGRY_TOOLS = StructuredOutputsParams(
    json={
        "anyOf": [
            {
                "type": "object",
                "properties": {"name": {"const": f"f{i}"}, "arguments": {"type": "object"}},
                "required": ["name", "arguments"],
            }
            for i in range(1000)
        ]
    }
)


@pytest.fixture(scope="module")
def tokenizer(builtin_model_dir: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(builtin_model_dir)


@pytest.fixture(scope="module")
def make(tokenizer: PreTrainedTokenizerBase) -> Iterator[Callable[..., GrammarCompiler]]:
    """Build compilers with given limits, their workers started and ready."""
    made: list[GrammarCompiler] = []

    def build(**limits: float) -> GrammarCompiler:
        compiler = GrammarCompiler(tokenizer, VOCAB, [EOS], StructuredOutputsConfig(**limits))
        made.append(compiler)
        compiler.warm_up()
        deadline = time.monotonic() + 180  # the first zygote imports xgrammar and torch
        while any(lane.worker_pid is None for lane in compiler.lanes.values()):
            assert time.monotonic() < deadline, "compile workers did not start"
            time.sleep(0.05)
        return compiler

    yield build
    for compiler in made:
        compiler.shutdown()


def wait_gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not _alive(pid)


def test_lanes_by_size() -> None:
    assert len(SLOW_REGEX.key()[1]) <= SMALL_GRAMMAR_CHARS < len(BIG_ENUM.key()[1])
    assert len(HUNGRY_TOOLS.key()[1]) > SMALL_GRAMMAR_CHARS


def test_a_compile_past_the_timeout_is_killed_and_remembered(
    make: Callable[..., GrammarCompiler],
) -> None:
    compiler = make(compile_timeout=1.0)
    lane = compiler.lanes["small"]
    pid = lane.worker_pid
    assert pid is not None
    start = time.monotonic()
    with pytest.raises(LimitError, match="longer than 1 s \\(--grammar-compile-timeout\\)") as e:
        compiler.compile(SLOW_REGEX).result(timeout=120)
    assert time.monotonic() - start < 1.0 + 10  # generous: 2 busy cores
    assert e.value.param == "structured_outputs"
    assert wait_gone(pid) and lane.killed == 1
    # The same constraint again fails at once, without a compile.
    with pytest.raises(GrammarError, match="--grammar-compile-timeout"):
        compiler.compile(SLOW_REGEX).result(timeout=0.5)
    assert lane.killed == 1
    # A fresh worker serves the next request.
    grammar = compiler.compile(StructuredOutputsParams(choice=["yes", "no"])).result(timeout=120)
    assert grammar.memory_size_bytes > 0
    assert lane.worker_pid not in (None, pid)


def test_a_compile_past_the_memory_limit_is_killed(make: Callable[..., GrammarCompiler]) -> None:
    compiler = make(compile_timeout=120.0, compile_max_memory=64 * MiB)
    lane = compiler.lanes["large"]
    pid = lane.worker_pid
    assert pid is not None
    with pytest.raises(LimitError, match="more than 64 MiB \\(--grammar-compile-max-memory\\)"):
        compiler.compile(HUNGRY_TOOLS).result(timeout=120)
    assert wait_gone(pid) and lane.killed == 1


def test_small_grammars_pass_a_large_one_and_cancel_kills_it(
    make: Callable[..., GrammarCompiler],
) -> None:
    compiler = make(compile_timeout=120.0)
    large = compiler.lanes["large"]
    pid = large.worker_pid
    assert pid is not None
    big = [compiler.compile(BIG_ENUM), compiler.compile(BIG_ENUM)]  # two requests, one compile
    for i in range(3):  # choices and a small schema, in the small lane
        small = compiler.compile(StructuredOutputsParams(choice=["red", "green", str(i)]))
        assert small.result(timeout=120).memory_size_bytes > 0
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert compiler.compile(StructuredOutputsParams(json=schema)).result(timeout=120)
    assert not any(f.done() for f in big)
    # One of the two requests leaves: the compile goes on for the other.
    assert big[0].cancel()
    time.sleep(1.0)
    assert _alive(pid) and large.killed == 0 and not big[1].done()
    # The last one leaves: the worker is killed (what it built goes with it).
    assert big[1].cancel()
    assert wait_gone(pid) and large.killed == 1
    # Not remembered as a failure: the next request compiles it afresh.
    again = compiler.compile(BIG_ENUM)
    time.sleep(0.5)
    assert not again.done()
    again.cancel()


def test_the_cache_is_bounded_in_bytes(make: Callable[..., GrammarCompiler]) -> None:
    compiler = make(cache_memory=3 * MiB)  # a small JSON schema compiles to ~2.2 MB
    schemas = [
        StructuredOutputsParams(
            json={"type": "object", "properties": {f"k{i}": {"type": "integer"}}}
        )
        for i in range(3)
    ]
    first = compiler.compile(schemas[0]).result(timeout=120)
    assert compiler.compile(schemas[0]).result() is first  # cached
    for params in schemas[1:]:
        compiler.compile(params).result(timeout=120)
        assert compiler.cache_bytes <= 3 * MiB
    assert compiler.compile(schemas[0]).result(timeout=120) is not first  # evicted: compiled again
