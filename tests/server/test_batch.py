"""The Batch API (/v1/files, /v1/batches) on a real ``kvserve serve`` with the tiny random
model, through the official ``openai`` client; a ``kill -9`` mid-job and a restart on the same
--batch-dir; and ``kvserve run-batch`` answering exactly as the server.

One server for the module (restarted once, by the kill test); batch concurrency 1, so every
line runs alone and greedy answers equal the online endpoint's.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.server.conftest import Server, start_server

pytestmark = pytest.mark.slow

MODEL = "tiny"
MAX_FILE_BYTES = 16384
MAX_FILE_LINES = 40
POLL = 0.05
# Exact equality of answers (logprobs too) needs every prompt computed from scratch: a prefix
# cache hit computes the rest of a prompt in another kernel call, which moves the last bits.
NO_CACHE = ["--no-enable-prefix-caching"]


class Holder:
    """The module's server; the kill test replaces it with a restarted one."""

    def __init__(self, args: list[str], log_dir: Path) -> None:
        self.args, self.log_dir, self.starts = args, log_dir, 0
        self.server = self.start()

    def start(self) -> Server:
        self.starts += 1
        return start_server(self.args, self.log_dir / f"server{self.starts}.log")


@pytest.fixture(scope="module")
def batch_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("batch")


CHAT = [
    {"model": MODEL, "messages": [{"role": "user", "content": "Hi there"}], "max_tokens": 8,
     "temperature": 0},
    {"model": MODEL, "messages": [{"role": "user", "content": "Name a colour"}],
     "max_tokens": 6, "temperature": 0, "logprobs": True, "top_logprobs": 2},
]  # fmt: skip
BAD = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "temperature": -1}


def _line(cid: str, url: str, body: dict[str, Any]) -> dict[str, Any]:
    return {"custom_id": cid, "method": "POST", "url": url, "body": body}


