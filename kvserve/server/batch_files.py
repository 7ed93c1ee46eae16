"""The Batch API's file store: ``/v1/files`` uploads kept on disk under ``--batch-dir``.

A file is two entries in ``<batch-dir>/files/``: ``<id>.data`` (the bytes, as uploaded) and
``<id>.json`` (OpenAI's file object). Both are written atomically (a temporary file, fsync,
rename, fsync of the folder), the data first, so that a server killed at any point leaves
either a whole file or none: the metadata is the commit point, and data without it is
swept at start-up.
"""

from __future__ import annotations

import email.parser
import email.policy
import json
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvserve.server.errors import APIError, bad_request

# what an upload may be for: batch input; batch output and error files are written by jobs
UPLOAD_PURPOSES = ("batch",)
OUTPUT_PURPOSE = "batch_output"


@dataclass(frozen=True)
class BatchLimits:
    """The Batch API's bounds (each a ``serve`` flag, named in the 4xx that enforces it)."""

    max_file_bytes: int = 64 * 1024 * 1024  # --max-batch-file-bytes (an upload)
    max_file_lines: int = 50_000  # --max-batch-file-lines (OpenAI's own limit per batch)
    max_jobs: int = 16  # --max-batch-jobs: jobs not yet completed, failed or cancelled
    max_concurrency: int = 4  # --batch-max-concurrency: batch requests in flight at once
    # --batch-completion-window-seconds: how long a job's "24h" window lasts here; a job not
    # finished by then expires (its unfinished lines go to the error file as batch_expired)
    completion_window_seconds: int = 24 * 3600


def atomic_write(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` all at once, durably: a crash leaves old or new."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    with tmp.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def fsync_dir(path: Path) -> None:
    """Make a rename or a new entry in ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def not_found(kind: str, ident: str, param: str | None = None) -> APIError:
    return APIError(404, f"No such {kind}: {ident!r}", param=param, code="not_found")


@dataclass(frozen=True)
class Upload:
    """A ``multipart/form-data`` upload: its form fields and its one file."""

    fields: dict[str, str]
    filename: str | None
    data: bytes | None


def parse_multipart(content_type: str, body: bytes) -> Upload:
    """The parts of a multipart body, byte-exact (the stdlib's MIME parser: no dependency)."""
    if not content_type.lower().startswith("multipart/form-data"):
        raise bad_request("POST /v1/files takes multipart/form-data (fields: purpose, file)")
    head = b"Content-Type: " + content_type.encode("latin-1") + b"\r\n\r\n"
    msg = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(head + body)
    if not msg.is_multipart():
        raise bad_request("the multipart body has no parts")
    fields: dict[str, str] = {}
    filename, data = None, None
    for part in msg.iter_parts():
        name = part.get_param("name", header="content-disposition")
        payload = part.get_payload(decode=True)
        if not isinstance(name, str) or not isinstance(payload, bytes):
            continue
        if name == "file":
            filename, data = part.get_filename() or "upload.jsonl", payload
        else:
            fields[name] = payload.decode("utf-8", "replace")
    return Upload(fields, filename, data)


class FileStore:
    """The files under ``<root>/files``; one owner (the server's ``BatchService``)."""

    def __init__(self, root: Path) -> None:
        self.dir = root / "files"
        self.dir.mkdir(parents=True, exist_ok=True)
        for data in self.dir.glob("*.data"):  # a crash between the two writes: no metadata
            if not data.with_suffix(".json").exists():
                data.unlink()
        for tmp in self.dir.glob(".*.tmp"):
            tmp.unlink()

    def create(
        self, data: bytes, filename: str, purpose: str, file_id: str | None = None
    ) -> dict[str, Any]:
        """Store ``data``; ``file_id`` given (a job's output) makes a rewrite idempotent."""
        file_id = file_id or f"file-{uuid.uuid4().hex}"
        obj = {
            "id": file_id,
            "object": "file",
            "bytes": len(data),
            "created_at": int(time.time()),
            "filename": filename,
            "purpose": purpose,
            "status": "processed",
            "expires_at": None,
            "status_details": None,
        }
        atomic_write(self.dir / f"{file_id}.data", data)
        atomic_write(self.dir / f"{file_id}.json", json.dumps(obj).encode())
        return obj

    def _meta(self, file_id: str) -> Path:
        # ids are ours (file-<hex>); anything else, a path included, is simply not found
        if not file_id.replace("-", "").replace("_", "").isalnum():
            raise not_found("file", file_id)
        path = self.dir / f"{file_id}.json"
        if not path.is_file():
            raise not_found("file", file_id)
        return path

    def get(self, file_id: str) -> dict[str, Any]:
        return json.loads(self._meta(file_id).read_bytes())

    def content(self, file_id: str) -> bytes:
        self._meta(file_id)
        return (self.dir / f"{file_id}.data").read_bytes()

    def delete(self, file_id: str) -> dict[str, Any]:
        path = self._meta(file_id)
        path.unlink()  # the metadata first: a crash leaves data that start-up sweeps
        (self.dir / f"{file_id}.data").unlink(missing_ok=True)
        fsync_dir(self.dir)
        return {"id": file_id, "object": "file", "deleted": True}

    def list(self, purpose: str | None = None) -> list[dict[str, Any]]:
        objs = [json.loads(p.read_bytes()) for p in self.dir.glob("*.json")]
        objs = [o for o in objs if purpose is None or o["purpose"] == purpose]
        return sorted(objs, key=lambda o: (o["created_at"], o["id"]))


def check_upload(upload: Upload, limits: BatchLimits) -> tuple[str, bytes, str]:
    """(filename, data, purpose) of a valid batch upload; 400/413 naming the limit."""
    purpose = upload.fields.get("purpose")
    if purpose not in UPLOAD_PURPOSES:
        raise bad_request(
            f"purpose must be one of {list(UPLOAD_PURPOSES)}, got {purpose!r}", "purpose"
        )
    if upload.data is None:
        raise bad_request("the upload has no 'file' part", "file")
    if len(upload.data) > limits.max_file_bytes:
        raise APIError(
            413, f"the file has {len(upload.data)} bytes, above this server's limit of "
            f"{limits.max_file_bytes} (--max-batch-file-bytes)", param="file",
            code="file_too_large",
        )  # fmt: skip
    # not parsed here (a job's validation says which line is wrong, as OpenAI's does): counted
    lines = sum(1 for line in upload.data.splitlines() if line.strip())
    if lines > limits.max_file_lines:
        raise bad_request(
            f"the file has {lines} lines, above this server's limit of "
            f"{limits.max_file_lines} (--max-batch-file-lines)",
            "file",
        )
    return upload.filename or "upload.jsonl", upload.data, purpose
