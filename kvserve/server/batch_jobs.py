"""Batch jobs on disk: OpenAI's batch object and a job's progress, durable across ``kill -9``.

A job is a folder ``<batch-dir>/batches/<id>/`` holding

- ``state.json``: the batch object (status, timestamps, file ids), replaced atomically on
  every status change;
- ``results.jsonl``: one line per finished request, in OpenAI's batch output format, each
  appended and fsynced before the next request's result. This file is the commit point of a
  line: a request whose result line is there is never run again; one whose line is missing
  (in flight at the crash) runs again after the restart. A torn last line (a crash inside
  ``write``) is cut off when the job is loaded.

``request_counts`` are recomputed from ``results.jsonl`` on load, so the state file needs no
write per request.
"""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from kvserve.server.batch_files import atomic_write, fsync_dir

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
COMPLETION_WINDOWS = ("24h",)


class Status(str, Enum):
    VALIDATING = "validating"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"
    EXPIRED = "expired"  # not finished within its completion window (OpenAI's status)


TERMINAL = frozenset({Status.COMPLETED, Status.FAILED, Status.CANCELLED, Status.EXPIRED})
# OpenAI's error for a line its batch's window closed on
EXPIRED_ERROR = {
    "code": "batch_expired",
    "message": "This request could not be executed before the completion window expired.",
}


@dataclass(frozen=True)
class BatchLine:
    """One request of an input file."""

    index: int  # 0-based line number among the non-blank lines
    custom_id: str
    url: str
    body: dict[str, Any]


@dataclass
class Job:
    """A batch's state; owned by the ``BatchService`` (single event loop, no lock needed)."""

    obj: dict[str, Any]  # OpenAI's batch object, as stored in state.json
    folder: Path
    done: dict[str, int] = field(default_factory=dict)  # custom_id -> status code

    @property
    def id(self) -> str:
        return str(self.obj["id"])

    @property
    def status(self) -> Status:
        return Status(self.obj["status"])

    def to_openai(self) -> dict[str, Any]:
        failed = sum(1 for code in self.done.values() if code != 200)
        counts = {"total": self.obj["request_counts"]["total"]}
        counts.update(completed=len(self.done) - failed, failed=failed)
        return {**self.obj, "request_counts": counts}


def new_batch_object(
    input_file_id: str,
    endpoint: str,
    window: str,
    metadata: dict[str, str] | None,
    window_seconds: int = 24 * 3600,
) -> dict[str, Any]:
    """OpenAI's batch object of a job just created; it expires ``window_seconds`` after its
    creation (``--batch-completion-window-seconds``; OpenAI's "24h" by default)."""
    now = int(time.time())
    return {
        "id": f"batch_{uuid.uuid4().hex}",
        "object": "batch",
        "endpoint": endpoint,
        "errors": None,
        "input_file_id": input_file_id,
        "completion_window": window,
        "status": Status.VALIDATING.value,
        "output_file_id": None,
        "error_file_id": None,
        "created_at": now,
        "in_progress_at": None,
        "expires_at": now + window_seconds,
        "finalizing_at": None,
        "completed_at": None,
        "failed_at": None,
        "expired_at": None,
        "cancelling_at": None,
        "cancelled_at": None,
        "request_counts": {"total": 0, "completed": 0, "failed": 0},
        "metadata": metadata,
    }


