"""Real ``kvserve serve`` subprocesses on free 127.0.0.1 ports, shared per session.

Each server loads its models once (~10-15 s for the built-in model on 2 cores), so the suite
starts only two: ``server`` (the built-in model plus a tiny random model, with an API key)
and ``queue_server`` (a tiny batch and a bounded queue, for backpressure tests).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from transformers import LlamaConfig, LlamaForCausalLM

API_KEY = "sk-kvserve-test"
BUILTIN = "SmolLM2-135M-Instruct"
TINY = "tiny-random"
STARTUP_TIMEOUT = 240.0
SERVER_THREADS = "1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    """A running server process and how to reach it."""

    proc: subprocess.Popen[bytes]
    port: int
    log: Path
    api_key: str | None = None
    health_seen: list[int] = field(default_factory=list)  # /health codes while starting

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self, **kw: object) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=self.api_key or "none", **kw)  # type: ignore[arg-type]

    def async_client(self, **kw: object) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=self.api_key or "none", **kw)  # type: ignore[arg-type]

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def metrics(self, model: str = BUILTIN) -> dict[str, float]:
        """Sample name -> value for ``model``'s label set (histograms: _count/_sum too)."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.labels.get("model_name") == model:
                    key = s.name
                    if "finished_reason" in s.labels:
                        key += f"{{{s.labels['finished_reason']}}}"
                    if "le" not in s.labels:
                        out[key] = s.value
        return out

    def wait_idle(self, model: str = BUILTIN, timeout: float = 20.0) -> dict[str, float]:
        """Metrics once nothing runs or waits and no KV block is in use."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics(model)
            if (
                m["kvserve:num_requests_running"] == 0
                and m["kvserve:num_requests_waiting"] == 0
                and m["kvserve:kv_cache_usage_perc"] == 0
            ):
                return m
            assert time.monotonic() < deadline, f"server not idle: {m}"
            time.sleep(0.1)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def start_server(args: list[str], log: Path, api_key: str | None = None) -> Server:
    """Start ``kvserve serve`` and wait for /health to turn 200."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "KVSERVE_API_KEY"}
    # One torch thread per server: on a shared 2-core box, OpenMP barriers with two threads
    # stall whenever another process takes a core (8-10x slower steps).
    env.setdefault("OMP_NUM_THREADS", SERVER_THREADS)
    cmd = [sys.executable, "-m", "kvserve.cli", "serve", *args, "--port", str(port)]
    if "--grammar-warm-up" not in args:
        # The compile workers start with the first grammar: ~40 of the suite's ~60 servers
        # never compile one, and the warm-up took 2.5-3.0 s of CPU per start from the other
        # test worker (benchmarks/grammar_warm_up.py). test_grammar_limits.py keeps it.
        cmd.append("--no-grammar-warm-up")
    if api_key:
        cmd += ["--api-key", api_key]
    with log.open("wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    server = Server(proc, port, log, api_key)
    deadline = time.monotonic() + STARTUP_TIMEOUT
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            code = httpx.get(f"{server.url}/health", timeout=2).status_code
            server.health_seen.append(code)
            if code == 200:
                return server
        except httpx.TransportError:
            pass  # not listening yet
        if time.monotonic() > deadline:
            server.stop()
            raise RuntimeError(
                f"server not ready in {STARTUP_TIMEOUT}s:\n{log.read_text()[-3000:]}"
            )
        time.sleep(0.25)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, builtin_model_dir: Path) -> Path:
    """A random 2-layer Llama with the built-in model's tokenizer (vocab 49152)."""
    path = tmp_path_factory.mktemp("models") / TINY
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=True,
    )  # fmt: skip
    LlamaForCausalLM(cfg).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (builtin_model_dir / name).is_file():
            shutil.copy(builtin_model_dir / name, path / name)
    return path


@pytest.fixture(scope="session")
def server(
    builtin_model_dir: Path, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    """The built-in model (served under its own name) and the tiny model, behind an API key."""
    log = tmp_path_factory.mktemp("logs") / "server.log"
    srv = start_server(
        [
            str(builtin_model_dir), str(tiny_model_dir),
            "--served-model-name", BUILTIN, TINY,
            "--num-kv-blocks", "600",
            "--max-tokens-limit", "4096",
            "--max-request-body-bytes", "65536",
            "--max-num-seqs", "64",
        ],
        log,
        api_key=API_KEY,
    )  # fmt: skip
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def queue_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The built-in model with 2 running and at most 2 queued sequences."""
    log = tmp_path_factory.mktemp("logs") / "queue_server.log"
    args = ["--max-num-seqs", "2", "--max-queued-requests", "2", "--num-kv-blocks", "200"]
    srv = start_server(args, log)
    yield srv
    srv.stop()


RERANKER = "tiny-reranker"
# the reranker server's KV cache: 8192 blocks of 16 tokens, 8 KiB each in float32 (64 MiB),
# so that sleep's release stands far above the RSS noise (tests/server/test_sleep.py)
RERANKER_KV_BLOCKS = 8192
SCORE_MAX_DOCS = 4  # --max-prompts-per-request of the score servers
SCORE_MAX_TOKENS = 400  # --max-score-tokens-per-request (a reranker prompt is ~60 tokens)


def score_server_args(path: Path, num_blocks: int, *extra: str) -> list[str]:
    return [str(path), "--dtype", "float32", "--num-kv-blocks", str(num_blocks),
            "--max-prompts-per-request", str(SCORE_MAX_DOCS),
            "--max-score-tokens-per-request", str(SCORE_MAX_TOKENS), *extra]  # fmt: skip


@pytest.fixture(scope="session")
def reranker_server(
    tmp_path_factory: pytest.TempPathFactory, builtin_model_dir: Path
) -> Iterator[tuple[Server, Path]]:
    """A tiny random Qwen3 served as a causal-LM reranker (``--task score``), with sleep mode
    on, behind the API key; shared by the score and sleep tests. Yields it and its folder."""
    from tests.engine.score_models import make_model

    path = tmp_path_factory.mktemp(RERANKER)
    make_model("qwen3", path, builtin_model_dir)
    args = score_server_args(path, RERANKER_KV_BLOCKS, "--task", "score", "--enable-sleep-mode",
                             "--served-model-name", RERANKER)  # fmt: skip
    srv = start_server(args, tmp_path_factory.mktemp("logs") / "reranker.log", api_key=API_KEY)
    yield srv, path
    srv.stop()
