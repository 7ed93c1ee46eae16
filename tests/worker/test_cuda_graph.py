"""Decode steps through static, padded inputs (``kvserve/worker/cuda_graph.py``) against the
eager path: the capture sizes, the input layout, and a whole engine's tokens and KV cache.

Without a GPU the static path runs the very callable a CUDA graph captures, eagerly, under
Triton's interpreter (``capture=False``); the ``cuda`` tests capture and replay it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvserve.config import default_capture_sizes, resolve_capture_sizes
from kvserve.engine.arg_utils import EngineArgs
from kvserve.engine.llm import build_engine_config
from kvserve.engine.llm_engine import LLMEngine
from kvserve.ops.triton.paged_attention import interpreted
from kvserve.sampling_params import SamplingParams
from kvserve.worker.cuda_graph import PAD_TOKEN_ID, StaticDecodeInputs
from kvserve.worker.model_runner import ModelRunner
from tests.engine.utils import TINY, random_prompts, run_engine_checked

# (prompt length, max_tokens): five rows in the first decode step (more than the largest
# size, 4: eager), then 4, 3 (padded to 4), 1 and 1 (the padded sizes of the static path)
REQUESTS = [(5, 6), (9, 4), (3, 4), (12, 3), (7, 2)]
SIZES = (1, 2, 4)
GRAPH_STEPS = 4  # the decode steps of at most 4 rows: 4, 3, 1, 1 rows
# TRITON_ATTN on a CPU: in Triton's interpreter only (tests/conftest.py sets it without CUDA)
interpreter = pytest.mark.skipif(not interpreted(), reason="no Triton interpreter (CUDA)")


def test_default_capture_sizes_follow_vllm() -> None:
    assert default_capture_sizes(512) == (1, 2, 4, *range(8, 256, 8), *range(256, 513, 16))
    assert default_capture_sizes(3) == (1, 2)
    assert default_capture_sizes(20) == (1, 2, 4, 8, 16)


@pytest.mark.parametrize(
    ("sizes", "cap", "seqs", "want"),
    [
        (None, None, 256, default_capture_sizes(256)),  # min(max_num_seqs, 512)
        (None, None, 1024, default_capture_sizes(512)),
        (None, 24, 256, (1, 2, 4, 8, 16, 24)),
        ([16], None, 256, (1, 2, 4, 8, 16)),  # one value: the pattern up to it
        ([16], 8, 256, (1, 2, 4, 8)),
        ([8, 3, 3, 1], None, 256, (1, 3, 8)),  # several: exactly those
    ],
)
def test_resolve_capture_sizes(
    sizes: list[int] | None, cap: int | None, seqs: int, want: tuple[int, ...]
) -> None:
    assert resolve_capture_sizes(sizes, cap, seqs) == want


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"cuda_graph_sizes": [0, 4]}, "must be positive integers"),
        ({"max_cudagraph_capture_size": 0}, "must be >= 1"),
        ({"cuda_graph_sizes": [1, 64], "max_cudagraph_capture_size": 32}, "go past"),
    ],
)
def test_bad_capture_sizes_are_refused(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        EngineArgs(**kwargs)  # type: ignore[arg-type]


def test_capture_flags_parse() -> None:
    import argparse

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    ns = parser.parse_args(["--cuda-graph-sizes", "1", "2", "8", "--max-cudagraph-capture-size",
                            "8"])  # fmt: skip
    args = EngineArgs.from_cli_args(ns)
    assert (args.cuda_graph_sizes, args.max_cudagraph_capture_size) == ([1, 2, 8], 8)


def test_static_inputs_layout_and_padding() -> None:
    """Rows then padding rows, laid out for the padded size: each padding row has token 0 at
    position 0, its one slot and its whole block table in the scratch block."""
    inputs = StaticDecodeInputs(8, 3, 4, scratch_block=9, device=torch.device("cpu"))
    inputs.fill([(11, 5, [3, 7]), (12, 0, [2])], 4)
    ids, pos, slots, lens, tables = inputs.device_views(4)
    assert ids.tolist() == [11, 12, PAD_TOKEN_ID, PAD_TOKEN_ID]
    assert pos.tolist() == [5, 0, 0, 0]
    assert slots.tolist() == [7 * 4 + 1, 2 * 4, 9 * 4, 9 * 4]
    assert lens.tolist() == [6, 1, 1, 1]
    assert tables.tolist() == [[3, 7, 9], [2, 9, 9], [9, 9, 9], [9, 9, 9]]


@pytest.fixture(scope="module")
def llama_1k(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with a 1,024-token limit: a static plan cuts that into two split-K
    partitions on a CPU (512 each), while the eager plan of these short contexts has one."""
    path = tmp_path_factory.mktemp("llama_1k")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**{**TINY, "max_position_embeddings": 1024})).save_pretrained(path)
    return path


