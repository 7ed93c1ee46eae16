"""Batch jobs whose completion window closes (OpenAI's ``expired``), on a real ``kvserve
serve`` whose "24h" lasts a few seconds (``--batch-completion-window-seconds``), through the
official ``openai`` client; and a job whose window closed while the server was down."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.server.conftest import Server, start_server

pytestmark = pytest.mark.slow

MODEL = "tiny"
WINDOW = 3  # seconds


def _lines(n: int, prefix: str) -> bytes:
    """n completions of exactly 32 tokens, far more than a 3-second window runs one at a time."""
    body = {"model": MODEL, "max_tokens": 32, "temperature": 0, "ignore_eos": True}
    lines = [{"custom_id": f"{prefix}{i}", "method": "POST", "url": "/v1/completions",
              "body": {**body, "prompt": f"line {i}"}} for i in range(n)]  # fmt: skip
    return "".join(json.dumps(x) + "\n" for x in lines).encode()


def _submit(client: openai.OpenAI, data: bytes) -> Any:
    f = client.files.create(file=("in.jsonl", data), purpose="batch")
    return client.batches.create(input_file_id=f.id, endpoint="/v1/completions",
                                 completion_window="24h")  # fmt: skip


def _wait_final(client: openai.OpenAI, batch_id: str, timeout: float = 120) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        b = client.batches.retrieve(batch_id)
        if b.status in ("completed", "failed", "cancelled", "expired"):
            return b
        assert time.monotonic() < deadline, f"batch stuck: {b}"
        time.sleep(0.1)


def _records(client: openai.OpenAI, file_id: str | None) -> dict[str, dict[str, Any]]:
    if file_id is None:
        return {}
    records = [json.loads(x) for x in client.files.content(file_id).text.splitlines()]
    assert len({r["custom_id"] for r in records}) == len(records)  # each line once
    return {r["custom_id"]: r for r in records}


def _check_expired(client: openai.OpenAI, job: Any, total: int, prefix: str) -> int:
    """``job`` is expired with every line exactly once in its files; returns how many ran."""
    assert job.status == "expired"
    assert job.expires_at == job.created_at + WINDOW
    assert job.expired_at is not None and job.expired_at >= job.expires_at
    out, err = _records(client, job.output_file_id), _records(client, job.error_file_id)
    assert set(out) | set(err) == {f"{prefix}{i}" for i in range(total)}
    assert not set(out) & set(err)
    for rec in out.values():
        assert rec["response"]["body"]["usage"]["completion_tokens"] == 32
    for rec in err.values():
        assert rec["response"] is None
        assert rec["error"]["code"] == "batch_expired"
    counts = job.request_counts
    assert (counts.total, counts.completed, counts.failed) == (total, len(out), len(err))
    return len(out)


def test_a_job_past_its_window_expires(tiny_model_dir: Path, tmp_path: Path) -> None:
    batch_dir = tmp_path / "batch"
    args = [str(tiny_model_dir), "--served-model-name", MODEL, "--num-kv-blocks", "200",
            "--batch-dir", str(batch_dir), "--batch-max-concurrency", "1",
            "--batch-completion-window-seconds", str(WINDOW)]  # fmt: skip
    server: Server = start_server(args, tmp_path / "server1.log")
    try:
        client = server.client()
        total = 200
        job = _wait_final(client, _submit(client, _lines(total, "a")).id)
        ran = _check_expired(client, job, total, "a")
        assert ran < total  # the window closed on most of them
        # a second job, then the server stops before its window closes ...
        second = _submit(client, _lines(total, "b"))
    finally:
        server.stop()
    # wait only for what is left of its window (stopping the server often outlasts it): a
    # second past ``expires_at``, which is whole seconds
    time.sleep(max(0.0, second.expires_at + 1 - time.time()))
    # ... and a restart after it closed expires the job at once, lines answered so far kept
    server = start_server(args, tmp_path / "server2.log")
    try:
        client = server.client()
        job = _wait_final(client, second.id, timeout=30)
        _check_expired(client, job, total, "b")
        server.wait_idle(MODEL)  # the aborted lines left nothing running in the engine
    finally:
        server.stop()
