"""The Batch API's parts without a model: input-file validation, the on-disk job store (a
torn last line, exactly-once reads), multipart parsing, the file store, and the line runner
against a real ASGI app (retries of 429, the concurrency cap, the batch priority)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from kvserve.server.batch_files import FileStore, parse_multipart
from kvserve.server.batch_jobs import JobStore, Status, new_batch_object, parse_lines
from kvserve.server.batch_runner import BATCH_PRIORITY, LineSender, run_lines
from kvserve.server.errors import APIError


def _line(cid: str, url: str = "/v1/completions", **body: Any) -> str:
    return json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": body})


def test_parse_lines_names_each_bad_line() -> None:
    text = "\n".join([
        _line("a", prompt="x"), "", "not json", _line("a", prompt="y"),
        _line("b", url="/v1/embeddings"), json.dumps({"custom_id": "c", "url": "/v1/completions"}),
        json.dumps({"url": "/v1/completions", "body": {}}),
    ])  # fmt: skip
    lines, errors = parse_lines(text, "/v1/completions")
    assert [(line.index, line.custom_id) for line in lines] == [(0, "a")]
    assert [(e["line"], e["code"]) for e in errors] == [
        (3, "invalid_json_line"), (4, "duplicate_custom_id"), (5, "invalid_url"),
        (6, "invalid_request"), (7, "missing_required_parameter"),
    ]  # fmt: skip
    # run-batch (no batch endpoint): any of the three per line
    mixed = "\n".join([_line("a"), _line("b", url="/v1/embeddings")])
    assert [line.url for line in parse_lines(mixed, None)[0]] == [
        "/v1/completions", "/v1/embeddings",
    ]  # fmt: skip
    assert parse_lines("\n\n", None)[1][0]["code"] == "empty_file"


def _record(cid: str, status: int = 200) -> dict[str, Any]:
    return {"id": "r", "custom_id": cid, "response": {"status_code": status, "body": {}},
            "error": None}  # fmt: skip


def test_job_store_survives_a_torn_line_and_reads_each_line_once(tmp_path: Path) -> None:
    store = JobStore(tmp_path)
    job = store.create(new_batch_object("file-x", "/v1/completions", "24h", None))
    store.set_status(job, Status.IN_PROGRESS)
    for cid, status in (("a", 200), ("b", 400), ("a", 200)):  # "a" twice: read once
        store.append_result(job, _record(cid, status))
    results = job.folder / "results.jsonl"
    whole = results.read_bytes()
    results.write_bytes(whole + b'{"id": "r", "custom_id": "c", "resp')  # killed mid-write
    (loaded,) = JobStore(tmp_path).load_all()
    assert loaded.status is Status.IN_PROGRESS and loaded.obj["in_progress_at"] is not None
    assert loaded.done == {"a": 200, "b": 400}
    assert results.read_bytes() == whole  # the torn line is cut off
    counts = loaded.to_openai()["request_counts"]
    assert (counts["completed"], counts["failed"]) == (1, 1)


def test_multipart_is_byte_exact() -> None:
    data = b'{"a": 1}\r\n{"b": "\xc3\xa9"}\n\n--not-a-boundary\n'
    req = httpx.Request("POST", "http://x/v1/files", data={"purpose": "batch"},
                        files={"file": ("in.jsonl", data)})  # fmt: skip
    upload = parse_multipart(req.headers["content-type"], req.read())
    assert (upload.fields, upload.filename, upload.data) == ({"purpose": "batch"}, "in.jsonl",
                                                            data)  # fmt: skip
    with pytest.raises(APIError, match="multipart/form-data"):
        parse_multipart("application/json", b"{}")


def test_file_store(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    obj = store.create(b"abc\n", "in.jsonl", "batch")
    assert store.content(obj["id"]) == b"abc\n" and store.get(obj["id"])["bytes"] == 4
    (store.dir / "file-orphan.data").write_bytes(b"x")  # killed before its metadata
    store = FileStore(tmp_path)
    assert not (store.dir / "file-orphan.data").exists()
    for bad in ("../files/" + obj["id"], "file-nope"):
        with pytest.raises(APIError) as e:
            store.get(bad)
        assert e.value.status == 404
    assert store.delete(obj["id"])["deleted"] and store.list() == []


def _app(seen: list[dict[str, Any]], refuse_first: int) -> Starlette:
    """A real ASGI app: 429 for the first ``refuse_first`` requests, then an echo."""
    in_flight = [0]

    async def echo(request: Request) -> JSONResponse:
        body = await request.json()
        in_flight[0] += 1
        try:
            assert in_flight[0] == 1, "more lines in flight than the cap"
            await asyncio.sleep(0.01)
            if len(seen) < refuse_first:
                seen.append({"refused": body})
                return JSONResponse({"error": {"message": "busy"}}, status_code=429)
            seen.append(body)
            return JSONResponse({"id": f"cmpl-{body['prompt']}", "auth":
                                 request.headers.get("authorization")})  # fmt: skip
        finally:
            in_flight[0] -= 1

    return Starlette(routes=[Route("/v1/completions", echo, methods=["POST"])])


def test_run_lines_retries_caps_and_sets_the_batch_priority(monkeypatch: Any) -> None:
    monkeypatch.setattr("kvserve.server.batch_runner.RETRY_SECONDS", 0.0)
    text = "\n".join([_line("a", prompt="a"), _line("b", prompt="b", priority=3),
                      _line("c", prompt="c", stream=True), _line("d", prompt="d")])  # fmt: skip
    lines, _ = parse_lines(text, "/v1/completions")
    seen: list[dict[str, Any]] = []
    sender = LineSender(_app(seen, refuse_first=2), "k", priority_scheduling=True)
    records: list[dict[str, Any]] = []

    async def commit(record: dict[str, Any]) -> None:
        records.append(record)

    slots = asyncio.Semaphore(1)
    asyncio.run(run_lines(lines, sender, slots, commit))
    by_id = {r["custom_id"]: r["response"] for r in records}
    assert sorted(by_id) == ["a", "b", "c", "d"]  # each exactly once
    assert by_id["a"]["status_code"] == 200 and by_id["a"]["request_id"] == "cmpl-a"
    assert by_id["a"]["body"]["auth"] == "Bearer k"
    assert "priority is set by the batch runner" in by_id["b"]["body"]["error"]["message"]
    assert by_id["c"]["status_code"] == 400 and by_id["c"]["body"]["error"]["param"] == "stream"
    sent = [b for b in seen if "refused" not in b]
    assert [b["prompt"] for b in sent] == ["a", "d"]  # "a" retried after two 429s
    assert all(b["priority"] == BATCH_PRIORITY for b in sent)
    assert slots._value == 1  # every slot given back