def _jsonl(lines: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


# run-batch's input: chat lines (one with an error) and a completion line
OFFLINE_LINES = [
    *(_line(f"c{i}", "/v1/chat/completions", b) for i, b in enumerate(CHAT)),
    _line("p0", "/v1/completions", {"model": MODEL, "prompt": "line 0", "max_tokens": 32,
                                     "temperature": 0, "ignore_eos": True}),
    _line("bad", "/v1/chat/completions", BAD),
]  # fmt: skip


@dataclass
class OfflineRun:
    proc: subprocess.Popen[str]
    output: Path


@pytest.fixture(scope="module")
def offline(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[OfflineRun]:  # fmt: skip
    """``kvserve run-batch``, started first so that its model load overlaps the other tests."""
    folder = tmp_path_factory.mktemp("offline")
    src, dst = folder / "in.jsonl", folder / "out.jsonl"
    src.write_bytes(_jsonl(OFFLINE_LINES))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "kvserve.cli", "run-batch", "-i", str(src), "-o", str(dst),
           "--model", str(tiny_model_dir), "--served-model-name", MODEL,
           "--num-kv-blocks", "200", "--batch-max-concurrency", "1", *NO_CACHE]  # fmt: skip
    log = (folder / "run-batch.log").open("w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    yield OfflineRun(proc, dst)
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    log.close()


@pytest.fixture(scope="module")
def holder(tiny_model_dir: Path, batch_dir: Path, tmp_path_factory: pytest.TempPathFactory,
           offline: OfflineRun) -> Iterator[Holder]:  # fmt: skip
    args = [
        str(tiny_model_dir), "--served-model-name", MODEL, "--num-kv-blocks", "200",
        *NO_CACHE, "--batch-dir", str(batch_dir), "--batch-max-concurrency", "1",
        "--max-batch-file-bytes", str(MAX_FILE_BYTES),
        "--max-batch-file-lines", str(MAX_FILE_LINES), "--max-batch-jobs", "2",
    ]  # fmt: skip
    h = Holder(args, tmp_path_factory.mktemp("logs"))
    yield h
    h.server.stop()


def _long_lines(n: int, prefix: str, max_tokens: int = 32) -> bytes:
    """n lines of ``max_tokens`` tokens each (ignore_eos: exact), run one at a time."""
    body = {"model": MODEL, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    return _jsonl([_line(f"{prefix}{i}", "/v1/completions", {**body, "prompt": f"line {i}"})
                   for i in range(n)])  # fmt: skip


def _submit(client: openai.OpenAI, data: bytes, endpoint: str = "/v1/completions") -> Any:
    f = client.files.create(file=("in.jsonl", data), purpose="batch")
    return client.batches.create(input_file_id=f.id, endpoint=endpoint, completion_window="24h")  # type: ignore[arg-type]


def _wait(client: openai.OpenAI, batch_id: str, until: Any, timeout: float = 120) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        b = client.batches.retrieve(batch_id)
        if until(b):
            return b
        assert time.monotonic() < deadline, f"batch stuck: {b}"
        time.sleep(POLL)


def _finished(b: Any) -> bool:
    return b.status in ("completed", "failed", "cancelled")


def _records(client: openai.OpenAI, file_id: str | None) -> dict[str, dict[str, Any]]:
    if file_id is None:
        return {}
    lines = client.files.content(file_id).text.splitlines()
    records = [json.loads(line) for line in lines]
    assert len({r["custom_id"] for r in records}) == len(records)
    return {r["custom_id"]: r for r in records}


def _answer(body: dict[str, Any]) -> dict[str, Any]:
    """What must match between two answers to one greedy request (not ids, times, cache)."""
    usage = {k: body["usage"][k] for k in ("prompt_tokens", "completion_tokens")}
    return {"choices": body["choices"], "usage": usage, "model": body["model"]}


def test_end_to_end_equals_online(holder: Holder) -> None:
    client = holder.server.client()
    lines = [_line(f"c{i}", "/v1/chat/completions", b) for i, b in enumerate(CHAT)]
    lines.append(_line("bad", "/v1/chat/completions", BAD))
    data = _jsonl(lines)
    f = client.files.create(file=("chat.jsonl", data), purpose="batch")
    assert (f.purpose, f.bytes, f.filename) == ("batch", len(data), "chat.jsonl")
    assert client.files.retrieve(f.id).id == f.id
    assert client.files.content(f.id).content == data  # byte-exact
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                              completion_window="24h", metadata={"k": "v"})  # fmt: skip
    assert (b.status, b.metadata) == ("validating", {"k": "v"})
    b = _wait(client, b.id, _finished)
    assert b.status == "completed"
    counts = b.request_counts
    assert (counts.total, counts.completed, counts.failed) == (3, 2, 1)
    assert b.in_progress_at and b.finalizing_at and b.completed_at
    out, err = _records(client, b.output_file_id), _records(client, b.error_file_id)
    assert list(out) == ["c0", "c1"] and list(err) == ["bad"]
    # the error line is the online endpoint's 400, exactly
    online_bad = httpx.post(f"{holder.server.url}/v1/chat/completions", json=BAD, timeout=30)
    assert err["bad"]["response"] == {
        "status_code": 400, "request_id": err["bad"]["response"]["request_id"],
        "body": online_bad.json(),
    }  # fmt: skip
    for i, body in enumerate(CHAT):
        rec = out[f"c{i}"]
        assert rec["error"] is None and rec["response"]["status_code"] == 200
        assert rec["response"]["request_id"] == rec["response"]["body"]["id"]
        online = httpx.post(f"{holder.server.url}/v1/chat/completions", json=body, timeout=60)
        assert _answer(rec["response"]["body"]) == _answer(online.json())
    assert client.files.delete(f.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(f.id)
    listed = client.batches.list(limit=10)
    assert [x.id for x in listed.data] == [b.id]


def test_limits(holder: Holder) -> None:
    client = holder.server.client()
    url = holder.server.url
    with pytest.raises(openai.APIStatusError) as e:
        client.files.create(file=("big.jsonl", b"x" * (MAX_FILE_BYTES + 1)), purpose="batch")
    assert e.value.status_code == 413 and "--max-batch-file-bytes" in e.value.message
    many = _jsonl([_line(f"m{i}", "/v1/completions", {"prompt": "a"}) for i in range(41)])
    with pytest.raises(openai.BadRequestError, match="--max-batch-file-lines"):
        client.files.create(file=("many.jsonl", many), purpose="batch")
    r = httpx.post(f"{url}/v1/files", data={"purpose": "fine-tune"},
                   files={"file": ("a.jsonl", b"{}\n")})  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["param"] == "purpose"
    f = client.files.create(file=("ok.jsonl", _long_lines(2, "ok")), purpose="batch")
    for field, value in (("endpoint", "/v1/responses"), ("completion_window", "1h"),
                         ("input_file_id", "file-nope")):  # fmt: skip
        body = {"input_file_id": f.id, "endpoint": "/v1/completions", "completion_window": "24h"}
        r = httpx.post(f"{url}/v1/batches", json={**body, field: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    assert httpx.get(f"{url}/v1/batches/batch_nope").status_code == 404
    assert httpx.get(f"{url}/v1/files/file-nope/content").status_code == 404
    # a file whose lines are not batch requests: the job fails in validation, naming the line
    b = _submit(client, b'{"custom_id": "a", "url": "/v1/embeddings", "body": {}}\n')
    b = _wait(client, b.id, _finished)
    assert b.status == "failed" and b.errors.data[0].line == 1
    assert b.errors.data[0].code == "invalid_url"


def test_cancel_and_job_limit(holder: Holder) -> None:
    client = holder.server.client()
    # runs first (oldest), one line at a time; lines of 320 tokens, since 20 x 32 finished
    # before the cancel once on an AVX512-BF16 EPYC (the cancel got a 400)
    a = _submit(client, _long_lines(20, "a", max_tokens=320))
    b = _submit(client, _long_lines(2, "b"))  # waits behind a
    with pytest.raises(openai.RateLimitError, match="--max-batch-jobs"):
        _submit(client, _long_lines(2, "c"))
    _wait(client, a.id, lambda x: x.request_counts.completed >= 1)
    # Online requests while a runs: each one-chunk prompt's step holds a's one running row
    # out (or none, between two lines); their answers are unchanged.
    # Up to 10 (at least 3): on a loaded box all of 3 once landed between two of a's lines.
    before = holder.server.metrics(MODEL)["kvserve:num_background_rows_held_total"]
    held = tries = 0
    while tries < 3 or (held == 0 and tries < 10):
        r = client.completions.create(model=MODEL, prompt="online", max_tokens=2, temperature=0)
        assert r.usage.completion_tokens == 2
        tries += 1
        held = holder.server.metrics(MODEL)["kvserve:num_background_rows_held_total"] - before
    assert 1 <= held <= tries
    assert client.batches.cancel(b.id).status == "cancelling"
    assert client.batches.cancel(a.id).status == "cancelling"
    a = _wait(client, a.id, _finished)
    b = _wait(client, b.id, _finished)
    assert (a.status, b.status) == ("cancelled", "cancelled")
    assert a.cancelled_at and a.cancelling_at
    assert 1 <= a.request_counts.completed < 20 and a.request_counts.failed == 0
    assert len(_records(client, a.output_file_id)) == a.request_counts.completed
    assert (b.request_counts.completed, b.output_file_id) == (0, None)
    with pytest.raises(openai.BadRequestError, match="cancelled"):
        client.batches.cancel(a.id)
    holder.server.wait_idle(MODEL)  # the cancelled lines were aborted in the engine


def test_kill_9_mid_job_resumes_exactly_once(holder: Holder, batch_dir: Path) -> None:
    client = holder.server.client()
    total = 16
    job = _submit(client, _long_lines(total, "k"))
    _wait(client, job.id, lambda x: x.request_counts.completed >= 2)
    holder.server.proc.send_signal(signal.SIGKILL)
    holder.server.proc.wait()
    results = batch_dir / "batches" / job.id / "results.jsonl"
    before = len(results.read_bytes().splitlines())
    assert 2 <= before < total  # killed mid-job
    holder.server = holder.start()
    client = holder.server.client()
    done = _wait(client, job.id, _finished)
    assert done.status == "completed"
    assert (done.request_counts.completed, done.request_counts.failed) == (total, 0)
    out = _records(client, done.output_file_id)
    assert sorted(out) == sorted(f"k{i}" for i in range(total))
    # on disk: one committed line per request, none run twice
    raw = [json.loads(x)["custom_id"] for x in results.read_bytes().splitlines()]
    assert sorted(raw) == sorted(out)
    for rec in out.values():
        assert rec["response"]["body"]["usage"]["completion_tokens"] == 32


def test_run_batch_cli_equals_server(holder: Holder, offline: OfflineRun) -> None:
    assert offline.proc.wait(300) == 0
    records = [json.loads(x) for x in offline.output.read_text().splitlines()]
    assert [r["custom_id"] for r in records] == ["c0", "c1", "p0", "bad"]  # input order
    client = holder.server.client()
    by_url: dict[str, list[dict[str, Any]]] = {}
    for line in OFFLINE_LINES:
        by_url.setdefault(line["url"], []).append(line)
    served: dict[str, dict[str, Any]] = {}
    for url, lines in by_url.items():  # one job per endpoint, as OpenAI's batches are
        b = _wait(client, _submit(client, _jsonl(lines), url).id, _finished)
        served |= _records(client, b.output_file_id) | _records(client, b.error_file_id)
    for rec in records:
        mine = served[rec["custom_id"]]["response"]
        assert rec["response"]["status_code"] == mine["status_code"]
        if mine["status_code"] == 200:
            assert _answer(rec["response"]["body"]) == _answer(mine["body"])
        else:
            assert rec["response"]["body"] == mine["body"]