class JobStore:
    """The jobs under ``<root>/batches``."""

    def __init__(self, root: Path) -> None:
        self.dir = root / "batches"
        self.dir.mkdir(parents=True, exist_ok=True)
        self._append_lock = threading.Lock()  # appends run in worker threads

    def create(self, obj: dict[str, Any]) -> Job:
        folder = self.dir / obj["id"]
        folder.mkdir()
        fsync_dir(self.dir)
        job = Job(obj, folder)
        self.save(job)
        return job

    def save(self, job: Job) -> None:
        atomic_write(job.folder / "state.json", json.dumps(job.to_openai()).encode())

    def set_status(self, job: Job, status: Status, **fields: Any) -> None:
        """Move ``job`` to ``status``, stamping ``<status>_at`` (OpenAI's fields), durably."""
        job.obj["status"] = status.value
        stamp = f"{status.value}_at"
        if stamp in job.obj and job.obj[stamp] is None:
            job.obj[stamp] = int(time.time())
        job.obj.update(fields)
        self.save(job)

    def load_all(self) -> list[Job]:
        """Every job on disk, oldest first, with its progress read back from results.jsonl."""
        jobs = []
        for folder in self.dir.iterdir():
            state = folder / "state.json"
            if not state.is_file():  # a crash between mkdir and the first save
                continue
            job = Job(json.loads(state.read_bytes()), folder)
            job.done = {r["custom_id"]: status_code(r) for r in self.results(job)}
            jobs.append(job)
        return sorted(jobs, key=lambda j: (j.obj["created_at"], j.id))

    def results(self, job: Job) -> list[dict[str, Any]]:
        """The result lines written so far (a torn last line is cut off the file)."""
        path = job.folder / "results.jsonl"
        # the lock: an append still running in a worker thread (its line was cancelled, say)
        # finishes its line first, so only a crash can leave a torn one
        with self._append_lock:
            if not path.is_file():
                return []
            data = path.read_bytes()
            end = data.rfind(b"\n") + 1
            if end != len(data):  # killed inside a write: that request has not finished
                with path.open("r+b") as f:
                    f.truncate(end)
                    os.fsync(f.fileno())
        seen: set[str] = set()
        out = []
        for raw in data[:end].splitlines():
            record = json.loads(raw)
            if record["custom_id"] not in seen:  # appends are exactly-once; reads are too
                seen.add(record["custom_id"])
                out.append(record)
        return out

    def append_result(self, job: Job, record: dict[str, Any]) -> None:
        """Commit one finished request (blocking: run it in a thread)."""
        line = (json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n").encode()
        with self._append_lock, (job.folder / "results.jsonl").open("ab") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())
        job.done[record["custom_id"]] = status_code(record)


def status_code(record: dict[str, Any]) -> int:
    """A result line's HTTP status; 0 for a line that never ran (its window expired)."""
    response = record.get("response")
    return int(response["status_code"]) if response else 0


def expired_record(line: BatchLine) -> dict[str, Any]:
    """The error-file line of a request its batch's window closed on (OpenAI's)."""
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": line.custom_id,
            "response": None, "error": dict(EXPIRED_ERROR)}  # fmt: skip


def parse_lines(text: str, endpoint: str | None) -> tuple[list[BatchLine], list[dict[str, Any]]]:
    """The requests of an input file and OpenAI's validation errors (``errors.data``).

    ``endpoint`` is the batch's (every line's ``url`` must be it); None (``run-batch``)
    takes any of ``ENDPOINTS`` per line, as vLLM's run-batch does.
    """
    lines: list[BatchLine] = []
    errors: list[dict[str, Any]] = []
    seen: set[str] = set()
    for number, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        why, line = _parse_line(raw, len(lines), endpoint, seen)
        if why is not None:
            errors.append({"code": why[0], "message": why[1], "param": why[2], "line": number})
        elif line is not None:
            seen.add(line.custom_id)
            lines.append(line)
    if not lines and not errors:
        errors.append({"code": "empty_file", "message": "the input file has no requests",
                       "param": None, "line": None})  # fmt: skip
    return lines, errors


def _parse_line(
    raw: str, index: int, endpoint: str | None, seen: set[str]
) -> tuple[tuple[str, str, str | None] | None, BatchLine | None]:
    try:
        data = json.loads(raw)
    except ValueError as e:
        return ("invalid_json_line", f"the line is not valid JSON: {e}", None), None
    if not isinstance(data, dict):
        return ("invalid_json_line", "the line is not a JSON object", None), None
    cid, url, body = data.get("custom_id"), data.get("url"), data.get("body")
    if not isinstance(cid, str) or not cid:
        return ("missing_required_parameter", "custom_id must be a non-empty string",
                "custom_id"), None  # fmt: skip
    if cid in seen:
        return ("duplicate_custom_id", f"custom_id {cid!r} appears twice", "custom_id"), None
    if data.get("method", "POST") != "POST":
        return ("invalid_request", "method must be POST", "method"), None
    allowed = ENDPOINTS if endpoint is None else (endpoint,)
    if url not in allowed:
        return ("invalid_url", f"url must be one of {list(allowed)}, got {url!r}", "url"), None
    if not isinstance(body, dict):
        return ("invalid_request", "body must be a JSON object", "body"), None
    return None, BatchLine(index, cid, url, body)
