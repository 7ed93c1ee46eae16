"""``kvserve serve --batch-invariant``: the flag reaches the engine (its log line and the
``execution_paths_info`` gauge), a completion's tokens and logprobs over HTTP are the same
alone and beside concurrent requests, and a combination that cannot hold it stops the start
with the reason."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvserve.engine.arg_utils import EngineArgs
from kvserve.server.cli import add_serve_parser
from tests.server.conftest import TINY, Server, start_server

PROMPTS = ["The quick brown fox", "Once upon a time in a land far away, there lived",
           "1, 2, 3, 4,", "Paris is the capital of", "def fib(n):", "Hello"]  # fmt: skip


@pytest.fixture(scope="module")
def invariant_server(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("logs") / "batch_invariant.log"
    srv = start_server(
        [str(tiny_model_dir), "--served-model-name", TINY, "--batch-invariant",
         "--dtype", "bfloat16", "--num-kv-blocks", "200", "--max-num-batched-tokens", "16"],
        log,
    )  # fmt: skip
    yield srv
    srv.stop()


def _completion(srv: Server, prompt: str, seed: int) -> tuple[list[str], list[float]]:
    out = srv.client().completions.create(
        model=TINY, prompt=prompt, max_tokens=6, logprobs=2, seed=seed, temperature=0.8,
    )  # fmt: skip
    lp = out.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    return lp.tokens, lp.token_logprobs


async def _concurrently(srv: Server) -> list[Any]:
    client = srv.async_client()
    calls = [client.completions.create(model=TINY, prompt=p, max_tokens=6, logprobs=2, seed=i,
                                       temperature=0.8)
             for i, p in enumerate(PROMPTS)]  # fmt: skip
    return list(await asyncio.gather(*calls))


@pytest.mark.slow
def test_flag_reaches_the_engine_and_holds_over_http(invariant_server: Server) -> None:
    log = invariant_server.log.read_text()
    assert "batch-invariant mode: on" in log
    metrics = httpx.get(f"{invariant_server.url}/metrics", timeout=10).text
    assert 'batch_invariant="True"' in metrics
    alone = [_completion(invariant_server, p, i) for i, p in enumerate(PROMPTS)]
    together = asyncio.run(_concurrently(invariant_server))
    for want, out in zip(alone, together, strict=True):
        lp = out.choices[0].logprobs
        assert (lp.tokens, lp.token_logprobs) == want


def test_a_refused_combination_is_refused_from_the_serve_flags(tiny_model_dir: Path) -> None:
    """The serve flags build the engine's config, which refuses with the reason (the server
    logs it and the model does not load)."""
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["serve", str(tiny_model_dir), "--batch-invariant",
                              "--attention-backend", "TORCH_SDPA"])  # fmt: skip
    engine_args = replace(EngineArgs.from_cli_args(args), model=str(tiny_model_dir))
    assert engine_args.batch_invariant
    with pytest.raises(
        ValueError,
        match=r"batch-invariant mode \(--batch-invariant\) needs the "
        "CPU_KERNEL attention backend, not TORCH_SDPA",
    ):
        engine_args.create_engine_config()