def _engine(path: Path, device: str = "cpu", **kw: object) -> LLMEngine:
    opts: dict[str, object] = {"dtype": "float32", "block_size": 4, "num_kv_blocks": 48,
                               "attention_backend": "TRITON_ATTN", **kw}  # fmt: skip
    return LLMEngine(build_engine_config(str(path), device=device, **opts))


def _run(engine: LLMEngine, requests: list[tuple[int, int]]) -> dict[str, list[int]]:
    """Every (prompt length, max tokens) request added at once, run to the end with KV
    integrity checked each step."""
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for _, m in requests]
    return run_engine_checked(engine, random_prompts([n for n, _ in requests]), params)


def _runner(engine: LLMEngine) -> ModelRunner:
    assert engine.runner is not None
    return engine.runner


@interpreter
def test_static_decode_matches_eager_on_cpu(llama_1k: Path) -> None:
    """Padded static steps give the eager tokens, K/V equal in every block the requests
    used, nothing in any other block, and padding only in the scratch block."""
    eager = _engine(llama_1k, enforce_eager=True)
    want = _run(eager, REQUESTS)
    static = _engine(llama_1k, enforce_eager=True)
    runner = _runner(static)
    runner.enable_decode_graphs(SIZES, capture=False)
    assert runner.scratch_block == runner.num_blocks
    got = _run(static, REQUESTS)
    assert got == want
    assert [len(got[str(i)]) for i in range(5)] == [m for _, m in REQUESTS]
    graphs = runner.decode_graphs
    assert graphs is not None and not graphs.captured and graphs.steps == GRAPH_STEPS
    nb = runner.num_blocks
    for (k, v), (ek, ev) in zip(runner.kv_caches, _runner(eager).kv_caches, strict=True):
        assert k.shape[0] == v.shape[0] == nb + 1 and ek.shape[0] == nb
        # the same blocks hold K/V in both (the engine allocates the same ids) ...
        used = ek.flatten(1).abs().sum(1) != 0  # [nb]
        assert torch.equal(k[:nb].flatten(1).abs().sum(1) != 0, used)
        # ... with the same numbers (rows batched 4 instead of 3 may round differently)
        torch.testing.assert_close(k[:nb], ek, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(v[:nb], ev, rtol=1e-5, atol=1e-6)
        assert k[nb].abs().sum() > 0  # the padding rows wrote their slot there


@interpreter
def test_capture_failure_leaves_the_engine_eager(llama_1k: Path) -> None:
    """A capture that raises (here: no CUDA) is a warning; the runner keeps the eager path."""
    engine = _engine(llama_1k, enforce_eager=True)
    runner = _runner(engine)
    runner.enable_decode_graphs((1, 2), capture=True)
    assert runner.decode_graphs is None
    assert _run(engine, [(4, 3)]) == _run(_engine(llama_1k, enforce_eager=True), [(4, 3)])


@interpreter
def test_long_contexts_and_sleep(llama_1k: Path) -> None:
    """Steps past max_seq_len_to_capture run eager (positions 12-15 of 12-18 replay); sleep
    drops the static path and wake-up builds it again over the new KV tensors."""
    want = _run(_engine(llama_1k, enforce_eager=True), [(12, 8)])
    engine = _engine(llama_1k, enforce_eager=True, max_seq_len_to_capture=16)
    runner = _runner(engine)
    runner.enable_decode_graphs((1, 2), capture=False)
    assert _run(engine, [(12, 8)]) == want
    assert runner.decode_graphs is not None and runner.decode_graphs.steps == 4
    runner.sleep(1)
    assert runner.decode_graphs is None
    runner.wake_up()
    assert runner.decode_graphs is not None and runner.decode_graphs.max_len == 16
    assert runner.decode_graphs._batches[1].kv_caches is runner.kv_caches
    assert runner.kv_caches[0][0].shape[0] == runner.num_blocks + 1


def test_graphs_are_off_on_cpu_and_the_decode_loop_unchanged(llama_1k: Path) -> None:
    """enforce_eager=False on a CPU still means the C++ decode loop (where it applies), never
    graphs, and no scratch block."""
    engine = _engine(llama_1k, attention_backend="auto")
    runner = _runner(engine)
    assert runner.decode_graphs is None and runner.scratch_block is None
    assert engine.execution_paths.cuda_graphs == ()
    assert runner.kv_caches[0][0].shape[0] == runner.num_blocks


# -- on a CUDA device ----------------------------------------------------------------------------


def _cuda_engine(path: Path, **kw: object) -> LLMEngine:
    return _engine(path, "cuda", num_kv_blocks=256, max_model_len=128, **kw)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graphs_match_eager_on_cuda(llama_1k: Path, dtype: str) -> None:
    """Replayed graphs give enforce_eager's tokens. bfloat16 runs batches of exactly a
    captured size (4 rows), where both paths launch the same kernels on the same shapes;
    float32 also pads (3 rows -> 4, 1 -> 1 after 2)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    requests = [(5, 8), (9, 8), (3, 8), (12, 8)] if dtype == "bfloat16" else REQUESTS
    want = _run(_cuda_engine(llama_1k, dtype=dtype, enforce_eager=True), requests)
    engine = _cuda_engine(llama_1k, dtype=dtype, cuda_graph_sizes=list(SIZES))
    runner = _runner(engine)
    assert runner.decode_graphs is not None and runner.decode_graphs.captured
    assert runner.decode_graphs.sizes == engine.execution_paths.cuda_graphs == SIZES
    assert _run(engine, requests) == want
    assert runner.decode_graphs.steps == (7 if dtype == "bfloat16" else GRAPH_STEPS)


@pytest.mark.cuda
def test_larger_batches_run_eager_on_cuda(llama_1k: Path) -> None:
    """With sizes (1, 2), decode steps of 3 or more rows run eager: only the 2- and 1-row
    steps replay, and the tokens are enforce_eager's."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    want = _run(_cuda_engine(llama_1k, enforce_eager=True), REQUESTS)
    engine = _cuda_engine(llama_1k, cuda_graph_sizes=[1, 2])
    assert _run(engine, REQUESTS) == want
    graphs = _runner(engine).decode_graphs
    assert graphs is not None and graphs.steps == 2  # the two 1-row steps at the end


@pytest.mark.cuda
def test_replay_has_no_host_sync(llama_1k: Path) -> None:
    """A graph step's input copy and replay queue work without waiting for the device; and
    LLM-level enforce_eager keeps graphs off."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    engine = _cuda_engine(llama_1k, cuda_graph_sizes=[1, 2, 4])
    runner = _runner(engine)
    graphs = runner.decode_graphs
    assert graphs is not None
    last = runner.num_blocks - 1  # a block no request of this engine has used
    rows = [(7, 3, [last]), (8, 0, [last - 1]), (9, 1, [last - 1])]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        size = graphs.prepare(rows)
        assert size == 4
        hidden = graphs.run(size, len(rows))  # [3, hidden]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert hidden.shape[0] == 3 and bool(torch.isfinite(hidden).all())
    assert _runner(_cuda_engine(llama_1k, enforce_eager=True)).decode_graphs is None


@pytest.mark.cuda
def test_wake_up_captures_again_on_cuda(llama_1k: Path) -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    want = _run(_cuda_engine(llama_1k, enforce_eager=True), [(4, 3)])
    engine = _cuda_engine(llama_1k, cuda_graph_sizes=[1, 2])
    runner = _runner(engine)
    runner.sleep(1)
    runner.wake_up()
    graphs = runner.decode_graphs
    assert graphs is not None and graphs.captured
    assert _run(engine, [(4, 3)]) == want and graphs.steps == 2
