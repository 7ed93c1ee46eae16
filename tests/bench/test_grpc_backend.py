"""``kvserve bench serve --backend grpc`` against a real ``kvserve serve --grpc-port``.

The benchmark's numbers must come from the gRPC stream (TTFT, ITL, usage) and agree exactly
with the server's own Prometheus counters, as the HTTP backends' do (test_e2e_kvserve.py).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvserve.bench.client import RequestInput
from kvserve.bench.grpc_client import call_metadata, grpc_target, sampling_parameters
from kvserve.cli import main
from tests.server.conftest import API_KEY, BUILTIN, Server, free_port, start_server

OUTPUT_LEN = 8
NUM_PROMPTS = 6


@pytest.fixture(scope="module")
def grpc_bench_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("logs") / "grpc_bench_server.log"
    port = free_port()
    args = ["--grpc-port", str(port), "--max-num-seqs", "4", "--kv-cache-memory", "256MiB",
            "--no-warmup"]  # fmt: skip
    srv = start_server(args, log, api_key=API_KEY)
    srv.grpc_port = port  # type: ignore[attr-defined]
    yield srv
    srv.stop()


def _argv(server: Server, out_dir: Path, *extra: str) -> list[str]:
    return [
        "bench", "serve", "--backend", "grpc", "--base-url", server.url,
        "--grpc-port", str(server.grpc_port),  # type: ignore[attr-defined]
        "--served-model-name", BUILTIN,  # /v1/models needs the key; the name is known
        "--dataset-name", "random", "--random-input-len", "24",
        "--random-output-len", str(OUTPUT_LEN), "--num-prompts", str(NUM_PROMPTS),
        "--max-concurrency", "3", "--temperature", "0", "--seed", "0", "--disable-tqdm",
        "--metrics-interval", "0.2", "--save-result", "--save-detailed",
        "--result-dir", str(out_dir), "--result-filename", "result.json", *extra,
    ]  # fmt: skip


def _delta(before: dict[str, float], after: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


@pytest.mark.slow
def test_grpc_backend_metrics_match_the_server(grpc_bench_server: Server, tmp_path: Path) -> None:
    before = grpc_bench_server.wait_idle()
    assert main([*_argv(grpc_bench_server, tmp_path), "--api-key", API_KEY]) == 0
    after = grpc_bench_server.wait_idle()
    result: dict[str, Any] = json.loads((tmp_path / "result.json").read_text())
    n = NUM_PROMPTS
    assert (result["completed"], result["failed"], result["errors"]) == (n, 0, [""] * n)
    # random prompts end with ignore_eos: exactly OUTPUT_LEN tokens each, counted by usage
    assert result["output_lens"] == [OUTPUT_LEN] * n
    assert result["output_token_sources"] == ["usage"] * n
    assert result["total_output_tokens"] == n * OUTPUT_LEN
    assert _delta(before, after, "kvserve:generation_tokens_total") == n * OUTPUT_LEN
    assert _delta(before, after, "kvserve:prompt_tokens_total") == result["total_input_tokens"]
    assert result["total_input_tokens"] == sum(result["input_lens"])
    assert result["server_metrics_source"] == "kvserve"
    for ttft, e2e, itl in zip(result["ttfts"], result["latencies"], result["itls"], strict=True):
        assert 0 < ttft <= e2e
        assert 1 <= len(itl) <= OUTPUT_LEN - 1 and all(gap >= 0 for gap in itl)
    for key in ("mean_ttft_ms", "mean_itl_ms", "mean_tpot_ms", "output_throughput"):
        assert result[key] > 0, key
    assert result["mean_ttft_ms"] <= result["mean_e2el_ms"]


@pytest.mark.slow
def test_wrong_key_fails_every_request(grpc_bench_server: Server, tmp_path: Path) -> None:
    assert main([*_argv(grpc_bench_server, tmp_path), "--api-key", "wrong"]) == 1
    result = json.loads((tmp_path / "result.json").read_text())
    assert (result["completed"], result["failed"]) == (0, NUM_PROMPTS)
    assert {e.split(":")[0] for e in result["errors"]} == {"gRPC UNAUTHENTICATED"}


def test_grpc_needs_its_port(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "serve", "--backend", "grpc", "--dataset-name", "random",
            "--tokenizer", str(tmp_path)]  # fmt: skip
    assert main(argv) == 2  # refused before any tokenizer or connection
    assert "--backend grpc needs --grpc-port" in capsys.readouterr().err


def test_request_fields_map_onto_sampling_parameters() -> None:
    inp = RequestInput(
        api_url="127.0.0.1:1", model="m", prompt="p", prompt_len=1, max_tokens=7,
        ignore_eos=True, extra_body={"top_k": 5, "temperature": 0.5, "stop": "x"},
        headers={"Content-Type": "application/json", "Authorization": "Bearer k", "X-A": "b"},
    )  # fmt: skip
    params = sampling_parameters(inp)
    assert (params.max_tokens, params.ignore_eos, params.top_k) == (7, True, 5)
    assert (params.temperature, list(params.stop)) == (0.5, ["x"])
    assert call_metadata(inp.headers) == (("authorization", "Bearer k"), ("x-a", "b"))
    inp.extra_body = {"logit_bias": {"1": 2}}
    with pytest.raises(ValueError, match="'logit_bias' has no gRPC equivalent"):
        sampling_parameters(inp)
    assert grpc_target("http://localhost:8000", 50051) == "localhost:50051"
    assert grpc_target("http://[::1]:8000", 50051) == "[::1]:50051"
