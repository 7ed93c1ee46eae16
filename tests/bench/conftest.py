"""Fixtures for the benchmark-lab tests: an offline tokenizer and a fake streaming server."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from tests.bench.fake_server import FakeServer, make_app


@pytest.fixture(scope="session")
def byte_tokenizer() -> PreTrainedTokenizerFast:
    """A GPT-2-style byte-level BPE with no merges: exactly one token per UTF-8 byte, plus an
    ``<|endoftext|>`` special token. Built in memory, so token counts in tests are exact."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    vocab["<|endoftext|>"] = len(alphabet)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


@pytest.fixture(scope="session")
def byte_tokenizer_dir(byte_tokenizer: PreTrainedTokenizerFast, tmp_path_factory) -> Path:
    """The byte tokenizer saved as a local folder, for code paths that take --tokenizer PATH."""
    path = tmp_path_factory.mktemp("byte-tokenizer")
    byte_tokenizer.save_pretrained(path)
    return path


@pytest.fixture
def keep_torch_threads() -> Iterator[None]:
    """benchmarks/study/run.py sets torch's thread count; give the rest of the session its
    own back."""
    import torch

    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def run_study(tmp_path: Path, keep_torch_threads: None) -> Callable[..., dict[str, Any]]:
    """``run_study("expN", *flags)``: ``benchmarks/study/run.py expN --quick`` into
    ``tmp_path/out`` (server logs under ``tmp_path/work``); returns its results.json."""

    def run(name: str, *flags: str) -> dict[str, Any]:
        from benchmarks.study import run as study

        out, work = tmp_path / "out", tmp_path / "work"
        argv = [name, "--quick", "--out-dir", str(out), "--work-dir", str(work), *flags]
        assert study.main(argv) == 0
        return json.loads((out / "results.json").read_text())

    return run


@pytest.fixture
async def fake_server() -> AsyncIterator[FakeServer]:
    """The fake server on 127.0.0.1 with an ephemeral port, in the test's event loop."""
    state = FakeServer()
    runner = web.AppRunner(make_app(state))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    state.base_url = f"http://127.0.0.1:{port}"
    yield state
    await runner.cleanup()


@pytest.fixture
def threaded_fake_server() -> Iterator[FakeServer]:
    """The fake server in a background thread with its own event loop, for code that calls
    ``asyncio.run`` itself (the sync entry points)."""
    state = FakeServer(delays=[0.02, 0.01, 0.01])
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(make_app(state))
    ready = threading.Event()

    def serve() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        loop.run_until_complete(site.start())
        state.base_url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
        ready.set()
        loop.run_forever()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    assert ready.wait(10), "the fake server did not start"
    yield state
    asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    loop.close()
